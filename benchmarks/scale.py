"""``dilocox bench scale``: what a round costs at three model sizes, with 2 and 8 workers.

Each cell is a real run: a local chain (anvil) with the registry and ledger deployed as by ``dilocox
demo``, a coordinator and W workers as separate processes over TLS (cli.cluster.LocalCluster),
dev attestation, signed reports, compression on, then ``dilocox audit`` on the finished run. Sizes
(a Llama-family decoder by default, ``--family``; exact parameter counts are printed per cell):

    1M    5 layers x 128 wide,  4 heads (2 key/value heads), MLP 352
    20M   6 layers x 512 wide,  8 heads (4 key/value heads), MLP 1376
    100M  16 layers x 768 wide, 12 heads (4 key/value heads), MLP 2048
    1B    22 layers x 2048 wide, 32 heads (4 key/value heads), MLP 5632 (TinyLlama's blocks)

(``--family gpt`` builds the project's own GPT at the same layers, widths and heads.) Every cell
runs ``--rounds`` rounds of ``--inner-steps`` AdamW steps on batches of ``--batch-size`` sequences
of ``--block-size`` tokens, with ``data.eval_batches = --eval-batches``, byte tokens of the embedded
corpus (or ``--tokens DIR``, a prepared dataset, passed through as ``data.tokens``), seed 1337.

Per cell, from what the processes themselves record (means over rounds 2..R, round 1 also holds
the workers' start; R = 1 uses round 1):

    round      the coordinator's seconds from a round's opening to its publication (rounds.jsonl)
    inner      a worker's H inner steps (its metrics record ``inner_s``), mean over workers
    compress   a worker's encoding of Δ and decoding of the global update (``compress_s``,
               ``decode_s``, mean over workers) + the coordinator's decoding of every update
               of the round (rounds.jsonl ``phases.decode``)
    transfer   a worker's push streams up to the coordinator's reply (which holds the coordinator's
               intake of that update) + streaming the global state in, waiting excluded
               (``push_s`` + ``fetch_s``), mean over workers
    aggregate  the coordinator's round transition: clipping, mean, outer step, downlink compression
    store      the coordinator's intake of the round's updates (checks, store, journal) and the
               storing of the new checkpoint and manifest (``phases.intake`` + ``phases.store``)
    evaluate   the coordinator's evaluation of the new checkpoint + a worker's check of the
               checkpoint before signing (``evaluate_s``, mean over workers)
    machinery  (compress + aggregate) / (inner / H): the round's own codec and transition work in
               inner steps of the same model on the same machine (issue 30 asks for <= 2.5)
    RSS/bound  the coordinator's peak RSS / (4 x the model's float32 bytes + 1 GiB)

The phases overlap (workers run in parallel, the coordinator's intake runs while others train), so
they do not add up to ``round``. Peak RSS is each process's VmHWM (/proc/<pid>/status), polled
while it runs: the coordinator's, and the largest worker's. Store bytes per round: the growth of
``<run>/store`` (apparent sizes) from genesis to the end, over R; wire bytes per round: the
manifests' bytes_up + bytes_down, over R. Audit seconds per round: ``dilocox audit`` of the
finished run (chain still up), over R.

A cell whose estimated memory (workers' and coordinator's, from the parameter count) does not fit
in ``--memory-guard`` (85%) of this machine's available memory, or whose parameters exceed
``--max-params``, is skipped with the reason printed (``--memory-guard 0`` runs it anyway).
Output: a table on stdout, ``<out>/scale.md`` and ``<out>/scale.json``;
the runs go to ``<out>/runs/`` and are deleted after each cell unless ``--keep-runs``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from storage_client import strict_json, write_atomic

REPO_ROOT = Path(__file__).resolve().parents[1]
SEED = 1337


@dataclass(frozen=True)
class Size:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    intermediate_size: int


SIZES = {s.name: s for s in (
    Size("1M", 5, 128, 4, 2, 352),
    Size("20M", 6, 512, 8, 4, 1376),
    Size("100M", 16, 768, 12, 4, 2048),
    Size("1B", 22, 2048, 32, 4, 5632),
)}
SMOKE_SIZE = Size("smoke", 2, 64, 4, 2, 176)
WORKER_COUNTS = (2, 8)


@dataclass(frozen=True)
class Settings:
    family: str = "llama"
    cells: tuple[tuple[str, int], ...] = tuple((s, w) for s in SIZES for w in WORKER_COUNTS)
    max_params: int = 0  # 0: no limit
    memory_guard: float = 0.85  # a cell runs if its estimated memory fits this share of the available; 0: always
    rounds: int = 3
    checkpoint_every: int = 0  # rounds.checkpoint_every; 0: R (the last round's full checkpoint only)
    inner_steps: int = 4
    batch_size: int = 4
    block_size: int = 128
    eval_batches: int = 4
    vocab_size: int = 256
    tokens: str = ""
    device: str = "cpu"
    threads: int = 0  # 0: cores // workers
    out: Path = Path("runs/bench-scale")
    keep_runs: bool = False
    smoke: bool = False
    cell_timeout_s: float = 3600.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", default="llama", help="model.family of every cell (llama, qwen2, gpt)")
    p.add_argument("--cells", help="comma-separated SIZE:WORKERS, e.g. 1M:2,20M:8 (default: every size "
                                   f"of {', '.join(SIZES)} with {' and '.join(map(str, WORKER_COUNTS))} workers)")
    p.add_argument("--max-params", type=float, default=0, help="skip cells with more estimated parameters (0: none)")
    p.add_argument("--memory-guard", type=float, default=0.85,
                   help="skip a cell whose estimated memory exceeds this share of the available memory (0: never skip)")
    p.add_argument("--rounds", type=int, default=3, help="R, rounds per cell")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="rounds.checkpoint_every K: full parameters and outer state stored every K rounds "
                        "(default 0: R, so the last round only)")
    p.add_argument("--inner-steps", type=int, default=4, help="H, inner steps a round")
    p.add_argument("--batch-size", type=int, default=4, help="sequences an inner step")
    p.add_argument("--block-size", type=int, default=128, help="tokens a sequence (the model's context)")
    p.add_argument("--eval-batches", type=int, default=4, help="data.eval_batches: held-out batches evaluated")
    p.add_argument("--tokens", default="", help="a prepared token directory (data.tokens); default: the embedded "
                                                "corpus as byte tokens")
    p.add_argument("--vocab-size", type=int, default=256, help="model.vocab_size (256 for byte tokens)")
    p.add_argument("--device", default="cpu", help="the workers' --device (cpu, cuda, cuda:N)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (default: cores // workers)")
    p.add_argument("--out", default="runs/bench-scale", help="scale.md / scale.json and runs/ go here")
    p.add_argument("--keep-runs", action="store_true", help="keep each cell's run directory")
    p.add_argument("--cell-timeout", type=float, default=3600.0, help="seconds a cell may take")
    p.add_argument("--smoke", action="store_true", help="one tiny cell (2 layers x 64, 2 workers, 2 rounds of 2 "
                                                        "steps): the same code path in well under a minute")


def settings_of(args: argparse.Namespace) -> Settings:
    cells = Settings.cells
    if args.cells:
        cells = tuple(_cell(text) for text in args.cells.split(",") if text.strip())
    for name, value, low in (("--rounds", args.rounds, 1), ("--inner-steps", args.inner_steps, 1),
                             ("--batch-size", args.batch_size, 1), ("--block-size", args.block_size, 2),
                             ("--eval-batches", args.eval_batches, 1), ("--threads", args.threads, 0),
                             ("--checkpoint-every", args.checkpoint_every, 0)):
        if value < low:
            raise ValueError(f"{name} {value} is out of range: must be >= {low}")
    if not 0 <= args.memory_guard <= 1:
        raise ValueError(f"--memory-guard {args.memory_guard} is out of range: must be within [0, 1]")
    s = Settings(family=args.family, cells=cells, max_params=int(args.max_params), memory_guard=args.memory_guard,
                 rounds=args.rounds, checkpoint_every=args.checkpoint_every, inner_steps=args.inner_steps,
                 batch_size=args.batch_size, block_size=args.block_size,
                 eval_batches=args.eval_batches, vocab_size=args.vocab_size, tokens=args.tokens,
                 device=args.device, threads=args.threads, out=Path(args.out), keep_runs=args.keep_runs,
                 cell_timeout_s=args.cell_timeout)
    if args.smoke:
        s = dataclasses.replace(s, cells=(("smoke", 2),), rounds=2, inner_steps=2, batch_size=2, block_size=32,
                                eval_batches=2, smoke=True, cell_timeout_s=min(s.cell_timeout_s, 300.0))
    return s


def _cell(text: str) -> tuple[str, int]:
    size, _, workers = text.strip().partition(":")
    if size not in SIZES or not workers.isdigit() or not 1 <= int(workers) <= 64:
        raise ValueError(f"--cells {text.strip()[:40]!r}: expected SIZE:WORKERS with SIZE one of "
                         f"{', '.join(SIZES)} and 1 to 64 workers")
    return size, int(workers)


# ------------------------------------------------------------------------------- the machine


def machine(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                            "torch": torch.__version__, "python": platform.python_version(),
                            "os": platform.platform(), "device": device}
    for path, key, prefix in (("/proc/cpuinfo", "cpu", "model name"), ("/proc/meminfo", "ram", "MemTotal")):
        try:
            line = next(x for x in Path(path).read_text().splitlines() if x.startswith(prefix))
            info[key] = line.split(":", 1)[1].strip()
        except (OSError, StopIteration):
            pass
    if device.startswith("cuda") and torch.cuda.is_available():
        index = int(device.partition(":")[2] or 0)
        info["gpu"] = torch.cuda.get_device_name(index)
    return info


def available_bytes() -> int:
    try:
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return 0


def estimated_memory(params: int, workers: int) -> int:
    """Bytes a cell may need at most, from float32 parameters: a worker holds the model, its
    gradients, AdamW's two moments, the round's start, Δ and the error feedback (about 8 copies,
    + 12 for activations and codecs); the coordinator θ, m, e, the evaluation model and the
    round's updates (6 + 2 per worker); 400 MB of interpreter and libraries per process."""
    model, base = 4 * params, 400 << 20
    return workers * (20 * model + base) + (6 + 2 * workers) * model + base


