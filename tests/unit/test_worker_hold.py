"""The test-only worker hold (trainer.worker.hold): refused outside pytest, inert when unset, and a
held round waits for its file to go."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from trainer.worker import WorkerError
from trainer.worker.hold import HOLD_DIR_ENV, UNDER_PYTEST_ENV, RoundHold, hold_file


def test_the_hold_is_refused_outside_pytest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOLD_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(UNDER_PYTEST_ENV)
    with pytest.raises(WorkerError, match=f"{HOLD_DIR_ENV} is a test-only pause and is refused outside pytest"):
        RoundHold.from_env()


def test_no_hold_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HOLD_DIR_ENV, raising=False)
    hold = RoundHold.from_env()
    assert hold.directory is None
    hold.wait("w0", 1)  # returns at once


def test_a_held_round_waits_until_its_file_is_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOLD_DIR_ENV, str(tmp_path))
    hold = RoundHold.from_env()
    hold_file(tmp_path, "w0", 2).touch()
    hold.wait("w0", 1)  # another round: not held
    hold.wait("w1", 2)  # another worker: not held
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (hold.wait("w0", 2), done.set()), daemon=True)
    waiter.start()
    assert not done.wait(0.3)  # held while the file exists
    hold_file(tmp_path, "w0", 2).unlink()
    assert done.wait(10)
