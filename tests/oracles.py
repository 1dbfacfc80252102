"""Reference implementations the tests compare the product's code with (kept out of the product)."""

from __future__ import annotations

from typing import Mapping

from trainer.codec.wire import Params


def mean_pseudo_gradient(updates: Mapping[str, Params]) -> Params:
    """Δ⁽ʳ⁾: the mean of the accepted pseudo-gradients, summed in sorted worker order (the plain
    DiLoCo mean, which trainer.rounds.aggregation.aggregate must equal with clipping off)."""
    if not updates:
        raise ValueError("cannot aggregate a round with no accepted updates")
    workers = sorted(updates)
    total = {name: t.clone() for name, t in updates[workers[0]].items()}
    for worker in workers[1:]:
        for name, t in updates[worker].items():
            total[name].add_(t)
    return {name: t.div_(len(workers)) for name, t in total.items()}
