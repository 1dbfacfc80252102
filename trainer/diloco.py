"""DiLoCo's dual optimiser: H inner AdamW steps per worker, one outer Nesterov step per round.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models"
(arXiv:2311.08105), the base that DiLoCoX (Qi et al., arXiv:2506.21263) builds on.

Round r starts from the global parameters θ⁽ʳ⁻¹⁾. Each participating worker i runs H steps of
AdamW on its own shard (its inner optimiser state persists across rounds in the worker process):

    θᵢ ← θ⁽ʳ⁻¹⁾
    for h = 1..H:   θᵢ ← AdamW(θᵢ, ∇ℓ(θᵢ; batch_{i,r,h}))        (lr 4e-4, wd 0.1, β = (0.9, 0.95))
    Δᵢ⁽ʳ⁾ = θ⁽ʳ⁻¹⁾ − θᵢ                                            (the pseudo-gradient)

The coordinator averages the pseudo-gradients of the round's accepted participants Sᵣ and takes
one step of SGD with Nesterov momentum (μ = 0.9, η = 0.7), starting from m⁽⁰⁾ = 0:

    Δ⁽ʳ⁾ = (1 / |Sᵣ|) Σ_{i∈Sᵣ} Δᵢ⁽ʳ⁾          (trainer.aggregation, summed in sorted worker order)
    m⁽ʳ⁾ = μ m⁽ʳ⁻¹⁾ + Δ⁽ʳ⁾
    θ⁽ʳ⁾ = θ⁽ʳ⁻¹⁾ − η (Δ⁽ʳ⁾ + μ m⁽ʳ⁾)                                (Nesterov)
    θ⁽ʳ⁾ = θ⁽ʳ⁻¹⁾ − η m⁽ʳ⁾                                           (plain momentum, nesterov=False)

This is ``torch.optim.SGD(lr=η, momentum=μ, nesterov=True)`` applied with the gradient set to Δ⁽ʳ⁾,
written out as a pure function so its state is one plain tensor per parameter, stored as
safetensors beside each checkpoint, and computed with one rounding per operation (no fused
multiply-add), so that an auditor on any CPU re-derives the same bits (trainer.transition).

With DiLoCoX's one-step-delay overlap round r starts instead from θ⁽ʳ⁻²⁾ moved by what stands in
for the outer step still in flight: ``delayed_start`` and ``eager_start`` below, the one function
each for the worker (trainer.worker.loops, which states both rules) and the audit's replay.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn as nn

from trainer.config import InnerConfig, OuterConfig
from trainer.device import autocast
from trainer.progress import Progress
from trainer.wire import Params, encode_params


def params_of(model: nn.Module) -> Params:
    """A detached copy of the model's parameters, by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def load_params(model: nn.Module, params: Params) -> None:
    """Copy ``params`` into the model; names, shapes and dtypes must match exactly."""
    own = dict(model.named_parameters())
    missing, unexpected = sorted(set(own) - set(params)), sorted(set(params) - set(own))
    if missing or unexpected:
        raise ValueError(f"parameter names differ: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, p in own.items():
            src = params[name]
            if src.shape != p.shape or src.dtype != p.dtype:
                raise ValueError(
                    f"parameter {name}: got {src.dtype}{list(src.shape)}, "
                    f"model has {p.dtype}{list(p.shape)}"
                )
            p.copy_(src)


def bind_params(model: nn.Module, params: Params) -> None:
    """Make ``model`` compute with ``params``' own tensors, without a copy (a model that only
    evaluates the tensors someone else holds need not keep a second copy of them). Names, shapes
    and dtypes must match exactly. While bound, the model's parameters are those tensors: nothing
    may train the model or ``load_params`` into it, which would write into ``params``."""
    own = dict(model.named_parameters())
    missing, unexpected = sorted(set(own) - set(params)), sorted(set(params) - set(own))
    if missing or unexpected:
        raise ValueError(f"parameter names differ: missing {missing}, unexpected {unexpected}")
    for name, p in own.items():
        src = params[name]
        if src.shape != p.shape or src.dtype != p.dtype:
            raise ValueError(f"parameter {name}: got {src.dtype}{list(src.shape)}, model has {p.dtype}{list(p.shape)}")
    with torch.no_grad():
        for name, p in own.items():
            p.data = params[name]


@dataclass(frozen=True)
class InnerResult:
    pseudo_gradient: Params
    mean_loss: float
    tokens: int
    steps: int


class InnerLoop:
    """A worker's H local AdamW steps; the AdamW state lives as long as the worker process.

    The state a round starts from is committed: ``state()`` names its tensors (``exp_avg.<p>``,
    ``exp_avg_sq.<p>``, ``step.<p>``; empty before the first step) and ``inner_state_digest`` hashes
    them, so a worker's push names the state its update grew from and ``dilocox audit --replay``
    can re-run the round from the same place. A round whose update does not count is undone
    (``snapshot`` / ``restore``): the AdamW state moves only through counted rounds, so an auditor
    rebuilds it from the run's manifests alone, round after counted round, from a fresh start.

    On a CUDA ``device`` (trainer.device) the loop trains its own copy of ``model`` there, under
    bf16 autocast, and hands Δ back on the CPU; on the CPU it trains ``model`` itself, in float32.
    """

    def __init__(self, model: nn.Module, cfg: InnerConfig, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        # ``model`` stays on the CPU (the worker evaluates checkpoints with it); an accelerator gets a copy.
        self.model = model if self.device.type == "cpu" else copy.deepcopy(model).to(self.device)
        self.cfg = cfg
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
            weight_decay=cfg.weight_decay,
        )

    def run(self, start: Params, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
            progress: Progress | None = None) -> InnerResult:
        """H AdamW steps from ``start``, one a batch; ``progress`` counts the steps and their tokens."""
        load_params(self.model, start)
        self.model.train()
        losses: list[float] = []
        tokens = 0
        for x, y in batches:
            x, y = x.to(self.device), y.to(self.device)  # the same tensors on the CPU
            with autocast(self.device):
                _, loss = self.model(x, y)
            assert loss is not None
            if not torch.isfinite(loss):
                raise FloatingPointError(f"inner step {len(losses) + 1}: loss is {loss.item()}")
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
            losses.append(loss.item())
            tokens += x.numel()
            if progress is not None:
                progress.advance(1, amount=x.numel())
        if not losses:
            raise ValueError("an inner loop needs at least one batch")
        end = params_of(self.model)
        delta = {name: start[name] - end[name].cpu() for name in start}
        return InnerResult(delta, sum(losses) / len(losses), tokens, len(losses))

    def state(self) -> Params:
        """The AdamW state by parameter name (empty while no step has been taken)."""
        out: Params = {}
        for name, p in self.model.named_parameters():
            for key, value in sorted(self.optimizer.state.get(p, {}).items()):
                out[f"{key}.{name}"] = value.detach().cpu().reshape(value.shape)
        return out

    def snapshot(self) -> dict:
        """A copy of the AdamW state, to ``restore`` if the round about to run does not count."""
        return copy.deepcopy(self.optimizer.state_dict())

    def restore(self, snapshot: dict) -> None:
        self.optimizer.load_state_dict(snapshot)


def inner_state_digest(*states: Params) -> str:
    """sha256 (hex) of a worker's inner state: its AdamW state and, when the uplink is compressed,
    its error-feedback buffers, in one byte-deterministic safetensors file
    (``trainer.wire.encode_params``). ``FRESH_STATE`` is the digest of a worker that has taken no step."""
    merged: Params = {}
    for state in states:
        merged.update(state)
    return hashlib.sha256(encode_params(merged)).hexdigest()


def zero_momentum(params: Params) -> Params:
    """m⁽⁰⁾ = 0: the outer optimiser state of a run's genesis."""
    return {name: torch.zeros_like(p) for name, p in params.items()}


def outer_step(cfg: OuterConfig, params: Params, momentum: Params, delta: Params) -> tuple[Params, Params]:
    """(θ⁽ʳ⁾, m⁽ʳ⁾) from θ⁽ʳ⁻¹⁾, m⁽ʳ⁻¹⁾ and Δ⁽ʳ⁾; see the module docstring. One rounding per
    operation, no fused multiply-add (trainer.transition's rules), μ and η rounded to each tensor's
    dtype first:

        m⁽ʳ⁾ = fl(fl(μ·m⁽ʳ⁻¹⁾) + Δ⁽ʳ⁾)
        d    = fl(Δ⁽ʳ⁾ + fl(μ·m⁽ʳ⁾))          (Nesterov; d = m⁽ʳ⁾ without)
        θ⁽ʳ⁾ = fl(θ⁽ʳ⁻¹⁾ − fl(η·d))

    Pure: the inputs are left untouched, so a round that fails half-way through being published
    leaves the previous global state intact.
    """
    new_params: Params = {}
    new_momentum: Params = {}
    for name, theta in params.items():
        new_params[name], new_momentum[name] = outer_step_tensor(cfg, name, theta, momentum[name], delta[name])
    return new_params, new_momentum


def outer_step_tensor(cfg: OuterConfig, name: str, theta: torch.Tensor, momentum: torch.Tensor,
                      delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``outer_step`` of one parameter tensor ``name``: (θ⁽ʳ⁾, m⁽ʳ⁾) of it, the inputs untouched."""
    mu = torch.tensor(cfg.momentum, dtype=theta.dtype)
    lr = torch.tensor(cfg.lr, dtype=theta.dtype)
    m = torch.mul(momentum, mu).add_(delta)
    direction = torch.add(delta, torch.mul(m, mu)) if cfg.nesterov else m
    new_theta = torch.sub(theta, torch.mul(direction, lr))
    if not bool(torch.isfinite(new_theta).all()):  # e.g. an outer lr of 1e30
        raise OuterStepError(f"the outer step made {name} non-finite (outer lr {cfg.lr:g}, momentum "
                             f"{cfg.momentum:g}); nothing is published")
    return new_theta, m


class OuterStepError(ArithmeticError):
    """An outer step whose result is not finite: the round cannot be published."""


MOMENTUM_PREFIX = "momentum."
DOWNLINK_ERROR_PREFIX = "downlink_error."  # e⁽ʳ⁾ of the compressed downlink (trainer.downlink)


def outer_state_of(momentum: Params, downlink_error: Params | None = None) -> Params:
    """The outer optimiser state as stored beside a checkpoint: ``momentum.<param>`` tensors, and
    ``downlink_error.<param>`` tensors when the global update travels compressed."""
    state = {MOMENTUM_PREFIX + name: m for name, m in momentum.items()}
    if downlink_error:
        state.update({DOWNLINK_ERROR_PREFIX + name: e for name, e in downlink_error.items()})
    return state


def _split_outer_state(state: Params) -> tuple[Params, Params]:
    unexpected = sorted(k for k in state if not k.startswith((MOMENTUM_PREFIX, DOWNLINK_ERROR_PREFIX)))
    if unexpected:
        raise ValueError(f"outer state has tensors named neither momentum.<param> nor "
                         f"downlink_error.<param>: {unexpected}")
    momentum = {k[len(MOMENTUM_PREFIX):]: v for k, v in state.items() if k.startswith(MOMENTUM_PREFIX)}
    error = {k[len(DOWNLINK_ERROR_PREFIX):]: v for k, v in state.items() if k.startswith(DOWNLINK_ERROR_PREFIX)}
    if error and set(error) != set(momentum):
        raise ValueError("outer state's downlink_error tensors do not name the same parameters as its momentum")
    return momentum, error


def momentum_of(state: Params) -> Params:
    """The momentum tensors of a stored outer state, keyed by parameter name."""
    return _split_outer_state(state)[0]


def downlink_error_of(state: Params) -> Params:
    """The downlink error buffer of a stored outer state (empty before the first compressed round)."""
    return _split_outer_state(state)[1]


@torch.no_grad()
def evaluate_batches(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Cross-entropy (nats per token) of each of fixed held-out batches, in order."""
    model.eval()
    return [model(x, y)[1].item() for x, y in batches]  # type: ignore[union-attr]


def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross-entropy (nats per token) over fixed held-out batches."""
    losses = evaluate_batches(model, batches)
    return sum(losses) / len(losses)


FRESH_STATE = inner_state_digest()  # no AdamW step taken, no error carried


def delayed_start(newest: Params, sent: Params) -> Params:
    """Where an overlapped round starts with the delayed rule (trainer.worker.loops):
    s⁽ʳ⁾ = θ⁽ʳ⁻²⁾ − Δ̂ᵢ⁽ʳ⁻¹⁾, elementwise in the tensors' own dtype; the worker's and the replay's
    one computation (audit.replay)."""
    return {k: newest[k] - sent[k] for k in newest}


def eager_weight(outer: OuterConfig, workers: int) -> float:
    """c of the eager start: the weight a fresh outer gradient gets in one outer step,
    η_out (1 + μ) / W with Nesterov, η_out / W without (trainer.worker.loops)."""
    return outer.lr * ((1.0 + outer.momentum) if outer.nesterov else 1.0) / workers


def eager_start(newest: Params, sent: Params, weight: float, history: tuple[Params, Params] | None) -> Params:
    """Where an overlapped round starts with the eager rule (trainer.worker.loops):

        s⁽ʳ⁾ = θ⁽ʳ⁻²⁾ − Ũᵢ⁽ʳ⁻¹⁾,   Ũᵢ⁽ʳ⁻¹⁾ = (θ⁽ʳ⁻³⁾ − θ⁽ʳ⁻²⁾) + c (Δ̂ᵢ⁽ʳ⁻¹⁾ − Δ̂ᵢ⁽ʳ⁻²⁾)

    with ``newest`` = θ⁽ʳ⁻²⁾, ``sent`` = Δ̂ᵢ⁽ʳ⁻¹⁾, c = ``weight`` and ``history`` = (θ⁽ʳ⁻³⁾, Δ̂ᵢ⁽ʳ⁻²⁾);
    without history (the worker's first overlapped start since it started or started over) both
    terms of round r−3 / r−2 are zero: Ũᵢ⁽ʳ⁻¹⁾ = c Δ̂ᵢ⁽ʳ⁻¹⁾. Elementwise, in this order, in the
    tensors' own dtype: the worker's and the replay's one computation (audit.replay)."""
    start: Params = {}
    for k, theta in newest.items():
        proxy = (sent[k] - history[1][k] if history is not None else sent[k]) * weight
        if history is not None:
            proxy = proxy + (history[0][k] - theta)
        start[k] = theta - proxy
    return start
