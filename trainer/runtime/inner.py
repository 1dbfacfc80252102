"""DiLoCo's inner loop: a worker's H optimiser steps on its shard, and held-out evaluation.

Douillard et al., "DiLoCo" (arXiv:2311.08105); DiLoCoX (Qi et al., arXiv:2506.21263). Round r
starts from θ_start (θ⁽ʳ⁻¹⁾, or with the one-step-delay overlap the start of
trainer.rounds.outer.delayed_start / eager_start). Worker i runs H steps of the inner optimiser on
its own batches; the optimiser's state persists across the rounds that count:

    θᵢ ← θ_start
    for h = 1..H:   θᵢ ← Opt(θᵢ, ∇ℓ(θᵢ; batch_{i,r,h}))          (InnerConfig: lr, wd, β₁, β₂, optimizer)
    Δᵢ⁽ʳ⁾ = θ_start − θᵢ                                          (the pseudo-gradient)

Opt is AdamW (torch.optim.AdamW) or, with ``inner.optimizer = "muon"``, Muon on the blocks' matrices
and AdamW on the rest (trainer.runtime.muon); ``inner_optimizer`` builds it for every party that
trains or replays.

What the coordinator does with Δᵢ⁽ʳ⁾ (the average and the outer Nesterov step) is
trainer.rounds.outer; the audit's replay (audit.replay) re-runs this loop from the committed state.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn as nn

from trainer.codec.wire import (
    Params,
    ParamsPayload,
    cid_of_chunks,
    encode_params,
    layout_of,
    params_chunks,
    streamable,
)
from trainer.config import InnerConfig
from trainer.model.params import load_params
from trainer.progress import Progress
from trainer.runtime.device import autocast
from trainer.runtime.muon import MuonWithAdamW
from trainer.runtime.staged import StagedArithmetic


# Called by ``InnerLoop.run`` with (j, model, optimiser) at step 0 and after each step j.
StepObserver = Callable[[int, nn.Module, torch.optim.Optimizer], None]


@dataclass(frozen=True)
class InnerResult:
    pseudo_gradient: Params
    mean_loss: float
    tokens: int
    steps: int


class InnerLoop:
    """A worker's H local optimiser steps; the optimiser's state lives as long as the worker process.

    The state a round starts from is committed: ``state()`` names its tensors (``exp_avg.<p>``,
    ``exp_avg_sq.<p>``, ``step.<p>``; empty before the first step) and ``inner_state_digest`` hashes
    them, so a worker's push names the state its update grew from and ``dilocox audit --replay``
    can re-run the round from the same place. A round whose update does not count is undone
    (``snapshot`` / ``restore``): the optimiser's state moves only through counted rounds, so an auditor
    rebuilds it from the run's manifests alone, round after counted round, from a fresh start.

    On a CUDA ``device`` (trainer.runtime.device) the loop trains its own copy of ``model`` there, under
    bf16 autocast, and hands Δ back on the CPU; on the CPU it trains ``model`` itself, in float32.
    """

    def __init__(self, model: nn.Module, cfg: InnerConfig, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        # ``model`` stays on the CPU (the worker evaluates checkpoints with it); an accelerator gets a copy.
        self.model = model if self.device.type == "cpu" else copy.deepcopy(model).to(self.device)
        self.cfg = cfg
        self.optimizer = inner_optimizer(self.model, cfg)

    def run(self, start: Params, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
            progress: Progress | None = None, staged: StagedArithmetic | None = None, *,
            observer: StepObserver | None = None) -> InnerResult:
        """H optimiser steps from ``start``, one a batch; ``progress`` counts the steps and their tokens.
        ``staged``: compute each step's gradients as a worker of several pipeline stages does
        (trainer.runtime.staged: microbatches, the stages' clipping), to replay one. ``observer``
        is called as ``observer(j, model, optimizer)`` with j = 0 once ``start`` is loaded and with
        j = 1, 2, … after each step (the training state θ_j and the optimiser's state after j steps:
        trainer.runtime.step_commit); it must not write into either."""
        load_params(self.model, start)
        self.model.train()
        losses: list[float] = []
        tokens = 0
        if observer is not None:
            observer(0, self.model, self.optimizer)
        for x, y in batches:
            x, y = x.to(self.device), y.to(self.device)  # the same tensors on the CPU
            if staged is not None:
                self.optimizer.zero_grad(set_to_none=True)
                loss_value = staged.gradients(self.model, x, y, self.cfg.grad_clip)
            else:
                loss_value = self._gradients(x, y, len(losses) + 1)
            self.optimizer.step()
            losses.append(loss_value)
            tokens += x.numel()
            if observer is not None:
                observer(len(losses), self.model, self.optimizer)
            if progress is not None:
                progress.advance(1, amount=x.numel())
        if not losses:
            raise ValueError("an inner loop needs at least one batch")
        # θ_start − θᵢ tensor by tensor from the model's own parameters: no whole copy of θᵢ beside Δ.
        end = dict(self.model.named_parameters())
        delta = {name: start[name] - end[name].detach().cpu() for name in start}
        return InnerResult(delta, sum(losses) / len(losses), tokens, len(losses))

    def _gradients(self, x: torch.Tensor, y: torch.Tensor, step: int) -> float:
        """One step's clipped full-batch gradients left in the model's ``.grad``; the step's loss."""
        with autocast(self.device):
            _, loss = self.model(x, y)
        assert loss is not None
        if not torch.isfinite(loss):
            raise FloatingPointError(f"inner step {step}: loss is {loss.item()}")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        return loss.item()

    def state(self) -> Params:
        """The optimiser's state by parameter name (empty while no step has been taken)."""
        return optimizer_state(self.model, self.optimizer)

    def snapshot(self) -> Params:
        """A copy of the optimiser's state, to ``restore`` if the round about to run does not count: the
        same copy ``state`` gives, so a worker holds one copy of the state its round starts from for
        the commitment, the upload and the undo (the hyper-parameters are the config's, never changed)."""
        return self.state()

    def restore(self, snapshot: Params) -> None:
        load_optimizer_state(self.model, self.optimizer, snapshot)


def inner_optimizer(module: nn.Module, cfg: InnerConfig) -> torch.optim.Optimizer:
    """The inner optimiser of ``module``'s parameters that ``cfg.optimizer`` names (module docstring)."""
    if cfg.optimizer == "muon":
        return MuonWithAdamW(module.named_parameters(), cfg)
    return torch.optim.AdamW(module.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             weight_decay=cfg.weight_decay)


def set_inner_hyperparameters(optimizer: torch.optim.Optimizer, cfg: InnerConfig) -> None:
    """A round's hyper-parameters on an optimiser ``inner_optimizer`` built (its state carries over)."""
    if isinstance(optimizer, MuonWithAdamW):
        optimizer.set_hyperparameters(cfg)
        return
    for group in optimizer.param_groups:
        group.update(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)


# The names an inner optimiser's per-parameter state goes by (AdamW's, and Muon's momentum).
STATE_KEYS = ("exp_avg", "exp_avg_sq", "momentum", "step")


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> Params:
    """``optimizer``'s state of ``module``'s parameters by name (``exp_avg.<p>``, ``exp_avg_sq.<p>``,
    ``step.<p>``; ``momentum.<p>`` for Muon's), copied to the CPU; empty while no step has been taken.
    A pipeline stage's is the slice of the one-process state its parameters name (trainer.runtime.pipeline)."""
    out: Params = {}
    for name, p in module.named_parameters():
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            # A copy: AdamW's next step updates its tensors in place (a stage's start state outlives it).
            out[f"{key}.{name}"] = value.detach().to("cpu", copy=True).reshape(value.shape)
    return out


def load_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: Params) -> None:
    """Put back a state ``optimizer_state`` gave (empty: no step taken, a fresh optimiser); the step
    counts stay on the CPU, where AdamW keeps them."""
    optimizer.state.clear()
    for name, p in module.named_parameters():
        entry = {key: state[f"{key}.{name}"] for key in STATE_KEYS if f"{key}.{name}" in state}
        if entry:
            optimizer.state[p] = {key: value.clone() if key == "step" else value.to(p.device, copy=True)
                                  for key, value in entry.items()}


