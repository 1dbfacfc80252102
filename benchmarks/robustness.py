"""Robustness: what one admitted dishonest worker does to a run, and what each defence costs.

    dilocox bench robust [--quick] [--rounds R] [--seed S] [--out DIR] [--scenarios s1,s2,...]
                         [--aggregations a1,a2,...] [--honest-workers K] [--trim-fraction β]
                         [--screen-margin M] [--scale X] [--data DIR] [--keep-runs]

Every run is real processes on 127.0.0.1 (cli.cluster.LocalCluster): a coordinator and K
honest ``dilocox worker`` processes (w0, w1, …; K = 1 by default), one torch thread each, plus
"mallory", an admitted client driven from this process (benchmarks.hostile): it joins as a worker,
keeps itself live with heartbeats, and each round fetches θ⁽ʳ⁻¹⁾, trains the update an honest
worker on its shard would (H AdamW steps, one torch thread), then pushes what its scenario says.
Rounds close once every live worker has delivered (quorum 1), so a refused push costs the round
nothing but mallory's contribution.

Scenarios, one row each (``--scenarios`` takes the keys):

    honest        mallory pushes its honest update (the row every other one is compared with)
    scaled        its honest update × 86 (--scale)
    noise         Gaussian noise with the L2 norm of its honest update
    noise-bound   Gaussian noise at 0.99 × the coarse bound (trainer.rounds.aggregation.norm_bound)
    replay        round 1: its honest update; later rounds: round 1's update again, byte for byte
    zero          an all-zero update
    stale         trains from, and names, the state one round older than the round's (round 1:
                  the round's own, so round 1 is honest)
    tokens        its honest update, claiming 1000× the round's tokens

Aggregation settings, one column each (``--aggregations`` takes the keys; trainer.config.RoundConfig):

    clip-off      clip_multiple 0, aggregator "mean": the plain mean, no defence
    clip          clip_multiple 2 (the default), "mean"
    trimmed       clip_multiple 2, "trimmed_mean", trim_fraction β (--trim-fraction, 0.2)
    median        clip_multiple 2, "median" (the coordinate-wise lower median)
    screen        clip_multiple 2, "mean", screen_margin M (--screen-margin, 0.05 nats)

Also an honest-only table: K + 1 honest worker processes (no mallory) under each setting, quorum
K + 1: what each defence costs a run that has no attacker.

Measured, per run: the held-out loss of the final checkpoint, evaluated here on fixed-seed
windows of WikiText-2 ``test.txt`` that no process trains on (benchmarks.ablation.measure.heldout_batches:
16 batches of 16 × 64 tokens by default); its ratio to the honest-only run under the plain mean ("clip-off"),
the reference of every table; the mean round time over rounds 2..R (round 1 also holds the
workers' start), from the coordinator's rounds.jsonl; what happened to mallory's pushes each
round (accepted, clipped (the coordinator's log), or refused with the gRPC status and the reason);
and whether every round re-derives bit for bit from the stored updates (audit.rederive with the
run's ``rounds`` section). A run that fails (a process exits non-zero, anything raises) is the
cell ``failed: <one line>`` and the benchmark goes on.

Data as in benchmarks/ablation/measure.py: WikiText-2 raw ``valid.txt`` is the training corpus,
``test.txt`` held out; without that folder it falls back, loudly, to the embedded corpus.

Defaults: the demo model (2 layers × 128 wide GPT, block 64, ``trainer.config.demo_config``'s
inner lr 2e-3), batch 16, H = 50, R = 5, outer SGD-Nesterov lr 0.7 / momentum 0.9 (OuterConfig()).
``--quick``: a tiny model (1 layer × 32 wide, block 32, batch 4, H = 4, R = 2) for a smoke test.
Output: markdown on stdout and in ``<out>/robustness.md``, raw numbers in ``<out>/robustness.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proto import WorkerPhase
from storage_client import strict_json

if TYPE_CHECKING:  # torch, grpc and the trainer load when the benchmark runs, not when the CLI parses
    import torch

    from benchmarks.ablation.measure import Data
    from trainer.config import ModelConfig, RunConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO_ROOT.parent / "shared" / "data" / "wikitext-2"
INNER_LR = 2e-3  # demo_config's
TOKENS_CLAIMED = 1000  # × the round's tokens, in the "tokens" scenario
NOISE_AT_BOUND = 0.99  # × the coarse bound, so the noise passes check 5 and reaches the aggregation
REFERENCE = "clip-off"  # the honest-only run under this setting is every ratio's denominator
WORKER_FLAGS = ("--reconnect-timeout", "30")  # a coordinator gone for good fails the run in 30 s, not 120


@dataclass(frozen=True)
class Scenario:
    key: str
    name: str


SCENARIOS = (
    Scenario("honest", "honest (mallory honest)"),
    Scenario("scaled", "scaled ×86"),
    Scenario("noise", "noise, honest norm"),
    Scenario("noise-bound", "noise at the coarse bound"),
    Scenario("replay", "replay of round 1's update"),
    Scenario("zero", "zero update"),
    Scenario("stale", "stale base (one round old)"),
    Scenario("tokens", "inflated tokens ×1000"),
)
SCENARIO = {s.key: s for s in SCENARIOS}


@dataclass(frozen=True)
class Aggregation:
    key: str
    name: str
    clip_multiple: float = 2.0
    aggregator: str = "mean"
    screen: bool = False


AGGREGATIONS = (
    Aggregation("clip-off", "mean, no clip", clip_multiple=0.0),
    Aggregation("clip", "clip c=2 + mean"),
    Aggregation("trimmed", "clip + trimmed mean", aggregator="trimmed_mean"),
    Aggregation("median", "clip + median", aggregator="median"),
    Aggregation("screen", "clip + mean + screening", screen=True),
)
AGGREGATION = {a.key: a for a in AGGREGATIONS}


@dataclass
class Settings:
    rounds: int
    inner_steps: int
    batch_size: int
    model: ModelConfig
    eval_batches: int
    scenarios: list[str]
    aggregations: list[str]
    data: Path
    out: Path
    quick: bool
    keep_runs: bool = False
    honest_workers: int = 1
    seed: int = 1337
    inner_lr: float = INNER_LR
    scale: float = 86.0
    trim_fraction: float = 0.2
    screen_margin: float = 0.05
    timeout_s: float = 600.0


FULL = dict(rounds=5, inner_steps=50, batch_size=16, model={}, eval_batches=16)  # model: ModelConfig() defaults
QUICK = dict(rounds=2, inner_steps=4, batch_size=4, model=dict(block_size=32, n_layer=1, n_head=2, n_embd=32),
             eval_batches=2)


# --------------------------------------------------------------------------------------- configs


def run_config(s: Settings, data: Data, agg: Aggregation, *, run_id: str, mallory: bool) -> RunConfig:
    from trainer.config import InnerConfig, OuterConfig, RoundConfig, RunConfig

    workers = s.honest_workers + 1
    return RunConfig(
        run_id=run_id, seed=s.seed, model=s.model,
        inner=InnerConfig(steps=s.inner_steps, batch_size=s.batch_size, lr=s.inner_lr),
        outer=OuterConfig(), data=data.config,
        rounds=RoundConfig(rounds=s.rounds, expected_workers=workers,
                           # with mallory: close once every live worker delivered, accepted or refused
                           quorum=1 if mallory else workers,
                           straggler_timeout_s=s.timeout_s, heartbeat_interval_s=0.5, liveness_timeout_s=15.0,
                           clip_multiple=agg.clip_multiple, aggregator=agg.aggregator,
                           trim_fraction=s.trim_fraction, screen_margin=s.screen_margin if agg.screen else 0.0),
    ).plain_diloco()  # what the aggregation rows compare: dense updates (the hostile clients push dense)


# ----------------------------------------------------------------------------------------- mallory


def noise_like(update: dict[str, torch.Tensor], norm: float, seed: int) -> dict[str, torch.Tensor]:
    """Gaussian noise in ``update``'s layout, scaled to L2 norm ``norm``."""
    import torch

    from trainer.rounds.aggregation import exact_norm

    generator = torch.Generator().manual_seed(seed)
    noise = {k: torch.randn(v.shape, generator=generator) for k, v in sorted(update.items())}
    factor = torch.tensor(norm / exact_norm(noise), dtype=torch.float32)
    return {k: v.mul(factor) for k, v in noise.items()}


