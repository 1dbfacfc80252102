"""The DiLoCoX ablation (Qi et al., arXiv:2506.21263, §4): what each ingredient buys, measured.

    dilocox bench ablation [--smoke] [--out DIR] [--workers W] [--rounds R] [--inner-steps H]
                           [--throughput-rounds R_t] [--allreduce-throughput-steps N]
                           [--link-ratio 350] [--dilocox-outer-momentum 0.3] [--modes m1,m2,...]
                           [--data DIR]

Modes, one row each (``--modes`` takes the keys):

    allreduce        synchronous data parallel: gloo all-reduce of the gradients every step
                     (benchmarks.allreduce.run_allreduce), the baseline; always run
    diloco           DiLoCo: dense fp32 pseudo-gradients both ways, synchronous rounds, 1 stage
    dilocox          compression (adaptive low-rank + int4, both directions, error feedback)
                     + one-step-delay overlap + 2 pipeline stages per worker
    no-compression   dilocox without compression (dense fp32 both ways)
    no-overlap       dilocox with synchronous rounds
    no-pipeline      dilocox with 1 stage per worker
    fixed-rank       dilocox with a fixed rank 24 (compression.min_rank = max_rank = 24, the middle
                     of the adaptive policy's [16, 32], so both send about the same bytes)
    eager            dilocox whose overlapped rounds start eagerly (rounds.overlap_start = "eager",
                     trainer.worker.loops) instead of with the delayed rule

Every DiLoCo mode runs real processes through benchmarks.cluster.LocalCluster: one coordinator and W
workers (``dilocox worker --metrics FILE [--stages 2]``), one torch thread per worker process, over
gRPC on 127.0.0.1.

Outer optimiser: DiLoCo keeps ``OuterConfig()`` (SGD-Nesterov, lr 0.7, momentum 0.9). Every DiLoCoX
row, the ablations included, uses lr 0.7 and momentum ``--dilocox-outer-momentum`` (default 0.3),
so that each ablation row differs from DiLoCoX in its one technique only. Momentum 0.9 amplifies
both the one-round staleness (trainer.config.RoundConfig.overlap) and the compression residual
that error feedback re-sends a round later: on this benchmark's default configuration (6 rounds,
PP=1, held-out loss), compressed + overlapped rounds ended at 2.285 with momentum 0.7, 2.200 with
0.5, 2.186 with 0.3, 2.189 with 0.2 and 2.220 with 0.0, and compressed synchronous rounds at 2.222
with 0.9 against 2.161 with 0.3.

Compression of the DiLoCoX rows: ``DILOCOX_COMPRESSION``, the adaptive policy of
trainer.compression with τ = 0.9, rank r ∈ [16, 32] (an eighth to a quarter of the model's width
128) and int4 groups of 128 values. Measured on the same configuration against the library
defaults (r ∈ [8, 64], groups of 64), with momentum 0.3: loss 2.177 at 1,108× fewer bytes per token
than AllReduce, against 2.186 at 973×; r ∈ [16, 64] gave 2.177 at 978×. (With momentum 0.5 and
the library defaults otherwise, τ = 0.95 gave 2.183 at 681×, τ = 0.9 2.200 at 976×.)

Inner AdamW lr 2e-3 as in ``demo_config`` (a tiny model over a few hundred steps is far from the regime the
DiLoCo default of 4e-4 was tuned for); the AllReduce baseline uses the same inner optimiser.

Data: WikiText-2 raw from ``../shared/data/wikitext-2`` beside the repository (or ``--data DIR``).
``valid.txt`` is the TRAINING corpus (byte tokens; its last 2% is the coordinator's own eval
split); ``test.txt`` is HELD OUT: the benchmark itself evaluates every checkpoint on fixed-seed
windows of ``test.txt`` (16 batches of 16 × 64 tokens by default) that no process trains on.
Without that folder it falls back, loudly, to the embedded generated corpus with its last 10%
held out.

Part 1, convergence, on an unthrottled link (the update rule does not depend on link speed):
every mode trains on equal tokens, R rounds × H inner steps × W workers × batch × block
(AllReduce: R·H steps, a snapshot every H steps; step t reads exactly the batches DiLoCo worker k
reads at round t//H+1, step t%H). Every round's checkpoint (walked from the run's HEAD through
its manifests) and every AllReduce snapshot is evaluated on the held-out batches: the loss-vs-tokens
curve (``ablation_loss.png``) and the final held-out loss, with its ratio to AllReduce's. Traffic:
the actual gRPC wire bytes of each worker in each direction (its ``--metrics`` file), mean over
workers; AllReduce: ring all-reduce bytes 2(W−1)/W·n per rank and direction. Bytes per token
count both directions of one worker over that worker's tokens, every byte of every RPC; "× fewer"
is AllReduce's bytes per token divided by the mode's. Neither pays for θ⁰: AllReduce ranks and
DiLoCo workers both build it from the seed (a worker's fetch of θ⁰ is the header alone, naming the
CID it checked its own build against).

Part 2, throughput under an emulated link (trainer.link: bandwidth paced on the bytes actually
sent and received, plus a latency per call; the same for every mode and every worker):

  1. the inner step time t_step is calibrated from the Part-1 AllReduce run: compute_s / steps of
     an unthrottled run with W training processes running concurrently, one torch thread each,
     exactly as the DiLoCo workers run (so t_step includes the contention of W processes on the
     machine's cores);
  2. the bandwidth is set so that one dense fp32 ring all-reduce of the model costs
     ``--link-ratio`` (350) × t_step, the regime of the paper's 107B run (10.4 vs 3,728 tokens/s):
     bandwidth_bps = 8 · (2(W−1)/W · 4 · parameters) / (350 · t_step); latency ``--link-latency``
     ms (default 2);
  3. every DiLoCo mode runs R_t rounds × H steps, AllReduce N steps (each costs ~351 t_step).

Reported, each as a ratio to AllReduce too: tokens/s and compute utilisation, two ways.

  * whole run: tokens over all workers / the largest ``wall_s`` among the workers' ``finished``
    metrics (a worker's clock runs from having joined to holding the final checkpoint), and
    compute_s / wall_s, mean over workers. This clock also holds what a short run cannot
    amortise: the start of the pipeline stage processes (inside round 1's training time), and the
    last round's exchange, which no next round overlaps;
  * steady state (the headline): rounds 2..R_t, between each worker's round-1 and round-R_t
    ``round`` metrics records: R_t − 1 whole rounds of training and exchange; tokens of those
    rounds over all workers / the longest worker's span, and their training seconds / the span.

AllReduce's clock starts after the rendezvous and its steps are alike, so both measures are its
``wall_s`` and ``compute_s / wall_s``. Also printed: the all-reduce / step time ratio the emulated
link actually produced (AllReduce comm_s / compute_s under the link).

Targets, for ``dilocox`` against ``allreduce``, printed as met/missed on both measures: held-out
loss ≤ 1.05×; ≥ 1000× fewer bytes per token; ≥ 300× tokens/s; ≥ 85% compute utilisation.

A mode that fails (a process exits non-zero, a run raises) is a row ``failed: <one line>`` in its
table and the benchmark goes on with the others; without the AllReduce row there is nothing to
take ratios against (they print as —), and without its step time no link to emulate, so Part 2's
rows then say so.

Output: markdown tables on stdout and in ``<out>/ablation.md``, raw numbers in
``<out>/ablation.json``, the plot in ``<out>/ablation_loss.png``; the header names the machine,
the data, the model and every setting. The runs' directories go to ``<out>/runs/`` and are deleted
at the end unless ``--keep-runs``. Defaults (2 layers × 128 wide GPT, block 64, batch 16, H = 50,
W = 2, R = 6, R_t = 3, N = 3) take about 7 minutes on a 2-core CPU machine. ``--smoke`` runs
the same code on a tiny configuration (2 layers × 32 wide — two pipeline stages need two blocks —
block 32, batch 4, H = 4, R = 2, R_t = 2, N = 3, W = 2, link ratio 20).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from storage_client import strict_json

if TYPE_CHECKING:  # torch and the trainer load when the benchmark runs, not when the CLI parses
    import torch

    from trainer.config import DataConfig, ModelConfig, OuterConfig, RunConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO_ROOT.parent / "shared" / "data" / "wikitext-2"
HELDOUT_SEED = 20_250_626  # the fixed windows of the held-out batches
INNER_LR = 2e-3
FIXED_RANK = 24
DILOCOX_COMPRESSION = dict(target_energy=0.9, min_rank=16, max_rank=32, int4_group_size=128)
DILOCOX_OUTER_MOMENTUM = 0.3

TARGETS = {"loss_ratio": 1.05, "bytes_x_fewer": 1000.0, "throughput_x": 300.0, "utilisation": 0.85}


@dataclass(frozen=True)
class Mode:
    key: str
    name: str
    compression: bool = False
    overlap: bool = False
    stages: int = 1
    fixed_rank: int = 0  # 0: the adaptive policy
    allreduce: bool = False
    overlap_start: str = "delayed"  # rounds.overlap_start of an overlapped mode

    @property
    def dilocox(self) -> bool:
        """A DiLoCoX row (every mode but the two baselines): DiLoCoX's outer optimiser."""
        return self.compression or self.overlap or self.stages > 1


