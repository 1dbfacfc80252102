"""Muon on a worker's hidden matrices, AdamW on the rest: the inner optimiser ``inner.optimizer = "muon"``.

Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (2024) for the update;
Liu et al., "Muon is Scalable for LLM Training" (arXiv:2502.16982) for its scale and weight decay;
Thérien et al., "MuLoCo: Muon is a practical inner optimizer for DiLoCo" (arXiv:2505.23725) for its
use as DiLoCo's inner optimiser. Our own implementation.

A hidden matrix W (m × n) is a 2-D parameter of a transformer block (trainer.model.stages.hidden_matrix:
not the embeddings, the final norm or the output head). With its gradient G, momentum μ
(``inner.muon_momentum``), learning rate η (``inner.muon_lr``) and weight decay λ (``inner.weight_decay``):

    B  ← μ B + G                                   (state ``momentum``)
    M  = G + μ B                                   (Nesterov)
    O  = NS₅(M / (‖M‖_F + 10⁻⁷))                   (≈ U Vᵀ for M = U Σ Vᵀ)
    W  ← (1 − η λ) W − η · 0.2 √max(m, n) · O

NS₅ is five Newton–Schulz iterations X ← a X + (b A + c A²) X, A = X Xᵀ, (a, b, c) = (3.4445, −4.7750,
2.0315), run on the wide orientation (on Xᵀ when m > n) in float32. O's entries have an RMS of about
1/√max(m, n), so the factor 0.2 √max(m, n) gives the update AdamW's typical RMS of 0.2·η (Liu et al.):
η and λ mean what they mean for AdamW.

Every other parameter p takes AdamW (Loshchilov & Hutter; ``inner.lr``, β₁, β₂, λ), in the order
torch.optim.AdamW computes it:

    p ← (1 − η λ) p,   m ← β₁ m + (1 − β₁) g,   v ← β₂ v + (1 − β₂) g²
    p ← p − η / (1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + 10⁻⁸)

Every parameter that has taken a step keeps ``step`` t (a float32 scalar, as AdamW keeps it), so a
worker's committed inner state (trainer.runtime.state_commit) names, per parameter, either
``exp_avg``, ``exp_avg_sq`` and ``step`` or ``momentum`` and ``step``. The arithmetic is plain torch
on the parameters' device, the same from the same state on the same kernels: the audit's replay re-runs it.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from trainer.config import InnerConfig
from trainer.model.stages import hidden_matrix

_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_NS_STEPS = 5
_RMS_MATCH = 0.2  # AdamW's typical update RMS per unit of learning rate (Liu et al.)
_ADAMW_EPS = 1e-8


def orthogonalised(m: torch.Tensor) -> torch.Tensor:
    """NS₅(M / ‖M‖_F) of the module docstring: a float32 matrix close to U Vᵀ for M = U Σ Vᵀ."""
    a, b, c = _NS_COEFFICIENTS
    x = m.float() / (m.float().norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(_NS_STEPS):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the hidden matrices of ``named`` (module docstring), AdamW on the other parameters:
    two parameter groups, ``muon`` True and False, in that order."""

    def __init__(self, named: Iterable[tuple[str, torch.nn.Parameter]], cfg: InnerConfig) -> None:
        hidden, other = [], []
        for name, p in named:
            (hidden if hidden_matrix(name, tuple(p.shape)) else other).append(p)
        super().__init__([{"params": hidden, "muon": True}, {"params": other, "muon": False}],
                         _hyperparameters(cfg, muon=False))
        self.set_hyperparameters(cfg)

    def set_hyperparameters(self, cfg: InnerConfig) -> None:
        """The round's hyper-parameters (the state carries over between rounds)."""
        for group in self.param_groups:
            group.update(_hyperparameters(cfg, muon=group["muon"]))

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    if group["muon"]:
                        state["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    else:
                        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                (_muon_step if group["muon"] else _adamw_step)(p, p.grad, state, group)


def _hyperparameters(cfg: InnerConfig, *, muon: bool) -> dict[str, float | tuple[float, float]]:
    return {"lr": cfg.muon_lr if muon else cfg.lr, "weight_decay": cfg.weight_decay,
            "betas": (cfg.beta1, cfg.beta2), "momentum": cfg.muon_momentum}


def _muon_step(p: torch.Tensor, g: torch.Tensor, state: dict, group: dict) -> None:
    lr, mu = group["lr"], group["momentum"]
    buffer = state["momentum"]
    buffer.mul_(mu).add_(g)
    update = orthogonalised(g.add(buffer, alpha=mu)).to(p.dtype)
    p.mul_(1.0 - lr * group["weight_decay"])
    p.add_(update, alpha=-lr * _RMS_MATCH * math.sqrt(max(p.shape)))


def _adamw_step(p: torch.Tensor, g: torch.Tensor, state: dict, group: dict) -> None:
    lr, (beta1, beta2) = group["lr"], group["betas"]
    t = float(state["step"])
    p.mul_(1.0 - lr * group["weight_decay"])
    state["exp_avg"].lerp_(g, 1.0 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denominator = (state["exp_avg_sq"].sqrt() / math.sqrt(1.0 - beta2 ** t)).add_(_ADAMW_EPS)
    p.addcdiv_(state["exp_avg"], denominator, value=-lr / (1.0 - beta1 ** t))
