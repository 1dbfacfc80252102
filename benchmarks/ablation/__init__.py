"""The DiLoCoX ablation (Qi et al., arXiv:2506.21263, §4): what each ingredient buys, over seeds.

    dilocox bench ablation [--smoke] [--sweep] [--seeds 1337,1338,1339] [--modes m1,m2,...]
                           [--out DIR] [--workers W] [--rounds R] [--inner-steps H]
                           [--throughput-rounds R_t] [--time-rounds R2] [--link-ratio 350] [--data DIR]
                           [--keep-runs]

Modes (benchmarks.ablation.modes; one row each, ``--modes`` takes the keys):

    allreduce      synchronous data parallel, a gloo all-reduce of the gradients every step
                   (benchmarks.allreduce); the baseline, always run
    diloco         DiLoCo: dense fp32 both ways, synchronous rounds, one process per worker
    diloco-muon    DiLoCo with Muon inner steps (inner.optimizer = "muon", trainer.runtime.muon)
    dilocox        what the product runs: adaptive low-rank + int4 both ways with error feedback,
                   the one-step-delay overlap (rounds.overlap_start = modes.DILOCOX_START), pipeline
                   stages as the worker chooses for its cores (`--stages auto`)
    muon           DiLoCoX with Muon inner steps
    no-compression, no-overlap       DiLoCoX with one technique off
    fixed-rank     DiLoCoX at a fixed rank 24 (about the adaptive policy's bytes)
    other-start    DiLoCoX with the other overlapped start (eager ↔ delayed, trainer.worker.loops)
    adaptive-steps DiLoCoX with adaptive H (inner.adaptive_steps: H_r in [H/2, H] follows the rank of
                   round r−2's global update, trainer.rounds.schedule); it trains until its tokens reach
                   the budget and is read at the first checkpoint that does
    topk           DiLoCoX with the top-k + low-bit codec (SparseLoCo style, trainer.codec.topk) at the
                   payload of rank 24: the two codecs at equal bytes
    pipeline       DiLoCoX with 2 stages forced (Part 2 only: stages change which process computes
                   a layer, not the arithmetic)

Every DiLoCo mode is real processes (cli.cluster.LocalCluster): a coordinator and W workers
over gRPC + TLS on 127.0.0.1, each worker given ⌊cores / W⌋ cores (``--cores``) and choosing its
stages and threads on them (trainer.runtime.pipeline), so the machine is never oversubscribed.

Outer step: every mode at its own best (η, μ) of the grid in benchmarks.ablation.modes, found by
``--sweep`` (benchmarks.ablation.sweep) on the first seed; AllReduce has no outer step.

Data: WikiText-2 raw beside the repository (``../shared/data/wikitext-2``, or ``--data``):
``valid.txt`` is the training corpus (byte tokens), ``test.txt`` is held out: every checkpoint is
evaluated on fixed windows of it that no process trains on. Without it the embedded corpus is
used, loudly.

Part 1, convergence (unthrottled; the update rule does not depend on the link): every mode, every
seed, trains equal tokens, R rounds × H steps × W workers × batch × block (AllReduce: R·H steps,
step t reading the batches DiLoCo worker k reads at round t//H+1, step t%H). Each seed's held-out
loss of the last checkpoint, its ratio to AllReduce's on the same seed, and the wire bytes (every
byte of every RPC, both directions, from the workers' metrics; AllReduce: ring all-reduce bytes
2(W−1)/W·n per rank and direction) are reported as mean ± sample standard deviation over seeds.

Part 2, throughput under an emulated link (trainer.net.link, bandwidth paced on the bytes actually
sent and received, plus a latency per call, the same for every worker of every mode), first seed:

    t_step     = compute_s / steps of Part 1's unthrottled AllReduce run (W processes on the cores)
    ceiling    = W · B · T / t_step                  tokens/s with nothing but inner steps
    bandwidth  = 8 · 2(W−1)/W · 4 · n / (link_ratio · t_step)    one dense all-reduce = 350 steps,
                                                                the regime of the paper's 107B run

and per mode: steady state (rounds 2..R_t, between the workers' round records), the run without
its start-up (stage processes, join, first fetch) and last exchange (which nothing overlaps), both
of which are reported on their own, and the whole run; each as tokens/s, fraction of the ceiling,
and compute utilisation.

Targets, for DiLoCoX (report.TARGETS): held-out loss ≤ 1.03 × AllReduce (mean of seeds); ≥ 2000×
fewer bytes per token; tokens/s ≥ 0.9 × the ceiling; utilisation ≥ 95%.

A mode that fails is a row ``failed: <one line>`` and the benchmark goes on. Output: markdown on
stdout and ``<out>/ablation.md``, raw numbers ``<out>/ablation.json``, plots ``ablation_loss.png``
(held-out loss vs tokens, mean over seeds) and ``ablation_rounds.png`` (per round: uplink rank,
bytes, inner steps). ``--sweep`` writes ``sweep.md`` / ``sweep.json`` instead. ``--smoke`` runs the same code
on a tiny configuration, one seed, and times only AllReduce and DiLoCoX with 1 and 2 stages.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.ablation import measure, report
from benchmarks.ablation.measure import DEFAULT_DATA, Settings, mean, spread
from benchmarks.ablation.modes import BY_KEY, FIXED_RANK, MODES, Mode
from benchmarks.ablation.relative import against_dense
from storage_client import strict_json

__all__ = ["MODES", "SMOKE_THROUGHPUT", "Mode", "Settings", "add_arguments", "main", "run", "run_sweep", "settings_of"]

FULL = dict(workers=2, rounds=8, inner_steps=50, throughput_rounds=4, allreduce_throughput_steps=3,
            link_ratio=350.0, batch_size=16, model={}, eval_batches=16, seeds="1337,1338,1339")
SMOKE = dict(workers=2, rounds=2, inner_steps=4, throughput_rounds=2, allreduce_throughput_steps=2,
             link_ratio=20.0, batch_size=4, model=dict(block_size=32, n_layer=2, n_head=2, n_embd=32),
             eval_batches=2, seeds="1337")
# The smoke times only what Part 2's code paths need: the baseline, one pipeline-free and one
# two-stage DiLoCoX worker; every mode still trains in Part 1.
SMOKE_THROUGHPUT = ("allreduce", "dilocox", "pipeline")


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type, its message's first line and, for a message that
    carries a process's log, the log's last line, where the error usually is."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if len(lines) > 1:
        text += f" … {lines[-1]}"
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= 300 else text[:299] + "…"


def failed_row(mode: Mode, exc: BaseException) -> dict[str, Any]:
    return {"name": mode.name, "failed": f"failed: {one_line(exc)}"}


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b is not None and b != 0 else float("nan")


def machine() -> dict[str, Any]:
    import os
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "cores": cores, "torch": torch.__version__, "os": platform.platform(),
            "python": platform.python_version(), "load_average": list(os.getloadavg())}


def topk_density(s: Settings) -> float:
    """The top-k density whose payload equals the low-rank codec's at rank FIXED_RANK, for this model."""
    from dataclasses import replace

    from trainer.codec import density_matching_bytes, predicted_size
    from trainer.codec.wire import layout_of
    from trainer.config import DILOCOX_COMPRESSION
    from trainer.model.gpt import build_model

    layout = layout_of({k: v.detach() for k, v in build_model(s.model, s.seeds[0]).state_dict().items()})
    lowrank = replace(DILOCOX_COMPRESSION, min_rank=FIXED_RANK, max_rank=FIXED_RANK)
    return density_matching_bytes(layout, predicted_size(layout, lowrank), replace(lowrank, codec="topk"))