MODES = (
    Mode("allreduce", "AllReduce", allreduce=True),
    Mode("diloco", "DiLoCo"),
    Mode("dilocox", "DiLoCoX", compression=True, overlap=True, stages=2),
    Mode("no-compression", "DiLoCoX −compression", compression=False, overlap=True, stages=2),
    Mode("no-overlap", "DiLoCoX −overlap", compression=True, overlap=False, stages=2),
    Mode("no-pipeline", "DiLoCoX −pipeline", compression=True, overlap=True, stages=1),
    Mode("fixed-rank", "DiLoCoX −adaptive rank", compression=True, overlap=True, stages=2,
         fixed_rank=FIXED_RANK),
    Mode("eager", "DiLoCoX, eager overlap", compression=True, overlap=True, stages=2, overlap_start="eager"),
)
BY_KEY = {m.key: m for m in MODES}


@dataclass
class Settings:
    workers: int
    rounds: int
    inner_steps: int
    throughput_rounds: int
    allreduce_throughput_steps: int
    link_ratio: float
    link_latency_ms: float
    dilocox_outer_momentum: float
    batch_size: int
    model: ModelConfig
    eval_batches: int
    modes: list[str]
    data: Path
    out: Path
    smoke: bool
    keep_runs: bool
    seed: int = 1337
    inner_lr: float = INNER_LR
    timeout_s: float = 3600.0


