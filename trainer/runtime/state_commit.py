"""Inner-state commitments stored by CID once per worker per window of K rounds: a replay needs at most K.

Every push names σ = sha256 of the worker's inner state at the round's start
(trainer.runtime.inner.inner_state_digest: one byte-deterministic safetensors file,
trainer.codec.wire.encode_params, of its AdamW tensors and error feedback). Those bytes are an object
of the run's store whose CID digest is σ itself, so the manifest's ``state`` already names the
object, and every report's signature over the manifest covers it. With ``rounds.state_every`` = K
the rounds fall into windows m = [mK, (m+1)K), and a worker sends those bytes with its push (stage
0's slice, for a worker of several stages: its stages' states together) at its FIRST counted
contribution in each window:

    due(r, p) = ⌊r/K⌋ > ⌊p/K⌋      p: the round of the worker's previous counted contribution, 0 if none

never for a fresh state (a replay starts there anyway). With every worker present every round that
is r % K == 0; a worker absent on such a round (dead, slow, joined late) uploads at its next
contribution instead, so whoever was absent when, every chain starts within its window (at a stored
or fresh state) and is at most K contributions long. The audit's replay (audit.replay) starts a
worker's chain at its latest contribution whose state is stored (or fresh), and the honest replay
distance, which grows along a chain, stays bounded.

The one rule (``state_due``) is applied by three parties, each from what it knows of p:

* the worker: its last round whose push was accepted (its inner state moves only through counted
  rounds, trainer.worker.role); after a refused push it cannot tell a refusal from a lost reply, so
  its next push sends its state whether due or not (``StateUploads``);
* the coordinator: its published manifests of the window's rounds before r (at most K − 1, in
  memory, also after a restart: ``window_contributions``). It REQUIRES the bytes when its view says
  due, and ACCEPTS bytes a worker sends unasked within a budget: at most ``MAX_STORED_PER_WINDOW``
  stored states among a worker's counted contributions of one window (the due one and one more,
  e.g. after a refused push), so a disagreement never wedges an honest worker's pushes;
* the audit: the manifests, exactly: which rounds must have stored states (audit.replay.missing_states).

The bytes are hostile input: at most ``state_limit`` bytes, their sha256 must be σ (the coordinator
spools them to a file against it, trainer.runstore.spool), they are read back a tensor at a time
(``check_state_file``: only the canonical safetensors form of their tensors, never unpickled; a
state is three times the model, and never whole in the coordinator's memory) and must name
exactly the tensors a worker's state can hold (``check_inner_state``): for each parameter p of the
model either none or all of its optimiser's tensors, ``exp_avg.p`` and ``exp_avg_sq.p`` for AdamW,
``momentum.p`` for Muon's hidden matrices (``inner.optimizer``, trainer.runtime.muon; float32, p's
shape), and ``step.p`` (a float32 scalar, a whole number ≥ 1, the same for every p), and, with a
compressed uplink only, ``error.p`` (float32, p's shape); every value finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Mapping

import torch

from storage_client import CID, Codec, Participant, Store
from trainer.codec.wire import (
    Layout,
    Params,
    WireError,
    decode_params,
    params_chunks,
    serialized_size,
    streamable,
    streamed_layout,
)
from trainer.config import InnerOptimizer
from trainer.model.stages import hidden_matrix
from trainer.runtime.inner import FRESH_STATE, inner_state_digest

# A worker's counted contributions of one window carry at most this many stored states: the one
# ``state_due`` asks for, and one sent unasked (a worker in doubt after a refused push).
MAX_STORED_PER_WINDOW = 2
# Room for the safetensors header (names, shapes, offsets) per tensor, beyond the tensors' bytes.
_HEADER_BYTES_PER_TENSOR = 512
_ADAMW = ("exp_avg", "exp_avg_sq")
_MUON = ("momentum",)


class StateError(ValueError):
    """Stored or pushed inner-state bytes that are not a worker's inner state (the message says why)."""


def state_due(state_every: int, round_: int, previous: int) -> bool:
    """Whether a worker's contribution to round ``round_`` carries its inner state (``rounds.state_every``
    = K > 0): it is the worker's first counted one in its window of K rounds, ``previous`` being the
    round of its previous counted contribution (0 if none): ⌊r/K⌋ > ⌊p/K⌋."""
    return state_every > 0 and round_ // state_every > previous // state_every


def window_contributions(state_every: int, round_: int,
                         counted: Callable[[int], Participant | None]) -> list[tuple[int, Participant]]:
    """A worker's counted contributions to the rounds of ``round_``'s window before it, [⌊r/K⌋K, r − 1]
    (round 0 is genesis), as ``counted`` (round → the worker's participant, or None) gives them: at
    most K − 1 rounds, all that ``state_due`` needs of the worker's history (any earlier p decides alike)."""
    first = max(1, round_ - round_ % state_every) if state_every > 0 else round_
    return [(r, p) for r in range(first, round_) if (p := counted(r)) is not None]


