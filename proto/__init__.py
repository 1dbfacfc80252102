"""The coordinator-worker wire contract, generated from ``proto/dilocox.proto``.

The generated modules are build outputs (``make stubs``), not sources. The protocol's size limits
below are plain constants, importable without them (the pure codec, ``trainer.codec.wire``, needs only
those); ``pb``, ``pb_grpc``, ``PROTOCOL_VERSION`` and ``SERVICE_NAME`` load the stubs on first use,
and without them fail with a message that says how to make them.
"""

from __future__ import annotations

import enum
from typing import Any

# grpcio refuses received messages over 4 MiB by default; every bulk transfer is chunked well below.
CHUNK_BYTES: int = 1 << 20
MAX_MESSAGE_BYTES: int = 4 << 20
# Options of every channel and server of the protocol: message size limits on both sides.
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)



class Encoding(enum.IntEnum):
    """How a payload travels: the .proto's ``Encoding``, number for number (a unit test checks)."""

    UNSPECIFIED = 0
    DENSE_F32 = 1
    LOWRANK_INT4 = 2  # compressed by trainer.codec, any kind (the codec header names each tensor's)
    HELD = 3  # a global state the fetching worker already holds: the header alone


class WorkerPhase(enum.IntEnum):
    """Where a worker is in its round: the .proto's ``WorkerPhase``, number for number."""

    UNSPECIFIED = 0
    STARTING = 1
    JOINED = 2  # the coordinator's, on Join
    WAITING = 3
    TRAINING = 4
    PUSHING = 5
    ABANDONED = 6
    DONE = 7

    @property
    def label(self) -> str:
        return self.name.lower()


# Calls acting for a worker carry its id and the session token of its latest Join as metadata.
METADATA_WORKER = "dilocox-worker"
METADATA_SESSION = "dilocox-session-bin"


def session_metadata(worker_id: str, token: bytes) -> tuple[tuple[str, str | bytes], ...]:
    """The metadata a worker's calls carry after Join."""
    return ((METADATA_WORKER, worker_id), (METADATA_SESSION, token))


# What a worker may say in a heartbeat (JOINED is the coordinator's to set).
HEARTBEAT_PHASES = frozenset(WorkerPhase) - {WorkerPhase.UNSPECIFIED, WorkerPhase.JOINED}
PUSH_ENCODINGS = (Encoding.DENSE_F32, Encoding.LOWRANK_INT4)

__all__ = ["Encoding", "WorkerPhase", "HEARTBEAT_PHASES", "PUSH_ENCODINGS", "METADATA_WORKER", "METADATA_SESSION",
           "session_metadata", "pb", "pb_grpc", "PROTOCOL_VERSION", "SERVICE_NAME", "CHUNK_BYTES", "MAX_MESSAGE_BYTES", "CHANNEL_OPTIONS"]


def _stubs() -> dict[str, Any]:
    try:
        from proto import dilocox_pb2 as pb
        from proto import dilocox_pb2_grpc as pb_grpc
    except ImportError as exc:  # pragma: no cover - exercised only on a broken checkout
        raise ImportError(
            "gRPC stubs are missing: run `make stubs` (or `make demo` / `make test`, which do it) "
            "to generate proto/dilocox_pb2.py from proto/dilocox.proto"
        ) from exc
    return {"pb": pb, "pb_grpc": pb_grpc, "PROTOCOL_VERSION": int(pb.PROTOCOL_VERSION_CURRENT),
            "SERVICE_NAME": pb.DESCRIPTOR.services_by_name["Coordinator"].full_name}


def __getattr__(name: str) -> Any:
    if name in ("pb", "pb_grpc", "PROTOCOL_VERSION", "SERVICE_NAME"):
        values = _stubs()
        globals().update(values)  # later lookups find them directly
        return values[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
