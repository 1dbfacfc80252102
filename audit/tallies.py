"""The ledger's books: its records of the rounds, and the credits and payouts they add up to.

Checks ``rounds`` (1..lastRound, each once, in order), and for each recorded round
``parent-checkpoint`` (its parent is the previous round's checkpoint on chain), ``report-count``
(the credited workers are the call's report signers), ``ledger`` (the stored commitment is the
event's and the hash of the recorded facts) and ``recorder`` (the run's coordinator sent it); then
``tally`` and ``total-contribution`` (the ledger's views against its events) and, with the
deployment's reward pool, ``payout`` (settlement.rewards.statement).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from attestation import checksum_address
from settlement import ChainError, Ledger
from settlement.ledger import commitment_of
from settlement.rewards import RewardPool

from .findings import Findings


class Tallies:
    """Checks what the ledger (and its reward pool, when there is one) keeps of a run."""

    def __init__(self, findings: Findings, ledger: Ledger, rewards: RewardPool | None) -> None:
        self.findings = findings
        self.ledger = ledger
        self.rewards = rewards

    def check_rounds(self, last: int, rounds: list[dict[str, Any]]) -> None:
        """The ledger's RoundRecorded events are for rounds 1..``last`` (its lastRound), in order."""
        numbers = [int(rec["round"]) for rec in rounds]
        if numbers != list(range(1, last + 1)):
            self.findings.fail(None, self.ledger.address, "rounds",
                               f"the ledger's lastRound is {last}, but its RoundRecorded events are for rounds "
                               f"{numbers}")

    def check_record(self, run_id: bytes, record: dict[str, Any], parent_checkpoint: bytes, coordinator: str) -> None:
        """A round's record on chain: chained to the previous round's checkpoint, crediting the
        reports' signers, committed as recorded, and sent by the run's ``coordinator`` (as runOf says it)."""
        fail = self.findings.fail
        r = int(record["round"])
        where = f"round {r} on chain"
        if record.get("parentCheckpoint") != parent_checkpoint:
            fail(r, where, "parent-checkpoint",
                 f"the ledger recorded parent 0x{record.get('parentCheckpoint', b'').hex()}, but the previous "
                 f"round's checkpoint on chain is 0x{parent_checkpoint.hex()}")
        unreported: list[bytes] = record.get("unreported", [])
        credited = [checksum_address(w) for w in record.get("workers", [])]
        signers = [signed.report.worker for signed in record.get("reports", [])]
        if credited != signers or int(record.get("unreportedCount", 0)) != len(unreported):
            fail(r, where, "report-count",
                 f"RoundRecorded credits {len(credited)} worker(s) and says {record.get('unreportedCount', 0)} "
                 f"unreported update(s); the recording call carried reports of {len(signers)} and "
                 f"{len(unreported)} unreported" + ("" if len(credited) != len(signers) else
                                                    ": the credited workers are not the reports' signers"))
        stored = self.ledger.round_commitment(run_id, r)
        derived = commitment_of(record)
        if stored != record.get("commitment") or stored != derived:
            fail(r, where, "ledger",
                 f"the ledger keeps commitment 0x{stored.hex()} for the round, its RoundRecorded event says "
                 f"0x{bytes(record.get('commitment', b'')).hex()}, and the recorded facts hash to "
                 f"0x{derived.hex()} (the round was overwritten, or the ledger is not what it claims)")
        coordinator = checksum_address(coordinator)
        if record.get("sender") != coordinator:
            fail(r, where, "recorder",
                 f"round {r} was recorded by {record.get('sender')} (tx {record.get('tx_hash')}), not by the run's "
                 f"coordinator {coordinator}")

    def check_tallies(self, run_id: bytes, rounds: list[dict[str, Any]]) -> None:
        """``contributionOf(run, worker)`` equals the run's recorded reports of that worker, and
        ``totalContributionOf(worker)`` the worker's credits over every run on this ledger (summed from
        each run's RoundRecorded events: the tokens each round credits each of its workers)."""
        tokens: dict[str, int] = defaultdict(int)
        counted: dict[str, int] = defaultdict(int)
        for record in rounds:
            for signed in record.get("reports", []):
                tokens[signed.report.worker] += signed.report.tokens
                counted[signed.report.worker] += 1
        workers = set(tokens) | {checksum_address(w) for record in rounds for w in record.get("workers", [])}
        tallies = self.findings.result.tallies
        for worker in sorted(workers):
            got = self.ledger.contribution_of(run_id, worker)
            want = {"tokens": tokens.get(worker, 0), "rounds": counted.get(worker, 0)}
            tallies[worker] = {"tokens": want["tokens"], "rounds": want["rounds"]}
            if (int(got["tokens"]), int(got["rounds"])) != (want["tokens"], want["rounds"]):
                self.findings.fail(None, worker, "tally",
                                   f"the ledger credits {worker} with {got['tokens']} tokens over {got['rounds']} "
                                   f"round(s); its recorded reports sum to {want['tokens']} tokens over "
                                   f"{want['rounds']} round(s)")
        if not workers:
            return
        try:
            totals = self._totals_over_runs()
        except ChainError as exc:
            self.findings.fail(None, self.ledger.address, "total-contribution",
                               f"the ledger's runs cannot be read: {exc}")
            return
        for worker in sorted(workers):
            got = self.ledger.total_contribution_of(worker)
            want = totals.get(worker, {"tokens": 0, "rounds": 0})
            tallies[worker]["total_tokens"] = want["tokens"]
            if (int(got["tokens"]), int(got["rounds"])) != (want["tokens"], want["rounds"]):
                self.findings.fail(None, worker, "total-contribution",
                                   f"the ledger's totalContributionOf({worker}) is {got['tokens']} tokens over "
                                   f"{got['rounds']} round(s); its rounds over all {len(self.ledger.runs_created())} "
                                   f"run(s) credit {want['tokens']} tokens over {want['rounds']} round(s)")

    def _totals_over_runs(self) -> dict[str, dict[str, int]]:
        """Each worker's credits over every run this ledger created, from the RoundRecorded events."""
        totals: dict[str, dict[str, int]] = defaultdict(lambda: {"tokens": 0, "rounds": 0})
        for created in self.ledger.runs_created():
            for event in self.ledger.recorded_round_events(bytes(created["runId"])):
                for worker in event["workers"]:
                    total = totals[checksum_address(worker)]
                    total["tokens"] += int(event["tokens"])
                    total["rounds"] += 1
        return totals

    def check_payouts(self, run_id: bytes) -> None:
        """Every reward the pool paid out of this run is one a recorded round entitles (``payout``),
        and each worker's earnings and payments go in the result (settlement.rewards.statement)."""
        if self.rewards is None:
            return
        try:
            statement = self.rewards.statement(run_id)
        except ChainError as exc:
            self.findings.fail(None, self.rewards.address, "payout", f"the reward pool cannot be read: {exc}")
            return
        if statement is None:
            return
        self.findings.result.rewards = statement
        for worker, account in sorted(statement.workers.items()):
            for problem in account.overpaid:
                self.findings.fail(None, worker, "payout", f"the reward pool paid {worker} for a round no record "
                                                           f"entitles it to: {problem}")
        if statement.paid > statement.funded:
            self.findings.fail(None, self.rewards.address, "payout",
                               f"the pool paid {statement.paid} out of this run, funded with {statement.funded}")