def previous_in_window(contributions: list[tuple[int, Participant]]) -> int:
    """``state_due``'s p from ``window_contributions``: the latest, or 0 when none (same verdict as any p
    before the window)."""
    return max((r for r, _ in contributions), default=0)


class StateUploads:
    """A worker's side of ``state_due``: whether its push of a round carries its inner state. p is the
    round of its last push the coordinator took (its inner state moves only through those); after a
    refused push it cannot tell a refusal from a lost reply that the coordinator counted, so its next
    push carries the state, due or not, until one that carries it (or whose state is fresh) is taken."""

    def __init__(self) -> None:
        self.last_counted = 0  # p: the round of the last push taken whole, 0 if none
        self.in_doubt = False  # a push was refused since the state was last sent
        self._pending: tuple[int, bool] | None = None  # the push under way: its round, and whether it settles a doubt

    def take(self, state_every: int, round_: int, raw: bytes) -> bytes:
        """What the push of ``round_`` sends (stage 0): ``raw``, the state's bytes (b"" when fresh),
        when due or in doubt, else b"". A push never confirmed (``counted``) was refused."""
        return raw if self.sends(state_every, round_, fresh=not raw) else b""

    def upload(self, state_every: int, round_: int, committed: Committed | None) -> StateBytes:
        """``take`` of the state ``committed`` (None: none committed, as fresh): its bytes, made as
        they are sent (``Committed.stream``), when the push carries them, else ``NO_STATE``."""
        if not self.sends(state_every, round_, fresh=committed is None or committed.fresh):
            return NO_STATE
        assert committed is not None
        return committed.stream()

    def sends(self, state_every: int, round_: int, fresh: bool) -> bool:
        """``take``'s verdict before the bytes exist: whether the push of ``round_`` carries the state,
        ``fresh`` when it is the fresh state (never sent)."""
        self.in_doubt = self.in_doubt or self._pending is not None
        upload = not fresh and (self.in_doubt or state_due(state_every, round_, self.last_counted))
        self._pending = (round_, upload or fresh)
        return upload

    def counted(self) -> None:
        """The push of the last ``take`` was taken whole by the coordinator."""
        assert self._pending is not None
        self.last_counted, settled = self._pending
        self.in_doubt, self._pending = self.in_doubt and not settled, None


@dataclass(frozen=True)
class StateBytes:
    """An inner state's bytes as a push sends them (``inner_state_bytes``'s bytes): their length, and
    for each attempt afresh the bytes a tensor (at most 8 MiB) at a time (``params_chunks``), so a
    worker never holds the file (three times its model) whole. ``NO_STATE``: a push that carries none."""

    size: int
    tensors: Params

    def chunks(self) -> Iterator[bytes]:
        if self.size:
            yield from params_chunks(self.tensors)


NO_STATE = StateBytes(0, {})


@dataclass(frozen=True)
class Committed:
    """The inner state a round starts from (its AdamW and error feedback) and its digest. The tensors
    are the worker's one copy of that state (the round's undo restores it too); nobody writes into
    them (the error feedback's buffers are replaced, never written in place: trainer.codec.feedback).
    Its bytes are made only for a push that carries them (``StateUploads.sends``), as they are sent:
    ``stream``."""

    digest: str
    adamw: Params
    errors: Params

    @property
    def fresh(self) -> bool:
        return self.digest == FRESH_STATE

    def stream(self) -> StateBytes:
        """``inner_state_bytes`` of the state, made as they are sent (``NO_STATE`` for the fresh state,
        which is never uploaded)."""
        if self.fresh:
            return NO_STATE
        tensors = {**self.adamw, **self.errors}
        return StateBytes(serialized_size(tensors), tensors)


def commitment(adamw: Params, errors: Params) -> Committed:
    """The state a round starts from, its digest hashed without its whole serialisation in memory
    (``inner_state_digest``); whether its bytes go with the push is decided when it is sent
    (``StateUploads``)."""
    return Committed(inner_state_digest(adamw, errors), adamw, errors)


def state_cid(digest: str) -> CID:
    """The store's name for the inner state whose sha256 (hex, a manifest participant's ``state``) is ``digest``."""
    return CID(Codec.RAW, bytes.fromhex(digest))


def state_stored(store: Store, p: Participant) -> bool:
    """Whether the inner state ``p`` commits to (not fresh) is in the store."""
    return p.state not in (None, FRESH_STATE) and store.has(state_cid(p.state))


def state_limit(layout: Layout) -> int:
    """The most bytes an inner state of a model of ``layout`` can take: three float32 tensors of each
    parameter's shape (two moments and an error buffer), a step, and a header."""
    numel = sum(math.prod(shape) for _, shape in layout.values())
    return 4 * (3 * numel + len(layout)) + _HEADER_BYTES_PER_TENSOR * 4 * len(layout)


