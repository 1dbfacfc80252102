"""Inner-state commitments every K rounds: replay cost per sampled contribution, and the honest
distance and the smallest scale the replay is sure to catch, against K, on two CPU capabilities.

One real run (coordinator and 2 worker processes on 127.0.0.1, one torch thread each; tiny GPT:
2 layers × 32 wide, 30 rounds of 10 inner steps, batch 4 × 32 tokens; plain DiLoCo, dense) with
``rounds.state_every = 1``: every worker's inner state is stored every round
(trainer.runtime.state_commit). A replay at K then sees only the states of rounds r with
r % K == 0 (the others hidden, as a run with ``state_every = K`` would not have stored them), so
one run serves every K; K = 0 hides them all, as a run that stores none (chains back to each
worker's fresh start: up to 30 rounds). K = 10 and K = 0 are past the run rule (rounds.state_every
in [1, trainer.config.REPLAY_HORIZON]): measured to show why it is one, no run may use them.

For each K, each of the sampled contributions (both workers at rounds 12, 19, 26 and 30) is replayed
alone, in a process started with ``ATEN_CPU_CAPABILITY`` set (``default``: no vector kernels;
``native``: the CPU's best, as the workers ran) and one torch thread: the replayed inner steps and
seconds per sampled contribution, and the largest honest distance d over every contribution
replayed on the way. A contribution scaled by s is caught when ‖sΔ − Δ'‖ > τ‖sΔ‖ (τ =
REPLAY_TOLERANCE); since ‖sΔ − Δ'‖ ≥ (s − 1)‖Δ‖ − d‖Δ‖, every s > s* = (1 + d)/(1 − τ) is caught
(d: the honest distance at that K). About 2 minutes on a 2-core machine.

    python -m benchmarks.state_commits
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROUNDS = 30
SAMPLED_ROUNDS = (12, 19, 26, 30)
KS = (1, 2, 5, 10, 0)  # 10, 0 (none stored): past the replay horizon, which a run's config refuses
CAPABILITIES = ("default", "native")


def train(root: Path) -> Path:
    """The 30-round run, every worker's state stored every round; returns its run directory."""
    from cli.cluster import LocalCluster
    from trainer.config import DataConfig, InnerConfig, ModelConfig, RoundConfig, RunConfig

    config = RunConfig(
        run_id="bench", model=ModelConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),
        inner=InnerConfig(steps=10, batch_size=4, lr=1e-3), data=DataConfig(eval_batches=2),
        rounds=RoundConfig(rounds=ROUNDS, expected_workers=2, quorum=2, heartbeat_interval_s=0.5,
                           liveness_timeout_s=10.0, straggler_timeout_s=120.0, state_every=1),
    ).plain_diloco()
    config.save(root / "config.json")
    cluster = LocalCluster(root / "run")
    with cluster:
        cluster.start_coordinator(root / "config.json")
        cluster.start_worker("w0")
        cluster.start_worker("w1")
        for name in ("w0", "w1", "coordinator"):
            if cluster.wait_exit(name, 1200) != 0:
                raise RuntimeError(f"{name} failed:\n{cluster.log(name)}")
    return root / "run"


class _StatesEvery:
    """The run's store, seen as a run with ``state_every = k`` would have it: the inner states of
    the other rounds hidden."""

    def __init__(self, store: object, hidden: set[str]) -> None:
        self.store, self.hidden = store, hidden

    def has(self, cid: object) -> bool:
        return str(cid) not in self.hidden and self.store.has(cid)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)


def replay(run_dir: Path) -> None:
    """In this process (its capability fixed by the environment): one JSON line per K."""
    import torch

    from audit.replay import REPLAY_TOLERANCE, Replayer
    from storage_client import lineage, strict_json
    from trainer.runstore.run_dir import RunDir
    from trainer.config import RunConfig
    from trainer.runtime.state_commit import state_cid

    torch.set_num_threads(1)
    store = RunDir(run_dir).store
    manifests = {m.round: m for _, m in lineage(store, RunDir(run_dir).head())}
    config = RunConfig.from_json(store.get_json(manifests[0].config))
    for k in KS:
        hidden = {str(state_cid(p.state)) for r, m in manifests.items() if not k or r % k
                  for p in m.participants if p.state is not None}
        view = _StatesEvery(store, hidden)
        steps, seconds, worst, sampled = 0, 0.0, 0.0, 0
        for r in SAMPLED_ROUNDS:
            for p in manifests[r].participants:
                replayer = Replayer(view, config, manifests)  # type: ignore[arg-type]
                started = time.perf_counter()
                rows, replayed = replayer.replay([(r, p.worker)])
                seconds += time.perf_counter() - started
                if replayer.problems or any(row.distance is None for row in rows):
                    raise RuntimeError(f"K={k}, round {r}, {p.worker}: {replayer.problems or rows}")
                steps += replayed
                sampled += 1
                worst = max([worst, *(row.distance for row in rows if row.distance is not None)])
        print(strict_json({"k": k, "sampled": sampled, "steps": steps / sampled, "seconds": seconds / sampled,
                          "d": worst, "scale": (1 + worst) / (1 - REPLAY_TOLERANCE), "tolerance": REPLAY_TOLERANCE,
                          "capability": torch.backends.cpu.get_cpu_capability()}), flush=True)


def main(args: argparse.Namespace | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="replay this run (made by a first invocation) instead of training one")
    parser.add_argument("--replay-here", action="store_true", help=argparse.SUPPRESS)  # the child's role
    options = parser.parse_args() if args is None else args
    if options.replay_here:
        replay(options.run)
        return
    run_dir = options.run or train(Path(tempfile.mkdtemp(prefix="dilocox-bench-states-")))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; run: {run_dir}; "
          f"{ROUNDS} rounds x 10 inner steps, 2 workers (1 thread each); sampled: both workers at rounds "
          f"{', '.join(map(str, SAMPLED_ROUNDS))}; replay on 1 thread\n")
    print("| capability | K | inner steps replayed per sampled contribution | seconds per sampled contribution "
          "| max honest d | scale surely caught (> s*) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for capability in CAPABILITIES:
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": "1"}
        child = subprocess.run([sys.executable, "-m", "benchmarks.state_commits", "--run", str(run_dir),
                                "--replay-here"], env=env, capture_output=True, text=True, check=False)
        if child.returncode != 0:
            raise SystemExit(f"the replay under ATEN_CPU_CAPABILITY={capability} failed:\n{child.stderr[-3000:]}")
        for line in child.stdout.splitlines():
            row = json.loads(line)
            print(f"| {capability} ({row['capability']}) | {row['k']} | {row['steps']:.0f} | {row['seconds']:.2f} "
                  f"| {row['d']:.2e} | {row['scale']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
