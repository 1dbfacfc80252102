"""Step commitments: honest one-segment and one-step distances across CPU kernels, what cheats look
like against them, and what a leaf costs at 20M parameters (trainer.runtime.step_commit;
docs/step_commitments.md has the measured tables).

Distances (``python -m benchmarks.step_segments``, a few minutes on 2 cores):

1. The "worker" is this process: its ATen CPU capability as started (the machine's best unless
   ``ATEN_CPU_CAPABILITY`` says otherwise) and 1 torch thread. It trains the demo GPT
   (``trainer.config.demo_config()``: 2 layers × 128 wide, batches of 16 × 64 tokens, H = 50, lr
   2e-3, seed 1337) on shard 0 of the demo corpus for ``--rounds`` rounds (one worker: each round
   starts where the last ended, AdamW carried on), and writes its state after every inner step
   (``StepCommitter(every=1, directory=…)``: the files a worker reveals).
2. Then, in the last round, the cheats, each from the same start and optimiser state:
   ``scale`` (the final state θ_0 − 1.01 (θ_0 − θ_H): the update ×1.01), ``noise`` (θ_H plus
   Gaussian noise of 1% of ‖θ_0 − θ_H‖), ``skip`` (10% of the steps, drawn with seed 7, not taken,
   the optimiser's step counters still advanced), ``bf16`` (every forward and backward under
   ``torch.autocast("cpu", dtype=torch.bfloat16)`` while the run names float32).
3. Each segment [j, j + s) of the honest rounds, for s in ``--every``, is replayed from the
   revealed state j (``SegmentReplayer``) in a child process per auditor kernels (``ATEN_CPU_CAPABILITY``
   default and avx2, and the machine's best, with 1 and 2 threads; the child's environment as
   audit.replay_env.child_environment makes it), and compared with the revealed state j + s: d_θ
   (movement-relative) and d_m (each AdamW moment, relative). s = 1 is the one-step distance.
   For each cheat: the segment where it happens, for every s, and at s = DEFAULT_EVERY the whole
   audit: ``first_bad_segment`` over every segment in order, then ``narrow_to_step`` on the
   cheat's own per-step states.

Cost (``python -m benchmarks.step_segments --cost``): the bench's 20M model (benchmarks/scale.py's
20M size: Llama, 6 layers × 512, 8 heads, 4 key/value heads, MLP 1376; batches of 4 × 128 tokens,
its defaults), one inner step's seconds (1 and 2 threads), and one leaf's: hashing θ, exp_avg,
exp_avg_sq and the step counts (``leaf_digest``), and writing the file too (``write_step_state``),
against plain sha256 of as many bytes; the smallest s whose amortised leaf is ≤ 5% of a step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from storage_client import strict_json

REPO_ROOT = Path(__file__).resolve().parents[1]
EVERY = (1, 5, 10, 25, 50)
CHEATS = ("scale", "noise", "skip", "bf16")
SKIP_FRACTION = 0.1
CHEAT_SEED = 7


# ----------------------------------------------------------------------------------------------------
# The worker's side (this process).


def _setup() -> tuple[Any, Any, Any]:
    from trainer.config import demo_config
    from trainer.data.corpus import load_corpus

    cfg = demo_config()
    corpus = load_corpus(cfg.data, cfg.seed, cfg.model.block_size)
    return cfg, corpus, corpus.shard(0, cfg.rounds.expected_workers)


def batches_of(cfg: Any, shard: torch.Tensor, round_: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from trainer.data.corpus import round_batches

    return list(round_batches(shard, seed=cfg.seed, shard_index=0, round_=round_, steps=cfg.inner.steps,
                              batch_size=cfg.inner.batch_size, block_size=cfg.model.block_size))


def train(out: Path, rounds: int) -> dict[str, Any]:
    """The honest rounds and the cheats of the last one, every step's state written under ``out``."""
    from trainer.model.gpt import build_model
    from trainer.model.params import params_of
    from trainer.runtime.inner import InnerLoop, load_optimizer_state
    from trainer.runtime.step_commit import StepCommitter, StepState, capture, write_step_state

    cfg, _, shard = _setup()
    H = cfg.inner.steps
    model = build_model(cfg.model, cfg.seed)
    loop = InnerLoop(model, cfg.inner)
    start = params_of(model)
    roots = {}
    t0 = time.perf_counter()
    for r in range(1, rounds + 1):
        round_start, round_opt = dict(start), loop.state()
        committer = StepCommitter(1, H, r, 0, out / f"honest-{r}")
        loop.run(start, batches_of(cfg, shard, r), observer=committer)
        roots[r] = committer.commitment().root.hex()
        start = params_of(loop.model)
    train_s = time.perf_counter() - t0
    # The cheats of the last round, from its start (round_start, round_opt).
    last = rounds
    batches = batches_of(cfg, shard, last)
    honest_dir = out / f"honest-{last}"
    from trainer.codec.wire import layout_of
    from trainer.runtime.step_commit import decode_step_state

    layout = layout_of(round_start)
    end = decode_step_state((honest_dir / StepCommitter.leaf_name(H)).read_bytes(), layout)
    delta = {n: round_start[n] - end.params[n] for n in round_start}
    norm = math.sqrt(math.fsum(float(d.double().pow(2).sum()) for d in delta.values()))
    cheats: dict[str, Any] = {}
    for name in ("scale", "noise"):
        d = out / f"cheat-{name}"
        d.mkdir(parents=True, exist_ok=True)
        if name == "scale":
            theta = {n: round_start[n] - 1.01 * delta[n] for n in delta}
        else:
            g = torch.Generator().manual_seed(CHEAT_SEED)
            noise = {n: torch.randn(t.shape, generator=g, dtype=torch.float64) for n, t in delta.items()}
            scale = 0.01 * norm / math.sqrt(math.fsum(float(v.pow(2).sum()) for v in noise.values()))
            theta = {n: (end.params[n].double() + scale * noise[n]).float() for n in delta}
        write_step_state(d / StepCommitter.leaf_name(H), StepState(last, 0, H, theta, end.optimizer).tensors())
        cheats[name] = {"first_step": H}
    # skip: per-step runs (bit for bit the same as one run), some steps not taken, counters advanced.
    import random

    skipped = sorted(random.Random(CHEAT_SEED).sample(range(1, H + 1), max(1, round(SKIP_FRACTION * H))))
    for name in ("skip", "bf16"):
        d = out / f"cheat-{name}"
        d.mkdir(parents=True, exist_ok=True)
        cheat = InnerLoop(build_model(cfg.model, cfg.seed), cfg.inner)
        load_optimizer_state(cheat.model, cheat.optimizer, round_opt)
        theta = dict(round_start)
        write_step_state(d / StepCommitter.leaf_name(0), StepState(last, 0, 0, theta, round_opt).tensors())
        for k, batch in enumerate(batches, start=1):
            if name == "skip" and k in skipped:
                for state in cheat.optimizer.state.values():
                    state["step"] += 1
            elif name == "bf16":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    cheat.run(theta, [batch])
            else:
                cheat.run(theta, [batch])
            theta = params_of(cheat.model)
            write_step_state(d / StepCommitter.leaf_name(k), capture(cheat.model, cheat.optimizer, last, 0, k).tensors())
        cheats[name] = {"first_step": skipped[0] if name == "skip" else 1, **({"skipped": skipped} if name == "skip" else {})}
    return {"rounds": rounds, "steps": H, "roots": roots, "train_s": train_s, "cheats": cheats,
            "update_norm": norm}


