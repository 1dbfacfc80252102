"""The coordinator's domain types: plain data, no protobuf, no gRPC.

What a push header says (:class:`UpdateHeader`), what the open round holds (:class:`OpenRound`,
:class:`Accepted`, :class:`StageSlices`, each accepted update's :class:`JournalEntry`), what each
registered worker last said (:class:`WorkerState`), what is served (:class:`GlobalState`) and what
is reported (:class:`RoundSummary`, :class:`StatusView`). trainer.coordinator.service translates
between these and the wire.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from proto import Encoding, WorkerPhase
from storage_client import CID, Kernels, Manifest, Participant, from_e6
from trainer.codec.wire import Params
from trainer.rounds.transition import OuterState
from trainer.rounds.update_source import MergedUpdate, UpdateSource


@dataclass(frozen=True)
class UpdateHeader:
    """The first message of a push: everything checked before a payload byte is read."""

    protocol_version: int
    run_id: str
    worker_id: str
    round: int
    stage: int
    num_stages: int
    encoding: int  # an Encoding number; anything else is refused by name
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]  # declared layout: (name, dtype, shape)
    payload_size: int
    payload_sha256: str
    train_loss: float
    tokens: int
    inner_steps: int
    base_params_cid: str
    base_bytes_received: int
    signature: bytes
    compression_header: bytes
    inner_state_sha256: str
    inner_state_size: int = 0  # bytes of the inner state sent after the payload (trainer.runtime.state_commit)
    cpu_capability: str = ""  # what decided the inner loop's floating point (trainer.runtime.kernels); "" for none
    intra_op_threads: int = 0
    data_parallel: int = 0  # the worker's data-parallel ranks (trainer.runtime.island); 0 or 1: one process

    @property
    def what(self) -> str:
        return "update" if self.num_stages <= 1 else f"stage {self.stage} of {self.num_stages} slice"


@dataclass(frozen=True)
class JournalEntry:
    """One accepted update (or stage slice) of the open round, as <run>/pending keeps it: what its
    manifest participant will say. Tokens and inner steps are the config's, not the worker's."""

    cid: str
    train_loss_e6: int
    tokens: int
    inner_steps: int
    bytes_sent: int
    bytes_received: int
    shard: int
    state: str | None  # inner_state_sha256 the push names (every slice, with several stages); None in old journals
    base_params_cid: str | None = None  # stage slices: the base every slice of a worker must share
    kernels: Kernels | None = None  # what decided its floating point, as pushed (checks.pushed_kernels)

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["kernels"] = None if self.kernels is None else self.kernels.to_json()
        return out

    @classmethod
    def from_json(cls, obj: Any) -> JournalEntry:
        """An entry read back from disk, its fields checked by type (a torn or edited journal is
        refused by name rather than half-used)."""
        if not isinstance(obj, dict):
            raise ValueError("a journal entry must be a JSON object")
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = obj.get(f.name)
            if f.name == "kernels":  # strictly parsed (a ManifestError is a ValueError); absent: none recorded
                values[f.name] = None if value is None else Kernels.from_json(value, "journal entry kernels")
                continue
            optional = f.name in ("state", "base_params_cid")
            kind = str if f.name in ("cid", "state", "base_params_cid") else int
            if not (isinstance(value, kind) and not isinstance(value, bool) or (optional and value is None)):
                raise ValueError(f"journal entry field {f.name!r} is missing or not a {kind.__name__}")
            values[f.name] = value
        return cls(**values)

    def participant(self, worker: str) -> Participant:
        return Participant(worker=worker, update=self.cid, train_loss_e6=self.train_loss_e6, tokens=self.tokens,
                           inner_steps=self.inner_steps, bytes_sent=self.bytes_sent,
                           bytes_received=self.bytes_received, shard=self.shard, state=self.state,
                           kernels=self.kernels)


@dataclass
class Accepted:
    """An accepted update (or stage slice) as held until the round closes: compact (a compressed
    push is kept as its packed tensors, trainer.rounds.update_source), decoded tensor by tensor at close."""

    source: UpdateSource
    entry: JournalEntry
    norm: float | None = None  # exact_norm of a whole update, computed once (trainer.rounds.aggregation)


@dataclass
class StageSlices:
    """The slices a worker of several pipeline stages has delivered so far for the open round."""

    num_stages: int
    slices: dict[int, Accepted] = field(default_factory=dict)  # by stage
    completing: bool = False  # the last slice is in: its merged update is being stored

    def merged(self) -> MergedUpdate:
        """Δ̂ᵢ: the union of the slices, in stage order."""
        return MergedUpdate([self.slices[stage].source for stage in range(self.num_stages)])

    def to_json(self) -> dict[str, Any]:
        return {"num_stages": self.num_stages,
                "slices": {str(s): a.entry.to_json() for s, a in sorted(self.slices.items())}}

    @staticmethod
    def entries_from_json(obj: Any) -> tuple[int, dict[int, JournalEntry]]:
        """``to_json``'s form read back from disk: the stage count and each stage's entry, every
        field checked (a torn or edited journal is refused by name rather than half-used)."""
        if not isinstance(obj, dict) or set(obj) != {"num_stages", "slices"}:
            raise ValueError("a stage journal entry must be {num_stages, slices}")
        num_stages, slices = obj["num_stages"], obj["slices"]
        if type(num_stages) is not int or num_stages < 2 or not isinstance(slices, dict):
            raise ValueError("a stage journal entry needs num_stages >= 2 and a slices object")
        entries: dict[int, JournalEntry] = {}
        for stage, raw in slices.items():
            if not (isinstance(stage, str) and stage.isdigit() and int(stage) < num_stages):
                raise ValueError(f"stage journal: stage {str(stage)[:20]!r} is not one of 0..{num_stages - 1}")
            entries[int(stage)] = JournalEntry.from_json(raw)
        return num_stages, entries


@dataclass
class OpenRound:
    number: int
    opened_at: float
    first_accept_at: float | None = None
    accepted: dict[str, Accepted] = field(default_factory=dict)
    partial: dict[str, StageSlices] = field(default_factory=dict)  # workers with some stage slices in
    refused: dict[str, list[str]] = field(default_factory=dict)  # every refusal, by worker
    up: dict[str, int] = field(default_factory=dict)    # wire bytes by worker, worker → coordinator
    down: dict[str, int] = field(default_factory=dict)  # and coordinator → worker
    closing: bool = False

    def first_accept(self, now: float) -> None:
        self.first_accept_at = self.first_accept_at or now


class StallWatch:
    """When the open round can never close.

    A round closes only with an accepted update (Coordinator.close_due), and a worker whose push was
    refused does not push that round again: it waits for the round to close. So once every live
    worker's push of the open round was refused, and no update or stage slice is in, nothing can
    move the run. Said once that has held for ``patience_s`` (``straggler_timeout_s``: what the
    coordinator would wait for a straggler anyway, room for a worker still starting or one coming
    back to life); a live worker without a refusal, or an accepted push, resets it."""

    def __init__(self, patience_s: float) -> None:
        self.patience_s = patience_s
        self.since: float | None = None  # when every live worker's push was first seen refused

    def check(self, r: OpenRound, alive: set[str], now: float, finished: bool) -> str | None:
        """Why round ``r`` cannot close, in one line, or None."""
        if finished or r.closing or r.accepted or r.partial or not alive or not alive <= set(r.refused):
            self.since = None
            return None
        if self.since is None:
            self.since = now
        if now - self.since < self.patience_s:
            return None
        why = "; ".join(f"{w}: {r.refused[w][0]}" for w in sorted(alive))  # our own bounded messages
        return (f"round {r.number} cannot close: every live worker's push of it was refused and none was "
                f"accepted ({why})")


@dataclass
class WorkerState:
    shard: int
    last_seen: float
    round: int = 0
    phase: WorkerPhase = WorkerPhase.JOINED
    address: str | None = None  # admitted key, when the run has a ledger


@dataclass(frozen=True)
class CompressedGlobal:
    """The compressed global update C⁽ʳ⁾ of a round, its codec header (canonical JSON) and the
    CID of θ⁽ʳ⁻¹⁾ it applies to: what a worker holding θ⁽ʳ⁻¹⁾ is sent instead of θ⁽ʳ⁾."""

    payload: bytes
    header: bytes
    base_params_cid: str
    encoding: Encoding = Encoding.LOWRANK_INT4


@dataclass(frozen=True)
class GlobalState:
    """The published global checkpoint: what FetchGlobal serves."""

    round: int
    params: Params
    momentum: Params
    payload: bytes | bytearray  # safetensors of params (sha256: the params CID); params may be views of it
    params_cid: CID
    manifest_cid: CID
    eval_loss_e6: int
    downlink: CompressedGlobal | None = None  # None when the round's update travels dense
    downlink_error: Params = field(default_factory=dict)  # e⁽ʳ⁾, part of the outer state
    # to_e6 of each held-out batch's loss, whose mean is eval_loss_e6: sent with the state, so
    # that each worker re-evaluates only its share of the batches (trainer.data.shared_eval).
    eval_losses_e6: tuple[int, ...] = ()

    @property
    def outer(self) -> OuterState:
        return OuterState(self.params, self.momentum, self.downlink_error)


@dataclass(frozen=True)
class RoundSummary:
    round: int
    manifest_cid: str
    eval_loss: float
    mean_train_loss: float  # NaN for a round without participants (genesis): null in rounds.jsonl
    participants: tuple[str, ...]
    dropped: tuple[str, ...]
    refused: tuple[str, ...]
    bytes_up: int
    bytes_down: int
    seconds: float

    @classmethod
    def of(cls, cid: CID, m: Manifest, refused: tuple[str, ...] = (), seconds: float = 0.0) -> RoundSummary:
        losses = [from_e6(p.train_loss_e6) for p in m.participants]
        return cls(
            round=m.round, manifest_cid=str(cid), eval_loss=from_e6(m.eval_loss_e6),
            mean_train_loss=sum(losses) / len(losses) if losses else float("nan"),
            participants=tuple(p.worker for p in m.participants), dropped=m.dropped,
            refused=refused, bytes_up=m.bytes_up, bytes_down=m.bytes_down, seconds=seconds,
        )


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    shard: int
    alive: bool
    round: int
    phase: WorkerPhase
    last_seen_s: float  # -1 when not heard from since a restart
    address: str = ""  # its admitted key's address; empty when the run has no ledger (or before it joined)

    @classmethod
    def of(cls, worker_id: str, state: WorkerState, alive: bool, now: float) -> WorkerView:
        seen = now - state.last_seen if math.isfinite(state.last_seen) else -1.0
        return cls(worker_id, state.shard, alive, state.round, state.phase, seen, state.address or "")


@dataclass(frozen=True)
class StatusView:
    run_id: str
    open_round: int
    total_rounds: int
    finished: bool
    workers: tuple[WorkerView, ...]
    rounds: tuple[RoundSummary, ...]
    ledger_lag_rounds: int
