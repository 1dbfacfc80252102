"""proto.Encoding and proto.WorkerPhase mirror the .proto's enums number for number, so code that
must import without the generated stubs (the codec, the config, the audit) speaks the same wire."""

from __future__ import annotations

from proto import HEARTBEAT_PHASES, PUSH_ENCODINGS, Encoding, WorkerPhase, pb


def test_the_python_enums_are_the_protos() -> None:
    assert {e.name: e.value for e in Encoding} == {
        name.removeprefix("ENCODING_"): number for name, number in pb.Encoding.items()}
    assert {p.name: p.value for p in WorkerPhase} == {
        name.removeprefix("WORKER_PHASE_"): number for name, number in pb.WorkerPhase.items()}


def test_what_a_worker_may_send() -> None:
    assert WorkerPhase.JOINED not in HEARTBEAT_PHASES and WorkerPhase.UNSPECIFIED not in HEARTBEAT_PHASES
    assert set(PUSH_ENCODINGS) == {Encoding.DENSE_F32, Encoding.LOWRANK_INT4}  # HELD is a fetch's only
