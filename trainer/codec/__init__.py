"""Compression of pseudo-gradients: one header and one payload per update, one codec kind per tensor.

    trainer.codec.base      the door: CodecKind, the TensorCodec interface, TensorEntry, CompressionError
    trainer.codec.registry  every kind keyed by CodecKind (a new kind: its module + one line there)
    trainer.codec.quant     int4/int8 group quantisation and int4 packing (shared by the kinds)
    trainer.codec.policy    CompressionConfig and the adaptive rank policy
    trainer.codec.frame     header, payload validation, decompression, the encoding stream, sizes
    trainer.codec.feedback  error feedback: compress, ErrorFeedbackCompressor
    kinds                   trainer.codec.lowrank (lowrank-int4), .dense (int4, int8), .topk (topk-int4)

The public names are re-exported here; callers import them from ``trainer.codec``.
"""

from trainer.codec.base import CodecKind, CompressionError, TensorCodec, TensorEntry
from trainer.codec.feedback import ErrorFeedbackCompressor, compress
from trainer.codec.frame import (
    FORMAT, CodecHeader, CompressedPayload, CompressionStream, compressed_size, decompress,
    density_matching_bytes, predicted_size, validate,
)
from trainer.codec.lowrank import rank_of
from trainer.codec.policy import (
    AdaptiveRankPolicy, CompressionConfig, PinnedRankPolicy, RoundDecision, TensorDecision,
)
from trainer.codec.quant import PartSpec, pack_int4, unpack_int4
from trainer.codec.registry import CHOICES, CODEC_LOWRANK, CODEC_TOPK, CODECS, codec_of, matrix_codec

__all__ = [
    "FORMAT", "AdaptiveRankPolicy", "CHOICES", "CODECS", "CODEC_LOWRANK", "CODEC_TOPK", "CodecHeader", "CodecKind",
    "CompressedPayload", "CompressionConfig", "CompressionError", "CompressionStream", "ErrorFeedbackCompressor",
    "PartSpec", "PinnedRankPolicy", "RoundDecision", "TensorCodec", "TensorDecision", "TensorEntry", "codec_of",
    "compress", "compressed_size", "decompress", "density_matching_bytes", "matrix_codec", "pack_int4",
    "predicted_size", "rank_of", "unpack_int4", "validate",
]
