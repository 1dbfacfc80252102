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
from storage_client import CID, Manifest, Participant

DOMAIN_NAME = "DiLoCoX Contribution Ledger"
DOMAIN_VERSION = "1"



@dataclass(frozen=True)
class ReportField:
    """One member of the ``RoundReport`` struct: its Python name, its Solidity name and ABI type,
    and whether every report of a round shares it (``IContributionLedger.RoundHeader``) or each
    worker's report has its own (``WorkerReport``)."""

    name: str
    solidity: str
    abi_type: str
    shared: bool


# The one table of the struct, in the Solidity field order: the EIP-712 type, the message, the
# range checks, the ledger's tuples and the header/worker split are all read off it.
REPORT_FIELDS: tuple[ReportField, ...] = (
    ReportField("run_id", "runId", "bytes32", True),
    ReportField("round", "round", "uint64", True),
    ReportField("worker", "worker", "address", False),
    ReportField("parent_checkpoint", "parentCheckpoint", "bytes32", True),
    ReportField("checkpoint", "checkpoint", "bytes32", True),
    ReportField("manifest_digest", "manifestDigest", "bytes32", True),
    ReportField("update_digest", "updateDigest", "bytes32", False),
    ReportField("data_digest", "dataDigest", "bytes32", False),
    ReportField("train_loss_e6", "trainLossE6", "int64", False),
    ReportField("eval_loss_e6", "evalLossE6", "int64", True),
    ReportField("tokens", "tokens", "uint64", True),
    ReportField("inner_steps", "innerSteps", "uint32", True),
    ReportField("bytes_sent", "bytesSent", "uint64", False),
    ReportField("bytes_received", "bytesReceived", "uint64", False),
)
ROUND_REPORT_TYPE = [{"name": f.solidity, "type": f.abi_type} for f in REPORT_FIELDS]
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


def typed_data(domain: Domain, primary_type: str, fields_: list[dict[str, str]], message: dict[str, Any]) -> dict[str, Any]:
    """EIP-712 typed data of one struct in ``domain``: what every message of the run is signed as
    (the round report here; the coordinator's receipt, attestation.receipt)."""
    return {
        "types": {
            "EIP712Domain": [
                {"name": "name", "type": "string"}, {"name": "version", "type": "string"},
                {"name": "chainId", "type": "uint256"}, {"name": "verifyingContract", "type": "address"},
            ],
            primary_type: fields_,
        },
        "primaryType": primary_type,
        "domain": domain.to_eip712(),
        "message": message,
    }


def typed_digest(data: dict[str, Any]) -> bytes:
    """keccak256(0x1901 ‖ domainSeparator ‖ hashStruct(message)) of ``typed_data``'s output."""
    return _hash_eip191_message(encode_typed_data(full_message=data))


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
        for f in REPORT_FIELDS:
            value = getattr(self, f.name)
            if f.abi_type == "bytes32" and not (isinstance(value, bytes) and len(value) == 32):
                raise ReportError(f"report field {f.name} must be 32 bytes")
            if f.abi_type.startswith(("uint", "int")):
                bits = int(f.abi_type.removeprefix("u").removeprefix("int"))
                low, high = (0, 2**bits) if f.abi_type.startswith("u") else (-(2 ** (bits - 1)), 2 ** (bits - 1))
                if type(value) is not int or not low <= value < high:
                    raise ReportError(f"report field {f.name} must be a {f.abi_type}, got {value!r}")
        try:
            object.__setattr__(self, "worker", to_checksum_address(self.worker))
        except ValueError as exc:
            raise ReportError(f"report field worker is not an address: {self.worker!r}") from exc

    def message(self) -> dict[str, Any]:
        """The EIP-712 message, keys as in the Solidity struct."""
        return {f.solidity: getattr(self, f.name) for f in REPORT_FIELDS}

    def as_abi(self) -> tuple[Any, ...]:
        """The struct as an ABI tuple, in the Solidity field order."""
        return tuple(getattr(self, f.name) for f in REPORT_FIELDS)

    def typed_data(self, domain: Domain) -> dict[str, Any]:
        return typed_data(domain, "RoundReport", ROUND_REPORT_TYPE, self.message())

    def digest(self, domain: Domain) -> bytes:
        """The 32 bytes that are signed (and that the ledger computes in ``reportDigest``)."""
        return typed_digest(self.typed_data(domain))

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



@dataclass(frozen=True)
class ReportDifference:
    """A report field that does not say what the round's manifest says."""

    field: ReportField
    got: Any
    want: Any

    def __str__(self) -> str:
        show = (lambda v: "0x" + v.hex()) if isinstance(self.want, bytes) else repr
        return f"{self.field.solidity} is {show(self.got)}, the manifest says {show(self.want)}"


def manifest_claims(run_id: bytes, manifest_digest: bytes, manifest: Manifest, parent: Manifest,
                    participant: Participant, data_digest: bytes | None) -> dict[str, Any]:
    """What a participant's report of a round must say, field by field, read off the round's
    manifest (and its parent's) and the digest of the participant's shard: the one statement of
    the report-versus-manifest rule, which the coordinator enforces on intake and the audit re-checks
    on chain. ``data_digest`` None leaves dataDigest out (an auditor without the corpus)."""
    claims: dict[str, Any] = {
        "run_id": run_id, "round": manifest.round, "parent_checkpoint": CID.parse(parent.params).digest,
        "checkpoint": CID.parse(manifest.params).digest, "manifest_digest": manifest_digest,
        "update_digest": CID.parse(participant.update).digest, "train_loss_e6": participant.train_loss_e6,
        "eval_loss_e6": manifest.eval_loss_e6, "tokens": participant.tokens,
        "inner_steps": participant.inner_steps, "bytes_sent": participant.bytes_sent,
        "bytes_received": participant.bytes_received,
    }
    if data_digest is not None:
        claims["data_digest"] = data_digest
    return claims


def report_differences(report: RoundReport, claims: dict[str, Any]) -> list[ReportDifference]:
    """The fields of ``report`` that differ from ``claims`` (``manifest_claims``), in struct order."""
    return [ReportDifference(f, getattr(report, f.name), claims[f.name])
            for f in REPORT_FIELDS if f.name in claims and getattr(report, f.name) != claims[f.name]]
