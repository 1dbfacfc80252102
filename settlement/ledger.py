"""Typed clients of the two contracts: ``WorkerRegistry`` and ``ContributionLedger``.

``deploy`` puts both on a chain and returns a ``Deployment`` (saved as JSON next to a run, so the
coordinator, workers and auditors find the same addresses). ``Registry`` and ``Ledger`` wrap each
function of docs/trust.md "Contracts" with Python types: 32-byte values are ``bytes``, addresses
checksummed ``str``, reports ``attestation.report`` objects.

What they read from the chain comes back as the typed records of ``settlement.records``
(``run_of(run).last_round``). Histories come from event logs, which is what an auditor can read
from any node without trusting the coordinator: ``recorded_rounds`` even rebuilds every signed
report from the calldata of the transaction that recorded it, so the signatures can be checked
again off chain.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from eth_utils import to_checksum_address

from attestation.report import REPORT_FIELDS, Domain, ReportField, RoundReport, SignedReport
from storage_client import bytes32, strict_json, write_atomic

from .artifacts import Artifact, ledger_artifact, load_artifact, registry_artifact
from .chain import Chain, ChainError, Deployed
from .records import (
    Admission,
    Contribution,
    CreditVoided,
    Handover,
    MeasurementChange,
    Revocation,
    RoundRecord,
    RunCreated,
    RunRecord,
    Tenures,
    WorkerRecord,
)

__all__ = ["Deployment", "DeploymentError", "Ledger", "Registry", "deploy"]

_ZERO_ADDRESS = "0x0000000000000000000000000000000000000000"
_Record = TypeVar("_Record")


class DeploymentError(ValueError):
    """A deployment file that is missing or malformed."""


@dataclass(frozen=True)
class Deployment:
    """Where the contracts of one chain live.

    @param chain_id the chain they were deployed on
    @param registry the ``WorkerRegistry`` address
    @param ledger the ``ContributionLedger`` address (bound to ``registry``)
    @param owner the registry's owner (the deploying account)
    @param deployed_block the block of the registry's deployment: where log scans can start
    @param token the ERC-20 rewards are paid in (a ``RewardToken`` the owner mints, locally)
    @param rewards the ``RewardPool`` paying each run's workers from the ledger's records
    @param receipt_court the ``ReceiptCourt`` where a worker proves its coordinator's receipted omission
        (None in a deployment made before the court existed)
    """

    chain_id: int
    registry: str
    ledger: str
    owner: str
    deployed_block: int
    token: str
    rewards: str
    receipt_court: str | None = None

    def save(self, path: Path) -> None:
        """Write the deployment as JSON, atomically."""
        write_atomic(Path(path), (strict_json(asdict(self), indent=2) + "\n").encode())

    @classmethod
    def load(cls, path: Path) -> Deployment:
        """Read a deployment written by ``save``.

        @raise DeploymentError naming the file when it is missing or malformed
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise DeploymentError(f"deployment file {path} does not exist") from None
        except (OSError, ValueError) as exc:
            raise DeploymentError(f"deployment file {path} is not readable JSON: {exc}") from None
        names = {"chain_id", "registry", "ledger", "owner", "deployed_block", "token", "rewards"}
        if not isinstance(data, dict) or not names <= set(data) <= names | {"receipt_court"}:
            raise DeploymentError(f"deployment file {path} must hold exactly {sorted(names)} (and receipt_court)")
        try:
            if type(data["chain_id"]) is not int or type(data["deployed_block"]) is not int:
                raise ValueError("chain_id and deployed_block must be integers")
            return cls(chain_id=data["chain_id"], registry=to_checksum_address(data["registry"]),
                       ledger=to_checksum_address(data["ledger"]), owner=to_checksum_address(data["owner"]),
                       deployed_block=data["deployed_block"], token=to_checksum_address(data["token"]),
                       rewards=to_checksum_address(data["rewards"]),
                       receipt_court=None if data.get("receipt_court") is None
                       else to_checksum_address(data["receipt_court"]))
        except (TypeError, ValueError) as exc:
            raise DeploymentError(f"deployment file {path} is malformed: {exc}") from None


