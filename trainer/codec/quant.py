"""Group quantisation and int4 packing: the value encoding every codec kind shares.

Quantisation (symmetric, per group of g consecutive values of the flattened array; b = 7 for int4,
b = 127 for int8; the last group may be short):

    s_g = fl32(max_{j∈g} |x_j| / b)                       (scale, stored as float32)
    q_j = clamp(round(x_j / s_g), −b−1, b)  (int4: [−8, 7]; int8: [−128, 127]; q_j = 0 if s_g = 0)
    deq(q)_j = q_j · s_g,              |x_j − deq(q)_j| ≤ s_g / 2

Scales are float32, not float16: a float16 scale underflows below 6e-8 (pseudo-gradient entries of
a converging run get there) and overflows above 65504, and costs only 2 bytes less per group. int4
values are two's-complement nibbles, two per byte, low nibble first; an odd count is padded with
a zero nibble (one canonical encoding: a payload whose padding nibble is not zero is refused).

A part (``PartSpec``) is one quantised array of a tensor's encoding: in the payload its packed
values ``<name>.<part>.q`` (uint8 nibbles for int4, int8 for int8) and, when it has any, its
float32 group scales ``<name>.<part>.scale``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

INT4_MAX = 7
INT8_MAX = 127
SCALE_BYTES = 4  # float32 scales


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
    low, high = packed & 0xF, packed >> 4
    nibbles = torch.stack([low, high], dim=1).reshape(-1)[:count].to(torch.int8)
    return (nibbles ^ 8) - 8  # a two's-complement nibble n ↦ n − 16·[n ≥ 8]


def num_groups(numel: int, group: int) -> int:
    return -(-numel // group)


def quantize_groups(x: torch.Tensor, group: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-group quantisation of a flat array: (q int8 [n], scales float32 [⌈n/g⌉])."""
    flat = x.reshape(-1).to(torch.float64)
    n = flat.numel()
    groups = num_groups(n, group)
    padded = torch.zeros(groups * group, dtype=torch.float64, device=flat.device)
    padded[:n] = flat
    blocks = padded.view(groups, group)
    scales = (blocks.abs().amax(dim=1) / qmax).to(torch.float32) if groups else torch.zeros(0, device=flat.device)
    s = scales.to(torch.float64).unsqueeze(1)
    q = torch.where(s > 0, torch.round(blocks / torch.where(s > 0, s, 1.0)), 0.0)
    q = q.clamp(-qmax - 1, qmax).reshape(-1)[:n].to(torch.int8)
    return q, scales


def dequantize_groups(q: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """q · s per group, in float64 (exact: an int8 times a float32 fits in 53 bits). One multiply
    over the whole groups viewed as rows, one over the short last group."""
    n = q.numel()
    values = q.reshape(-1).to(torch.float64, copy=True)  # multiplied in place below
    s = scales.to(torch.float64)
    whole = n // group
    values[:whole * group].view(whole, group).mul_(s[:whole].unsqueeze(1))
    if whole * group < n:
        values[whole * group:].mul_(s[whole])
    return values


def encode_part(values: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed values, float32 scales) of ``values`` quantised to ``bits`` (4 or 8) in groups of
    ``group``, computed on ``values``' device and returned on the CPU (where payloads are made)."""
    q, scales = quantize_groups(values, group, INT4_MAX if bits == 4 else INT8_MAX)
    return (pack_int4(q) if bits == 4 else q).cpu(), scales.cpu()


def decode_part(packed: torch.Tensor, scales: torch.Tensor, count: int, bits: int, group: int) -> torch.Tensor:
    """Inverse of ``encode_part`` up to quantisation: the ``count`` dequantised values, float64."""
    q = unpack_int4(packed, count) if bits == 4 else packed
    return dequantize_groups(q, scales, group)


def padding_nibble_set(packed: torch.Tensor, count: int) -> bool:
    """True when an odd count of int4 values leaves its padding nibble non-zero (not canonical)."""
    return bool(count % 2) and bool(int(packed[-1]) >> 4)


@dataclass(frozen=True)
class PartSpec:
    """One quantised part of a tensor: its shape, packed values and group scales."""

    shape: tuple[int, ...]
    packed_len: int
    num_scales: int

    @classmethod
    def of(cls, shape: Sequence[int], bits: int, group: int) -> PartSpec:
        count = math.prod(shape)
        return cls(tuple(shape), (count + 1) // 2 if bits == 4 else count, num_groups(count, group))

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data on the wire: packed values plus float32 scales."""
        return self.packed_len + SCALE_BYTES * self.num_scales

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "packed_len": self.packed_len, "num_scales": self.num_scales}