FULL = dict(workers=2, rounds=6, inner_steps=50, throughput_rounds=3, allreduce_throughput_steps=3, link_ratio=350.0,
            batch_size=16, model={}, eval_batches=16)  # model: ModelConfig() defaults
SMOKE = dict(workers=2, rounds=2, inner_steps=4, throughput_rounds=2, allreduce_throughput_steps=3, link_ratio=20.0,
             batch_size=4, model=dict(block_size=32, n_layer=2, n_head=2, n_embd=32), eval_batches=4)


# ------------------------------------------------------------------------------------------ data


@dataclass
class Data:
    description: str
    config: DataConfig  # the training corpus, as the run configuration names it
    heldout: torch.Tensor  # byte tokens no process trains on
    wikitext: bool


def load_data(folder: Path, seed: int, block_size: int) -> Data:
    from trainer.config import DataConfig
    from trainer.data import encode, load_corpus

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

    from trainer.data import sample_batch

    generator = torch.Generator().manual_seed(HELDOUT_SEED)
    return [sample_batch(tokens, batch_size, block_size, generator) for _ in range(count)]


class Evaluator:
    def __init__(self, s: Settings, data: Data) -> None:
        from trainer.model import build_model

        self.model = build_model(s.model, s.seed)
        self.batches = heldout_batches(data.heldout, s.eval_batches, s.batch_size, s.model.block_size)

    def __call__(self, params: dict[str, torch.Tensor]) -> float:
        from trainer.diloco import evaluate, load_params

        load_params(self.model, params)
        return evaluate(self.model, self.batches)


# --------------------------------------------------------------------------------------- configs


def outer_of(mode: Mode, s: Settings) -> OuterConfig:
    from trainer.config import OuterConfig

    return OuterConfig(momentum=s.dilocox_outer_momentum) if mode.dilocox else OuterConfig()


def run_config(mode: Mode, s: Settings, data: Data, rounds: int) -> RunConfig:
    from trainer.compression import CompressionConfig
    from trainer.config import InnerConfig, RoundConfig, RunConfig

    compression = CompressionConfig(enabled=mode.compression, **DILOCOX_COMPRESSION)
    if mode.fixed_rank:
        compression = replace(compression, min_rank=mode.fixed_rank, max_rank=mode.fixed_rank)
    return RunConfig(
        run_id=f"ablation-{mode.key}", seed=s.seed, model=s.model,
        inner=InnerConfig(steps=s.inner_steps, batch_size=s.batch_size, lr=s.inner_lr),
        outer=outer_of(mode, s), data=data.config,
        rounds=RoundConfig(rounds=rounds, expected_workers=s.workers, quorum=s.workers,
                           straggler_timeout_s=s.timeout_s, heartbeat_interval_s=0.5,
                           liveness_timeout_s=15.0, overlap=mode.overlap, overlap_start=mode.overlap_start),
        compression=compression,
    )


def parameter_count(model: ModelConfig, seed: int) -> int:
    from trainer.model import build_model

    return sum(p.numel() for p in build_model(model, seed).parameters())


# ------------------------------------------------------------------------------------------ runs


@dataclass
class DilocoRun:
    finished: list[dict[str, Any]]  # one `finished` metrics record per worker
    rounds: list[list[dict[str, Any]]]  # the `round` records, per worker
    run_dir: Path
    seconds: float


