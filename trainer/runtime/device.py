"""Where a worker's inner loop runs: ``cpu`` (the default, and what the tests run), ``cuda`` or
``cuda:N``.

On CUDA the forward and backward passes run under bf16 autocast (matrix products in bfloat16,
reductions and the loss in float32); the parameters, AdamW's state (the master weights) and the
pseudo-gradient Δ = θ⁽ʳ⁻¹⁾ − θ stay float32, and Δ is brought back to the CPU before it is encoded,
so what crosses the network, and everything the coordinator and the audit compute, is unchanged
and stays on the CPU. Pipeline stages on CUDA each take their own GPU, stage s on cuda:(s mod the
number of GPUs), and talk over NCCL; on the CPU over gloo.
"""

from __future__ import annotations

import contextlib
import re
from typing import ContextManager

import torch

_DEVICE = re.compile(r"cpu|cuda(?::(\d{1,3}))?")


class DeviceError(ValueError):
    """A device that is malformed or not present on this machine."""


def parse_device(text: str) -> torch.device:
    """``cpu``, ``cuda`` (cuda:0) or ``cuda:N``; DeviceError, in one line, for anything else and
    for a CUDA device this machine does not have."""
    match = _DEVICE.fullmatch(text.strip())
    if match is None:
        raise DeviceError(f"--device {text[:40]!r}: expected cpu, cuda or cuda:N")
    if text.strip() == "cpu":
        return torch.device("cpu")
    index = int(match.group(1) or 0)
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {text.strip()}: CUDA is not available here (torch {torch.__version__}, "
                          f"{'built without CUDA' if torch.version.cuda is None else 'no GPU visible'})")
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"--device {text.strip()}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


def autocast(device: torch.device) -> ContextManager:
    """bf16 autocast for a forward and backward on CUDA; nothing on the CPU (float32 throughout)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def stage_device(device: torch.device, stage: int) -> torch.device:
    """Pipeline stage ``stage``'s device: its own GPU, cuda:(stage mod GPUs), on CUDA; else the CPU."""
    if device.type == "cuda":
        return torch.device("cuda", stage % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend of a process group whose tensors live on ``device``."""
    return "nccl" if device.type == "cuda" else "gloo"
