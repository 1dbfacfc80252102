"""`dilocox bench scale`: what a round costs at a real model size, measured on real processes.

Each cell (a model size × a number of workers W) is one run as a user would start it: a
coordinator and W workers as OS processes talking gRPC over TLS on 127.0.0.1 (benchmarks.cluster,
as ``dilocox demo`` runs them), updates compressed (low-rank + int4 with error feedback), the
coordinator recording every round to a local anvil chain as the demo does when anvil is installed,
and ``dilocox audit`` run on the finished run. The model is a Llama-family decoder (``--family``)
built from its configuration, at about 1M, 20M and 100M parameters (``--sizes``); the exact count
the run built is printed. Data: the embedded corpus as byte tokens (vocabulary 256), or a directory
written by ``dilocox data prepare`` (``--tokens``). Seeds: the run seed (``--seed``).

Columns, per round (means over rounds, and over workers for the worker-side ones):

    compute      the inner loop's seconds, H steps (the worker's train time less its encoding)
    compress     seconds compressing Δ on the worker (trainer.uplink)
    transfer     seconds in PushUpdate and FetchGlobal calls, less the coordinator's close (a
                 fetch waits for the round to close)
    aggregate    the coordinator's round transition: clip, mean, outer step, downlink compression
    store        the coordinator writing the round's objects and manifest
    eval         the coordinator evaluating the new checkpoint (data.eval_batches batches)
    coord / worker RSS   peak resident set (VmHWM), the largest worker's
    store/round  growth of <run>/store after genesis, per round; ckpt/round: the part of it that
                 is full checkpoints (params and outer state, every rounds.checkpoint_every rounds)
    wire/round   the manifests' bytes_up + bytes_down, per round
    audit/round  wall seconds of ``dilocox audit`` (re-deriving every round), per round

A cell whose processes would not fit in the machine's memory (an estimate printed beside it) is
skipped with its reason; ``--max-params`` skips the larger sizes outright.
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

# name: the model section's sizes (n_layer, n_embd, n_head, n_kv_head, intermediate_size) of the
# Llama-family configurations; the built-in GPT (--family gpt) uses n_layer, n_embd and n_head.
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "smoke": (2, 64, 4, 2, 176),
    "1M": (4, 128, 4, 2, 352),
    "20M": (6, 512, 8, 4, 1408),
    "100M": (14, 768, 12, 4, 2048),
}
DEFAULT_SIZES = ("1M", "20M", "100M")
DEFAULT_WORKERS = (2, 8)
COLUMNS = ("size", "params", "W", "compute s", "compress s", "transfer s", "aggregate s", "store s", "eval s",
           "coord RSS MB", "worker RSS MB", "store/round MB", "ckpt/round MB", "wire/round MB", "audit s/round")


@dataclass(frozen=True)
class Settings:
    family: str = "llama"
    sizes: tuple[str, ...] = DEFAULT_SIZES
    workers: tuple[int, ...] = DEFAULT_WORKERS
    rounds: int = 3
    steps: int = 4
    batch_size: int = 4
    block_size: int = 128
    seed: int = 1337
    device: str = "cpu"
    tokens: str = ""
    max_params: int = 0  # 0: no limit
    timeout_s: float = 3600.0
    out: Path = Path("runs/bench-scale")
    extra: tuple[str, ...] = ()  # further --set settings


@dataclass
class Cell:
    size: str
    workers: int
    params: int = 0
    row: dict[str, Any] = field(default_factory=dict)
    skipped: str = ""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", default="llama", help="model family: llama, qwen2 or gpt (default llama)")
    p.add_argument("--sizes", default=",".join(DEFAULT_SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--workers", default=",".join(map(str, DEFAULT_WORKERS)), help="comma-separated worker counts")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="inner steps a round (H)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cpu", help="the workers' device (cpu, cuda, cuda:N)")
    p.add_argument("--tokens", default="", help="a directory written by `dilocox data prepare` (default: "
                                                "the embedded corpus, byte tokens)")
    p.add_argument("--max-params", type=float, default=0, help="skip sizes above this many parameters")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds a cell may run")
    p.add_argument("--out", default="runs/bench-scale", help="where the cells' runs and results.json go")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="a further run-configuration setting for every cell (repeatable)")
    p.add_argument("--smoke", action="store_true", help="one tiny cell (2 workers, 2 rounds): a check, not a figure")


def settings_of(args: argparse.Namespace) -> Settings:
    if args.smoke:
        return Settings(family=args.family, sizes=("smoke",), workers=(2,), rounds=2, steps=2, batch_size=2,
                        block_size=32, seed=args.seed, device=args.device, tokens=args.tokens,
                        timeout_s=args.timeout, out=Path(args.out), extra=tuple(args.set))
    sizes = tuple(s.strip() for s in args.sizes.split(",") if s.strip())
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"--sizes: unknown size {unknown[0][:20]!r} (sizes: {', '.join(SIZES)})")
    try:
        workers = tuple(int(w) for w in args.workers.split(",") if w.strip())
    except ValueError:
        raise SystemExit("--workers: expected comma-separated integers") from None
    if not workers or min(workers) < 1:
        raise SystemExit("--workers: expected at least one count, each >= 1")
    return Settings(family=args.family, sizes=sizes, workers=workers, rounds=args.rounds, steps=args.steps,
                    batch_size=args.batch_size, block_size=args.block_size, seed=args.seed, device=args.device,
                    tokens=args.tokens, max_params=int(args.max_params), timeout_s=args.timeout,
                    out=Path(args.out), extra=tuple(args.set))


# ------------------------------------------------------------------------------------------ a cell


def cell_config(s: Settings, size: str, workers: int) -> Any:
    """The run configuration of one cell."""
    from trainer.config import RunConfig
    from trainer.data import load_corpus

    n_layer, n_embd, n_head, n_kv_head, intermediate = SIZES[size]
    model = [f"model.n_layer={n_layer}", f"model.n_embd={n_embd}", f"model.n_head={n_head}",
             f"model.block_size={s.block_size}"]
    if s.family != "gpt":  # the built-in GPT is the default family and has no such fields
        model += [f"model.family={s.family}", f"model.n_kv_head={n_kv_head}",
                  f"model.intermediate_size={intermediate}"]
    settings = [
        f"run_id=scale-{size}-{workers}w", f"seed={s.seed}", *model,
        f"inner.steps={s.steps}", f"inner.batch_size={s.batch_size}", "inner.lr=0.001",
        f"rounds.rounds={s.rounds}", f"rounds.expected_workers={workers}", f"rounds.quorum={workers}",
        f"rounds.straggler_timeout_s={s.timeout_s}", "rounds.liveness_timeout_s=600",
        "rounds.heartbeat_interval_s=1", "data.eval_batches=2", "compression.enabled=true",
    ]
    if s.tokens:
        settings.append(f"data.tokens={s.tokens}")
    config = RunConfig().with_settings([*settings, *s.extra])
    # Pinned before the chain allowlists the configuration's measurement, as the demo does.
    corpus = load_corpus(config.data, config.seed, config.model.block_size)
    return config.replace(data=dataclasses.replace(config.data, corpus_sha256=corpus.sha256))


def parameter_count(config: Any) -> int:
    import torch

    from trainer.model import build_model

    with torch.device("meta"):
        return sum(p.numel() for p in build_model(config.model, config.seed).parameters())


def memory_needed(params: int, workers: int) -> int:
    """A generous estimate of the cell's resident memory: per worker θ, AdamW's two moments, the
    gradient, Δ and the error feedback (6 × 4 bytes a parameter) plus torch's ~0.5 GB; the
    coordinator θ, m, θ', m', e (5 × 4 bytes) plus the same."""
    base = 512 << 20
    return workers * (24 * params + base) + 20 * params + base


def available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakRss:
    """Polls VmHWM (the kernel's peak resident set) of named processes until stopped."""

    def __init__(self, processes: dict[str, subprocess.Popen[bytes]], every_s: float = 0.25) -> None:
        self.processes, self.every_s = processes, every_s
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="peak-rss", daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.is_set():
            for name, process in list(self.processes.items()):
                hwm = _vm_hwm(process.pid)
                if hwm:
                    self.peak[name] = max(self.peak.get(name, 0), hwm)
            self._stop.wait(self.every_s)


def _vm_hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def store_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def checkpoint_bytes(run: Path) -> int:
    """Bytes of the full checkpoints (params, outer state) of rounds >= 1 that the store holds."""
    from storage_client import CID, lineage
    from trainer.run_dir import RunDir

    rd = RunDir(run)
    total = 0
    for _, manifest in lineage(rd.store, rd.head()):
        if manifest.round == 0:
            continue
        for cid in (manifest.params, manifest.outer_state):
            if rd.store.has(CID.parse(cid)):
                total += len(rd.store.get(CID.parse(cid)))
    return total


def run_cell(s: Settings, cell: Cell, where: Path) -> None:
    """Run one cell and fill ``cell.row``."""
    from benchmarks.cluster import LocalCluster

    config = cell_config(s, cell.size, cell.workers)
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    config.save(where / "config.json")
    run = where / "run"
    run.mkdir()
    names = [f"w{k}" for k in range(cell.workers)]
    metrics = {name: where / f"metrics-{name}.jsonl" for name in names}
    anvil, chain_args = _chain(run, config)
    try:
        with LocalCluster(run, threads_per_worker=max(1, (os.cpu_count() or 1) // cell.workers)) as cluster:
            cluster.start_coordinator(where / "config.json", extra=["--linger", "2", *chain_args[0]],
                                      timeout_s=600)
            genesis_bytes = store_bytes(run / "store")
            with PeakRss(cluster.processes) as rss:
                for name in names:
                    extra = ["--metrics", str(metrics[name]), *chain_args[1]]
                    if s.device != "cpu":
                        extra += ["--device", s.device]
                    cluster.start_worker(name, extra=extra)
                for name in [*names, "coordinator"]:
                    code = cluster.wait_exit(name, s.timeout_s)
                    if code != 0:
                        raise RuntimeError(f"{cell.size} x {cell.workers}: {name} exited with {code}:\n"
                                           f"{cluster.log(name)}")
        audit_s = _audit(run, anvil)
    finally:
        if anvil is not None:
            anvil.stop()
    cell.row = _row(s, cell, run, metrics, rss.peak, genesis_bytes, audit_s)


def _chain(run: Path, config: Any) -> tuple[Any, tuple[list[str], list[str]]]:
    """A local anvil with the contracts deployed, as the demo has, or (None, no arguments) where
    anvil is not installed (then the audit column is empty)."""
    from settlement.anvil import Anvil, AnvilError, anvil_binary

    try:
        anvil_binary()
    except AnvilError:
        return None, ([], [])
    from cli.demo import provision

    anvil = Anvil(state_file=run / "chain" / "state.json")
    anvil.start()
    return anvil, provision(run, anvil.rpc_url, config)


def _audit(run: Path, anvil: Any) -> float | None:
    if anvil is None:
        return None
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "cli.main", "audit", "--run", str(run), "--rpc", anvil.rpc_url,
                           "--allow-dev"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    seconds = time.monotonic() - started
    if done.returncode != 0 or "AUDIT PASSED" not in done.stdout:
        raise RuntimeError(f"audit of {run} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
    return seconds


def _records(path: Path, event: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip())
            if r.get("event") == event]


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _row(s: Settings, cell: Cell, run: Path, metrics: dict[str, Path], peak: dict[str, int],
         genesis_bytes: int, audit_s: float | None) -> dict[str, Any]:
    from trainer.run_dir import RunDir

    rounds = [r for r in RunDir(run).logged_rounds() if r["round"] >= 1]
    n = max(1, len(rounds))
    phases = [r.get("phases") or {} for r in rounds]
    close_s = _mean([p.get("close_s", 0.0) for p in phases])
    worker_rounds = [rec for path in metrics.values() for rec in _records(path, "round")]
    encode = _mean([r.get("encode_s", 0.0) for r in worker_rounds])
    exchange = _mean([r.get("push_s", 0.0) + r.get("fetch_s", 0.0) for r in worker_rounds])
    grown = store_bytes(run / "store") - genesis_bytes
    return {
        "size": cell.size, "params": cell.params, "W": cell.workers,
        "compute s": _mean([r["compute_s"] - r.get("encode_s", 0.0) for r in worker_rounds]),
        "compress s": encode,
        "transfer s": max(0.0, exchange - close_s),
        "aggregate s": _mean([p.get("aggregate_s", 0.0) for p in phases]),
        "store s": _mean([p.get("store_s", 0.0) for p in phases]),
        "eval s": _mean([p.get("eval_s", 0.0) for p in phases]),
        "coord RSS MB": peak.get("coordinator", 0) / 2**20,
        "worker RSS MB": max((v for k, v in peak.items() if k != "coordinator"), default=0) / 2**20,
        "store/round MB": grown / n / 2**20,
        "ckpt/round MB": checkpoint_bytes(run) / n / 2**20,
        "wire/round MB": sum(r["bytes_up"] + r["bytes_down"] for r in rounds) / n / 2**20,
        "audit s/round": None if audit_s is None else audit_s / n,
        "model MB": cell.params * 4 / 2**20,
        "rounds": len(rounds),
    }


# ------------------------------------------------------------------------------------------ the table


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return (f"{cpu}, {os.cpu_count()} cores, {available_memory() / 2**30:.0f} GiB available{gpu}; "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def format_table(cells: Sequence[Cell]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for cell in cells:
        if cell.skipped:
            lines.append(f"| {cell.size} | {cell.params:,} | {cell.workers} | skipped: {cell.skipped} |"
                         + " |" * (len(COLUMNS) - 4))
            continue
        values = []
        for column in COLUMNS:
            v = cell.row.get(column)
            if column == "params":
                values.append(f"{v:,}")
            elif v is None:
                values.append("-")
            elif isinstance(v, float):
                values.append(f"{v:.3g}" if v < 100 else f"{v:.0f}")
            else:
                values.append(str(v))
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)


def run(s: Settings) -> list[Cell]:
    cells = [Cell(size, w) for size in s.sizes for w in s.workers]
    s.out.mkdir(parents=True, exist_ok=True)
    print(f"bench scale: {s.family} models, {s.rounds} rounds of {s.steps} inner steps, batch {s.batch_size} x "
          f"{s.block_size} tokens, compression on, seed {s.seed}, workers on {s.device}; data: "
          f"{s.tokens or 'the embedded corpus, byte tokens'}")
    print(f"machine: {machine()}", flush=True)
    for cell in cells:
        cell.params = parameter_count(cell_config(s, cell.size, cell.workers))
        need = memory_needed(cell.params, cell.workers)
        if s.max_params and cell.params > s.max_params:
            cell.skipped = f"over --max-params {s.max_params:,}"
        elif available_memory() and need > 0.8 * available_memory():
            cell.skipped = f"needs about {need / 2**30:.1f} GiB, {available_memory() / 2**30:.1f} GiB available"
        if cell.skipped:
            print(f"{cell.size} x {cell.workers}: skipped ({cell.skipped})", flush=True)
            continue
        started = time.monotonic()
        run_cell(s, cell, s.out / f"{cell.size}-{cell.workers}w")
        print(f"{cell.size} x {cell.workers}: {cell.params:,} parameters, {time.monotonic() - started:.0f}s",
              flush=True)
    (s.out / "results.json").write_text(json.dumps([cell.__dict__ for cell in cells], indent=2, default=str))
    print()
    print(format_table(cells))
    return cells


def main(args: argparse.Namespace) -> None:
    run(settings_of(args))
