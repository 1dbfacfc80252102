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


@pytest.mark.parametrize("device", DEVICES)
def test_received_is_what_every_receiver_decodes(device: str) -> None:
    """The Â the encoding hands back (the worker's transmitted slice, decoded nowhere again) is
    the payload's CPU decode bit for bit, on whatever device it was rebuilt."""
    compressor = ErrorFeedbackCompressor(AdaptiveRankPolicy(config()), torch.device(device))
    for seed in (4, 5):
        tensors, received = update(seed), {}
        payload, header, _ = compressor.compress(tensors, received=received)
        decoded = decompress(payload, header, layout_of(tensors))
        assert sorted(received) == sorted(decoded)
        for name, t in decoded.items():
            assert received[name].device.type == "cpu" and received[name].dtype == t.dtype
            assert torch.equal(received[name], t), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape,rank", [((768, 2048), 64), ((2048, 768), 32), ((256, 768), 16), ((1000, 37), 5)])
def test_a_gpu_decode_is_the_cpu_decode_bit_for_bit(shape: tuple[int, int], rank: int) -> None:
    """Rebuilt on the GPU (a worker's global update, its own Â) the same float64 operations in the
    same order give the CPU's bits, on factors whose magnitudes span many binades."""
    g = torch.Generator().manual_seed(rank)
    m, n = shape
    scales = torch.logspace(-6, 2, rank, dtype=torch.float64)
    a = (torch.randn(m, rank, generator=g, dtype=torch.float64) * scales) @ torch.randn(rank, n, generator=g,
                                                                                      dtype=torch.float64)
    cfg = CompressionConfig(enabled=True, min_rank=rank, max_rank=rank)
    tensors = {"w": a.float()}
    payload, header = compress(tensors, None, AdaptiveRankPolicy(cfg))
    assert header["tensors"][0]["kind"] == "lowrank-int4" and header["tensors"][0]["rank"] == rank
    on_cpu = decompress(payload, header, layout_of(tensors))["w"]
    on_gpu = decompress(payload, header, layout_of(tensors), torch.device("cuda"))["w"]
    assert on_gpu.device.type == "cpu"
    assert torch.equal(on_gpu.view(torch.int32), on_cpu.view(torch.int32))
