"""Client of the ``RewardPool`` (contracts/src/RewardPool.sol) and its ``RewardToken``.

A run's coordinator opens the run's pool once (``open_pool``: funded amount, number of rounds it
pays for). Each recorded round r ≤ that number carries ⌊funded / rounds⌋, split equally among the
round's reporting workers (they are all credited the same tokens), rounded down; a worker claims,
or anyone claims for it, once the round is ``challengeWindow`` blocks old. ``statement`` works out,
from the ledger's events alone, what each worker is owed, what it was paid, and what it can claim
now; ``claim`` sends the claims, proving each round's facts against the ledger's commitment.

A credit an upheld verdict voided (the ledger's ``CreditVoided``, settlement.disputes) earns nothing
and is never claimed; ``reclaim`` returns to the funder what each matured round leaves unpaid
(IRewardPool.reclaim: p − (n − v)·⌊p / n⌋, the whole p for a round credited to nobody or voided, and
the funding's rounding remainder with the last round).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from eth_utils import to_checksum_address

from .artifacts import load_artifact
from .chain import Chain
from .ledger import Ledger, _Contract
from storage_client import bytes32

from .records import Payment, Pool, Reclaim

__all__ = ["RewardPool", "RewardToken", "Statement", "WorkerStatement"]


class RewardToken(_Contract):
    """Client of the local ``RewardToken`` (an ERC-20 its owner mints)."""

    def __init__(self, chain: Chain, address: str, *, from_block: int = 0) -> None:
        super().__init__(chain, address, load_artifact("RewardToken"), from_block)

    def mint(self, to: str, amount: int) -> Any:
        return self.chain.transact(self._contract.functions.mint(to_checksum_address(to), amount))

    def approve(self, spender: str, amount: int) -> Any:
        return self.chain.transact(self._contract.functions.approve(to_checksum_address(spender), amount))

    def balance_of(self, holder: str) -> int:
        return int(self.chain.call(self._contract.functions.balanceOf(to_checksum_address(holder))))


@dataclass
class WorkerStatement:
    """One worker's account with a run's pool. Amounts in the token's smallest unit."""

    worker: str
    rounds: list[int] = field(default_factory=list)  # rounds the ledger credited it in
    earned: int = 0  # what those rounds entitle it to
    paid: int = 0  # RewardPaid to it so far
    claimable: int = 0  # earned, unpaid, and past the challenge window now
    pending: int = 0  # earned, unpaid, still inside the window
    overpaid: list[str] = field(default_factory=list)  # payments no recorded round entitles
    voided: list[int] = field(default_factory=list)  # credited rounds an upheld verdict voided: not payable

    def to_json(self) -> dict[str, Any]:
        return {"worker": self.worker, "rounds": list(self.rounds), "earned": self.earned, "paid": self.paid,
                "claimable": self.claimable, "pending": self.pending, "overpaid": list(self.overpaid),
                "voided": list(self.voided)}


@dataclass
class Statement:
    """A run's pool and every credited worker's account, as of block ``head``: ``paid`` adds up the
    run's ``RewardPaid`` events; ``pool_paid`` is what the pool itself counts as paid out of the run,
    and ``pool_balance`` the tokens the pool holds (for every run it pays); ``reclaimed`` adds up the
    run's ``RoundReclaimed`` events (returned to the funder), ``pool_reclaimed`` is the pool's own count."""

    run_id: bytes
    funded: int
    total_rounds: int
    challenge_window: int
    head: int
    workers: dict[str, WorkerStatement]
    pool_paid: int
    pool_balance: int
    reclaimed: int = 0
    pool_reclaimed: int = 0

    @property
    def paid(self) -> int:
        return sum(w.paid for w in self.workers.values())

    def to_json(self) -> dict[str, Any]:
        return {"run_id": "0x" + self.run_id.hex(), "funded": self.funded, "total_rounds": self.total_rounds,
                "challenge_window": self.challenge_window, "head": self.head, "paid": self.paid,
                "pool_paid": self.pool_paid, "pool_balance": self.pool_balance, "reclaimed": self.reclaimed,
                "pool_reclaimed": self.pool_reclaimed, "workers": [w.to_json() for _, w in sorted(self.workers.items())]}


