"""``dilocox demo``: the whole platform on one machine, on the embedded corpus.

1. a local chain (anvil, from the npm lockfile) whose state is kept in <run>/chain/state.json;
2. the registry and ledger deployed, the code measurement allowlisted, the coordinator's account
   made a verifier;
3. a coordinator and N workers as processes, over TLS (the coordinator's self-signed certificate,
   pinned by the workers by its fingerprint; ``--insecure`` runs plaintext instead, to measure what
   TLS costs); workers attest with the ``dev`` provider (which PROVES NOTHING, and says so), are
   admitted on chain, train, and sign a report per round; every round is recorded on the ledger;
4. the rewards settled and the lineage audit, from the ledger and the store alone, replaying two
   sampled contributions;
5. a closing word on reports: every update reported, or, loudly, each update a round counted
   without its worker's report (its worker id and address; it earns that worker nothing).

Step 2, the pool and the mining past the challenge window are settlement.provision's: the functions
``dilocox chain deploy``, ``dilocox run create``, ``dilocox pool fund`` and ``dilocox chain mine``
run (README: "Running it by hand").

It runs DiLoCoX, the product's default (trainer.config), with pipeline stages where the machine has
a core for each; ``--diloco`` runs plain DiLoCo instead. Shows one line per finished round (eval
loss, mean inner loss, bytes each way, how many times fewer than dense fp32 both ways the updates
travel, time), a summary and the audit's table. The inner states the workers upload once per
window of ``rounds.state_every`` rounds in a run that uploads them are counted in the bytes up and shown
apart; DiLoCoX's default sends none (the workers keep them in <run>/retained/ and the audit's replay
challenges them there). Afterwards ``dilocox audit --run <run>`` re-verifies the run on its own.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from attestation import DEV_WARNING
from cli.cluster import LOCAL_CHALLENGE_WINDOW, ClusterError, LocalCluster, provision
from settlement import DEV_ACCOUNTS, Anvil, Chain, Deployment, Ledger
from settlement.provision import TOKEN_UNIT, await_run, fund_pool, mine
from settlement.roster import roster_of, unreported_lines
from storage_client import RUN_STORE_DIR, Manifest, Store, open_store
from trainer.config import RunConfig, demo_config, estimated_parameters

DEMO_REPLAYS = 2  # contributions the demo's audit re-runs (audit.replay)
DEMO_POOL = 1_000 * TOKEN_UNIT  # reward tokens the demo's run is funded with


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _kb(n: float) -> str:
    return f"{n / 1e3:,.1f} kB" if n < 1e6 else _mb(int(n))


def _row(s: dict, dense: int, states: int) -> list[str]:
    """round, eval loss, train loss, workers, bytes up, bytes down, × fewer than dense, inner states up, time.

    ``dense``: one dense fp32 copy of the model, what plain DiLoCo sends each way per worker; the
    ratio is against that, both directions, over the round's participants, counting the round's real
    bytes: every RPC, as the coordinator counted them, ``states`` (the inner states the round's pushes
    carried for the audit, ``state_bytes``: none where states are revealed on challenge) included."""
    if s["round"] == 0:
        return ["0", f"{s['eval_loss']:.4f}", "—", "genesis", "—", "—", "—", "—", "—"]
    workers = str(len(s["participants"])) + (f" (dropped {', '.join(s['dropped'])})" if s["dropped"] else "")
    sent = s["bytes_up"] + s["bytes_down"]
    fewer = f"{2 * dense * len(s['participants']) / sent:,.1f}× fewer" if sent > 0 else "—"
    return [str(s["round"]), f"{s['eval_loss']:.4f}", f"{s['mean_train_loss']:.4f}", workers,
            _kb(s["bytes_up"]), _kb(s["bytes_down"]), fewer, _kb(states) if states else "—", f"{s['seconds']:.1f}s"]


def state_bytes(store: Store, summary: dict) -> int:
    """The bytes of the inner states a round's pushes carried (a worker's first counted round in each
    window of ``rounds.state_every`` rounds, trainer.runtime.state_commit): a replay starts from them,
    so the audit's chains stay short."""
    from trainer.runtime.state_commit import state_cid, state_stored

    if summary["round"] == 0:
        return 0
    manifest = Manifest.load(store, summary["manifest_cid"])
    return sum(store.size(state_cid(p.state)) for p in manifest.participants if state_stored(store, p))


