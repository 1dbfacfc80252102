"""The coordinator's receipts: what it signs when it counts a worker's update, and when it takes the
worker's report of that round (docs/trust.md, "Receipts").

    Receipt{bytes32 runId, uint64 round, address worker, bytes32 updateDigest, bytes32 reportDigest}
    digest = keccak256(0x1901 ‖ domainSeparator ‖ hashStruct(receipt))

signed by the run's coordinator (its chain key: the ledger's ``runOf(runId).coordinator``) in the
run's ledger's EIP-712 domain, the one workers sign their reports in (attestation.report.Domain);
``contracts/src/ReceiptCourt.sol`` verifies it there, and a test recomputes the digest on chain
through ``receiptDigest``.

When it is signed, so that "receipted" means "counted":

- an *update receipt* (``reportDigest`` zero) once the worker's whole update is accepted into the
  open round (trainer.coordinator.intake: accepted under the lock that closes the round, journalled,
  so it is in the round's aggregate and manifest whatever happens next, a restart included);
- a *report receipt* (``reportDigest`` = the ledger's ``reportDigest`` of the report) once the
  worker's signed report of a published round is filed for the ledger (settlement.report_book: only
  before the round is handed to the ledger, so the recording call must carry it).

``updateDigest`` is the digest of the update record's CID, the one the manifest's participant names
and the report and the ledger's ``unreported`` list restate. A report receipt held for a round the
ledger records without crediting its worker is a fault of the coordinator that the worker proves on
chain alone (``ReceiptCourt.proveOmission``); an update receipt is what the audit reads to tell "the
coordinator did not use what this worker sent" from "this worker's update is wrong".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eth_utils import to_checksum_address

from attestation.keys import SignatureError, WorkerKey, recover_address
from attestation.report import Domain, ReportError
from storage_client import hex32, unhex32

RECEIPT_FIELDS: tuple[tuple[str, str, str], ...] = (  # (Python name, Solidity name, ABI type), struct order
    ("run_id", "runId", "bytes32"),
    ("round", "round", "uint64"),
    ("worker", "worker", "address"),
    ("update_digest", "updateDigest", "bytes32"),
    ("report_digest", "reportDigest", "bytes32"),
)
RECEIPT_TYPE = [{"name": solidity, "type": abi} for _, solidity, abi in RECEIPT_FIELDS]
NO_REPORT = bytes(32)  # the reportDigest of an update receipt


class ReceiptError(ReportError):
    """A receipt that is malformed, or not signed by the key it must be."""


@dataclass(frozen=True)
class Receipt:
    run_id: bytes
    round: int
    worker: str
    update_digest: bytes
    report_digest: bytes = NO_REPORT

    def __post_init__(self) -> None:
        for name in ("run_id", "update_digest", "report_digest"):
            value = getattr(self, name)
            if not (isinstance(value, bytes) and len(value) == 32):
                raise ReceiptError(f"receipt field {name} must be 32 bytes")
        if type(self.round) is not int or not 0 < self.round < 2**64:
            raise ReceiptError(f"receipt round must be a uint64 above 0, got {self.round!r}")
        try:
            object.__setattr__(self, "worker", to_checksum_address(self.worker))
        except (ValueError, TypeError) as exc:
            raise ReceiptError("receipt worker is not an address") from exc

    @property
    def reported(self) -> bool:
        """A report receipt (the coordinator holds the worker's report), not an update receipt."""
        return self.report_digest != NO_REPORT

    def message(self) -> dict[str, Any]:
        return {solidity: getattr(self, name) for name, solidity, _ in RECEIPT_FIELDS}

    def as_abi(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name, _, _ in RECEIPT_FIELDS)

    def digest(self, domain: Domain) -> bytes:
        """The 32 bytes the coordinator signs (``ReceiptCourt.receiptDigest``)."""
        return domain.typed_digest("Receipt", RECEIPT_TYPE, self.message())

    def to_json(self) -> dict[str, Any]:
        return {name: (hex32(v) if isinstance(v := getattr(self, name), bytes) else v) for name, _, _ in RECEIPT_FIELDS}

    @classmethod
    def from_json(cls, obj: Any) -> Receipt:
        names = {name for name, _, _ in RECEIPT_FIELDS}
        if not isinstance(obj, dict) or set(obj) != names:
            raise ReceiptError(f"a receipt is an object of exactly {sorted(names)}")
        try:
            return cls(run_id=unhex32(obj["run_id"], "run_id"), round=obj["round"], worker=obj["worker"],
                       update_digest=unhex32(obj["update_digest"], "update_digest"),
                       report_digest=unhex32(obj["report_digest"], "report_digest"))
        except ReceiptError:
            raise
        except ValueError as exc:
            raise ReceiptError(f"receipt {exc}") from None


@dataclass(frozen=True)
class SignedReceipt:
    receipt: Receipt
    signature: bytes  # 65 bytes r ‖ s ‖ v, by the run's coordinator

    def signer(self, domain: Domain) -> str:
        try:
            return recover_address(self.receipt.digest(domain), self.signature)
        except SignatureError as exc:
            raise ReceiptError(f"receipt of round {self.receipt.round}: {exc}") from exc

    def verify(self, domain: Domain, coordinator: str) -> None:
        """The receipt must be signed by ``coordinator`` (the run's coordinator on chain)."""
        signer = self.signer(domain)
        if signer != to_checksum_address(coordinator):
            raise ReceiptError(f"receipt of round {self.receipt.round} is signed by {signer}, not by the run's "
                               f"coordinator {to_checksum_address(coordinator)}")

    def to_json(self) -> dict[str, Any]:
        return {"receipt": self.receipt.to_json(), "signature": "0x" + self.signature.hex()}

    @classmethod
    def from_json(cls, obj: Any) -> SignedReceipt:
        if not isinstance(obj, dict) or set(obj) != {"receipt", "signature"}:
            raise ReceiptError("a signed receipt is {receipt, signature}")
        signature = obj["signature"]
        if not isinstance(signature, str) or len(signature) != 132 or not signature.startswith("0x"):
            raise ReceiptError("a receipt's signature must be 0x and 65 bytes of hex")
        receipt = Receipt.from_json(obj["receipt"])
        try:
            return cls(receipt, bytes.fromhex(signature[2:]))
        except ValueError:
            raise ReceiptError("a receipt's signature is not hex") from None


def sign_receipt(signer: WorkerKey, domain: Domain, receipt: Receipt) -> SignedReceipt:
    """``receipt`` signed by ``signer`` (an attestation.WorkerKey: the coordinator's chain key)."""
    return SignedReceipt(receipt, signer.sign_digest(receipt.digest(domain)))