class RewardPool(_Contract):
    """Client of a ``RewardPool``.

    @param chain the account that sends (the run's coordinator to open a pool; anyone to claim)
    @param address the pool
    @param ledger the ledger the pool pays from (its events tell who is owed what)
    """

    def __init__(self, chain: Chain, address: str, ledger: Ledger, *, from_block: int = 0) -> None:
        super().__init__(chain, address, load_artifact("RewardPool"), from_block)
        self.ledger = ledger

    def token_address(self) -> str:
        return to_checksum_address(self.chain.call(self._contract.functions.token()))

    def open_pool(self, run_id: bytes, amount: int, total_rounds: int) -> Any:
        """Open and fund the run's pool (the run's coordinator; approve ``amount`` to the pool first)."""
        return self.chain.transact(self._contract.functions.openPool(bytes32(run_id, "run_id"), amount, total_rounds))

    def pool_of(self, run_id: bytes) -> Pool | None:
        """The run's pool, or None when the run has none."""
        pool = Pool.from_struct(self._view_struct("poolOf", bytes32(run_id, "run_id")))
        return None if pool.funded == 0 else pool

    def payments(self, run_id: bytes, worker: str | None = None) -> list[Payment]:
        """``RewardPaid`` events of the run (to ``worker``, or to anyone), oldest first."""
        filters = {"worker": to_checksum_address(worker)} if worker else {}
        return self._logs("RewardPaid", Payment.from_event, runId=bytes32(run_id, "run_id"), **filters)

    def statement(self, run_id: bytes) -> Statement | None:
        """What each worker the ledger credited in the run has earned, been paid and can claim now, from
        the ledger's ``RoundRecorded`` events and the pool's ``RewardPaid`` events; None without a pool."""
        pool = self.pool_of(run_id)
        if pool is None:
            return None
        # The window the pool itself applies: the one it snapshotted when it was opened.
        window = self.chain.call(self._contract.functions.challengeWindowOf(bytes32(run_id, "run_id")))
        head = self.ledger.head_block()
        funded, total = pool.funded, pool.total_rounds
        per_round = funded // total if total else 0
        accounts: dict[str, WorkerStatement] = {}
        earned: dict[tuple[str, int], tuple[int, bool]] = {}
        voided = {(v.worker, v.round) for v in self.ledger.voided_credits(run_id)}
        for event in self.ledger.recorded_round_events(run_id):
            share = per_round // len(event.workers) if event.workers and 1 <= event.round <= total else 0
            mature = event.block + window <= head
            for w in event.workers:
                account = accounts.setdefault(w, WorkerStatement(w))
                account.rounds.append(event.round)
                if (w, event.round) in voided:  # earns nothing: the pool refuses it (RewardPoolVoided)
                    account.voided.append(event.round)
                    earned[(w, event.round)] = (0, mature)
                    continue
                account.earned += share
                earned[(w, event.round)] = (share, mature)
        paid: dict[tuple[str, int], int] = defaultdict(int)
        for payment in self.payments(run_id):
            w, r = payment.worker, payment.round
            account = accounts.setdefault(w, WorkerStatement(w))
            account.paid += payment.amount
            paid[(w, r)] += payment.amount
            if (w, r) not in earned or paid[(w, r)] > earned[(w, r)][0]:
                account.overpaid.append(f"round {r}: paid {paid[(w, r)]}, entitled to "
                                        f"{earned.get((w, r), (0, False))[0]}")
        for (w, r), (share, mature) in earned.items():
            if paid.get((w, r), 0) == 0 and share > 0:
                if mature:
                    accounts[w].claimable += share
                else:
                    accounts[w].pending += share
        balance = RewardToken(self.chain, self.token_address()).balance_of(self.address)
        reclaimed = sum(r.amount for r in self.reclaims(run_id))
        return Statement(run_id, funded, total, window, head, accounts, pool.paid, balance, reclaimed,
                         self.reclaimed_of(run_id))

    def reclaims(self, run_id: bytes) -> list[Reclaim]:
        """``RoundReclaimed`` events of the run, oldest first."""
        return self._logs("RoundReclaimed", Reclaim.from_event, runId=bytes32(run_id, "run_id"))

    def reclaimed_of(self, run_id: bytes) -> int:
        """What the pool counts as returned to the run's funder."""
        return int(self.chain.call(self._contract.functions.reclaimedOf(bytes32(run_id, "run_id"))))

    def reclaim(self, run_id: bytes) -> tuple[int, Any | None]:
        """Return to the funder (this account) what every matured round of the pool's rounds leaves
        unpaid, in one call; returns (amount, receipt), or (0, None) when no round is left to reclaim."""
        statement = self.statement(run_id)
        if statement is None:
            return 0, None
        done = {r.round for r in self.reclaims(run_id)}
        proofs = [(event.round, event.facts()) for event in self.ledger.recorded_round_events(run_id)
                  if 1 <= event.round <= statement.total_rounds and event.round not in done
                  and event.block + statement.challenge_window <= statement.head]
        if not proofs:
            return 0, None
        receipt = self.chain.transact(self._contract.functions.reclaim(bytes32(run_id, "run_id"), proofs))
        tx_hash = "0x" + bytes(receipt["transactionHash"]).hex()
        return sum(r.amount for r in self.reclaims(run_id) if r.tx_hash == tx_hash), receipt

    def claim(self, run_id: bytes, worker: str) -> tuple[int, Any | None]:
        """Claim every matured, unpaid round of ``worker`` in one call; returns (amount, receipt), or
        (0, None) when there is nothing to claim."""
        worker = to_checksum_address(worker)
        statement = self.statement(run_id)
        if statement is None:
            return 0, None
        account = statement.workers.get(worker)
        paid_rounds = {p.round for p in self.payments(run_id, worker)}
        paid_rounds |= set(account.voided) if account is not None else set()  # refused: never claimed
        claims = []
        for event in self.ledger.recorded_round_events(run_id):
            if worker not in event.workers or event.round in paid_rounds or event.round > statement.total_rounds:
                continue
            if event.block + statement.challenge_window > statement.head:
                continue
            claims.append((event.round, event.workers.index(worker), event.facts()))
        if not claims or account is None:
            return 0, None
        receipt = self.chain.transact(self._contract.functions.claim(bytes32(run_id, "run_id"), worker, claims))
        tx_hash = "0x" + bytes(receipt["transactionHash"]).hex()
        return sum(p.amount for p in self.payments(run_id, worker) if p.tx_hash == tx_hash), receipt