def run_diloco(mode: Mode, s: Settings, config: RunConfig, where: Path, *, link_bps: float = 0.0,
               latency_s: float = 0.0) -> DilocoRun:
    """One coordinator and W workers as OS processes; each worker writes its metrics."""
    from benchmarks.cluster import LocalCluster

    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    config.save(where / "config.json")
    names = [f"w{k}" for k in range(s.workers)]
    metrics = {name: where / f"metrics-{name}.jsonl" for name in names}
    started = time.monotonic()
    with LocalCluster(where / "run", threads_per_worker=1) as cluster:
        cluster.start_coordinator(where / "config.json", extra=["--linger", "5"])
        for name in names:
            extra = ["--metrics", str(metrics[name])]
            if mode.stages > 1:
                extra += ["--stages", str(mode.stages)]
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
    from trainer.run_dir import RunDir
    from trainer.wire import decode_params

    rd = RunDir(run_dir)
    head = rd.head()
    if head is None:
        raise RuntimeError(f"{run_dir}: no HEAD")
    curve, tokens, warnings = [], 0, []
    for _, manifest in lineage(rd.store, head):
        tokens += sum(p.tokens for p in manifest.participants)
        if manifest.round >= 1 and len(manifest.participants) != workers:
            warnings.append(f"round {manifest.round} had {len(manifest.participants)} of {workers} workers "
                            f"(dropped: {', '.join(manifest.dropped) or '-'})")
        curve.append((tokens, evaluate(decode_params(rd.store.get(manifest.params)))))
    return curve, warnings


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def convergence_row(mode: Mode, s: Settings, data: Data, evaluate: Evaluator, root: Path) -> dict[str, Any]:
    config = run_config(mode, s, data, s.rounds)
    row: dict[str, Any] = {"name": mode.name, "stages": mode.stages,
                           "overlap": mode.overlap_start if mode.overlap else "no",
                           "compression": ("fixed rank %d" % mode.fixed_rank if mode.fixed_rank else "adaptive")
                           if mode.compression else "none",
                           "outer": asdict(config.outer), "warnings": []}
    if mode.allreduce:
        from benchmarks.allreduce import run_allreduce
        from trainer.model import build_model
        from trainer.diloco import params_of

        started = time.monotonic()
        result = run_allreduce(config, workers=s.workers, steps=s.rounds * s.inner_steps,
                               snapshot_every=s.inner_steps, threads_per_worker=1, timeout_s=s.timeout_s)
        row["seconds"] = time.monotonic() - started
        _threads_for_eval()
        curve = [(int(tokens), evaluate(params)) for _, tokens, params in result.snapshots]
        if not any(t == 0 for t, _ in curve):
            curve.insert(0, (0, evaluate(params_of(build_model(s.model, s.seed)))))
        if not curve or curve[-1][0] != result.tokens:
            curve.append((int(result.tokens), evaluate(result.params)))
        per_worker_tokens = result.tokens / result.workers
        sent, received = float(result.bytes_sent_per_worker), float(result.bytes_received_per_worker)
        row.update(tokens=int(result.tokens), steps=result.steps, wall_s=result.wall_s,
                   compute_s=result.compute_s, comm_s=result.comm_s,
                   t_step_s=_step_time(result))
    else:
        run = run_diloco(mode, s, config, root / mode.key)
        row["seconds"] = run.seconds
        _threads_for_eval()
        curve, warnings = diloco_curve(run.run_dir, evaluate, s.workers)
        row["warnings"] += warnings
        tokens = [f["tokens"] for f in run.finished]
        per_worker_tokens = mean(tokens)
        sent = mean([f["bytes_sent"] for f in run.finished])
        received = mean([f["bytes_received"] for f in run.finished])
        row.update(tokens=int(sum(tokens)), rounds=s.rounds,
                   wall_s=max(f["wall_s"] for f in run.finished),
                   compute_s=mean([f["compute_s"] for f in run.finished]))
        if sum(tokens) != curve[-1][0]:
            row["warnings"].append(f"workers report {sum(tokens)} tokens, the manifests {curve[-1][0]}")
    row.update(curve=curve, final_loss=curve[-1][1], bytes_sent_per_worker=sent,
               bytes_received_per_worker=received, tokens_per_worker=per_worker_tokens,
               bytes_per_token=(sent + received) / per_worker_tokens)
    return row


def _threads_for_eval() -> None:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)


def _step_time(result: Any) -> float:
    """Seconds of compute per training step of one worker process."""
    return float(result.compute_s) / max(1, int(result.steps))


def throughput_row(mode: Mode, s: Settings, data: Data, root: Path, link_bps: float,
                   latency_s: float) -> dict[str, Any]:
    row: dict[str, Any] = {"name": mode.name}
    if mode.allreduce:
        from benchmarks.allreduce import run_allreduce

        config = run_config(mode, s, data, 1)
        result = run_allreduce(config, workers=s.workers, steps=s.allreduce_throughput_steps,
                               link_bandwidth_bps=link_bps, link_latency_s=latency_s,
                               threads_per_worker=1, timeout_s=s.timeout_s)
        # Its clock starts after the rendezvous and every step is alike: whole run = steady state.
        row.update(steps=result.steps, tokens=int(result.tokens), wall_s=float(result.wall_s),
                   compute_s=float(result.compute_s), comm_s=float(result.comm_s),
                   utilisation=float(result.compute_s) / float(result.wall_s),
                   comm_to_step=float(result.comm_s) / float(result.compute_s) if result.compute_s else float("nan"))
        row.update(steady_tokens=row["tokens"], steady_wall_s=row["wall_s"], steady_utilisation=row["utilisation"],
                   steady_step_s=row["compute_s"] / max(1, row["steps"]))
    else:
        config = run_config(mode, s, data, s.throughput_rounds)
        run = run_diloco(mode, s, config, root / mode.key, link_bps=link_bps, latency_s=latency_s)
        row.update(steps=s.throughput_rounds * s.inner_steps, rounds=s.throughput_rounds,
                   tokens=int(sum(f["tokens"] for f in run.finished)),
                   wall_s=max(f["wall_s"] for f in run.finished),
                   compute_s=mean([f["compute_s"] for f in run.finished]),
                   utilisation=mean([f["compute_s"] / f["wall_s"] for f in run.finished]),
                   bytes_sent_per_worker=mean([f["bytes_sent"] for f in run.finished]),
                   bytes_received_per_worker=mean([f["bytes_received"] for f in run.finished]))
        row.update(steady_state(run, s.throughput_rounds))
    row["tokens_per_s"] = row["tokens"] / row["wall_s"]
    row["steady_tokens_per_s"] = row["steady_tokens"] / row["steady_wall_s"]
    return row


