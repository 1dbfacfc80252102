"""What the contracts' clients read from the chain, as typed records.

Every record is a frozen dataclass with snake_case fields: a ``bytes32`` is ``bytes``, an integer
``int``, an address a checksummed ``str``, an array a ``tuple``. Each is built in one place, from
the web3 value it stands for (``from_struct`` for a view's struct, ``from_event`` for an event log),
which checks the type of every field; nothing past these classmethods reads web3's dicts.

Views: what a contract keeps now.

    WorkerRecord       ``WorkerRegistry.workerOf``: a worker key's admission (all zero if never
                       admitted)
    RunRecord          ``ContributionLedger.runOf``: a run's coordinator, last round and genesis
    Contribution       ``ContributionLedger.contributionOf`` (one run) and ``totalContributionOf``
                       (all runs): the tokens and rounds credited to a worker
    Pool               ``RewardPool.poolOf``: a run's reward pool

Events: the histories, from logs any node serves. Each also says where it was emitted: ``block``,
``tx_hash`` (0x-hex) and ``log_index``.

    Admission          ``WorkerAdmitted``: a verifier admitted a worker key
    Revocation         ``WorkerRevoked``: a worker key was revoked
    MeasurementChange  ``MeasurementSet``: a code measurement was allowlisted, or removed
    RunCreated         ``RunCreated``: a run was created on the ledger
    Handover           ``CoordinatorHandedOver``: a run changed coordinator (by its creator, or by
                       its workers' vote), from a round on

Derived: ``Tenures``, who held each round of a run (its coordinator now and its handovers), what
receipts, recording calls and verdicts about a round are judged against.
    RoundRecord        ``RoundRecorded``: a round was recorded; read by ``Ledger.recorded_rounds``,
                       also what the recording transaction says (``with_call``: its sender, and from
                       its calldata the parent checkpoint, the signed reports and the unreported
                       updates). ``facts`` and ``facts_commitment`` are what the ledger's
                       commitment of the round hashes, and what a reward claim proves
    Payment            ``RewardPaid``: the reward pool paid a worker for a round
    Reclaim            ``RoundReclaimed``: the pool returned what a round left unpaid to its funder
    CreditVoided       ``CreditVoided``: an upheld verdict took a worker's credit for a round off the
                       ledger's tallies
    AuditorAdmission   ``AuditorAdmitted``: the disputes contract's owner admitted an auditor key to a run
    VerdictUpheld      ``VerdictUpheld``: k admitted auditors' verdict against a party of a round held
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from eth_abi import encode
from eth_utils import is_address, keccak, to_checksum_address

from attestation.report import SignedReport
from storage_client import bytes32

__all__ = ["Admission", "AuditorAdmission", "Contribution", "CreditVoided", "Handover", "MeasurementChange", "Payment", "Pool",
           "Reclaim", "Revocation", "RoundRecord", "RunCreated", "RunRecord", "Tenures", "VerdictUpheld", "WorkerRecord"]

# IContributionLedger.RoundFacts, as abi.encode sees it.
_ROUND_FACTS_ABI = "(bytes32,bytes32,uint64,uint64,uint64,address[])"


def _bytes32s(name: str, values: Any) -> tuple[bytes, ...]:
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be an array, got {type(values).__name__}")
    return tuple(bytes32(v, f"{name}[{i}]") for i, v in enumerate(values))


def _uint(name: str, value: Any) -> int:
    if type(value) is bool or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an unsigned integer, got {value!r}")
    return int(value)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def _address(name: str, value: Any) -> str:
    if not isinstance(value, str) or not is_address(value):
        raise ValueError(f"{name} must be an address, got {value!r}")
    return to_checksum_address(value)


def _addresses(name: str, values: Any) -> tuple[str, ...]:
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be an array, got {type(values).__name__}")
    return tuple(_address(f"{name}[{i}]", v) for i, v in enumerate(values))


@dataclass(frozen=True, kw_only=True)
class WorkerRecord:
    """``WorkerRegistry.workerOf(worker)``: the key's admission as the registry keeps it now (every
    field zero when it was never admitted; ``revoked_at`` zero while it is not revoked)."""

    measurement: bytes
    evidence_digest: bytes
    verifier: str
    admitted_at: int
    revoked_at: int

    @classmethod
    def from_struct(cls, struct: Mapping[str, Any]) -> WorkerRecord:
        """From the view's struct, keyed by its Solidity field names."""
        return cls(measurement=bytes32(struct["measurement"], "measurement"),
                   evidence_digest=bytes32(struct["evidenceDigest"], "evidenceDigest"),
                   verifier=_address("verifier", struct["verifier"]),
                   admitted_at=_uint("admittedAt", struct["admittedAt"]),
                   revoked_at=_uint("revokedAt", struct["revokedAt"]))


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """``ContributionLedger.runOf(runId)``: a run as the ledger keeps it now (its coordinator zero
    when there is no such run)."""

    coordinator: str
    last_round: int
    challenge_window: int  # blocks a recorded round waits before rewards for it can be claimed
    last_checkpoint: bytes
    genesis_checkpoint: bytes
    config_digest: bytes
    genesis_manifest: bytes

    @classmethod
    def from_struct(cls, struct: Mapping[str, Any]) -> RunRecord:
        """From the view's struct, keyed by its Solidity field names."""
        return cls(coordinator=_address("coordinator", struct["coordinator"]),
                   last_round=_uint("lastRound", struct["lastRound"]),
                   challenge_window=_uint("challengeWindow", struct["challengeWindow"]),
                   last_checkpoint=bytes32(struct["lastCheckpoint"], "lastCheckpoint"),
                   genesis_checkpoint=bytes32(struct["genesisCheckpoint"], "genesisCheckpoint"),
                   config_digest=bytes32(struct["configDigest"], "configDigest"),
                   genesis_manifest=bytes32(struct["genesisManifest"], "genesisManifest"))


