"""The rules of aggregation: the checks each pushed update passes, the clip and the robust means.

Nothing enters the average unless it passed every check below; each failure names what was wrong
so the worker (and the operator reading the coordinator's log) can tell a bug from an attack.

Checks, in the order they run (cheap ones first, before a byte is decoded):
  1. declared layout: the same tensor names as the model, each with its dtype and shape;
  2. payload: exactly the declared number of bytes, hashing to the declared sha256;
  3. decoded tensors: exactly the declared layout (the header cannot lie about the bytes);
  4. every value finite;
  5. L2 norm of the whole update at most ``bound``.

Mean (see trainer.rounds.outer for the outer step that follows):

    Δ⁽ʳ⁾ = (1 / |Sᵣ|) Σ_{i∈Sᵣ} Δᵢ⁽ʳ⁾,  summed in sorted worker-id order,

so the result does not depend on the order in which updates arrived and any replica, or an
auditor holding the stored updates, re-derives it bit for bit.

Robust aggregation: clipping to a multiple of the median honest norm
--------------------------------------------------------------------

The bound of check 5 is derived from the worst case an inner loop can reach and sits far above what
honest workers actually send (docs/measurements.md), so it is only a coarse pre-check. What enters the mean is
bounded against the round's own updates (``aggregate``), with c = ``rounds.clip_multiple`` and
K = ``rounds.clip_history_rounds``:

    nᵢ   = ‖Δᵢ⁽ʳ⁾‖₂                       (``exact_norm``: correctly rounded, the same on every CPU)
    ρ̃⁽ʳ'⁾ = lower median of {‖Δⱼ⁽ʳ'⁾‖₂ : j ∈ S_r'}   (``round_norm``: one value per earlier round, from
                                           its stored updates alone)
    R⁽ʳ⁾ = {nᵢ : i ∈ Sᵣ} ∪ {ρ̃⁽ʳ'⁾ : r−K ≤ r' < r}    (a multiset)
    ρ⁽ʳ⁾ = R⁽ʳ⁾₍⌊(|R|−1)/2⌋₎             the lower median (the smaller middle value when |R| is even)
    τ⁽ʳ⁾ = c · ρ⁽ʳ⁾
    sᵢ   = min(1, τ⁽ʳ⁾ / nᵢ)              computed in float64, applied as one float32 multiply
    Δ⁽ʳ⁾ = (1 / |Sᵣ|) Σ_{i∈Sᵣ} sᵢ·Δᵢ⁽ʳ⁾      (an update with sᵢ = 1 is not multiplied at all)

Breakdown: ρ can exceed every honest norm only if dishonest norms fill more than half of R
(strictly: at least |R| − ⌊(|R|−1)/2⌋ of them), so while honest norms are a strict majority of R,
every update enters with norm ≤ c · max honest norm, i.e. at most c times an honest update's
influence on the mean. With two workers, one of them dishonest, the lower median is the smaller
norm: a scaled-up update is clipped to c times an honest one. The K previous rounds enter as one
value each, their own lower median ρ̃ (recomputed by an auditor from the stored updates alone, no
recursion through earlier thresholds): a dishonest minority of a round cannot raise its ρ̃, so a
persistent attacker's raw norms never reach the history (taking every earlier norm in, as a first
version did, let a scaled update raise its own later thresholds: docs/robustness.md).
They guard rounds with one or two participants. Deflation is easier: norms at least ⌈|R|/2⌉ of R that are tiny drag ρ
down and shrink honest updates, which slows training but never moves the model further than an
honest update would. The direction of a clipped update is not judged: an update of norm ≤ c·ρ
pointing the wrong way still counts: screening by effect (``rounds.screen_margin``, off by
default; trainer.coordinator.screening) refuses an update that raises the held-out loss
of the round's start checkpoint by more than the margin on batches the coordinator draws.

c = 0 turns clipping off (the plain mean); otherwise 1 ≤ c ≤ 100, 2 by default (the spread of one
round's honest norms is measured in docs/measurements.md).

Robust mean: trimmed mean or coordinate-wise median
---------------------------------------------------

The clip bounds how far one update moves the model, not where it moves it. ``rounds.aggregator``
replaces the mean of the clipped updates uᵢ = sᵢ·Δᵢ⁽ʳ⁾ by a statistic taken coordinate by
coordinate. With n = |Sᵣ|, the uᵢ stacked in sorted worker-id order and sorted along the worker
dimension (a stable sort), u₍₁₎ⱼ ≤ … ≤ u₍ₙ₎ⱼ are coordinate j's n values, and β = ``rounds.trim_fraction``:

    mean          Δ⁽ʳ⁾ⱼ = (1 / n) Σ_{i∈Sᵣ} uᵢⱼ                       (above; the default)
    trimmed_mean  b = ⌊β·n⌋
                  Δ⁽ʳ⁾ⱼ = (1 / (n − 2b)) Σ_{k=b+1}^{n−b} u₍ₖ₎ⱼ        summed k = b+1, b+2, …, n−b in that
                                                                  order, one float32 add at a time,
                                                                  then one division by n − 2b
    median        Δ⁽ʳ⁾ⱼ = u₍⌊(n+1)/2⌋₎ⱼ                              the lower median: the smaller middle
                                                                  value when n is even

Every step is elementwise (the sort, the adds, the division), so the bits depend neither on the
order in which updates arrived nor on the thread count, and the audit re-derives them. The median
does no arithmetic at all: each coordinate is a value some worker sent (after its clip). With b = 0
(n < 1/β: with β = 0.2, fewer than 5 updates) the trimmed mean is the mean, computed by the mean's
own code, so it gives the mean's bits.

Breakdown, per coordinate: the trimmed mean's Δ⁽ʳ⁾ⱼ stays within the range of the honest values of
coordinate j while at most b of the n updates are dishonest (each kept value has b + 1 values,
itself included, at or below it and b + 1 at or above it, so an honest value bounds it from each
side), and b + 1 dishonest updates can place it anywhere their clip allows; the lower median
tolerates ⌈n/2⌉ − 1 (with n = 2 none: it is the coordinate-wise minimum, which one update drags as
low as its clip allows). Within the honest range a dishonest update still chooses, coordinate by
coordinate, which honest extreme to pull towards; the clip above still bounds its norm. On honest
rounds both rules cost accuracy: the median of n = 2 is biased low (the minimum of two values), and
every trimmed value is information thrown away; benchmarks/robustness.py measures both, with and
without an attacker (docs/robustness.md).

``aggregate`` is the only place Δ⁽ʳ⁾ is computed: the coordinator calls it when a round closes and
``audit.rederive`` calls it again, each with the run's ``rounds`` section.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping, Sequence

import torch

from proto import Encoding
from trainer.codec import CompressedPayload, CompressionError
from trainer.codec.wire import Layout, Params, WireError, decode_params, layout_of
from trainer.config import AGGREGATORS, RoundConfig, RunConfig
from trainer.rounds.update_source import DenseUpdate, UpdateSource, dense, source_of


class InvalidUpdate(ValueError):
    """A pushed update that must not enter the average; the message names the problem."""


def _describe(spec: tuple[str, tuple[int, ...]]) -> str:
    return f"{spec[0]}{list(spec[1])}"


def check_layout(declared: Layout, expected: Layout) -> None:
    missing = sorted(set(expected) - set(declared))
    unexpected = sorted(set(declared) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing}")
        if unexpected:
            parts.append(f"unexpected tensors {unexpected}")
        raise InvalidUpdate("tensor names do not match the model: " + ", ".join(parts))
    for name in sorted(expected):
        if declared[name][0] != expected[name][0]:
            raise InvalidUpdate(
                f"tensor {name}: dtype {declared[name][0]}, expected {expected[name][0]}"
            )
        if tuple(declared[name][1]) != tuple(expected[name][1]):
            raise InvalidUpdate(
                f"tensor {name}: shape {list(declared[name][1])}, expected {list(expected[name][1])}"
            )


def decode_update(payload: bytes, declared: Layout) -> Params:
    try:
        tensors = decode_params(payload)
    except WireError as exc:
        raise InvalidUpdate(str(exc)) from exc
    actual = layout_of(tensors)
    if actual != declared:
        differing = sorted(
            name for name in set(actual) | set(declared) if actual.get(name) != declared.get(name)
        )
        name = differing[0]
        got = _describe(actual[name]) if name in actual else "absent"
        said = _describe(declared[name]) if name in declared else "absent"
        raise InvalidUpdate(f"payload disagrees with its header at tensor {name}: {got} vs {said}")
    return tensors


def check_finite(update: Params) -> None:
    for name in sorted(update):
        t = update[name]
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            count = int(bad.sum())
            kinds = []
            if bool(torch.isnan(t).any()):
                kinds.append("NaN")
            if bool(torch.isinf(t).any()):
                kinds.append("Inf")
            raise InvalidUpdate(f"tensor {name} has {count} non-finite value(s) ({'/'.join(kinds)})")


def l2_norm(update: Params | UpdateSource) -> float:
    source = source_of(update)
    return math.sqrt(sum(float(source.tensor(name).double().pow(2).sum()) for name in source.names()))


def norm_bound(cfg: RunConfig, n_params: int) -> float:
    """The largest pseudo-gradient norm a correct worker can plausibly produce.

    An AdamW step moves each coordinate by about lr (|m̂/√v̂| ≲ 1, plus lr·wd·|θ| of decay), so
    after H steps ‖Δ‖₂ ≲ H·lr·√P. A factor of 10 leaves room for Adam's early transients; an
    explicit ``rounds.max_update_norm`` overrides the derivation.
    """
    if cfg.rounds.max_update_norm > 0:
        return cfg.rounds.max_update_norm
    return 10.0 * cfg.inner.steps * cfg.inner.lr * (1.0 + cfg.inner.weight_decay) * math.sqrt(n_params)


def check_norm(update: Params | UpdateSource, bound: float) -> float:
    norm = l2_norm(update)
    if norm > bound:
        raise InvalidUpdate(f"update L2 norm {norm:.4g} exceeds the bound {bound:.4g}")
    return norm


@dataclass(frozen=True)
class CheckedUpdate:
    """A pushed update that passed checks 3-5: the compact form the coordinator holds until the
    round closes (trainer.rounds.update_source) and its ``exact_norm``, computed once."""

    source: UpdateSource
    norm: float


def checked_update(payload: bytes, declared: Layout, bound: float, *, encoding: str = Encoding.DENSE_F32,
                   codec_header: Mapping[str, Any] | None = None) -> CheckedUpdate:
    """Checks 3-5, for a payload whose declared layout (1) and digest (2) already passed, one dense
    tensor at a time: a compressed payload is validated against its codec header (factor shapes,
    rank, group scales, packed lengths) before anything is decompressed, then each tensor it
    reconstructs to is checked and dropped; the update is kept as its packed tensors."""
    if encoding == Encoding.LOWRANK_INT4:
        try:
            source: UpdateSource = CompressedPayload.parse(payload, codec_header or {}, declared)
        except CompressionError as exc:
            raise InvalidUpdate(f"compressed update refused: {exc}") from exc
    else:
        source = DenseUpdate(decode_update(payload, declared))
    nonzero, squares, exact = False, 0.0, []
    for name in source.names():
        t = source.tensor(name)
        check_finite({name: t})
        nonzero = nonzero or bool(t.any())
        squares += float(t.double().pow(2).sum())
        exact.append(_exact_square_sum(t))
    if not nonzero:
        raise InvalidUpdate("the update is all zeros: it carries no training")
    if math.sqrt(squares) > bound:
        raise InvalidUpdate(f"update L2 norm {math.sqrt(squares):.4g} exceeds the bound {bound:.4g}")
    return CheckedUpdate(source, math.sqrt(math.fsum(exact)))


def validate_payload(payload: bytes, declared: Layout, bound: float, *, encoding: str = Encoding.DENSE_F32,
                     codec_header: Mapping[str, Any] | None = None) -> Params:
    """``checked_update``'s checks; returns the dense update whole."""
    return dense(checked_update(payload, declared, bound, encoding=encoding, codec_header=codec_header).source)


