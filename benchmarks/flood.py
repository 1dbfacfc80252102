"""How fast health and Status answer while hostile clients hit each of the coordinator's limits.

    dilocox bench flood [--streams 40] [--samples 50] [--idle-timeout 3]

A real coordinator (TLS, no ledger) and one honest worker training on 127.0.0.1; a hostile client
joins under its own id (in a run without a ledger anyone may) and, one flood at a time, opens:

    stalled pushes      N PushUpdate streams that never send a byte (held until the idle timeout)
    long-polls          N FetchGlobal calls waiting for a round that will not come
    unauthenticated     N PushUpdate streams with no session token
    100 kB worker ids   N Challenge calls whose worker id is 100,000 characters
    challenge flood     N Challenge calls for the honest worker's id
    undecodable         N Join calls whose bytes do not decode

During each flood (held at least the idle timeout and a second) it times at least ``samples``
health Check + Status calls, and reports their median and worst, and what the flood's calls were
answered. Prints one table, and the machine it ran on.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import PROTOCOL_VERSION, SERVICE_NAME, pb, pb_grpc


def _code(call: Callable[[], object]) -> str:
    try:
        result = call()
        if isinstance(result, Iterator):
            for _ in result:
                pass
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


def run(streams: int = 40, samples: int = 50, idle_timeout_s: float = 3.0) -> list[dict[str, object]]:
    from benchmarks.cluster import LocalCluster
    from trainer.config import InnerConfig, RoundConfig, demo_config
    from proto import session_metadata

    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="dilocox-flood-") as tmp, LocalCluster(Path(tmp) / "run") as cluster:
        config = demo_config()
        config = config.replace(inner=InnerConfig(steps=100_000, batch_size=4, lr=2e-3),
                                rounds=RoundConfig(rounds=1, expected_workers=1, quorum=1, heartbeat_interval_s=0.5,
                                                   liveness_timeout_s=5.0))
        config.save(Path(tmp) / "config.json")
        cluster.start_coordinator(Path(tmp) / "config.json", extra=["--idle-timeout", str(idle_timeout_s)])
        cluster.start_worker("honest")
        channel = cluster.channel()
        stub = pb_grpc.CoordinatorStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        joined = stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, worker_id="mallory"), timeout=30)
        session = session_metadata("mallory", joined.session_token)
        release = threading.Event()

        def stalled() -> Iterator[pb.UpdateChunk]:
            release.wait(idle_timeout_s + 30)
            yield pb.UpdateChunk(data=b"late")

        garbage = channel.unary_unary(f"/{SERVICE_NAME}/Join", request_serializer=lambda b: b,
                                      response_deserializer=lambda b: b)
        floods: dict[str, Callable[[], object]] = {
            "stalled pushes": lambda: stub.PushUpdate(stalled(), timeout=60, metadata=session),
            "long-polls": lambda: stub.FetchGlobal(pb.FetchGlobalRequest(worker_id="mallory", min_round=99, wait_s=30),
                                                   timeout=60, metadata=session),
            "unauthenticated": lambda: stub.PushUpdate(stalled(), timeout=60),
            "100 kB worker ids": lambda: stub.Challenge(pb.ChallengeRequest(
                protocol_version=PROTOCOL_VERSION, worker_id="x" * 100_000), timeout=30),
            "challenge flood": lambda: stub.Challenge(pb.ChallengeRequest(
                protocol_version=PROTOCOL_VERSION, worker_id="honest"), timeout=30),
            "undecodable": lambda: garbage(b"\xff" * 256, timeout=30),
        }
        for name, call in floods.items():
            release.clear()
            answers: list[str] = []
            threads = [threading.Thread(target=lambda: answers.append(_code(call)), daemon=True)
                       for _ in range(streams)]
            for t in threads:
                t.start()
            time.sleep(0.5)
            took: list[float] = []
            until = time.monotonic() + idle_timeout_s + 1.0  # long enough for the idle reaper to act
            while len(took) < samples or time.monotonic() < until:
                started = time.monotonic()
                for service in ("", SERVICE_NAME):
                    health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                stub.Status(pb.StatusRequest(), timeout=10)
                took.append(time.monotonic() - started)
                time.sleep(0.02)
            release.set()
            for t in threads:
                t.join(timeout=60)
            rows.append({"flood": name, "calls": streams, "median_ms": 1000 * statistics.median(took),
                         "worst_ms": 1000 * max(took), "answers": dict(Counter(answers))})
        channel.close()
    return rows


def print_table(rows: list[dict[str, object]], streams: int, samples: int) -> None:
    print(f"health Check (2 services) + Status while one flood runs; {streams} hostile calls at once, "
          f"{samples} samples each; coordinator over TLS with --idle-timeout; one honest worker training.")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_implementation()} "
          f"{platform.python_version()}, {platform.system()} {platform.release()}\n")
    print("| flood | median ms | worst ms | how the flood's calls were answered |")
    print("| --- | ---: | ---: | --- |")
    for r in rows:
        answers = ", ".join(f"{n} {k}" for k, n in sorted(r["answers"].items(), key=lambda kv: -kv[1]))
        print(f"| {r['flood']} | {r['median_ms']:.1f} | {r['worst_ms']:.1f} | {answers} |")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=40, help="hostile calls at once, per flood")
    p.add_argument("--samples", type=int, default=50, help="health+Status timings per flood")
    p.add_argument("--idle-timeout", type=float, default=3.0, help="the coordinator's --idle-timeout")


def main(args: argparse.Namespace) -> None:
    print_table(run(args.streams, args.samples, args.idle_timeout), args.streams, args.samples)
