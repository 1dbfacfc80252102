"""The door of the codec package: ``CodecKind`` (how one tensor travels, the header's ``kind``),
``TensorCodec`` (what a kind must provide), ``TensorEntry`` (one tensor's header entry) and the one
error they raise, ``CompressionError``.

A kind is one module defining one ``TensorCodec`` subclass and one line in
``trainer.codec.registry`` (its ``CodecKind`` member is in ``trainer.codec.kinds``); the framing
(header, payload, validation, error feedback) in ``trainer.codec.frame`` and
``trainer.codec.feedback`` is shared, and calls a kind only through this interface:

    parts          the quantised parts a tensor of this kind travels as (shape, packed length,
                   scale count each), from its header fields: what the coordinator checks a
                   push's header against before it reads a byte of payload
    header_fields  the kind's own header fields beyond the common ones (top-k: chunk and k),
                   parsed and range-checked
    encode         A (float64, error feedback added) → payload entries + header entry; a kind with
                   ``encodes_on_device`` does its linear algebra on A's device (the encoder's
                   ``device``: trainer.codec.frame.CompressionStream) and returns CPU entries
    decode         payload entries → Â (float64), elementwise operations only (bit-identical on
                   every machine)
    validate       the payload checks beyond dtype and length (canonical padding, positions)
    size           the bytes of tensor data a tensor of a shape takes under a config
    replay_target  U, what the audit's replay compares a stored Â with: A' at the parameters
                   the header records (rank, positions), unquantised
    replay_ranks   what the replay pins when it re-encodes (the low-rank kind: the stored ranks)
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

import torch

from trainer.codec.kinds import CodecKind, CompressionError
from trainer.codec.quant import PartSpec, decode_part, padding_nibble_set

if TYPE_CHECKING:
    from trainer.codec.policy import AdaptiveRankPolicy
    from trainer.codec.settings import CompressionConfig
    from trainer.codec.wire import Params


def fail(name: str, fieldname: str, problem: str) -> CompressionError:
    return CompressionError(f"tensor {name}: field {fieldname}: {problem}")


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def matrix_dims(shape: tuple[int, ...] | list[int]) -> tuple[int, int]:
    """A tensor of shape (m, k₁, k₂, …) viewed as the matrix m × n, n = k₁·k₂·…"""
    return int(shape[0]), math.prod(int(k) for k in shape[1:])


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a codec header: what it is (the dense layout's name, shape and dtype) and how
    it travels (kind, rank, group size, parts, and the kind's own fields, e.g. top-k's chunk and k)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    rank: int
    group_size: int
    parts: dict[str, PartSpec]
    fields: Mapping[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "kind": str(self.kind),
               "rank": self.rank, "group_size": self.group_size,
               "parts": {part: spec.to_json() for part, spec in self.parts.items()}}
        out.update(self.fields)
        return out


class TensorCodec(ABC):
    """One kind of tensor encoding (see the module docstring for what each method is for)."""

    kind: ClassVar[CodecKind]
    bits: ClassVar[int]  # value bits: 4 (packed uint8 nibbles) or 8 (int8)
    for_vectors: ClassVar[bool] = False  # the kind for tensors of ndim ≤ 1 (else for matrices)
    # Whether ``encode`` runs on the device of its ``a`` (the worker's GPU, when it has one) and
    # returns its payload entries on the CPU; a kind without it is handed A on the CPU.
    encodes_on_device: ClassVar[bool] = False

    def header_fields(self, name: str, obj: Mapping[str, Any]) -> dict[str, int]:
        """The kind's own fields of a header entry ``obj``, checked; none by default."""
        return {}

    @abstractmethod
    def parts(self, name: str, shape: tuple[int, ...], rank: Any, group: int,
              fields: Mapping[str, int]) -> dict[str, PartSpec]:
        """The parts a tensor of ``shape`` must travel as; CompressionError if ``rank`` (as read
        off the wire: not yet known to be an int in range) or the fields do not fit the kind."""

    @abstractmethod
    def encode(self, name: str, t: torch.Tensor, a: torch.Tensor, policy: AdaptiveRankPolicy,
               out: Params) -> TensorEntry:
        """A = ``a`` (float64, error feedback added) of the dense tensor ``t`` into ``out``."""

    @abstractmethod
    def decode(self, entry: TensorEntry, packed: Mapping[str, torch.Tensor],
               device: torch.device | None = None) -> torch.Tensor:
        """Â of a validated entry, float64 on the CPU (any shape with the entry's element count).
        ``device``: where a kind whose decode is more than a dequantisation does its arithmetic
        (the worker's GPU); elementwise IEEE float64 operations in a fixed order give the same
        bits on any device."""

    def validate(self, entry: TensorEntry, packed: Mapping[str, torch.Tensor]) -> None:
        """Payload checks beyond dtype and length: by default, zero padding nibbles of int4 parts."""
        if self.bits == 4:
            self.check_padding(entry, packed, entry.parts)

    @abstractmethod
    def size(self, shape: tuple[int, ...], config: CompressionConfig, rank: int | None) -> int:
        """Bytes of tensor data (packed values and scales) a tensor of ``shape`` takes."""

    def replay_target(self, a: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
        """U: A' (float64) at the parameters ``entry`` records, unquantised; A' itself by default."""
        return a

    def replay_ranks(self, stored: Params) -> dict[str, int]:
        """The ranks the replay pins when it re-encodes matrices with this codec; none by default."""
        return {}

    @staticmethod
    def values(entry: TensorEntry, packed: Mapping[str, torch.Tensor], part: str, bits: int) -> torch.Tensor:
        """A part's dequantised values, float64."""
        return decode_part(packed[f"{entry.name}.{part}.q"], packed[f"{entry.name}.{part}.scale"],
                           math.prod(entry.parts[part].shape), bits, entry.group_size)

    @staticmethod
    def check_padding(entry: TensorEntry, packed: Mapping[str, torch.Tensor], parts: Mapping[str, PartSpec]) -> None:
        for part, spec in parts.items():
            if padding_nibble_set(packed[f"{entry.name}.{part}.q"], math.prod(spec.shape)):
                raise fail(entry.name, f"{part}.q", "padding nibble is not zero")
