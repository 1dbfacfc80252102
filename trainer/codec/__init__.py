"""Compression of pseudo-gradients: one header and one payload per update, one codec kind per tensor.

    trainer.codec.kinds     CodecKind and CompressionError (no torch)
    trainer.codec.base      the door: the TensorCodec interface, TensorEntry
    trainer.codec.registry  every kind keyed by CodecKind (a new kind: its module + one line there)
    trainer.codec.settings  CompressionConfig, the run configuration's ``compression`` (no torch)
    trainer.codec.quant     int4/int8 group quantisation and int4 packing (shared by the kinds)
    trainer.codec.policy    the adaptive rank policy
    trainer.codec.frame     header, payload validation, decompression, the encoding stream, sizes
    trainer.codec.feedback  error feedback: accumulate, compress, ErrorFeedbackCompressor
    kinds                   trainer.codec.lowrank (lowrank-int4), .dense (int4, int8), .topk (topk-int4)

The public names are re-exported here; callers import them from ``trainer.codec``. Each is
imported from its module when first asked for, so that a caller of the configuration's names alone
(trainer.config: ``CompressionConfig``, ``CODEC_LOWRANK``) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "trainer.codec.kinds": ("CodecKind", "CompressionError"),
    "trainer.codec.base": ("TensorCodec", "TensorEntry"),
    "trainer.codec.feedback": ("ErrorFeedbackCompressor", "accumulate", "compress"),
    "trainer.codec.frame": ("FORMAT", "CodecHeader", "CompressedPayload", "CompressionStream", "compressed_size",
                            "decompress", "density_matching_bytes", "predicted_size", "validate"),
    "trainer.codec.lowrank": ("rank_of",),
    "trainer.codec.policy": ("AdaptiveRankPolicy", "PinnedRankPolicy", "RoundDecision", "TensorDecision"),
    "trainer.codec.settings": ("CompressionConfig",),
    "trainer.codec.quant": ("PartSpec", "pack_int4", "unpack_int4"),
    "trainer.codec.registry": ("CHOICES", "CODEC_LOWRANK", "CODEC_TOPK", "CODECS", "codec_of", "matrix_codec"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer.codec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from trainer.codec.base import TensorCodec, TensorEntry
    from trainer.codec.feedback import ErrorFeedbackCompressor, accumulate, compress
    from trainer.codec.frame import (
        FORMAT, CodecHeader, CompressedPayload, CompressionStream, compressed_size, decompress,
        density_matching_bytes, predicted_size, validate,
    )
    from trainer.codec.kinds import CodecKind, CompressionError
    from trainer.codec.lowrank import rank_of
    from trainer.codec.policy import AdaptiveRankPolicy, PinnedRankPolicy, RoundDecision, TensorDecision
    from trainer.codec.quant import PartSpec, pack_int4, unpack_int4
    from trainer.codec.registry import CHOICES, CODEC_LOWRANK, CODEC_TOPK, CODECS, codec_of, matrix_codec
    from trainer.codec.settings import CompressionConfig