# --------------------------------------------------------------------------------- robust mean


def exact_norm(update: Params | UpdateSource) -> float:
    """‖Δ‖₂, the same bits on every CPU: each float32 value squared in float64 is exact, and
    ``math.fsum`` rounds each tensor's sum of squares correctly whatever the order (torch's own
    reductions do not fix their summation order across CPU capabilities); the per-tensor sums are
    added with fsum in sorted name order. One dense tensor at a time."""
    source = source_of(update)
    return math.sqrt(math.fsum(_exact_square_sum(source.tensor(name)) for name in source.names()))


def _exact_square_sum(t: torch.Tensor) -> float:
    """Σ xⱼ² correctly rounded to float64: the value ``math.fsum`` of the exactly squared values gives.

    For float32 (and the 16-bit floats, exact in float32) in integers, without a Python float per
    element: from a value's bits, biased exponent E and 23 fraction bits f, xⱼ = ±mⱼ·2^(max(E,1)−150)
    with mⱼ = f + 2²³ (f for a subnormal, E = 0), so xⱼ² = mⱼ²·2^(2(max(E,1)−150)); mⱼ² < 2⁴⁸ is split
    into 24-bit halves whose per-exponent sums (int64 ``scatter_add``, exact whatever the order)
    cannot overflow below 2³⁹ elements; Python's integers then add the 254 per-exponent sums exactly
    and one correctly rounded division gives the float64. float64 values (whose squares are not
    exact) and non-finite ones take ``math.fsum`` itself."""
    flat = t.detach().reshape(-1)
    if (flat.dtype not in (torch.float32, torch.float16, torch.bfloat16) or not 0 < flat.numel() < 1 << 39
            or not bool(torch.isfinite(flat).all())):
        return math.fsum(flat.double().square().tolist())
    bits = flat.float().contiguous().view(torch.int32)
    biased = (bits >> 23) & 0xFF
    fraction = (bits & 0x7FFFFF).to(torch.int64)
    m = torch.where(biased > 0, fraction | (1 << 23), fraction)
    square = m * m  # < 2⁴⁸, exact
    slot = biased.clamp_min(1).to(torch.int64)  # 1..254: the exponent max(E, 1)
    high = torch.zeros(256, dtype=torch.int64).scatter_add_(0, slot, square >> 24)
    low = torch.zeros(256, dtype=torch.int64).scatter_add_(0, slot, square & ((1 << 24) - 1))
    total = 0  # Σ_E (H_E·2²⁴ + L_E)·2^(2(E−1)): the sum is total·2^(2(1−150))
    for k, (h, lo) in enumerate(zip(high.tolist(), low.tolist())):
        if h or lo:
            total += ((h << 24) + lo) << (2 * (k - 1))
    return total / (1 << 298)


