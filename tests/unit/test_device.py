"""--device (trainer.runtime.device): parsing, refusal of a device this machine lacks, and the CPU path
unchanged (no autocast, float32, the worker's own model trained in place). CUDA itself is exercised
only where a GPU is present."""

from __future__ import annotations

import contextlib

import pytest
import torch

from cli.main import main
from trainer.config import InnerConfig, ModelConfig
from trainer.model.gpt import build_model
from trainer.model.params import params_of
from trainer.runtime.device import DeviceError, autocast, backend_for, parse_device, stage_device
from trainer.runtime.inner import InnerLoop

HAS_CUDA = torch.cuda.is_available()


def test_parses_cpu_and_refuses_what_is_not_a_device() -> None:
    assert parse_device("cpu") == torch.device("cpu")
    for text in ("gpu", "cuda:", "cuda:x", "cuda:1:2", "CPU", "cuda:0000", ""):
        with pytest.raises(DeviceError, match="expected cpu, cuda or cuda:N"):
            parse_device(text)


@pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA")
def test_refuses_cuda_where_there_is_none() -> None:
    for text in ("cuda", "cuda:0", "cuda:3"):
        with pytest.raises(DeviceError, match="CUDA is not available here") as caught:
            parse_device(text)
        assert "\n" not in str(caught.value)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_refuses_a_gpu_index_past_the_last() -> None:
    count = torch.cuda.device_count()
    assert parse_device("cuda") == torch.device("cuda", 0)
    with pytest.raises(DeviceError, match=f"has {count} CUDA device"):
        parse_device(f"cuda:{count}")


@pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA")
def test_a_worker_asked_for_an_absent_gpu_exits_at_start_with_a_usage_error(capsys) -> None:
    code = main(["worker", "--coordinator", "127.0.0.1:1", "--worker-id", "w0", "--insecure", "--device", "cuda:0"])
    assert code == 2


def test_cpu_runs_without_autocast_and_stages_use_gloo() -> None:
    cpu = torch.device("cpu")
    assert isinstance(autocast(cpu), contextlib.nullcontext)
    with autocast(cpu):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    assert backend_for(cpu) == "gloo" and backend_for(torch.device("cuda", 0)) == "nccl"
    assert stage_device(cpu, 3) == cpu


def test_the_cpu_inner_loop_trains_the_model_itself_bit_for_bit_as_before() -> None:
    cfg, inner = ModelConfig(n_layer=1, n_embd=32, n_head=2, block_size=8), InnerConfig(steps=2, batch_size=2)
    model = build_model(cfg, 7)
    loop = InnerLoop(model, inner)
    assert loop.model is model and loop.device == torch.device("cpu")
    start = params_of(model)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (2, 8), generator=gen), torch.randint(0, 256, (2, 8), generator=gen))
               for _ in range(2)]
    explicit = InnerLoop(build_model(cfg, 7), inner, torch.device("cpu")).run(start, batches)
    default = loop.run(start, batches)
    assert all(d.dtype == torch.float32 and d.device.type == "cpu" for d in default.pseudo_gradient.values())
    assert all(torch.equal(default.pseudo_gradient[n], explicit.pseudo_gradient[n]) for n in start)
    assert all(v.device.type == "cpu" for v in loop.state().values())


@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_a_cuda_inner_loop_keeps_float32_state_and_hands_delta_back_on_the_cpu() -> None:
    cfg, inner = ModelConfig(n_layer=1, n_embd=32, n_head=2, block_size=8), InnerConfig(steps=2, batch_size=2)
    model = build_model(cfg, 7)
    loop = InnerLoop(model, inner, parse_device("cuda"))
    assert loop.model is not model and next(model.parameters()).device.type == "cpu"
    start = params_of(model)
    batch = (torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
    result = loop.run(start, [batch, batch])
    assert all(d.dtype == torch.float32 and d.device.type == "cpu" for d in result.pseudo_gradient.values())
    assert all(p.dtype == torch.float32 for p in loop.model.parameters())
    assert any(d.abs().sum() > 0 for d in result.pseudo_gradient.values())