def convergence(mode: Mode, s: Settings, data: measure.Data, evaluate: measure.Evaluator, density: float,
                say: Any) -> dict[str, Any]:
    """Part 1 of one mode over every seed, with the seeds' mean and spread."""
    runs = []
    for seed in s.seeds:
        run = measure.convergence_run(mode, s, data, evaluate, s.out / "runs" / "convergence", seed,
                                      topk_density=density)
        say(f"[ablation]   seed {seed}: held-out loss {run['final_loss']:.4f} in {run['seconds']:.0f}s")
        runs.append(run)
    losses = [r["final_loss"] for r in runs]
    n = len(runs[0]["curve"])
    curve = [(runs[0]["curve"][i][0], mean([r["curve"][i][1] for r in runs if len(r["curve"]) > i])) for i in range(n)]
    return {"name": mode.name, "stages": _stages(runs[0]), "overlap": mode.overlap_start if mode.overlap else "no",
            "compression": mode.compression_label, "outer": runs[0]["outer"], "tokens": runs[0]["tokens"],
            "loss_mean": mean(losses), "loss_sd": spread(losses), "curve": curve,
            "bytes_per_token": mean([r["bytes_per_token"] for r in runs]),
            "per_round": runs[0]["per_round"], "seeds": runs,
            "warnings": [f"seed {r['seed']}: {w}" for r in runs for w in r["warnings"]]}


def _stages(run: dict[str, Any]) -> str:
    stages = {p.get("stages") for p in run.get("per_round", []) if p.get("stages")}
    return "/".join(str(x) for x in sorted(stages)) or "1"