# ----------------------------------------------------------------------------------------------------
# The auditor's side (a child process in chosen kernels).


def child(request: dict[str, Any]) -> dict[str, Any]:
    import hashlib

    from trainer.runtime import step_commit as sc
    from trainer.runtime.kernels import current_kernels

    torch.set_num_threads(request["threads"])
    cfg, _, shard = _setup()
    out, H, rounds = Path(request["dir"]), request["steps"], request["rounds"]
    replayer = sc.SegmentReplayer(cfg.model, cfg.inner)
    layout = {n: ("float32", tuple(p.shape)) for n, p in replayer.loop.model.named_parameters()}
    batches = {r: batches_of(cfg, shard, r) for r in range(1, rounds + 1)}
    files: dict[tuple[str, int], tuple[str, Path]] = {}
    done: dict[tuple[str, str, int], Any] = {}  # (start digest, end digest, round): a segment replayed once
    replay_s = [0.0, 0]

    def file(where: str, j: int) -> tuple[str, Path]:
        if (where, j) not in files:
            path = out / where / sc.StepCommitter.leaf_name(j)
            if not path.exists():  # a cheat that only changed some states: the honest ones otherwise
                path = out / f"honest-{rounds}" / sc.StepCommitter.leaf_name(j)
            files[(where, j)] = (hashlib.sha256(path.read_bytes()).hexdigest(), path)
        return files[(where, j)]

    def state(where: str, j: int) -> Any:
        return sc.decode_step_state(file(where, j)[1].read_bytes(), layout, step=j)

    def distance(where: str, r: int, j: int, e: int) -> Any:
        key = (file(where, j)[0], file(where, e)[0], r)
        if key not in done:
            t0 = time.perf_counter()
            done[key] = replayer.distance(state(where, j), batches[r][j:e], state(where, e))
            replay_s[0] += time.perf_counter() - t0
            replay_s[1] += e - j
        return done[key]

    def seg(where: str, r: int, j: int, e: int) -> dict[str, Any]:
        d = distance(where, r, j, e)
        return {"round": r, "start": j, "end": e, "theta": d.theta, "moment": d.worst_moment,
                "moments": d.moments, "counts": d.step_counts_agree}

    every = sorted(set(request["every"]) | {sc.DEFAULT_EVERY})
    honest = {s: [seg(f"honest-{r}", r, j, e) for r in range(1, rounds + 1) for j, e in sc.segment_bounds(H, s)]
              for s in every}
    cheats: dict[str, Any] = {}
    for name, info in request["cheats"].items():
        where, first = f"cheat-{name}", info["first_step"]
        at = {}
        for s in every:
            j, e = next((j, e) for j, e in sc.segment_bounds(H, s) if j < first <= e)
            at[s] = seg(where, rounds, j, e)
        bounds = sc.segment_bounds(H, sc.DEFAULT_EVERY)
        audit = sc.first_bad_segment(lambda i: distance(where, rounds, *bounds[i]), range(len(bounds)))
        named = None
        if audit.bad is not None:
            j, e = bounds[audit.bad]
            states = [state(where, k) for k in range(j, e + 1)]
            narrowed = sc.narrow_to_step(replayer, states, batches[rounds][j:e], states[0].digest(), states[-1])
            named = {"step": narrowed.step, "theta": narrowed.distances[-1].theta,
                     "moment": narrowed.distances[-1].worst_moment,
                     "before": max((d.theta for d in narrowed.distances[:-1]), default=0.0)}
        cheats[name] = {"at": at, "bad_segment": audit.bad,
                        "bad_bounds": bounds[audit.bad] if audit.bad is not None else None,
                        "replayed_steps": audit.replayed_steps, "named": named}
    return {"kernels": str(current_kernels(torch.device("cpu"))), "honest": honest, "cheats": cheats,
            "step_s": replay_s[0] / max(1, replay_s[1])}


