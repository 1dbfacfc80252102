"""The dense kinds: ``int8`` for every vector and scalar, ``int4`` for a matrix sent whole.

Vectors and scalars (ndim ≤ 1: biases, LayerNorm gains), kind ``"int8"``, one rule for all of
them, whatever their size (no fp16 path):  Â = deq(int8(A)),  one part ``W`` of shape [numel].

A matrix the low-rank kind would not shrink (trainer.codec.lowrank), kind ``"int4"``:
Â = deq(int4(A)),  one part ``W`` of shape [m, n], flattened row-major. Rank is 0 in both headers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

import torch

from trainer.codec.base import TensorCodec, TensorEntry, fail, matrix_dims
from trainer.codec.kinds import CodecKind
from trainer.codec.quant import PartSpec, encode_part
from trainer.codec.wire import dtype_name

if TYPE_CHECKING:
    from trainer.codec.policy import AdaptiveRankPolicy
    from trainer.codec.settings import CompressionConfig
    from trainer.codec.wire import Params


def _dense_rank(name: str, rank: Any) -> None:
    if rank != 0:
        raise fail(name, "rank", f"{rank} for a dense tensor, expected 0")


class Int8Codec(TensorCodec):
    kind = CodecKind.INT8
    bits = 8
    for_vectors = True
    encodes_on_device = True

    def parts(self, name: str, shape: tuple[int, ...], rank: Any, group: int,
              fields: Mapping[str, int]) -> dict[str, PartSpec]:
        _dense_rank(name, rank)
        return {"W": PartSpec.of([math.prod(shape)], self.bits, group)}

    def encode(self, name: str, t: torch.Tensor, a: torch.Tensor, policy: AdaptiveRankPolicy,
               out: Params) -> TensorEntry:
        g = policy.config.int8_group_size
        out[f"{name}.W.q"], out[f"{name}.W.scale"] = encode_part(a, self.bits, g)
        return TensorEntry(name, tuple(t.shape), dtype_name(t.dtype), self.kind, 0, g,
                           {"W": PartSpec.of([a.numel()], self.bits, g)})

    def decode(self, entry: TensorEntry, packed: Mapping[str, torch.Tensor],
               device: torch.device | None = None) -> torch.Tensor:
        return self.values(entry, packed, "W", self.bits)

    def size(self, shape: tuple[int, ...], config: CompressionConfig, rank: int | None) -> int:
        return PartSpec.of([math.prod(shape)], self.bits, config.int8_group_size).nbytes


class Int4Codec(TensorCodec):
    kind = CodecKind.INT4
    bits = 4
    encodes_on_device = True

    def parts(self, name: str, shape: tuple[int, ...], rank: Any, group: int,
              fields: Mapping[str, int]) -> dict[str, PartSpec]:
        _dense_rank(name, rank)
        return {"W": PartSpec.of(list(matrix_dims(shape)), self.bits, group)}

    def encode(self, name: str, t: torch.Tensor, a: torch.Tensor, policy: AdaptiveRankPolicy,
               out: Params) -> TensorEntry:
        shape = tuple(t.shape)
        m, n = matrix_dims(shape)
        g = policy.config.int4_group_size
        out[f"{name}.W.q"], out[f"{name}.W.scale"] = encode_part(a.reshape(m, n), self.bits, g)
        return TensorEntry(name, shape, dtype_name(t.dtype), self.kind, 0, g, {"W": PartSpec.of([m, n], self.bits, g)})

    def decode(self, entry: TensorEntry, packed: Mapping[str, torch.Tensor],
               device: torch.device | None = None) -> torch.Tensor:
        return self.values(entry, packed, "W", self.bits)

    def size(self, shape: tuple[int, ...], config: CompressionConfig, rank: int | None) -> int:
        return PartSpec.of([math.prod(shape)], self.bits, config.int4_group_size).nbytes
