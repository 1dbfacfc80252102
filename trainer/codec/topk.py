"""Top-k sparsification with int4 values (kind ``"topk-int4"``): the second matrix codec.

SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with
SparseLoCo", arXiv:2508.15706) sends each pseudo-gradient as its largest entries, chunk by chunk,
with low-bit values, and error feedback carries what was not sent into the next round. This module
is that codec, in our own implementation; trainer.codec.frame frames it (header, payload,
validation, error feedback) exactly as it frames the low-rank kind, so the coordinator, the
workers and the audit decode both through one path. Chosen by ``CompressionConfig.codec = "topk"``;
no rank is chosen, so the rank policy is not consulted.

Per matrix (vectors stay int8, trainer.codec.dense)
---------------------------------------------------
A = Δ + e (float64) is flattened row-major into N values and cut into chunks of C values (the
last one L = N − C·⌊(N−1)/C⌋ long). With k the count kept in a full chunk:

    k_j   = min(L_j, max(1, ⌈k · L_j / C⌉))                      kept in chunk j of length L_j
    S_j   = the k_j positions of largest |A| in chunk j           (ties: the lower position first)
    I     = the positions of S_j, in-chunk, ascending, each a little-endian uint16 (C ≤ 65536)
    V     = deq(int4(A[S]))                                       groups of g kept values, chunk after
                                                                  chunk (trainer.codec.quant)
    Â     = 0 everywhere but Â[S] = V
    e     ← A − Â

so a chunk costs 2·k_j + k_j/2 bytes plus a float32 scale per g kept values: with k = density · C,
about 2.5 + 4/g bytes per kept value, against 4 for a dense fp32 value.

Decoding is a scatter of dequantised values into zeros (no sums), the same bits on every machine;
a payload is refused unless each chunk's positions are strictly increasing and inside the chunk
(one canonical encoding: no repeated position, none out of range). The header entry carries
``chunk`` (C) and ``k`` besides the common fields, rank 0; parts ``I`` (the positions, uint8
pairs, no scales) and ``V`` (the int4 values).

As SparseLoCo runs it (docs/ablation.md compares the two point by point): e decays,
A = Δ + β·e with ``CompressionConfig.error_decay`` = β (trainer.codec.feedback), the outer step is
plain averaged descent (lr 1, momentum 0), and with ``topk_downlink_union`` the coordinator's
broadcast keeps W·k per chunk, every position of the average of W top-k updates, as SparseLoCo's
all-gather delivers it (``CompressionConfig.downlink``). What stays ours: chunks are bands of the
row-major flattening rather than 2-D tiles, values int4 with group scales rather than 2-bit
statistical levels, positions 16-bit rather than 12.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

import torch

from trainer.codec.base import TensorCodec, TensorEntry, fail, is_int, matrix_dims
from trainer.codec.kinds import CodecKind
from trainer.codec.quant import PartSpec, encode_part
from trainer.codec.settings import TOPK_MAX_CHUNK
from trainer.codec.wire import dtype_name

if TYPE_CHECKING:
    from trainer.codec.policy import AdaptiveRankPolicy
    from trainer.codec.settings import CompressionConfig
    from trainer.codec.wire import Params



def keep_per_chunk(density: float, chunk: int) -> int:
    """k: the entries kept in a full chunk at ``density`` (at least one)."""
    return max(1, min(chunk, round(density * chunk)))


def _chunks(numel: int, chunk: int, k: int) -> tuple[int, int, int]:
    """(full chunks, length of the short last one or 0, k kept in it): O(1), whatever a header says."""
    full, rest = divmod(numel, chunk)
    return full, rest, (min(rest, max(1, -(-k * rest // chunk))) if rest else 0)


def chunk_lengths(numel: int, chunk: int) -> list[int]:
    full, rest, _ = _chunks(numel, chunk, 1)
    return [chunk] * full + ([rest] if rest else [])


def kept_counts(numel: int, chunk: int, k: int) -> list[int]:
    """k_j for every chunk of an N-value tensor (module docstring)."""
    full, rest, last = _chunks(numel, chunk, k)
    return [min(chunk, k)] * full + ([last] if rest else [])


def kept_total(numel: int, chunk: int, k: int) -> int:
    """Σ k_j, without building the per-chunk list (a hostile header may name tiny chunks)."""
    full, _, last = _chunks(numel, chunk, k)
    return full * min(chunk, k) + last


def select(a: torch.Tensor, chunk: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(in-chunk positions int64, flat positions int64) of the entries kept from flat float64 ``a``."""
    local, flat, offset = [], [], 0
    for length, kept in zip(chunk_lengths(a.numel(), chunk), kept_counts(a.numel(), chunk, k)):
        magnitude = a[offset:offset + length].abs()
        # A stable sort on −|a| puts equal magnitudes in position order: the lower position wins a tie.
        order = torch.sort(-magnitude, stable=True).indices[:kept]
        positions = torch.sort(order).values
        local.append(positions)
        flat.append(positions + offset)
        offset += length
    return torch.cat(local), torch.cat(flat)


def encode_positions(local: torch.Tensor) -> torch.Tensor:
    """In-chunk positions as little-endian uint16, two uint8 each."""
    v = local.to(torch.int64)
    return torch.stack([v & 0xFF, v >> 8], dim=1).reshape(-1).to(torch.uint8)


def decode_positions(packed: torch.Tensor) -> torch.Tensor:
    pairs = packed.to(torch.int64).view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 8)