@dataclass(frozen=True, kw_only=True)
class Contribution:
    """What the ledger credits a worker with (``contributionOf`` in one run, ``totalContributionOf``
    over all runs): the tokens of its reports and the number of rounds it reported in."""

    tokens: int
    rounds: int

    @classmethod
    def from_struct(cls, struct: Mapping[str, Any]) -> Contribution:
        """From the view's struct, keyed by its Solidity field names."""
        return cls(tokens=_uint("tokens", struct["tokens"]), rounds=_uint("rounds", struct["rounds"]))


@dataclass(frozen=True, kw_only=True)
class Pool:
    """``RewardPool.poolOf(runId)``: a run's reward pool (``funded`` zero when it has none). Amounts
    in the token's smallest unit."""

    funder: str
    total_rounds: int  # the rounds 1..total_rounds it pays for, ⌊funded / total_rounds⌋ each
    funded: int
    paid: int

    @classmethod
    def from_struct(cls, struct: Mapping[str, Any]) -> Pool:
        """From the view's struct, keyed by its Solidity field names."""
        return cls(funder=_address("funder", struct["funder"]),
                   total_rounds=_uint("totalRounds", struct["totalRounds"]),
                   funded=_uint("funded", struct["funded"]), paid=_uint("paid", struct["paid"]))


@dataclass(frozen=True, kw_only=True)
class _Event:
    """Where an event was emitted: its block, its transaction (0x-hex) and its index in the block."""

    block: int
    tx_hash: str
    log_index: int


def _where(log: Mapping[str, Any]) -> dict[str, Any]:
    """An event log's position, as ``_Event``'s fields."""
    return {"block": _uint("blockNumber", log["blockNumber"]),
            "tx_hash": "0x" + bytes32(log["transactionHash"], "transactionHash").hex(),
            "log_index": _uint("logIndex", log["logIndex"])}


@dataclass(frozen=True, kw_only=True)
class Admission(_Event):
    """A ``WorkerAdmitted`` event: ``verifier`` admitted ``worker``'s key, attested to run code of
    ``measurement``, on the evidence whose admission record is ``CID(JSON, evidence_digest)``."""

    worker: str
    measurement: bytes
    evidence_digest: bytes
    verifier: str

    @classmethod
    def from_event(cls, log: Mapping[str, Any]) -> Admission:
        """From a web3 event log (its ``args`` keyed by the event's Solidity names)."""
        args = log["args"]
        return cls(worker=_address("worker", args["worker"]), measurement=bytes32(args["measurement"], "measurement"),
                   evidence_digest=bytes32(args["evidenceDigest"], "evidenceDigest"),
                   verifier=_address("verifier", args["verifier"]), **_where(log))


