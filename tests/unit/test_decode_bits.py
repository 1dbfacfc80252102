"""The vectorised decode gives the bits the decode it replaced gave (issue 30): every decoded tensor of
encoded updates, across shapes, ranks, odd sizes and group sizes, byte for byte.

The reference below is the decode as it stood before it was vectorised (main 02e5a10), kept here
verbatim as the definition: int4 nibbles widened to int16 and selected with ``where``, scales
repeated per value, and the rank-1 terms of the low-rank product added per 256 KB block of rows.
"""

from __future__ import annotations

import math

import pytest
import torch

from trainer.codec import AdaptiveRankPolicy, CompressionConfig, codec_of, compress, decompress, quant
from trainer.codec.base import matrix_dims
from trainer.codec.frame import CodecHeader, validate
from trainer.codec.wire import layout_of


def reference_unpack_int4(packed: torch.Tensor, count: int) -> torch.Tensor:
    p = packed.to(torch.int16)
    nibbles = torch.stack([p & 0xF, (p >> 4) & 0xF], dim=1).reshape(-1)[:count]
    return torch.where(nibbles >= 8, nibbles - 16, nibbles).to(torch.int8)


def reference_dequantize(q: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    s = scales.to(torch.float64).repeat_interleave(group)[:q.numel()]
    return q.to(torch.float64) * s


def reference_outer_products(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r, m = p.shape
    n = q.shape[1]
    out = torch.zeros(m, n, dtype=torch.float64)
    rows = max(1, min(m, (256 << 10) // (8 * max(1, n))))
    term = torch.empty(rows, n, dtype=torch.float64)
    for start in range(0, m, rows):
        block = out[start:start + rows]
        product = term[:block.shape[0]]
        for i in range(r):
            torch.mul(p[i, start:start + rows].unsqueeze(1), q[i].unsqueeze(0), out=product)
            block.add_(product)
    return out


def reference_decode(parsed: CodecHeader, packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The old decode of every tensor of a validated payload, float64 (before the one rounding to
    the tensor's dtype, which would hide most differences in the last float64 bits)."""
    out = {}
    for entry in parsed.tensors:
        bits = 8 if entry.kind == "int8" else 4
        values = {}
        for part, spec in entry.parts.items():
            count = math.prod(spec.shape)
            q = packed[f"{entry.name}.{part}.q"]
            q = reference_unpack_int4(q, count) if bits == 4 else q
            values[part] = reference_dequantize(q, packed[f"{entry.name}.{part}.scale"], entry.group_size)
        if entry.kind == "lowrank-int4":
            m, n = matrix_dims(entry.shape)
            dense = reference_outer_products(values["P"].view(entry.rank, m), values["Q"].view(entry.rank, n))
        else:
            dense = values["W"]
        out[entry.name] = dense.reshape(entry.shape)
    return out


def update(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        t = torch.randn(*shape, generator=g, dtype=torch.float64)
        if len(shape) >= 2:  # a few strong directions over noise, as pseudo-gradients look
            m, n = shape[0], math.prod(shape[1:])
            t = t * 0.05 + (torch.randn(m, 3, generator=g, dtype=torch.float64)
                            @ torch.randn(3, n, generator=g, dtype=torch.float64)).reshape(shape)
        out[name] = t.float()
    out["half"] = torch.randn(13, 9, generator=g).to(torch.bfloat16)
    return out


SHAPES = {
    "big": (300, 1100),  # several row blocks at 256 KB and at 512 KB
    "tall": (1500, 37),
    "cube": (12, 7, 9),
    "odd": (33, 21),  # odd element counts: int4 padding nibbles
    "tiny": (3, 2),  # too small for a low rank: dense int4
    "vec": (101,),
    "one": (1,),
}


@pytest.mark.parametrize("min_rank, max_rank, group", [(1, 1, 64), (5, 17, 16), (8, 64, 7), (40, 40, 64)])
def test_decode_is_the_old_decode_bit_for_bit(min_rank: int, max_rank: int, group: int) -> None:
    config = CompressionConfig(enabled=True, min_rank=min_rank, max_rank=max_rank, int4_group_size=group,
                               int8_group_size=group)
    errors: dict[str, torch.Tensor] = {}
    policy = AdaptiveRankPolicy(config)
    for round_ in range(2):  # the second round encodes Δ + e with ranks from the policy's window
        tensors = update(SHAPES, seed=100 + round_)
        payload, header = compress(tensors, errors, policy)
        layout = layout_of(tensors)
        parsed = CodecHeader.parse(header, layout)
        packed = validate(payload, parsed)
        old = reference_decode(parsed, packed)
        new = decompress(payload, header, layout)
        assert {e["rank"] for e in header["tensors"]} - {0}, "no tensor travelled low-rank"
        for entry in parsed.tensors:
            name = entry.name
            wide = codec_of(entry.kind).decode(entry, packed).reshape(entry.shape)
            assert wide.dtype == torch.float64 and wide.view(torch.int64).equal(old[name].view(torch.int64)), name
            want = old[name].to(getattr(torch, entry.dtype))
            assert new[name].dtype == want.dtype and new[name].shape == want.shape
            assert new[name].contiguous().view(torch.uint8).equal(want.contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("count, group", [(1, 1), (2, 64), (7, 3), (64, 64), (1001, 64), (4097, 100)])
def test_unpack_and_dequantize_are_the_old_ones(count: int, group: int) -> None:
    g = torch.Generator().manual_seed(count)
    values = torch.randint(-8, 8, (count,), generator=g, dtype=torch.int8)
    packed = quant.pack_int4(values)
    assert torch.equal(quant.unpack_int4(packed, count), reference_unpack_int4(packed, count))
    assert torch.equal(quant.unpack_int4(packed, count), values)
    scales = torch.rand(quant.num_groups(count, group), generator=g) * 10.0 ** torch.randint(-30, 30, (1,)).item()
    for q in (values, torch.randint(-128, 128, (count,), generator=g, dtype=torch.int8)):
        got, want = quant.dequantize_groups(q, scales, group), reference_dequantize(q, scales, group)
        assert got.view(torch.int64).equal(want.view(torch.int64))