def deploy(chain: Chain) -> Deployment:
    """Deploy a ``WorkerRegistry`` owned by ``chain.address``, a ``ContributionLedger`` bound to it, a
    ``RewardToken`` it mints, a ``RewardPool`` paying in it from the ledger's records and a
    ``ReceiptCourt`` judging the ledger's rounds against their coordinators' receipts.

    The owner still has to allowlist measurements and name verifiers (``Registry``).
    """
    def deployed(artifact: Artifact, *args: Any) -> Deployed:
        return chain.deploy(artifact.abi, artifact.bytecode, *args)

    registry, block, _ = deployed(registry_artifact(), chain.address)
    ledger = deployed(ledger_artifact(), registry).address
    token = deployed(load_artifact("RewardToken"), chain.address).address
    rewards = deployed(load_artifact("RewardPool"), ledger, token).address
    court = deployed(load_artifact("ReceiptCourt"), ledger).address
    return Deployment(chain_id=chain.chain_id, registry=registry, ledger=ledger, owner=chain.address,
                      deployed_block=block, token=token, rewards=rewards, receipt_court=court)


class _Contract:
    """What both clients share: the web3 contract, struct views and event scans."""

    def __init__(self, chain: Chain, address: str, artifact: Artifact, from_block: int) -> None:
        self.chain = chain
        self.address = to_checksum_address(address)
        self.from_block = from_block
        self._abi = artifact.abi
        self._contract = chain.contract(self.address, artifact.abi)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address} on {self.chain.rpc_url})"

    def _view_struct(self, fn_name: str, *args: Any) -> dict[str, Any]:
        """A view's struct, keyed by the Solidity names of its fields (for a record's ``from_struct``)."""
        value = self.chain.call(getattr(self._contract.functions, fn_name)(*args))
        entry = next(e for e in self._abi if e.get("type") == "function" and e["name"] == fn_name)
        return {c["name"]: v for c, v in zip(entry["outputs"][0]["components"], value, strict=True)}

    def _logs(self, event: str, record: Callable[[Mapping[str, Any]], _Record], **filters: Any) -> list[_Record]:
        """Every log of ``event`` (from ``from_block``) matching indexed ``filters``, oldest first, each
        made into a record by ``record`` (a record class's ``from_event``)."""
        contract_event = getattr(self._contract.events, event)
        logs = self.chain.read(
            lambda: contract_event.get_logs(argument_filters=filters or None, from_block=self.from_block),
            f"{event} logs")
        return [record(entry) for entry in sorted(logs, key=lambda e: (e["blockNumber"], e["logIndex"]))]


class Registry(_Contract):
    """Client of a ``WorkerRegistry``.

    @param chain the account that sends (owner for measurements and verifiers, a verifier to admit)
    @param address the registry
    @param from_block where event scans start (a deployment's ``deployed_block``)
    """

    def __init__(self, chain: Chain, address: str, *, from_block: int = 0) -> None:
        super().__init__(chain, address, registry_artifact(), from_block)

    def set_measurement(self, measurement: bytes, allowed: bool = True) -> Any:
        """Allowlist a code measurement (owner only); ``allowed=False`` removes it. Returns the receipt."""
        fn = self._contract.functions.setMeasurement(bytes32(measurement, "measurement"), allowed)
        return self.chain.transact(fn)

    def set_verifier(self, verifier: str, enabled: bool = True) -> Any:
        """Enable or disable a verifier account (owner only). Returns the receipt."""
        return self.chain.transact(self._contract.functions.setVerifier(to_checksum_address(verifier), enabled))

    def admit_worker(self, worker: str, measurement: bytes, evidence_digest: bytes) -> Any:
        """Admit a worker key whose evidence was verified (verifier only). Returns the receipt."""
        fn = self._contract.functions.admitWorker(to_checksum_address(worker), bytes32(measurement, "measurement"),
                                                  bytes32(evidence_digest, "evidence_digest"))
        return self.chain.transact(fn)

    def revoke_worker(self, worker: str) -> Any:
        """Revoke a worker key for good (owner or verifier). Returns the receipt."""
        return self.chain.transact(self._contract.functions.revokeWorker(to_checksum_address(worker)))

    def owner(self) -> str:
        return str(self.chain.call(self._contract.functions.owner()))

    def is_active(self, worker: str) -> bool:
        """Admitted, not revoked, and its measurement still allowed."""
        return bool(self.chain.call(self._contract.functions.isActive(to_checksum_address(worker))))

    def is_verifier(self, account: str) -> bool:
        return bool(self.chain.call(self._contract.functions.isVerifier(to_checksum_address(account))))

    def is_measurement_allowed(self, measurement: bytes) -> bool:
        fn = self._contract.functions.isMeasurementAllowed(bytes32(measurement, "measurement"))
        return bool(self.chain.call(fn))

    def worker_of(self, worker: str) -> WorkerRecord:
        """The key's admission as the registry keeps it now (all zero if never admitted)."""
        return WorkerRecord.from_struct(self._view_struct("workerOf", to_checksum_address(worker)))

    def admissions(self, worker: str | None = None) -> list[Admission]:
        """``WorkerAdmitted`` events (of ``worker``, or of every key), oldest first."""
        filters = {"worker": to_checksum_address(worker)} if worker else {}
        return self._logs("WorkerAdmitted", Admission.from_event, **filters)

    def revocations(self, worker: str | None = None) -> list[Revocation]:
        """``WorkerRevoked`` events (of ``worker``, or of every key), oldest first."""
        filters = {"worker": to_checksum_address(worker)} if worker else {}
        return self._logs("WorkerRevoked", Revocation.from_event, **filters)

    def measurement_changes(self) -> list[MeasurementChange]:
        """``MeasurementSet`` events, oldest first: every allowlisting and removal of a measurement."""
        return self._logs("MeasurementSet", MeasurementChange.from_event)