def run(s: Settings) -> dict[str, Any]:
    """The whole benchmark (or, with ``sweep``, the outer-step sweep); writes its files under ``s.out``."""
    started = time.monotonic()
    host = machine()  # the load average before the benchmark adds its own
    modes = [BY_KEY[k] for k in s.modes]
    data = measure.load_data(s.data, s.seeds[0], s.model.block_size)
    if not data.wikitext:
        print(f"WARNING: {data.description}", file=sys.stderr, flush=True)
    s.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(s.out / "runs", ignore_errors=True)
    evaluate = measure.Evaluator(s, data)
    n_params = measure.parameter_count(s.model, s.seeds[0])
    density = topk_density(s) if "topk" in s.modes else 0.0

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    conv: dict[str, Any] = {}
    for mode in [m for m in modes if m.convergence]:
        say(f"[ablation] convergence: {mode.name} ...")
        try:
            conv[mode.key] = convergence(mode, s, data, evaluate, density, say)
        except Exception as exc:  # one failed mode is a row that says so; the others still run
            conv[mode.key] = failed_row(mode, exc)
            say(f"[ablation]   {conv[mode.key]['failed']}")
    base = conv.get("allreduce", {})
    base_loss = {r["seed"]: r["final_loss"] for r in base.get("seeds", [])}
    for r in report.ran(conv):
        ratios = [_ratio(x["final_loss"], base_loss.get(x["seed"])) for x in r["seeds"]]
        r["ratio_mean"], r["ratio_sd"] = mean(ratios), spread(ratios)
        r["bytes_x_fewer"] = _ratio(base.get("bytes_per_token"), r["bytes_per_token"])

    t_step = mean([x["t_step_s"] for x in base.get("seeds", [])[:1]])
    dense = against_dense(conv, t_step, s.inner_steps, n_params, s.link_latency_ms / 1e3)
    calibration = measure.calibrate(s, t_step, n_params)
    link_bps, latency_s = calibration["link_bandwidth_bps"], calibration["link_latency_s"]
    say(f"[ablation] t_step {t_step * 1e3:.1f} ms → ceiling {calibration['ceiling_tokens_per_s']:,.0f} tokens/s, "
        f"link {link_bps / 1e6:.4f} Mbit/s, {s.link_latency_ms:g} ms")
    thr: dict[str, Any] = {}
    for mode in [m for m in modes if m.throughput and (not s.smoke or m.key in SMOKE_THROUGHPUT)]:
        say(f"[ablation] throughput: {mode.name} ...")
        try:
            if not math.isfinite(link_bps):
                raise RuntimeError("no link to emulate: the AllReduce convergence run, which calibrates it, failed")
            thr[mode.key] = {"name": mode.name, **measure.throughput_row(
                mode, s, data, s.out / "runs" / "throughput", link_bps, latency_s, density)}
        except Exception as exc:
            thr[mode.key] = failed_row(mode, exc)
            say(f"[ablation]   {thr[mode.key]['failed']}")
            continue
        say(f"[ablation]   {thr[mode.key]['steady_tokens_per_s']:,.0f} tokens/s steady, "
            f"utilisation {100 * thr[mode.key]['utilisation']:.0f}%")
    base_t = thr.get("allreduce", {})
    for r in report.ran(thr):
        r["steady_throughput_x"] = _ratio(r["steady_tokens_per_s"], base_t.get("steady_tokens_per_s"))

    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()}
    result = {"machine": host, "data": data.description, "wikitext": data.wikitext, "parameters": n_params,
              "settings": settings, "topk_density": density, "calibration": calibration,
              "convergence": conv, "against_dense": dense, "throughput": thr}
    result["targets"] = report.targets(result)
    result["wall_s"] = time.monotonic() - started
    text = report.report(result)
    print(text, end="", flush=True)
    (s.out / "ablation.md").write_text(text, encoding="utf-8")
    (s.out / "ablation.json").write_text(strict_json(result, indent=1) + "\n", encoding="utf-8")
    report.plot_loss(result, s.out / "ablation_loss.png")
    report.plot_rounds(result, s.out / "ablation_rounds.png")
    if not s.keep_runs:
        shutil.rmtree(s.out / "runs", ignore_errors=True)
    say(f"[ablation] wrote {s.out / 'ablation.md'}, ablation.json, ablation_loss.png, ablation_rounds.png "
        f"({result['wall_s']:.0f} s in all)")
    return result