def round_norm(norms: Sequence[float]) -> float:
    """ρ̃⁽ʳ⁾: what a closed round contributes to the next K rounds' clip thresholds, the lower median
    of its updates' ``exact_norm``s."""
    return lower_median(norms)


def updates_round_norm(updates: Mapping[str, Params | UpdateSource]) -> float:
    """ρ̃ of a closed round from its updates: ``round_norm`` of their ``exact_norm``s (worker
    order), what the round adds to the clip history of the next K rounds. The coordinator's resume,
    checkpoint rebuilding and the audit all take it from here."""
    return round_norm([exact_norm(updates[w]) for w in sorted(updates)])


def lower_median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("no norms to take a median of")
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


# The rule with clipping off and the plain mean: what ``audit.rederive`` assumes unless told.
PLAIN_MEAN = RoundConfig(clip_multiple=0.0, aggregator="mean")


def trimmed_count(n: int, trim_fraction: float) -> int:
    """b = ⌊β·n⌋ values dropped from each end of every coordinate, β taken as the decimal the
    configuration states (its repr: 0.29 × 100 is 29, not the 28.99… of binary floating point)."""
    return min(math.floor(Fraction(repr(trim_fraction)) * n), (n - 1) // 2)


def combine(values: Sequence[torch.Tensor], aggregator: str, trim_fraction: float) -> torch.Tensor:
    """One tensor of Δ⁽ʳ⁾ from that tensor of each clipped update, ``values`` in sorted worker-id
    order (the module docstring's rules, coordinate by coordinate). The first value may be
    modified in place (the mean accumulates into it)."""
    if not values:
        raise ValueError("cannot aggregate a round with no accepted updates")
    if aggregator not in AGGREGATORS:
        raise ValueError(f"unknown aggregator {aggregator!r}: one of {', '.join(AGGREGATORS)}")
    n = len(values)
    b = trimmed_count(n, trim_fraction)
    if aggregator == "mean" or (aggregator == "trimmed_mean" and b == 0):
        total = values[0]
        for t in values[1:]:
            total.add_(t)
        return total.div_(n)
    ordered = torch.sort(torch.stack(list(values)), dim=0, stable=True).values
    if aggregator == "median":
        return ordered[(n - 1) // 2].clone()
    total = ordered[b].clone()
    for k in range(b + 1, n - b):
        total.add_(ordered[k])
    return total.div_(n - 2 * b)


@dataclass(frozen=True)
class Aggregation:
    """How a round's Δ⁽ʳ⁾ is reached: every update's norm, the clip threshold τ, each scale sᵢ, the
    rule. Known before any tensor is combined (the norms are computed at acceptance)."""

    norms: dict[str, float]
    threshold: float  # τ; inf when clipping is off
    scales: dict[str, float]
    aggregator: str = "mean"  # rounds.aggregator
    trimmed: int = 0  # b, the values dropped from each end of every coordinate (trimmed_mean)
    trim_fraction: float = 0.0

    @property
    def clipped(self) -> list[str]:
        return sorted(w for w, s in self.scales.items() if s < 1.0)

    def tensor(self, name: str, updates: Mapping[str, UpdateSource]) -> torch.Tensor:
        """Δ⁽ʳ⁾'s tensor ``name``: that tensor of each update, decoded in sorted worker order, each
        clipped (sᵢ rounded once to float32, one multiply; sᵢ = 1 is not multiplied), combined."""
        values = []
        for worker in sorted(updates):
            t = updates[worker].tensor(name)
            if self.scales[worker] < 1.0:
                t = t.mul(torch.tensor(self.scales[worker], dtype=torch.float32))
            values.append(t)
        return combine(values, self.aggregator, self.trim_fraction)


@dataclass(frozen=True)
class Aggregated(Aggregation):
    """An ``Aggregation`` with the whole Δ⁽ʳ⁾ it gives (``aggregate``)."""

    delta: Params = None  # type: ignore[assignment]  # always given by aggregate


def plan(norms: Mapping[str, float], rounds: RoundConfig, history: Sequence[float] = ()) -> Aggregation:
    """τ⁽ʳ⁾ and each sᵢ from the updates' ``exact_norm``s and ρ̃ of the previous K rounds."""
    if not norms:
        raise ValueError("cannot aggregate a round with no accepted updates")
    if rounds.aggregator not in AGGREGATORS:
        raise ValueError(f"unknown aggregator {rounds.aggregator!r}: one of {', '.join(AGGREGATORS)}")
    threshold = math.inf
    scales = {w: 1.0 for w in norms}
    if rounds.clip_multiple > 0:
        threshold = rounds.clip_multiple * lower_median([*norms.values(), *history])
        for worker in sorted(norms):
            if norms[worker] > threshold:
                scales[worker] = threshold / norms[worker]
    trimmed = trimmed_count(len(norms), rounds.trim_fraction) if rounds.aggregator == "trimmed_mean" else 0
    return Aggregation(dict(norms), threshold, scales, rounds.aggregator, trimmed, rounds.trim_fraction)


def norms_of(updates: Mapping[str, UpdateSource], norms: Mapping[str, float] | None = None) -> dict[str, float]:
    """Each update's ``exact_norm``: from ``norms`` where known, else computed."""
    return {w: (norms[w] if norms is not None and w in norms else exact_norm(u)) for w, u in updates.items()}


def aggregate(updates: Mapping[str, Params | UpdateSource], rounds: RoundConfig, history: Sequence[float] = (),
              norms: Mapping[str, float] | None = None) -> Aggregated:
    """Δ⁽ʳ⁾ whole, by the rules of the module docstring and the run's ``rounds`` section
    (clip_multiple, aggregator, trim_fraction): each update clipped, then the robust mean of the
    clipped updates. ``history``: ρ̃ of each of the previous K rounds (``round_norm``); ``norms``: the
    updates' ``exact_norm``s when already known (recomputed if not). trainer.rounds.transition computes the
    same Δ⁽ʳ⁾ one tensor at a time (``plan``, then ``Aggregation.tensor``)."""
    if not updates:
        raise ValueError("cannot aggregate a round with no accepted updates")
    sources = {w: source_of(u) for w, u in updates.items()}
    how = plan(norms_of(sources, norms), rounds, history)
    first = sources[sorted(sources)[0]]
    delta = {name: how.tensor(name, sources) for name in first.names()}
    return Aggregated(**{f: getattr(how, f) for f in ("norms", "threshold", "scales", "aggregator", "trimmed",
                                                     "trim_fraction")}, delta=delta)