@dataclass(frozen=True, kw_only=True)
class Revocation(_Event):
    """A ``WorkerRevoked`` event: ``by`` (the owner or a verifier) revoked ``worker``'s key for good."""

    worker: str
    by: str

    @classmethod
    def from_event(cls, log: Mapping[str, Any]) -> Revocation:
        """From a web3 event log (its ``args`` keyed by the event's Solidity names)."""
        args = log["args"]
        return cls(worker=_address("worker", args["worker"]), by=_address("by", args["by"]), **_where(log))


@dataclass(frozen=True, kw_only=True)
class MeasurementChange(_Event):
    """A ``MeasurementSet`` event: the registry's owner allowlisted a code measurement, or removed it."""

    measurement: bytes
    allowed: bool

    @classmethod
    def from_event(cls, log: Mapping[str, Any]) -> MeasurementChange:
        """From a web3 event log (its ``args`` keyed by the event's Solidity names)."""
        args = log["args"]
        return cls(measurement=bytes32(args["measurement"], "measurement"),
                   allowed=_bool("allowed", args["allowed"]), **_where(log))


@dataclass(frozen=True, kw_only=True)
class RunCreated(_Event):
    """A ``RunCreated`` event: ``coordinator`` created run ``run_id`` (the digest of its genesis
    manifest) from its genesis checkpoint and config."""

    run_id: bytes
    coordinator: str
    genesis_checkpoint: bytes
    config_digest: bytes
    genesis_manifest: bytes
    challenge_window: int

    @classmethod
    def from_event(cls, log: Mapping[str, Any]) -> RunCreated:
        """From a web3 event log (its ``args`` keyed by the event's Solidity names)."""
        args = log["args"]
        return cls(run_id=bytes32(args["runId"], "runId"), coordinator=_address("coordinator", args["coordinator"]),
                   genesis_checkpoint=bytes32(args["genesisCheckpoint"], "genesisCheckpoint"),
                   config_digest=bytes32(args["configDigest"], "configDigest"),
                   genesis_manifest=bytes32(args["genesisManifest"], "genesisManifest"),
                   challenge_window=_uint("challengeWindow", args["challengeWindow"]), **_where(log))


@dataclass(frozen=True, kw_only=True)
class Handover(_Event):
    """A ``CoordinatorHandedOver`` event: run ``run_id`` passed from ``previous`` to ``next``, who
    records its rounds from ``from_round`` on; ``by_vote`` when its workers voted ``next`` in, not
    its creator."""

    run_id: bytes
    previous: str
    next: str
    from_round: int
    by_vote: bool

    @classmethod
    def from_event(cls, log: Mapping[str, Any]) -> Handover:
        """From a web3 event log (its ``args`` keyed by the event's Solidity names)."""
        args = log["args"]
        if type(args["byVote"]) is not bool:
            raise ValueError(f"byVote must be a bool, got {type(args['byVote']).__name__}")
        return cls(run_id=bytes32(args["runId"], "runId"), previous=_address("previous", args["previous"]),
                   next=_address("next", args["next"]), from_round=_uint("fromRound", args["fromRound"]),
                   by_vote=args["byVote"], **_where(log))


