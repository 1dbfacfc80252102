"""How many inner steps each round trains: DiLoCoX's adaptive H.

DiLoCoX (arXiv:2506.21263) lowers the number of inner steps with the rank of what is sent, so that
communication (∝ rank) stays hidden behind compute (∝ H) while rounds get more frequent as fewer
bytes are needed. With H = ``inner.steps``, H_min = ``inner.min_steps``, r_max =
``compression.max_rank`` and C⁽ʳ⁻²⁾ the codec header of the compressed global update of round r−2
(trainer.codec.downlink; stored, its manifest's ``downlink`` names it):

    H_r = H                                                  r ≤ 2, or inner.adaptive_steps off,
                                                             or round r−2's update travelled dense
    ρ_r = mean over the matrices t of C⁽ʳ⁻²⁾ of  min(rank_t, r_max) / r_max
          (a matrix sent dense, kind int4, counts as 1)
    H_r = clamp(round(H·ρ_r), H_min, H)                      round half up, exact rational arithmetic

and a round's tokens follow: H_r · batch_size · block_size.

Why r−2: with the one-step-delay overlap a worker starting round r holds the global update of round
r−2 but not that of r−1; taking r−2 in every mode gives one rule that the coordinator, every worker
and the auditor evaluate, from stored bytes, before the round starts. H_r is never a worker's claim:
the coordinator checks each push against it and the audit re-derives it from the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Mapping

from storage_client import Manifest, Store
from trainer.codec import CodecHeader, CodecKind
from trainer.codec.wire import Layout, json_object
from trainer.config import RunConfig


def rank_fraction(config: RunConfig, header: CodecHeader | None) -> Fraction:
    """ρ of the module docstring: 1 without a header (or without a matrix in it)."""
    if header is None:
        return Fraction(1)
    r_max = config.compression.max_rank
    shares = [Fraction(min(entry.rank, r_max), r_max) if entry.kind == CodecKind.LOWRANK_INT4 else Fraction(1)
              for entry in header.tensors if entry.kind != CodecKind.INT8]
    return sum(shares, Fraction(0)) / len(shares) if shares else Fraction(1)


def inner_steps_for_round(config: RunConfig, round_: int, header: CodecHeader | None) -> int:
    """H_r of the module docstring; ``header`` is the codec header of round ``round_`` − 2's global
    update (None when there is none: round ≤ 2, or that update travelled dense)."""
    steps = config.inner.steps
    if not config.inner.adaptive_steps or round_ <= 2 or header is None:
        return steps
    scaled = steps * rank_fraction(config, header)
    nearest = int(scaled + Fraction(1, 2))  # floor(x + 1/2): round half up, exactly
    return max(config.inner.min_steps, min(steps, nearest))


def round_tokens(config: RunConfig, steps: int) -> int:
    """The tokens of one worker's round of ``steps`` inner steps."""
    return steps * config.inner.batch_size * config.model.block_size


def stored_downlink_header(store: Store, manifest: Manifest, layout: Layout) -> CodecHeader | None:
    """The codec header of ``manifest``'s compressed global update, read from ``store`` (bounded
    JSON) and checked against ``layout``; None when that round's update travelled dense. Raises
    ``trainer.codec.wire.WireError`` or ``trainer.codec.CompressionError`` naming what is wrong."""
    if manifest.downlink is None:
        return None
    raw = json_object(store.get(manifest.downlink.header), f"round {manifest.round}'s downlink codec header")
    return CodecHeader.parse(raw, layout)


def stored_inner_steps(config: RunConfig, round_: int, manifests: Mapping[int, Manifest], store: Store,
                       layout: Layout) -> int:
    """H_r re-derived from the store: round r−2's manifest (from ``manifests``, by round) names the
    codec header. KeyError when that manifest is not at hand; the errors of
    ``stored_downlink_header`` when its header is unreadable."""
    if not config.inner.adaptive_steps or round_ <= 2:
        return config.inner.steps
    return inner_steps_for_round(config, round_, stored_downlink_header(store, manifests[round_ - 2], layout))


class ScheduleError(ValueError):
    """A declared H_r out of bounds or not the one the worker derives; the message says which."""


@dataclass(frozen=True)
class StepsDecision:
    """A round's H_r and where it came from: "derived" by the worker itself (with ρ; None where no
    header is needed) or "declared" by the coordinator (the worker lacks round r−2's header)."""

    steps: int
    rank_fraction: float | None
    source: str


class WorkerSchedule:
    """A worker's view of H_r for the rounds ahead. With each global state θ⁽ᵍ⁾ the coordinator
    declares H_{g+1} and H_{g+2} (what it will check the pushes against); the worker keeps them,
    bounded to [1, inner.steps], and the codec header of θ⁽ᵍ⁾'s compressed update when it came
    compressed. ``decide`` derives H_r itself whenever it can, and refuses a declaration that differs.
    """

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.declared: dict[int, int] = {}
        self.headers: dict[int, CodecHeader] = {}

    def learn(self, round_: int, next_steps: int, second_steps: int, header: CodecHeader | None) -> None:
        """θ⁽ᵍ⁾ arrived (g = ``round_``) declaring H_{g+1}, H_{g+2}, with its codec header if compressed."""
        most = self.config.inner.steps
        declared = {round_ + 1: next_steps, round_ + 2: second_steps}
        for r, steps in declared.items():
            if not 1 <= steps <= most:
                raise ScheduleError(f"the global state of round {round_} declares {steps} inner steps for round "
                                    f"{r}; this run's rounds train 1 to inner.steps = {most}")
        headers = {r: h for r, h in self.headers.items() if r >= round_ - 1}
        if header is not None:
            headers[round_] = header
        # One assignment each: an overlapped round reads them while the next fetch runs.
        self.headers = headers
        self.declared = {**{r: s for r, s in self.declared.items() if r > round_}, **declared}

    def decide(self, round_: int) -> StepsDecision:
        """H_r of ``round_``: derived from round r−2's header when held (or when none is needed),
        else as declared."""
        cfg, declared = self.config, self.declared.get(round_)
        needs_header = cfg.inner.adaptive_steps and round_ > 2
        header = self.headers.get(round_ - 2)
        if needs_header and header is None:
            if declared is None:
                raise ScheduleError(f"round {round_}: no declared inner steps and no codec header of round "
                                    f"{round_ - 2} to derive them from")
            return StepsDecision(declared, None, "declared")
        derived = inner_steps_for_round(cfg, round_, header)
        if declared is not None and declared != derived:
            raise ScheduleError(f"round {round_}: the coordinator declares {declared} inner steps, but round "
                                f"{round_ - 2}'s downlink header gives {derived}")
        return StepsDecision(derived, float(rank_fraction(cfg, header)) if needs_header else None, "derived")
