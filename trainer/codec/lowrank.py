"""The low-rank + int4 kind (``"lowrank-int4"``): DiLoCoX's adaptive low-rank factors, quantised.

DiLoCoX (Qi et al., "DiLoCoX: A Low-Communication Large-Scale Training Framework for Decentralized
Cluster", arXiv:2506.21263) sends each pseudo-gradient as a low-rank decomposition quantised to
int4, with a rank that adapts as training goes on (trainer.codec.policy). The factorisation follows
PowerSGD (Vogels et al., NeurIPS 2019). Our own implementation; the paper publishes no code.

Per matrix (a tensor of shape (m, k₁, k₂, …) viewed as m × n, n = k₁·k₂·…), A = Δ + e float64:

    A  ≈ U Σ Vᵀ,  σ₁ ≥ σ₂ ≥ …  (``Decomposition``: exact, or sketched on wide matrices, below)
    sign fix: for each i ≤ r, flip (uᵢ, vᵢ) together so that the largest-|·| entry of uᵢ is
              positive (the first such entry on a tie)
    P  = U_r Σ_r^{1/2}   (m × r),    Q = V_r Σ_r^{1/2}   (n × r),    so A_r = P Qᵀ
    P̃  = deq(int4(P)),   Q̃ = deq(int4(Q))
    Â  = P̃ Q̃ᵀ = Σ_{i=1..r} p̃ᵢ q̃ᵢᵀ                          (the tensor every replica receives)

Parts ``P`` [m, r] and ``Q`` [n, r], each flattened column by column (Pᵀ row-major), so that when g
divides m a group never mixes two singular directions, whose magnitudes differ by √(σᵢ/σⱼ).

Rank fallback to kind ``"int4"`` (trainer.codec.dense): if r ≥ min(m, n)/2 the factors would not
save bytes over the dense matrix (r(m+n) < mn already holds for every r < min(m,n)/2, since
(m+n)/2 ≤ max(m,n)), so the dense matrix is quantised instead. When even the policy's smallest
rank is ≥ min(m, n)/2 the SVD is skipped altogether and the policy is not consulted.

Which decomposition (``sketch_size``): with k = min(m, n) and s = r_max + ``SKETCH_OVERSAMPLING``,
the exact one (float64, from the k × k Gram matrix: a k × k ``eigh``, O(m·n·k + k³)) while
k ≤ ``EXACT_UP_TO``·s, so every matrix of a model up to a few hundred wide (the ablation's 128-wide
GPT) is encoded exactly as before; above it a randomized subspace iteration (Halko, Martinsson &
Tropp, SIAM Review 2011, Alg. 4.4; PowerSGD's family), O(m·n·s), whose top directions are those of
the matrix's projection on an s-dimensional row space:

    Ω  ~ N(0, 1)^{n × s}           (torch.Generator seeded from (m, n, s): the same on every run)
    Z₀ = Ω;  for j = 1..q:  Q_j = qr(A Z_{j−1}),  Z_j = qr(Aᵀ Q_j)     (float32, q = POWER_ITERATIONS)
    Z  = qr(Z_q) (float64),   Y = A Z  (m × s, float64),   A ≈ Y Zᵀ
    Y  = U Σ Wᵀ  (``thin_svd`` of the small Y),   so  A ≈ U Σ (Z W)ᵀ,  V = Z W

σ₁..σ_s are then estimates from below of A's first s singular values (the rank policy's input
with ‖Δ‖_F² computed exactly, trainer.codec.policy); only the iteration that finds the subspace is
float32 (the factors themselves are float64 products of A). How far its rank-r reconstruction is
from the best one, and what it saves, is measured in the README (issue 30).

Determinism: how the factors were chosen need not be reproducible, only Â from the bytes: the
rank-1 terms of Σᵢ p̃ᵢ q̃ᵢᵀ are added one by one in increasing i with elementwise float64
operations (no BLAS matmul whose blocking depends on the CPU or the thread count).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch

from trainer.codec.base import TensorCodec, TensorEntry, fail, matrix_dims
from trainer.codec.kinds import CodecKind
from trainer.codec.dense import Int4Codec
from trainer.codec.quant import PartSpec, encode_part
from trainer.codec.wire import dtype_name

if TYPE_CHECKING:
    from trainer.codec.policy import AdaptiveRankPolicy
    from trainer.codec.settings import CompressionConfig
    from trainer.codec.wire import Params

_BLOCK_BYTES = 512 << 10  # a block of rows of the result and its product term: together a core's L2

SKETCH_OVERSAMPLING = 16  # s = r_max + this: Halko et al.'s p, directions found beyond the rank sent
POWER_ITERATIONS = 2  # q: each pass (A then Aᵀ) sharpens the subspace by (σ_{s+1}/σ_r)²
EXACT_UP_TO = 4  # the exact decomposition while k ≤ this × s (crossover measured: README, issue 30)


def thin_svd(a: torch.Tensor, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """U, σ (descending), Vᵀ of a float64 m × n matrix, k = min(m, n), from the eigendecomposition of
    the smaller Gram matrix: for m ≤ n, A Aᵀ = U diag(σ²) Uᵀ and V = Aᵀ U diag(σ)⁻¹ (else the
    transpose). A Gram product and a k × k ``eigh`` cost a few times less than LAPACK's SVD of A
    and lose precision only in σᵢ below ~1e-8·σ₁, far under what int4 keeps; directions with
    σᵢ ≤ 1e-12·σ₁ get a zero vector. How a payload was chosen need not be reproducible (see
    Determinism), only its decompression. ``rank``: only the first ``rank`` singular vectors (σ
    whole); the other side's vectors then cost m·n·rank, not m·n·k."""
    return svd_from_gram(a, *gram_eigen(a), rank)