def steady_state(run: DilocoRun, rounds: int) -> dict[str, Any]:
    """Rounds 2..R_t, between each worker's round-1 and round-R_t metrics records.

    A worker writes a round's record when the round's training is done and its exchange pushed
    (synchronous) or the previous exchange received (overlap), so the span between the records of
    rounds 1 and R_t holds R_t − 1 whole rounds of training and exchange, and leaves out the
    one-time start of the pipeline stage processes, inside round 1 of the worker's own clock.
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


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type, its message's first line and, for a message that
    carries a process's log (run_diloco's), the log's last line, where the error usually is."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if len(lines) > 1:
        text += f" … {lines[-1]}"
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= 300 else text[:299] + "…"


def failed_row(mode: Mode, exc: BaseException) -> dict[str, Any]:
    return {"name": mode.name, "failed": f"failed: {one_line(exc)}"}


def ran(rows: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of the modes that did not fail."""
    return [r for r in rows.values() if "failed" not in r]


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b is not None and b != 0 else float("nan")


# -------------------------------------------------------------------------------------- reporting


def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "os": platform.platform(),
            "python": platform.python_version(), "load_average": list(os.getloadavg())}


def _count(n: int | None) -> str:
    return "—" if n is None else f"{n:,}"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.3f} MB" if n < 1e9 else f"{n / 1e9:,.2f} GB"


def _x(v: float) -> str:
    if not math.isfinite(v):
        return "—"
    return f"{v:,.0f}×" if v >= 100 else f"{v:,.2f}×" if v < 10 else f"{v:,.1f}×"


def _outer(o: dict[str, Any]) -> str:
    return f"{o['lr']}/{o['momentum']}{' N' if o['nesterov'] else ''}"


def _report_settings(result: dict[str, Any]) -> list[str]:
    s, base_c, m = result["settings"], result["convergence"].get("allreduce", {}), result["machine"]
    lines = [
        f"# DiLoCoX ablation (arXiv:2506.21263){' — SMOKE configuration, numbers mean nothing' if s['smoke'] else ''}",
        "",
        f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, Python {m['python']}, {m['os']}; "
        f"load average {m['load_average'][0]:.2f} at the start (other processes share the cores and the timings)",
        f"data: {result['data']}",
        f"model: GPT {s['model']['n_layer']} layers × {s['model']['n_embd']} wide, {s['model']['n_head']} heads, "
        f"block {s['model']['block_size']}, byte vocabulary 256, {result['parameters']:,} parameters "
        f"({_mb(4 * result['parameters'])} fp32); batch {s['batch_size']} per worker; inner AdamW lr {s['inner_lr']}; "
        f"held-out eval: {s['eval_batches']} fixed batches of {s['batch_size']} × {s['model']['block_size']} tokens",
        f"settings: W = {s['workers']} workers (1 torch thread per process), H = {s['inner_steps']} inner steps; "
        f"convergence R = {s['rounds']} rounds ({s['rounds'] * s['inner_steps']} steps, "
        f"{_count(base_c.get('tokens'))} tokens per mode); throughput R_t = {s['throughput_rounds']} rounds "
        f"({s['throughput_rounds'] * s['inner_steps']} steps) per DiLoCo mode, "
        f"{s['allreduce_throughput_steps']} steps of AllReduce; compression of the DiLoCoX rows: τ = {DILOCOX_COMPRESSION['target_energy']}, "
        f"rank [{DILOCOX_COMPRESSION['min_rank']}, {DILOCOX_COMPRESSION['max_rank']}] (fixed-rank row: {FIXED_RANK}), "
        f"int4 groups of {DILOCOX_COMPRESSION['int4_group_size']}; outer lr/momentum (N: Nesterov) per mode below",
        "",
    ]
    return lines


