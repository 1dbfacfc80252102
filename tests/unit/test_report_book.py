"""settlement.report_book.ReportBook: when a round goes to the ledger outbox, and with which reports.

The book runs on a real run directory; the outbox is a recorder of what was queued, and time is
passed in (``queue_due(..., now)``), so the report timeout is a number here, not a wait.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from settlement.report_book import ReportBook
from storage_client import CID, Codec
from trainer.net.refusal import Reason, Refusal
from trainer.runstore.run_dir import RunDir

TIMEOUT_S = 60.0


class RecordingOutbox:
    """What ReportBook hands on: one entry per queued round."""

    def __init__(self) -> None:
        self.rounds: list[dict[str, Any]] = []

    def enqueue_round(self, **item: Any) -> None:
        self.rounds.append(item)


def cid(text: str) -> CID:
    return CID.of(text.encode(), Codec.RAW)


def manifest(r: int, workers: tuple[str, ...]) -> tuple[CID, SimpleNamespace]:
    participants = tuple(SimpleNamespace(worker=w, update=str(cid(f"update {w} {r}"))) for w in workers)
    return cid(f"manifest {r}"), SimpleNamespace(params=str(cid(f"params {r}")), participants=participants)


def report(r: int, worker: str) -> SimpleNamespace:
    """A report as the book keeps it (the gate checked its signature before ``add``)."""
    return SimpleNamespace(report=SimpleNamespace(round=r), to_json=lambda: {"round": r, "worker": worker})


class Run:
    """Rounds published at ``closed_at``, each with both workers as participants."""

    def __init__(self, tmp_path, workers: tuple[str, ...] = ("honest", "mute")) -> None:
        self.run_dir = RunDir(tmp_path / "run")
        self.outbox = RecordingOutbox()
        self.book = ReportBook(self.run_dir, self.outbox, b"\x01" * 32, TIMEOUT_S)
        self.workers = workers
        self.manifests = {0: manifest(0, ())}
        self.closed_at: dict[int, float] = {}

    def publish(self, r: int, at: float) -> None:
        self.manifests[r] = manifest(r, self.workers)
        self.closed_at[r] = at

    def queue(self, now: float) -> list[int]:
        return self.book.queue_due(self.manifests, self.closed_at, now)

    def reopened(self) -> ReportBook:
        return ReportBook(self.run_dir, self.outbox, b"\x01" * 32, TIMEOUT_S)


def test_a_worker_that_never_reports_costs_one_report_timeout_once(tmp_path) -> None:
    run = Run(tmp_path)
    run.publish(1, at=0.0)
    run.book.add("honest", report(1, "honest"))
    assert run.queue(now=TIMEOUT_S - 1) == []  # round 1 waits for mute, up to the timeout
    assert run.queue(now=TIMEOUT_S) == [1]
    assert len(run.outbox.rounds[0]["unreported"]) == 1 and run.book.silent == {"mute"}

    for r in range(2, 12):  # ten more rounds: each queued as soon as the honest worker reports
        t = 100.0 * r
        run.publish(r, at=t)
        assert run.queue(now=t) == []  # the honest worker's report is still awaited
        run.book.add("honest", report(r, "honest"))
        assert run.queue(now=t + 1) == [r]
        assert len(run.outbox.rounds[-1]["reports"]) == 1 and len(run.outbox.rounds[-1]["unreported"]) == 1
    assert run.reopened().silent == {"mute"}  # a restart remembers


def test_a_silent_workers_report_counts_if_it_arrives_before_its_round_is_queued(tmp_path) -> None:
    run = Run(tmp_path)
    run.publish(1, at=0.0)
    assert run.queue(now=TIMEOUT_S) == [1]  # nobody reported: queued at the timeout, both unreported
    assert run.book.silent == {"honest", "mute"}
    run.publish(2, at=100.0)
    run.book.add("mute", report(2, "mute"))  # mute comes back before round 2 is queued
    assert run.book.silent == {"honest"}
    assert run.queue(now=100.0) == [2]  # nobody is awaited: mute has reported, honest is silent
    assert run.outbox.rounds[-1]["reports"] == [{"round": 2, "worker": "mute"}]
    assert run.book.silent == {"honest"}

    run.publish(3, at=200.0)
    run.book.add("honest", report(3, "honest"))  # honest reports again: both awaited from now on
    assert run.book.silent == set()
    assert run.queue(now=200.0) == []  # mute's report of round 3 is awaited again
    run.book.add("mute", report(3, "mute"))
    assert run.queue(now=201.0) == [3] and len(run.outbox.rounds[-1]["reports"]) == 2


def test_a_report_too_late_is_refused_but_the_worker_is_waited_for_again(tmp_path) -> None:
    run = Run(tmp_path)
    run.publish(1, at=0.0)
    run.book.add("honest", report(1, "honest"))
    assert run.queue(now=TIMEOUT_S) == [1] and run.book.silent == {"mute"}
    with pytest.raises(Refusal) as late:
        run.book.add("mute", report(1, "mute"))
    assert late.value.reason is Reason.NOT_PUBLISHED
    assert run.book.silent == set()  # it reports again, if late: round 2 waits for it
    run.publish(2, at=100.0)
    run.book.add("honest", report(2, "honest"))
    assert run.queue(now=101.0) == []
    assert run.queue(now=100.0 + TIMEOUT_S) == [2] and run.book.silent == {"mute"}