class Play:
    """Mallory's side of one run: each round, fetch, train honestly, push what the scenario says."""

    def __init__(self, key: str, s: Settings, m: Any, trainer: Any, beats: Any, bound: float) -> None:
        self.key, self.s, self.m, self.trainer, self.beats, self.bound = key, s, m, trainer, beats, bound
        self.previous: tuple[str, dict[str, torch.Tensor]] | None = None  # last round's base, for "stale"
        self.first: dict[str, torch.Tensor] | None = None  # round 1's update, for "replay"

    def round(self, r: int) -> dict[str, Any]:
        import grpc

        from trainer.rounds.aggregation import exact_norm

        self.beats.round, self.beats.phase = r, WorkerPhase.TRAINING
        base, params = self.trainer.fetch(r - 1)
        used = (base, params) if self.key != "stale" or self.previous is None else self.previous
        self.previous = (base, params)
        delta = self.trainer.train(used[1], r)
        header: dict[str, Any] = {"round": r, "base_params_cid": used[0], "train_loss": self.trainer.loss,
                                  "base_bytes_received": self.trainer.received[used[0]]}
        push = delta
        if self.key == "scaled":
            push = {k: v * self.s.scale for k, v in delta.items()}
        elif self.key == "noise":
            push = noise_like(delta, exact_norm(delta), self.s.seed * 1000 + r)
        elif self.key == "noise-bound":
            push = noise_like(delta, NOISE_AT_BOUND * self.bound, self.s.seed * 1000 + r)
        elif self.key == "replay":
            self.first = self.first or delta
            push = self.first
        elif self.key == "zero":
            push = self.m.zero
        elif self.key == "tokens":
            header["tokens"] = self.m.tokens * TOKENS_CLAIMED
        self.beats.phase = WorkerPhase.PUSHING
        outcome: dict[str, Any] = {"round": r, "norm": exact_norm(push), "honest_norm": exact_norm(delta)}
        try:
            self.m.push(push, **header)
            outcome["accepted"] = True
        except grpc.RpcError as exc:
            outcome.update(accepted=False, code=exc.code().name, details=exc.details() or "")
        self.beats.phase = WorkerPhase.WAITING
        return outcome


