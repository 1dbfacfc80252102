"""What the coordinator asks of a run's trust layer, as an interface.

The state machine admits workers, checks push signatures and takes reports through a
:class:`RunTrust`; settlement.ledger_trust implements it over the chain (attestation, the registry,
the report book and the ledger outbox). A run without a ledger has none: its workers are not
attested and its rounds are not recorded. trainer/ never imports settlement/: the CLI that starts a
coordinator builds the implementation and hands it in.
"""

from __future__ import annotations

import threading
from typing import Protocol

from attestation import Domain, SignedReport, WorkerKey
from attestation.receipt import NO_REPORT, SignedReceipt
from storage_client import CID, Manifest


class PublishedRounds(Protocol):
    """The coordinator as the settlement loop sees it."""

    def published(self) -> tuple[dict[int, tuple[CID, Manifest]], dict[int, float], float]:
        """Every published round's manifest, when each closed, and the coordinator's clock now."""
        ...


class RunTrust(Protocol):
    signer: WorkerKey  # the run's coordinator account: signs every global state served
    chain_id: int
    ledger_address: str  # the EIP-712 domain's verifying contract, which workers sign reports for
    domain: Domain  # that domain: reports and receipts are signed in it
    lag: int  # published rounds the ledger has not confirmed yet

    def challenge(self, worker_id: str) -> bytes:
        """A join nonce bound to ``worker_id``."""
        ...

    def admit(self, worker_id: str, address: str, evidence: bytes, nonce: bytes) -> str:
        """Verify a joining worker's evidence and admit its key; returns its checksummed address."""
        ...

    def check_update(self, worker_id: str, address: str | None, round_: int, stage: int, num_stages: int,
                     payload_sha256: str, signature: bytes) -> None:
        """A push header must be signed by the worker's admitted key."""
        ...

    def take_report(self, worker_id: str, address: str | None, signed: SignedReport, manifest_cid: CID,
                    manifest: Manifest, parent: Manifest, data_digest: bytes) -> None:
        """Check a participant's signed report against its round's manifest, and keep it."""
        ...

    def receipt(self, worker: str, round_: int, update_digest: bytes,
                report_digest: bytes = NO_REPORT) -> SignedReceipt:
        """The coordinator's signed receipt (attestation.receipt): an update of ``round_`` counted, or,
        with ``report_digest``, its worker's report of it filed for the ledger."""
        ...

    def settle(self, rounds: PublishedRounds, until: threading.Event, stop: threading.Event,
               failure: list[str]) -> None:
        """Record reported rounds on the ledger until ``until`` is set; a failure that retrying
        cannot fix is put in ``failure`` and sets ``stop``, so the coordinator exits 1."""
        ...

    def settled(self, head_round: int) -> bool:
        """Every round up to ``head_round`` is recorded and confirmed."""
        ...
