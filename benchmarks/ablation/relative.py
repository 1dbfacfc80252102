"""Every row against dense DiLoCo (issue 31): the loss ratio at equal tokens, the bytes of one round,
and the time to reach DiLoCo's held-out loss on an emulated 1 Gbps-equivalent link.

Per seed s, a row's loss ratio is L_mode(s) / L_DiLoCo(s) on the same seed, reported as mean ±
sample sd over seeds. Bytes per round are one worker's exchange, both directions, the median over
rounds 2..R of the workers' round records (round 1 carries the join; every K-th round also
uploads the worker's inner state for the audit, which the median leaves out); AllReduce's "round"
is its H steps of ring all-reduces.

The time to the dense loss is computed, not timed, from measured quantities: the first checkpoint
r of the row's held-out curve (mean over seeds) at or below DiLoCo's final loss (mean over seeds),
each round's compute C = H · t_step (t_step from the unthrottled AllReduce run) and its exchange
X = 8 · bytes per round / B + latency on a link of bandwidth B:

    synchronous:      T(r) = r · (C + X)
    overlapped:       T(r) = C + (r − 1) · max(C, X) + X     round r's exchange hides behind round r+1

B is the 1 Gbps-equivalent link: 1 Gbit/s scaled by this model's parameters over 10⁹, so that one
dense fp32 copy of the model crosses it in the time a 1B-parameter model's crosses 1 Gbit/s (32 s),
while the compute stays this model's. Both directions share it (the emulated link,
trainer.net.link, paces the bytes sent and received together).
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

from benchmarks.ablation.measure import mean, spread

REFERENCE_PARAMETERS = 1e9  # the model whose fp32 copy crosses the real link in the same time
REFERENCE_BPS = 1e9  # 1 Gbit/s


def equivalent_bandwidth_bps(parameters: int) -> float:
    """B: 1 Gbit/s × parameters / 10⁹ (module docstring)."""
    return REFERENCE_BPS * parameters / REFERENCE_PARAMETERS


def bytes_per_round(per_round: Sequence[dict[str, Any]]) -> float:
    """One worker's exchange bytes in a round, both directions: the median over rounds 2..R."""
    later = [p["bytes_sent"] + p["bytes_received"] for p in per_round if p["round"] >= 2]
    return float(statistics.median(later)) if later else float("nan")


def round_seconds(compute_s: float, exchange_s: float, overlap: bool, rounds: int) -> float:
    """T(r): the wall time until checkpoint r is held (module docstring)."""
    if rounds <= 0:
        return 0.0
    if overlap:
        return compute_s + (rounds - 1) * max(compute_s, exchange_s) + exchange_s
    return rounds * (compute_s + exchange_s)


def time_to_loss(curve: Sequence[tuple[int, float]], target: float, compute_s: float, exchange_s: float,
                 overlap: bool) -> float:
    """Seconds to the first checkpoint of ``curve`` (genesis first, one point a round) at or below
    ``target``; NaN when no checkpoint reaches it."""
    for rounds, (_, loss) in enumerate(curve):
        if loss <= target:
            return round_seconds(compute_s, exchange_s, overlap, rounds)
    return math.nan


def against_dense(rows: dict[str, dict[str, Any]], t_step_s: float, inner_steps: int, parameters: int,
                  latency_s: float) -> dict[str, Any]:
    """Adds to every row that ran: ``diloco_ratio_mean`` / ``_sd``, ``bytes_per_round``,
    ``round_bytes_x_fewer`` (DiLoCo's bytes per round over the row's) and ``time_to_dense_s``; returns
    the link and the target loss used (empty when the DiLoCo row did not run)."""
    dense = rows.get("diloco", {})
    if "failed" in dense or "seeds" not in dense:
        return {}
    by_seed = {r["seed"]: r["final_loss"] for r in dense["seeds"]}
    bandwidth = equivalent_bandwidth_bps(parameters)
    compute = inner_steps * t_step_s
    for key, row in rows.items():
        if "failed" in row:
            continue
        ratios = [r["final_loss"] / by_seed[r["seed"]] for r in row["seeds"] if r["seed"] in by_seed]
        row["diloco_ratio_mean"], row["diloco_ratio_sd"] = mean(ratios), spread(ratios)
        if key == "allreduce":
            rounds = max(1, len(row["curve"]) - 1)
            row["bytes_per_round"] = mean([r["sent"] + r["received"] for r in row["seeds"]]) / rounds
            exchange = 8 * row["bytes_per_round"] / bandwidth + inner_steps * latency_s
        else:
            row["bytes_per_round"] = mean([bytes_per_round(r["per_round"]) for r in row["seeds"]])
            exchange = 8 * row["bytes_per_round"] / bandwidth + latency_s
        row["time_to_dense_s"] = time_to_loss(row["curve"], dense["loss_mean"], compute, exchange,
                                              row.get("overlap", "no") != "no")
    for row in rows.values():
        if "failed" not in row:
            row["round_bytes_x_fewer"] = dense["bytes_per_round"] / row["bytes_per_round"]
    return {"bandwidth_bps": bandwidth, "target_loss": dense["loss_mean"], "compute_s": compute}