def fund_and_mature(run_dir: Path, rpc_url: str, rounds: int) -> None:
    """What ``dilocox pool fund`` and ``dilocox chain mine`` do: the demo's coordinator opens its
    run's reward pool (the owner mints the tokens), then the chain mines past the challenge window."""
    deployment = Deployment.load(run_dir / "chain" / "deployment.json")
    owner, coordinator = Chain(rpc_url, DEV_ACCOUNTS[0]), Chain(rpc_url, DEV_ACCOUNTS[1])
    ledger = Ledger(coordinator, deployment.ledger, from_block=deployment.deployed_block)
    run_id = await_run(open_store(run_dir), ledger, timeout_s=0)
    fund_pool(coordinator, deployment, run_id, DEMO_POOL, rounds, minter=owner)
    mine(coordinator, LOCAL_CHALLENGE_WINDOW)


def unreported_summary(run_dir: Path, rpc_url: str, console: Console) -> None:
    """The demo's closing word on reports: every round whose updates were all reported, or, loudly,
    each update a round counted without its worker's report (settlement.roster)."""
    deployment = Deployment.load(run_dir / "chain" / "deployment.json")
    ledger = Ledger(Chain(rpc_url, DEV_ACCOUNTS[3]), deployment.ledger, from_block=deployment.deployed_block)
    store = open_store(run_dir)
    run_id = await_run(store, ledger, timeout_s=0)
    lines = unreported_lines(roster_of(store, ledger.recorded_rounds(run_id)))
    for line in lines:
        console.print(f"[bold red]UNREPORTED[/] {escape(line)}")
    if lines:
        console.print(f"[bold red]{len(lines)} update(s) went unreported: their workers are unpaid for those "
                      f"rounds[/] (the coordinator waits --report-timeout seconds for reports)")
    else:
        console.print("every update of every round was reported: each worker is credited for each round it trained")


def run_demo(run_dir: Path, workers: int = 2, settings: Sequence[str] = (), insecure: bool = False,
             diloco: bool = False, *, time_limit_s: float, report_timeout_s: float | None = None) -> int:
    """The demo's run: ``demo_config()`` (DiLoCoX; plain DiLoCo with ``diloco``) for ``workers``
    workers, then ``settings`` (``--set``); ``report_timeout_s``: the coordinator's
    ``--report-timeout`` (None: its default)."""
    console = Console()
    config = demo_config().plain_diloco() if diloco else demo_config()
    config = config.replace(rounds=dataclasses.replace(config.rounds, expected_workers=workers, quorum=workers))
    config = config.with_settings(settings)
    from trainer.data.dataset import pin_dataset  # torch: after a bad setting has been refused

    # Pin the corpus (or prepared tokens) now: the allowlisted measurement covers the configuration's CID.
    config, _ = pin_dataset(config)
    if (run_dir / "HEAD").exists() or (run_dir / RUN_STORE_DIR).exists():
        console.print(f"[yellow]replacing the previous demo run in {run_dir}[/]")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.json"
    config.save(config_path)
    console.print(f"[bold yellow]{DEV_WARNING}[/]")
    with Anvil(state_file=run_dir / "chain" / "state.json") as anvil:
        coordinator_args, worker_args = provision(run_dir, anvil.rpc_url, config)
        if report_timeout_s is not None:
            coordinator_args += ["--report-timeout", repr(report_timeout_s)]
        console.print(f"local chain {anvil.rpc_url} (state kept in {run_dir / 'chain'}); contracts deployed")
        code = _train(console, run_dir, config, config_path, workers, coordinator_args, worker_args, insecure,
                      time_limit_s)
        if code != 0:
            return code
        console.print("\n[bold]rewards[/]: the coordinator funds the run's pool; once the rounds are "
                      f"{LOCAL_CHALLENGE_WINDOW} blocks old, every worker's share is claimed")
        fund_and_mature(run_dir, anvil.rpc_url, config.rounds.rounds)
        from cli.settle import settle_run_dir

        code = settle_run_dir(run_dir, rpc_url=anvil.rpc_url, claim=True, key=DEV_ACCOUNTS[3], console=console)
        if code != 0:
            return code
        console.print("\n[bold]audit[/]: re-verifying the run from the ledger and the store alone, and "
                      f"replaying {DEMO_REPLAYS} sampled contributions")
        from audit.cli import audit_run_dir

        code = audit_run_dir(run_dir, rpc_url=anvil.rpc_url, allow_dev=True, console=console,
                             replay=(DEMO_REPLAYS, None))
        unreported_summary(run_dir, anvil.rpc_url, console)
    console.print(f"re-verify any time, from {run_dir} alone, on any CPU: dilocox audit --run {run_dir} --allow-dev "
                  f"[--replay K]")
    return code


