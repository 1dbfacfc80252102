"""``dilocox bench ablation --sweep``: each mode's outer step, chosen on a grid.

For every mode with its own outer step (benchmarks.ablation.modes.TUNED_OUTER), train the Part-1
configuration on the first seed at every (η, μ) of GRID_LR × GRID_MOMENTUM and keep the lowest
held-out loss. The chosen values are written into TUNED_OUTER by hand, with the sweep's table in
docs/ablation.md: the benchmark itself then runs every row at its own best, on every seed.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import Any

from benchmarks.ablation.measure import Data, Evaluator, Settings, convergence_run
from benchmarks.ablation.modes import BY_KEY, GRID_LR, GRID_MOMENTUM, TUNED_OUTER


def sweep(s: Settings, data: Data, evaluate: Evaluator, topk_density: float) -> dict[str, Any]:
    seed = s.seeds[0]
    grid: dict[str, Any] = {}
    best: dict[str, list[float]] = {}
    root = s.out / "runs" / "sweep"
    for key in [k for k in s.modes if k in TUNED_OUTER]:
        mode = BY_KEY[key]
        losses: dict[str, float] = {}
        for lr in GRID_LR:
            for momentum in GRID_MOMENTUM:
                started = time.monotonic()
                try:
                    row = convergence_run(mode, s, data, evaluate, root, seed, outer=(lr, momentum),
                                          topk_density=topk_density)
                except Exception as exc:  # a diverging setting is a blank cell, not the end of the sweep
                    print(f"[sweep] {mode.name} η={lr:g} μ={momentum:g}: failed: {str(exc)[:200]}",
                          file=sys.stderr, flush=True)
                    continue
                losses[f"{lr:g}/{momentum:g}"] = row["final_loss"]
                print(f"[sweep] {mode.name} η={lr:g} μ={momentum:g}: {row['final_loss']:.4f} "
                      f"({time.monotonic() - started:.0f}s)", file=sys.stderr, flush=True)
                shutil.rmtree(root, ignore_errors=True)
        grid[key] = {"name": mode.name, "loss": losses}
        if losses:
            lr, momentum = min(losses, key=losses.__getitem__).split("/")
            best[key] = [float(lr), float(momentum)]
    return {"seed": seed, "grid": grid, "best": best}