# What a round's reports share (``RoundHeader``) and what each adds (``WorkerReport``): the ledger
# takes the shared fields once per call and rebuilds each signed ``RoundReport`` from the two.
_HEADER_FIELDS = tuple(f for f in REPORT_FIELDS if f.shared)
_WORKER_FIELDS = tuple(f for f in REPORT_FIELDS if not f.shared)


@dataclass(frozen=True)
class RoundHeader:
    """``IContributionLedger.RoundHeader``: the fields every report of a round shares."""

    run_id: bytes
    round: int
    parent_checkpoint: bytes
    checkpoint: bytes
    manifest_digest: bytes
    eval_loss_e6: int = 0
    tokens: int = 0
    inner_steps: int = 0

    def as_abi(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in _HEADER_FIELDS)

    @classmethod
    def of(cls, reports: Sequence[SignedReport], run_id: bytes, round: int, parent: bytes, checkpoint: bytes,
           manifest_digest: bytes) -> RoundHeader:
        """The header of a recording call: the round's own fields, and what its reports share (which
        must agree with them and with each other)."""
        header = cls(run_id, round, parent, checkpoint, manifest_digest)
        if reports:
            first = reports[0].report
            header = cls(run_id, round, parent, checkpoint, manifest_digest, first.eval_loss_e6, first.tokens,
                         first.inner_steps)
        for signed in reports:
            report = signed.report
            differing = [f.name for f in _HEADER_FIELDS if getattr(report, f.name) != getattr(header, f.name)]
            if differing:
                raise ValueError(f"the report of {report.worker} differs from round {round}'s other reports or "
                                 f"the recording call in {', '.join(differing)}")
        return header


def _worker_tuple(signed: SignedReport) -> tuple[Any, ...]:
    return (*(getattr(signed.report, f.name) for f in _WORKER_FIELDS), bytes(signed.signature))


def _field(value: Sequence[Any] | dict[str, Any], name: str, index: int) -> Any:
    return value[name] if isinstance(value, dict) else value[index]


def _signed_from_abi(header: Sequence[Any] | dict[str, Any], part: Sequence[Any] | dict[str, Any]) -> SignedReport:
    """The ``SignedReport`` a worker signed, rebuilt from a recording call's decoded header and one of
    its worker parts (web3 gives structs as dicts keyed by field name)."""
    values = {f.name: _field(header, f.solidity, i) for i, f in enumerate(_HEADER_FIELDS)}
    values |= {f.name: _field(part, f.solidity, i) for i, f in enumerate(_WORKER_FIELDS)}
    report = RoundReport(**{f.name: _abi_value(f, values[f.name]) for f in REPORT_FIELDS})
    signature = part["signature"] if isinstance(part, dict) else part[len(_WORKER_FIELDS)]
    return SignedReport(report, bytes(signature))


def _abi_value(field: ReportField, value: Any) -> Any:
    if field.abi_type == "bytes32":
        return bytes(value)
    return value if field.abi_type == "address" else int(value)