def run_child(capability: str, threads: int, request: dict[str, Any]) -> dict[str, Any]:
    from audit.replay_env import child_environment
    from storage_client import Kernels

    env = child_environment(Kernels(capability, threads))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    done = subprocess.run([sys.executable, "-m", "benchmarks.step_segments", "--child"],
                          input=strict_json({**request, "threads": threads}).encode(), stdout=subprocess.PIPE,
                          env=env, cwd=REPO_ROOT, check=True)
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def _fmt(x: float) -> str:
    return "0" if x == 0 else ("inf" if math.isinf(x) else f"{x:.2g}")


def report(info: dict[str, Any], answers: dict[tuple[str, int], dict[str, Any]], every: list[int], best: str,
           rounds: int) -> None:
    """The tables of docs/step_commitments.md from the children's answers."""
    from trainer.runtime import step_commit as sc

    print()
    print("## Honest distances (max / median over every segment of every round)")
    print()
    print("| auditor's kernels | s | segments | d_θ max | d_θ median | d_m max | d_m median |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    worst: dict[int, tuple[float, float]] = {}
    for (c, t), ans in answers.items():
        for s in every:
            rows = ans["honest"][str(s)]
            th, mo = [r["theta"] for r in rows], [r["moment"] for r in rows]
            assert all(r["counts"] for r in rows)
            if (c, t) != (best, 1):
                w = worst.get(s, (0.0, 0.0))
                worst[s] = (max(w[0], max(th)), max(w[1], max(mo)))
            print(f"| {ans['kernels']} | {s} | {len(rows)} | {_fmt(max(th))} | {_fmt(statistics.median(th))} "
                  f"| {_fmt(max(mo))} | {_fmt(statistics.median(mo))} |")
    print()
    print("## Largest honest distance in other kernels than the worker's, by s; what MARGIN × it would be")
    print()
    print("| s | d_θ max | d_m max | MARGIN × d_θ | MARGIN × d_m |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for s, (th, mo) in sorted(worst.items()):
        print(f"| {s} | {_fmt(th)} | {_fmt(mo)} | {_fmt(sc.MARGIN * th)} | {_fmt(sc.MARGIN * mo)} |")
    print()
    print(f"## Cheats (round {rounds}), at the segment where each happens; tolerances d_θ ≤ "
          f"{sc.SEGMENT_TOLERANCE:g} (segment), {sc.STEP_TOLERANCE:g} (step), d_m ≤ {sc.MOMENT_TOLERANCE:g}")
    print()
    print("| cheat | auditor's kernels | s | segment | d_θ | d_m | d_θ / tolerance |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: |")
    for name in CHEATS:
        for (c, t), ans in answers.items():
            for s in every:
                r = ans["cheats"][name]["at"][str(s)]
                tol = sc.STEP_TOLERANCE if s == 1 else sc.SEGMENT_TOLERANCE
                print(f"| {name} | {ans['kernels']} | {s} | [{r['start']}, {r['end']}) | {_fmt(r['theta'])} "
                      f"| {_fmt(r['moment'])} | {r['theta'] / tol:.3g} |")
    print()
    print(f"## The audit at s = {sc.DEFAULT_EVERY}: first_bad_segment over every segment in order, then narrow_to_step")
    print()
    print("| cheat | auditor's kernels | first step it touches | first bad segment | replayed steps | named step | its d_θ | its d_m |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for name in CHEATS:
        for (c, t), ans in answers.items():
            ch = ans["cheats"][name]
            n = ch["named"] or {}
            print(f"| {name} | {ans['kernels']} | {info['cheats'][name]['first_step']} | {ch['bad_bounds']} "
                  f"| {ch['replayed_steps']} | {n.get('step')} | {_fmt(n.get('theta', math.nan))} "
                  f"| {_fmt(n.get('moment', math.nan))} |")


def distances(args: argparse.Namespace) -> int:
    from trainer.runtime import step_commit as sc
    from trainer.runtime.kernels import current_kernels

    torch.set_num_threads(1)
    worker = current_kernels(torch.device("cpu"))
    out = Path(args.out or tempfile.mkdtemp(prefix="step-segments-"))
    info = train(out, args.rounds)
    print(f"# machine: {platform.machine()}, {os.cpu_count()} cores, {platform.processor() or ''} torch {torch.__version__}", flush=True)
    print(f"# worker: {worker}; demo GPT, {args.rounds} rounds of {info['steps']} steps "
          f"({info['train_s']:.1f} s with every step's state written); update norm of round {args.rounds}: "
          f"{info['update_norm']:.4g}; skipped steps: {info['cheats']['skip']['skipped']}", flush=True)
    request = {"dir": str(out), "steps": info["steps"], "rounds": args.rounds, "every": list(args.every),
               "cheats": info["cheats"]}
    from trainer.runtime.kernels import cpu_runs

    best = worker.capability if worker else "default"
    configs = [(best, 1)] + [(c, t) for c in ("default", "avx2", "avx512") for t in (1, 2)
                             if (c, t) != (best, 1) and cpu_runs(c)]
    if args.kernels:
        configs = [(c, int(t)) for c, t in (k.split(":") for k in args.kernels.split(","))]
    every = sorted(set(args.every) | {sc.DEFAULT_EVERY})
    answers: dict[tuple[str, int], dict[str, Any]] = {}
    for c, t in configs:
        t0 = time.perf_counter()
        answers[(c, t)] = run_child(c, t, request)
        if args.json:  # every child's answer as it comes, so a long run that is stopped keeps what it measured
            Path(args.json).write_text(strict_json({"info": info, "answers": {f"{c}/{t}": a for (c, t), a in answers.items()}}))
        print(f"# replayed in {answers[(c, t)]['kernels']} ({time.perf_counter() - t0:.0f} s, "
              f"{answers[(c, t)]['step_s'] * 1000:.0f} ms a replayed step)", flush=True)
    report(info, answers, every, best, args.rounds)
    if args.json:
        Path(args.json).write_text(strict_json({"info": info, "answers": {f"{c}/{t}": a for (c, t), a in answers.items()}},
                                              indent=1))
    if not args.out:
        shutil.rmtree(out)
    return 0


# ----------------------------------------------------------------------------------------------------
# Cost at 20M parameters.


def cost(args: argparse.Namespace) -> int:
    import hashlib

    from benchmarks.scale import SIZES
    from trainer.config import InnerConfig, ModelConfig
    from trainer.model.gpt import build_model, param_count
    from trainer.model.params import params_of
    from trainer.runtime.inner import InnerLoop
    from trainer.runtime.step_commit import _live_state, leaf_digest, step_state_tensors, write_step_state

    size = SIZES["20M"]
    model_cfg = ModelConfig(family="llama", n_layer=size.n_layer, n_embd=size.n_embd, n_head=size.n_head,
                            n_kv_head=size.n_kv_head, intermediate_size=size.intermediate_size, block_size=128)
    inner = InnerConfig(steps=4, batch_size=4)
    model = build_model(model_cfg, 1337)
    print(f"# 20M cell: {param_count(model):,} parameters, batches of {inner.batch_size} x {model_cfg.block_size} tokens; "
          f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.backends.cpu.get_cpu_capability()}")
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(256, (inner.batch_size, model_cfg.block_size), generator=g),
             torch.randint(256, (inner.batch_size, model_cfg.block_size), generator=g))
    loop = InnerLoop(model, inner)
    steps: dict[int, float] = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        loop.run(params_of(loop.model), [batch])  # warm-up
        t0 = time.perf_counter()
        n = args.cost_steps
        for _ in range(n):
            loop.run(params_of(loop.model), [batch])
        steps[threads] = (time.perf_counter() - t0) / n
    tensors = step_state_tensors(dict(loop.model.named_parameters()), _live_state(loop.model, loop.optimizer), 1, 0, 5)
    nbytes = sum(t.element_size() * t.numel() for t in tensors.values())
    hashes = []
    for _ in range(args.cost_repeats):
        t0 = time.perf_counter()
        leaf_digest(tensors)
        hashes.append(time.perf_counter() - t0)
    blob = os.urandom(64 << 20)
    t0 = time.perf_counter()
    h = hashlib.sha256()
    for _ in range(4):
        h.update(blob)
    raw_rate = 4 * len(blob) / (time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        write_step_state(Path(tmp) / "leaf.safetensors", tensors)
        write_s = time.perf_counter() - t0
    leaf_s = min(hashes)
    print(f"leaf: {nbytes / 1e6:.1f} MB (θ, exp_avg, exp_avg_sq, steps, position)")
    print(f"leaf hash (leaf_digest, streamed): {leaf_s * 1000:.0f} ms (best of {len(hashes)}; all: "
          f"{', '.join(f'{x * 1000:.0f}' for x in hashes)} ms) = {nbytes / leaf_s / 1e9:.2f} GB/s; "
          f"hashlib sha256 alone: {raw_rate / 1e9:.2f} GB/s")
    print(f"leaf hash + file written (write_step_state): {write_s * 1000:.0f} ms")
    for threads, step_s in steps.items():
        s_min = math.ceil(leaf_s / (0.05 * step_s))
        print(f"inner step, {threads} thread(s): {step_s * 1000:.0f} ms; leaf/step = {100 * leaf_s / step_s:.1f}%; "
              f"smallest s with leaf ≤ 5% of a step: {s_min}; at s = 10: {100 * leaf_s / (10 * step_s):.2f}%")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--every", type=lambda t: tuple(int(x) for x in t.split(",")), default=EVERY)
    p.add_argument("--out", default="", help="keep every step's state here (default: a temporary directory, removed)")
    p.add_argument("--kernels", default="", help="the auditor kernels to replay in, e.g. avx2:1,default:1 "
                   "(default: the best with 1 thread, then default, avx2, avx512 with 1 and 2 threads where the CPU runs them)")
    p.add_argument("--json", default="", help="write every distance measured to this file")
    p.add_argument("--cost", action="store_true", help="the cost of a leaf at 20M parameters against an inner step")
    p.add_argument("--cost-steps", type=int, default=3)
    p.add_argument("--cost-repeats", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--report", default="", help="print the tables from a --json file of an earlier run")
    args = p.parse_args(argv)
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        answers = {(k.split("/")[0], int(k.split("/")[1])): v for k, v in saved["answers"].items()}
        every = sorted({int(s) for a in answers.values() for s in a["honest"]})
        report(saved["info"], answers, every, next(iter(answers))[0], saved["info"]["rounds"])
        return 0
    if args.child:
        print(strict_json(child(json.loads(sys.stdin.read()))))
        return 0
    return cost(args) if args.cost else distances(args)


if __name__ == "__main__":
    sys.exit(main())
