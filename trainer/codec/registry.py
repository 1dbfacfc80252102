"""Every codec kind, keyed by ``CodecKind``: adding a kind is its module plus one line here (and its
``CodecKind`` member, trainer.codec.base).

``CompressionConfig.codec`` names the codec matrices travel with (a kind's ``choice``); vectors
always travel as the kind ``for_vectors`` (int8), and the low-rank codec sends a matrix as dense
int4 when its rank would not save bytes.
"""

from __future__ import annotations

from trainer.codec.base import CodecKind, CompressionError, TensorCodec
from trainer.codec.dense import Int4Codec, Int8Codec
from trainer.codec.lowrank import LowRankCodec
from trainer.codec.topk import TopKCodec

CODECS: dict[CodecKind, TensorCodec] = {codec.kind: codec for codec in (
    LowRankCodec(),
    Int4Codec(),
    Int8Codec(),
    TopKCodec(),
)}

# The values of CompressionConfig.codec, in registration order.
CHOICES: tuple[str, ...] = tuple(codec.choice for codec in CODECS.values() if codec.choice)
CODEC_LOWRANK = LowRankCodec.choice
CODEC_TOPK = TopKCodec.choice
VECTOR_CODEC: TensorCodec = next(codec for codec in CODECS.values() if codec.for_vectors)


def codec_of(kind: str) -> TensorCodec:
    """The codec of a header entry's kind (CompressionError for a kind no codec has)."""
    try:
        return CODECS[CodecKind(kind)]
    except ValueError:
        raise CompressionError(f"no codec of kind {str(kind)[:40]!r}") from None


def matrix_codec(choice: str) -> TensorCodec:
    """The codec ``CompressionConfig.codec = choice`` sends matrices with."""
    return next(codec for codec in CODECS.values() if codec.choice == choice)
