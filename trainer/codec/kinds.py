"""The codec package's names that need no torch: ``CodecKind`` (how one tensor travels, the header
entry's ``kind``) and ``CompressionError``. Kept apart from the codecs themselves so that reading a
run's configuration (trainer.config, every CLI command) does not load torch.
"""

from __future__ import annotations

import enum


class CompressionError(ValueError):
    """A compressed update (or compressor state) that must not be used; names tensor and field."""


class CodecKind(enum.StrEnum):
    """How one tensor travels: the header entry's ``kind`` (the string is the wire value)."""

    LOWRANK_INT4 = "lowrank-int4"
    INT4 = "int4"
    INT8 = "int8"
    TOPK_INT4 = "topk-int4"
