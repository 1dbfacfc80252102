"""Inner-state commitments stored by CID every K rounds, so that a replay needs at most K rounds.

Every push names σ = sha256 of the worker's inner state at the round's start
(trainer.runtime.inner.inner_state_digest: one byte-deterministic safetensors file,
trainer.codec.wire.encode_params, of its AdamW tensors and error feedback). Those bytes are an object
of the run's store whose CID digest is σ itself, so the manifest's ``state`` already names the
object, and every report's signature over the manifest covers it. With ``rounds.state_every`` = K,
on every round r with r % K == 0 each worker whose state is not fresh sends those bytes with its
push (stage 0's slice, for a worker of several stages: its stages' states together), and the
coordinator checks and stores them. The audit's replay (audit.replay) then starts a worker's chain
at its latest contribution whose state is stored (or fresh): at most K rounds back, instead of the
worker's whole history, and the honest replay distance, which grows along a chain, stays bounded.

The bytes are hostile input: at most ``state_limit`` bytes, their sha256 must be σ (the coordinator
reassembles them against it), they are decoded by the wire codec (never unpickled) and must name
exactly the tensors a worker's state can hold (``check_inner_state``): for each parameter p of the
model either none or all of ``exp_avg.p``, ``exp_avg_sq.p`` (float32, p's shape) and ``step.p``
(a float32 scalar, a whole number ≥ 1, the same for every p), and, with a compressed uplink only,
``error.p`` (float32, p's shape); every value finite.
"""

from __future__ import annotations

import hashlib
import math

import torch

from storage_client import CID, Codec
from trainer.codec.wire import Layout, Params, WireError, decode_params
from trainer.runtime.inner import FRESH_STATE, inner_state_bytes

# Room for the safetensors header (names, shapes, offsets) per tensor, beyond the tensors' bytes.
_HEADER_BYTES_PER_TENSOR = 512
_ADAMW = ("exp_avg", "exp_avg_sq")


class StateError(ValueError):
    """Stored or pushed inner-state bytes that are not a worker's inner state (the message says why)."""


def state_due(state_every: int, round_: int) -> bool:
    """Whether round ``round_``'s pushes carry their inner state (``rounds.state_every`` = K > 0)."""
    return state_every > 0 and round_ % state_every == 0


def commitment(state_every: int, round_: int, adamw: Params, errors: Params) -> tuple[str, bytes]:
    """The digest of the inner state round ``round_`` starts from (its AdamW and error feedback), and
    its bytes when the round uploads them (``state_due``, unless the state is fresh); else b""."""
    raw = inner_state_bytes(adamw, errors)
    digest = hashlib.sha256(raw).hexdigest()
    return digest, raw if state_due(state_every, round_) and digest != FRESH_STATE else b""


def state_cid(digest: str) -> CID:
    """The store's name for the inner state whose sha256 (hex, a manifest participant's ``state``) is ``digest``."""
    return CID(Codec.RAW, bytes.fromhex(digest))


def state_limit(layout: Layout) -> int:
    """The most bytes an inner state of a model of ``layout`` can take: three float32 tensors of each
    parameter's shape (two moments and an error buffer), a step, and a header."""
    numel = sum(math.prod(shape) for _, shape in layout.values())
    return 4 * (3 * numel + len(layout)) + _HEADER_BYTES_PER_TENSOR * 4 * len(layout)


def check_inner_state(state: Params, layout: Layout, compressed: bool) -> None:
    """Refuse (StateError, naming the first fault) a state that a worker of a model of ``layout``
    could not hold; see the module doc."""
    steps: set[float] = set()
    known = set()
    for name, (_, shape) in layout.items():
        present = [key for key in (*_ADAMW, "step") if f"{key}.{name}" in state]
        if present and len(present) != 3:
            raise StateError(f"inner state: parameter {name[:120]} has {', '.join(present)} but not all of "
                             f"exp_avg, exp_avg_sq and step")
        wanted = {f"{key}.{name}": tuple(shape) for key in _ADAMW if present}
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
        raise StateError(f"inner state: AdamW step counts {sorted(steps)[:4]} are not one whole number >= 1")


def decode_inner_state(data: bytes, layout: Layout, compressed: bool) -> Params:
    """The state in ``data`` (bytes whose digest was already checked), decoded and checked."""
    try:
        state = decode_params(data)
    except WireError as exc:
        raise StateError(f"inner state: {str(exc)[:300]}") from None
    check_inner_state(state, layout, compressed)
    return state


def split_inner_state(state: Params) -> tuple[Params, Params]:
    """(AdamW state by ``trainer.runtime.inner.adamw_state``'s names, error feedback by parameter name)."""
    adamw = {k: v for k, v in state.items() if not k.startswith("error.")}
    errors = {k[len("error."):]: v for k, v in state.items() if k.startswith("error.")}
    return adamw, errors
