"""Fixed-seed updates encoded by every codec kind, and what their encoding is: the golden values of
tests/unit/test_codec_golden.py (recorded before trainer/compression.py was split into trainer/codec/;
``python -m tests.unit.codec_golden_cases`` prints them again)."""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import torch

from trainer.codec import (
    AdaptiveRankPolicy,
    CompressionConfig,
    ErrorFeedbackCompressor,
    compressed_size,
    decompress,
    density_matching_bytes,
    predicted_size,
)
from trainer.codec.wire import encode_params, layout_of


def update(seed: int) -> dict[str, torch.Tensor]:
    """A pseudo-gradient with every shape class: a low-rank-ish matrix, a 3-D tensor, a matrix too
    small for a low rank (int4), odd-length vectors (int8, padding), half-precision tensors."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(48, 6, generator=g, dtype=torch.float64) @ torch.randn(6, 40, generator=g, dtype=torch.float64)
    return {
        "attn.w": (a + 0.05 * torch.randn(48, 40, generator=g, dtype=torch.float64)).float(),
        "conv.w": torch.randn(16, 3, 5, generator=g),
        "head.w": torch.randn(6, 4, generator=g),
        "ln.b": torch.randn(37, generator=g),
        "ln.g": torch.randn(1, generator=g),
        "mlp.w": torch.randn(33, 21, generator=g).to(torch.bfloat16),
        "mlp.b": torch.randn(21, generator=g).to(torch.float16),
    }


CONFIGS = {
    "lowrank": CompressionConfig(enabled=True, min_rank=2, max_rank=8, int4_group_size=16, int8_group_size=8),
    "topk": CompressionConfig(enabled=True, codec="topk", topk_density=0.07, topk_chunk=100, int4_group_size=16,
                              int8_group_size=8),
}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tensors_sha(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: sha(encode_params({name: t.contiguous()})) for name, t in sorted(tensors.items())}


def record() -> dict[str, Any]:
    """Three rounds of each codec with error feedback: payload sha256, header, decoded tensors and
    error buffers (sha256 of their safetensors bytes), plus the size functions."""
    out: dict[str, Any] = {}
    for label, config in CONFIGS.items():
        compressor = ErrorFeedbackCompressor(AdaptiveRankPolicy(config))
        rounds = []
        for seed in (1, 2, 3):
            delta = update(seed)
            payload, header, _ = compressor.compress(delta)
            rounds.append({"payload_sha256": sha(payload), "header": header,
                           "decoded_sha256": tensors_sha(decompress(payload, header, layout_of(delta))),
                           "errors_sha256": tensors_sha(compressor.errors),
                           "compressed_size": compressed_size(header)})
        layout = layout_of(update(1))
        out[label] = {"rounds": rounds, "predicted_size": predicted_size(layout, config),
                      "predicted_size_rank3": predicted_size(layout, config, rank=3),
                      "density_matching_bytes": density_matching_bytes(layout, 2000, config)}
    return out


if __name__ == "__main__":
    json.dump(record(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
