"""``dilocox store``: a run's store from anywhere.

``dilocox store serve --run DIR [--host H] [--port P] [--tls] [--from URL …]`` serves DIR's store as
an IPFS trustless gateway (storage_client.gateway): ``GET /ipfs/<cid>`` as a raw block or a CAR,
read-only, every block re-hashed before it is sent. With ``--from``, a block DIR lacks is fetched from
those gateways (verified by CID, cli.mirror.ReadThroughStore), kept and served: a mirror that follows
a live run, which its workers fetch each round's downlink from (``dilocox worker --store-source``),
so the coordinator sends it once. ``--tls`` serves HTTPS with the run's coordinator identity (DIR/tls, or
``--tls-cert``/``--tls-key``), so a client trusts it by the same certificate its workers pin. It prints
its URL on one line and serves until SIGTERM (exit 143) or Ctrl-C (130).

``dilocox store car --run DIR --round N OUT.car`` writes round N as a CARv1 whose root is the round's
manifest (storage_client.car): the manifest, then the run configuration, the checkpoint and outer
state when the round stored them, the compressed downlink, and each participant's update record with
the payloads, codec headers and committed state it names (:func:`round_blocks`), each once, every
one re-hashed as it is read. The lineage from HEAD to genesis is re-hashed first. An IPFS node
imports it with ``ipfs dag import OUT.car``.

Exit status: 0 when served / written, 2 when it could not (one line saying why).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from storage_client import CID, Store, StoreError

EXIT_OK, EXIT_ERROR = 0, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_subparsers(dest="store_command", required=True)
    serve = what.add_parser("serve", help="serve a run's store as an IPFS trustless gateway (read-only)")
    serve.add_argument("--run", required=True, metavar="DIR", help="run directory (its store/)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8480, help="port to listen on (default 8480; 0: any free one)")
    serve.add_argument("--tls", action="store_true", help="HTTPS with the run's coordinator identity (DIR/tls)")
    serve.add_argument("--tls-cert", metavar="FILE", help="with --tls: this certificate chain instead of DIR/tls's")
    serve.add_argument("--tls-key", metavar="FILE", help="with --tls: the key of --tls-cert")
    serve.add_argument("--from", dest="sources", action="append", default=[], metavar="URL",
                       help="read through: a block DIR lacks is fetched from these gateways (repeatable, in "
                            "order), verified, kept in DIR/store and served (a mirror that follows a live run)")
    serve.add_argument("--store-ca", metavar="FILE", help="with --from: the CA certificate to trust for https sources "
                                                          "(a coordinator's DIR/tls/cert.pem)")
    car = what.add_parser("car", help="write one round (manifest, checkpoint, update records) as a CARv1")
    car.add_argument("--run", required=True, metavar="DIR", help="run directory (its store/ and HEAD)")
    car.add_argument("--round", required=True, type=int, metavar="N", help="the round to write")
    car.add_argument("out", metavar="OUT.car", help="file to write (replaced atomically)")


def run(args: argparse.Namespace) -> int:
    if not (Path(args.run) / "store").is_dir() and not getattr(args, "sources", None):
        print(f"store: {str(args.run)[:200]} is not a run directory (no store/)", file=sys.stderr)
        return EXIT_ERROR
    return serve(args) if args.store_command == "serve" else write_round_car(args)


def serve(args: argparse.Namespace) -> int:
    from storage_client.gateway import server_tls, start_gateway

    if not 0 <= args.port <= 65535:
        print(f"store serve: --port {args.port} is out of range: must be in [0, 65535]", file=sys.stderr)
        return EXIT_ERROR
    tls = None
    if args.tls:
        from trainer.net.tls import TlsError, server_identity

        try:
            identity = server_identity(Path(args.run) / "tls", args.tls_cert, args.tls_key, hosts=[args.host])
            tls = server_tls(identity.cert_path, identity.key_path)
        except (TlsError, OSError, ValueError) as exc:
            print(f"store serve: no TLS identity: {str(exc)[:300]}", file=sys.stderr)
            return EXIT_ERROR
    try:
        served = _served_store(args)
    except (StoreError, OSError) as exc:
        print(f"store serve: {str(exc)[:300]}", file=sys.stderr)
        return EXIT_ERROR
    try:
        server, thread = start_gateway(served, args.host, args.port, tls)
    except OSError as exc:
        print(f"store serve: cannot listen on {args.host[:100]}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_ERROR
    stopped: list[int] = []
    done = threading.Event()

    def stop(signum: int, _frame: object) -> None:
        stopped.append(signum)
        done.set()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)
    print(f"serving {args.run} at {server.url}/ipfs/<cid> "
          f"({'reading through ' + ', '.join(args.sources) if args.sources else 'read-only'})", flush=True)
    done.wait()
    server.shutdown()
    server.server_close()
    thread.join(10)
    return 128 + stopped[0]


def _served_store(args: argparse.Namespace) -> Store:
    """DIR's store, or with --from, DIR's store reading through those gateways (cli.mirror.ReadThroughStore)."""
    from storage_client import open_store

    if not args.sources:
        return open_store(args.run)
    from cli.mirror import ReadThroughStore
    from storage_client.remote import RemoteStore

    if args.store_ca is not None and not Path(args.store_ca).is_file():
        raise StoreError(f"--store-ca {args.store_ca[:200]!r} is not a file")
    return ReadThroughStore(open_store(args.run), RemoteStore(args.sources, ca_file=args.store_ca))


def round_blocks(store: Store, manifest_cid: CID) -> Iterator[tuple[CID, bytes]]:
    """Round ``manifest_cid``'s blocks, each once, manifest first: what an auditor of that round reads
    (objects a round does not store, such as a checkpoint between full ones, are left out)."""
    from storage_client import Manifest
    from trainer.runstore.update_record import parse_record
    from trainer.runtime.state_commit import FRESH_STATE, state_cid

    manifest = Manifest.load(store, manifest_cid)
    seen: set[CID] = set()

    def block(cid: CID) -> Iterator[tuple[CID, bytes]]:
        if cid not in seen and store.has(cid):
            seen.add(cid)
            yield cid, store.get(cid)

    yield from block(manifest_cid)
    yield from block(CID.parse(manifest.config))
    downlink = (manifest.downlink.payload, manifest.downlink.header) if manifest.downlink else ()
    for raw in (manifest.params, manifest.outer_state, *downlink):
        yield from block(CID.parse(raw))
    for participant in manifest.participants:
        record = CID.parse(participant.update)
        for cid, data in block(record):
            yield cid, data
            for ref in parse_record(data):
                yield from block(CID.parse(ref.payload))
                if ref.header:
                    yield from block(CID.parse(ref.header))
        if participant.state is not None and participant.state != FRESH_STATE:
            yield from block(state_cid(participant.state))


def write_round_car(args: argparse.Namespace) -> int:
    from storage_client import lineage, write_atomic
    from storage_client.car import encode_car
    from trainer.runstore.run_dir import RunDir

    if not (Path(args.run) / "HEAD").is_file():
        print(f"car: {str(args.run)[:200]} holds no run (no HEAD file)", file=sys.stderr)
        return EXIT_ERROR
    run_dir = RunDir(args.run)
    chain = lineage(run_dir.store, run_dir.head())
    if not 0 <= args.round < len(chain):
        print(f"car: --round {args.round}: the run has rounds 0 to {len(chain) - 1}", file=sys.stderr)
        return EXIT_ERROR
    root = chain[args.round][0]
    blocks = list(round_blocks(run_dir.store, root))
    data = b"".join(encode_car([root], blocks))
    write_atomic(Path(args.out), data)
    print(f"round {args.round} (manifest {root}): {len(blocks)} blocks, {len(data)} bytes written to {args.out}")
    return EXIT_OK