def _report_convergence(result: dict[str, Any]) -> list[str]:
    conv = result["convergence"]
    lines = [
        "## Part 1: convergence on equal tokens (unthrottled)",
        "",
        "| mode | PP | overlap | compression | outer | tokens | held-out loss | × AllReduce | sent / worker "
        "| received / worker | bytes / token | × fewer |",
        "| --- | ---: | :---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, r in conv.items():
        if "failed" in r:
            lines.append(f"| {r['name']} | {r['failed']} |" + " |" * 10)
            continue
        lines.append(
            f"| {r['name']} | {r['stages'] if key != 'allreduce' else '—'} | "
            f"{r['overlap']} | {r['compression'] if key != 'allreduce' else 'none (fp32)'} | "
            f"{_outer(r['outer']) if key != 'allreduce' else 'AdamW only'} | {r['tokens']:,} | {r['final_loss']:.4f} | "
            f"{r['loss_ratio']:.3f} | {_mb(r['bytes_sent_per_worker'])} | {_mb(r['bytes_received_per_worker'])} | "
            f"{r['bytes_per_token']:,.2f} | {_x(r['bytes_x_fewer'])} |")
    lines += [
        "",
        "bytes / token: both directions of one worker over that worker's tokens, from the gRPC wire bytes "
        "(AllReduce: ring all-reduce bytes per rank), every byte of every RPC. Nobody downloads θ⁰: AllReduce "
        "ranks and DiLoCo workers build it from the seed (a worker's fetch of θ⁰ is the header naming its CID).",
        "",
    ]
    return lines


def _report_throughput(result: dict[str, Any]) -> list[str]:
    s, thr, cal = result["settings"], result["throughput"], result["calibration"]
    base_t = thr.get("allreduce", {})
    lines = [
        "## Part 2: throughput under an emulated link",
        "",
        f"calibration: t_step = {cal['t_step_s'] * 1e3:.1f} ms ({cal['source']}); one dense fp32 ring all-reduce "
        f"= {_mb(cal['ring_bytes_per_worker'])} per rank and direction; link ratio {s['link_ratio']:g} → "
        f"bandwidth {cal['link_bandwidth_bps'] / 1e6:.4f} Mbit/s, latency {s['link_latency_ms']:g} ms per call, "
        f"for every worker of every mode. Measured AllReduce all-reduce time / step time: "
        f"{base_t.get('comm_to_step', float('nan')):.0f}× (target {s['link_ratio']:g}×).",
        "",
        "| mode | steps per worker | steady state: compute ms / step | tokens/s | × AllReduce | compute utilisation "
        "| whole run: tokens | wall s | tokens/s | × AllReduce | compute utilisation |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, r in thr.items():
        if "failed" in r:
            lines.append(f"| {r['name']} | {r['failed']} |" + " |" * 9)
            continue
        steps = f"{r['steps']}" + (f" ({r['rounds']} × {s['inner_steps']})" if "rounds" in r else "")
        lines.append(f"| {r['name']} | {steps} | {1e3 * r['steady_step_s']:.1f} | {r['steady_tokens_per_s']:,.1f} | "
                     f"{_x(r['steady_throughput_x'])} | "
                     f"{100 * r['steady_utilisation']:.1f}% | {r['tokens']:,} | {r['wall_s']:.1f} | "
                     f"{r['tokens_per_s']:,.1f} | {_x(r['throughput_x'])} | {100 * r['utilisation']:.1f}% |")
    lines += [
        "",
        f"steady state: rounds 2–{s['throughput_rounds']} of each worker, between its round-1 and round-"
        f"{s['throughput_rounds']} metrics records (tokens of those rounds over all workers / the longest "
        "worker's span; utilisation: their training seconds / the span, mean over workers; compute ms / step: "
        "their training seconds / their inner steps, mean over workers, which is what a step costs a worker "
        "process on this machine: with P stages per worker, W·P single-threaded processes share its cores). "
        "Whole run: the "
        "workers' `finished` records (tokens / the largest wall_s; compute_s / wall_s, mean over workers), "
        "whose clock starts when a worker has joined, so it also holds the start of the pipeline stage "
        "processes (inside round 1's training time) and the last round's exchange, which no round overlaps. "
        "AllReduce: its clock starts after the rendezvous; both measures equal.",
        "",
    ]
    return lines


def _report_targets(result: dict[str, Any]) -> list[str]:
    conv = result["convergence"]
    lines = [
        "## Targets (DiLoCoX vs AllReduce)",
        "",
    ]
    if not result["targets"]:
        lines.append("- not judged: the DiLoCoX or the AllReduce row failed (see above)")
    for t in result["targets"]:
        verdicts = "; ".join(f"{label + ': ' if label else ''}{value} — **{'met' if met else 'MISSED'}**"
                             for label, value, met in t["values"])
        lines.append(f"- {t['what']} (target {t['target']}): {verdicts}")
    warnings = [f"{r['name']}: {w}" for r in ran(conv) for w in r.get("warnings", [])]
    if warnings:
        lines += ["", "warnings:"] + [f"- {w}" for w in warnings]
    lines += ["", f"benchmark wall time {result['wall_s']:.0f} s"]
    return lines


def report(result: dict[str, Any]) -> str:
    sections = (_report_settings, _report_convergence, _report_throughput, _report_targets)
    return "\n".join(line for section in sections for line in section(result)) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    rows = ran(result["convergence"])
    for r in rows:
        tokens, losses = zip(*r["curve"])
        ax.plot([t / 1e3 for t in tokens], losses, marker="o", markersize=3,
                linestyle="--" if r["name"] == "AllReduce" else "-", label=f"{r['name']} ({r['final_loss']:.3f})")
    ax.set_xlabel("tokens trained, all workers (thousands)")
    ax.set_ylabel("held-out loss (nats / byte token)")
    ax.set_title(f"DiLoCoX ablation: held-out loss vs tokens ({'WikiText-2 test' if result['wikitext'] else 'embedded corpus'})")
    # Genesis (loss ≈ ln 256) would flatten every later difference: zoom on the trained checkpoints.
    trained = [loss for r in rows for tokens, loss in r["curve"] if tokens > 0]
    genesis = [loss for r in rows for tokens, loss in r["curve"] if tokens == 0]
    if trained and genesis:
        ax.set_ylim(min(trained) - 0.05, max(trained) + 0.1)
        ax.set_title(ax.get_title() + f"\n(genesis {max(genesis):.2f}, at 0 tokens, is above the plot)", fontsize=10)
    ax.grid(True, alpha=0.3)
    if rows:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def targets(conv: dict[str, Any], thr: dict[str, Any], rounds: int) -> list[dict[str, Any]]:
    """DiLoCoX against AllReduce; each target judged on the headline measure and the alternative."""
    if any(k not in rows or "failed" in rows[k] for rows in (conv, thr) for k in ("dilocox", "allreduce")):
        return []
    c, t = conv["dilocox"], thr["dilocox"]
    lo, bx, tx, ut = (TARGETS[k] for k in ("loss_ratio", "bytes_x_fewer", "throughput_x", "utilisation"))
    steady = f"steady state (rounds 2–{rounds})"

    def pct(v: float) -> str:
        return f"{100 * v:.1f}%"

    return [
        {"what": "held-out loss ratio", "target": f"≤ {lo}×",
         "values": [("", f"{c['loss_ratio']:.3f}×", c["loss_ratio"] <= lo)]},
        {"what": "fewer bytes per token", "target": f"≥ {bx:,.0f}×",
         "values": [("", _x(c["bytes_x_fewer"]), c["bytes_x_fewer"] >= bx)]},
        {"what": "tokens/s", "target": f"≥ {tx:,.0f}×",
         "values": [(steady, _x(t["steady_throughput_x"]), t["steady_throughput_x"] >= tx),
                    ("whole run", _x(t["throughput_x"]), t["throughput_x"] >= tx)]},
        {"what": "compute utilisation", "target": f"≥ {100 * ut:.0f}%",
         "values": [(steady, pct(t["steady_utilisation"]), t["steady_utilisation"] >= ut),
                    ("whole run", pct(t["utilisation"]), t["utilisation"] >= ut)]},
    ]


# ------------------------------------------------------------------------------------------- main


def calibrate(s: Settings, allreduce: dict[str, Any], n_params: int) -> dict[str, Any]:
    """The emulated link of Part 2: a dense fp32 ring all-reduce takes ``link_ratio`` × the
    AllReduce row's compute time per step."""
    from benchmarks.allreduce import ring_allreduce_bytes

    t_step = allreduce.get("t_step_s", float("nan"))
    ring = ring_allreduce_bytes(4 * (n_params + 1), s.workers)  # the gradients and the loss, fp32
    return {"t_step_s": t_step, "ring_bytes_per_worker": ring,
            "link_bandwidth_bps": 8 * ring / (s.link_ratio * t_step) if t_step > 0 else float("nan"),
            "link_latency_s": s.link_latency_ms / 1e3,
            "source": f"compute_s / steps of the unthrottled Part-1 AllReduce run, {s.workers} processes "
                      f"training concurrently, 1 torch thread each"}


def run(s: Settings) -> dict[str, Any]:
    """The whole benchmark; writes ablation.md / .json / _loss.png under ``s.out``."""
    import torch

    started = time.monotonic()
    host = machine()  # the load average before the benchmark adds its own
    threads = torch.get_num_threads()
    modes = [BY_KEY[k] for k in s.modes]
    data = load_data(s.data, s.seed, s.model.block_size)
    if not data.wikitext:
        print(f"WARNING: {data.description}", file=sys.stderr, flush=True)
    s.out.mkdir(parents=True, exist_ok=True)
    runs = s.out / "runs"
    shutil.rmtree(runs, ignore_errors=True)
    evaluate = Evaluator(s, data)
    n_params = parameter_count(s.model, s.seed)

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    conv: dict[str, Any] = {}
    for mode in modes:
        say(f"[ablation] convergence: {mode.name} ...")
        torch.set_num_threads(threads)
        try:
            conv[mode.key] = convergence_row(mode, s, data, evaluate, runs / "convergence")
        except Exception as exc:  # one failed mode is a row that says so; the others still run
            conv[mode.key] = failed_row(mode, exc)
            say(f"[ablation]   {conv[mode.key]['failed']}")
            continue
        say(f"[ablation]   held-out loss {conv[mode.key]['final_loss']:.4f} in {conv[mode.key]['seconds']:.0f}s")
    base = conv.get("allreduce", {})
    for r in ran(conv):
        r["loss_ratio"] = _ratio(r["final_loss"], base.get("final_loss"))
        r["bytes_x_fewer"] = _ratio(base.get("bytes_per_token"), r["bytes_per_token"])

    calibration = calibrate(s, base, n_params)
    t_step, link_bps, latency_s = calibration["t_step_s"], calibration["link_bandwidth_bps"], calibration["link_latency_s"]
    say(f"[ablation] t_step {t_step * 1e3:.1f} ms → link {link_bps / 1e6:.4f} Mbit/s, {s.link_latency_ms:g} ms")
    thr: dict[str, Any] = {}
    for mode in modes:
        say(f"[ablation] throughput: {mode.name} ...")
        torch.set_num_threads(threads)
        try:
            if not math.isfinite(link_bps):
                raise RuntimeError("no link to emulate: the AllReduce convergence run, which calibrates it, failed")
            thr[mode.key] = throughput_row(mode, s, data, runs / "throughput", link_bps, latency_s)
        except Exception as exc:
            thr[mode.key] = failed_row(mode, exc)
            say(f"[ablation]   {thr[mode.key]['failed']}")
            continue
        say(f"[ablation]   {thr[mode.key]['tokens_per_s']:.1f} tokens/s, "
            f"utilisation {100 * thr[mode.key]['utilisation']:.0f}%")
    base_t = thr.get("allreduce", {})
    for r in ran(thr):
        r["throughput_x"] = _ratio(r["tokens_per_s"], base_t.get("tokens_per_s"))
        r["steady_throughput_x"] = _ratio(r["steady_tokens_per_s"], base_t.get("steady_tokens_per_s"))
    torch.set_num_threads(threads)

    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()}
    result = {"machine": host, "data": data.description, "wikitext": data.wikitext, "parameters": n_params,
              "settings": settings, "calibration": calibration, "convergence": conv, "throughput": thr,
              "targets": targets(conv, thr, s.throughput_rounds), "wall_s": time.monotonic() - started}
    text = report(result)
    print(text, end="", flush=True)
    (s.out / "ablation.md").write_text(text, encoding="utf-8")
    (s.out / "ablation.json").write_text(strict_json(result, indent=1) + "\n", encoding="utf-8")
    plot(result, s.out / "ablation_loss.png")
    if not s.keep_runs:
        shutil.rmtree(runs, ignore_errors=True)
    say(f"[ablation] wrote {s.out / 'ablation.md'}, ablation.json, ablation_loss.png "
        f"({result['wall_s']:.0f} s in all)")
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--smoke", action="store_true", help="tiny configuration, same code path (under a few minutes)")
    p.add_argument("--out", default="runs/bench-ablation", help="ablation.md / .json / _loss.png go here")
    p.add_argument("--workers", type=int, help="W, DiLoCo workers and AllReduce ranks (default 2)")
    p.add_argument("--rounds", type=int, help="R, convergence rounds (default 6; smoke 2)")
    p.add_argument("--inner-steps", type=int, help="H, inner steps per round (default 50; smoke 4)")
    p.add_argument("--throughput-rounds", type=int, help="R_t, rounds per DiLoCo mode under the link (default 3)")
    p.add_argument("--allreduce-throughput-steps", type=int, help="AllReduce steps under the link (default 3)")
    p.add_argument("--link-ratio", type=float,
                   help="one dense all-reduce costs this many inner steps on the emulated link (default 350; smoke 20)")
    p.add_argument("--link-latency", type=float, default=2.0, help="emulated latency per call, ms")
    p.add_argument("--dilocox-outer-momentum", type=float, default=DILOCOX_OUTER_MOMENTUM,
                   help="outer Nesterov momentum of every DiLoCoX row (DiLoCo keeps OuterConfig()'s 0.9)")
    p.add_argument("--modes", default=",".join(m.key for m in MODES),
                   help="comma-separated subset of: " + ", ".join(m.key for m in MODES) + " (allreduce always runs)")
    p.add_argument("--data", default=str(DEFAULT_DATA), help="folder with WikiText-2 valid.txt and test.txt (or the shared data folder holding wikitext-2/)")
    p.add_argument("--keep-runs", action="store_true", help="keep the runs' directories under <out>/runs")


def settings_of(args: argparse.Namespace) -> Settings:
    from trainer.config import ModelConfig

    preset = SMOKE if args.smoke else FULL
    keys = [k.strip() for k in args.modes.split(",") if k.strip()]
    unknown = [k for k in keys if k not in BY_KEY]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(BY_KEY)}")
    keys = ["allreduce"] + [k for k in BY_KEY if k in keys and k != "allreduce"]

    def pick(name: str) -> Any:
        value = getattr(args, name, None)
        return preset[name] if value is None else value

    s = Settings(workers=pick("workers"), rounds=pick("rounds"), inner_steps=pick("inner_steps"),
                 throughput_rounds=pick("throughput_rounds"),
                 allreduce_throughput_steps=pick("allreduce_throughput_steps"), link_ratio=pick("link_ratio"),
                 link_latency_ms=args.link_latency, dilocox_outer_momentum=args.dilocox_outer_momentum,
                 batch_size=preset["batch_size"], model=ModelConfig(**preset["model"]), eval_batches=preset["eval_batches"],
                 modes=keys, data=Path(args.data), out=Path(args.out), smoke=args.smoke, keep_runs=args.keep_runs)
    if s.workers < 2:
        raise ValueError("--workers must be >= 2 (an all-reduce needs two ranks)")
    if min(s.rounds, s.inner_steps, s.throughput_rounds, s.allreduce_throughput_steps) < 1 or s.link_ratio <= 0:
        raise ValueError("rounds, steps and the link ratio must be positive")
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dilocox bench ablation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    run(settings_of(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