def run_sweep(s: Settings) -> dict[str, Any]:
    from benchmarks.ablation.sweep import sweep

    started = time.monotonic()
    data = measure.load_data(s.data, s.seeds[0], s.model.block_size)
    s.out.mkdir(parents=True, exist_ok=True)
    evaluate = measure.Evaluator(s, data)
    result = sweep(s, data, evaluate, topk_density(s) if "topk" in s.modes else 0.0)
    result["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()}
    result["wall_s"] = time.monotonic() - started
    text = report.sweep_report(result)
    print(text, end="", flush=True)
    (s.out / "sweep.md").write_text(text, encoding="utf-8")
    (s.out / "sweep.json").write_text(strict_json(result, indent=1) + "\n", encoding="utf-8")
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--smoke", action="store_true", help="tiny configuration, same code path (a minute or two)")
    p.add_argument("--sweep", action="store_true", help="sweep each mode's outer step on the grid instead")
    p.add_argument("--out", default="runs/bench-ablation", help="ablation.md / .json / *.png go here")
    p.add_argument("--seeds", help="comma-separated run seeds of Part 1 (default 1337,1338,1339; smoke 1337)")
    p.add_argument("--workers", type=int, help="W, DiLoCo workers and AllReduce ranks (default 2)")
    p.add_argument("--rounds", type=int, help="R, convergence rounds (default 8; smoke 2)")
    p.add_argument("--inner-steps", type=int, help="H, inner steps per round (default 50; smoke 4)")
    p.add_argument("--time-rounds", type=int, default=0,
                   help="DiLoCo modes train this many rounds (>= R) so that the time to DiLoCo's loss can be read "
                        "past R; the loss columns stay at R rounds' tokens (default: R)")
    p.add_argument("--throughput-rounds", type=int, help="R_t, rounds per DiLoCo mode under the link (default 4)")
    p.add_argument("--allreduce-throughput-steps", type=int, help="AllReduce steps under the link (default 3)")
    p.add_argument("--link-ratio", type=float,
                   help="one dense all-reduce costs this many inner steps on the emulated link (default 350; smoke 20)")
    p.add_argument("--link-latency", type=float, default=2.0, help="emulated latency per call, ms")
    p.add_argument("--modes", default=",".join(m.key for m in MODES),
                   help="comma-separated subset of: " + ", ".join(m.key for m in MODES) + " (allreduce always runs)")
    p.add_argument("--data", default=str(DEFAULT_DATA),
                   help="folder with WikiText-2 valid.txt and test.txt (or the shared data folder holding wikitext-2/)")
    p.add_argument("--keep-runs", action="store_true", help="keep the runs' directories under <out>/runs")


def settings_of(args: argparse.Namespace) -> Settings:
    from trainer.config import ModelConfig

    preset = SMOKE if args.smoke else FULL
    keys = [k.strip() for k in args.modes.split(",") if k.strip()]
    unknown = [k for k in keys if k not in BY_KEY]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(k[:40] for k in unknown[:5])}; choose from {', '.join(BY_KEY)}")
    keys = ["allreduce"] + [k for k in BY_KEY if k in keys and k != "allreduce"]
    try:
        seeds = [int(x) for x in (args.seeds or preset["seeds"]).split(",") if x.strip()]
    except ValueError:
        raise ValueError("--seeds must be comma-separated integers") from None

    def pick(name: str) -> Any:
        value = getattr(args, name, None)
        return preset[name] if value is None else value

    s = Settings(workers=pick("workers"), rounds=pick("rounds"), inner_steps=pick("inner_steps"),
                 throughput_rounds=pick("throughput_rounds"),
                 allreduce_throughput_steps=pick("allreduce_throughput_steps"), link_ratio=pick("link_ratio"),
                 link_latency_ms=args.link_latency, batch_size=preset["batch_size"],
                 model=ModelConfig(**preset["model"]), eval_batches=preset["eval_batches"], modes=keys, seeds=seeds,
                 data=Path(args.data), out=Path(args.out), smoke=args.smoke, keep_runs=args.keep_runs,
                 time_rounds=args.time_rounds)
    if s.workers < 2:
        raise ValueError("--workers must be >= 2 (an all-reduce needs two ranks)")
    if not seeds or len(seeds) != len(set(seeds)):
        raise ValueError("--seeds must name at least one seed, each once")
    if min(s.rounds, s.inner_steps, s.throughput_rounds, s.allreduce_throughput_steps) < 1 or s.link_ratio <= 0:
        raise ValueError("rounds, steps and the link ratio must be positive")
    if s.time_rounds and s.time_rounds < s.rounds:
        raise ValueError("--time-rounds must be >= --rounds")
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dilocox bench ablation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    s = settings_of(args)
    (run_sweep if args.sweep else run)(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
