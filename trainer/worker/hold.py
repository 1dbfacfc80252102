"""A test-only pause: a worker that waits, before a round's inner steps, while a file exists.

Integration tests need a worker to stay in a phase ("training round 1") while something else
happens: a SIGKILL, a hostile push into the open round, a coordinator restart. Training for
thousands of steps to keep it busy makes the test slow and its timing a guess; a hold makes it an
event the test controls. With ``DILOCOX_TEST_HOLD_DIR=<dir>`` in its environment, a worker about to
train round r waits while ``<dir>/<worker id>-<r>`` exists (it is in phase TRAINING of round r then,
and its heartbeats go on), and trains as usual once the test removes the file. Nothing else
changes: what it trains, pushes and signs is the same as without the hold.

The knob is for tests alone: a worker refuses to start with it unless it runs under pytest
(``PYTEST_CURRENT_TEST`` in its environment, which pytest sets during a test and the test's child
processes inherit), so a stray variable cannot stall a real run.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from trainer.worker.client import WorkerError

HOLD_DIR_ENV = "DILOCOX_TEST_HOLD_DIR"
UNDER_PYTEST_ENV = "PYTEST_CURRENT_TEST"
POLL_S = 0.05  # how often a held worker looks for its file

log = logging.getLogger("dilocox.worker")


def hold_file(directory: Path, worker_id: str, round_: int) -> Path:
    """The file that, while it exists, holds ``worker_id`` before round ``round_``'s inner steps."""
    return directory / f"{worker_id}-{round_}"


class RoundHold:
    """Where a worker's holds live (``DILOCOX_TEST_HOLD_DIR``), or none in a normal run."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory

    @classmethod
    def from_env(cls) -> RoundHold:
        """The hold the environment asks for; WorkerError when it is set outside a test."""
        value = os.environ.get(HOLD_DIR_ENV)
        if not value:
            return cls(None)
        if UNDER_PYTEST_ENV not in os.environ:
            raise WorkerError(f"{HOLD_DIR_ENV} is a test-only pause and is refused outside pytest; "
                              f"unset it to run a worker")
        return cls(Path(value))

    def wait(self, worker_id: str, round_: int) -> None:
        """Block while this worker's hold file for ``round_`` exists (at once when there is none)."""
        if self.directory is None:
            return
        path = hold_file(self.directory, worker_id, round_)
        if path.exists():
            log.info("round %d: held by the test (%s) before the inner steps", round_, path.name)
        while path.exists():
            time.sleep(POLL_S)
