"""What an auditor signs: the EIP-712 ``Verdict`` that an audit check failed for a party in a round.

The typed data (docs/trust.md "Disputes") is signed by the auditor's TEE-bound key (admitted to the
run on the disputes contract) and verified on chain by ``Disputes`` (OpenZeppelin EIP712 + ECDSA), so
the struct, its type string and the domain must match ``contracts/src/Disputes.sol`` exactly; a test
recomputes the digest on chain through ``verdictDigest``.

    Verdict(bytes32 runId, uint64 round, address party, bytes32 check, bytes32 evidence)
    digest = keccak256(0x1901 ‖ domainSeparator("DiLoCoX Disputes", "1", chainId, disputes) ‖ hashStruct)
    check  = keccak256(the audit check's name)            e.g. keccak256("replay")
    evidence = the sha256 digest of the store object the check read (its CID's digest)

``party`` is a worker credited in the round (its credit is voided) or the run's coordinator (the
round is voided).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eth_utils import keccak, to_checksum_address

from storage_client import bytes32, hex32, unhex32

from .report import Domain

DISPUTES_DOMAIN_NAME = "DiLoCoX Disputes"
VERDICT_TYPE = [
    {"name": "runId", "type": "bytes32"}, {"name": "round", "type": "uint64"},
    {"name": "party", "type": "address"}, {"name": "check", "type": "bytes32"},
    {"name": "evidence", "type": "bytes32"},
]
TYPE_STRING = "Verdict(" + ",".join(f"{f['type']} {f['name']}" for f in VERDICT_TYPE) + ")"


def disputes_domain(chain_id: int, disputes: str) -> Domain:
    """The domain verdicts are signed in: the disputes contract on its chain."""
    return Domain(chain_id, disputes, name=DISPUTES_DOMAIN_NAME)


def check_id(name: str) -> bytes:
    """The bytes32 a verdict names an audit check by: keccak256 of its name."""
    return keccak(text=name)


@dataclass(frozen=True)
class Verdict:
    """The audit's finding that ``party`` failed ``check`` in ``round`` of ``run_id``, having read
    ``evidence``; ``check_name`` is the check's name (only its keccak is signed)."""

    run_id: bytes
    round: int
    party: str
    check_name: str
    evidence: bytes

    def __post_init__(self) -> None:
        bytes32(self.run_id, "run_id")
        bytes32(self.evidence, "evidence")
        if type(self.round) is not int or not 1 <= self.round < 2**64:
            raise ValueError(f"verdict round must be a uint64 ≥ 1, got {self.round!r}")
        if not isinstance(self.check_name, str) or not 0 < len(self.check_name) <= 66:
            raise ValueError("verdict check_name must be a check's name (1 to 66 characters)")
        object.__setattr__(self, "party", to_checksum_address(self.party))

    @property
    def check(self) -> bytes:
        return check_id(self.check_name)

    def message(self) -> dict[str, Any]:
        return {"runId": self.run_id, "round": self.round, "party": self.party, "check": self.check,
                "evidence": self.evidence}

    def as_abi(self) -> tuple[Any, ...]:
        """``IDisputes.Verdict`` as an ABI tuple."""
        return self.run_id, self.round, self.party, self.check, self.evidence

    def digest(self, domain: Domain) -> bytes:
        """The 32 bytes an auditor signs (and that ``Disputes.verdictDigest`` computes)."""
        return domain.typed_digest("Verdict", VERDICT_TYPE, self.message())

    def to_json(self) -> dict[str, Any]:
        return {"run_id": hex32(self.run_id, "run_id"), "round": self.round, "party": self.party,
                "check": self.check_name, "check_id": hex32(self.check, "check"),
                "evidence": hex32(self.evidence, "evidence")}

    @classmethod
    def from_json(cls, obj: Any) -> Verdict:
        """The inverse of ``to_json`` for untrusted input: exactly its keys, ``check_id`` the keccak of
        ``check`` (ValueError naming the field, never echoing more than a short prefix)."""
        keys = {"run_id", "round", "party", "check", "check_id", "evidence"}
        if not isinstance(obj, dict) or set(obj) != keys:
            raise ValueError(f"a verdict is an object of exactly {sorted(keys)}")
        if not isinstance(obj["party"], str) or len(obj["party"]) != 42:
            raise ValueError("verdict party must be a 0x-prefixed 20-byte address")
        verdict = cls(unhex32(obj["run_id"], "run_id"), obj["round"], obj["party"], obj["check"],
                      unhex32(obj["evidence"], "evidence"))
        if unhex32(obj["check_id"], "check_id") != verdict.check:
            raise ValueError("verdict check_id is not keccak256 of its check")
        return verdict
