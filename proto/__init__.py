"""The coordinator-worker wire contract, generated from ``proto/dilocox.proto``.

The generated modules are build outputs (``make stubs``), not sources; importing this package
without them fails with a message that says how to make them.
"""

from __future__ import annotations

try:
    from proto import dilocox_pb2 as pb
    from proto import dilocox_pb2_grpc as pb_grpc
except ImportError as exc:  # pragma: no cover - exercised only on a broken checkout
    raise ImportError(
        "gRPC stubs are missing: run `make stubs` (or `make demo` / `make test`, which do it) "
        "to generate proto/dilocox_pb2.py from proto/dilocox.proto"
    ) from exc

PROTOCOL_VERSION: int = pb.PROTOCOL_VERSION_CURRENT
SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name

# grpcio refuses received messages over 4 MiB by default; every bulk transfer is chunked well below.
CHUNK_BYTES: int = 1 << 20
MAX_MESSAGE_BYTES: int = 4 << 20
# Options of every channel and server of the protocol: message size limits on both sides.
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)

__all__ = ["pb", "pb_grpc", "PROTOCOL_VERSION", "SERVICE_NAME", "CHUNK_BYTES", "MAX_MESSAGE_BYTES", "CHANNEL_OPTIONS"]