@dataclass(frozen=True)
class Tenures:
    """Who held each round of a run: ``(from_round, coordinator)`` in ascending rounds, the first from
    round 1. A round is held by the last tenure that starts at or before it (round 0, the genesis,
    by the first); a run that never changed hands has one tenure."""

    tenures: tuple[tuple[int, str], ...]

    @classmethod
    def of(cls, coordinator_now: str, handovers: Sequence[Handover]) -> Tenures:
        """From the run's coordinator now (``RunRecord.coordinator``) and its handovers, oldest first.

        @raise ValueError when they do not chain: a handover from someone other than the holder
            before it, rounds going back, or a last holder other than the coordinator now
        """
        if not handovers:
            return cls(((1, coordinator_now),))
        tenures = [(1, handovers[0].previous)]
        for handover in handovers:
            holder_from, holder = tenures[-1]
            if handover.previous != holder or handover.from_round < holder_from:
                raise ValueError(f"the handover to {handover.next} from round {handover.from_round} names "
                                 f"{handover.previous} as the coordinator before it, but {holder} held the run "
                                 f"from round {holder_from}")
            if handover.from_round == holder_from:
                tenures[-1] = (holder_from, handover.next)  # handed on again before it recorded a round
            else:
                tenures.append((handover.from_round, handover.next))
        if tenures[-1][1] != coordinator_now:
            raise ValueError(f"the run's handovers end with {tenures[-1][1]}, but its coordinator now is "
                             f"{coordinator_now}")
        return cls(tuple(tenures))

    @classmethod
    def coerce(cls, holders: Tenures | str) -> Tenures:
        """``holders`` as tenures: a single address is a run that never changed hands."""
        return holders if isinstance(holders, Tenures) else cls(((1, holders),))

    def at(self, round_: int) -> str:
        """The coordinator that held ``round_``."""
        holder = self.tenures[0][1]
        for from_round, coordinator in self.tenures:
            if from_round <= round_:
                holder = coordinator
        return holder

    @property
    def coordinators(self) -> frozenset[str]:
        """Every coordinator the run has had."""
        return frozenset(coordinator for _, coordinator in self.tenures)


@dataclass(frozen=True, kw_only=True)
class RoundRecord(_Event):
    """A ``RoundRecorded`` event: round ``round`` of run ``run_id`` was recorded in ``block``, with
    its checkpoint and manifest, crediting ``workers`` (the signers of its reports, in ascending
    order) with ``tokens`` each, with ``unreported_count`` updates counted on the coordinator's word,
    and ``commitment`` the hash of its facts that the ledger keeps.

    The last four fields are what the recording transaction says (``with_call``, as
    ``Ledger.recorded_rounds`` reads it): its ``sender``, and from its calldata the round's
    ``parent_checkpoint``, the ``reports`` exactly as their workers signed them and the
    ``unreported`` update digests. Read from the event alone, ``sender`` and ``parent_checkpoint``
    are None and ``reports`` and ``unreported`` empty.
    """

    run_id: bytes
    round: int
    checkpoint: bytes
    manifest_digest: bytes
    tokens: int
    workers: tuple[str, ...]
    unreported_count: int
    commitment: bytes
    sender: str | None = None
    parent_checkpoint: bytes | None = None
    reports: tuple[SignedReport, ...] = ()
    unreported: tuple[bytes, ...] = ()

    @classmethod
    def from_event(cls, log: Mapping[str, Any]) -> RoundRecord:
        """From a web3 event log (its ``args`` keyed by the event's Solidity names)."""
        args = log["args"]
        return cls(run_id=bytes32(args["runId"], "runId"), round=_uint("round", args["round"]),
                   checkpoint=bytes32(args["checkpoint"], "checkpoint"),
                   manifest_digest=bytes32(args["manifestDigest"], "manifestDigest"),
                   tokens=_uint("tokens", args["tokens"]), workers=_addresses("workers", args["workers"]),
                   unreported_count=_uint("unreportedCount", args["unreportedCount"]),
                   commitment=bytes32(args["commitment"], "commitment"), **_where(log))

    def with_call(self, *, sender: Any, parent_checkpoint: Any, reports: Sequence[SignedReport],
                  unreported: Any) -> RoundRecord:
        """This round with what its recording transaction says: the account that sent it, and the
        parent checkpoint, signed reports and unreported update digests its ``recordRound`` call carried."""
        if not all(isinstance(signed, SignedReport) for signed in reports):
            raise ValueError("reports must be SignedReports")
        return replace(self, sender=_address("sender", sender),
                       parent_checkpoint=bytes32(parent_checkpoint, "parentCheckpoint"), reports=tuple(reports),
                       unreported=_bytes32s("unreported", unreported))

    @property
    def report_count(self) -> int:
        """How many reports recorded the round: one per credited worker."""
        return len(self.workers)

    def facts(self) -> tuple[bytes, bytes, int, int, int, list[str]]:
        """``IContributionLedger.RoundFacts`` of the round, in the struct's order: what its commitment
        hashes and a reward claim proves."""
        return (self.checkpoint, self.manifest_digest, self.tokens, self.block, self.unreported_count,
                list(self.workers))

    def facts_commitment(self) -> bytes:
        """keccak256(abi.encode(RoundFacts)) of what this record says: what the ledger keeps of the
        round (its ``roundCommitment``) when the record is true."""
        return keccak(encode([_ROUND_FACTS_ABI], [self.facts()]))