# -------------------------------------------------------------------------------------------- runs


def held_out_curve(run_dir: Path, evaluate: Any) -> list[tuple[int, float]]:
    from storage_client import lineage
    from trainer.codec.wire import decode_params
    from trainer.runstore.run_dir import RunDir

    rd = RunDir(run_dir)
    head = rd.head()
    if head is None:
        raise RuntimeError(f"{run_dir}: no HEAD")
    return [(m.round, evaluate(decode_params(rd.store.get(m.params)))) for _, m in lineage(rd.store, head)]


def rederives(run_dir: Path) -> bool:
    """Every round's params and outer state re-derive bit for bit from the stored updates (the
    audit's arithmetic, audit.rederive, under the run's own ``rounds`` section)."""
    from audit.rederive import rederive
    from storage_client import CID, lineage
    from trainer.codec.wire import decode_params, layout_of
    from trainer.config import RunConfig
    from trainer.runstore.round_inputs import ClipHistory, round_updates
    from trainer.runstore.run_dir import RunDir

    run = RunDir(run_dir)
    chain = lineage(run.store, run.head())
    config = RunConfig.from_json(run.store.get_json(chain[0][1].config))
    clip = ClipHistory(config.rounds)
    state = (run.store.get(chain[0][1].params), run.store.get(chain[0][1].outer_state))
    layout = layout_of(decode_params(state[0]))
    for _, m in chain[1:]:
        updates = round_updates(run.store, m, layout, config.model)
        history = clip.history(m.round)
        derived = rederive(config.outer, *state, updates, rounds=config.rounds, history=history)
        clip.keep_updates(m.round, updates)
        state = (derived.params, derived.outer_state)
        if (derived.params_digest != CID.parse(m.params).digest
                or derived.outer_state_digest != CID.parse(m.outer_state).digest):
            return False
    return True


def round_seconds(run_dir: Path) -> dict[int, float]:
    """Each published round's seconds from its opening to its publication (rounds.jsonl)."""
    records = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines() if line.strip()]
    return {int(r["round"]): float(r["seconds"]) for r in records if int(r["round"]) >= 1}


