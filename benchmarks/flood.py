"""What an attacker can cost: honest rounds, health latency and coordinator resources under each attack.

    dilocox bench flood [--window 15] [--calls 64] [--ids 4] [--streams 40] [--idle-timeout 3]
    dilocox bench flood --side worker

Coordinator side (the default): a real coordinator over TLS and two honest ``dilocox worker``
processes training a tiny model (a round in well under a second), on 127.0.0.1. The honest rate is
measured once with no attack, then during each attack of benchmarks.attacks in turn, in the same run
(``--window`` seconds each, a round closed between attacks), in this order:

    stalled pushes          ``--streams`` PushUpdate streams of one joined id that never send a byte
    long-polls              ``--streams`` FetchGlobal calls of one joined id for a round that will not come
    unauthenticated         ``--streams`` PushUpdate streams with no session
    100 kB worker ids       ``--streams`` Challenge calls whose worker id is 100,000 characters
    challenge flood         ``--streams`` Challenge calls for an honest worker's id
    undecodable             ``--streams`` Join calls whose bytes do not decode
    dripping pushes         ``--ids`` joined ids, 8 pushes each: a plausible header, then a byte every 2 s
    slot hoarding           ``--ids`` joined ids, 8 long-polls and 8 stalled pushes each
    unfinished unary calls  ``--calls`` unary calls over ONE connection whose request never arrives

Every attacker thread re-opens its call when it ends or is refused. For each window: honest rounds
per minute (rounds.jsonl, benchmarks.attacks.observe) against the rate with no attack, health Check
latency (median and worst; each probe has a 1 s deadline), the coordinator's peak RSS and open
files (/proc), and how the attack's calls were answered. One table, and the machine it ran on.

Worker side (``--side worker``, benchmarks.hostile_coordinator): a hostile coordinator in this
process against a real ``dilocox worker``, one misbehaviour at a time.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and the attack clients load only when the bench runs
    from benchmarks.attacks import Attack, Window
    from cli.cluster import LocalCluster
    from trainer.config import RunConfig

BIG_WORKER_ID = "x" * 100_000
RECOVERY_S = 60.0  # an attack that stopped the run: how long the next window waits for a round first


def fast_config(rounds: int) -> RunConfig:
    """Two workers and a tiny model (rounds of 200 steps of a 1-layer, 32-wide model): rounds/min
    is a rate of dozens of rounds, so a window of seconds measures it. The hostile coordinator's
    run (benchmarks.hostile_coordinator) is this one too."""
    from trainer.config import DataConfig, InnerConfig, ModelConfig, RoundConfig, RunConfig

    return RunConfig(
        run_id="flood",
        model=ModelConfig(block_size=32, n_layer=1, n_head=2, n_embd=32),
        inner=InnerConfig(steps=200, batch_size=4, lr=1e-3),
        data=DataConfig(eval_batches=2),
        rounds=RoundConfig(rounds=rounds, expected_workers=2, quorum=2, straggler_timeout_s=10.0,
                           heartbeat_interval_s=0.5, liveness_timeout_s=5.0),
    ).plain_diloco()


def older_floods(cluster: LocalCluster, streams: int) -> list[Attack]:
    """The floods this bench measured before issue 26, as re-opening attacks."""
    from benchmarks.attacks import FAR_ROUND, HOLD_S, Flood, attacker_channel, join_insiders
    from proto import PROTOCOL_VERSION, SERVICE_NAME, pb, pb_grpc

    (mallory,) = join_insiders(cluster, ["mallory"])
    stub, session = mallory.stub, mallory.session
    stranger = pb_grpc.CoordinatorStub(attacker_channel(cluster))
    garbage = attacker_channel(cluster).unary_unary(f"/{SERVICE_NAME}/Join", request_serializer=lambda b: b,
                                                    response_deserializer=lambda b: b)

    def challenge(worker_id: str) -> pb.ChallengeRequest:
        return pb.ChallengeRequest(protocol_version=PROTOCOL_VERSION, worker_id=worker_id)

    return [
        Flood("stalled pushes", streams,
              lambda a: (stub.PushUpdate.future(a.held(), timeout=HOLD_S, metadata=session), False)),
        Flood("long-polls", streams, lambda a: (stub.FetchGlobal(pb.FetchGlobalRequest(
            worker_id="mallory", min_round=FAR_ROUND, wait_s=30), timeout=HOLD_S, metadata=session), True)),
        Flood("unauthenticated", streams, lambda a: (stranger.PushUpdate.future(a.held(), timeout=HOLD_S), False)),
        Flood("100 kB worker ids", streams,
              lambda a: (stranger.Challenge.future(challenge(BIG_WORKER_ID), timeout=30), False)),
        Flood("challenge flood", streams, lambda a: (stranger.Challenge.future(challenge("w0"), timeout=30), False)),
        Flood("undecodable", streams, lambda a: (garbage.future(b"\xff" * 256, timeout=30), False)),
    ]


def run(window_s: float = 15.0, calls: int = 64, ids: int = 4, streams: int = 40,
        idle_timeout_s: float = 3.0) -> list[Window]:
    """The no-attack window first, then one window per attack (module docstring)."""
    from benchmarks.attacks import Dripping, Hoarding, UnfinishedUnary, join_insiders, observe, under_attack
    from cli.cluster import LocalCluster

    with tempfile.TemporaryDirectory(prefix="dilocox-flood-") as tmp, LocalCluster(Path(tmp) / "run") as cluster:
        fast_config(rounds=100_000).save(Path(tmp) / "config.json")
        cluster.start_coordinator(Path(tmp) / "config.json", extra=["--idle-timeout", str(idle_timeout_s)])
        cluster.start_worker("w0")
        cluster.start_worker("w1")
        cluster.wait_for(lambda s: len(s.rounds) >= 2, 120, "the first round")
        # Every attacker id joins first: a joined id is waited for until its liveness lapses, a cost
        # paid once here rather than in the first windows. The older floods, which today's server
        # withstands, run before the attacks that stop it, so what those leave behind spoils no row.
        attacks: list[Attack] = [
            *older_floods(cluster, streams),
            Dripping(join_insiders(cluster, [f"dripper{i}" for i in range(ids)])),
            Hoarding(join_insiders(cluster, [f"hoarder{i}" for i in range(ids)])),
            UnfinishedUnary(cluster, calls),
        ]
        observe(cluster, "recovery", max_s=RECOVERY_S, rounds=1)
        windows = [observe(cluster, "no attack", max_s=window_s)]
        for attack in attacks:
            observe(cluster, "recovery", max_s=RECOVERY_S, rounds=1)  # the run goes on before the next attack
            windows.append(under_attack(cluster, attack, max_s=window_s))
    return windows


def machine_line() -> str:
    return (f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_implementation()} "
            f"{platform.python_version()}, {platform.system()} {platform.release()}")


def print_table(windows: list[Window], window_s: float, calls: int, ids: int, streams: int) -> None:
    without = windows[0]
    print(f"Honest rounds/min (2 workers, tiny model) and coordinator health during each attack, {window_s:g} s "
          f"windows in one run; coordinator over TLS with --idle-timeout. Unfinished unary: {calls} calls on one "
          f"connection; hoarding and dripping: {ids} joined ids; older floods: {streams} calls at once.")
    print(machine_line() + "\n")
    print("| attack | honest rounds/min without | with | ratio | health median ms | worst ms | coordinator RSS MiB "
          "| open fds | how the attack's calls were answered |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for w in windows:
        answers = ", ".join(f"{n} {k}" for k, n in sorted(w.answers.items(), key=lambda kv: -kv[1])) or "-"
        ratio = w.rounds_per_min / without.rounds_per_min if without.rounds_per_min else float("nan")
        print(f"| {w.name} | {without.rounds_per_min:.1f} | {w.rounds_per_min:.1f} | {ratio:.2f} | "
              f"{w.health_median_ms:.0f} | {w.health_worst_ms:.0f} | {w.rss_bytes / 2**20:.0f} | {w.open_fds} | "
              f"{answers} |")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--side", choices=("coordinator", "worker"), default="coordinator",
                   help="attack the coordinator (default), or a worker from a hostile coordinator")
    p.add_argument("--window", type=float, default=15.0, help="seconds measured per attack (and without)")
    p.add_argument("--calls", type=int, default=64, help="unfinished unary calls on the one connection")
    p.add_argument("--ids", type=int, default=4, help="joined ids that hoard slots, and that drip pushes")
    p.add_argument("--streams", type=int, default=40, help="calls at once, per older flood")
    p.add_argument("--idle-timeout", type=float, default=3.0, help="the coordinator's --idle-timeout")


def main(args: argparse.Namespace) -> None:
    if args.side == "worker":
        from benchmarks.hostile_coordinator import main as worker_side

        worker_side()
        return
    windows = run(args.window, args.calls, args.ids, args.streams, args.idle_timeout)
    print_table(windows, args.window, args.calls, args.ids, args.streams)
