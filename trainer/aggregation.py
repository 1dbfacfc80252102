"""Where a round is aggregated: checking each pushed pseudo-gradient, then averaging them.

Nothing enters the average unless it passed every check below; each failure names what was wrong
so the worker (and the operator reading the coordinator's log) can tell a bug from an attack.

Checks, in the order they run (cheap ones first, before a byte is decoded):
  1. declared layout: the same tensor names as the model, each with its dtype and shape;
  2. payload: exactly the declared number of bytes, hashing to the declared sha256;
  3. decoded tensors: exactly the declared layout (the header cannot lie about the bytes);
  4. every value finite;
  5. L2 norm of the whole update at most ``bound``.

Mean (see trainer.diloco for the outer step that follows):

    Δ⁽ʳ⁾ = (1 / |Sᵣ|) Σ_{i∈Sᵣ} Δᵢ⁽ʳ⁾,  summed in sorted worker-id order,

so the result does not depend on the order in which updates arrived and any replica, or an
auditor holding the stored updates, re-derives it bit for bit.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from trainer.config import RunConfig
from trainer.compression import CompressionError, decompress
from trainer.wire import (
    ENCODING_DENSE_F32, ENCODING_LOWRANK_INT4, Layout, Params, WireError, decode_params, layout_of,
)


class InvalidUpdate(ValueError):
    """A pushed update that must not enter the average; the message names the problem."""


def _describe(spec: tuple[str, tuple[int, ...]]) -> str:
    return f"{spec[0]}{list(spec[1])}"


def check_layout(declared: Layout, expected: Layout) -> None:
    missing = sorted(set(expected) - set(declared))
    unexpected = sorted(set(declared) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing}")
        if unexpected:
            parts.append(f"unexpected tensors {unexpected}")
        raise InvalidUpdate("tensor names do not match the model: " + ", ".join(parts))
    for name in sorted(expected):
        if declared[name][0] != expected[name][0]:
            raise InvalidUpdate(
                f"tensor {name}: dtype {declared[name][0]}, expected {expected[name][0]}"
            )
        if tuple(declared[name][1]) != tuple(expected[name][1]):
            raise InvalidUpdate(
                f"tensor {name}: shape {list(declared[name][1])}, expected {list(expected[name][1])}"
            )


def decode_update(payload: bytes, declared: Layout) -> Params:
    try:
        tensors = decode_params(payload)
    except WireError as exc:
        raise InvalidUpdate(str(exc)) from exc
    actual = layout_of(tensors)
    if actual != declared:
        differing = sorted(
            name for name in set(actual) | set(declared) if actual.get(name) != declared.get(name)
        )
        name = differing[0]
        got = _describe(actual[name]) if name in actual else "absent"
        said = _describe(declared[name]) if name in declared else "absent"
        raise InvalidUpdate(f"payload disagrees with its header at tensor {name}: {got} vs {said}")
    return tensors


def check_finite(update: Params) -> None:
    for name in sorted(update):
        t = update[name]
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            count = int(bad.sum())
            kinds = []
            if bool(torch.isnan(t).any()):
                kinds.append("NaN")
            if bool(torch.isinf(t).any()):
                kinds.append("Inf")
            raise InvalidUpdate(f"tensor {name} has {count} non-finite value(s) ({'/'.join(kinds)})")


def l2_norm(update: Params) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in update.values()))


def norm_bound(cfg: RunConfig, n_params: int) -> float:
    """The largest pseudo-gradient norm a correct worker can plausibly produce.

    An AdamW step moves each coordinate by about lr (|m̂/√v̂| ≲ 1, plus lr·wd·|θ| of decay), so
    after H steps ‖Δ‖₂ ≲ H·lr·√P. A factor of 10 leaves room for Adam's early transients; an
    explicit ``rounds.max_update_norm`` overrides the derivation.
    """
    if cfg.rounds.max_update_norm > 0:
        return cfg.rounds.max_update_norm
    return 10.0 * cfg.inner.steps * cfg.inner.lr * (1.0 + cfg.inner.weight_decay) * math.sqrt(n_params)


def check_norm(update: Params, bound: float) -> float:
    norm = l2_norm(update)
    if norm > bound:
        raise InvalidUpdate(f"update L2 norm {norm:.4g} exceeds the bound {bound:.4g}")
    return norm


def validate_payload(payload: bytes, declared: Layout, bound: float, *, encoding: str = ENCODING_DENSE_F32,
                     codec_header: Mapping[str, Any] | None = None) -> Params:
    """Checks 3-5, for a payload whose declared layout (1) and digest (2) already passed.

    A compressed payload is validated against its codec header (factor shapes, rank, group
    scales, packed lengths) before anything is decompressed, then checked as the dense update it
    reconstructs to.
    """
    if encoding == ENCODING_LOWRANK_INT4:
        try:
            update = decompress(payload, codec_header or {}, declared)
        except CompressionError as exc:
            raise InvalidUpdate(f"compressed update refused: {exc}") from exc
    else:
        update = decode_update(payload, declared)
    check_finite(update)
    check_norm(update, bound)
    return update


def mean_pseudo_gradient(updates: Mapping[str, Params]) -> Params:
    """Δ⁽ʳ⁾: the mean of the accepted pseudo-gradients, summed in sorted worker order."""
    if not updates:
        raise ValueError("cannot aggregate a round with no accepted updates")
    workers = sorted(updates)
    total = {name: t.clone() for name, t in updates[workers[0]].items()}
    for worker in workers[1:]:
        for name, t in updates[worker].items():
            total[name].add_(t)
    return {name: t.div_(len(workers)) for name, t in total.items()}