@dataclass(frozen=True, kw_only=True)
class Payment(_Event):
    """A ``RewardPaid`` event: the reward pool paid ``worker`` ``amount`` (the token's smallest unit)
    for round ``round`` of run ``run_id``."""

    run_id: bytes
    worker: str
    round: int
    amount: int

    @classmethod
    def from_event(cls, log: Mapping[str, Any]) -> Payment:
        """From a web3 event log (its ``args`` keyed by the event's Solidity names)."""
        args = log["args"]
        return cls(run_id=bytes32(args["runId"], "runId"), worker=_address("worker", args["worker"]),
                   round=_uint("round", args["round"]), amount=_uint("amount", args["amount"]), **_where(log))


@dataclass(frozen=True, kw_only=True)
class Reclaim(_Event):
    """A ``RoundReclaimed`` event: the pool returned ``amount`` of round ``round`` to the run's funder."""

    run_id: bytes
    round: int
    amount: int

    @classmethod
    def from_event(cls, log: Mapping[str, Any]) -> Reclaim:
        args = log["args"]
        return cls(run_id=bytes32(args["runId"], "runId"), round=_uint("round", args["round"]),
                   amount=_uint("amount", args["amount"]), **_where(log))


@dataclass(frozen=True, kw_only=True)
class CreditVoided(_Event):
    """A ``CreditVoided`` event of the ledger: ``worker``'s ``tokens`` for ``round`` left its tallies."""

    run_id: bytes
    round: int
    worker: str
    tokens: int

    @classmethod
    def from_event(cls, log: Mapping[str, Any]) -> CreditVoided:
        args = log["args"]
        return cls(run_id=bytes32(args["runId"], "runId"), round=_uint("round", args["round"]),
                   worker=_address("worker", args["worker"]), tokens=_uint("tokens", args["tokens"]), **_where(log))


@dataclass(frozen=True, kw_only=True)
class AuditorAdmission(_Event):
    """An ``AuditorAdmitted`` event: ``auditor``'s key may sign verdicts on ``run_id``; its admission
    record is ``CID(JSON, evidence_digest)``."""

    run_id: bytes
    auditor: str
    measurement: bytes
    evidence_digest: bytes

    @classmethod
    def from_event(cls, log: Mapping[str, Any]) -> AuditorAdmission:
        args = log["args"]
        return cls(run_id=bytes32(args["runId"], "runId"), auditor=_address("auditor", args["auditor"]),
                   measurement=bytes32(args["measurement"], "measurement"),
                   evidence_digest=bytes32(args["evidenceDigest"], "evidenceDigest"), **_where(log))


@dataclass(frozen=True, kw_only=True)
class VerdictUpheld(_Event):
    """A ``VerdictUpheld`` event: ``signers`` (admitted auditors) found ``party`` failed the check whose
    id is ``check`` in ``round``, having read ``evidence``."""

    run_id: bytes
    round: int
    party: str
    check: bytes
    evidence: bytes
    signers: tuple[str, ...]

    @classmethod
    def from_event(cls, log: Mapping[str, Any]) -> VerdictUpheld:
        args = log["args"]
        return cls(run_id=bytes32(args["runId"], "runId"), round=_uint("round", args["round"]),
                   party=_address("party", args["party"]), check=bytes32(args["check"], "check"),
                   evidence=bytes32(args["evidence"], "evidence"), signers=_addresses("signers", args["signers"]),
                   **_where(log))
