"""The ablation's report: markdown tables (mean ± spread over seeds), the targets, two plots."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from benchmarks.ablation.modes import FIXED_RANK, GRID_LR, GRID_MOMENTUM, TUNED_MUON_LR

TARGETS = {"loss_ratio": 1.03, "bytes_x_fewer": 2000.0, "ceiling_fraction": 0.9, "utilisation": 0.95}


def ran(rows: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of the modes that did not fail."""
    return [r for r in rows.values() if "failed" not in r]


def _mb(n: float) -> str:
    return f"{n / 1e6:,.3f} MB" if n < 1e9 else f"{n / 1e9:,.2f} GB"


def _x(v: float) -> str:
    if not math.isfinite(v):
        return "—"
    return f"{v:,.0f}×" if v >= 100 else f"{v:,.2f}×" if v < 10 else f"{v:,.1f}×"


def _pm(mu: float, sd: float, digits: int = 4) -> str:
    return f"{mu:.{digits}f} ± {sd:.{digits}f}" if math.isfinite(mu) else "—"


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%" if math.isfinite(v) else "—"


def _settings(result: dict[str, Any]) -> list[str]:
    from trainer.config import DILOCOX_COMPRESSION as c

    s, m = result["settings"], result["machine"]
    model = s["model"]
    return [
        f"# DiLoCoX ablation (arXiv:2506.21263){' — SMOKE configuration, numbers mean nothing' if s['smoke'] else ''}",
        "",
        f"- machine: {m['cpu']}, {m['cores']} cores usable, torch {m['torch']}, Python {m['python']}, {m['os']}; "
        f"load average {m['load_average'][0]:.2f} at the start",
        f"- data: {result['data']}",
        f"- model: {model['family']} {model['n_layer']} layers × {model['n_embd']} wide, {model['n_head']} heads, "
        f"block {model['block_size']}, vocabulary {model['vocab_size']}, {result['parameters']:,} parameters "
        f"({_mb(4 * result['parameters'])} fp32)",
        f"- training: W = {s['workers']} workers, batch {s['batch_size']} each, H = {s['inner_steps']} inner steps, "
        f"inner lr {s['inner_lr']} (AdamW), Muon lr per mode "
        f"{', '.join(f'{k} {v:g}' for k, v in TUNED_MUON_LR.items())} (rows with Muon inner steps); Part 1: R = {s['rounds']} rounds, seeds {', '.join(map(str, s['seeds']))} "
        f"(every mode, every seed); Part 2: R_t = {s['throughput_rounds']} rounds per DiLoCo mode, "
        f"{s['allreduce_throughput_steps']} AllReduce steps, seed {s['seeds'][0]}",
        f"- held-out: {s['eval_batches']} fixed batches of {s['batch_size']} × {model['block_size']} tokens",
        f"- compression (DiLoCoX rows, the product's default): τ = {c.target_energy}, rank "
        f"[{c.min_rank}, {c.max_rank}] (fixed-rank row: {FIXED_RANK}), int4 groups of {c.int4_group_size}; "
        f"top-k row: density "
        f"{result.get('topk_density', float('nan')):.5f}, chosen for the payload of rank {FIXED_RANK}",
        f"- outer step: per mode, the best of the sweep grid η ∈ {list(GRID_LR)} × μ ∈ {list(GRID_MOMENTUM)} "
        f"(Nesterov), in the `outer` column",
        "",
    ]


def _rows(rows: dict[str, dict[str, Any]], columns: int,
          cells: Callable[[str, dict[str, Any]], list[str]]) -> list[str]:
    """A markdown table's body: per mode its name, then ``cells`` (or its one-line failure, padded
    to the table's ``columns``)."""
    return [f"| {r['name']} | {r['failed']} |" + " |" * (columns - 2) if "failed" in r
            else "| " + " | ".join([r["name"], *cells(key, r)]) + " |" for key, r in rows.items()]