def clipped_rounds(log: str) -> dict[int, list[str]]:
    """Who the coordinator clipped in each round, from its log ("round r: clipped a, b to norm …")."""
    out: dict[int, list[str]] = {}
    for match in re.finditer(r"round (\d+): clipped (.+?) to norm", log):
        out[int(match.group(1))] = match.group(2).split(", ")
    return out


def one_run(s: Settings, data: Data, agg: Aggregation, scenario: str | None, evaluate: Any,
            where: Path) -> dict[str, Any]:
    """One run: ``scenario`` None is the honest-only run (K + 1 worker processes)."""
    import torch

    from benchmarks.hostile import Heartbeats, Mallory, Trainer
    from cli.cluster import LocalCluster
    from trainer.model.gpt import build_model
    from trainer.rounds.aggregation import norm_bound

    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    config = run_config(s, data, agg, run_id=f"robust-{scenario or 'honest-only'}-{agg.key}",
                        mallory=scenario is not None)
    config.save(where / "config.json")
    honest = [f"w{k}" for k in range(s.honest_workers + (1 if scenario is None else 0))]
    outcomes: list[dict[str, Any]] = []
    started = time.monotonic()
    threads = torch.get_num_threads()
    with LocalCluster(where / "run", threads_per_worker=1) as cluster:
        cluster.start_coordinator(where / "config.json", extra=["--linger", "5"])
        if scenario is None:
            for name in honest:
                cluster.start_worker(name, extra=WORKER_FLAGS)
        else:
            m = Mallory.joined(cluster)  # first, so it holds shard 0 as w0 would in the honest-only run
            trainer = Trainer(m, cluster)
            bound = norm_bound(m.config, sum(p.numel() for p in build_model(m.config.model, m.config.seed).parameters()))
            for name in honest:
                cluster.start_worker(name, extra=WORKER_FLAGS)
            # Quorum 1 closes a round once every live worker has delivered: wait for the honest ones
            # to join, or round 1 would close on mallory's push alone.
            cluster.wait_for(lambda st: set(honest) <= {w.worker_id for w in st.workers}, s.timeout_s,
                             "the honest workers to join")
            torch.set_num_threads(1)  # mallory trains as a worker does: one torch thread
            try:
                with Heartbeats(m, m.config.rounds.heartbeat_interval_s) as beats:
                    play = Play(scenario, s, m, trainer, beats, bound)
                    for r in range(1, s.rounds + 1):
                        outcomes.append(play.round(r))
            finally:
                torch.set_num_threads(threads)
        for name in [*honest, "coordinator"]:
            code = cluster.wait_exit(name, s.timeout_s)
            if code != 0:
                raise RuntimeError(f"{name} exited with {code}: {cluster.log(name, tail=1)}")
        log = cluster.log("coordinator", tail=100_000)
    seconds = time.monotonic() - started
    curve = held_out_curve(where / "run", evaluate)
    times = round_seconds(where / "run")
    clipped = clipped_rounds(log)
    for o in outcomes:
        o["clipped"] = "mallory" in clipped.get(o["round"], [])
    steady = [t for r, t in times.items() if r >= 2] or list(times.values())  # round 1 holds the start
    return {"final_loss": curve[-1][1], "curve": curve, "round_s": times, "mean_round_s": mean(steady),
            "wall_s": seconds,
            "outcomes": outcomes, "honest_clipped": sorted({w for ws in clipped.values() for w in ws if w != "mallory"}),
            "rederives": rederives(where / "run")}


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


# --------------------------------------------------------------------------------------- reporting


def short_reason(details: str) -> str:
    """A refusal's reason in a few words (the full text is in the JSON)."""
    for needle, words in (("all zeros", "all-zero update"), ("byte-identical", "replayed update"),
                          ("was computed from", "not the round's base"), ("claimed tokens", "claimed tokens"),
                          ("exceeds the bound", "norm above the coarse bound"),
                          ("screened on held-out", "screened: raises held-out loss"),
                          ("claimed train_loss", "train loss not a cross-entropy")):
        if needle in details:
            return words
    return details.split(":")[0][:60]


