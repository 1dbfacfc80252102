"""``dilocox demo``: a coordinator and N workers as processes, on the embedded corpus.

Shows one line per finished round (eval loss, mean inner loss, bytes each way, time) and a summary;
the run directory keeps the store, the manifests and the logs for inspection afterwards.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from proto import pb
from trainer.cluster import ClusterError, LocalCluster
from trainer.config import demo_config


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _row(s: pb.RoundSummary) -> list[str]:
    train = "—" if s.round == 0 else f"{s.mean_train_loss:.4f}"
    workers = "genesis" if s.round == 0 else ", ".join(s.participants) + (
        f" (dropped {', '.join(s.dropped)})" if s.dropped else "")
    seconds = "—" if s.round == 0 else f"{s.seconds:.1f}s"
    return [str(s.round), f"{s.eval_loss:.4f}", train, workers, _mb(s.bytes_up), _mb(s.bytes_down), seconds]


def run_demo(run_dir: Path, rounds: int | None = None, workers: int = 2) -> int:
    console = Console()
    config = demo_config()
    config = config.replace(rounds=dataclasses.replace(
        config.rounds, rounds=rounds or config.rounds.rounds, expected_workers=workers, quorum=workers))
    if (run_dir / "HEAD").exists() or (run_dir / "store").exists():
        console.print(f"[yellow]replacing the previous demo run in {run_dir}[/]")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.json"
    config.save(config_path)
    m = config.model
    console.print(
        f"[bold]DiLoCo demo[/]: {workers} workers × {config.inner.steps} inner AdamW steps × "
        f"{config.rounds.rounds} rounds; GPT {m.n_layer}L/{m.n_embd}d/{m.n_head}h, "
        f"context {m.block_size}, byte tokens; embedded corpus; run dir {run_dir}"
    )

    started = time.monotonic()
    table = Table(title="rounds")
    for column in ("round", "eval loss", "train loss", "participants", "bytes up", "bytes down", "time"):
        table.add_column(column, justify="left" if column == "participants" else "right")
    with LocalCluster(run_dir) as cluster:
        cluster.start_coordinator(config_path)
        for i in range(workers):
            cluster.start_worker(f"worker-{i}")
        shown = 0
        columns = (TextColumn("[progress.description]{task.description}"), BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("rounds", total=config.rounds.rounds)
            while True:
                try:
                    status = cluster.wait_for(lambda s: len(s.rounds) > shown or s.finished, 600, "the next round")
                except ClusterError as exc:
                    console.print(f"[red]demo failed:[/] {exc}")
                    return 1
                for summary in status.rounds[shown:]:
                    table.add_row(*_row(summary))
                    progress.console.print("  ".join(
                        f"{name} {value}" for name, value in zip(
                            ("round", "eval", "train", "workers", "up", "down", "time"), _row(summary))))
                shown = len(status.rounds)
                progress.update(task, completed=status.rounds[-1].round if status.rounds else 0)
                if status.finished:
                    break
        codes = {name: cluster.wait_exit(name, 60) for name in list(cluster.processes)}

    elapsed = time.monotonic() - started
    console.print(table)
    rounds_done = list(status.rounds)
    first, last = rounds_done[1] if len(rounds_done) > 1 else rounds_done[0], rounds_done[-1]
    up = sum(s.bytes_up for s in rounds_done)
    down = sum(s.bytes_down for s in rounds_done)
    failed = {name: code for name, code in codes.items() if code != 0}
    improved = last.eval_loss < first.eval_loss
    console.print(
        f"[bold]summary[/]: {last.round} rounds in {elapsed:.1f}s; eval loss {rounds_done[0].eval_loss:.4f} "
        f"(genesis) → {first.eval_loss:.4f} (round {first.round}) → {last.eval_loss:.4f} (round {last.round}); "
        f"{_mb(up)} up, {_mb(down)} down\n"
        f"head manifest {last.manifest_cid}\nrun dir {run_dir} (store, manifests, logs/)"
    )
    if failed:
        console.print(f"[red]processes failed[/]: {failed}; see {run_dir}/logs/")
        return 1
    if not improved:
        console.print("[red]the evaluation loss of the last round is not lower than the first[/]")
        return 1
    return 0