def gram_eigen(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """σ (descending) of a float64 m × n matrix and the eigenvectors of its smaller Gram matrix, in
    the same order: the first half of :func:`thin_svd`, on ``a``'s device."""
    m, n = a.shape
    gram = a @ a.T if m <= n else a.T @ a
    eigenvalues, vectors = torch.linalg.eigh(gram)  # ascending
    return eigenvalues.flip(0).clamp_min(0.0).sqrt(), vectors.flip(1)


def svd_from_gram(a: torch.Tensor, sigma: torch.Tensor, vectors: torch.Tensor,
                  rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """U, σ, Vᵀ of :func:`thin_svd` from :func:`gram_eigen`'s result, the vectors of the first
    ``rank`` directions only when ``rank`` is given."""
    m, n = a.shape
    wide = m <= n
    if rank is not None:
        vectors = vectors[:, :rank]
    floor = float(sigma[0]) * 1e-12 if sigma.numel() else 0.0
    kept = sigma[:vectors.shape[1]]
    inverse = torch.where(kept > floor, 1.0 / kept.clamp_min(floor if floor > 0 else 1.0), 0.0)
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


def sketch_size(m: int, n: int, max_rank: int) -> int | None:
    """s, the width of the randomized decomposition of an m × n matrix whose rank is at most
    ``max_rank``; None where the exact decomposition is as cheap (k = min(m, n) ≤ EXACT_UP_TO·s)."""
    s = max_rank + SKETCH_OVERSAMPLING
    return s if min(m, n) > EXACT_UP_TO * s else None


def row_basis(a: torch.Tensor, s: int) -> torch.Tensor:
    """Z (n × s, float64, orthonormal columns): the subspace iteration of the module docstring, on
    ``a``'s device. Ω is drawn on the CPU from a generator seeded with the shape, so the same matrix
    gets the same Z on every run (and the same Ω on every device)."""
    m, n = a.shape
    generator = torch.Generator().manual_seed((m * 1_000_003 + n) * 1_009 + s)
    z = torch.randn(n, s, generator=generator, dtype=torch.float32).to(a.device)
    low = a.to(torch.float32)  # the subspace only: the factors are formed from A in float64
    for _ in range(POWER_ITERATIONS):
        q = torch.linalg.qr(low @ z).Q
        z = torch.linalg.qr(low.T @ q).Q
    return torch.linalg.qr(z.to(torch.float64)).Q


@dataclass(frozen=True)
class Decomposition:
    """One decomposition of a float64 matrix A: σ (descending; all k of them, or the sketch's s)
    and what gives the singular vectors at a rank, without a second pass over A."""

    gram_of: torch.Tensor  # the matrix whose Gram matrix was decomposed: A, or the sketch Y = A Z
    sigma: torch.Tensor
    vectors: torch.Tensor  # the eigenvectors of gram_of's smaller Gram matrix, in σ's order
    basis: torch.Tensor | None  # Z for a sketch (A ≈ Y Zᵀ), None for the exact decomposition

    @classmethod
    def of(cls, a: torch.Tensor, sketch: int | None) -> "Decomposition":
        """Exact (``sketch`` None: :func:`gram_eigen` of A) or sketched at width ``sketch``."""
        if sketch is None:
            return cls(a, *gram_eigen(a), None)
        basis = row_basis(a, sketch)
        y = a @ basis
        return cls(y, *gram_eigen(y), basis)

    def svd(self, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """U (m × rank), σ, Vᵀ (rank × n) of A's first ``rank`` directions (rank ≤ len(σ))."""
        u, sigma, vh = svd_from_gram(self.gram_of, self.sigma, self.vectors, rank)
        return (u, sigma, vh) if self.basis is None else (u, sigma, vh @ self.basis.T)


def spectrum(a: torch.Tensor, sketch: int | None) -> torch.Tensor:
    """σ of a float64 matrix for the rank policy: all of them (:func:`singular_values`), or with a
    ``sketch`` width the first s estimated as :class:`Decomposition` does, without vectors."""
    return singular_values(a if sketch is None else a @ row_basis(a, sketch))


def rank_of(matrix: torch.Tensor, relative: float = 1e-5) -> int:
    """The numerical rank of a dense reconstruction: singular values above ``relative`` × the
    largest (a rank-r product rounded to float32 leaves the others near 1e-7 of it)."""
    sigma = torch.linalg.svdvals(matrix.to(torch.float64))
    if sigma.numel() == 0 or float(sigma[0]) == 0.0:
        return 0
    return int((sigma > relative * sigma[0]).sum())


def _lowrank_factors(
    u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """P = U_r Σ_r^{1/2}, Q = V_r Σ_r^{1/2}, each uᵢ's largest-|·| entry made positive."""
    u, s, v = u[:, :rank], s[:rank], vh[:rank].T
    pivot = u.abs().argmax(dim=0)  # the first maximal entry on a tie
    signs = torch.where(u[pivot, torch.arange(rank, device=u.device)] < 0, -1.0, 1.0).to(torch.float64)
    root = s.clamp_min(0.0).sqrt() * signs
    return u * root, v * root


def _factor_order(factor: torch.Tensor) -> torch.Tensor:
    """A factor m × r flattened column by column (Pᵀ row-major)."""
    return factor.T.contiguous().reshape(-1)


def _sum_of_outer_products(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Σᵢ pᵢ qᵢᵀ for the rows pᵢ of p (r × m) and qᵢ of q (r × n), float64: each entry is
    ((p₀q₀ + p₁q₁) + p₂q₂) + …, one rounded product and one rounded sum a term in increasing i, the
    same on every machine. On the CPU the m rows are done a block at a time so that the running sum
    and the product term stay in a core's L2 (the order of operations on each entry is the same as
    over the whole matrix at once); on a GPU (p and q on it) the whole matrix is one block. Per
    block and term, one elementwise multiply into a reused buffer and one add, each a kernel of its
    own (IEEE float64, correctly rounded: the same bits on a GPU as on any CPU): the only
    Python-level loop is over (block, term), each covering a whole block of rows (no per-group or
    per-row work); a fused multiply-add (``addcmul``, a matmul) would round once instead of twice
    and give other bits on some CPUs (trainer.rounds.transition, rule 1)."""
    r, m = p.shape
    n = q.shape[1]
    out = torch.zeros(m, n, dtype=torch.float64, device=p.device)
    rows = m if p.device.type != "cpu" else max(1, min(m, _BLOCK_BYTES // (8 * max(1, n))))
    term = torch.empty(rows, n, dtype=torch.float64, device=p.device)
    columns, lines = p.unsqueeze(2), q.unsqueeze(1)  # pᵢ as an m × 1 column, qᵢ as a 1 × n row
    for start in range(0, m, rows):
        block = out[start:start + rows]
        product = term[:block.shape[0]]
        column_block = columns[:, start:start + rows]
        for i in range(r):
            torch.mul(column_block[i], lines[i], out=product)
            block.add_(product)
    return out


class LowRankCodec(TensorCodec):
    kind = CodecKind.LOWRANK_INT4
    bits = 4
    encodes_on_device = True

    def parts(self, name: str, shape: tuple[int, ...], rank: Any, group: int,
              fields: Mapping[str, int]) -> dict[str, PartSpec]:
        m, n = matrix_dims(shape)
        if not 1 <= rank <= min(m, n):
            raise fail(name, "rank", f"{rank} outside [1, min(m, n) = {min(m, n)}]")
        return {"P": PartSpec.of([m, rank], self.bits, group), "Q": PartSpec.of([n, rank], self.bits, group)}

    def encode(self, name: str, t: torch.Tensor, a: torch.Tensor, policy: AdaptiveRankPolicy,
               out: Params) -> TensorEntry:
        """The policy's rank, or the whole matrix as int4 when that rank would not save bytes."""
        shape = tuple(t.shape)
        m, n = matrix_dims(shape)
        mat = a.reshape(m, n)
        g = policy.config.int4_group_size
        if not policy.always_dense(m, n):
            sketch = sketch_size(m, n, policy.config.max_rank)
            decomposition = Decomposition.of(mat, sketch)
            signal = t.detach().to(mat.device, torch.float64).reshape(m, n)
            # The rank follows Δ's own spectrum, not that of Δ + e (trainer.codec.policy); a
            # sketched spectrum is truncated, so the policy is also given Δ's whole energy.
            same = torch.equal(signal, mat)
            sigma = decomposition.sigma if same else spectrum(signal, sketch)
            total = None if sketch is None else float(signal.square().sum())
            decision = policy.decide(name, sigma.cpu(), (m, n), total)
            if decision.kind == self.kind:
                rank = decision.rank
                if rank > decomposition.sigma.numel():  # a pinned rank beyond the sketch
                    decomposition = Decomposition.of(mat, None)
                p, qf = _lowrank_factors(*decomposition.svd(rank), rank)
                parts = {}
                for part, (factor, fshape) in {"P": (p, [m, rank]), "Q": (qf, [n, rank])}.items():
                    out[f"{name}.{part}.q"], out[f"{name}.{part}.scale"] = encode_part(_factor_order(factor), self.bits, g)
                    parts[part] = PartSpec.of(fshape, self.bits, g)
                return TensorEntry(name, shape, dtype_name(t.dtype), self.kind, rank, g, parts)
        return _DENSE.encode(name, t, a, policy, out)

    def decode(self, entry: TensorEntry, packed: Mapping[str, torch.Tensor],
               device: torch.device | None = None) -> torch.Tensor:
        m, n = matrix_dims(entry.shape)
        r = entry.rank
        p, q = self.values(entry, packed, "P", self.bits), self.values(entry, packed, "Q", self.bits)
        if device is None or device.type == "cpu":
            return _sum_of_outer_products(p.view(r, m), q.view(r, n))  # row i is p̃ᵢ, q̃ᵢ
        return _sum_of_outer_products(p.view(r, m).to(device), q.view(r, n).to(device)).cpu()

    def size(self, shape: tuple[int, ...], config: CompressionConfig, rank: int | None) -> int:
        """At ``rank`` (default ``config.max_rank``), or dense int4 where that rank saves nothing."""
        m, n = matrix_dims(shape)
        r = min(rank or config.max_rank, min(m, n))
        counts = [m * r, n * r] if 2 * r < min(m, n) else [m * n]
        return sum(PartSpec.of([count], self.bits, config.int4_group_size).nbytes for count in counts)

    def replay_target(self, a: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
        """The best rank-r approximation of A' (float64 LAPACK SVD), r the entry's rank."""
        u, sigma, vh = torch.linalg.svd(a.reshape(a.shape[0], -1), full_matrices=False)
        k = entry.rank
        return ((u[:, :k] * sigma[:k]) @ vh[:k]).reshape(a.shape)

    def replay_ranks(self, stored: Params) -> dict[str, int]:
        """The ranks the worker's policy chose, read off the stored reconstructions Â."""
        return {name: rank_of(t.reshape(t.shape[0], -1)) for name, t in stored.items() if t.dim() >= 2 and t.numel()}


_DENSE = Int4Codec()