# ------------------------------------------------------------------------------- one cell


@dataclass
class PeakRss:
    """VmHWM of each watched process, polled until the process exits (the kernel keeps the peak)."""

    pids: dict[str, int]
    peaks: dict[str, int] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def poll(self) -> None:
        while not self.stop.is_set():
            for name, pid in list(self.pids.items()):
                try:
                    text = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue  # exited: its last reading stands
                for line in text.splitlines():
                    if line.startswith("VmHWM:"):
                        self.peaks[name] = max(self.peaks.get(name, 0), int(line.split()[1]) * 1024)
            self.stop.wait(0.1)


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def cell_config(s: Settings, size: Size, workers: int):  # -> RunConfig
    from trainer.config import RunConfig

    settings = [f"model.n_layer={size.n_layer}", f"model.n_embd={size.n_embd}", f"model.n_head={size.n_head}",
                f"model.block_size={s.block_size}", f"model.vocab_size={s.vocab_size}"]
    if s.family != "gpt":  # the fields of the Hugging Face families (trainer.config.ModelConfig)
        settings += [f"model.family={s.family}", f"model.n_kv_head={size.n_kv_head}",
                     f"model.intermediate_size={size.intermediate_size}"]
    if s.tokens:
        settings.append(f"data.tokens={s.tokens}")
    settings += [f"inner.steps={s.inner_steps}", f"inner.batch_size={s.batch_size}",
                 f"data.eval_batches={s.eval_batches}", f"rounds.rounds={s.rounds}",
                 f"rounds.expected_workers={workers}", f"rounds.quorum={workers}",
                 f"rounds.checkpoint_every={s.checkpoint_every or s.rounds}",
                 "rounds.straggler_timeout_s=86400", "rounds.liveness_timeout_s=600",
                 "compression.enabled=true"]
    return RunConfig(run_id=f"scale-{size.name}-{workers}w", seed=SEED).with_settings(settings)


