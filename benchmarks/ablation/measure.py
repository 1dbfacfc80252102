"""The ablation's measurements: one run of one mode, as real processes, and what is read off it.

Part 1 (``convergence_run``) trains a mode on a seed over an unthrottled link and evaluates every
checkpoint on held-out batches; Part 2 (``throughput_row``) times the same mode under the emulated
link; ``ceiling`` is the compute-bound tokens/s every throughput is compared with.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from benchmarks.ablation.modes import Mode, rounds_for_tokens, run_config

if TYPE_CHECKING:
    import torch

    from trainer.config import DataConfig, ModelConfig, RunConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA = REPO_ROOT.parent / "shared" / "data" / "wikitext-2"
HELDOUT_SEED = 20_250_626  # the fixed windows of the held-out batches
INNER_LR = 2e-3


@dataclass
class Settings:
    workers: int
    rounds: int
    inner_steps: int
    throughput_rounds: int
    allreduce_throughput_steps: int
    link_ratio: float
    link_latency_ms: float
    batch_size: int
    model: ModelConfig
    eval_batches: int
    modes: list[str]
    seeds: list[int]
    data: Path
    out: Path
    smoke: bool
    keep_runs: bool
    inner_lr: float = INNER_LR
    # Rounds a DiLoCo mode trains past R, for the time column only (relative.time_to_loss): the loss
    # columns still read each run at R rounds' tokens. 0: R.
    time_rounds: int = 0
    timeout_s: float = 3600.0

    @property
    def cores(self) -> int:
        """The cores the benchmark's processes may use (its affinity mask)."""
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    @property
    def cores_per_worker(self) -> int:
        return max(1, self.cores // self.workers)


# ------------------------------------------------------------------------------------------ data


@dataclass
class Data:
    description: str
    config: DataConfig  # the training corpus, as the run configuration names it
    heldout: torch.Tensor  # byte tokens no process trains on
    wikitext: bool


def load_data(folder: Path, seed: int, block_size: int) -> Data:
    from trainer.config import DataConfig
    from trainer.data.corpus import encode, load_corpus

    if not (folder / "valid.txt").is_file() and (folder / "wikitext-2" / "valid.txt").is_file():
        folder = folder / "wikitext-2"  # --data named the shared data folder itself
    valid, test = folder / "valid.txt", folder / "test.txt"
    if valid.is_file() and test.is_file():
        config = DataConfig(corpus=str(valid.resolve()), eval_fraction=0.02, eval_batches=4)
        heldout = encode(test.read_text(encoding="utf-8"))
        return Data(f"WikiText-2 raw: TRAIN on {valid.resolve()} ({valid.stat().st_size:,} bytes; its last 2% is "
                    f"the coordinator's eval split), HELD-OUT loss on {test.resolve()} "
                    f"({len(heldout):,} byte tokens)", config, heldout, True)
    config = DataConfig(corpus="embedded", eval_fraction=0.1, eval_batches=4)
    corpus = load_corpus(config, seed, block_size)
    return Data(f"!!! {folder} NOT FOUND: embedded generated corpus (seed {seed}), last 10% held out "
                f"({len(corpus.eval):,} tokens); NOT WikiText-2 !!!", config, corpus.eval, False)


def heldout_batches(tokens: torch.Tensor, count: int, batch_size: int,
                    block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    import torch

    from trainer.data.corpus import sample_batch

    generator = torch.Generator().manual_seed(HELDOUT_SEED)
    return [sample_batch(tokens, batch_size, block_size, generator) for _ in range(count)]


class Evaluator:
    """Held-out loss of a parameter set, on the same fixed batches for every mode and seed."""

    def __init__(self, s: Settings, data: Data) -> None:
        from trainer.model.gpt import build_model

        self.model = build_model(s.model, s.seeds[0])
        self.batches = heldout_batches(data.heldout, s.eval_batches, s.batch_size, s.model.block_size)

    def __call__(self, params: dict[str, torch.Tensor]) -> float:
        import torch

        from trainer.model.params import load_params
        from trainer.runtime.inner import evaluate

        torch.set_num_threads(os.cpu_count() or 1)
        load_params(self.model, params)
        return evaluate(self.model, self.batches)


def parameter_count(model: ModelConfig, seed: int) -> int:
    from trainer.model.gpt import build_model

    return sum(p.numel() for p in build_model(model, seed).parameters())


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def spread(xs: Sequence[float]) -> float:
    """Sample standard deviation (n − 1); 0 for a single value."""
    if len(xs) < 2:
        return 0.0
    mu = mean(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


# ------------------------------------------------------------------------------------------ runs


@dataclass
class DilocoRun:
    finished: list[dict[str, Any]]  # one `finished` metrics record per worker
    rounds: list[list[dict[str, Any]]]  # the `round` records, per worker
    run_dir: Path
    seconds: float


def worker_args(mode: Mode, s: Settings) -> list[str]:
    """How a worker of ``mode`` is started: the cores it may use and its stages on them."""
    stages = "auto" if mode.stages == 0 else str(mode.stages)
    return ["--cores", str(s.cores_per_worker), "--stages", stages]


def run_diloco(mode: Mode, s: Settings, config: RunConfig, where: Path, *, link_bps: float = 0.0,
               latency_s: float = 0.0) -> DilocoRun:
    """One coordinator and W workers as OS processes; each worker writes its metrics."""
    from cli.cluster import LocalCluster

    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    config.save(where / "config.json")
    names = [f"w{k}" for k in range(s.workers)]
    metrics = {name: where / f"metrics-{name}.jsonl" for name in names}
    started = time.monotonic()
    with LocalCluster(where / "run", threads_per_worker=0) as cluster:
        cluster.start_coordinator(where / "config.json", extra=["--linger", "5"])
        for name in names:
            extra = ["--metrics", str(metrics[name]), *worker_args(mode, s)]
            if link_bps > 0 or latency_s > 0:
                extra += ["--link-bandwidth", repr(link_bps / 1e6), "--link-latency", repr(latency_s * 1e3)]
            cluster.start_worker(name, extra=extra)
        for name in [*names, "coordinator"]:
            code = cluster.wait_exit(name, s.timeout_s)
            if code != 0:
                raise RuntimeError(f"{mode.name}: {name} exited with {code}:\n{cluster.log(name)}")
    seconds = time.monotonic() - started
    finished, rounds = [], []
    for name in names:
        records = [json.loads(line) for line in metrics[name].read_text().splitlines() if line.strip()]
        done = [r for r in records if r.get("event") == "finished"]
        if not done:
            raise RuntimeError(f"{mode.name}: {name} wrote no `finished` metrics record")
        finished.append(done[-1])
        rounds.append([r for r in records if r.get("event") == "round"])
    return DilocoRun(finished, rounds, where / "run", seconds)


def diloco_curve(run_dir: Path, evaluate: Evaluator, workers: int) -> tuple[list[tuple[int, float]], list[str]]:
    """Held-out loss of every checkpoint from genesis to HEAD, at the tokens trained so far.

    Also warnings for rounds that had fewer than W participants.
    """
    from storage_client import lineage
    from trainer.runstore.checkpoints import checkpoint_at
    from trainer.runstore.run_dir import RunDir

    rd = RunDir(run_dir)
    head = rd.head()
    if head is None:
        raise RuntimeError(f"{run_dir}: no HEAD")
    chain = list(lineage(rd.store, head))
    curve, tokens, warnings = [], 0, []
    for round_, (_, manifest) in enumerate(chain):
        tokens += sum(p.tokens for p in manifest.participants)
        if manifest.round >= 1 and len(manifest.participants) != workers:
            warnings.append(f"round {manifest.round} had {len(manifest.participants)} of {workers} workers "
                            f"(dropped: {', '.join(manifest.dropped) or '-'})")
        curve.append((tokens, evaluate(checkpoint_at(rd.store, chain, round_).params)))
    return curve, warnings


def at_tokens(curve: list[tuple[int, float]], budget: int) -> tuple[int, float]:
    """The first point of a loss curve that has trained ``budget`` tokens (else the last)."""
    for tokens, loss in curve:
        if tokens >= budget:
            return tokens, loss
    return curve[-1]


def convergence_run(mode: Mode, s: Settings, data: Data, evaluate: Evaluator, root: Path, seed: int,
                    outer: tuple[float, float] | None = None, topk_density: float = 0.0) -> dict[str, Any]:
    """One seed of one mode on R·H steps' tokens: its held-out curve, final loss and wire bytes."""
    rounds = max(rounds_for_tokens(mode, s.rounds, s.inner_steps), s.time_rounds)
    config = run_config(mode, s, data, rounds, seed, outer, topk_density)
    budget = s.rounds * s.inner_steps * s.workers * s.batch_size * s.model.block_size
    row: dict[str, Any] = {"seed": seed, "outer": [config.outer.lr, config.outer.momentum], "warnings": []}
    started = time.monotonic()
    if mode.allreduce:
        from benchmarks.allreduce import run_allreduce
        from trainer.model.gpt import build_model
        from trainer.model.params import params_of

        result = run_allreduce(config, workers=s.workers, steps=s.rounds * s.inner_steps,
                               snapshot_every=s.inner_steps, threads_per_worker=1, timeout_s=s.timeout_s)
        curve = [(int(tokens), evaluate(params)) for _, tokens, params in result.snapshots]
        if not any(t == 0 for t, _ in curve):
            curve.insert(0, (0, evaluate(params_of(build_model(s.model, seed)))))
        if curve[-1][0] != result.tokens:
            curve.append((int(result.tokens), evaluate(result.params)))
        row.update(sent=float(result.bytes_sent_per_worker), received=float(result.bytes_received_per_worker),
                   t_step_s=float(result.compute_s) / max(1, int(result.steps)), per_round=[])
    else:
        run = run_diloco(mode, s, config, root / f"{mode.key}-{seed}")
        curve, warnings = diloco_curve(run.run_dir, evaluate, s.workers)
        row["warnings"] += warnings
        # Every byte of the run (the last push and the final fetch included) over every token of it.
        tokens_trained = mean([f["tokens"] for f in run.finished])
        row.update(sent=mean([f["bytes_sent"] for f in run.finished]),
                   received=mean([f["bytes_received"] for f in run.finished]),
                   tokens_per_worker=tokens_trained, per_round=per_round(run.rounds))
    row["seconds"] = time.monotonic() - started
    tokens, loss = at_tokens(curve, budget)
    row.setdefault("tokens_per_worker", curve[-1][0] / s.workers)
    row.update(curve=curve, tokens=tokens, final_loss=loss,
               bytes_per_token=(row["sent"] + row["received"]) / row["tokens_per_worker"])
    if tokens != budget:
        row["warnings"].append(f"read at {tokens:,} tokens, the budget is {budget:,}")
    return row


def per_round(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per round, over workers: bytes up and down, inner steps, and the uplink's mean rank."""
    out = []
    by_round: dict[int, list[dict[str, Any]]] = {}
    for records in rounds:
        for r in records:
            by_round.setdefault(r["round"], []).append(r)
    for n in sorted(by_round):
        rs = by_round[n]
        ranks = [mean(list(r["ranks"].values())) for r in rs if r.get("ranks")]
        out.append({"round": n, "bytes_sent": mean([r["bytes_sent"] for r in rs]),
                    "bytes_received": mean([r["bytes_received"] for r in rs]),
                    "inner_steps": mean([r["inner_steps"] for r in rs]),
                    "stages": max(r.get("stages", 1) for r in rs),
                    "mean_rank": mean(ranks) if ranks else None})
    return out


# ------------------------------------------------------------------------------------ throughput


def calibrate(s: Settings, t_step: float, n_params: int) -> dict[str, Any]:
    """The emulated link of Part 2 (a dense fp32 ring all-reduce takes ``link_ratio`` × t_step) and
    the compute-bound ceiling: W processes, each on its share of the cores, doing nothing but inner
    steps: W · B · T / t_step tokens/s."""
    from benchmarks.allreduce import ring_allreduce_bytes

    ring = ring_allreduce_bytes(4 * (n_params + 1), s.workers)  # the gradients and the loss, fp32
    ok = math.isfinite(t_step) and t_step > 0
    return {"t_step_s": t_step, "ring_bytes_per_worker": ring,
            "link_bandwidth_bps": 8 * ring / (s.link_ratio * t_step) if ok else float("nan"),
            "link_latency_s": s.link_latency_ms / 1e3,
            "ceiling_tokens_per_s": s.workers * s.batch_size * s.model.block_size / t_step if ok else float("nan"),
            "source": f"compute_s / steps of the unthrottled Part-1 AllReduce runs (seed {s.seeds[0]}): "
                      f"{s.workers} processes training concurrently on {s.cores} cores, 1 torch thread each"}


def throughput_row(mode: Mode, s: Settings, data: Data, root: Path, link_bps: float, latency_s: float,
                   topk_density: float = 0.0) -> dict[str, Any]:
    seed = s.seeds[0]
    row: dict[str, Any] = {}
    if mode.allreduce:
        from benchmarks.allreduce import run_allreduce

        config = run_config(mode, s, data, 1, seed)
        result = run_allreduce(config, workers=s.workers, steps=s.allreduce_throughput_steps,
                               link_bandwidth_bps=link_bps, link_latency_s=latency_s,
                               threads_per_worker=1, timeout_s=s.timeout_s)
        # Its clock starts after the rendezvous and every step is alike: whole run = steady state.
        row.update(steps=result.steps, tokens=int(result.tokens), wall_s=float(result.wall_s),
                   compute_s=float(result.compute_s), comm_s=float(result.comm_s),
                   utilisation=float(result.compute_s) / float(result.wall_s),
                   comm_to_step=float(result.comm_s) / float(result.compute_s) if result.compute_s else float("nan"),
                   startup_s=0.0, last_exchange_s=0.0, stages=1, threads_per_stage=1)
        row.update(steady_tokens=row["tokens"], steady_wall_s=row["wall_s"], steady_utilisation=row["utilisation"],
                   steady_step_s=row["compute_s"] / max(1, row["steps"]),
                   run_tokens_per_s=row["tokens"] / row["wall_s"], run_utilisation=row["utilisation"])
    else:
        config = run_config(mode, s, data, s.throughput_rounds, seed, topk_density=topk_density)
        run = run_diloco(mode, s, config, root / mode.key, link_bps=link_bps, latency_s=latency_s)
        f = run.finished
        row.update(rounds=s.throughput_rounds, steps=int(mean([sum(r["inner_steps"] for r in rs) for rs in run.rounds])),
                   tokens=int(sum(x["tokens"] for x in f)), wall_s=max(x["wall_s"] for x in f),
                   compute_s=mean([x["compute_s"] for x in f]),
                   utilisation=mean([x["compute_s"] / x["wall_s"] for x in f]),
                   startup_s=max(x["startup_s"] for x in f), last_exchange_s=max(x["last_exchange_s"] for x in f),
                   run_tokens_per_s=sum(x["tokens"] for x in f) / max(x["steady_wall_s"] for x in f),
                   run_utilisation=mean([x["steady_compute_s"] / x["steady_wall_s"] for x in f]),
                   stages=run.rounds[0][-1].get("stages", 1) if run.rounds[0] else 1,
                   threads_per_stage=run.rounds[0][-1].get("threads_per_stage", 1) if run.rounds[0] else 1,
                   bytes_sent_per_worker=mean([x["bytes_sent"] for x in f]),
                   bytes_received_per_worker=mean([x["bytes_received"] for x in f]))
        row.update(steady_state(run, s.throughput_rounds))
    row["tokens_per_s"] = row["tokens"] / row["wall_s"]
    row["steady_tokens_per_s"] = row["steady_tokens"] / row["steady_wall_s"]
    return row


def steady_state(run: DilocoRun, rounds: int) -> dict[str, Any]:
    """Rounds 2..R_t, between each worker's round-1 and round-R_t metrics records.

    A worker writes a round's record when the round's training is done and its exchange pushed
    (synchronous) or the previous exchange received (overlap), so the span between the records of
    rounds 1 and R_t holds R_t − 1 whole rounds of training and exchange, and leaves out the start
    (stage processes, join, first fetch) and the last exchange, which are reported on their own.
    """
    spans, tokens, utilisation, step_s = [], 0, [], []
    for records in run.rounds:
        by_round = {r["round"]: r for r in records}
        if 1 not in by_round or rounds not in by_round or rounds < 2:
            return {"steady_tokens": float("nan"), "steady_wall_s": float("nan"),
                    "steady_utilisation": float("nan"), "steady_step_s": float("nan")}
        later = [by_round[r] for r in range(2, rounds + 1) if r in by_round]
        span = by_round[rounds]["time"] - by_round[1]["time"]
        spans.append(span)
        tokens += sum(r["tokens"] for r in later)
        utilisation.append(sum(r["compute_s"] for r in later) / span)
        step_s.append(sum(r["compute_s"] for r in later) / sum(r["inner_steps"] for r in later))
    return {"steady_tokens": tokens, "steady_wall_s": max(spans), "steady_utilisation": mean(utilisation),
            "steady_step_s": mean(step_s)}
