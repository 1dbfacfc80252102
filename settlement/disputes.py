"""Client of the ledger's ``Disputes`` contract (contracts/src/Disputes.sol, docs/trust.md "Disputes").

The ledger creates its disputes contract (``Ledger.disputes_address``); its owner, the deployer of
the ledger, admits each auditor key to a run after checking its evidence (``admit_auditor``,
settlement.auditors) and sets the run's threshold k. ``dispute`` sends a verdict signed by k admitted
auditors, proving the round's facts against the ledger's commitment; its refusals come back as
``TxReverted`` naming the contract's error (``DisputesWindowClosed``, ``DisputesNotAuditor``, …).
``verdicts`` and ``admissions`` read the contract's events, which is what the audit shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eth_utils import to_checksum_address

from attestation import recover_address
from attestation.report import Domain
from attestation.verdict import Verdict, disputes_domain
from storage_client import bytes32

from .artifacts import load_artifact
from .chain import Chain
from .ledger import _Contract
from .records import AuditorAdmission, RoundRecord, VerdictUpheld

__all__ = ["Disputes", "DISPUTES"]

DISPUTES = "Disputes"


class Disputes(_Contract):
    """Client of a ``Disputes`` contract.

    @param chain the account that sends (its owner to admit auditors; anyone to submit a verdict)
    @param address the contract (``Ledger.disputes_address()``)
    @param from_block where event scans start (a deployment's ``deployed_block``)
    """

    def __init__(self, chain: Chain, address: str, *, from_block: int = 0) -> None:
        super().__init__(chain, address, load_artifact(DISPUTES), from_block)

    def domain(self) -> Domain:
        """The EIP-712 domain auditors sign verdicts in: this chain and this contract."""
        return disputes_domain(self.chain.chain_id, self.address)

    def ledger_address(self) -> str:
        """The ledger whose credit this contract voids."""
        return to_checksum_address(self.chain.call(self._contract.functions.ledger()))

    def owner(self) -> str:
        return str(self.chain.call(self._contract.functions.owner()))

    def admit_auditor(self, run_id: bytes, auditor: str, measurement: bytes, evidence_digest: bytes) -> Any:
        """Admit an auditor key to a run (the owner only). Returns the receipt."""
        fn = self._contract.functions.admitAuditor(bytes32(run_id, "run_id"), to_checksum_address(auditor),
                                                   bytes32(measurement, "measurement"),
                                                   bytes32(evidence_digest, "evidence_digest"))
        return self.chain.transact(fn)

    def set_threshold(self, run_id: bytes, threshold: int) -> Any:
        """Set how many distinct admitted auditors a verdict on the run needs (the owner only)."""
        return self.chain.transact(self._contract.functions.setThreshold(bytes32(run_id, "run_id"), threshold))

    def dispute(self, verdict: Verdict, record: RoundRecord, signatures: Sequence[bytes]) -> Any:
        """Submit ``verdict`` on the round ``record`` tells (its facts prove it), signed by admitted
        auditors; signatures are sent in ascending signer order, as the contract requires.

        @raise TxReverted naming the contract's refusal
        """
        domain = self.domain()
        ordered = sorted(signatures, key=lambda sig: int(recover_address(verdict.digest(domain), sig), 16))
        index = record.workers.index(verdict.party) if verdict.party in record.workers else 0
        fn = self._contract.functions.dispute(verdict.as_abi(), record.facts(), index, [bytes(s) for s in ordered])
        return self.chain.transact(fn)

    def verdict_digest(self, verdict: Verdict) -> bytes:
        """The digest the contract computes for ``verdict`` (must equal ``verdict.digest(domain())``)."""
        return bytes(self.chain.call(self._contract.functions.verdictDigest(verdict.as_abi())))

    def is_voided(self, run_id: bytes, round_: int, worker: str) -> bool:
        fn = self._contract.functions.isVoided(bytes32(run_id, "run_id"), round_, to_checksum_address(worker))
        return bool(self.chain.call(fn))

    def is_auditor(self, run_id: bytes, auditor: str) -> bool:
        fn = self._contract.functions.isAuditor(bytes32(run_id, "run_id"), to_checksum_address(auditor))
        return bool(self.chain.call(fn))

    def panel_of(self, run_id: bytes) -> tuple[int, int]:
        """(admitted auditors, threshold k) of the run."""
        auditors, threshold = self.chain.call(self._contract.functions.panelOf(bytes32(run_id, "run_id")))
        return int(auditors), int(threshold)

    def verdicts(self, run_id: bytes) -> list[VerdictUpheld]:
        """``VerdictUpheld`` events of the run, oldest first."""
        return self._logs("VerdictUpheld", VerdictUpheld.from_event, runId=bytes32(run_id, "run_id"))

    def admissions(self, run_id: bytes) -> list[AuditorAdmission]:
        """``AuditorAdmitted`` events of the run, oldest first."""
        return self._logs("AuditorAdmitted", AuditorAdmission.from_event, runId=bytes32(run_id, "run_id"))