def parameters_of(config) -> int:  # config: RunConfig
    import torch

    from trainer.model.gpt import build_model, param_count

    with torch.device("meta"):  # shapes only: a 1B cell is counted without allocating it
        return param_count(build_model(config.model, config.seed))


def run_cell(s: Settings, size: Size, workers: int, run_dir: Path) -> dict[str, Any]:
    """One cell, end to end; the row's figures (raises on a failed run)."""
    from cli.cluster import provision
    from settlement import Anvil
    from trainer.data.dataset import pin_dataset

    # Pinned before the chain allowlists the configuration's measurement, as the demo does.
    config, _ = pin_dataset(cell_config(s, size, workers))
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    config.save(run_dir / "config.json")
    with Anvil(state_file=run_dir / "chain" / "state.json") as anvil:
        coordinator_args, worker_args = provision(run_dir, anvil.rpc_url, config)
        peaks, genesis_bytes, wall = _train(s, config, run_dir, workers, coordinator_args, worker_args)
        started = time.perf_counter()
        audit = subprocess.run([sys.executable, "-m", "cli.main", "audit", "--run", str(run_dir), "--rpc",
                                anvil.rpc_url, "--allow-dev"], cwd=REPO_ROOT, capture_output=True, text=True)
        audit_s = time.perf_counter() - started
    if audit.returncode != 0:
        raise RuntimeError(f"dilocox audit failed ({audit.returncode}): {(audit.stdout + audit.stderr)[-400:]}")
    return _row(s, config, run_dir, workers, peaks, tree_bytes(run_dir / "store") - genesis_bytes, audit_s, wall)