def what_happened(outcomes: list[dict[str, Any]]) -> str:
    """Mallory's pushes over the rounds, grouped: "r1 accepted; r2–4 refused INVALID_ARGUMENT (…)"."""
    def label(o: dict[str, Any]) -> str:
        if o["accepted"]:
            return "clipped" if o["clipped"] else "accepted"
        return f"refused {o['code']} ({short_reason(o['details'])})"

    groups: list[tuple[int, int, str]] = []
    for o in outcomes:
        text = label(o)
        if groups and groups[-1][2] == text:
            groups[-1] = (groups[-1][0], o["round"], text)
        else:
            groups.append((o["round"], o["round"], text))
    if len(groups) == 1:
        return f"{groups[0][2]}, every round"
    return "; ".join(f"r{a}{f'–{b}' if b != a else ''} {text}" for a, b, text in groups)


def cell(r: dict[str, Any], what: str, reference: float) -> str:
    if "failed" in r:
        return r["failed"]
    if what == "loss":
        ratio = r["final_loss"] / reference if math.isfinite(reference) else float("nan")
        return f"{r['final_loss']:.4f} ({ratio:.3f}×)" + ("" if r["rederives"] else " NOT re-derived")
    if what == "time":
        return f"{r['mean_round_s']:.2f}"
    return what_happened(r["outcomes"])


def report(result: dict[str, Any]) -> str:
    s, m = result["settings"], result["machine"]
    aggs = [AGGREGATION[k] for k in s["aggregations"]]
    honest_only, attacked = result["honest_only"], result["attacked"]
    reference = honest_only.get(REFERENCE, {}).get("final_loss", float("nan"))
    n = s["honest_workers"] + 1
    lines = [
        f"# Robustness: one admitted dishonest worker{' — QUICK configuration, numbers mean nothing' if s['quick'] else ''}",
        "",
        f"command: `{result['command']}`",
        "",
        f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, Python {m['python']}, {m['os']}; "
        f"load average {m['load_average'][0]:.2f} at the start",
        f"data: {result['data']}",
        f"model: GPT {s['model']['n_layer']} layers × {s['model']['n_embd']} wide, {s['model']['n_head']} heads, "
        f"block {s['model']['block_size']}, {result['parameters']:,} parameters; batch {s['batch_size']}, "
        f"H = {s['inner_steps']} inner steps (AdamW lr {s['inner_lr']}), R = {s['rounds']} rounds, outer "
        f"SGD-Nesterov lr 0.7 / momentum 0.9; seed {s['seed']} (model, data order), noise seeds {s['seed']}·1000 + r, "
        f"held-out windows seed {result['heldout_seed']} ({s['eval_batches']} batches of {s['batch_size']} × "
        f"{s['model']['block_size']} tokens)",
        f"workers: {s['honest_workers']} honest process(es) + mallory (n = {n} updates a round when mallory's "
        f"is accepted), one torch thread each; coarse bound {result['bound']:.4g} (trainer.rounds.aggregation.norm_bound)",
        "settings: " + "; ".join(f"**{a.key}** = {describe(a, s)}" for a in aggs),
        f"reference: the honest-only run under {REFERENCE} (plain mean), held-out loss "
        f"{reference:.4f}; every ratio below is a loss over it",
        "",
        "## Honest-only runs: the cost of each setting when nobody attacks",
        "",
        f"{n} honest worker processes, no mallory.",
        "",
        "| setting | held-out loss | × plain mean | mean round s | re-derives |",
        "| --- | ---: | ---: | ---: | :---: |",
    ]
    for a in aggs:
        r = honest_only.get(a.key, {"failed": "not run"})
        if "failed" in r:
            lines.append(f"| {a.key} | {r['failed']} | | | |")
            continue
        lines.append(f"| {a.key} | {r['final_loss']:.4f} | {r['final_loss'] / reference:.3f}× | "
                     f"{r['mean_round_s']:.2f} | {'yes' if r['rederives'] else '**no**'} |")
    header = "| scenario | " + " | ".join(a.key for a in aggs) + " |"
    rule = "| --- |" + " ---: |" * len(aggs)
    for title, what, note in (
            ("Held-out loss after R rounds (× the honest-only plain mean)", "loss",
             "A cell marked NOT re-derived did not re-derive bit for bit from its stored updates."),
            ("What happened to mallory's pushes", "what",
             "clipped: accepted, then scaled down to c × the lower median norm (trainer.rounds.aggregation); a refused "
             "push is in no manifest, so that run's rounds hold the honest update(s) alone."),
            ("Mean round time, rounds 2..R (s)", "time",
             "From each round's opening to its publication (the coordinator's rounds.jsonl): training, "
             "both transfers, screening, aggregation, the outer step and the coordinator's own eval.")):
        lines += ["", f"## {title}", "", header, rule.replace("---:", "---") if what == "what" else rule]
        for sc in s["scenarios"]:
            row = attacked.get(sc, {})
            cells = [cell(row.get(a.key, {"failed": "not run"}), what, reference) for a in aggs]
            lines.append(f"| {SCENARIO[sc].name} | " + " | ".join(cells) + " |")
        lines += ["", note]
    clipped_honest = sorted({f"{sc}/{a}" for sc, row in attacked.items() for a, r in row.items()
                             if r.get("honest_clipped")})
    if clipped_honest:
        lines += ["", "honest workers clipped in: " + ", ".join(clipped_honest)]
    lines += ["", f"benchmark wall time {result['wall_s']:.0f} s"]
    return "\n".join(lines) + "\n"


