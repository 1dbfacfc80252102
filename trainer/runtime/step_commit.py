"""Step commitments: a worker commits to its training state every s inner steps, and a check that
narrows a false claim to one segment, then to one step.

Why. A worker's round is H inner steps (trainer.runtime.inner). Replayed in the worker's own CPU
kernels it re-derives bit for bit (audit.replay_env), but a worker on an accelerator, or on a CPU
capability the auditor lacks, can only be replayed in other kernels, where the honest distance of
a whole round's update grows with H (AdamW amplifies the rounding of every step) and the audit falls
back to a 0.05 relative tolerance within which an update scaled by 1.01, 1% noise, 10% skipped
steps or bfloat16 compute pass. Optimistic verification (Gensyn's Verde, arXiv:2502.19405;
proof-of-learning, Jia et al., arXiv:2103.05633) bounds the replay by a segment of s steps instead
of H: the honest cross-kernel distance of s steps is measured and small, so the tolerance can be
small too.

The training state after j inner steps of round r on shard k:

    S_j = (θ_j, O_j, (r, k, j))      θ_j: the parameters; O_j: the inner optimiser's state (AdamW's
                                     exp_avg, exp_avg_sq, step; Muon's momentum, step), named as
                                     trainer.runtime.inner.optimizer_state names them

Leaf. ``leaf_digest(S_j)`` = sha256 of one byte-deterministic safetensors file (the bytes of
``trainer.codec.wire.encode_params``) of the tensors ``param.<p>`` = θ_j[p], ``exp_avg.<p>`` …
(O_j), and the int64 scalars ``position.round``, ``position.shard``, ``position.step``. The file is
what a worker reveals: the store's CID of those bytes IS the leaf digest, so a revealed state needs
no rule beyond its CID to be tied to its leaf. It is hashed (and written) a tensor, at most 8 MiB,
at a time (``step_state_chunks``), never whole in memory. The error feedback of a compressed uplink
is not in a leaf: no inner step reads or writes it (the round-level commitment,
trainer.runtime.inner.inner_state_digest, covers it).

Tree. The leaves are the states at j ∈ L(H, s) = {0, s, 2s, …} ∪ {H} (``leaf_steps``: the last step
is a leaf even when s ∤ H), in that order, n = |L| of them, and

    leaf node   h(d)        = sha256(0x00 ‖ d)                       d: a leaf digest (32 bytes)
    inner node  h(l, r)     = sha256(0x01 ‖ l ‖ r)
    MTH([d])    = h(d);     MTH(D[0:n]) = h(MTH(D[0:k]), MTH(D[k:n])), k the largest power of 2 < n

the tree of RFC 6962 (Certificate Transparency, §2.1): an odd node is PROMOTED (carried up
unchanged), never duplicated, so no two leaf lists share a root (duplication, Bitcoin's rule, lets
[a, b, c] and [a, b, c, c] collide), and the two prefixes make a leaf never verify as an inner node
(second preimage). The root, the H and s it is over, go in the worker's update header
(``StepCommitment``). An inclusion proof of leaf i is its audit path, of exactly ``proof_length(i, n)``
≤ ⌈log₂ n⌉ hashes (n ≤ ``MAX_LEAVES``): a proof of another length is refused before any hashing.

Recording. ``InnerLoop.run(..., observer=StepCommitter(...))`` hands the committer the model and the
optimiser at j = 0 and after every step; at each j ∈ L it hashes S_j (and with a directory writes
its file, the same bytes hashed as they are written), and keeps only the 32-byte digests. On a CUDA
device θ_j and O_j are on the GPU: they are copied to the host 8 MiB at a time through one reused
buffer (``_pieces``), so no full device→host copy is held, but every byte still crosses the bus once
per leaf (240 MB at 20M parameters: about 10-20 ms at PCIe 4/5 rates, against about 0.2-0.3 s of
sha256 on one host core, which is what a leaf costs; docs/step_commitments.md). sha256 is kept
because the store names objects by it.

The check (an auditor that challenges a contribution; the worker answers with revealed files):

1. Anchors (free): the revealed S_0 has θ_0 = the round's start (bit for bit) and O_0 the committed
   round-start state, and fl32(θ_0 − θ_H) = Δ, the pushed update, bit for bit (the worker computed
   Δ with that very subtraction; compressed: θ_0 − θ_H is what the codec check takes as Δ). So a lie
   about the update cannot stay out of the trajectory: it must show in some segment.
2. Segments: segment i is [j, j + s) with j = L[i]; its check replays those steps from the revealed
   S_j in the AUDITOR'S kernels (``SegmentReplayer``, a fresh InnerLoop with
   ``load_optimizer_state``) on the round's batches j..j+s−1 (trainer.data.corpus.round_batches, the
   worker's) and compares the result S'_{j+s} with the revealed S_{j+s}:

       d_θ = ‖θ'_{j+s} − θ_{j+s}‖ / ‖θ_{j+s} − θ_j‖          (relative to the segment's movement)
       d_m = ‖m' − m‖ / ‖m‖   for each moment m of O          (exp_avg, exp_avg_sq; momentum)

   and the step counters must agree. A segment is consistent when d_θ ≤ SEGMENT_TOLERANCE and every
   d_m ≤ MOMENT_TOLERANCE, tolerances that are MARGIN × the largest honest distance measured across
   kernels (benchmarks/step_segments.py, docs/step_commitments.md).
3. Which segments. Each segment's check stands alone (it starts at a state the worker committed
   to), so consistency is not monotone in the segment index and there is nothing to bisect for a
   single auditor: a cheat that lies at step t makes every later segment consistent with its own
   committed states, and only the segment holding t is inconsistent. Verde's bisection (log₂ n
   rounds) needs two parties that claim DIFFERENT trajectories from one start and compute bit for
   bit alike; across kernels no two honest parties do, and an auditor in the worker's own kernels
   already replays the whole round at d = 0 (audit.replay_env). So ``first_bad_segment`` checks
   segments in ascending order and stops at the first inconsistent one, over all n − 1 segments
   (cost: H replayed steps and n revealed states, the whole round, bounded per segment) or over a
   sample (``sample_segments``: the last segment always, where any lie about the pushed update that
   the anchors force into the trajectory lands when it is not spread out, plus k − 1 drawn after
   the root is committed; cost k·s replayed steps and 2k revealed states; a lie confined to one
   segment of n − 1 is caught with probability k/(n − 1), a lie in a fraction f of them with
   1 − C((1−f)(n−1), k)/C(n−1, k)). What passes: a lie spread so thin that every segment stays
   within its tolerance, at most SEGMENT_TOLERANCE of each segment's movement.
4. One step. For the first inconsistent segment the worker reveals S_j, S_{j+1}, …, S_{j+s},
   recomputed in its own kernels from its committed S_j (``SegmentReplayer.trajectory``), and
   ``narrow_to_step`` replays each step alone: the first step t whose one-step distance exceeds
   STEP_TOLERANCE (and MOMENT_TOLERANCE) is named. A per-step reveal whose first state is not the
   committed S_j is refused; one whose last state is not the committed S_{j+s} bit for bit
   (kernels that are not deterministic, or a lie) is reported with its distance from it.

Revealed states are hostile input: ``decode_step_state`` bounds the bytes (``step_state_limit``),
decodes with safetensors (never unpickling), and refuses anything but exactly the model's
``param.<p>``, an optimiser state of the run's optimiser (the rule of
trainer.runtime.state_commit.check_inner_state, without error feedback), and the three positions,
all finite; every refusal is a ``StepStateError`` (a ValueError) of one line that never quotes the
input.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.nn as nn

from storage_client import strict_json
from trainer.codec.wire import Layout, Params, WireError, decode_params, dtype_name, encode_params, layout_of
from trainer.config import InnerConfig, InnerOptimizer, ModelConfig
from trainer.model.params import params_of
from trainer.model.stages import hidden_matrix
from trainer.runtime.inner import STATE_KEYS, InnerLoop, load_optimizer_state, optimizer_state
from trainer.runtime.staged import StagedArithmetic
from trainer.runtime.state_commit import StateError, check_inner_state

# Chosen from measured honest cross-kernel distances (benchmarks/step_segments.py; the tables are in
# docs/step_commitments.md: the demo GPT, a worker on avx2 with 1 thread replayed on default with 1
# thread): the largest honest d_θ was 4.3e-4 for one step, 4.5e-4 for s = 5, 9.3e-4 for s = 10, and
# d_m 1.3e-6 (s = 5) and 1.3e-5 (s = 10). Each tolerance is at least MARGIN (the audit's
# FALLBACK_MARGIN) times its measured maximum at s ≤ DEFAULT_EVERY; a cheat's d_θ falls about as 1/s
# (a fixed lie over a longer movement) while the honest one barely grows, so s = 5 rather than 10:
# ×1.01 and 1% noise are then 27× over SEGMENT_TOLERANCE (11× at s = 10 would be too close). A leaf
# costs 13% of an inner step at 20M parameters on 1 thread, 2.6% at s = 5 (≤ 5% from s = 3).
DEFAULT_EVERY = 5
MARGIN = 4.0
SEGMENT_TOLERANCE = 2e-3  # d_θ of one segment of up to DEFAULT_EVERY steps (4 × 4.5e-4, rounded up)
STEP_TOLERANCE = 2e-3  # d_θ of one step (4 × 4.3e-4, rounded up)
MOMENT_TOLERANCE = 1e-4  # d_m of each optimiser moment, one segment of s ≤ 10 or one step (7.7 × 1.3e-5)

MAX_LEAVES = 1 << 20  # leaves of one round's tree (H/s + 2 ≤ this): proofs of at most 20 hashes
LEAF_PREFIX = b"\x00"
NODE_PREFIX = b"\x01"
DIGEST_BYTES = 32
PARAM_PREFIX = "param."
POSITION_NAMES = ("position.round", "position.shard", "position.step")
MAX_POSITION = 1 << 40  # a round, shard or step index beyond this is not a position
_PIECE = 8 << 20  # bytes of one tensor hashed or written at a time
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,512}")
_MOMENTS = ("exp_avg", "exp_avg_sq", "momentum")
_HEADER_BYTES_PER_TENSOR = 512  # room for a tensor's safetensors header entry
_DTYPES = {"int64": "I64", "float32": "F32"}  # a leaf's dtypes, in safetensors' data order


class StepCommitError(ValueError):
    """A step commitment, proof or revealed state that does not hold (one line, no input quoted)."""


class StepStateError(StepCommitError):
    """Revealed bytes that are not a training state of this model at the claimed position."""


class ProofError(StepCommitError):
    """A Merkle inclusion proof that does not verify against the committed root."""


# ----------------------------------------------------------------------------------------------------
# The leaves: which steps, and the bytes of a state.


def leaf_steps(steps: int, every: int) -> list[int]:
    """The steps j whose state is a leaf of a round of ``steps`` (H) inner steps committed every
    ``every`` (s): 0, s, 2s, … below H, and H."""
    if steps < 1 or every < 1:
        raise StepCommitError("a step commitment needs H >= 1 steps and s >= 1")
    out = list(range(0, steps, every)) + [steps]
    if len(out) > MAX_LEAVES:
        raise StepCommitError(f"{len(out)} leaves, more than the {MAX_LEAVES} a round may have")
    return out


def segment_bounds(steps: int, every: int) -> list[tuple[int, int]]:
    """The segments [j, j') between consecutive leaves, in order."""
    leaves = leaf_steps(steps, every)
    return list(zip(leaves[:-1], leaves[1:]))


def position_tensors(round_: int, shard: int, step: int) -> Params:
    return {"position.round": torch.tensor(round_, dtype=torch.int64),
            "position.shard": torch.tensor(shard, dtype=torch.int64),
            "position.step": torch.tensor(step, dtype=torch.int64)}


def step_state_tensors(params: Mapping[str, torch.Tensor], optimizer: Params, round_: int, shard: int,
                       step: int) -> Params:
    """The tensors of a leaf: θ as ``param.<p>``, the optimiser's state by its own names, the position.
    No copy is made: the tensors are ``params``' and ``optimizer``'s own (on any device)."""
    out: Params = {f"{PARAM_PREFIX}{name}": p.detach() for name, p in params.items()}
    out.update(optimizer)
    out.update(position_tensors(round_, shard, step))
    return out


def _leaf_layout_ok(tensors: Mapping[str, torch.Tensor]) -> bool:
    return sys.byteorder == "little" and all(
        dtype_name(t.dtype) in _DTYPES and _PLAIN_NAME.fullmatch(name) for name, t in tensors.items())


def _ordered(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """safetensors' data order: int64 tensors, then float32, each by name (pinned against
    ``encode_params`` by tests/unit/test_step_commit.py)."""
    return sorted(tensors, key=lambda n: (0 if tensors[n].dtype == torch.int64 else 1, n))


def _header(tensors: Mapping[str, torch.Tensor]) -> bytes:
    entries, offset = [], 0
    for name in _ordered(tensors):
        t = tensors[name]
        size = t.element_size() * t.numel()
        entries.append(f'"{name}":{{"dtype":"{_DTYPES[dtype_name(t.dtype)]}","shape":[{",".join(map(str, t.shape))}],'
                       f'"data_offsets":[{offset},{offset + size}]}}')
        offset += size
    header = ("{" + ",".join(entries) + "}").encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header


def _pieces(t: torch.Tensor, staging: list[torch.Tensor]) -> Iterator[memoryview]:
    """``t``'s bytes, at most ``_PIECE`` at a time, each valid until the next is asked for: views of
    ``t`` itself on the CPU; on an accelerator, copies into one reused host buffer (``staging``)."""
    flat = t.detach().reshape(-1)
    if flat.device.type == "cpu":
        data = flat.contiguous().view(torch.uint8)
        for start in range(0, data.numel(), _PIECE):
            yield memoryview(data[start:start + _PIECE].numpy())
        return
    data = flat.contiguous().view(torch.uint8)
    if not staging:
        staging.append(torch.empty(_PIECE, dtype=torch.uint8, pin_memory=torch.cuda.is_available()))
    buffer = staging[0]
    for start in range(0, data.numel(), _PIECE):
        piece = data[start:start + _PIECE]
        buffer[:piece.numel()].copy_(piece)
        yield memoryview(buffer[:piece.numel()].numpy())


def step_state_chunks(tensors: Mapping[str, torch.Tensor]) -> Iterator[bytes | memoryview]:
    """``encode_params(tensors)`` as consecutive pieces, one tensor (at most 8 MiB of it) at a time:
    the canonical header, then the data in safetensors' order. Each piece is valid until the next
    is asked for (hash it or write it, then move on)."""
    if not _leaf_layout_ok(tensors):
        yield encode_params(dict(tensors))
        return
    yield _header(tensors)
    staging: list[torch.Tensor] = []
    for name in _ordered(tensors):
        yield from _pieces(tensors[name], staging)


def step_state_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The whole file (for a reveal by value and for tests; a worker writes it with ``write_step_state``)."""
    return b"".join(bytes(c) for c in step_state_chunks(tensors))


def leaf_digest(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """sha256 of the state's file, streamed: the leaf digest, and the CID digest of the revealed file."""
    digest = hashlib.sha256()
    for chunk in step_state_chunks(tensors):
        digest.update(chunk)
    return digest.digest()


def write_step_state(path: Path, tensors: Mapping[str, torch.Tensor]) -> bytes:
    """Write the state's file at ``path`` (atomically: a temporary name, then a rename) and return its
    digest, hashed from the same pieces as they are written."""
    digest = hashlib.sha256()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for chunk in step_state_chunks(tensors):
            digest.update(chunk)
            f.write(chunk)
    os.replace(tmp, path)
    return digest.digest()


@dataclass(frozen=True)
class StepState:
    """A training state S_j: θ_j by parameter name, the optimiser's state by its names, the position."""

    round: int
    shard: int
    step: int
    params: Params
    optimizer: Params

    def tensors(self) -> Params:
        return step_state_tensors(self.params, self.optimizer, self.round, self.shard, self.step)

    def digest(self) -> bytes:
        return leaf_digest(self.tensors())

    def to_bytes(self) -> bytes:
        return step_state_bytes(self.tensors())


def capture(model: nn.Module, optimizer: torch.optim.Optimizer, round_: int, shard: int, step: int) -> StepState:
    """A copy of the training state (on the CPU) of ``model`` and ``optimizer`` after ``step`` steps."""
    return StepState(round_, shard, step, {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()},
                     optimizer_state(model, optimizer))


# ----------------------------------------------------------------------------------------------------
# A revealed state, as hostile input.


def step_state_limit(layout: Layout) -> int:
    """The most bytes a revealed state of a model of ``layout`` can take: θ and two moments of each
    parameter, a step count each, the three positions, and a header."""
    numel = sum(math.prod(shape) for _, shape in layout.values())
    tensors = 4 * len(layout) + len(POSITION_NAMES)
    return 4 * (3 * numel + len(layout)) + 8 * len(POSITION_NAMES) + 8 + _HEADER_BYTES_PER_TENSOR * tensors


def _expected(layout: Layout, optimizer: InnerOptimizer) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every name a state of this model may hold, with its dtype and shape."""
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, (_, shape) in layout.items():
        out[f"{PARAM_PREFIX}{name}"] = (torch.float32, tuple(shape))
        moments = ("momentum",) if optimizer == "muon" and hidden_matrix(name, tuple(shape)) else ("exp_avg", "exp_avg_sq")
        for key in moments:
            out[f"{key}.{name}"] = (torch.float32, tuple(shape))
        out[f"step.{name}"] = (torch.float32, ())
    for name in POSITION_NAMES:
        out[name] = (torch.int64, ())
    return out


def check_step_state(tensors: Mapping[str, torch.Tensor], layout: Layout, optimizer: InnerOptimizer = "adamw",
                     *, round_: int | None = None, shard: int | None = None, step: int | None = None) -> StepState:
    """The ``StepState`` of ``tensors`` (decoded from a revealed file) if they are one of a model of
    ``layout`` trained with ``optimizer`` at the given position (None: any); else StepStateError."""
    expected = _expected(layout, optimizer)
    unknown = [name for name in tensors if name not in expected]
    if unknown:
        raise StepStateError(f"revealed step state: {len(unknown)} tensor(s) no training state of this model holds")
    for name, (dtype, shape) in layout.items():
        if f"{PARAM_PREFIX}{name}" not in tensors:
            raise StepStateError(f"revealed step state: no {PARAM_PREFIX}{name[:140]}")
    for name in POSITION_NAMES:
        if name not in tensors:
            raise StepStateError(f"revealed step state: no {name}")
    for name, t in tensors.items():
        dtype, shape = expected[name]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise StepStateError(f"revealed step state: {name[:160]} is not {dtype_name(dtype)} of shape {shape}")
        if dtype == torch.float32 and not bool(torch.isfinite(t).all()):
            raise StepStateError(f"revealed step state: {name[:160]} is not finite")
    position = [int(tensors[name]) for name in POSITION_NAMES]
    if not all(0 <= v < MAX_POSITION for v in position):
        raise StepStateError("revealed step state: a position out of range")
    for want, got, what in zip((round_, shard, step), position, ("round", "shard", "step")):
        if want is not None and want != got:
            raise StepStateError(f"revealed step state: not the {what} it was asked for")
    state = StepState(position[0], position[1], position[2],
                      {name: tensors[f"{PARAM_PREFIX}{name}"] for name in layout},
                      {name: t for name, t in tensors.items()
                       if not name.startswith(PARAM_PREFIX) and name not in POSITION_NAMES})
    counts = {float(t) for name, t in state.optimizer.items() if name.startswith("step.")}
    if len(counts) > 1 or any(c < 1 or c != int(c) for c in counts):
        raise StepStateError("revealed step state: the optimiser's step counts are not one whole number >= 1")
    if counts and counts.pop() < state.step:
        raise StepStateError("revealed step state: fewer optimiser steps than its position")
    if state.step > 0 and not state.optimizer:
        raise StepStateError("revealed step state: a state after a step without an optimiser state")
    try:
        check_inner_state(state.optimizer, layout, compressed=False, optimizer=optimizer)
    except StateError as exc:  # only the all-or-none rule is left to fail: it names the model's parameter
        raise StepStateError(f"revealed step state: {str(exc).removeprefix('inner state: ')[:300]}") from None
    return state


def decode_step_state(data: bytes | bytearray, layout: Layout, optimizer: InnerOptimizer = "adamw", *,
                      round_: int | None = None, shard: int | None = None, step: int | None = None) -> StepState:
    """A revealed state's bytes (at most ``step_state_limit``), decoded by safetensors (never
    unpickled) and checked (``check_step_state``)."""
    limit = step_state_limit(layout)
    if len(data) > limit:
        raise StepStateError(f"revealed step state of {len(data)} bytes: more than the {limit} a state of this model takes")
    try:
        tensors = decode_params(data)
    except WireError:
        raise StepStateError("revealed step state: not a valid safetensors file") from None
    return check_step_state(tensors, layout, optimizer, round_=round_, shard=shard, step=step)


# ----------------------------------------------------------------------------------------------------
# The Merkle tree (RFC 6962: odd nodes promoted).


def leaf_hash(digest: bytes) -> bytes:
    if len(digest) != DIGEST_BYTES:
        raise ProofError(f"a leaf digest is {DIGEST_BYTES} bytes")
    return hashlib.sha256(LEAF_PREFIX + digest).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(NODE_PREFIX + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two below ``n`` (n ≥ 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def _subtree(hashes: Sequence[bytes]) -> bytes:
    if len(hashes) == 1:
        return hashes[0]
    k = _split(len(hashes))
    return node_hash(_subtree(hashes[:k]), _subtree(hashes[k:]))


def merkle_root(digests: Sequence[bytes]) -> bytes:
    """The root over the leaf digests, in leaf order."""
    if not 1 <= len(digests) <= MAX_LEAVES:
        raise ProofError(f"a tree has 1 to {MAX_LEAVES} leaves")
    return _subtree([leaf_hash(d) for d in digests])


def proof_length(index: int, count: int) -> int:
    """Hashes in the inclusion proof of leaf ``index`` of ``count``: the depth of that leaf."""
    if not (1 <= count <= MAX_LEAVES and 0 <= index < count):
        raise ProofError(f"leaf index out of range for a tree of {count} leaves")
    depth = 0
    while count > 1:
        k = _split(count)
        index, count = (index, k) if index < k else (index - k, count - k)
        depth += 1
    return depth


def inclusion_proof(digests: Sequence[bytes], index: int) -> list[bytes]:
    """The audit path of leaf ``index``: sibling subtree hashes from the leaf up."""
    proof_length(index, len(digests))
    hashes = [leaf_hash(d) for d in digests]
    path: list[bytes] = []
    lo, hi = 0, len(hashes)
    while hi - lo > 1:
        k = _split(hi - lo)
        if index < lo + k:
            path.append(_subtree(hashes[lo + k:hi]))
            hi = lo + k
        else:
            path.append(_subtree(hashes[lo:lo + k]))
            lo = lo + k
    return path[::-1]


def verify_inclusion(root: bytes, digest: bytes, index: int, count: int, proof: Sequence[bytes]) -> None:
    """ProofError unless ``digest`` is leaf ``index`` of the ``count``-leaf tree whose root is ``root``.
    A proof of another length than that leaf's depth is refused before any hashing."""
    want = proof_length(index, count)
    if len(proof) != want:
        raise ProofError(f"an inclusion proof of leaf {index} of {count} has {want} hashes")
    if len(root) != DIGEST_BYTES or any(len(p) != DIGEST_BYTES for p in proof):
        raise ProofError(f"a root and a proof's hashes are {DIGEST_BYTES} bytes each")
    # The path from the root down: at each level, which side the leaf is on.
    sides: list[bool] = []  # True: the leaf is in the left subtree
    lo, hi = 0, count
    while hi - lo > 1:
        k = _split(hi - lo)
        sides.append(index < lo + k)
        lo, hi = (lo, lo + k) if index < lo + k else (lo + k, hi)
    h = leaf_hash(digest)
    for sibling, left in zip(proof, reversed(sides)):
        h = node_hash(h, sibling) if left else node_hash(sibling, h)
    if h != root:
        raise ProofError(f"leaf {index} of {count} does not verify against the committed root")


@dataclass(frozen=True)
class StepCommitment:
    """What a push's header carries: the root over the leaves of a round of ``steps`` (H) inner steps
    committed every ``every`` (s) steps; ``leaves`` (the digests) stay with the worker."""

    root: bytes
    every: int
    steps: int
    leaves: tuple[bytes, ...] = field(default=(), compare=False)

    @property
    def count(self) -> int:
        return len(leaf_steps(self.steps, self.every))

    def index(self, step: int) -> int:
        """The leaf index of step ``step`` (StepCommitError when it is not a leaf)."""
        leaves = leaf_steps(self.steps, self.every)
        if step not in leaves:
            raise StepCommitError(f"step {step} is not a leaf of a round of {self.steps} steps every {self.every}")
        return leaves.index(step)

    def proof(self, step: int) -> list[bytes]:
        return inclusion_proof(self.leaves, self.index(step))

    def verify(self, step: int, digest: bytes, proof: Sequence[bytes]) -> None:
        verify_inclusion(self.root, digest, self.index(step), self.count, proof)

    def to_json(self) -> dict[str, object]:
        return {"root": self.root.hex(), "every": self.every, "steps": self.steps}

    @classmethod
    def from_json(cls, obj: object) -> StepCommitment:
        """A header's commitment, checked: a 64-hex root, 1 ≤ s, 1 ≤ H ≤ 1,000,000 (InnerConfig's
        range), at most MAX_LEAVES leaves."""
        if not isinstance(obj, dict) or set(obj) != {"root", "every", "steps"}:
            raise StepCommitError("a step commitment is an object of root, every and steps")
        root, every, steps = obj["root"], obj["every"], obj["steps"]
        if not (isinstance(root, str) and re.fullmatch(r"[0-9a-f]{64}", root)):
            raise StepCommitError("a step commitment's root is 64 lowercase hex digits")
        if type(every) is not int or type(steps) is not int or not (1 <= steps <= 1_000_000 and 1 <= every):
            raise StepCommitError("a step commitment's every and steps are whole numbers, 1 <= steps <= 1000000")
        leaf_steps(steps, every)
        return cls(bytes.fromhex(root), every, steps)

    def __str__(self) -> str:
        return strict_json(self.to_json())


# ----------------------------------------------------------------------------------------------------
# Recording, as an InnerLoop observer.


class StepCommitter:
    """``InnerLoop.run``'s observer that commits to the states at the leaves of a round of ``steps``
    inner steps, every ``every``: their digests, and with ``directory`` their files there (named
    ``leaf_name``) for a later reveal. ``commitment()`` once the round is done."""

    def __init__(self, every: int, steps: int, round_: int, shard: int, directory: Path | None = None) -> None:
        self.every, self.steps, self.round, self.shard = every, steps, round_, shard
        self.wanted = leaf_steps(steps, every)
        self.directory = directory
        self.digests: dict[int, bytes] = {}
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def leaf_name(step: int) -> str:
        return f"step-{step:07d}.safetensors"

    def __call__(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if step > self.steps:
            raise StepCommitError(f"step {step} of a round committed for {self.steps} steps")
        if step % self.every and step != self.steps:
            return
        tensors = step_state_tensors(dict(model.named_parameters()), _live_state(model, optimizer),
                                     self.round, self.shard, step)
        if self.directory is not None:
            self.digests[step] = write_step_state(self.directory / self.leaf_name(step), tensors)
        else:
            self.digests[step] = leaf_digest(tensors)

    def commitment(self) -> StepCommitment:
        missing = [j for j in self.wanted if j not in self.digests]
        if missing:
            raise StepCommitError(f"the round ended before step {missing[0]}: {len(missing)} leaves never recorded")
        leaves = tuple(self.digests[j] for j in self.wanted)
        return StepCommitment(merkle_root(leaves), self.every, self.steps, leaves)


def _live_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> Params:
    """``optimizer_state``'s names for the optimiser's own tensors, without copying them (hashed where
    they are; the step counts are CPU scalars)."""
    out: Params = {}
    for name, p in model.named_parameters():
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if key in STATE_KEYS:
                out[f"{key}.{name}"] = value.detach().reshape(value.shape)
    return out


# ----------------------------------------------------------------------------------------------------
# The check: one segment, the first bad one, one step.


def _sq(t: torch.Tensor) -> float:
    return float(t.double().pow(2).sum())


def _norm(values: Iterable[float]) -> float:
    return math.sqrt(math.fsum(values))


@dataclass(frozen=True)
class SegmentDistance:
    """How far a replay of steps [start, end) lands from the revealed state at ``end``: d_θ
    (movement-relative), d_m of each moment the state holds, and whether the step counters agree."""

    start: int
    end: int
    theta: float
    moments: dict[str, float]
    step_counts_agree: bool

    def within(self, tolerance: float, moment_tolerance: float = MOMENT_TOLERANCE) -> bool:
        return (self.step_counts_agree and self.theta <= tolerance
                and all(d <= moment_tolerance for d in self.moments.values()))

    @property
    def worst_moment(self) -> float:
        return max(self.moments.values(), default=0.0)


def state_distance(start: StepState, replayed: StepState, claimed: StepState) -> SegmentDistance:
    """``SegmentDistance`` of ``replayed`` (the auditor's S'_end) from ``claimed`` (the revealed S_end),
    both from ``start``. Missing or extra optimiser tensors are an infinite distance."""
    if set(replayed.params) != set(claimed.params) or set(replayed.optimizer) != set(claimed.optimizer):
        keys = {k.split(".", 1)[0] for k in set(replayed.optimizer) | set(claimed.optimizer)} & set(_MOMENTS)
        return SegmentDistance(start.step, claimed.step, math.inf, {k: math.inf for k in keys}, False)
    off = _norm(_sq(replayed.params[n].double() - claimed.params[n].double()) for n in claimed.params)
    moved = _norm(_sq(claimed.params[n].double() - start.params[n].double()) for n in claimed.params)
    theta = off / moved if moved else (0.0 if off == 0 else math.inf)
    moments: dict[str, float] = {}
    for key in _MOMENTS:
        names = [n for n in claimed.optimizer if n.startswith(f"{key}.")]
        if not names:
            continue
        d = _norm(_sq(replayed.optimizer[n].double() - claimed.optimizer[n].double()) for n in names)
        m = _norm(_sq(claimed.optimizer[n]) for n in names)
        moments[key] = d / m if m else (0.0 if d == 0 else math.inf)
    agree = all(torch.equal(replayed.optimizer[n], claimed.optimizer[n]) for n in claimed.optimizer
                if n.startswith("step."))
    return SegmentDistance(start.step, claimed.step, theta, moments, agree and replayed.step == claimed.step)


class SegmentReplayer:
    """Replays inner steps from a revealed state in this process's kernels: one model and one inner
    loop (``InnerLoop``, ``load_optimizer_state``) reused for every segment."""

    def __init__(self, model_cfg: ModelConfig, inner_cfg: InnerConfig, seed: int = 0,
                 staged: StagedArithmetic | None = None) -> None:
        from trainer.model.gpt import build_model

        self.loop = InnerLoop(build_model(model_cfg, seed), inner_cfg)  # its weights are overwritten
        self.staged = staged

    def replay(self, start: StepState, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> StepState:
        """S'_{j+len(batches)}: the steps on ``batches`` from ``start``."""
        return self.trajectory(start, batches, every=len(batches))[-1]

    def trajectory(self, start: StepState, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                   every: int = 1) -> list[StepState]:
        """The states start.step, start.step + every, …, and the last, from ``start`` (every = 1: the
        per-step states a worker reveals for a bad segment, recomputed in its own kernels)."""
        if not batches:
            raise StepCommitError("a segment has at least one step")
        load_optimizer_state(self.loop.model, self.loop.optimizer, start.optimizer)
        states: list[StepState] = []
        last = len(batches)

        def observe(j: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
            if j % every == 0 or j == last:
                states.append(capture(model, optimizer, start.round, start.shard, start.step + j))

        self.loop.run(start.params, batches, staged=self.staged, observer=observe)
        return states

    def distance(self, start: StepState, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 end: StepState) -> SegmentDistance:
        if end.step - start.step != len(batches):
            raise StepCommitError(f"a segment from step {start.step} to {end.step} takes {end.step - start.step} batches")
        return state_distance(start, self.replay(start, batches), end)


def segment_distance(model_cfg: ModelConfig, inner_cfg: InnerConfig, start: StepState,
                     batches: Sequence[tuple[torch.Tensor, torch.Tensor]], end: StepState) -> SegmentDistance:
    """One segment's check in a fresh InnerLoop (``SegmentReplayer`` reuses one for many)."""
    return SegmentReplayer(model_cfg, inner_cfg).distance(start, batches, end)


def anchor_faults(first: StepState, last: StepState, start: Params, delta: Params | None = None,
                  round_start_optimizer: Params | None = None) -> list[str]:
    """What the revealed S_0 and S_H contradict (empty: nothing): θ_0 must be the round's ``start``
    bit for bit, O_0 the committed round-start optimiser state (when given), and fl32(θ_0 − θ_H) the
    pushed dense update ``delta`` bit for bit (the worker's own subtraction, trainer.runtime.inner)."""
    faults = []
    if first.step != 0:
        faults.append("the first revealed state is not step 0")
    if set(first.params) != set(start) or any(not torch.equal(first.params[n], start[n]) for n in start):
        faults.append("the state at step 0 is not the round's start")
    if round_start_optimizer is not None and (
            set(first.optimizer) != set(round_start_optimizer)
            or any(not torch.equal(first.optimizer[n], round_start_optimizer[n]) for n in round_start_optimizer)):
        faults.append("the optimiser state at step 0 is not the committed one")
    if delta is not None and (set(delta) != set(first.params) or set(last.params) != set(first.params) or any(
            not torch.equal(first.params[n] - last.params[n], delta[n]) for n in delta)):
        faults.append("the update is not the state at step 0 minus the state at the last step")
    return faults


def sample_segments(count: int, k: int, seed: int) -> list[int]:
    """Segment indices to check, ascending: the last (``count`` − 1) always, and k − 1 others drawn
    with ``seed`` (drawn after the root is committed; all of them when k ≥ count)."""
    if count < 1:
        raise StepCommitError("a round has at least one segment")
    if k >= count:
        return list(range(count))
    others = random.Random(seed).sample(range(count - 1), max(0, k - 1))
    return sorted(set(others) | {count - 1})


@dataclass(frozen=True)
class SegmentAudit:
    """``first_bad_segment``'s answer: the first inconsistent segment's index (None: all checked are
    consistent), and the distances of the segments checked, in order (replayed steps: their spans)."""

    bad: int | None
    checked: list[tuple[int, SegmentDistance]]

    @property
    def replayed_steps(self) -> int:
        return sum(d.end - d.start for _, d in self.checked)


def first_bad_segment(check: Callable[[int], SegmentDistance], segments: Iterable[int], *,
                      tolerance: float = SEGMENT_TOLERANCE,
                      moment_tolerance: float = MOMENT_TOLERANCE) -> SegmentAudit:
    """Check ``segments`` (indices, ascending; all of them, or ``sample_segments``) with ``check``
    (index → its ``SegmentDistance``, e.g. a ``SegmentReplayer`` on the revealed states) and stop at
    the first out of tolerance. Why in order and not by bisection, and what it costs: module doc."""
    checked: list[tuple[int, SegmentDistance]] = []
    for index in segments:
        d = check(index)
        checked.append((index, d))
        if not d.within(tolerance, moment_tolerance):
            return SegmentAudit(index, checked)
    return SegmentAudit(None, checked)


@dataclass(frozen=True)
class NarrowedStep:
    """``narrow_to_step``'s answer: ``step`` (t: the step taking S_{t−1} to S_t) whose one-step replay
    leaves the tolerance first (None: none does), each step's distance, and whether the per-step
    reveal ends at the committed state (``end_distance``: 0 bit for bit)."""

    step: int | None
    distances: list[SegmentDistance]
    end_distance: float
    note: str = ""


def narrow_to_step(replayer: SegmentReplayer, states: Sequence[StepState],
                   batches: Sequence[tuple[torch.Tensor, torch.Tensor]], committed_start: bytes,
                   committed_end: StepState | None = None, *, tolerance: float = STEP_TOLERANCE,
                   moment_tolerance: float = MOMENT_TOLERANCE) -> NarrowedStep:
    """Name the first step of a bad segment whose one-step replay is out of tolerance, from the
    worker's per-step states ``states`` (S_j … S_{j+s}) and the segment's ``batches``. ``states[0]``
    must be the committed leaf (digest ``committed_start``), else StepCommitError."""
    if len(states) != len(batches) + 1 or any(b.step != a.step + 1 for a, b in zip(states, states[1:])):
        raise StepCommitError("a per-step reveal is one state per step of its segment, consecutive")
    if states[0].digest() != committed_start:
        raise StepCommitError("a per-step reveal does not start at the committed state of its segment")
    end_distance = 0.0
    if committed_end is not None and states[-1].digest() != committed_end.digest():
        end_distance = state_distance(states[0], states[-1], committed_end).theta
    distances: list[SegmentDistance] = []
    for k, batch in enumerate(batches):
        d = replayer.distance(states[k], [batch], states[k + 1])
        distances.append(d)
        if not d.within(tolerance, moment_tolerance):
            return NarrowedStep(states[k + 1].step, distances, end_distance)
    return NarrowedStep(None, distances, end_distance,
                        "every step is within the step tolerance: a deviation spread over the segment's steps")
