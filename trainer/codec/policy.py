"""The adaptive rank policy: DiLoCoX's rank that follows the update (its knobs: trainer.codec.settings).

For every matrix the policy sees the full spectrum of the pseudo-gradient Δ itself, before the
error buffer is added (σᵢ below are Δ's; A = Δ + e is still what is decomposed and sent), and keeps,
per tensor, the cumulative energy curves of the last W rounds:

    E_t(k) = Σ_{i≤k} σᵢ(Δ)² / Σ_i σᵢ(Δ)²    (E ≡ 1 for Δ = 0),     Ē(k) = mean_{last W rounds} E_t(k)
    r*     = min { k : Ē(k) ≥ τ }                               (target energy fraction τ)
    r_t    = clamp(r*, max(r_min, ⌈r_{t−1}/f⌉), min(r_max, ⌊f·r_{t−1}⌋))   (first round: [r_min, r_max])
    r_t    ← min(r_t, min(m, n))

so the rank follows the energy of the update, stays in [r_min, r_max] and changes at most by a
factor f per round.

A truncated spectrum (the codec's sketch of a wide matrix, trainer.codec.lowrank: σ₁..σ_s, s ≥
r_max, estimated) comes with the whole energy ‖Δ‖_F², computed exactly; the curve then stops at s:

    E_t(k) = min(1, Σ_{i≤k} σᵢ² / ‖Δ‖_F²)   for k ≤ s,   the rest of the energy the tail (E_t(d) = 1)

and "not reached within the curve" means r* = d, as with a whole one (r* only matters up to r_max ≤
s, where the clamp takes it). A tensor's curves all have the same length (its shape and r_max fix
which decomposition it gets); a curve of another length restarts its window.

Each round's decision (per tensor: r_t, r*, E_t(r_t), Ē(r_t), and the kind sent: ``lowrank-int4``,
or ``int4`` when r_t ≥ min(m, n)/2) is returned as a ``RoundDecision`` for the caller to log.

Why Δ's spectrum and not A's: the residual e is, by construction, the energy the last round's rank
left out, spread over the tail directions; added to Δ it flattens the spectrum, so a policy fed A
needs more directions every round to reach τ and its ranks climb. Fed Δ, the rank falls as the
update concentrates, as DiLoCoX intends, and error feedback still delivers what a low rank drops, a
round later. When there is no residual (A = Δ) the one decomposition serves both. No H multiplier
is suggested: the rank is the only adaptive quantity here.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import torch

from trainer.codec.kinds import CodecKind, CompressionError
from trainer.codec.settings import CompressionConfig
from trainer.codec.wire import Params

_LOWRANK, _INT4 = CodecKind.LOWRANK_INT4.value, CodecKind.INT4.value


@dataclass(frozen=True)
class TensorDecision:
    """What the policy chose for one matrix this round (JSON-able through ``as_dict``)."""

    name: str
    matrix: tuple[int, int]
    rank: int             # r_t, after every clamp
    target_rank: int      # r*, the smallest rank whose window-averaged energy reaches τ
    energy: float         # E_t(r_t): fraction of this round's ‖A‖_F² captured by rank r_t
    window_energy: float  # Ē(r_t)
    total_energy: float   # ‖A‖_F² = Σσᵢ²
    kind: str = _LOWRANK  # what was sent: lowrank-int4, or int4 when r_t >= min(m, n)/2


@dataclass(frozen=True)
class RoundDecision:
    """The policy's decisions for one round, for the caller's log."""

    round: int
    tensors: dict[str, TensorDecision] = field(default_factory=dict)

    @property
    def mean_rank(self) -> float:
        return sum(d.rank for d in self.tensors.values()) / len(self.tensors) if self.tensors else 0.0

    @property
    def energy(self) -> float:
        """Energy captured by the chosen ranks over all matrices: Σ E_t(r)·‖A‖² / Σ ‖A‖²."""
        total = sum(d.total_energy for d in self.tensors.values())
        if total == 0.0:
            return 1.0
        return sum(d.energy * d.total_energy for d in self.tensors.values()) / total

    def describe(self) -> str:
        """For a log line: the mean rank and energy kept, or that no rank was chosen (top-k, or
        only vectors and dense matrices)."""
        return f"mean rank {self.mean_rank:.1f}, energy {self.energy:.3f}" if self.tensors else "no rank chosen"

    def as_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "mean_rank": self.mean_rank,
            "energy": self.energy,
            "tensors": {
                name: {**asdict(d), "matrix": list(d.matrix)}
                for name, d in sorted(self.tensors.items())
            },
        }


class AdaptiveRankPolicy:
    """Per-tensor rank from the windowed energy of the spectra seen (see the module docstring)."""

    def __init__(self, config: CompressionConfig | None = None) -> None:
        self.config = config or CompressionConfig()
        self.round = 0
        self._ranks: dict[str, int] = {}
        self._curves: dict[str, deque[torch.Tensor]] = {}
        self._pending: dict[str, TensorDecision] = {}
        self._saved: tuple[dict[str, int], dict[str, deque[torch.Tensor]]] | None = None
        self.last_decision: RoundDecision | None = None

    @classmethod
    def fixed(cls, rank: int, **config: Any) -> "AdaptiveRankPolicy":
        """A policy that always picks ``rank`` (capped at min(m, n))."""
        return cls(CompressionConfig(min_rank=rank, max_rank=rank, **config))

    def always_dense(self, m: int, n: int) -> bool:
        """True when every rank the policy could pick is ≥ min(m, n)/2: no SVD is worth doing."""
        d = min(m, n)
        return 2 * min(self.config.min_rank, d) >= d

    def decide(self, name: str, sigma: torch.Tensor, matrix: tuple[int, int],
               total: float | None = None) -> TensorDecision:
        """Record this round's singular values of tensor ``name`` and choose its rank: all
        min(m, n) of them, or (with ``total`` = ‖Δ‖_F²) the first s ≥ min(r_max, min(m, n))."""
        cfg = self.config
        d = min(matrix)
        curve, total = self._curve(name, sigma, d, total)
        window = self._curves.get(name)
        if window is None or window.maxlen != cfg.window or (window and window[0].numel() != curve.numel()):
            window = deque(maxlen=cfg.window)
            self._curves[name] = window
            self._ranks.pop(name, None)
        window.append(curve)
        mean_curve = torch.stack(list(window)).mean(dim=0)
        reaching = torch.nonzero(mean_curve >= cfg.target_energy - 1e-12)
        target = int(reaching[0]) + 1 if reaching.numel() else d
        lo, hi = cfg.min_rank, cfg.max_rank
        previous = self._ranks.get(name)
        if previous is not None:
            lo = max(lo, math.ceil(previous / cfg.max_rank_factor))
            hi = min(hi, math.floor(previous * cfg.max_rank_factor))
        rank = max(1, min(max(lo, min(target, hi)), d))
        self._ranks[name] = rank
        decision = TensorDecision(
            name=name, matrix=(int(matrix[0]), int(matrix[1])), rank=rank, target_rank=target,
            energy=float(curve[rank - 1]), window_energy=float(mean_curve[rank - 1]),
            total_energy=total, kind=_LOWRANK if 2 * rank < d else _INT4,
        )
        self._pending[name] = decision
        return decision

    def _curve(self, name: str, sigma: torch.Tensor, d: int, total: float | None) -> tuple[torch.Tensor, float]:
        """E_t(k) for k = 1..len(σ) and ‖Δ‖_F²: of a whole spectrum (``total`` None: Σσᵢ²), or of
        a truncated one."""
        shortest = d if total is None else min(self.config.max_rank, d)
        if sigma.dim() != 1 or not shortest <= sigma.numel() <= d:
            wanted = d if total is None else f"{shortest} to {d}"
            raise ValueError(f"tensor {name}: expected {wanted} singular values, got {list(sigma.shape)}")
        if total is not None and not (math.isfinite(total) and total >= 0.0):
            raise ValueError(f"tensor {name}: the total energy is not a finite non-negative number")
        sq = sigma.to(torch.float64) ** 2
        whole = float(sq.sum()) if total is None else total
        if whole <= 0.0:
            return torch.ones(sigma.numel(), dtype=torch.float64), whole
        curve = torch.cumsum(sq, 0) / whole
        return (curve if total is None else curve.clamp_max(1.0)), whole  # estimates may overshoot by rounding

    def begin_round(self) -> None:
        """Remember the state, so that ``abort_round`` can restore it if compression fails."""
        self._pending = {}
        curves = {k: deque(v, maxlen=v.maxlen) for k, v in self._curves.items()}
        self._saved = (dict(self._ranks), curves)

    def finish_round(self) -> RoundDecision:
        """Close the round: the decisions made since the last call, as one ``RoundDecision``."""
        self.round += 1
        self.last_decision = RoundDecision(self.round, dict(sorted(self._pending.items())))
        self._pending, self._saved = {}, None
        return self.last_decision

    def abort_round(self) -> None:
        self._pending = {}
        if self._saved is not None:
            self._ranks, self._curves = self._saved
            self._saved = None

    def state_dict(self) -> Params:
        state: Params = {"round": torch.tensor([self.round], dtype=torch.int64)}
        for name in sorted(self._ranks):
            state[f"rank/{name}"] = torch.tensor([self._ranks[name]], dtype=torch.int64)
            state[f"window/{name}"] = torch.stack(list(self._curves[name]))
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if "round" not in state:
            raise CompressionError("policy state: missing field round")
        ranks: dict[str, int] = {}
        curves: dict[str, deque[torch.Tensor]] = {}
        for key, value in state.items():
            if key == "round":
                continue
            kind, _, name = key.partition("/")
            if kind not in ("rank", "window") or not name:
                raise CompressionError(f"policy state: unexpected entry {key}")
            if kind == "rank":
                if f"window/{name}" not in state:
                    raise CompressionError(f"policy state: tensor {name}: missing field window")
                ranks[name] = int(value.reshape(-1)[0])
            else:
                if f"rank/{name}" not in state:
                    raise CompressionError(f"policy state: tensor {name}: missing field rank")
                w = value.to(torch.float64)
                rows_ok = w.dim() == 2 and 1 <= w.shape[0] <= self.config.window
                if not rows_ok or not bool(torch.isfinite(w).all()):
                    raise CompressionError(f"policy state: tensor {name}: malformed field window")
                curves[name] = deque(list(w.unbind(0)), maxlen=self.config.window)
        for name, rank in ranks.items():
            if not 1 <= rank <= curves[name][0].numel():
                raise CompressionError(f"policy state: tensor {name}: rank {rank} out of range")
        self.round = int(state["round"].reshape(-1)[0])
        self._ranks, self._curves, self._pending, self._saved = ranks, curves, {}, None


class PinnedRankPolicy(AdaptiveRankPolicy):
    """The rank of each matrix fixed in advance (an auditor re-compressing a replayed update at the
    ranks the worker sent); the kind follows as for ``AdaptiveRankPolicy``."""

    def __init__(self, config: CompressionConfig, ranks: Mapping[str, int]) -> None:
        super().__init__(config)
        self.ranks = dict(ranks)

    def decide(self, name: str, sigma: torch.Tensor, matrix: tuple[int, int],
               total: float | None = None) -> TensorDecision:
        d = min(matrix)
        rank = max(1, min(self.ranks.get(name, d), d))
        decision = TensorDecision(name=name, matrix=(int(matrix[0]), int(matrix[1])), rank=rank, target_rank=rank,
                                  energy=float("nan"), window_energy=float("nan"), total_energy=float("nan"),
                                  kind=_LOWRANK if 2 * rank < d else _INT4)
        self._pending[name] = decision
        return decision
