"""Who the ledger's addresses are: worker ids beside addresses, and the updates nobody reported.

The ledger knows workers by address only; the store's manifests know them by id. The binding is
what a worker signed: its report for round r names an ``updateDigest`` (the CID of its update
record), and round r's manifest names the participant whose update that is. So, from the chain
(``Ledger.recorded_rounds``: every report exactly as signed, and the unreported update digests) and
the store (the manifests the ledger's rounds name) alone, nothing a coordinator keeps for itself:

    ids[address]   the worker ids whose updates that address signed reports for (one, normally)
    unreported     each participant's update recorded on the coordinator's word, without a report:
                   round, worker id, update CID, and the address the id reported as in another round
                   of the run (None when it never reported)

A round recorded with fewer reports than updates is the loud case: its unreported workers are
credited nothing for it on the ledger, and are paid nothing for it from the run's pool
(settlement.rewards: a round's share is split among its reporting workers; with none, it stays in
the pool). ``dilocox settle``, ``dilocox audit`` and the demo's summary all say so with
``unreported_lines``. A manifest that is missing or does not parse is skipped here (the audit
fails it by name).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

from storage_client import CID, Codec, Manifest, Store, StoreError
from storage_client.manifest import ManifestError

from .records import RoundRecord

__all__ = ["Roster", "UnreportedUpdate", "roster_of", "short_address", "unreported_lines"]


def short_address(address: str) -> str:
    """``0x12345678…abcd``: enough of an address to tell a run's workers apart."""
    return f"{address[:10]}…{address[-4:]}" if len(address) > 16 else address


@dataclass(frozen=True)
class UnreportedUpdate:
    """A participant's update that a round counts without its worker's report."""

    round: int
    worker: str  # its worker id, from the round's manifest
    update: str  # CID of its update record
    address: str | None  # the address the id signed reports as in other rounds; None if it never did

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "worker": self.worker, "update": self.update, "address": self.address}


@dataclass
class Roster:
    """The run's worker ids by address, and the updates recorded without a report."""

    ids: dict[str, list[str]] = field(default_factory=dict)  # address -> worker ids, sorted
    unreported: list[UnreportedUpdate] = field(default_factory=list)  # by round, then worker id
    updates: dict[int, int] = field(default_factory=dict)  # round -> participants in its manifest

    def id_of(self, address: str) -> str:
        """The worker id(s) of ``address``, or ``?`` when none of its reports names a known update."""
        return "/".join(self.ids.get(address, ())) or "?"

    def label(self, address: str) -> str:
        """``site-a (0x12345678…abcd)``."""
        return f"{self.id_of(address)} ({short_address(address)})"

    def address_of(self, worker_id: str) -> str | None:
        found = [address for address, ids in self.ids.items() if worker_id in ids]
        return found[0] if len(found) == 1 else None

    def to_json(self) -> dict[str, Any]:
        return {"ids": {a: list(ids) for a, ids in sorted(self.ids.items())},
                "unreported": [u.to_json() for u in self.unreported]}


def _manifest(store: Store, record: RoundRecord) -> Manifest | None:
    try:
        return Manifest.load(store, CID(Codec.JSON, record.manifest_digest))
    except (StoreError, ManifestError, ValueError):
        return None


def roster_of(store: Store, rounds: Sequence[RoundRecord]) -> Roster:
    """The roster of a run from its recorded rounds (with their calls: ``Ledger.recorded_rounds``)
    and the manifests they name in ``store``."""
    ids: dict[str, set[str]] = defaultdict(set)
    unreported: list[tuple[int, str, str]] = []
    updates: dict[int, int] = {}
    for record in rounds:
        manifest = _manifest(store, record)
        if manifest is None:
            continue
        updates[record.round] = len(manifest.participants)
        by_update = {CID.parse(p.update).digest: p for p in manifest.participants}
        for signed in record.reports:
            participant = by_update.get(signed.report.update_digest)
            if participant is not None:
                ids[signed.report.worker].add(participant.worker)
        for digest in record.unreported:
            participant = by_update.get(digest)
            if participant is not None:
                unreported.append((record.round, participant.worker, participant.update))
    roster = Roster(ids={a: sorted(names) for a, names in ids.items()}, updates=updates)
    roster.unreported = [UnreportedUpdate(r, worker, update, roster.address_of(worker))
                         for r, worker, update in sorted(unreported)]
    return roster


def unreported_lines(roster: Roster) -> list[str]:
    """One line per update recorded without its worker's report, naming the worker (id and address),
    the round's reports against its updates, and what it costs the worker; empty when every update
    was reported."""
    missing: dict[int, int] = defaultdict(int)
    for u in roster.unreported:
        missing[u.round] += 1
    lines = []
    for u in roster.unreported:
        total = roster.updates.get(u.round, missing[u.round])
        where = short_address(u.address) if u.address else "address unknown: it never reported in this run"
        lines.append(f"round {u.round} was recorded with {total - missing[u.round]} report(s) for {total} "
                     f"update(s): participant {u.worker} did not report ({where}); it is credited and paid "
                     f"nothing for round {u.round}")
    return lines
