"""The pipeline's arithmetic in one process: one inner step as P stage processes compute it.

A worker of P pipeline stages (trainer.runtime.pipeline) trains with a gradient that is, in exact
arithmetic, the one-process gradient, but rounds differently: each batch is cut into n
microbatches and each stage clips by a norm summed across stages. The audit's replay
(audit.replay) rebuilds such a worker's update in one process with this module, so that the
replay is the worker's arithmetic, not an approximation of it. For a batch (x, y) of B sequences
cut along the batch into n equal microbatches (``torch.tensor_split``, as
``torch.distributed.pipelining`` cuts them) and stage s holding the tensors t ∈ T_s:

    g_s  = (Σ_m ∇_{θ_s} ℓ_m) / n            accumulated microbatch by microbatch, in order, then
                                             divided (GPipe's ``scale_grads``)
    q_s  = fl64(‖(‖g_t‖₂)_{t ∈ T_s}‖₂)²       ``torch._foreach_norm``, each stage's own (squared_norm)
    ‖g‖  = fl32(sqrt(Σ_s q_s))               the stages' all-reduce: a float64 sum
    g_s ← g_s · min(1, c / (‖g‖ + 1e-6))     c = ``grad_clip`` (skipped when c = 0; clip_coefficient)
    ℓ    = fl64(mean_m ℓ_m)                  the step's loss

One process computes the same values: the stages hold the model's own modules, so the forward of
microbatch m through the stages is the model's forward on microbatch m, and its backward
accumulates into the same gradients in the same order. In the same kernels (ATen capability and
intra-op threads, trainer.runtime.kernels) the result is bit-exact against the stage processes:
on one thread (tests/integration/test_pipeline.py), and measured with 1, 2 and 4 threads a stage
for P = 2 and 1 and 2 for P = 3 (docs/verification.md), since each op runs on the same shapes on
either side. The all-reduce's sum is the stage-order sum for P = 2 (two terms commute); for P > 2
gloo may add in another order (a last-bit difference of a float64 before it is rounded to float32,
which rounding to float32 absorbs except at a near-tie; measured equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from trainer.config import ModelConfig
from trainer.model.stages import stage_param_names
from trainer.runtime.island import mean_in_rank_order, replica_slice

# Microbatches per batch a worker's pipeline stages cut (trainer.runtime.pipeline's GPipe): fixed,
# so that the replay of a multi-stage worker's contribution computes with the same.
WORKER_MICROBATCHES = 2


def squared_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """q_s: the float64 squared norm of one stage's gradients, as that stage computes it."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    norms = torch._foreach_norm(list(grads))
    return torch.linalg.vector_norm(torch.stack(norms)).double() ** 2


def clip_coefficient(total_squared: torch.Tensor, clip: float) -> torch.Tensor:
    """min(1, c / (‖g‖ + 1e-6)) for Σ_s q_s = ``total_squared`` (float64), as every stage applies it."""
    total_norm = total_squared.sqrt().float()
    return torch.clamp(clip / (total_norm + 1e-6), max=1.0)


@dataclass(frozen=True)
class StagedArithmetic:
    """How a worker of ``len(stages)`` stages computed its gradients: the parameter names of each
    stage (trainer.model.stages.stage_param_names), its microbatches per batch, and its data-parallel
    ``replicas`` (trainer.runtime.island: each the gradient of its slice of the batch, averaged in
    rank order; with one stage, the model's own full-slice forward and clip_grad_norm_)."""

    stages: tuple[tuple[str, ...], ...]
    microbatches: int
    replicas: int = 1

    def gradients(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float) -> float:
        """The step's clipped gradients left in ``model``'s ``.grad`` (zeroed by the caller), and
        its loss; FloatingPointError on a non-finite loss, as the stages stop."""
        named = dict(model.named_parameters())
        if self.replicas == 1:
            value = self._slice_gradients(model, x, y)
        else:
            per_rank: list[list[torch.Tensor]] = []
            values: list[float] = []
            for k in range(self.replicas):
                for p in named.values():
                    p.grad = None
                values.append(self._slice_gradients(model, replica_slice(x, k, self.replicas),
                                                    replica_slice(y, k, self.replicas)))
                per_rank.append([p.grad for p in named.values() if p.grad is not None])
            with_grad = [p for p in named.values() if p.grad is not None]
            for p, g in zip(with_grad, mean_in_rank_order(per_rank)):
                p.grad = g
            value = sum(values) / len(values)
        if clip > 0 and len(self.stages) == 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # as one process clips (InnerLoop)
        elif clip > 0:
            by_stage = [[named[n].grad for n in names if named[n].grad is not None] for names in self.stages]
            total = torch.zeros((), dtype=torch.float64)
            for grads in by_stage:
                total = total + squared_norm(grads)
            coef = clip_coefficient(total, clip)
            for grads in by_stage:
                if grads:
                    torch._foreach_mul_(grads, coef)
        return value

    def _slice_gradients(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        """One replica's unclipped gradients of (x, y) accumulated into ``.grad``, and its loss: the
        model's own forward with one stage; with several, microbatch by microbatch, then divided by n."""
        if len(self.stages) == 1:
            _, loss = model(x, y)
            assert loss is not None
            if not torch.isfinite(loss):
                raise FloatingPointError(f"inner step: loss is {loss.item()}")
            loss.backward()
            return loss.item()
        if x.shape[0] % self.microbatches:
            raise ValueError(f"batch of {x.shape[0]} sequences cannot be cut into {self.microbatches} "
                             f"equal microbatches")
        losses: list[torch.Tensor] = []
        for xm, ym in zip(torch.tensor_split(x, self.microbatches), torch.tensor_split(y, self.microbatches)):
            _, loss = model(xm, ym)
            assert loss is not None
            loss.backward()
            losses.append(loss.detach())
        value = torch.stack(losses).mean().double().item()
        if value != value or value in (float("inf"), float("-inf")):
            raise FloatingPointError(f"inner step: loss is {value}")
        named = dict(model.named_parameters())
        for names in self.stages:
            for n in names:
                if named[n].grad is not None:
                    named[n].grad.div_(self.microbatches)
        return value


def staged_arithmetic(model: ModelConfig, num_stages: int, microbatches: int = WORKER_MICROBATCHES,
                      replicas: int = 1) -> StagedArithmetic | None:
    """The arithmetic of a worker of ``replicas`` data-parallel replicas of ``num_stages`` stages of
    ``model`` (None for one process, which computes full-batch gradients: trainer.runtime.inner.InnerLoop)."""
    if num_stages == 1 and replicas == 1:
        return None
    return StagedArithmetic(tuple(tuple(names) for names in stage_param_names(model, num_stages)), microbatches,
                            replicas)
