"""DiLoCo's outer step: the average of a round's pseudo-gradients applied with Nesterov momentum,
and where an overlapped round starts.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models"
(arXiv:2311.08105), the base that DiLoCoX (Qi et al., arXiv:2506.21263) builds on. Each worker i
sends Δᵢ⁽ʳ⁾ = θ_start − θᵢ after its H inner AdamW steps (trainer.runtime.inner). The coordinator
averages the pseudo-gradients of the round's accepted participants Sᵣ and takes one step of SGD
with momentum (μ, η from OuterConfig), starting from m⁽⁰⁾ = 0:

    Δ⁽ʳ⁾ = (1 / |Sᵣ|) Σ_{i∈Sᵣ} Δᵢ⁽ʳ⁾          (trainer.rounds.aggregation, summed in sorted worker order)
    m⁽ʳ⁾ = μ m⁽ʳ⁻¹⁾ + Δ⁽ʳ⁾
    θ⁽ʳ⁾ = θ⁽ʳ⁻¹⁾ − η (Δ⁽ʳ⁾ + μ m⁽ʳ⁾)                                (Nesterov)
    θ⁽ʳ⁾ = θ⁽ʳ⁻¹⁾ − η m⁽ʳ⁾                                           (plain momentum, nesterov=False)

This is ``torch.optim.SGD(lr=η, momentum=μ, nesterov=True)`` applied with the gradient set to Δ⁽ʳ⁾,
written out as a pure function so its state is one plain tensor per parameter, stored as
safetensors beside each checkpoint, and computed with one rounding per operation (no fused
multiply-add), so that an auditor on any CPU re-derives the same bits (trainer.rounds.transition).

With DiLoCoX's one-step-delay overlap round r starts instead from θ⁽ʳ⁻²⁾ moved by what stands in
for the outer step still in flight: ``delayed_start`` and ``eager_start`` below, the one function
each for the worker (trainer.worker.loops, which states both rules) and the audit's replay.
"""

from __future__ import annotations

import torch

from trainer.codec.wire import Params
from trainer.config import OuterConfig


def zero_momentum(params: Params) -> Params:
    """m⁽⁰⁾ = 0: the outer optimiser state of a run's genesis."""
    return {name: torch.zeros_like(p) for name, p in params.items()}


def outer_step(cfg: OuterConfig, params: Params, momentum: Params, delta: Params) -> tuple[Params, Params]:
    """(θ⁽ʳ⁾, m⁽ʳ⁾) from θ⁽ʳ⁻¹⁾, m⁽ʳ⁻¹⁾ and Δ⁽ʳ⁾; see the module docstring. One rounding per
    operation, no fused multiply-add (trainer.rounds.transition's rules), μ and η rounded to each tensor's
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
DOWNLINK_ERROR_PREFIX = "downlink_error."  # e⁽ʳ⁾ of the compressed downlink (trainer.codec.downlink)


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