def check_inner_state(state: Mapping[str, torch.Tensor], layout: Layout, compressed: bool,
                      optimizer: InnerOptimizer = "adamw") -> None:
    """Refuse (StateError, naming the first fault) a state that a worker of a model of ``layout``
    whose inner optimiser is ``optimizer`` could not hold; see the module doc."""
    steps: set[float] = set()
    known = set()
    for name, (_, shape) in layout.items():
        moments = _MUON if optimizer == "muon" and hidden_matrix(name, tuple(shape)) else _ADAMW
        present = [key for key in (*moments, "step") if f"{key}.{name}" in state]
        if present and len(present) != len(moments) + 1:
            raise StateError(f"inner state: parameter {name[:120]} has {', '.join(present)} but not all of "
                             f"{', '.join(moments)} and step")
        wanted = {f"{key}.{name}": tuple(shape) for key in moments if present}
        if present:
            wanted[f"step.{name}"] = ()
        if compressed and f"error.{name}" in state:
            wanted[f"error.{name}"] = tuple(shape)
        for key, want in wanted.items():
            value = state[key]
            if value.dtype != torch.float32 or tuple(value.shape) != want:
                raise StateError(f"inner state: {key[:140]} is {value.dtype} of shape {tuple(value.shape)}, "
                                 f"expected float32 of shape {want}")
            if not bool(torch.isfinite(value).all()):
                raise StateError(f"inner state: {key[:140]} is not finite")
        known.update(wanted)
        if present:
            steps.add(float(state[f"step.{name}"]))
    unknown = sorted(set(state) - known)
    if unknown:
        raise StateError(f"inner state: {len(unknown)} tensor(s) no worker's state holds, e.g. {unknown[0][:140]}")
    if len(steps) > 1 or any(s < 1 or s != int(s) for s in steps):
        raise StateError(f"inner state: step counts {sorted(steps)[:4]} are not one whole number >= 1")


def decode_inner_state(data: bytes, layout: Layout, compressed: bool, optimizer: InnerOptimizer = "adamw") -> Params:
    """The state in ``data`` (bytes whose digest was already checked), decoded and checked."""
    try:
        state = decode_params(data)
    except WireError as exc:
        raise StateError(f"inner state: {str(exc)[:300]}") from None
    check_inner_state(state, layout, compressed, optimizer)
    return state


class _StateFile(Mapping[str, torch.Tensor]):
    """An inner state's tensors read one at a time from its open file (``streamed_layout``'s form)
    into one buffer the size of the largest, so a check holds one tensor of the state at once and
    allocates nothing per tensor (each lookup's tensor is valid until the next lookup: it is a view
    of that buffer, and ``check_inner_state`` is done with a value before it reads another)."""

    def __init__(self, f: BinaryIO, layout: Layout, slots: dict[str, tuple[int, int]]) -> None:
        self.f, self.layout, self.slots = f, layout, slots
        self.buffer = torch.empty(max((size for _, size in slots.values()), default=0) // 4, dtype=torch.float32)

    def __getitem__(self, key: str) -> torch.Tensor:
        offset, size = self.slots[key]
        view = self.buffer[:size // 4]
        self.f.seek(offset)
        if self.f.readinto(memoryview(view.numpy()).cast("B")) != size:
            raise StateError(f"inner state: the file ends inside {key[:140]}")
        return view.view(self.layout[key][1])

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout)

    def __len__(self) -> int:
        return len(self.layout)


def check_state_file(path: Path, size: int, layout: Layout, compressed: bool,
                     optimizer: InnerOptimizer = "adamw") -> None:
    """``decode_inner_state``'s checks on the ``size`` bytes at ``path`` (their digest already
    checked), a tensor at a time: the file must be the canonical safetensors form of float32
    tensors (``trainer.codec.wire.streamed_layout``: what every worker writes for a model whose
    layout is ``streamable``); StateError naming the first fault. A model whose layout is not
    streamable has its state read whole (``decode_inner_state``)."""
    if not streamable(layout):
        decode_inner_state(path.read_bytes(), layout, compressed, optimizer)
        return
    max_header = _HEADER_BYTES_PER_TENSOR * 4 * len(layout)
    with open(path, "rb") as f:
        try:
            state_layout, slots = streamed_layout(f.read(8 + max_header), size, max_header)
        except WireError as exc:
            raise StateError(f"inner state: {str(exc)[:300]}") from None
        check_inner_state(_StateFile(f, state_layout, slots), layout, compressed, optimizer)


def split_inner_state(state: Params) -> tuple[Params, Params]:
    """(optimiser state by ``trainer.runtime.inner.optimizer_state``'s names, error feedback by parameter name)."""
    adamw = {k: v for k, v in state.items() if not k.startswith("error.")}
    errors = {k[len("error."):]: v for k, v in state.items() if k.startswith("error.")}
    return adamw, errors
