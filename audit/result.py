"""What an audit concludes: failures naming round, object and check; one row per round; warnings.

``AuditResult.to_json()`` is the ``--json`` file of ``dilocox audit``:

    {"ok": bool, "run_id": "0x…" | null, "failures": [{"round", "object", "check", "message"}],
     "rounds": [{"round", "manifest", "checkpoint", "participants", "reports", "eval_loss", "status",
                 "unreported"}],
     "warnings": [str],
     "tallies": {worker: {"tokens", "rounds", "total_tokens"}},
     "rewards": null | settlement.rewards.Statement.to_json(),
     "roster": null | {"ids": {address: [worker id]},
                       "unreported": [{"round", "worker", "update", "address"}]},
     "replay": null | {"seed", "steps", "checked_steps", "seconds",
                       "contributions": [{"round", "worker", "sampled", "distance", "status", "note"}],
                       "rescored": [{"round", "reported", "recomputed", "ok"}]},
     "disputes": [{"run_id", "round", "party", "party_id", "check", "check_id", "evidence", "outcome",
                   "tx_hash", "signers"}]}

``disputes``: each verdict upheld on the run (the disputes contract's events), and with ``--dispute``
each verdict this audit submitted, with its outcome (audit.disputes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .checks import AuditCheck


@dataclass(frozen=True)
class Failure:
    """One check that did not hold.

    round    the round it concerns (0 is genesis); None for run-wide checks (tallies, the run itself)
    object   what was checked: a CID, ``report[i] 0xWorker``, a worker address, a contract
    check    the check (audit.checks.AuditCheck; its value is the name printed and in the JSON)
    message  what was expected and what was found
    """

    round: int | None
    object: str
    check: AuditCheck
    message: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        where = "run" if self.round is None else f"round {self.round}"
        return f"{where}: {self.check} [{self.object}]: {self.message}"


@dataclass
class RoundRow:
    """One line of the audit table. ``checkpoint`` is the on-chain checkpoint as 0x-hex."""

    round: int
    manifest: str | None
    checkpoint: str | None
    participants: int | None
    reports: int
    eval_loss: float | None
    status: str = "ok"
    unreported: int = 0  # participants recorded on the coordinator's word, without a report

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class AuditResult:
    """The outcome of ``audit.run_audit``. ``ok`` only when no check failed."""

    run_id: bytes | None = None
    failures: list[Failure] = field(default_factory=list)
    rounds: list[RoundRow] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    rederived: bool = False
    replay: Any = None  # audit.replay.ReplayOutcome of ``--replay K``; None when nothing was replayed
    tallies: dict[str, dict[str, int]] = field(default_factory=dict)  # worker -> tokens, rounds, total_tokens
    rewards: Any = None  # settlement.rewards.Statement of the run's pool; None without one
    roster: Any = None  # settlement.roster.Roster: worker ids by address, unreported updates; None before rounds
    disputes: list[Any] = field(default_factory=list)  # audit.disputes.DisputeRow: upheld, and submitted

    @property
    def ok(self) -> bool:
        return not self.failures

    def failures_of(self, round_: int | None) -> list[Failure]:
        return [f for f in self.failures if f.round == round_]

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "run_id": None if self.run_id is None else "0x" + self.run_id.hex(),
            "rederived": self.rederived,
            "failures": [f.to_json() for f in self.failures],
            "rounds": [r.to_json() for r in self.rounds],
            "warnings": list(self.warnings),
            "replay": None if self.replay is None else self.replay.to_json(),
            "tallies": {w: dict(t) for w, t in sorted(self.tallies.items())},
            "rewards": None if self.rewards is None else self.rewards.to_json(),
            "roster": None if self.roster is None else self.roster.to_json(),
            "disputes": [d.to_json() for d in self.disputes],
        }
