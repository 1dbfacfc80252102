"""Overlap vs synchronous rounds, at two outer momenta: final held-out loss.

Runs real coordinator and worker processes on 127.0.0.1 (2 workers, tiny GPT: 1 layer × 32 wide,
8 rounds of 100 inner steps, batch 4 × 32 tokens) on the embedded generated corpus, and prints a
markdown table. About 2 minutes on a 2-core CPU machine.

    dilocox bench overlap
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import tempfile
from pathlib import Path

from cli.cluster import LocalCluster
from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig, RoundConfig, RunConfig

MODES = [
    ("synchronous", False, OuterConfig()),
    ("overlap", True, OuterConfig()),
    ("overlap", True, OuterConfig(momentum=0.5)),
]


def run(overlap: bool, outer: OuterConfig) -> list[float]:
    root = Path(tempfile.mkdtemp(prefix="dilocox-bench-"))
    config = RunConfig(
        run_id="bench", model=ModelConfig(block_size=32, n_layer=1, n_head=2, n_embd=32),
        inner=InnerConfig(steps=100, batch_size=4, lr=1e-3), outer=outer, data=DataConfig(eval_batches=2),
        rounds=RoundConfig(rounds=8, expected_workers=2, quorum=2, overlap=overlap,
                           heartbeat_interval_s=0.5, liveness_timeout_s=3.0),
    )
    config = config.replace(compression=dataclasses.replace(config.compression, enabled=False))  # overlap alone
    config.save(root / "config.json")
    with LocalCluster(root / "run") as cluster:
        cluster.start_coordinator(root / "config.json")
        cluster.start_worker("w0")
        cluster.start_worker("w1")
        for name in ("w0", "w1", "coordinator"):
            if cluster.wait_exit(name, 600) != 0:
                raise RuntimeError(f"{name} failed:\n{cluster.log(name)}")
        return [r["eval_loss"] for r in cluster.run_dir.logged_rounds()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options: the three runs above, as they are."""


def main(args: argparse.Namespace | None = None) -> None:
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; "
          f"data: embedded generated corpus (seed 1337), eval on 2 held-out batches\n")
    print("| mode | outer lr | outer momentum | eval loss by round (genesis → 8) | final |")
    print("| --- | ---: | ---: | --- | ---: |")
    for name, overlap, outer in MODES:
        losses = run(overlap, outer)
        trail = " ".join(f"{x:.2f}" for x in losses)
        print(f"| {name} | {outer.lr} | {outer.momentum} | {trail} | {losses[-1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
