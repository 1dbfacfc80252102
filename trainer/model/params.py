"""A model's parameters as plain tensors by name: copied out, copied in, or bound without a copy."""

from __future__ import annotations

import torch
import torch.nn as nn

from trainer.codec.wire import Params


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

