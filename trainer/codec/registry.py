"""Every codec kind, keyed by ``CodecKind``: adding a kind is its module plus one line in
``REGISTERED`` (and its ``CodecKind`` member, trainer.codec.kinds).

``CompressionConfig.codec`` names the codec matrices travel with (a registration's ``choice``);
vectors always travel as the kind whose class is ``for_vectors`` (int8), and the low-rank codec
sends a matrix as dense int4 when its rank would not save bytes.

This module needs no torch: a registration names its class by import path, and ``CODECS`` imports
the classes the first time a codec is asked for, so that the configuration's choices
(trainer.config, and every CLI command that reads a configuration) cost no torch import.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from trainer.codec.kinds import CodecKind, CompressionError

if TYPE_CHECKING:
    from trainer.codec.base import TensorCodec


@dataclass(frozen=True)
class Registration:
    """One kind: the ``module:Class`` implementing it, and the ``CompressionConfig.codec`` value
    that sends matrices with it (None: a kind only the framing picks, for vectors or dense parts)."""

    kind: CodecKind
    implementation: str
    choice: str | None = None


REGISTERED: tuple[Registration, ...] = (
    Registration(CodecKind.LOWRANK_INT4, "trainer.codec.lowrank:LowRankCodec", choice="lowrank-int4"),
    Registration(CodecKind.INT4, "trainer.codec.dense:Int4Codec"),
    Registration(CodecKind.INT8, "trainer.codec.dense:Int8Codec"),
    Registration(CodecKind.TOPK_INT4, "trainer.codec.topk:TopKCodec", choice="topk"),
)

# The values of CompressionConfig.codec, in registration order.
CHOICES: tuple[str, ...] = tuple(r.choice for r in REGISTERED if r.choice)


def _choice_of(kind: CodecKind) -> str:
    return next(r.choice for r in REGISTERED if r.kind == kind and r.choice)


CODEC_LOWRANK = _choice_of(CodecKind.LOWRANK_INT4)
CODEC_TOPK = _choice_of(CodecKind.TOPK_INT4)


@cache
def _load() -> dict[CodecKind, TensorCodec]:
    codecs = {}
    for registration in REGISTERED:
        module, _, name = registration.implementation.partition(":")
        codec = getattr(importlib.import_module(module), name)()
        assert codec.kind == registration.kind, registration  # a registration names its own class
        codecs[registration.kind] = codec
    return codecs


class _Codecs(Mapping["CodecKind", "TensorCodec"]):
    """``REGISTERED``'s codecs by kind, their modules imported on first use."""

    def __getitem__(self, kind: CodecKind) -> TensorCodec:
        return _load()[kind]

    def __iter__(self) -> Iterator[CodecKind]:
        return iter(_load())

    def __len__(self) -> int:
        return len(REGISTERED)


CODECS: Mapping[CodecKind, TensorCodec] = _Codecs()


def codec_of(kind: str) -> TensorCodec:
    """The codec of a header entry's kind (CompressionError for a kind no codec has)."""
    try:
        return CODECS[CodecKind(kind)]
    except ValueError:
        raise CompressionError(f"no codec of kind {str(kind)[:40]!r}") from None


def matrix_codec(choice: str) -> TensorCodec:
    """The codec ``CompressionConfig.codec = choice`` sends matrices with."""
    return CODECS[next(r.kind for r in REGISTERED if r.choice == choice)]


@cache
def vector_codec() -> TensorCodec:
    """The codec every tensor of ndim ≤ 1 travels with."""
    return next(codec for codec in CODECS.values() if codec.for_vectors)