def _technique(config: RunConfig) -> str:
    """What the run is, in one line: DiLoCoX and its settings, or plain DiLoCo."""
    c = config.compression
    if not (c.enabled or config.rounds.overlap):
        return "plain DiLoCo (dense, synchronous)"
    return "DiLoCoX: " + ", ".join([
        f"adaptive low-rank + int4 (rank {c.min_rank}–{c.max_rank}) both ways" if c.enabled and c.codec == "lowrank-int4"
        else f"top-k {c.topk_density:g} + int4 both ways" if c.enabled else "dense updates",
        f"{config.rounds.overlap_start} one-step overlap" if config.rounds.overlap else "synchronous rounds",
        f"outer lr {config.outer.lr:g} / momentum {config.outer.momentum:g}"])


def _train(console: Console, run_dir: Path, config: RunConfig, config_path: Path, workers: int,
           coordinator_args: list[str], worker_args: list[str], insecure: bool, time_limit_s: float) -> int:
    m = config.model
    dense = 4 * estimated_parameters(m)
    console.print(
        f"[bold]{_technique(config)}[/]\n{workers} workers × {config.inner.steps} inner AdamW steps × "
        f"{config.rounds.rounds} rounds; {m.family} {m.n_layer}L/{m.n_embd}d/{m.n_head}h, "
        f"context {m.block_size}, "
        f"{f'prepared tokens {config.data.tokens}' if config.data.tokens else 'byte tokens; embedded corpus'}; "
        f"run dir {run_dir}"
    )

    started = time.monotonic()
    table = Table(title="rounds")
    for column in ("round", "eval loss", "train loss", "workers", "bytes up", "bytes down", "vs dense", "states up",
                   "time"):
        table.add_column(column, justify="left" if column == "workers" else "right")

    # Each worker plans its stages and threads on its share of the cores (trainer.runtime.pipeline.plan_stages):
    # pipeline stages where the machine has a core for each.
    from trainer.runtime.procgroup import available_cpus

    cores = ["--cores", str(max(1, available_cpus() // workers))]
    with LocalCluster(run_dir, insecure=insecure, threads_per_worker=0) as cluster:
        cluster.start_coordinator(config_path, extra=coordinator_args)
        if insecure:
            console.print(f"[bold red]coordinator {cluster.address}: PLAINTEXT (--insecure)[/]")
        else:
            console.print(f"coordinator {cluster.address} over TLS; workers pin its certificate, "
                          f"sha256 {cluster.client_tls.fingerprint}")
        # One at a time, each after the last has joined: the coordinator deals shards in order of
        # admission, so a fixed order makes the run's manifests (and their CIDs) the same every time.
        try:
            for i in range(workers):
                cluster.start_worker(f"worker-{i}", extra=[*worker_args, *cores])
                cluster.wait_for(lambda status, n=i + 1: len(status.workers) >= n, 120, f"worker-{i} to join")
        except ClusterError as exc:
            console.print(f"[red]demo failed:[/] {exc}; see {run_dir}/logs/")
            return 1
        coordinator = cluster.processes["coordinator"]
        rounds_done: list[dict] = []
        columns = (TextColumn("[progress.description]{task.description}"), BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("rounds", total=config.rounds.rounds)
            # Follow the coordinator's rounds.jsonl: it outlives the coordinator, so the last
            # round is shown even when the coordinator exits right after publishing it.
            while True:
                exited = coordinator.poll() is not None
                for summary in cluster.run_dir.logged_rounds()[len(rounds_done):]:
                    summary["bytes_state"] = state_bytes(cluster.run_dir.store, summary)
                    rounds_done.append(summary)
                    row = _row(summary, dense, summary["bytes_state"])
                    table.add_row(*row)
                    r, ev, tr, who, up, down, fewer, states, secs = row
                    progress.console.print(
                        f"round {r:>2}/{config.rounds.rounds}  eval {ev}  genesis (θ⁽⁰⁾, before any training)"
                        if summary["round"] == 0 else
                        f"round {r:>2}/{config.rounds.rounds}  eval {ev}  train {tr:>6}  "
                        f"workers {who}  up {up}  down {down}  {fewer} than dense fp32"
                        f"{f'  (+{states} inner states up)' if summary['bytes_state'] else ''}  {secs}")
                    progress.update(task, completed=summary["round"])
                if exited:
                    break
                if time.monotonic() - started > time_limit_s:
                    console.print(f"[red]the demo's training did not finish within {time_limit_s:g}s "
                                  f"(--time-limit); see {run_dir}/logs/[/]")
                    return 1
                time.sleep(0.2)
        try:
            codes = {name: cluster.wait_exit(name, 60) for name in list(cluster.processes)}
        except ClusterError as exc:
            console.print(f"[red]demo failed:[/] {exc}")
            return 1

    console.print(table)
    return _summary(console, run_dir, rounds_done, time.monotonic() - started, dense, codes)


def _summary(console: Console, run_dir: Path, rounds_done: list[dict], elapsed: float, dense: int,
             codes: dict[str, int]) -> int:
    """The run's closing lines; non-zero when a process failed or the loss did not fall."""
    if len(rounds_done) < 2:
        console.print(f"[red]no round was completed[/]; see {run_dir}/logs/")
        return 1
    first, last = rounds_done[1], rounds_done[-1]
    up = sum(s["bytes_up"] for s in rounds_done)
    down = sum(s["bytes_down"] for s in rounds_done)
    states = sum(s["bytes_state"] for s in rounds_done)
    failed = {name: code for name, code in codes.items() if code != 0}
    improved = last["eval_loss"] < first["eval_loss"]
    dense_total = 2 * dense * sum(len(s["participants"]) for s in rounds_done[1:])
    console.print(
        f"[bold]summary[/]: {last['round']} rounds in {elapsed:.1f}s; eval loss "
        f"{rounds_done[0]['eval_loss']:.4f} (genesis) → {first['eval_loss']:.4f} (round 1) → "
        f"{last['eval_loss']:.4f} (round {last['round']}); {_mb(up)} up, {_mb(down)} down, every byte of every "
        f"call: {dense_total / max(1, up + down):,.1f}× fewer than dense fp32 both ways ({_mb(dense_total)}); "
        + (f"of the bytes up, {_mb(states)} were inner states for the audit's replay\n" if states else
           "no inner state crossed the wire (the workers keep them, to reveal when challenged)\n") +
        f"head manifest {last['manifest_cid']}\nrun dir {run_dir} (store, manifests, logs/)"
    )
    if failed:
        console.print(f"[red]processes failed[/]: {failed}; see {run_dir}/logs/")
        return 1
    if not improved:
        console.print("[red]the evaluation loss of the last round is not lower than the first[/]")
        return 1
    return 0
