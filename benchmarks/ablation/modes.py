"""The ablation's modes: what each row runs, and the outer step it runs at.

A mode is one run configuration of the product (trainer.config.RunConfig) plus how its workers are
started. Every DiLoCo mode differs from DiLoCoX in one technique; its outer step (lr η, Nesterov
momentum μ) is its own best on the grid below, found by ``dilocox bench ablation --sweep``
(benchmarks.ablation.sweep), so that no row pays for settings tuned for another. A mode whose
arithmetic is DiLoCoX's own (pipeline stages only change which process computes which layers) uses
DiLoCoX's setting.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.ablation.measure import Data, Settings
    from trainer.config import RunConfig

FIXED_RANK = 24  # the middle of the adaptive policy's [16, 32] (trainer.config.DILOCOX_COMPRESSION)

# The outer-step grid of the sweep, and what it chose per mode (docs/ablation.md has the sweep's
# table: held-out loss at every grid point, seed 1337, the full configuration). DiLoCoX's choice is
# the product's default (trainer.config.DILOCOX_OUTER; a unit test holds the two equal).
GRID_LR = (0.5, 0.7, 1.0)
GRID_MOMENTUM = (0.0, 0.3, 0.6, 0.9)
TUNED_OUTER: dict[str, tuple[float, float]] = {
    "diloco": (0.7, 0.6),
    "dilocox": (0.7, 0.3),
    "no-compression": (0.7, 0.3),
    "no-overlap": (1.0, 0.0),  # at the grid's edge: the row may do a little better with η > 1
    "fixed-rank": (0.7, 0.3),
    "other-start": (0.7, 0.0),
    # SparseLoCo's outer step (arXiv:2508.15706): plain averaged descent, the error feedback's decay
    # standing in for the outer momentum; the sweep's best for top-k without the decay was (0.7, 0.3).
    "topk": (1.0, 0.0),
}

# Muon's learning rate per mode (inner.muon_lr; the AdamW part keeps the benchmark's inner lr 2e-3).
# Swept on seed 1337 over 2e-3 … 1.6e-2 (README, "Against dense DiLoCo"): DiLoCoX's best is 4e-3,
# DiLoCo's 8e-3.
TUNED_MUON_LR: dict[str, float] = {"muon": 4e-3, "diloco-muon": 8e-3}

# SparseLoCo's error-feedback decay β for the top-k row (compression.error_decay): of the paper's
# range, 0.9 beat 0.95 on seed 1337 (docs/ablation.md, "Top-k as SparseLoCo runs it").
TOPK_ERROR_DECAY = 0.9

# Which overlapped start DiLoCoX runs (rounds.overlap_start); the "other-start" row runs the other.
DILOCOX_START = "delayed"
OTHER_START = {"delayed": "eager", "eager": "delayed"}[DILOCOX_START]


@dataclass(frozen=True)
class Mode:
    key: str
    name: str
    compression: bool = False
    codec: str = "lowrank-int4"
    overlap: bool = False
    overlap_start: str = DILOCOX_START
    stages: int = 0  # 0: the worker's own choice (`--stages auto`, by the cores it is given)
    fixed_rank: int = 0  # 0: the adaptive policy
    adaptive_steps: bool = False  # inner.adaptive_steps, H_r in [H/2, H] (trainer.rounds.schedule)
    error_decay: float = 1.0  # compression.error_decay, β of the uplink's error feedback
    inner_optimizer: str = "adamw"  # inner.optimizer
    allreduce: bool = False
    convergence: bool = True  # a row of Part 1 (loss, bytes)
    throughput: bool = True  # a row of Part 2 (tokens/s)
    outer_of: str = ""  # the mode whose tuned outer step this one uses ("": its own key)

    @property
    def tuned_key(self) -> str:
        return self.outer_of or self.key

    @property
    def compression_label(self) -> str:
        if not self.compression:
            return "none"
        if self.codec != "lowrank-int4":
            return f"{self.codec}, β {self.error_decay:g}, equal bytes"
        return f"fixed rank {self.fixed_rank}" if self.fixed_rank else "adaptive rank"


MODES = (
    Mode("allreduce", "AllReduce", allreduce=True),
    Mode("diloco", "DiLoCo", stages=1),
    Mode("diloco-muon", "DiLoCo, Muon inner", stages=1, inner_optimizer="muon", outer_of="diloco"),
    Mode("dilocox", "DiLoCoX", compression=True, overlap=True),
    Mode("muon", "DiLoCoX, Muon inner", compression=True, overlap=True, inner_optimizer="muon", outer_of="dilocox"),
    Mode("no-compression", "DiLoCoX −compression", overlap=True),
    Mode("no-overlap", "DiLoCoX −overlap", compression=True),
    Mode("fixed-rank", "DiLoCoX −adaptive rank", compression=True, overlap=True, fixed_rank=FIXED_RANK,
         throughput=False),
    Mode("other-start", f"DiLoCoX, {OTHER_START} overlap", compression=True, overlap=True,
         overlap_start=OTHER_START, throughput=False),
    Mode("adaptive-steps", "DiLoCoX + adaptive H", compression=True, overlap=True, adaptive_steps=True,
         outer_of="dilocox"),
    Mode("topk", "DiLoCoX, top-k codec", compression=True, overlap=True, codec="topk", error_decay=TOPK_ERROR_DECAY),
    Mode("pipeline", "DiLoCoX, 2 stages", compression=True, overlap=True, stages=2, convergence=False,
         outer_of="dilocox"),
)
BY_KEY = {m.key: m for m in MODES}


def outer_config(mode: Mode, override: tuple[float, float] | None = None):  # -> OuterConfig
    from trainer.config import OuterConfig

    lr, momentum = override or TUNED_OUTER.get(mode.tuned_key, (0.7, 0.9))
    return OuterConfig(lr=lr, momentum=momentum, nesterov=True)


def min_steps(mode: Mode, inner_steps: int) -> int:
    """H_min of ``mode``: half of H with adaptive H (the rank policy's floor is half its ceiling,
    r_min/r_max = 16/32, so ρ and H_r fall at most as far as the rank can), else H."""
    return max(1, inner_steps // 2) if mode.adaptive_steps else inner_steps


def rounds_for_tokens(mode: Mode, rounds: int, inner_steps: int) -> int:
    """Rounds enough for ``rounds`` × H steps' tokens whatever H_r the run takes (each is ≥ H_min);
    the run is read at the first checkpoint that reaches those tokens."""
    return -(-rounds * inner_steps // min_steps(mode, inner_steps))


def run_config(mode: Mode, s: Settings, data: Data, rounds: int, seed: int,
               outer: tuple[float, float] | None = None, topk_density: float = 0.0) -> RunConfig:
    """The run configuration of ``mode``: everything but the technique under test is shared."""
    from trainer.config import DILOCOX_COMPRESSION, InnerConfig, RoundConfig, RunConfig

    compression = replace(DILOCOX_COMPRESSION, enabled=mode.compression)
    if mode.fixed_rank:
        compression = replace(compression, min_rank=mode.fixed_rank, max_rank=mode.fixed_rank)
    if mode.codec != "lowrank-int4":
        compression = replace(compression, codec=mode.codec, topk_density=topk_density)
    if mode.error_decay != 1.0:
        compression = replace(compression, error_decay=mode.error_decay)
    muon = mode.inner_optimizer == "muon"
    inner = InnerConfig(steps=s.inner_steps, batch_size=s.batch_size, lr=s.inner_lr,
                        adaptive_steps=mode.adaptive_steps, min_steps=min_steps(mode, s.inner_steps),
                        optimizer="muon" if muon else "adamw",
                        muon_lr=TUNED_MUON_LR[mode.key] if muon else InnerConfig.muon_lr)
    return RunConfig(
        run_id=f"ablation-{mode.key}", seed=seed, model=s.model, inner=inner,
        outer=outer_config(mode, outer), data=data.config,
        rounds=RoundConfig(rounds=rounds, expected_workers=s.workers, quorum=s.workers,
                           straggler_timeout_s=s.timeout_s, heartbeat_interval_s=0.5,
                           liveness_timeout_s=15.0, overlap=mode.overlap, overlap_start=mode.overlap_start,
                           state_reveal="on_challenge"),  # every mode: nothing but updates on the wire
        compression=compression,
    )
