"""Adaptive low-rank + int4 compression of pseudo-gradients, with error feedback.

DiLoCoX (Qi et al., "DiLoCoX: A Low-Communication Large-Scale Training Framework for Decentralized
Cluster", arXiv:2506.21263) sends each pseudo-gradient as a low-rank decomposition quantised to
int4, with a rank that adapts as training goes on and the update concentrates in fewer directions.
The low-rank factorisation follows PowerSGD (Vogels et al., "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization", NeurIPS 2019); what compression drops is carried into
the next round by error feedback (Karimireddy et al., "Error Feedback Fixes SignSGD and other
Gradient Compression Schemes", ICML 2019). This module is our own implementation of that recipe;
the paper publishes no code.

Per tensor, per round (Δ the pseudo-gradient, e the worker's error buffer, e⁽⁰⁾ = 0)
----------------------------------------------------------------------------------------
A tensor of shape (m, k₁, k₂, …) is viewed as the matrix m × n with n = k₁·k₂·…

Matrices (ndim ≥ 2), kind ``"lowrank-int4"``:

    A  = Δ + e                                            (float64)
    A  = U Σ Vᵀ,  σ₁ ≥ σ₂ ≥ …  (full SVD on CPU, float64, LAPACK)
    sign fix: for each i ≤ r, flip (uᵢ, vᵢ) together so that the largest-|·| entry of uᵢ is
              positive (the first such entry on a tie)
    P  = U_r Σ_r^{1/2}   (m × r),    Q = V_r Σ_r^{1/2}   (n × r),    so A_r = P Qᵀ
    P̃  = deq(int4(P)),   Q̃ = deq(int4(Q))
    Â  = P̃ Q̃ᵀ = Σ_{i=1..r} p̃ᵢ q̃ᵢᵀ                          (the tensor every replica receives)
    e  ← A − Â                                            (error feedback)

  Rank fallback, kind ``"int4"``: if r ≥ min(m, n)/2 the factors would not save bytes over the
  dense matrix (r(m+n) < mn already holds for every r < min(m,n)/2, since (m+n)/2 ≤ max(m,n)), so
  the dense matrix is quantised instead: Â = deq(int4(A)), e ← A − Â. When even the policy's
  smallest rank is ≥ min(m, n)/2 the SVD is skipped altogether and the policy is not consulted.

Top-k instead (``CompressionConfig.codec = "topk"``), kind ``"topk-int4"``: A's largest entries,
chunk by chunk, with int4 values (trainer.topk has the equations and the byte count); e ← A − Â as
above. No rank is chosen, so the policy is not consulted.

Vectors and scalars (ndim ≤ 1: biases, LayerNorm gains), kind ``"int8"``, one rule for all of them,
whatever their size (no fp16 path): Â = deq(int8(A)), e ← A − Â, with the same error feedback.

Quantisation (symmetric, per group of g consecutive values of the flattened array; b = 7 for int4,
b = 127 for int8; the last group may be short):

    s_g = fl32(max_{j∈g} |x_j| / b)                       (scale, stored as float32)
    q_j = clamp(round(x_j / s_g), −b−1, b)  (int4: [−8, 7]; int8: [−128, 127]; q_j = 0 if s_g = 0)
    deq(q)_j = q_j · s_g,              |x_j − deq(q)_j| ≤ s_g / 2

Scales are float32, not float16: a float16 scale underflows below 6e-8 (pseudo-gradient entries of
a converging run get there) and overflows above 65504, and costs only 2 bytes less per group. int4
values are two's-complement nibbles, two per byte, low nibble first; an odd count is padded with
a zero nibble. A factor is flattened column by column (Pᵀ row-major), so that when g divides m a
group never mixes two singular directions, whose magnitudes differ by √(σᵢ/σⱼ). A dense matrix is
flattened row-major.

Adaptive rank (``AdaptiveRankPolicy``)
-------------------------------------
For every matrix the policy sees the full spectrum of the pseudo-gradient Δ itself, before the
error buffer is added (σᵢ below are Δ's; A = Δ + e is still what is decomposed and sent), and keeps,
per tensor, the cumulative energy curves of the last W rounds:

    E_t(k) = Σ_{i≤k} σᵢ(Δ)² / Σ_i σᵢ(Δ)²    (E ≡ 1 for Δ = 0),     Ē(k) = mean_{last W rounds} E_t(k)
    r*     = min { k : Ē(k) ≥ τ }                               (target energy fraction τ)
    r_t    = clamp(r*, max(r_min, ⌈r_{t−1}/f⌉), min(r_max, ⌊f·r_{t−1}⌋))   (first round: [r_min, r_max])
    r_t    ← min(r_t, min(m, n))

so the rank follows the energy of the update, stays in [r_min, r_max] and changes at most by a
factor f per round. Each round's decision (per tensor: r_t, r*, E_t(r_t), Ē(r_t), and the kind
sent) is returned as a ``RoundDecision`` for the caller to log.

Why Δ's spectrum and not A's: the residual e is, by construction, the energy the last round's rank
left out, spread over the tail directions; added to Δ it flattens the spectrum, so a policy fed A
needs more directions every round to reach τ and its ranks climb (measured in the ablation before
this rule: 8–33 at round 1, 15–53 at round 6). Fed Δ, the rank falls as the update concentrates,
as DiLoCoX intends, and error feedback still delivers what a low rank drops, a round later. When
there is no residual (A = Δ) the one decomposition serves both. No H multiplier is suggested: the
rank is the only adaptive quantity here.

Determinism
-----------
Compression is a deterministic function of (Δ, e, policy state) on a given machine (float64
LAPACK SVD, explicit sign fix, round-half-to-even). Decompression is a deterministic function of
the payload bytes on any machine: dequantisation and the reconstruction use only elementwise
IEEE-754 float64 operations (the rank-1 terms of Σᵢ p̃ᵢ q̃ᵢᵀ are added one by one in increasing i,
no BLAS matmul whose blocking depends on the CPU or the thread count), followed by one rounding
to the dense dtype. Every replica decompressing the same bytes therefore gets bit-identical
tensors, and the worker's e is computed from that same reconstruction.

Aggregation: an average of low-rank factors is not low-rank, so the coordinator decompresses each
validated payload and averages the dense tensors (trainer.aggregation); a compressed broadcast of
the global update can use its own ``ErrorFeedbackCompressor``.

Wire format
-----------
``compress`` returns a safetensors payload (``trainer.wire.encode_params``: byte-deterministic)
and a JSON-able header. For each tensor ``name`` and each part (``P`` and ``Q`` for
``lowrank-int4``, ``W`` for ``int4`` and ``int8``) the payload holds ``<name>.<part>.q`` (uint8
packed nibbles for int4, int8 for int8) and ``<name>.<part>.scale`` (float32). The header is

    {"format": "dilocox-lowrank-int4/1",
     "tensors": [{"name", "shape", "dtype", "kind", "rank", "group_size",
                  "parts": {part: {"shape", "packed_len", "num_scales"}}}, …]}   (sorted by name)

with ``rank`` 0 for the dense and top-k kinds (a top-k entry also carries ``chunk`` and ``k``, and
its parts are ``I``, the in-chunk positions as uint8 pairs with no scales, and ``V``, the int4
values), part shapes [m, r] / [n, r] / [m, n] / [numel], packed_len
⌈numel/2⌉ (int4) or numel (int8), and num_scales ⌈numel/g⌉.

``decompress`` parses the header into a :class:`CodecHeader` (``CodecHeader.parse``) and checks the
payload against it (``validate``) before it reconstructs any tensor, and raises ``CompressionError``
naming the tensor and the field at the first failure:
  1. header: the format tag; names exactly those of the expected layout (none unknown, missing
     or repeated); dtype and shape equal to the expected dense tensor's; kind allowed for that
     shape (int8 for ndim ≤ 1, lowrank-int4 or int4 otherwise); group_size ≥ 1; 1 ≤ rank ≤ min(m, n)
     for lowrank-int4, 0 otherwise; part shapes, packed lengths and scale counts as above;
  2. payload: a safetensors file with exactly the entries the header implies, each 1-D of the
     implied dtype (uint8 / int8 / float32) and length; every scale finite and ≥ 0; the padding
     nibble of an odd int4 count zero (one canonical encoding).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping, MutableMapping, Sequence

import torch

from trainer import topk
from trainer.config_fields import Range, setting
from trainer.topk import KIND_TOPK
from trainer.wire import Layout, Params, WireError, decode_params, dtype_name, encode_params

FORMAT = "dilocox-lowrank-int4/1"

KIND_LOWRANK = "lowrank-int4"
KIND_INT4 = "int4"
KIND_INT8 = "int8"
KINDS = (KIND_LOWRANK, KIND_INT4, KIND_INT8, KIND_TOPK)

# How matrices travel (CompressionConfig.codec): the adaptive low-rank + int4 of DiLoCoX, or top-k
# with int4 values (trainer.topk, SparseLoCo style). Vectors are int8 in both.
CODEC_LOWRANK = "lowrank-int4"
CODEC_TOPK = "topk"
CODECS = (CODEC_LOWRANK, CODEC_TOPK)

INT4_MAX = 7
INT8_MAX = 127
SCALE_BYTES = 4  # float32 scales
FP32_BYTES = 4

_PARTS = {KIND_LOWRANK: ("P", "Q"), KIND_INT4: ("W",), KIND_INT8: ("W",), KIND_TOPK: ("I", "V")}
_FLOAT_DTYPES = {"float16", "bfloat16", "float32", "float64"}


class CompressionError(ValueError):
    """A compressed update (or compressor state) that must not be used; names tensor and field."""


# --------------------------------------------------------------------------------------------
# int4 packing and group quantisation
# --------------------------------------------------------------------------------------------


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Integers in [−8, 7] → uint8, two's-complement nibbles, low nibble first, ⌈n/2⌉ bytes."""
    v = values.reshape(-1).to(torch.int16)
    if v.numel() and (int(v.min()) < -8 or int(v.max()) > 7):
        raise ValueError("int4 values must lie in [-8, 7]")
    if v.numel() % 2:
        v = torch.cat([v, v.new_zeros(1)])
    nibbles = v & 0xF
    return (nibbles[0::2] | (nibbles[1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of ``pack_int4``: the first ``count`` values, as int8 in [−8, 7]."""
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError("packed int4 data must be a 1-D uint8 tensor")
    if packed.numel() != (count + 1) // 2:
        raise ValueError(f"{packed.numel()} bytes cannot hold exactly {count} int4 values")
    p = packed.to(torch.int16)
    nibbles = torch.stack([p & 0xF, (p >> 4) & 0xF], dim=1).reshape(-1)[:count]
    return torch.where(nibbles >= 8, nibbles - 16, nibbles).to(torch.int8)


def _num_groups(numel: int, group: int) -> int:
    return -(-numel // group)


def quantize_groups(x: torch.Tensor, group: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-group quantisation of a flat array: (q int8 [n], scales float32 [⌈n/g⌉])."""
    flat = x.reshape(-1).to(torch.float64)
    n = flat.numel()
    groups = _num_groups(n, group)
    padded = torch.zeros(groups * group, dtype=torch.float64)
    padded[:n] = flat
    blocks = padded.view(groups, group)
    scales = (blocks.abs().amax(dim=1) / qmax).to(torch.float32) if groups else torch.zeros(0)
    s = scales.to(torch.float64).unsqueeze(1)
    q = torch.where(s > 0, torch.round(blocks / torch.where(s > 0, s, 1.0)), 0.0)
    q = q.clamp(-qmax - 1, qmax).reshape(-1)[:n].to(torch.int8)
    return q, scales


def dequantize_groups(q: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """q · s per group, in float64 (exact: an int8 times a float32 fits in 53 bits)."""
    n = q.numel()
    s = scales.to(torch.float64).repeat_interleave(group)[:n]
    return q.to(torch.float64) * s


# --------------------------------------------------------------------------------------------
# Adaptive rank policy
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompressionConfig:
    """Knobs of the compressor. Defaults: τ = 0.9, r ∈ [8, 64], W = 4 rounds, f = 2, g = 64.

    The rank floor matters more than τ: some updates put 90% of their energy in one direction (the
    output layer's, early on), and sending that direction alone starves the rest
    (docs/measurements.md has the figures).
    """

    # The ranges are checked with the rest of the run configuration (trainer.config), which gives
    # its refusals; __post_init__ below keeps the codec's own (narrower) preconditions.
    enabled: bool = setting(False, "compress updates; off: they travel dense fp32 (the DiLoCo baseline)")
    target_energy: float = setting(0.9, "τ: the energy of each update the chosen rank keeps",
                                   Range(0.0, 1.0, low_open=True))
    min_rank: int = setting(8, "the rank floor, <= max_rank", Range(1, 4096))
    max_rank: int = setting(64, "the rank ceiling", Range(1, 4096))
    window: int = setting(4, "W: rounds whose energy spectra are averaged", Range(1, 1000))
    max_rank_factor: float = setting(2.0, "f: the most the rank may grow in one round", Range(1.0, 1000.0))
    int4_group_size: int = setting(64, "values sharing one int4 scale", Range(1, 1 << 20))
    int8_group_size: int = setting(64, "values sharing one int8 scale", Range(1, 1 << 20))
    codec: str = setting(CODEC_LOWRANK, "the codec of matrices: one of CODECS")
    topk_density: float = setting(1 / 32, "the fraction of each matrix's entries the top-k codec sends",
                                  Range(0.0, 1.0, low_open=True))
    topk_chunk: int = setting(4096, "values per chunk, each chunk keeping its own top k", Range(1, topk.MAX_CHUNK))

    def __post_init__(self) -> None:
        if not 0.0 < self.target_energy <= 1.0:
            raise ValueError(f"target_energy must lie in (0, 1], got {self.target_energy}")
        if not 1 <= self.min_rank <= self.max_rank:
            raise ValueError(f"need 1 <= min_rank <= max_rank, got {self.min_rank}, {self.max_rank}")
        if self.window < 1:
            raise ValueError(f"window must be at least 1, got {self.window}")
        if not self.max_rank_factor >= 1.0:
            raise ValueError(f"max_rank_factor must be >= 1, got {self.max_rank_factor}")
        for name in ("int4_group_size", "int8_group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.codec not in CODECS:
            raise ValueError(f"codec must be one of {', '.join(CODECS)}, got {str(self.codec)[:40]!r}")
        if not 0.0 < self.topk_density <= 1.0:
            raise ValueError(f"topk_density must lie in (0, 1], got {self.topk_density}")
        if not 1 <= self.topk_chunk <= topk.MAX_CHUNK:
            raise ValueError(f"topk_chunk must lie in [1, {topk.MAX_CHUNK}], got {self.topk_chunk}")


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
    kind: str = KIND_LOWRANK  # what was sent: lowrank-int4, or int4 when r_t >= min(m, n)/2


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

    def decide(self, name: str, sigma: torch.Tensor, matrix: tuple[int, int]) -> TensorDecision:
        """Record this round's singular values of tensor ``name`` and choose its rank."""
        cfg = self.config
        d = min(matrix)
        if sigma.dim() != 1 or sigma.numel() != d:
            raise ValueError(f"tensor {name}: expected {d} singular values, got {list(sigma.shape)}")
        sq = sigma.to(torch.float64) ** 2
        total = float(sq.sum())
        curve = torch.cumsum(sq, 0) / total if total > 0.0 else torch.ones(d, dtype=torch.float64)
        window = self._curves.get(name)
        if window is None or window.maxlen != cfg.window or (window and window[0].numel() != d):
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
            total_energy=total, kind=KIND_LOWRANK if 2 * rank < d else KIND_INT4,
        )
        self._pending[name] = decision
        return decision

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


# --------------------------------------------------------------------------------------------
# Compression
# --------------------------------------------------------------------------------------------


class PinnedRankPolicy(AdaptiveRankPolicy):
    """The rank of each matrix fixed in advance (an auditor re-compressing a replayed update at the
    ranks the worker sent); the kind follows as for ``AdaptiveRankPolicy``."""

    def __init__(self, config: CompressionConfig, ranks: Mapping[str, int]) -> None:
        super().__init__(config)
        self.ranks = dict(ranks)

    def decide(self, name: str, sigma: torch.Tensor, matrix: tuple[int, int]) -> TensorDecision:
        d = min(matrix)
        rank = max(1, min(self.ranks.get(name, d), d))
        decision = TensorDecision(name=name, matrix=(int(matrix[0]), int(matrix[1])), rank=rank, target_rank=rank,
                                  energy=float("nan"), window_energy=float("nan"), total_energy=float("nan"),
                                  kind=KIND_LOWRANK if 2 * rank < d else KIND_INT4)
        self._pending[name] = decision
        return decision


def rank_of(matrix: torch.Tensor, relative: float = 1e-5) -> int:
    """The numerical rank of a dense reconstruction: singular values above ``relative`` × the
    largest (a rank-r product rounded to float32 leaves the others near 1e-7 of it)."""
    sigma = torch.linalg.svdvals(matrix.to(torch.float64))
    if sigma.numel() == 0 or float(sigma[0]) == 0.0:
        return 0
    return int((sigma > relative * sigma[0]).sum())


def _error_dtype(dtype: torch.dtype) -> torch.dtype:
    """e is kept in float32 (float64 for float64 tensors): a 16-bit buffer would lose the residual."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _matrix_dims(shape: tuple[int, ...] | list[int]) -> tuple[int, int]:
    return int(shape[0]), math.prod(int(k) for k in shape[1:])


def thin_svd(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """U, σ (descending), Vᵀ of a float64 m × n matrix, k = min(m, n), from the eigendecomposition of
    the smaller Gram matrix: for m ≤ n, A Aᵀ = U diag(σ²) Uᵀ and V = Aᵀ U diag(σ)⁻¹ (else the
    transpose). A Gram product and a k × k ``eigh`` cost a few times less than LAPACK's SVD of A
    and lose precision only in σᵢ below ~1e-8·σ₁, far under what int4 keeps; directions with
    σᵢ ≤ 1e-12·σ₁ get a zero vector. How a payload was chosen need not be reproducible (see
    Determinism), only its decompression."""
    m, n = a.shape
    wide = m <= n
    gram = a @ a.T if wide else a.T @ a
    eigenvalues, vectors = torch.linalg.eigh(gram)  # ascending
    eigenvalues, vectors = eigenvalues.flip(0), vectors.flip(1)
    sigma = eigenvalues.clamp_min(0.0).sqrt()
    floor = float(sigma[0]) * 1e-12 if sigma.numel() else 0.0
    inverse = torch.where(sigma > floor, 1.0 / sigma.clamp_min(floor if floor > 0 else 1.0), 0.0)
    other = (a.T @ vectors if wide else a @ vectors) * inverse
    if wide:
        return vectors, sigma, other.T
    return other, sigma, vectors.T


def singular_values(a: torch.Tensor) -> torch.Tensor:
    """σ (descending) of a float64 m × n matrix, from the eigenvalues of its smaller Gram matrix
    (as in :func:`thin_svd`, without the vectors)."""
    m, n = a.shape
    eigenvalues = torch.linalg.eigvalsh(a @ a.T if m <= n else a.T @ a)  # ascending
    return eigenvalues.flip(0).clamp_min(0.0).sqrt()


def _lowrank_factors(
    u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """P = U_r Σ_r^{1/2}, Q = V_r Σ_r^{1/2}, each uᵢ's largest-|·| entry made positive."""
    u, s, v = u[:, :rank], s[:rank], vh[:rank].T
    pivot = u.abs().argmax(dim=0)  # the first maximal entry on a tie
    signs = torch.where(u[pivot, torch.arange(rank)] < 0, -1.0, 1.0).to(torch.float64)
    root = s.clamp_min(0.0).sqrt() * signs
    return u * root, v * root


def _encode_part(values: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, scales = quantize_groups(values, group, INT4_MAX if bits == 4 else INT8_MAX)
    return (pack_int4(q) if bits == 4 else q), scales


def _factor_order(factor: torch.Tensor) -> torch.Tensor:
    """A factor m × r flattened column by column (Pᵀ row-major)."""
    return factor.T.contiguous().reshape(-1)


_BLOCK_BYTES = 256 << 10  # a block of rows of the result and its product term stay in a core's L2


def _sum_of_outer_products(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Σᵢ pᵢ qᵢᵀ for the rows pᵢ of p (r × m) and qᵢ of q (r × n), float64: each entry is
    ((p₀q₀ + p₁q₁) + p₂q₂) + …, one rounded product and one rounded sum a term in increasing i, the
    same on every machine. The m rows are done a block at a time so the running sum stays in cache
    (the order of operations on each entry is the same as over the whole matrix at once)."""
    r, m = p.shape
    n = q.shape[1]
    out = torch.zeros(m, n, dtype=torch.float64)
    rows = max(1, min(m, _BLOCK_BYTES // (8 * max(1, n))))
    term = torch.empty(rows, n, dtype=torch.float64)
    for start in range(0, m, rows):
        block = out[start:start + rows]
        product = term[:block.shape[0]]
        for i in range(r):
            torch.mul(p[i, start:start + rows].unsqueeze(1), q[i].unsqueeze(0), out=product)
            block.add_(product)
    return out


def _reconstruct(entry: TensorEntry, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The dense tensor an entry stands for; elementwise float64 ops only (see Determinism)."""

    def values(part: str) -> torch.Tensor:
        spec = entry.parts[part]
        q = tensors[f"{entry.name}.{part}.q"]
        if entry.kind != KIND_INT8:
            q = unpack_int4(q, math.prod(spec.shape))
        return dequantize_groups(q, tensors[f"{entry.name}.{part}.scale"], entry.group_size)

    if entry.kind == KIND_LOWRANK:
        m, n = _matrix_dims(entry.shape)
        r = entry.rank
        dense = _sum_of_outer_products(values("P").view(r, m), values("Q").view(r, n))  # row i is p̃ᵢ, q̃ᵢ
    elif entry.kind == KIND_TOPK:
        numel = math.prod(entry.shape)
        local = topk.decode_positions(tensors[f"{entry.name}.I.q"])
        dense = topk.scatter(numel, topk.flat_positions(local, numel, entry.chunk, entry.k), values("V"))
    else:
        dense = values("W")
    return dense.reshape(entry.shape).to(dtype)


def compress(
    tensors: Mapping[str, torch.Tensor],
    errors: MutableMapping[str, torch.Tensor] | None,
    policy: AdaptiveRankPolicy,
) -> tuple[bytes, dict[str, Any]]:
    """(payload, header) for ``tensors``; see the module docstring.

    ``errors`` is the error-feedback buffer, updated in place with e ← A − Â (entries created on
    first use, float32, or float64 for float64 tensors); pass None to compress without feedback.
    The buffer and the policy are left as they were if any input is refused. The round's decisions
    are in ``policy.last_decision``.
    """
    for name in sorted(tensors):
        t = tensors[name]
        if not t.is_floating_point():
            raise CompressionError(f"tensor {name}: dtype {dtype_name(t.dtype)} is not floating point")
        if not bool(torch.isfinite(t).all()):
            raise CompressionError(f"tensor {name}: values are not all finite")
        if errors is not None and name in errors and tuple(errors[name].shape) != tuple(t.shape):
            raise CompressionError(
                f"tensor {name}: error buffer shape {list(errors[name].shape)} != {list(t.shape)}"
            )
    stream = CompressionStream(policy)
    residuals: Params = {}
    try:
        for name in sorted(tensors):
            t = tensors[name]
            a = t.detach().to(torch.float64)
            if errors is not None and name in errors:
                a = a + errors[name].detach().to(torch.float64)
            received = stream.add(name, t, a)
            residuals[name] = (a - received.to(torch.float64)).to(_error_dtype(t.dtype))
        payload, header = stream.finish()
    except BaseException:
        stream.abort()
        raise
    if errors is not None:
        errors.update(residuals)
    return payload, header


class CompressionStream:
    """``compress`` one tensor at a time, for a caller that holds only one tensor's A at once (the
    coordinator's downlink: trainer.downlink). ``add`` each tensor in sorted name order, then
    ``finish``; ``abort`` leaves the policy as it was. The payload and header are byte for byte those
    ``compress`` gives for the same tensors, and each ``add`` returns the Â every replica rebuilds
    from them (the same ``_reconstruct`` on the same quantised tensors)."""

    def __init__(self, policy: AdaptiveRankPolicy) -> None:
        self.policy = policy
        self.entries: list[TensorEntry] = []
        self.out: Params = {}
        self._last: str | None = None
        policy.begin_round()

    def add(self, name: str, t: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Encode A = ``a`` (float64, error feedback already added) of the dense tensor ``t``;
        returns Â in ``t``'s dtype."""
        if self._last is not None and name <= self._last:
            raise CompressionError(f"tensor {name}: added out of sorted name order (after {self._last})")
        if not t.is_floating_point():
            raise CompressionError(f"tensor {name}: dtype {dtype_name(t.dtype)} is not floating point")
        if not bool(torch.isfinite(a).all()):
            raise CompressionError(f"tensor {name}: values are not all finite")
        self._last = name
        entry = _encode_tensor(name, t, a, self.policy, self.out)
        self.entries.append(entry)
        return _reconstruct(entry, self.out, t.dtype)

    def finish(self) -> tuple[bytes, dict[str, Any]]:
        if len(self.out) != _entry_count(self.entries):
            self.policy.abort_round()
            raise CompressionError("tensor names collide once suffixed with .<part>.q / .<part>.scale")
        self.policy.finish_round()
        return encode_params(self.out), CodecHeader(tuple(self.entries)).to_json()

    def abort(self) -> None:
        self.policy.abort_round()


def _encode_tensor(name: str, t: torch.Tensor, a: torch.Tensor, policy: AdaptiveRankPolicy, out: Params) -> TensorEntry:
    """A = ``a`` (float64, error feedback added) quantised into ``out``: int8 for vectors, else the
    policy's low rank or dense int4; returns its header entry."""
    cfg, shape = policy.config, tuple(t.shape)
    if t.dim() <= 1:
        g = cfg.int8_group_size
        out[f"{name}.W.q"], out[f"{name}.W.scale"] = _encode_part(a, 8, g)
        return TensorEntry(name, shape, dtype_name(t.dtype), KIND_INT8, 0, g, {"W": PartSpec.of([a.numel()], 8, g)})
    m, n = _matrix_dims(shape)
    mat = a.reshape(m, n)
    g = cfg.int4_group_size
    if cfg.codec == CODEC_TOPK:
        k = topk.keep_per_chunk(cfg.topk_density, cfg.topk_chunk)
        local, flat = topk.select(mat.reshape(-1), cfg.topk_chunk, k)
        out[f"{name}.I.q"] = topk.encode_positions(local)
        out[f"{name}.V.q"], out[f"{name}.V.scale"] = _encode_part(mat.reshape(-1)[flat], 4, g)
        parts = {"I": PartSpec((local.numel(),), 2 * local.numel(), 0), "V": PartSpec.of([local.numel()], 4, g)}
        return TensorEntry(name, shape, dtype_name(t.dtype), KIND_TOPK, 0, g, parts, cfg.topk_chunk, k)
    if not policy.always_dense(m, n):
        u, sigma, vh = thin_svd(mat)
        signal = t.detach().to(torch.float64).reshape(m, n)
        # The rank follows Δ's own spectrum, not that of Δ + e (see Adaptive rank).
        decision = policy.decide(name, sigma if torch.equal(signal, mat) else singular_values(signal), (m, n))
        if decision.kind == KIND_LOWRANK:
            rank = decision.rank
            p, qf = _lowrank_factors(u, sigma, vh, rank)
            parts = {}
            for part, (factor, fshape) in {"P": (p, [m, rank]), "Q": (qf, [n, rank])}.items():
                out[f"{name}.{part}.q"], out[f"{name}.{part}.scale"] = _encode_part(_factor_order(factor), 4, g)
                parts[part] = PartSpec.of(fshape, 4, g)
            return TensorEntry(name, shape, dtype_name(t.dtype), KIND_LOWRANK, rank, g, parts)
    out[f"{name}.W.q"], out[f"{name}.W.scale"] = _encode_part(mat, 4, g)
    return TensorEntry(name, shape, dtype_name(t.dtype), KIND_INT4, 0, g, {"W": PartSpec.of([m, n], 4, g)})


# --------------------------------------------------------------------------------------------
# Validation and decompression
# --------------------------------------------------------------------------------------------


def _fail(name: str, fieldname: str, problem: str) -> CompressionError:
    return CompressionError(f"tensor {name}: field {fieldname}: {problem}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_list(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(_is_int(k) and k >= 0 for k in x)


@dataclass(frozen=True)
class PartSpec:
    """One quantised part of a tensor: its shape, packed values and group scales."""

    shape: tuple[int, ...]
    packed_len: int
    num_scales: int

    @classmethod
    def of(cls, shape: Sequence[int], bits: int, group: int) -> PartSpec:
        count = math.prod(shape)
        return cls(tuple(shape), (count + 1) // 2 if bits == 4 else count, _num_groups(count, group))

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "packed_len": self.packed_len, "num_scales": self.num_scales}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a codec header: what it is (the dense layout's name, shape and dtype) and how
    it travels (kind, rank, group size, parts)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    rank: int
    group_size: int
    parts: dict[str, PartSpec]
    chunk: int = 0  # top-k: values per chunk, and k, kept in a full one (0 for the other kinds)
    k: int = 0

    def to_json(self) -> dict[str, Any]:
        out = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "kind": self.kind,
               "rank": self.rank, "group_size": self.group_size,
               "parts": {part: spec.to_json() for part, spec in self.parts.items()}}
        if self.kind == KIND_TOPK:
            out.update(chunk=self.chunk, k=self.k)
        return out

    @classmethod
    def parse(cls, obj: Any, expected: Layout) -> TensorEntry:
        """An entry read off the wire, checked field by field against the expected dense layout
        (rule 1 of the module docstring); CompressionError names the tensor and field."""
        if not isinstance(obj, Mapping) or not isinstance(obj.get("name"), str):
            raise CompressionError("header: a tensor entry without a string name")
        name = obj["name"]
        if name not in expected:
            raise _fail(name, "name", "unknown tensor (not in the expected layout)")
        want_dtype, want_shape = expected[name][0], tuple(expected[name][1])
        if want_dtype not in _FLOAT_DTYPES:
            raise _fail(name, "dtype", f"expected layout says {want_dtype}, not a floating dtype")
        if obj.get("dtype") != want_dtype:
            raise _fail(name, "dtype", f"{obj.get('dtype')!r}, expected {want_dtype}")
        if not _int_list(obj.get("shape")) or tuple(obj["shape"]) != want_shape:
            raise _fail(name, "shape", f"{obj.get('shape')!r}, expected {list(want_shape)}")
        kind, group, rank = obj.get("kind"), obj.get("group_size"), obj.get("rank")
        if kind not in KINDS:
            raise _fail(name, "kind", f"{kind!r} is not one of {list(KINDS)}")
        if (kind == KIND_INT8) != (len(want_shape) <= 1):
            raise _fail(name, "kind", f"{kind} is not used for a {len(want_shape)}-D tensor")
        if not _is_int(group) or group < 1:
            raise _fail(name, "group_size", f"{group!r} is not a positive integer")
        if not _is_int(rank):
            raise _fail(name, "rank", f"{rank!r} is not an integer")
        chunk, k = 0, 0
        if kind == KIND_TOPK:
            chunk, k = obj.get("chunk"), obj.get("k")
            if not _is_int(chunk) or not 1 <= chunk <= topk.MAX_CHUNK:
                raise _fail(name, "chunk", f"{chunk!r} is not an integer in [1, {topk.MAX_CHUNK}]")
            if not _is_int(k) or not 1 <= k <= chunk:
                raise _fail(name, "k", f"{k!r} is not an integer in [1, chunk = {chunk}]")
        expected_parts = _expected_parts(name, kind, rank, want_shape, group, chunk, k)
        return cls(name, want_shape, want_dtype, kind, rank, group, _parse_parts(name, obj.get("parts"), expected_parts),
                   chunk, k)


def _expected_parts(name: str, kind: str, rank: int, shape: tuple[int, ...], group: int,
                    chunk: int = 0, k: int = 0) -> dict[str, PartSpec]:
    """The parts a tensor of ``shape`` must travel as, for its kind and rank (top-k: chunk and k)."""
    bits = 8 if kind == KIND_INT8 else 4
    if kind == KIND_TOPK:
        if rank != 0:
            raise _fail(name, "rank", f"{rank} for a top-k tensor, expected 0")
        kept = topk.kept_total(math.prod(shape), chunk, k)
        # I: the in-chunk positions, two bytes each, no scales; V: the kept values, int4.
        return {"I": PartSpec((kept,), 2 * kept, 0), "V": PartSpec.of([kept], bits, group)}
    if kind == KIND_LOWRANK:
        m, n = _matrix_dims(shape)
        if not 1 <= rank <= min(m, n):
            raise _fail(name, "rank", f"{rank} outside [1, min(m, n) = {min(m, n)}]")
        return {"P": PartSpec.of([m, rank], bits, group), "Q": PartSpec.of([n, rank], bits, group)}
    if rank != 0:
        raise _fail(name, "rank", f"{rank} for a dense tensor, expected 0")
    dims = list(_matrix_dims(shape)) if kind == KIND_INT4 else [math.prod(shape)]
    return {"W": PartSpec.of(dims, bits, group)}


def _parse_parts(name: str, parts: Any, expected: dict[str, PartSpec]) -> dict[str, PartSpec]:
    if not isinstance(parts, Mapping) or sorted(parts) != sorted(expected):
        got = sorted(parts) if isinstance(parts, Mapping) else parts
        raise _fail(name, "parts", f"{got!r}, expected {sorted(expected)}")
    for part, want in expected.items():
        spec = parts[part]
        if not isinstance(spec, Mapping):
            raise _fail(name, part, "not a mapping")
        if not _int_list(spec.get("shape")) or tuple(spec["shape"]) != want.shape:
            raise _fail(name, f"{part}.shape", f"{spec.get('shape')!r}, expected {list(want.shape)}")
        for fieldname in ("packed_len", "num_scales"):
            value = spec.get(fieldname)
            if not _is_int(value) or value != getattr(want, fieldname):
                raise _fail(name, f"{part}.{fieldname}", f"{value!r}, expected {getattr(want, fieldname)}")
    return expected


@dataclass(frozen=True)
class CodecHeader:
    """A compressed payload's header: every tensor's entry, sorted by name (its JSON form is what
    travels and is stored; ``parse`` is the one way back)."""

    tensors: tuple[TensorEntry, ...]

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "tensors": [entry.to_json() for entry in self.tensors]}

    @classmethod
    def parse(cls, obj: Any, expected: Layout) -> CodecHeader:
        if not isinstance(obj, Mapping) or obj.get("format") != FORMAT:
            got = obj.get("format") if isinstance(obj, Mapping) else type(obj).__name__
            raise CompressionError(f"header: format {got!r}, expected {FORMAT}")
        entries = obj.get("tensors")
        if not isinstance(entries, list):
            raise CompressionError("header: field tensors is not a list")
        parsed: dict[str, TensorEntry] = {}
        for raw in entries:
            entry = TensorEntry.parse(raw, expected)
            if entry.name in parsed:
                raise _fail(entry.name, "name", "appears twice in the header")
            parsed[entry.name] = entry
        missing = sorted(set(expected) - set(parsed))
        if missing:
            raise _fail(missing[0], "name", f"missing from the header (missing: {missing})")
        return cls(tuple(parsed.values()))

    def entry(self, name: str) -> TensorEntry:
        return next(e for e in self.tensors if e.name == name)

    def payload_keys(self) -> dict[str, tuple[str, str, torch.dtype, int]]:
        """Every payload entry the header implies: key → (tensor, field, dtype, length)."""
        keys: dict[str, tuple[str, str, torch.dtype, int]] = {}
        for entry in self.tensors:
            for part, spec in entry.parts.items():
                q_dtype = torch.int8 if entry.kind == KIND_INT8 else torch.uint8
                keys[f"{entry.name}.{part}.q"] = (entry.name, f"{part}.q", q_dtype, spec.packed_len)
                if spec.num_scales:  # top-k positions have none
                    keys[f"{entry.name}.{part}.scale"] = (entry.name, f"{part}.scale", torch.float32, spec.num_scales)
        if len(keys) != _entry_count(self.tensors):
            raise CompressionError("header: tensor names collide once suffixed with .<part>.q / .<part>.scale")
        return keys


def _entry_count(entries: Sequence[TensorEntry]) -> int:
    """Payload entries the tensors imply: a .q per part, and a .scale per part that has scales."""
    return sum(1 + (spec.num_scales > 0) for e in entries for spec in e.parts.values())


def validate(payload: bytes, header: CodecHeader) -> Params:
    """Check a payload against its parsed header (rule 2 of the module docstring); returns the
    decoded payload tensors (still packed)."""
    expected_keys = header.payload_keys()
    try:
        tensors = decode_params(payload)
    except WireError as exc:
        raise CompressionError(f"payload: {exc}") from exc
    unexpected = sorted(set(tensors) - set(expected_keys))
    if unexpected:
        raise CompressionError(f"payload: unexpected entries {unexpected}")
    for key, (name, fieldname, dtype, length) in expected_keys.items():
        t = tensors.get(key)
        if t is None:
            raise _fail(name, fieldname, f"payload has no entry {key}")
        if t.dtype != dtype or tuple(t.shape) != (length,):
            raise _fail(name, fieldname, f"payload holds {dtype_name(t.dtype)}{list(t.shape)}, "
                                         f"header implies {dtype_name(dtype)}[{length}]")
        if fieldname.endswith(".scale"):
            if not bool(torch.isfinite(t).all()):
                raise _fail(name, fieldname, f"{int((~torch.isfinite(t)).sum())} non-finite scale(s)")
            if bool((t < 0).any()):
                raise _fail(name, fieldname, "negative scale(s)")
    for entry in header.tensors:
        if entry.kind == KIND_TOPK:
            problem = topk.position_problem(topk.decode_positions(tensors[f"{entry.name}.I.q"]),
                                            math.prod(entry.shape), entry.chunk, entry.k)
            if problem:
                raise _fail(entry.name, "I.q", problem)
        if entry.kind != KIND_INT8:
            for part, spec in entry.parts.items():
                if part == "I":
                    continue
                if math.prod(spec.shape) % 2 and int(tensors[f"{entry.name}.{part}.q"][-1]) >> 4:
                    raise _fail(entry.name, f"{part}.q", "padding nibble is not zero")
    return tensors


def decompress(payload: bytes, header: Mapping[str, Any], expected_layout: Layout) -> Params:
    """The dense tensors of a compressed update, after its header and payload were checked whole."""
    parsed = CompressedPayload.parse(payload, header, expected_layout)
    return {name: parsed.tensor(name) for name in parsed.names()}


class CompressedPayload:
    """A compressed update checked whole (header and payload, as ``decompress`` checks them) and
    kept compact: its packed tensors, about the payload's size. ``tensor`` rebuilds one dense tensor
    at a time, bit for bit what ``decompress`` gives, so a holder of many updates never needs more
    than one dense tensor of each (trainer.aggregation's update sources)."""

    def __init__(self, header: CodecHeader, tensors: Params) -> None:
        self.header = header
        self._packed = tensors
        self._entries = {entry.name: entry for entry in header.tensors}

    @classmethod
    def parse(cls, payload: bytes, header: Mapping[str, Any], expected_layout: Layout) -> CompressedPayload:
        parsed = CodecHeader.parse(header, expected_layout)
        return cls(parsed, validate(payload, parsed))

    def names(self) -> list[str]:
        return sorted(self._entries)

    def layout(self) -> Layout:
        return {name: (e.dtype, tuple(e.shape)) for name, e in sorted(self._entries.items())}

    def tensor(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        return _reconstruct(entry, self._packed, getattr(torch, entry.dtype))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._packed.values())


def predicted_size(layout: Layout, config: CompressionConfig, rank: int | None = None) -> int:
    """Bytes of tensor data (as ``compressed_size`` counts them) a payload of ``layout`` takes under
    ``config``: the low-rank kind at ``rank`` (default ``config.max_rank``), or top-k."""
    total = 0
    for _, (_, shape) in sorted(layout.items()):
        numel = math.prod(shape)
        if len(shape) <= 1:
            total += numel + SCALE_BYTES * _num_groups(numel, config.int8_group_size)
            continue
        m, n = _matrix_dims(shape)
        g = config.int4_group_size
        if config.codec == CODEC_TOPK:
            total += topk.payload_bytes(numel, config.topk_chunk, topk.keep_per_chunk(config.topk_density, config.topk_chunk), g)
            continue
        r = min(rank or config.max_rank, min(m, n))
        parts = [m * r, n * r] if 2 * r < min(m, n) else [m * n]
        total += sum((count + 1) // 2 + SCALE_BYTES * _num_groups(count, g) for count in parts)
    return total


def density_matching_bytes(layout: Layout, target_bytes: int, config: CompressionConfig) -> float:
    """The largest top-k density (k / chunk) whose payload for ``layout`` is at most ``target_bytes``:
    the two codecs compared at equal bytes."""
    lo, hi = 1, config.topk_chunk
    while lo < hi:  # the largest k per chunk that fits
        mid = (lo + hi + 1) // 2
        size = predicted_size(layout, replace(config, codec=CODEC_TOPK, topk_density=mid / config.topk_chunk))
        lo, hi = (mid, hi) if size <= target_bytes else (lo, mid - 1)
    return lo / config.topk_chunk


def compressed_size(header: Mapping[str, Any]) -> int:
    """Bytes of tensor data the header implies: packed values plus float32 scales.

    The payload adds a safetensors JSON header (about 100 bytes per entry) on top of this.
    """
    return sum(
        spec["packed_len"] + SCALE_BYTES * spec["num_scales"]
        for entry in header["tensors"] for spec in entry["parts"].values()
    )


# --------------------------------------------------------------------------------------------
# Stateful compressor
# --------------------------------------------------------------------------------------------


class ErrorFeedbackCompressor:
    """A worker's compressor: the error buffer e per tensor plus its rank policy."""

    ERROR_PREFIX = "error/"
    POLICY_PREFIX = "policy/"

    def __init__(self, policy: AdaptiveRankPolicy | None = None) -> None:
        self.policy = policy or AdaptiveRankPolicy()
        self.errors: Params = {}

    def compress(
        self, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[bytes, dict[str, Any], RoundDecision]:
        """(payload, header, decisions) for this round's pseudo-gradient; e is updated."""
        payload, header = compress(tensors, self.errors, self.policy)
        assert self.policy.last_decision is not None
        return payload, header, self.policy.last_decision

    def carry_back(self, transmitted: Mapping[str, torch.Tensor]) -> None:
        """The last payload never counted (its round was refused or closed without it): e ← e + Â,
        so the buffer again holds all of A = Δ + e and nothing is lost."""
        for name, sent in transmitted.items():
            e = self.errors.get(name)
            if e is None:
                e = torch.zeros(sent.shape, dtype=_error_dtype(sent.dtype))
            self.errors[name] = (e.to(torch.float64) + sent.to(torch.float64)).to(e.dtype)

    def state_dict(self) -> Params:
        state = {self.ERROR_PREFIX + name: e.clone() for name, e in sorted(self.errors.items())}
        state.update({self.POLICY_PREFIX + k: v for k, v in self.policy.state_dict().items()})
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        errors: Params = {}
        policy_state: Params = {}
        for key, value in state.items():
            if key.startswith(self.ERROR_PREFIX):
                name = key[len(self.ERROR_PREFIX):]
                if not value.is_floating_point() or not bool(torch.isfinite(value).all()):
                    raise CompressionError(
                        f"compressor state: tensor {name}: field error is not finite floating point")
                errors[name] = value.clone()
            elif key.startswith(self.POLICY_PREFIX):
                policy_state[key[len(self.POLICY_PREFIX):]] = value
            else:
                raise CompressionError(f"compressor state: unexpected entry {key}")
        self.policy.load_state_dict(policy_state)
        self.errors = errors
