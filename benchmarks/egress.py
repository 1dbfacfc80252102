"""``python -m benchmarks.egress``: the coordinator's bytes out per round against W, with the downlink
streamed over gRPC to every worker (today's path) and served once by CID through a mirror.

For each W in ``--workers`` (default 2 4 8) and each way, a real run (cli.cluster.LocalCluster: a
coordinator and W worker processes over gRPC + TLS on loopback; no ledger) of ``--rounds`` rounds of
a small GPT with compression on, so that each round's downlink is the compressed global update C⁽ʳ⁾,
stored by CID:

    grpc   workers without --store-source: C⁽ʳ⁾ goes in every worker's FetchGlobal stream, W copies.
    cid    a mirror in this process (storage_client.gateway over cli.mirror.ReadThroughStore: a block
           it lacks is fetched from the coordinator's gateway once, verified, kept) and every worker
           started with ``--store-source <mirror>``: FetchGlobal carries the header and the payload's
           CID (trainer.worker.cid_fetch), the payload comes from the mirror.

Counted at the coordinator: its gRPC replies to FetchGlobal (the manifests' ``bytes_down``, every
message of every stream, per worker, rounds 2..R: round 1 starts from θ⁽⁰⁾, which every worker builds
itself) and every byte its store gateway wrote (``store gateway sent N bytes``, logged at exit; over
R rounds it serves R downlinks, θ⁽ᴿ⁾ included, so a round's share is total / R). The other gRPC
replies (Join, Heartbeat, PushUpdate's and SubmitReport's answers) are tens of bytes a call and left
out. ``uplink`` is a worker's push a round (``bytes_up`` / W), the coordinator's ingress per worker
(with ``rounds.state_every=5`` and at most 4 rounds, no push carries an inner state, trainer.runtime.
state_commit, which every 5th round adds 3 × the model's fp32 bytes to the uplink, not the downlink):
the target is egress ≤ W × uplink, and with the downlink served once, egress no longer grows by one
downlink per worker. ``mirror out`` is what the mirror served (the W copies moved off the coordinator).
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

SEED = 1337
SENT = re.compile(r"store gateway sent (\d+) bytes")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8], help="W of each cell")
    p.add_argument("--rounds", type=int, default=4, help="rounds of each run, in [2, 4]")
    p.add_argument("--n-embd", type=int, default=256, help="model width (2 layers, 4 heads)")
    p.add_argument("--max-rank", type=int, default=8, help="the codec's rank ceiling")
    p.add_argument("--out", help="also write the table (markdown) to this file")


def run_config(workers: int, rounds: int, n_embd: int, max_rank: int):  # -> RunConfig
    from trainer.config import RunConfig

    return RunConfig(run_id=f"egress-{workers}w", seed=SEED).with_settings([
        "model.n_layer=2", "model.n_head=4", f"model.n_embd={n_embd}", "model.block_size=32",
        "inner.steps=2", "inner.batch_size=4", "data.eval_batches=1", f"rounds.rounds={rounds}",
        f"rounds.expected_workers={workers}", f"rounds.quorum={workers}", "rounds.straggler_timeout_s=600",
        "rounds.liveness_timeout_s=120", "rounds.state_every=5", "compression.enabled=true", "compression.min_rank=1",
        f"compression.max_rank={max_rank}"])


def run_cell(workers: int, way: str, args: argparse.Namespace, where: Path) -> dict[str, Any]:
    """One run; its coordinator's egress a round (raises when a process fails)."""
    from cli.cluster import LocalCluster
    from cli.mirror import ReadThroughStore
    from storage_client import lineage, open_store
    from storage_client.gateway import start_gateway
    from storage_client.remote import RemoteStore

    config = run_config(workers, args.rounds, args.n_embd, args.max_rank)
    config.save(where / "config.json")
    mirror = None
    with LocalCluster(where / "run") as cluster:
        cluster.start_coordinator(where / "config.json")
        extra: list[str] = []
        if way == "cid":
            upstream = f"https://127.0.0.1:{cluster.status().store_port}"
            remote = RemoteStore([upstream], ca_file=str(where / "run" / "tls" / "cert.pem"))
            mirror, _ = start_gateway(ReadThroughStore(open_store(where / "mirror"), remote))
            extra = ["--store-source", mirror.url]
        try:
            for w in range(workers):
                cluster.start_worker(f"w{w}", extra)
            for name in [*(f"w{w}" for w in range(workers)), "coordinator"]:
                if cluster.wait_exit(name, 900) != 0:
                    raise RuntimeError(f"{name} failed:\n{cluster.log(name)}")
        finally:
            if mirror is not None:
                mirror.shutdown()
                mirror.server_close()
        log = (cluster.run_dir.logs / "coordinator.log").read_text(errors="replace")
        manifests = [m for _, m in lineage(cluster.run_dir.store, cluster.run_dir.head())][2:]
    gateway = int(SENT.findall(log)[-1]) if SENT.search(log) else 0
    grpc_out = sum(m.bytes_down for m in manifests) / len(manifests)
    uplink = sum(m.bytes_up for m in manifests) / len(manifests) / workers
    downlink = sum(len(open_store(where / "run").get(m.downlink.payload)) for m in manifests
                   if m.downlink is not None) / len(manifests)
    egress = grpc_out + gateway / args.rounds
    return {"workers": workers, "way": way, "grpc": grpc_out, "gateway": gateway / args.rounds, "egress": egress,
            "uplink": uplink, "downlink": downlink, "ratio": egress / (workers * uplink),
            "mirror": (mirror.bytes_out / args.rounds) if mirror is not None else 0.0}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| W | downlink via | C⁽ʳ⁾ | coordinator gRPC out | coordinator gateway out | coordinator egress | "
             "uplink / worker | egress / (W × uplink) | mirror out |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workers']} | {r['way']} | {r['downlink']:,.0f} B | {r['grpc']:,.0f} B | {r['gateway']:,.0f} B | "
                     f"{r['egress']:,.0f} B | {r['uplink']:,.0f} B | {r['ratio']:.2f} | {r['mirror']:,.0f} B |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from benchmarks.scale import machine, parameters_of

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    if not 2 <= args.rounds <= 4:
        p.error("--rounds must be in [2, 4] (round 5 would upload the workers' inner states)")
    info = machine("cpu")
    params = parameters_of(run_config(2, args.rounds, args.n_embd, args.max_rank))
    rows = []
    for workers in args.workers:
        for way in ("grpc", "cid"):
            where = Path(tempfile.mkdtemp(prefix=f"egress-{workers}-{way}-"))
            try:
                rows.append(run_cell(workers, way, args, where))
                print(f"W={workers} {way}: egress {rows[-1]['egress']:,.0f} B a round", flush=True)
            finally:
                shutil.rmtree(where, ignore_errors=True)
    header = (f"Coordinator bytes out a round (rounds 2..{args.rounds}), {info.get('cpu')} ({info.get('cores')} "
              f"cores), torch {info.get('torch')}; GPT 2 x {args.n_embd} ({params:,} parameters), compression on "
              f"(rank 1..{args.max_rank}), 2 inner steps, seed {SEED}; loopback, TLS, no ledger.")
    text = f"{header}\n\n{table(rows)}\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
