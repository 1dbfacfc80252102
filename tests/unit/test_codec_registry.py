"""Every registered codec kind keeps the ``TensorCodec`` contract the shared framing relies on: the
header entry it encodes is the one its ``parts`` and ``header_fields`` accept back, the payload it
writes passes validation and decodes to what it encoded (within the quantiser), its ``size`` is the
bytes it wrote, and ``replay_target`` keeps the tensor's shape. A new kind adds one row to CASES."""

from __future__ import annotations

import pytest
import torch

from trainer.codec import (
    CODECS,
    AdaptiveRankPolicy,
    CodecHeader,
    CodecKind,
    CompressionConfig,
    CompressionError,
    codec_of,
    validate,
)
from trainer.codec.wire import encode_params

# kind -> (shape of the tensor it is tried on, the config it is encoded under, the rank to size it at)
CASES: dict[CodecKind, tuple[tuple[int, ...], CompressionConfig, int | None]] = {
    CodecKind.LOWRANK_INT4: ((48, 4, 10), CompressionConfig(enabled=True, min_rank=3, max_rank=3), 3),
    CodecKind.INT4: ((7, 5), CompressionConfig(enabled=True), None),
    CodecKind.INT8: ((37,), CompressionConfig(enabled=True, int8_group_size=8), None),
    CodecKind.TOPK_INT4: ((33, 21), CompressionConfig(enabled=True, codec="topk", topk_density=0.1, topk_chunk=50),
                          None),
}


def test_every_registered_kind_has_a_case() -> None:
    assert set(CASES) == set(CODECS) == set(CodecKind)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_codec_keeps_the_contract(kind: CodecKind) -> None:
    shape, config, rank = CASES[kind]
    codec = codec_of(kind)
    g = torch.Generator().manual_seed(7)
    t = torch.randn(*shape, generator=g)
    a = t.double()
    out: dict[str, torch.Tensor] = {}
    entry = codec.encode("w", t, a, AdaptiveRankPolicy(config), out)
    assert entry.kind == kind and tuple(entry.shape) == shape
    assert codec.parts("w", shape, entry.rank, entry.group_size, entry.fields) == entry.parts

    header = CodecHeader((entry,))
    parsed = CodecHeader.parse(header.to_json(), {"w": ("float32", shape)})
    assert parsed == header
    packed = validate(encode_params(out), parsed)
    decoded = codec.decode(entry, packed).reshape(shape)
    assert decoded.dtype == torch.float64 and bool(torch.isfinite(decoded).all())
    if kind in (CodecKind.INT4, CodecKind.INT8):  # dense: within half a quantisation step everywhere
        assert float((decoded - a).abs().max()) <= float(a.abs().max()) / (7 if kind == CodecKind.INT4 else 127)
    assert float((decoded - a).norm()) < float(a.norm())

    assert codec.size(shape, config, rank) == sum(spec.nbytes for spec in entry.parts.values())
    assert codec.replay_target(a, entry).shape == a.shape


def test_unknown_kind_is_refused_by_name() -> None:
    with pytest.raises(CompressionError, match="no codec of kind 'fp8'"):
        codec_of("fp8")