def _convergence(result: dict[str, Any]) -> list[str]:
    conv = result["convergence"]
    lines = [
        "## Part 1: held-out loss and bytes on equal tokens (unthrottled link)",
        "",
        "| mode | PP | overlap | compression | outer η/μ | tokens | held-out loss | × AllReduce | × DiLoCo "
        "| bytes / token | × fewer | bytes / round | × fewer than DiLoCo | time to DiLoCo's loss |",
        "| --- | ---: | :---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    def cells(key: str, r: dict[str, Any]) -> list[str]:
        base = key == "allreduce"
        return [str('—' if base else r['stages']), r['overlap'], 'none (fp32)' if base else r['compression'],
                'AdamW only' if base else '%g/%g' % tuple(r['outer']), f"{r['tokens']:,}",
                _pm(r['loss_mean'], r['loss_sd']), _pm(r['ratio_mean'], r['ratio_sd'], 3),
                _pm(r.get('diloco_ratio_mean', math.nan), r.get('diloco_ratio_sd', math.nan), 3),
                f"{r['bytes_per_token']:,.2f}", _x(r['bytes_x_fewer']), _kb(r.get('bytes_per_round', math.nan)),
                _x(r.get('round_bytes_x_fewer', math.nan)), _seconds(r.get('time_to_dense_s', math.nan))]

    lines += _rows(conv, 14, cells)
    lines += [
        "",
        f"held-out loss: mean ± sample standard deviation over the {len(result['settings']['seeds'])} seeds; "
        "× AllReduce: the same over the per-seed ratios to AllReduce's run on that seed. bytes / token: both "
        "directions of one worker over that worker's tokens, from the gRPC wire bytes (AllReduce: ring all-reduce "
        "bytes per rank), mean over seeds. PP: the stages a worker chose for the cores it was given. Nobody "
        "downloads θ⁰: every process builds it from the seed.",
        "",
        *_dense_note(result),
    ]
    return lines


def _dense_note(result: dict[str, Any]) -> list[str]:
    d = result.get("against_dense") or {}
    if not d:
        return ["× DiLoCo, bytes / round and time to DiLoCo's loss: not computed (the DiLoCo row did not run).", ""]
    return [f"× DiLoCo: per seed, the loss over DiLoCo's on that seed (mean ± sd). bytes / round: one worker's "
            f"exchange in a round, both directions, median over rounds 2..R (the join and the audit's inner-state "
            f"uploads left out); AllReduce: its H steps. time to DiLoCo's loss: the first checkpoint at or below "
            f"DiLoCo's final loss ({d['target_loss']:.4f}), computed from the measured t_step (a round's compute "
            f"{d['compute_s']:.2f} s) and bytes per round on the 1 Gbps-equivalent link, "
            f"{d['bandwidth_bps'] / 1e6:.4f} Mbit/s (1 Gbit/s × parameters / 10⁹; benchmarks.ablation.relative); "
            f"— : not reached in R rounds.", ""]


def _kb(n: float) -> str:
    return f"{n / 1e3:,.1f} kB" if math.isfinite(n) else "—"


def _seconds(v: float) -> str:
    return f"{v:,.0f} s" if math.isfinite(v) else "—"


def _throughput(result: dict[str, Any]) -> list[str]:
    s, thr, cal = result["settings"], result["throughput"], result["calibration"]
    ceiling = cal["ceiling_tokens_per_s"]
    base = thr.get("allreduce", {})
    lines = [
        "## Part 2: tokens/s under an emulated link, against the compute-bound ceiling",
        "",
        f"t_step = {cal['t_step_s'] * 1e3:.1f} ms ({cal['source']}). **Ceiling: {ceiling:,.0f} tokens/s** (W·B·T / "
        f"t_step: the same model on the same cores doing nothing but inner steps). Link: one dense fp32 ring "
        f"all-reduce ({_mb(cal['ring_bytes_per_worker'])} per rank and direction) costs {s['link_ratio']:g} × t_step "
        f"→ {cal['link_bandwidth_bps'] / 1e6:.4f} Mbit/s, {s['link_latency_ms']:g} ms a call, for every worker; "
        f"AllReduce measured {base.get('comm_to_step', float('nan')):.0f}× comm / compute.",
        "",
        "| mode | PP × threads | ms / step | steady tokens/s | × ceiling | × AllReduce | utilisation | start-up s "
        "| last exchange s | run tokens/s | × ceiling | utilisation | whole run tokens/s | utilisation |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    def cells(key: str, r: dict[str, Any]) -> list[str]:
        return [f"{r['stages']} × {r['threads_per_stage']}", f"{1e3 * r['steady_step_s']:.1f}",
                f"{r['steady_tokens_per_s']:,.0f}", f"{r['steady_tokens_per_s'] / ceiling:.3f}",
                _x(r['steady_throughput_x']), _pct(r['steady_utilisation']), f"{r['startup_s']:.2f}",
                f"{r['last_exchange_s']:.2f}", f"{r['run_tokens_per_s']:,.0f}",
                f"{r['run_tokens_per_s'] / ceiling:.3f}", _pct(r['run_utilisation']), f"{r['tokens_per_s']:,.0f}",
                _pct(r['utilisation'])]

    lines += _rows(thr, 14, cells)
    lines += [
        "",
        f"steady: rounds 2–{s['throughput_rounds']}, between each worker's round-1 and last round records (their "
        "tokens over all workers / the longest span; utilisation: training seconds / span). start-up: process start "
        "to the first inner step (stage processes, join, the fetch of θ⁰); last exchange: end of the last round's "
        "training to holding the final checkpoint, which nothing can overlap. run: the whole run without those two "
        "(tokens / (wall − start-up − last exchange)); whole run: tokens / wall. AllReduce: its clock starts after "
        "the rendezvous, every step alike.",
        "",
    ]
    return lines


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """DiLoCoX against AllReduce and the ceiling, each judged on its headline measure."""
    conv, thr = result["convergence"], result["throughput"]
    if any(k not in rows or "failed" in rows[k] for rows in (conv, thr) for k in ("dilocox", "allreduce")):
        return []
    c, t, ceiling = conv["dilocox"], thr["dilocox"], result["calibration"]["ceiling_tokens_per_s"]
    lo, bx, cf, ut = (TARGETS[k] for k in ("loss_ratio", "bytes_x_fewer", "ceiling_fraction", "utilisation"))
    steady, run = t["steady_tokens_per_s"] / ceiling, t["run_tokens_per_s"] / ceiling
    return [
        {"what": "held-out loss vs AllReduce, mean of seeds", "target": f"≤ {lo}×",
         "value": f"{c['ratio_mean']:.3f}× ± {c['ratio_sd']:.3f}", "met": c["ratio_mean"] <= lo},
        {"what": "fewer bytes per token than AllReduce", "target": f"≥ {bx:,.0f}×",
         "value": _x(c["bytes_x_fewer"]), "met": c["bytes_x_fewer"] >= bx},
        {"what": "tokens/s, steady state, of the ceiling", "target": f"≥ {cf}",
         "value": f"{steady:.3f} ({t['steady_tokens_per_s']:,.0f} of {ceiling:,.0f})", "met": steady >= cf},
        {"what": "tokens/s, run without start-up and last exchange, of the ceiling", "target": f"≥ {cf}",
         "value": f"{run:.3f}", "met": run >= cf},
        {"what": "compute utilisation, run without start-up and last exchange", "target": f"≥ {100 * ut:.0f}%",
         "value": _pct(t["run_utilisation"]), "met": t["run_utilisation"] >= ut},
        {"what": "compute utilisation, whole run", "target": f"≥ {100 * ut:.0f}%",
         "value": _pct(t["utilisation"]), "met": t["utilisation"] >= ut},
    ]


def _targets(result: dict[str, Any]) -> list[str]:
    lines = ["## Targets (DiLoCoX)", ""]
    if not result["targets"]:
        lines.append("- not judged: the DiLoCoX or the AllReduce row failed (see above)")
    for t in result["targets"]:
        lines.append(f"- {t['what']} (target {t['target']}): {t['value']} — **{'met' if t['met'] else 'MISSED'}**")
    warnings = [f"{r['name']}: {w}" for r in ran(result["convergence"]) for w in r.get("warnings", [])]
    if warnings:
        lines += ["", "warnings:"] + [f"- {w}" for w in warnings]
    lines += ["", f"benchmark wall time {result['wall_s']:.0f} s"]
    return lines


def report(result: dict[str, Any]) -> str:
    sections = (_settings, _convergence, _throughput, _targets)
    return "\n".join(line for section in sections for line in section(result)) + "\n"


def sweep_report(result: dict[str, Any]) -> str:
    lines = ["# DiLoCoX ablation: outer-step sweep", "",
             f"held-out loss after R = {result['settings']['rounds']} rounds, seed {result['seed']}, every other "
             f"setting as in the ablation; rows η, columns μ (Nesterov). **Bold**: the mode's best.", ""]
    for key, grid in result["grid"].items():
        best = result["best"][key]
        lines += [f"## {grid['name']}", "", "| η \\ μ | " + " | ".join(f"{m:g}" for m in GRID_MOMENTUM) + " |",
                  "| --- |" + " ---: |" * len(GRID_MOMENTUM)]
        for lr in GRID_LR:
            cells = []
            for mom in GRID_MOMENTUM:
                loss = grid["loss"].get(f"{lr:g}/{mom:g}")
                text = "failed" if loss is None else f"{loss:.4f}"
                cells.append(f"**{text}**" if [lr, mom] == best else text)
            lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
        lines += ["", f"best: η = {best[0]:g}, μ = {best[1]:g}", ""]
    return "\n".join(lines) + "\n"


def plot_loss(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    rows = ran(result["convergence"])
    for r in rows:
        tokens, losses = zip(*r["curve"])
        ax.plot([t / 1e3 for t in tokens], losses, marker="o", markersize=3,
                linestyle="--" if r["name"] == "AllReduce" else "-", label=f"{r['name']} ({r['loss_mean']:.3f})")
    ax.set_xlabel("tokens trained, all workers (thousands)")
    ax.set_ylabel("held-out loss, mean over seeds")
    ax.set_title(f"DiLoCoX ablation: held-out loss vs tokens ({'WikiText-2 test' if result['wikitext'] else 'embedded corpus'})")
    trained = [loss for r in rows for tokens, loss in r["curve"] if tokens > 0]
    if trained:  # genesis (≈ ln 256) would flatten every later difference: zoom on the trained points
        ax.set_ylim(min(trained) - 0.05, max(trained) + 0.1)
    ax.grid(True, alpha=0.3)
    if rows:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def plot_rounds(result: dict[str, Any], path: Path) -> None:
    """Per round, for every DiLoCo mode (first seed): the uplink's mean rank, bytes up a worker, H."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rank_ax, bytes_ax, h_ax) = plt.subplots(3, 1, figsize=(8, 9), dpi=120, sharex=True)
    # One colour per mode in every panel (a panel skips the modes it has nothing for).
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(ran(result["convergence"])):
        rounds = r.get("per_round") or []
        if not rounds:
            continue
        style = dict(marker="o", markersize=3, label=r["name"], color=colours[i % len(colours)])
        xs = [p["round"] for p in rounds]
        ranked = [(p["round"], p["mean_rank"]) for p in rounds if p["mean_rank"] is not None]
        if ranked:
            rank_ax.plot(*zip(*ranked), **style)
        bytes_ax.plot(xs, [p["bytes_sent"] for p in rounds], **style)
        h_ax.plot(xs, [p["inner_steps"] for p in rounds], **style)
    rank_ax.set_ylabel("uplink mean rank")
    bytes_ax.set_ylabel("bytes up / worker / round")
    bytes_ax.set_yscale("log")
    h_ax.set_ylabel("inner steps H")
    h_ax.set_xlabel("round")
    rank_ax.set_title("Per-round decisions (first seed)")
    for ax in (rank_ax, bytes_ax, h_ax):
        ax.grid(True, alpha=0.3)
    bytes_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
