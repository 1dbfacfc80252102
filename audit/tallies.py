"""The ledger's books: its records of the rounds, and the credits and payouts they add up to.

Checks ``rounds`` (1..lastRound, each once, in order), and for each recorded round
``parent-checkpoint`` (its parent is the previous round's checkpoint on chain), ``report-count``
(the credited workers are the call's report signers), ``ledger`` (the stored commitment is the
event's and the hash of the recorded facts) and ``recorder`` (the run's coordinator sent it); then
``tally`` and ``total-contribution`` (the ledger's views against its events, less the credit upheld
verdicts voided: its ``CreditVoided`` events) and, with the deployment's reward pool, ``payout``
(settlement.rewards.statement: voided credit earns nothing, and what the funder reclaimed is neither
paid nor owed).
"""

from __future__ import annotations

from collections import defaultdict

from settlement import ChainError, Ledger
from settlement.records import Contribution, RoundRecord
from settlement.rewards import RewardPool
from storage_client import hex_or_none

from .checks import AuditCheck
from .findings import Findings


class Tallies:
    """Checks what the ledger (and its reward pool, when there is one) keeps of a run."""

    def __init__(self, findings: Findings, ledger: Ledger, rewards: RewardPool | None) -> None:
        self.findings = findings
        self.ledger = ledger
        self.rewards = rewards

    def check_rounds(self, last: int, rounds: list[RoundRecord]) -> None:
        """The ledger's RoundRecorded events are for rounds 1..``last`` (its lastRound), in order."""
        numbers = [rec.round for rec in rounds]
        if numbers != list(range(1, last + 1)):
            self.findings.fail(None, self.ledger.address, AuditCheck.ROUNDS,
                               f"the ledger's lastRound is {last}, but its RoundRecorded events are for rounds "
                               f"{numbers}")

    def check_record(self, run_id: bytes, record: RoundRecord, parent_checkpoint: bytes, coordinator: str) -> None:
        """A round's record on chain (with its recording call): chained to the previous round's
        checkpoint, crediting the reports' signers, committed as recorded, and sent by the run's
        ``coordinator`` (as runOf says it)."""
        fail = self.findings.fail
        r = record.round
        where = f"round {r} on chain"
        if record.parent_checkpoint != parent_checkpoint:
            fail(r, where, AuditCheck.PARENT_CHECKPOINT,
                 f"the ledger recorded parent {hex_or_none(record.parent_checkpoint)}, but the previous "
                 f"round's checkpoint on chain is 0x{parent_checkpoint.hex()}")
        credited = list(record.workers)
        signers = [signed.report.worker for signed in record.reports]
        if credited != signers or record.unreported_count != len(record.unreported):
            fail(r, where, AuditCheck.REPORT_COUNT,
                 f"RoundRecorded credits {len(credited)} worker(s) and says {record.unreported_count} "
                 f"unreported update(s); the recording call carried reports of {len(signers)} and "
                 f"{len(record.unreported)} unreported" + ("" if len(credited) != len(signers) else
                                                           ": the credited workers are not the reports' signers"))
        stored = self.ledger.round_commitment(run_id, r)
        derived = record.facts_commitment()
        if stored != record.commitment or stored != derived:
            fail(r, where, AuditCheck.LEDGER,
                 f"the ledger keeps commitment 0x{stored.hex()} for the round, its RoundRecorded event says "
                 f"0x{record.commitment.hex()}, and the recorded facts hash to "
                 f"0x{derived.hex()} (the round was overwritten, or the ledger is not what it claims)")
        if record.sender != coordinator:
            fail(r, where, AuditCheck.RECORDER,
                 f"round {r} was recorded by {record.sender} (tx {record.tx_hash}), not by the run's "
                 f"coordinator {coordinator}")

    def check_tallies(self, run_id: bytes, rounds: list[RoundRecord]) -> None:
        """``contributionOf(run, worker)`` equals the run's recorded reports of that worker, and
        ``totalContributionOf(worker)`` the worker's credits over every run on this ledger (summed from
        each run's RoundRecorded events: the tokens each round credits each of its workers)."""
        tokens: dict[str, int] = defaultdict(int)
        counted: dict[str, int] = defaultdict(int)
        for record in rounds:
            for signed in record.reports:
                tokens[signed.report.worker] += signed.report.tokens
                counted[signed.report.worker] += 1
        for voided in self.ledger.voided_credits(run_id):
            tokens[voided.worker] -= voided.tokens
            counted[voided.worker] -= 1
        workers = set(tokens) | {w for record in rounds for w in record.workers}
        tallies = self.findings.result.tallies
        for worker in sorted(workers):
            got = self.ledger.contribution_of(run_id, worker)
            want = Contribution(tokens=tokens.get(worker, 0), rounds=counted.get(worker, 0))
            tallies[worker] = {"tokens": want.tokens, "rounds": want.rounds}
            if got != want:
                self.findings.fail(None, worker, AuditCheck.TALLY,
                                   f"the ledger credits {worker} with {got.tokens} tokens over {got.rounds} "
                                   f"round(s); its recorded reports, less voided credit, sum to {want.tokens} "
                                   f"tokens over {want.rounds} round(s)")
        if not workers:
            return
        try:
            totals = self._totals_over_runs()
        except ChainError as exc:
            self.findings.fail(None, self.ledger.address, AuditCheck.TOTAL_CONTRIBUTION,
                               f"the ledger's runs cannot be read: {exc}")
            return
        for worker in sorted(workers):
            got = self.ledger.total_contribution_of(worker)
            want = totals.get(worker, Contribution(tokens=0, rounds=0))
            tallies[worker]["total_tokens"] = want.tokens
            if got != want:
                self.findings.fail(None, worker, AuditCheck.TOTAL_CONTRIBUTION,
                                   f"the ledger's totalContributionOf({worker}) is {got.tokens} tokens over "
                                   f"{got.rounds} round(s); its rounds over all {len(self.ledger.runs_created())} "
                                   f"run(s) credit {want.tokens} tokens over {want.rounds} round(s)")

    def _totals_over_runs(self) -> dict[str, Contribution]:
        """Each worker's credits over every run this ledger created, from the RoundRecorded events."""
        tokens: dict[str, int] = defaultdict(int)
        rounds: dict[str, int] = defaultdict(int)
        for created in self.ledger.runs_created():
            for event in self.ledger.recorded_round_events(created.run_id):
                for worker in event.workers:
                    tokens[worker] += event.tokens
                    rounds[worker] += 1
        for voided in self.ledger.voided_credits():
            tokens[voided.worker] -= voided.tokens
            rounds[voided.worker] -= 1
        return {worker: Contribution(tokens=tokens[worker], rounds=rounds[worker]) for worker in tokens}

    def check_payouts(self, run_id: bytes) -> None:
        """Every reward the pool paid out of this run is one a recorded round entitles, the pool's own
        count of what it paid equals its ``RewardPaid`` events, and it holds at least what it has yet
        to pay out of this run (``payout``); each worker's earnings and payments go in the result
        (settlement.rewards.statement)."""
        if self.rewards is None:
            return
        try:
            statement = self.rewards.statement(run_id)
        except ChainError as exc:
            self.findings.fail(None, self.rewards.address, AuditCheck.PAYOUT, f"the reward pool cannot be read: {exc}")
            return
        if statement is None:
            return
        self.findings.result.rewards = statement
        for worker, account in sorted(statement.workers.items()):
            for problem in account.overpaid:
                self.findings.fail(None, worker, AuditCheck.PAYOUT, f"the reward pool paid {worker} for a round no record "
                                                           f"entitles it to: {problem}")
        if statement.paid + statement.reclaimed > statement.funded:
            self.findings.fail(None, self.rewards.address, AuditCheck.PAYOUT,
                               f"the pool paid {statement.paid} and returned {statement.reclaimed} to the funder out "
                               f"of this run, funded with {statement.funded}")
        if statement.pool_reclaimed != statement.reclaimed:
            self.findings.fail(None, self.rewards.address, AuditCheck.PAYOUT,
                               f"the pool counts {statement.pool_reclaimed} returned to the funder, but its "
                               f"RoundReclaimed events add up to {statement.reclaimed}")
        # The pool's own books against its events: a count that drifted from the payments (or a pool
        # that no longer holds what it owes this run) cannot pay every worker what it is owed.
        if statement.pool_paid != statement.paid:
            self.findings.fail(None, self.rewards.address, AuditCheck.PAYOUT,
                               f"the pool counts {statement.pool_paid} paid out of this run, but its RewardPaid "
                               f"events add up to {statement.paid}")
        owed = statement.funded - statement.pool_paid - statement.pool_reclaimed
        if statement.pool_balance < owed:
            self.findings.fail(None, self.rewards.address, AuditCheck.PAYOUT,
                               f"the pool holds {statement.pool_balance} tokens, less than the {owed} it has yet to "
                               f"pay out of this run")
