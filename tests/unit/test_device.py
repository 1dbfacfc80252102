"""--device: parsing, refusal of a device this machine lacks, and the CPU path unchanged."""

from __future__ import annotations

import pytest
import torch

from trainer.config import InnerConfig, ModelConfig
from trainer.diloco import DeviceError, InnerLoop, autocast, resolve_device
from trainer.model import build_model
from trainer.pipeline import PipelinedInnerLoop


def test_cpu_is_the_default_and_parses() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" cpu ") == torch.device("cpu")


@pytest.mark.parametrize("text", ["tpu", "gpu0", "", "cuda:x"])
def test_unknown_devices_are_refused_by_name(text: str) -> None:
    with pytest.raises(DeviceError, match="--device"):
        resolve_device(text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_is_refused_where_there_is_none() -> None:
    with pytest.raises(DeviceError, match="no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="need 2 GPUs"):
        PipelinedInnerLoop(ModelConfig(n_layer=2), InnerConfig(batch_size=2), 2, device=torch.device("cuda"))


def test_autocast_is_off_on_the_cpu() -> None:
    with autocast(torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")
        y = torch.ones(2, 2) @ torch.ones(2, 2)
    assert y.dtype == torch.float32


def test_inner_loop_on_the_cpu_returns_cpu_float32() -> None:
    cfg = ModelConfig(n_layer=1, n_embd=16, n_head=2, block_size=8)
    model = build_model(cfg, 0)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    loop = InnerLoop(model, InnerConfig(steps=1, batch_size=2), torch.device("cpu"))
    x = torch.randint(0, 256, (2, 8))
    result = loop.run(start, [(x, x)])
    assert all(d.device.type == "cpu" and d.dtype == torch.float32 for d in result.pseudo_gradient.values())
    assert all(v.device.type == "cpu" for v in loop.state().values())
