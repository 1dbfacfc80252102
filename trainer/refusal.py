"""A request the coordinator will not serve, with the gRPC status code that says why."""

from __future__ import annotations

import grpc


class Refusal(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
