"""Encoding on the worker's device (issue 30): the decomposition and quantisation run where A is sent,
the payload and Â come back to the CPU, and the worker's error feedback is e = fl32(A − Â) with Â the
CPU decode every receiver computes, whatever device encoded."""

from __future__ import annotations

import pytest
import torch

from trainer.codec import AdaptiveRankPolicy, CompressionConfig, ErrorFeedbackCompressor, compress, decompress
from trainer.codec.wire import layout_of

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def update(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    low = torch.randn(90, 4, generator=g) @ torch.randn(4, 70, generator=g)
    return {"w": low + 0.01 * torch.randn(90, 70, generator=g), "small": torch.randn(5, 4, generator=g),
            "b": torch.randn(33, generator=g)}


def config() -> CompressionConfig:
    return CompressionConfig(enabled=True, min_rank=2, max_rank=8, int4_group_size=16, int8_group_size=8)


@pytest.mark.parametrize("device", DEVICES)
def test_feedback_is_a_minus_the_cpu_decode(device: str) -> None:
    compressor = ErrorFeedbackCompressor(AdaptiveRankPolicy(config()), torch.device(device))
    for seed in (1, 2):  # the second round encodes Δ + e
        tensors = update(seed)
        before = {name: e.clone() for name, e in compressor.errors.items()}
        payload, header, _ = compressor.compress(tensors)
        received = decompress(payload, header, layout_of(tensors))
        assert {e["kind"] for e in header["tensors"]} == {"lowrank-int4", "int4", "int8"}
        for name, t in tensors.items():
            a = t.double() + (before[name].double() if name in before else 0.0)
            assert compressor.errors[name].device.type == "cpu"
            assert torch.equal(compressor.errors[name], (a - received[name].double()).float()), name


def test_an_explicit_cpu_device_gives_the_default_bytes() -> None:
    tensors = update(3)
    default = compress(tensors, {}, AdaptiveRankPolicy(config()))
    assert compress(tensors, {}, AdaptiveRankPolicy(config()), torch.device("cpu")) == default