def _train(s: Settings, config, run_dir: Path, workers: int, coordinator_args: list[str],
           worker_args: list[str]) -> tuple[dict[str, int], int, float]:
    """Run the cell's processes to the end; (peak RSS by process, store bytes at genesis, wall s)."""
    from cli.cluster import ClusterError, LocalCluster

    threads = s.threads or max(1, (os.cpu_count() or 1) // workers)
    started = time.monotonic()
    with LocalCluster(run_dir, threads_per_worker=threads) as cluster:
        cluster.start_coordinator(run_dir / "config.json",
                                  extra=[*coordinator_args, "--threads", str(threads), "--linger", "2"])
        genesis_bytes = tree_bytes(run_dir / "store")  # genesis is stored before the port is announced
        for i in range(workers):
            cluster.start_worker(f"worker-{i}", extra=[*worker_args, "--metrics", str(run_dir / f"worker-{i}.jsonl"),
                                                       *(["--device", s.device] if s.device != "cpu" else [])])
        rss = PeakRss({name: p.pid for name, p in cluster.processes.items()})
        poller = threading.Thread(target=rss.poll, daemon=True)
        poller.start()
        try:
            codes = {name: cluster.wait_exit(name, max(1.0, s.cell_timeout_s - (time.monotonic() - started)))
                     for name in list(cluster.processes)}
        except ClusterError as exc:
            raise RuntimeError(f"cell timed out after {s.cell_timeout_s:.0f}s: {str(exc)[-400:]}") from None
        finally:
            rss.stop.set()
            poller.join()
        failed = {name: code for name, code in codes.items() if code != 0}
        if failed:
            name = next(iter(failed))
            raise RuntimeError(f"processes failed {failed}; {name}: {cluster.log(name, 5)[-400:]}")
    return rss.peaks, genesis_bytes, time.monotonic() - started


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _row(s: Settings, config, run_dir: Path, workers: int, peaks: dict[str, int], store_growth: int,
         audit_s: float, wall_s: float) -> dict[str, Any]:
    from storage_client import lineage
    from trainer.runstore.run_dir import RunDir

    rounds = s.rounds
    steady = range(2, rounds + 1) if rounds >= 2 else range(1, 2)
    summaries = {r["round"]: r for r in RunDir(run_dir).logged_rounds()}
    coordinator = [summaries[r].get("phases", {}) for r in steady]
    records = [[rec for rec in _records(run_dir / f"worker-{i}.jsonl") if rec.get("round") in steady]
               for i in range(workers)]

    def worker(*keys: str) -> float:  # a worker's seconds a round, mean over workers and rounds
        return _mean([_mean([sum(rec.get(k, 0.0) for k in keys) for rec in recs]) for recs in records])

    def coord(*keys: str) -> float:
        return _mean([sum(p.get(k, 0.0) for k in keys) for p in coordinator])

    params = parameters_of(config)
    inner_s, aggregate_s = worker("inner_s"), coord("aggregate")
    compress_s = worker("compress_s", "decode_s") + coord("decode")
    local = RunDir(run_dir)
    manifests = [m for _, m in lineage(local.store, local.head())][1:]
    wire = sum(m.bytes_up + m.bytes_down for m in manifests)
    # The full checkpoints stored for rounds 1..R (every rounds.checkpoint_every rounds, and the last).
    checkpoints = sum(len(local.store.get(cid)) for m in manifests for cid in (m.params, m.outer_state)
                      if local.store.has(cid))
    return {
        "parameters": params, "workers": workers, "rounds": len(manifests),
        "round_s": _mean([summaries[r]["seconds"] for r in steady]),
        "inner_s": inner_s, "compress_s": compress_s,
        "transfer_s": worker("push_s", "fetch_s"), "aggregate_s": aggregate_s,
        "machinery_steps": (compress_s + aggregate_s) / (inner_s / s.inner_steps) if inner_s else 0.0,
        "store_s": coord("intake", "store"), "evaluate_s": coord("evaluate") + worker("evaluate_s"),
        "evaluate_coordinator_s": coord("evaluate"), "evaluate_worker_s": worker("evaluate_s"),
        "coordinator_rss": peaks.get("coordinator", 0),
        "coordinator_rss_bound": peaks.get("coordinator", 0) / (4 * 4 * params + (1 << 30)),
        "worker_rss": max((v for k, v in peaks.items() if k != "coordinator"), default=0),
        "store_bytes_per_round": store_growth / max(1, len(manifests)),
        "wire_bytes_per_round": wire / max(1, len(manifests)),
        "checkpoint_bytes_per_round": checkpoints / max(1, len(manifests)),
        "audit_s_per_round": audit_s / max(1, len(manifests)), "wall_s": wall_s,
    }


def _records(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError):
        return []


# ------------------------------------------------------------------------------- the table

COLUMNS = ("size", "parameters", "workers", "round s", "inner", "compress", "transfer", "aggregate", "store",
           "evaluate", "machinery / step", "coord. RSS", "RSS / bound", "worker RSS", "store B/round",
           "of which ckpt", "wire B/round", "(store-ckpt)/wire", "audit s/round")


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def row_cells(name: str, row: dict[str, Any]) -> list[str]:
    if "skipped" in row or "failed" in row:
        reason = row.get("skipped") or f"failed: {row['failed']}"
        return [name, f"{row.get('parameters', 0):,}", str(row["workers"]), reason] + [""] * (len(COLUMNS) - 4)
    updates = row["store_bytes_per_round"] - row["checkpoint_bytes_per_round"]
    ratio = updates / row["wire_bytes_per_round"] if row["wire_bytes_per_round"] else 0.0
    return [name, f"{row['parameters']:,}", str(row["workers"]), f"{row['round_s']:.2f}",
            *(f"{row[k]:.3f}" for k in ("inner_s", "compress_s", "transfer_s", "aggregate_s", "store_s",
                                          "evaluate_s")),
            f"{row['machinery_steps']:.1f}", _mb(row["coordinator_rss"]), f"{row['coordinator_rss_bound']:.2f}",
            _mb(row["worker_rss"]), _mb(row["store_bytes_per_round"]),
            _mb(row["checkpoint_bytes_per_round"]), _mb(row["wire_bytes_per_round"]), f"{ratio:.2f}x",
            f"{row['audit_s_per_round']:.2f}"]


def markdown(header: str, rows: list[tuple[str, dict[str, Any]]]) -> str:
    lines = [header, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row_cells(name, row)) + " |" for name, row in rows]
    return "\n".join(lines) + "\n"