def position_problem(local: torch.Tensor, numel: int, chunk: int, k: int) -> str | None:
    """Why decoded in-chunk positions are not a canonical encoding for this tensor, or None
    (vectorised: the work is proportional to the positions sent, not to the chunk count named)."""
    full, rest, last = _chunks(numel, chunk, k)
    kept = min(chunk, k)
    if local.numel() != full * kept + last:
        return f"{local.numel()} positions, expected {full * kept + last}"
    in_full = full * kept
    limit = torch.full((local.numel(),), chunk, dtype=torch.int64)
    limit[in_full:] = rest
    if bool((local >= limit).any()):
        return "a position lies outside its chunk"
    index = torch.arange(local.numel(), dtype=torch.int64)
    first = torch.where(index < in_full, index % kept == 0, index == in_full)
    rising = torch.ones_like(first)
    rising[1:] = local[1:] > local[:-1]
    if not bool((rising | first).all()):
        return "positions within a chunk are not strictly increasing"
    return None


def scatter(numel: int, flat_positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Â, flat float64: zeros but the kept values at their positions."""
    out = torch.zeros(numel, dtype=torch.float64)
    out[flat_positions] = values
    return out


def flat_positions(local: torch.Tensor, numel: int, chunk: int, k: int) -> torch.Tensor:
    """In-chunk positions → positions in the flattened tensor."""
    full, _, _ = _chunks(numel, chunk, k)
    kept = min(chunk, k)
    index = torch.arange(local.numel(), dtype=torch.int64)
    chunk_of = torch.where(index < full * kept, index // kept, torch.full_like(index, full))
    return local + chunk_of * chunk


def payload_bytes(numel: int, chunk: int, k: int, group: int) -> int:
    """Bytes of tensor data a matrix of ``numel`` values takes: positions, int4 values, scales."""
    kept = kept_total(numel, chunk, k)
    return 2 * kept + (kept + 1) // 2 + 4 * math.ceil(kept / group)


class TopKCodec(TensorCodec):
    kind = CodecKind.TOPK_INT4
    bits = 4

    def header_fields(self, name: str, obj: Mapping[str, Any]) -> dict[str, int]:
        chunk, k = obj.get("chunk"), obj.get("k")
        if not is_int(chunk) or not 1 <= chunk <= TOPK_MAX_CHUNK:
            raise fail(name, "chunk", f"{chunk!r} is not an integer in [1, {TOPK_MAX_CHUNK}]")
        if not is_int(k) or not 1 <= k <= chunk:
            raise fail(name, "k", f"{k!r} is not an integer in [1, chunk = {chunk}]")
        return {"chunk": chunk, "k": k}

    def parts(self, name: str, shape: tuple[int, ...], rank: Any, group: int,
              fields: Mapping[str, int]) -> dict[str, PartSpec]:
        if rank != 0:
            raise fail(name, "rank", f"{rank} for a top-k tensor, expected 0")
        kept = kept_total(math.prod(shape), fields["chunk"], fields["k"])
        # I: the in-chunk positions, two bytes each, no scales; V: the kept values, int4.
        return {"I": PartSpec((kept,), 2 * kept, 0), "V": PartSpec.of([kept], self.bits, group)}

    def encode(self, name: str, t: torch.Tensor, a: torch.Tensor, policy: AdaptiveRankPolicy,
               out: Params) -> TensorEntry:
        cfg, shape = policy.config, tuple(t.shape)
        m, n = matrix_dims(shape)
        flat_a = a.reshape(m, n).reshape(-1)
        g = cfg.int4_group_size
        k = keep_per_chunk(cfg.topk_density, cfg.topk_chunk)
        local, flat = select(flat_a, cfg.topk_chunk, k)
        out[f"{name}.I.q"] = encode_positions(local)
        out[f"{name}.V.q"], out[f"{name}.V.scale"] = encode_part(flat_a[flat], self.bits, g)
        parts = {"I": PartSpec((local.numel(),), 2 * local.numel(), 0), "V": PartSpec.of([local.numel()], self.bits, g)}
        return TensorEntry(name, shape, dtype_name(t.dtype), self.kind, 0, g, parts, {"chunk": cfg.topk_chunk, "k": k})

    def decode(self, entry: TensorEntry, packed: Mapping[str, torch.Tensor],
               device: torch.device | None = None) -> torch.Tensor:
        numel = math.prod(entry.shape)
        chunk, k = entry.fields["chunk"], entry.fields["k"]
        local = decode_positions(packed[f"{entry.name}.I.q"])
        return scatter(numel, flat_positions(local, numel, chunk, k), self.values(entry, packed, "V", self.bits))

    def validate(self, entry: TensorEntry, packed: Mapping[str, torch.Tensor]) -> None:
        """Canonical positions (strictly increasing within each chunk, inside it), then the values'
        padding nibble."""
        problem = position_problem(decode_positions(packed[f"{entry.name}.I.q"]), math.prod(entry.shape),
                                   entry.fields["chunk"], entry.fields["k"])
        if problem:
            raise fail(entry.name, "I.q", problem)
        self.check_padding(entry, packed, {"V": entry.parts["V"]})

    def size(self, shape: tuple[int, ...], config: CompressionConfig, rank: int | None) -> int:
        k = keep_per_chunk(config.topk_density, config.topk_chunk)
        return payload_bytes(math.prod(shape), config.topk_chunk, k, config.int4_group_size)

    def replay_target(self, a: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
        """A' on its own top-k positions (at the entry's chunk and k), unquantised."""
        flat = a.reshape(-1)
        _, kept = select(flat, entry.fields["chunk"], entry.fields["k"])
        return scatter(flat.numel(), kept, flat[kept]).reshape(a.shape)
