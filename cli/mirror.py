"""``dilocox mirror --run-id HEX --from URL --to DIR --rpc URL --deployment FILE``: copy a run's
store from trustless gateways into DIR/store, verified and incrementally.

The run's last recorded round is read off the ledger (the chain at ``--rpc``, contracts named by
``--deployment``); from its manifest the lineage is walked back to genesis (storage_client.lineage:
every parent link checked), and for each round what ``dilocox store car`` would write of it
(cli.store.round_blocks: the manifest, config, stored checkpoint and outer state, downlink, update
records and the payloads, headers and states they name) is copied, and the admission record and
evidence of every worker the recorded rounds credit (what the audit checks each report's signer
against; ``admission_blocks``), so that the mirror is enough for a new coordinator to take the run
over (``dilocox coordinator --take-over``) and for an audit. Every block fetched is verified
against its CID by storage_client.remote.RemoteStore (``--from`` repeatable: tried in order) and
written atomically by the local store; a block already in DIR/store is read from there (and
re-hashed) instead of fetched, so a second mirror of a longer run fetches only the new rounds. The
mirror is a store like any other: ``dilocox store serve --run DIR`` serves it in turn.

Exit status: 0 when the mirror holds every round the ledger records, 2 when it could not (one line
naming the CID, and the sources that lied, or what else is wrong).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from storage_client import CID, Codec, ObjectStore, Store
from storage_client.backend import as_cid

EXIT_OK, EXIT_ERROR = 0, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-id", required=True, metavar="HEX", help="the run to mirror (0x + 64 hex)")
    parser.add_argument("--from", dest="sources", action="append", required=True, metavar="URL",
                        help="a trustless gateway serving the run's store (repeatable: tried in order)")
    parser.add_argument("--to", required=True, metavar="DIR", help="the mirror's directory (its store/ is filled)")
    parser.add_argument("--rpc", required=True, metavar="URL", help="the chain whose ledger records the run")
    parser.add_argument("--deployment", required=True, metavar="FILE", help="the contracts' deployment JSON")
    parser.add_argument("--store-ca", metavar="FILE", help="the CA certificate to trust for https sources")


class ReadThroughStore(Store):
    """Reads from ``local`` when it holds the object, else from ``remote``, keeping what it fetched in
    ``local``: the mirror's copy. Counts the blocks fetched and the reads served by the mirror. Misses
    are fetched one at a time (``dilocox store serve --from`` serves one from many threads): W readers
    of a new object cost its source one copy, not W."""

    def __init__(self, local: ObjectStore, remote: Store) -> None:
        self.local, self.remote = local, remote
        self.fetched = self.kept = 0
        self._missing = threading.Lock()

    @property
    def location(self) -> str:
        return f"{self.local.location} (from {self.remote.location})"

    def put(self, data: bytes, codec: Codec = Codec.RAW) -> CID:
        return self.local.put(data, codec)

    def get(self, cid: CID | str) -> bytes:
        cid = as_cid(cid)
        if self.local.has(cid):
            self.kept += 1
            return self.local.get(cid)
        with self._missing:
            if self.local.has(cid):  # fetched by the reader this one waited for
                return self.local.get(cid)
            data = self.remote.get(cid)  # verified against the CID by the remote store
            self.local.put(data, cid.codec)
            self.fetched += 1
        return data

    def has(self, cid: CID | str) -> bool:
        return self.local.has(cid) or self.remote.has(cid)

    def size(self, cid: CID | str) -> int:
        return self.local.size(cid) if self.local.has(cid) else self.remote.size(cid)

    def __iter__(self) -> Iterator[str]:
        return iter(self.local)

    def read_small_json(self, cid: CID | str, max_bytes: int) -> Any | None:
        return self.local.read_small_json(cid, max_bytes)


def admission_blocks(store: Store, admissions: Iterator[Any]) -> int:
    """Read (so copy) each admission's record (``CID(JSON, evidenceDigest)``) and the evidence it names;
    returns the blocks read. ``admissions``: settlement.records.Admission events."""
    from attestation.admission import admission_record_cid

    blocks = 0
    for admission in admissions:
        record = store.get_json(admission_record_cid(admission.evidence_digest))
        evidence = record.get("evidence") if isinstance(record, dict) else None
        if not isinstance(evidence, str):
            raise ValueError(f"the admission record of {admission.worker} names no evidence")
        store.get(CID.parse(evidence))
        blocks += 2
    return blocks


def run(args: argparse.Namespace) -> int:
    from settlement import Chain, ChainError, Deployment, DeploymentError, Ledger, Registry
    from storage_client import DilocoxError, lineage, open_store
    from storage_client.remote import RemoteStore

    from .store import round_blocks

    try:
        run_id = bytes.fromhex(args.run_id.removeprefix("0x"))
        if len(run_id) != 32:
            raise ValueError
    except ValueError:
        print(f"mirror: --run-id {args.run_id[:80]!r} is not 0x followed by 64 hex digits", file=sys.stderr)
        return EXIT_ERROR
    try:
        deployment = Deployment.load(Path(args.deployment))
        chain = Chain(args.rpc, os.urandom(32))  # a throwaway key: the mirror only reads the chain
        ledger = Ledger(chain, deployment.ledger, from_block=deployment.deployed_block)
        record = ledger.run_of(run_id)
        if record is None:
            raise ChainError(f"the ledger {deployment.ledger} records no run {args.run_id[:80]}")
        rounds = ledger.recorded_round_events(run_id)
        tip = CID(Codec.JSON, rounds[-1].manifest_digest if rounds else record.genesis_manifest)
        store = ReadThroughStore(open_store(args.to), RemoteStore(args.sources, ca_file=args.store_ca))
        chain_of_manifests = lineage(store, tip)
        blocks = sum(1 for cid, _ in chain_of_manifests for _ in round_blocks(store, cid))
        registry = Registry(chain, deployment.registry, from_block=deployment.deployed_block)
        credited = sorted({worker for recorded in rounds for worker in recorded.workers})
        blocks += admission_blocks(store, (a for worker in credited for a in registry.admissions(worker)))
    except (DeploymentError, ChainError, DilocoxError, OSError, ValueError) as exc:
        print(f"mirror: {str(exc)[:500]}", file=sys.stderr)
        return EXIT_ERROR
    print(f"mirror: rounds 0 to {len(chain_of_manifests) - 1} of run {args.run_id[:18]}… in {args.to}: {blocks} "
          f"blocks, {store.fetched} fetched and verified, {store.kept} reads from the mirror (up to manifest {tip})")
    return EXIT_OK