def describe(s: Settings, info: dict[str, Any]) -> str:
    data = f"prepared tokens {s.tokens}" if s.tokens else "the embedded corpus as byte tokens"
    gpu = f", {info['gpu']}" if "gpu" in info else ""
    return (f"Machine: {info.get('cpu')}, {info.get('cores')} cores, {info.get('ram', '?')} RAM, torch "
            f"{info.get('torch')}, workers on {s.device}{gpu}. Family {s.family}; data: {data}; seed {SEED}; "
            f"{s.rounds} rounds x {s.inner_steps} inner steps, full checkpoints every "
            f"{s.checkpoint_every or s.rounds} rounds, batch {s.batch_size} x {s.block_size} tokens, "
            f"{s.eval_batches} eval batches; compression on; TLS; dev attestation; signed reports on a local "
            f"chain. Seconds are per round (means over rounds {'2..' + str(s.rounds) if s.rounds > 1 else '1'}).")


# ------------------------------------------------------------------------------- the benchmark


def run(s: Settings, command: str = "dilocox bench scale") -> list[tuple[str, dict[str, Any]]]:
    from rich.console import Console

    console = Console()
    info = machine(s.device)
    header = describe(s, info)
    console.print(f"[bold]{command}[/]\n{header}")
    rows: list[tuple[str, dict[str, Any]]] = []
    for name, workers in s.cells:
        size = SMOKE_SIZE if name == "smoke" else SIZES[name]
        row = _measured_cell(s, size, workers, console)
        rows.append((name, row))
        console.print(" | ".join(f"{c}: {v}" for c, v in zip(COLUMNS, row_cells(name, row)) if v))
    table = markdown(f"`{command}`\n\n{header}", rows)
    console.print(table, markup=False, highlight=False, soft_wrap=True)
    s.out.mkdir(parents=True, exist_ok=True)
    write_atomic(s.out / "scale.md", table.encode())
    write_atomic(s.out / "scale.json", (strict_json({"command": command, "machine": info,
                                                     "settings": {**dataclasses.asdict(s), "out": str(s.out)},
                                                     "cells": [{"size": n, **r} for n, r in rows]},
                                                    indent=2) + "\n").encode())
    console.print(f"written: {s.out / 'scale.md'}, {s.out / 'scale.json'}")
    return rows


def _measured_cell(s: Settings, size: Size, workers: int, console) -> dict[str, Any]:
    config = cell_config(s, size, workers)
    params = parameters_of(config)
    need, have = estimated_memory(params, workers), available_bytes()
    if s.max_params and params > s.max_params:
        return {"parameters": params, "workers": workers, "skipped": f"skipped: over --max-params {s.max_params:,}"}
    if s.memory_guard and have and need > s.memory_guard * have:
        return {"parameters": params, "workers": workers,
                "skipped": f"skipped: needs about {need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB available"}
    run_dir = s.out / "runs" / f"{size.name}-{workers}w"
    console.print(f"cell {size.name} x {workers} workers: {params:,} parameters, run {run_dir}")
    try:
        return run_cell(s, size, workers, run_dir)
    except Exception as exc:  # one failed cell is a row; the others still run
        return {"parameters": params, "workers": workers, "failed": " ".join(str(exc).split())[:300]}
    finally:
        if not s.keep_runs:
            shutil.rmtree(run_dir, ignore_errors=True)