class Ledger(_Contract):
    """Client of a ``ContributionLedger``.

    @param chain the account that sends (a run's coordinator for ``record_round``)
    @param address the ledger
    @param from_block where event scans start (a deployment's ``deployed_block``)
    """

    def __init__(self, chain: Chain, address: str, *, from_block: int = 0) -> None:
        super().__init__(chain, address, ledger_artifact(), from_block)

    def domain(self) -> Domain:
        """The EIP-712 domain workers sign reports in: this chain and this ledger."""
        return Domain(self.chain.chain_id, self.address)

    def registry_address(self) -> str:
        return str(self.chain.call(self._contract.functions.registry()))

    def disputes_address(self) -> str | None:
        """The disputes contract this ledger created and takes voided credit from; None if it names none."""
        address = str(self.chain.call(self._contract.functions.disputes()))
        return None if int(address, 16) == 0 else to_checksum_address(address)

    def voided_credits(self, run_id: bytes | None = None) -> list[CreditVoided]:
        """``CreditVoided`` events (of one run, or of every run), oldest first: credit an upheld verdict
        took off the tallies."""
        filters = {} if run_id is None else {"runId": bytes32(run_id, "run_id")}
        return self._logs("CreditVoided", CreditVoided.from_event, **filters)

    def create_run(self, run_id: bytes, genesis_checkpoint: bytes, config_digest: bytes,
                   genesis_manifest: bytes, challenge_window: int = 0) -> Any:
        """Create a run; this account becomes its coordinator. ``challenge_window``: blocks a recorded
        round waits before rewards for it can be claimed. Returns the receipt."""
        if type(challenge_window) is not int or not 0 <= challenge_window < 2**32:
            raise ValueError(f"challenge_window must be a uint32, got {challenge_window!r}")
        fn = self._contract.functions.createRun(
            bytes32(run_id, "run_id"), bytes32(genesis_checkpoint, "genesis_checkpoint"),
            bytes32(config_digest, "config_digest"), bytes32(genesis_manifest, "genesis_manifest"),
            challenge_window)
        return self.chain.transact(fn)

    def hand_over(self, run_id: bytes, new_coordinator: str) -> Any:
        """Hand the run to ``new_coordinator`` (this account must be the run's creator), who records
        its rounds from the next one on. Returns the receipt.

        @raise TxReverted with the ledger's refusal, e.g. ``LedgerNotCreator(caller=…)``
        """
        fn = self._contract.functions.handOver(bytes32(run_id, "run_id"), to_checksum_address(new_coordinator))
        return self.chain.transact(fn)

    def vote_coordinator(self, run_id: bytes, candidate: str) -> Any:
        """This account's vote (a worker credited in the run's last recorded round) for ``candidate``
        as the coordinator of a stalled run. Returns the receipt.

        @raise TxReverted with the ledger's refusal, e.g. ``LedgerNotStalled(stalledFrom=…)``
        """
        fn = self._contract.functions.voteCoordinator(bytes32(run_id, "run_id"), to_checksum_address(candidate))
        return self.chain.transact(fn)

    def creator_of(self, run_id: bytes) -> str | None:
        """The account that created the run and may hand it over; None when no such run exists."""
        address = str(self.chain.call(self._contract.functions.creatorOf(bytes32(run_id, "run_id"))))
        return None if int(address, 16) == 0 else to_checksum_address(address)

    def coordinator_of(self, run_id: bytes, round: int) -> str | None:
        """The coordinator that held ``round`` (recorded it, or holds the run now if it is not recorded
        yet): whose receipts and verdicts about the round count. None when no such run exists."""
        address = str(self.chain.call(self._contract.functions.coordinatorOf(bytes32(run_id, "run_id"), round)))
        return None if int(address, 16) == 0 else to_checksum_address(address)

    def handovers(self, run_id: bytes) -> list[Handover]:
        """``CoordinatorHandedOver`` events of a run, oldest first: who held it from which round on."""
        return self._logs("CoordinatorHandedOver", Handover.from_event, runId=bytes32(run_id, "run_id"))

    def tenures(self, run_id: bytes, run: RunRecord) -> Tenures:
        """Who held each round of the run, from its ``CoordinatorHandedOver`` logs and its coordinator
        now (``run``: ``run_of(run_id)``), not from the ledger's own ``coordinatorOf``.

        @raise ValueError when the logs and the run do not chain (``Tenures.of``)
        """
        return Tenures.of(run.coordinator, self.handovers(run_id))

    def record_round(self, run_id: bytes, round: int, parent: bytes, checkpoint: bytes, manifest_digest: bytes,
                     reports: Sequence[SignedReport], unreported: Sequence[bytes] = ()) -> Any:
        """Record the run's next round. Returns the receipt.

        @param reports the signed reports of the participants that reported (their workers are credited)
        @param unreported the update digests of the participants that did not, on this account's word
            (sorted here; nobody is credited for them)
        @raise TxReverted with the ledger's refusal, e.g. ``LedgerWrongParent(expected=…, got=…)``
        """
        header = RoundHeader.of(reports, bytes32(run_id, "run_id"), round, bytes32(parent, "parent"),
                                bytes32(checkpoint, "checkpoint"), bytes32(manifest_digest, "manifest_digest"))
        # The ledger takes reports in strictly ascending worker order (so none is credited twice).
        ordered = sorted(reports, key=lambda s: int(s.report.worker, 16))
        vouched = sorted(bytes32(u, "unreported update") for u in unreported)
        fn = self._contract.functions.recordRound(header.as_abi(), [_worker_tuple(s) for s in ordered], vouched)
        return self.chain.transact(fn)

    def head_block(self) -> int:
        """The chain's latest block number (a round recorded in block b is at depth head − b + 1)."""
        return int(self.chain.read(lambda: self.chain.w3.eth.block_number, "eth_blockNumber"))

    def run_of(self, run_id: bytes) -> RunRecord | None:
        """The run as the ledger keeps it now, or None when no such run exists."""
        run = RunRecord.from_struct(self._view_struct("runOf", bytes32(run_id, "run_id")))
        return None if run.coordinator == _ZERO_ADDRESS else run

    def round_of(self, run_id: bytes, round: int) -> RoundRecord | None:
        """A recorded round as its ``RoundRecorded`` event tells it (the newest such event; no calldata
        is read), or None when the round is not recorded."""
        events = self._logs("RoundRecorded", RoundRecord.from_event, runId=bytes32(run_id, "run_id"), round=round)
        return events[-1] if events else None

    def round_commitment(self, run_id: bytes, round: int) -> bytes:
        """What the ledger keeps of a recorded round: the hash of its facts (``RoundRecord.facts_commitment``;
        zero if not recorded)."""
        return bytes(self.chain.call(self._contract.functions.roundCommitment(bytes32(run_id, "run_id"), round)))

    def contribution_of(self, run_id: bytes, worker: str) -> Contribution:
        """The tokens and rounds credited to ``worker`` in one run."""
        struct = self._view_struct("contributionOf", bytes32(run_id, "run_id"), to_checksum_address(worker))
        return Contribution.from_struct(struct)

    def total_contribution_of(self, worker: str) -> Contribution:
        """The tokens and rounds credited to ``worker`` over all runs."""
        return Contribution.from_struct(self._view_struct("totalContributionOf", to_checksum_address(worker)))

    def runs_of(self, worker: str) -> list[bytes]:
        """The runs ``worker`` has been credited in, in the order of its first credit in each."""
        return [bytes(r) for r in self.chain.call(self._contract.functions.runsOf(to_checksum_address(worker)))]

    def report_digest(self, report: RoundReport) -> bytes:
        """The EIP-712 digest the ledger computes for ``report`` (must equal ``report.digest(domain)``)."""
        return bytes(self.chain.call(self._contract.functions.reportDigest(report.as_abi())))

    def runs_created(self) -> list[RunCreated]:
        """``RunCreated`` events, oldest first."""
        return self._logs("RunCreated", RunCreated.from_event)

    def recorded_round_events(self, run_id: bytes) -> list[RoundRecord]:
        """``RoundRecorded`` events of a run, oldest first, without reading any calldata."""
        return self._logs("RoundRecorded", RoundRecord.from_event, runId=bytes32(run_id, "run_id"))

    def recorded_rounds(self, run_id: bytes) -> list[RoundRecord]:
        """Every recorded round of a run, oldest first, with what the transaction that recorded it says
        (``RoundRecord.with_call``): its sender, and from its calldata the parent checkpoint, the
        reports (each ``SignedReport`` exactly as its worker signed it) and the unreported update
        digests (recorded on the coordinator's word, without a report).

        @raise ChainError when a round was not recorded by a direct ``recordRound`` call to this
            ledger (its calldata then cannot be decoded), or the calldata disagrees with the event
        """
        rounds = []
        for event in self.recorded_round_events(run_id):
            tx = self.chain.read(lambda h=event.tx_hash: self.chain.w3.eth.get_transaction(h), "get transaction")
            if tx["to"] is None or to_checksum_address(tx["to"]) != self.address:
                raise ChainError(f"round {event.round} was recorded by tx {event.tx_hash}, which does not "
                                 f"call the ledger directly; its reports cannot be read from the calldata")
            fn, params = self._contract.decode_function_input(tx["input"])
            header = params.get("header") if fn.fn_name == "recordRound" else None
            if header is None or bytes(_field(header, "runId", 0)) != event.run_id \
                    or int(_field(header, "round", 1)) != event.round:
                raise ChainError(f"tx {event.tx_hash} does not hold the recordRound call of round {event.round}")
            rounds.append(event.with_call(
                sender=tx["from"], parent_checkpoint=_field(header, "parentCheckpoint", 2),
                reports=[_signed_from_abi(header, part) for part in params["reports"]],
                unreported=params["unreported"]))
        return rounds
