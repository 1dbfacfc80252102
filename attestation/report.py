"""Where a report is signed: the EIP-712 ``RoundReport`` a worker signs for each round it joined.

The typed data (docs/trust.md) is signed by the worker's TEE-bound key and verified on chain by
``ContributionLedger`` (OpenZeppelin EIP712 + ECDSA.tryRecover), so the struct, its type string and
the domain here must match ``contracts/src/ContributionLedger.sol`` exactly; a test recomputes the
digest on chain through ``reportDigest`` to keep the two in step.

    digest = keccak256(0x1901 ‖ domainSeparator ‖ hashStruct(report))
    domainSeparator = hashStruct(EIP712Domain{name, version, chainId, verifyingContract})
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from eth_account.messages import _hash_eip191_message, encode_typed_data
from eth_utils import to_checksum_address

from attestation.keys import SignatureError, recover_address

DOMAIN_NAME = "DiLoCoX Contribution Ledger"
DOMAIN_VERSION = "1"

ROUND_REPORT_TYPE = [
    {"name": "runId", "type": "bytes32"},
    {"name": "round", "type": "uint64"},
    {"name": "worker", "type": "address"},
    {"name": "parentCheckpoint", "type": "bytes32"},
    {"name": "checkpoint", "type": "bytes32"},
    {"name": "manifestDigest", "type": "bytes32"},
    {"name": "updateDigest", "type": "bytes32"},
    {"name": "dataDigest", "type": "bytes32"},
    {"name": "trainLossE6", "type": "int64"},
    {"name": "evalLossE6", "type": "int64"},
    {"name": "tokens", "type": "uint64"},
    {"name": "innerSteps", "type": "uint32"},
    {"name": "bytesSent", "type": "uint64"},
    {"name": "bytesReceived", "type": "uint64"},
]
TYPE_STRING = "RoundReport(" + ",".join(f"{f['type']} {f['name']}" for f in ROUND_REPORT_TYPE) + ")"


class ReportError(ValueError):
    """A report that is malformed, or whose signature does not hold."""


@dataclass(frozen=True)
class Domain:
    chain_id: int
    ledger: str  # verifyingContract

    def to_eip712(self) -> dict[str, Any]:
        return {"name": DOMAIN_NAME, "version": DOMAIN_VERSION, "chainId": self.chain_id,
                "verifyingContract": to_checksum_address(self.ledger)}


@dataclass(frozen=True)
class RoundReport:
    """What a worker attests about one round; 32-byte fields are bytes, losses fixed-point ×1e6."""

    run_id: bytes
    round: int
    worker: str
    parent_checkpoint: bytes
    checkpoint: bytes
    manifest_digest: bytes  # sha256 of the round's manifest: every manifest field is signed through it
    update_digest: bytes
    data_digest: bytes
    train_loss_e6: int
    eval_loss_e6: int
    tokens: int
    inner_steps: int
    bytes_sent: int  # wire bytes of the pushed update (the manifest participant's bytes_sent)
    bytes_received: int  # wire bytes of the FetchGlobal stream the update started from (bytes_received)

    def __post_init__(self) -> None:
        for name in ("run_id", "parent_checkpoint", "checkpoint", "manifest_digest", "update_digest", "data_digest"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != 32:
                raise ReportError(f"report field {name} must be 32 bytes")
        limits = {"round": 64, "tokens": 64, "inner_steps": 32, "bytes_sent": 64, "bytes_received": 64}
        for name, bits in limits.items():
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value < 2**bits:
                raise ReportError(f"report field {name} must be a uint{bits}, got {value!r}")
        for name in ("train_loss_e6", "eval_loss_e6"):
            value = getattr(self, name)
            if type(value) is not int or not -(2**63) <= value < 2**63:
                raise ReportError(f"report field {name} must be an int64, got {value!r}")
        try:
            object.__setattr__(self, "worker", to_checksum_address(self.worker))
        except ValueError as exc:
            raise ReportError(f"report field worker is not an address: {self.worker!r}") from exc

    def message(self) -> dict[str, Any]:
        """The EIP-712 message, keys as in the Solidity struct."""
        return {
            "runId": self.run_id, "round": self.round, "worker": self.worker,
            "parentCheckpoint": self.parent_checkpoint, "checkpoint": self.checkpoint,
            "manifestDigest": self.manifest_digest, "updateDigest": self.update_digest, "dataDigest": self.data_digest,
            "trainLossE6": self.train_loss_e6, "evalLossE6": self.eval_loss_e6,
            "tokens": self.tokens, "innerSteps": self.inner_steps, "bytesSent": self.bytes_sent,
            "bytesReceived": self.bytes_received,
        }

    def typed_data(self, domain: Domain) -> dict[str, Any]:
        return {
            "types": {
                "EIP712Domain": [
                    {"name": "name", "type": "string"}, {"name": "version", "type": "string"},
                    {"name": "chainId", "type": "uint256"}, {"name": "verifyingContract", "type": "address"},
                ],
                "RoundReport": ROUND_REPORT_TYPE,
            },
            "primaryType": "RoundReport",
            "domain": domain.to_eip712(),
            "message": self.message(),
        }

    def digest(self, domain: Domain) -> bytes:
        """The 32 bytes that are signed (and that the ledger computes in ``reportDigest``)."""
        return _hash_eip191_message(encode_typed_data(full_message=self.typed_data(domain)))

    def to_json(self) -> dict[str, Any]:
        """JSON form for the store: 32-byte fields as 0x-hex, ints as ints."""
        return {k: ("0x" + v.hex() if isinstance(v, bytes) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, obj: Any) -> RoundReport:
        if not isinstance(obj, dict):
            raise ReportError("a report must be a JSON object")
        names = {f.name for f in fields(cls)}
        if set(obj) != names:
            raise ReportError(f"report fields differ: missing {sorted(names - set(obj))}, "
                              f"unexpected {sorted(set(obj) - names)}")
        values = {}
        for name, value in obj.items():
            if isinstance(value, str) and name != "worker":
                if not value.startswith("0x"):
                    raise ReportError(f"report field {name} must be 0x-hex")
                try:
                    value = bytes.fromhex(value[2:])
                except ValueError as exc:
                    raise ReportError(f"report field {name} is not hex") from exc
            values[name] = value
        return cls(**values)


@dataclass(frozen=True)
class SignedReport:
    report: RoundReport
    signature: bytes  # 65 bytes r ‖ s ‖ v

    def signer(self, domain: Domain) -> str:
        """The address that signed (low-s only, v 27/28, as the ledger's ECDSA.tryRecover)."""
        try:
            return recover_address(self.report.digest(domain), self.signature)
        except SignatureError as exc:
            raise ReportError(f"report for round {self.report.round}: {exc}") from exc

    def verify(self, domain: Domain) -> None:
        signer = self.signer(domain)
        if signer != self.report.worker:
            raise ReportError(f"report for round {self.report.round} claims worker {self.report.worker} "
                              f"but was signed by {signer}")

    def to_json(self) -> dict[str, Any]:
        return {"report": self.report.to_json(), "signature": "0x" + self.signature.hex()}

    @classmethod
    def from_json(cls, obj: Any) -> SignedReport:
        if not isinstance(obj, dict) or set(obj) != {"report", "signature"}:
            raise ReportError("a signed report is {report, signature}")
        sig = obj["signature"]
        if not isinstance(sig, str) or not sig.startswith("0x"):
            raise ReportError("signature must be 0x-hex")
        try:
            signature = bytes.fromhex(sig[2:])
        except ValueError as exc:
            raise ReportError("signature is not hex") from exc
        return cls(RoundReport.from_json(obj["report"]), signature)

