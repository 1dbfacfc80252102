"""Client of the ``ReceiptCourt`` (contracts/src/ReceiptCourt.sol): a worker proves with its
coordinator's receipt that a recorded round left it uncredited (attestation.receipt, docs/trust.md
"Receipts").

``omissions`` finds, among a worker's kept receipts, the report receipts of rounds the ledger has
recorded without crediting their worker, each with the round's facts as the ledger's events give
them; ``prove`` submits one (``proveOmission``: the facts are proven against the round's
commitment on chain, as a reward claim's are); ``faults`` reads back every ``ReceiptFaultProven``
of a run, which the audit reports against the coordinator by round.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from attestation.receipt import Receipt, ReceiptError, SignedReceipt
from storage_client import bytes32

from .artifacts import load_artifact
from .chain import Chain
from .ledger import Ledger, _Contract
from .records import RoundRecord, _address, _Event, _uint, _where

__all__ = ["Omission", "ReceiptCourt", "ReceiptFault", "omissions"]


@dataclass(frozen=True, kw_only=True)
class ReceiptFault(_Event):
    """A ``ReceiptFaultProven`` event: ``coordinator`` receipted ``worker``'s update and report of
    ``round`` of ``run_id``, and the recorded round does not credit it."""

    run_id: bytes
    round: int
    worker: str
    coordinator: str
    update_digest: bytes
    report_digest: bytes

    @classmethod
    def from_event(cls, log: Mapping[str, Any]) -> ReceiptFault:
        args = log["args"]
        return cls(run_id=bytes32(args["runId"], "runId"), round=_uint("round", args["round"]),
                   worker=_address("worker", args["worker"]), coordinator=_address("coordinator", args["coordinator"]),
                   update_digest=bytes32(args["updateDigest"], "updateDigest"),
                   report_digest=bytes32(args["reportDigest"], "reportDigest"), **_where(log))

    def describe(self) -> str:
        return (f"round {self.round}: the coordinator {self.coordinator} receipted {self.worker}'s update "
                f"0x{self.update_digest.hex()[:16]}… and its report, and recorded the round without crediting it "
                f"(proven on chain in block {self.block})")


@dataclass(frozen=True)
class Omission:
    """A report receipt whose recorded round does not credit its worker: what ``prove`` submits."""

    signed: SignedReceipt
    round: RoundRecord


class ReceiptCourt(_Contract):
    """Client of a ``ReceiptCourt``.

    @param chain the account that sends proofs (anyone: the wronged worker, or someone for it)
    @param address the court
    """

    def __init__(self, chain: Chain, address: str, *, from_block: int = 0) -> None:
        super().__init__(chain, address, load_artifact("ReceiptCourt"), from_block)

    def receipt_digest(self, receipt: Receipt) -> bytes:
        """What the run's coordinator signs for ``receipt``, as the court computes it."""
        return bytes(self.chain.call(self._contract.functions.receiptDigest(receipt.as_abi())))

    def prove(self, omission: Omission) -> Any:
        """``proveOmission`` of one receipt with its round's facts; returns the transaction receipt.

        @raise TxReverted naming the court's error (ReceiptCourtWorkerCredited, ...) when refused"""
        return self.chain.transact(self._contract.functions.proveOmission(
            omission.signed.receipt.as_abi(), omission.signed.signature, omission.round.facts()))

    def is_proven(self, run_id: bytes, round_: int, worker: str) -> bool:
        return bool(self.chain.call(self._contract.functions.isProven(bytes32(run_id, "run_id"), round_, worker)))

    def faults(self, run_id: bytes) -> list[ReceiptFault]:
        """Every ``ReceiptFaultProven`` of the run, oldest first."""
        return self._logs("ReceiptFaultProven", ReceiptFault.from_event, runId=bytes32(run_id, "run_id"))


def omissions(ledger: Ledger, run_id: bytes, receipts: Iterable[SignedReceipt]) -> tuple[list[Omission], list[str]]:
    """The report receipts of ``run_id`` whose round the ledger recorded without their worker, and
    one line per receipt that proves nothing (an update receipt, a round not recorded yet, a credited
    worker, a signer other than the coordinator that held the round on chain)."""
    run = ledger.run_of(run_id)
    rounds = {record.round: record for record in ledger.recorded_round_events(run_id)}
    found: list[Omission] = []
    skipped: list[str] = []
    for signed in receipts:
        receipt = signed.receipt
        what = f"round {receipt.round} ({'report' if receipt.reported else 'update'} receipt)"
        record = rounds.get(receipt.round)
        if not receipt.reported:
            continue  # the audit reads update receipts; on chain only a report receipt proves an omission
        if run is None or receipt.run_id != run_id:
            skipped.append(f"{what}: another run's, or the run is not on this ledger")
        elif _signer(signed, ledger) != (holder := ledger.coordinator_of(run_id, receipt.round)):
            skipped.append(f"{what}: not signed by the run's coordinator of that round, {holder}")
        elif record is None:
            skipped.append(f"{what}: the round is not recorded yet")
        elif receipt.worker in record.workers:
            skipped.append(f"{what}: the round credits {receipt.worker}")
        else:
            found.append(Omission(signed, record))
    return found, skipped


def _signer(signed: SignedReceipt, ledger: Ledger) -> str | None:
    try:
        return signed.signer(ledger.domain())
    except ReceiptError:
        return None