def describe(a: Aggregation, s: dict[str, Any]) -> str:
    parts = [f"clip_multiple {a.clip_multiple:g}", f"aggregator {a.aggregator}"]
    if a.aggregator == "trimmed_mean":
        n = s["honest_workers"] + 1
        parts.append(f"trim_fraction {s['trim_fraction']:g} (b = ⌊β·n⌋ = {math.floor(s['trim_fraction'] * n)} "
                     f"with n = {n})")
    if a.screen:
        parts.append(f"screen_margin {s['screen_margin']:g}")
    return ", ".join(parts)


# -------------------------------------------------------------------------------------------- main


def failed(exc: BaseException) -> dict[str, Any]:
    from benchmarks.ablation import one_line

    return {"failed": f"failed: {one_line(exc)}"}


def run(s: Settings, command: str = "dilocox bench robust") -> dict[str, Any]:
    """The whole benchmark; writes robustness.md / .json under ``s.out``."""
    import torch

    from benchmarks.ablation import machine
    from benchmarks.ablation.measure import HELDOUT_SEED, heldout_batches, load_data
    from trainer.model.gpt import build_model
    from trainer.model.params import load_params
    from trainer.rounds.aggregation import norm_bound
    from trainer.runtime.inner import evaluate as evaluate_model

    started = time.monotonic()
    host = machine()
    data = load_data(s.data, s.seed, s.model.block_size)
    if not data.wikitext:
        print(f"WARNING: {data.description}", file=sys.stderr, flush=True)
    s.out.mkdir(parents=True, exist_ok=True)
    runs = s.out / "runs"
    shutil.rmtree(runs, ignore_errors=True)
    model = build_model(s.model, s.seed)
    batches = heldout_batches(data.heldout, s.eval_batches, s.batch_size, s.model.block_size)
    n_params = sum(p.numel() for p in model.parameters())
    threads = torch.get_num_threads()

    def evaluate(params: dict[str, torch.Tensor]) -> float:
        load_params(model, params)
        return evaluate_model(model, batches)

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def attempt(agg: Aggregation, scenario: str | None) -> dict[str, Any]:
        what = scenario or "honest-only"
        say(f"[robust] {what} / {agg.key} ...")
        torch.set_num_threads(threads)
        try:
            r = one_run(s, data, agg, scenario, evaluate, runs / f"{what}-{agg.key}")
        except Exception as exc:  # one failed run is a cell that says so; the others still run
            r = failed(exc)
            say(f"[robust]   {r['failed']}")
            return r
        say(f"[robust]   held-out loss {r['final_loss']:.4f}, {r['mean_round_s']:.2f} s a round"
            + (f"; mallory: {what_happened(r['outcomes'])}" if scenario else ""))
        return r

    aggs = [AGGREGATION[k] for k in s.aggregations]
    honest_only = {a.key: attempt(a, None) for a in aggs}
    attacked = {sc: {a.key: attempt(a, sc) for a in aggs} for sc in s.scenarios}
    torch.set_num_threads(threads)

    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()}
    result = {"command": command, "machine": host, "data": data.description, "wikitext": data.wikitext,
              "parameters": n_params, "heldout_seed": HELDOUT_SEED, "settings": settings,
              "bound": norm_bound(run_config(s, data, AGGREGATIONS[0], run_id="bound", mallory=True), n_params),
              "honest_only": honest_only, "attacked": attacked, "wall_s": time.monotonic() - started}
    text = report(result)
    print(text, end="", flush=True)
    (s.out / "robustness.md").write_text(text, encoding="utf-8")
    (s.out / "robustness.json").write_text(strict_json(result, indent=1) + "\n", encoding="utf-8")
    if not s.keep_runs:
        shutil.rmtree(runs, ignore_errors=True)
    say(f"[robust] wrote {s.out / 'robustness.md'} and robustness.json ({result['wall_s']:.0f} s in all)")
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny model, 2 rounds: a smoke test of the same code")
    p.add_argument("--rounds", type=int, help="R, rounds per run (default 5; quick 2)")
    p.add_argument("--inner-steps", type=int, help="H, inner steps per round (default 50; quick 4)")
    p.add_argument("--seed", type=int, default=1337, help="the runs' seed (model init, data order, noise)")
    p.add_argument("--out", default="runs/bench-robust", help="robustness.md / .json go here")
    p.add_argument("--scenarios", default=",".join(sc.key for sc in SCENARIOS),
                   help="comma-separated subset of: " + ", ".join(sc.key for sc in SCENARIOS))
    p.add_argument("--aggregations", default=",".join(a.key for a in AGGREGATIONS),
                   help="comma-separated subset of: " + ", ".join(a.key for a in AGGREGATIONS)
                        + f" ({REFERENCE}, the reference, always runs)")
    p.add_argument("--honest-workers", type=int, default=1, help="K, honest worker processes beside mallory")
    p.add_argument("--trim-fraction", type=float, default=0.2, help="β of the trimmed-mean setting, in [0, 0.5)")
    p.add_argument("--screen-margin", type=float, default=0.05, help="nats, of the screening setting, in (0, 100]")
    p.add_argument("--scale", type=float, default=86.0, help="the factor of the scaled scenario")
    p.add_argument("--data", default=str(DEFAULT_DATA),
                   help="folder with WikiText-2 valid.txt and test.txt (or the shared data folder holding wikitext-2/)")
    p.add_argument("--keep-runs", action="store_true", help="keep the runs' directories under <out>/runs")


