"""What decides a CPU worker's floating point, recorded with each contribution it pushes.

An honest worker's update and an auditor's replay of it (audit.replay) differ only by rounding, and
on a CPU the rounding of the inner loop is decided by two things of the worker's process, measured
on the demo run (docs/verification.md, "Replay tolerance"):

- the ATen CPU capability its kernels dispatch to (``torch.backends.cpu.get_cpu_capability()``:
  default, avx2, avx512 on x86; ``ATEN_CPU_CAPABILITY`` lowers it): the vectorised kernels of each
  capability fuse multiply-adds and reduce in their own order;
- its intra-op thread count (``torch.get_num_threads()``): a parallel reduction splits its sum by
  thread.

Replayed in a fresh process with the same two (audit.replay_env), an honest contribution is
re-derived bit for bit (d = 0: every contribution of the demo run, and a worker of 2 threads).
Measured not to matter on the demo's model: MKL's own instruction dispatch
(``MKL_ENABLE_INSTRUCTIONS=AVX2`` on an AVX-512 machine, rounds 1-4: d = 0). A worker on an
accelerator records none.

A worker of several pipeline stages (trainer.runtime.pipeline) trains in P processes of its own:
each stage reports the kernels it ran each round, and the worker records them (``agreed_kernels``)
when every stage ran the same capability and thread count; the audit replays its contributions in
one process with the stages' arithmetic (trainer.runtime.staged) in those kernels, bit for bit as
measured (tests/integration/test_replay.py; docs/verification.md). Where its stages disagree (or
one names none) it records none and says why in its log.

What a worker records is hostile input to whoever reads it: storage_client.Kernels allows a
capability from a fixed list and a bounded thread count, and the coordinator refuses anything else.
"""

from __future__ import annotations

from typing import Sequence

import torch

from storage_client import KERNEL_CAPABILITIES, Kernels


def current_kernels(device: torch.device) -> Kernels | None:
    """What decides this process's inner-loop floating point, or None on an accelerator (and for a
    capability outside the allowlist, which no auditor could name)."""
    if device.type != "cpu":
        return None
    capability = torch.backends.cpu.get_cpu_capability().lower()
    if capability not in KERNEL_CAPABILITIES:
        return None
    return Kernels(capability, max(1, torch.get_num_threads()))


def agreed_kernels(stages: Sequence[Kernels | None]) -> tuple[Kernels | None, str]:
    """The kernels a worker of several stages records, from what each stage ran (in stage order):
    the ones they all ran, with ""; else None and why (one line, for the worker's log)."""
    if any(k is None for k in stages):
        named = [s for s, k in enumerate(stages) if k is None]
        return None, f"pipeline stage(s) {named} ran on an accelerator or an unlisted CPU capability"
    if len(set(stages)) > 1:
        return None, "the pipeline stages ran different kernels (" + "; ".join(
            f"stage {s}: {k}" for s, k in enumerate(stages)) + ")"
    return stages[0], ""


def cpu_runs(capability: str) -> bool:
    """Whether this machine's CPU can run torch's kernels of ``capability``, whatever this process's
    ``ATEN_CPU_CAPABILITY`` (torch.cpu asks the CPU itself). Off x86 only the generic kernels and
    the capability this process runs are known to be runnable."""
    if capability == "default":
        return True
    if capability == "avx2":
        return bool(torch.cpu._is_avx2_supported())
    if capability == "avx512":
        return bool(torch.cpu._is_avx512_supported())
    return capability == torch.backends.cpu.get_cpu_capability().lower()