def _merged(states: tuple[Params, ...]) -> Params:
    merged: Params = {}
    for state in states:
        merged.update(state)
    return merged


def inner_state_bytes(*states: Params) -> bytes | bytearray:
    """A worker's inner state (its optimiser state and, when the uplink is compressed, its error-feedback
    buffers) in one byte-deterministic safetensors file (``trainer.codec.wire.encode_params``): what
    it uploads once per window of ``rounds.state_every`` rounds (trainer.runtime.state_commit). Its
    float32 tensors are written a tensor at a time into the one buffer (``ParamsPayload``: the same
    bytes), where safetensors' own writer would hold the file twice at its peak."""
    merged = _merged(states)
    layout = layout_of(merged)
    if not streamable(layout):
        return encode_params(merged)
    payload = ParamsPayload(layout)
    for name, t in merged.items():
        payload.put(name, t)
    return payload.payload()


def inner_state_digest(*states: Params) -> str:
    """sha256 (hex) of ``inner_state_bytes``: what a push commits to. ``FRESH_STATE`` is the digest of
    a worker that has taken no step. Hashed as the bytes are made, a tensor (at most 8 MiB) at a time
    (``trainer.codec.wire.params_chunks``: the same bytes), never the whole file at once."""
    return cid_of_chunks(params_chunks(_merged(states))).digest.hex()


@torch.no_grad()
def evaluate_batches(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Cross-entropy (nats per token) of each of fixed held-out batches, in order."""
    model.eval()
    return [model(x, y)[1].item() for x, y in batches]  # type: ignore[union-attr]


def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross-entropy (nats per token) over fixed held-out batches."""
    losses = evaluate_batches(model, batches)
    return sum(losses) / len(losses)


FRESH_STATE = inner_state_digest()  # no inner step taken, no error carried