def settings_of(args: argparse.Namespace) -> Settings:
    from trainer.config import ModelConfig

    preset = QUICK if args.quick else FULL

    def keys(text: str, known: dict[str, Any], what: str) -> list[str]:
        chosen = [k.strip() for k in text.split(",") if k.strip()]
        unknown = [k for k in chosen if k not in known]
        if unknown:
            raise ValueError(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(known)}")
        return [k for k in known if k in chosen]

    def pick(name: str) -> Any:
        value = getattr(args, name, None)
        return preset[name] if value is None else value

    aggregations = keys(args.aggregations, AGGREGATION, "aggregation setting(s)")
    s = Settings(rounds=pick("rounds"), inner_steps=pick("inner_steps"), batch_size=preset["batch_size"],
                 model=ModelConfig(**preset["model"]), eval_batches=preset["eval_batches"],
                 scenarios=keys(args.scenarios, SCENARIO, "scenario(s)"),
                 aggregations=[REFERENCE] + [k for k in aggregations if k != REFERENCE],
                 data=Path(args.data), out=Path(args.out), quick=args.quick, keep_runs=args.keep_runs,
                 honest_workers=args.honest_workers, seed=args.seed, scale=args.scale,
                 trim_fraction=args.trim_fraction, screen_margin=args.screen_margin)
    if s.rounds < 1 or s.inner_steps < 1 or not 1 <= s.honest_workers <= 64:
        raise ValueError("--rounds and --inner-steps must be >= 1, --honest-workers in [1, 64]")
    if not 0 <= s.trim_fraction < 0.5 or not 0 < s.screen_margin <= 100:
        raise ValueError("--trim-fraction must be in [0, 0.5), --screen-margin in (0, 100]")
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dilocox bench robust", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    run(settings_of(p.parse_args(argv)), "dilocox bench robust " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
