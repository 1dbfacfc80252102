"""Shared fixtures: small run configurations, a local cluster of real processes, a local chain, and
the public sample files in ../shared that some tests read (a test that needs one fails, naming it,
when it is absent: a missing input must not pass as a skip)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Iterator

import pytest

from cli.cluster import LocalCluster, start_process
from settlement import Anvil
from trainer.config import DataConfig, InnerConfig, ModelConfig, RoundConfig, RunConfig
from trainer.worker.hold import HOLD_DIR_ENV, hold_file

from tests.zygote import Zygote

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Public sample data (TDX quotes and their collateral, tiny Shakespeare) kept beside the repository
# and read in place, never copied into it.
SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def shared_path(relative: str) -> Path:
    """``../shared/<relative>``, or the test fails with one line saying what is missing and where."""
    path = SHARED / relative
    if not path.exists():
        pytest.fail(f"{path} is absent: this test reads the public sample data in ../shared/{relative}; "
                    f"put the shared folder beside the repository ({SHARED})", pytrace=False)
    return path


def small_config(**sections: object) -> RunConfig:
    """A run that trains in well under a second a round on one CPU thread: plain DiLoCo (dense,
    synchronous) unless the test's sections say otherwise."""
    base = RunConfig(
        run_id="test",
        model=ModelConfig(block_size=32, n_layer=1, n_head=2, n_embd=32),
        inner=InnerConfig(steps=3, batch_size=4, lr=1e-3),
        data=DataConfig(eval_batches=2),
        rounds=RoundConfig(rounds=2, expected_workers=2, quorum=2, straggler_timeout_s=30.0,
                           heartbeat_interval_s=0.5, liveness_timeout_s=3.0),
    ).plain_diloco()
    return base.replace(**sections)


@pytest.fixture(scope="session", autouse=True)
def forked_cluster_processes() -> Iterator[None]:
    """Every LocalCluster of this pytest process starts its coordinator and workers from one fork
    server (tests/zygote.py: real processes, without importing torch and gRPC again each time).
    ``DILOCOX_TEST_FRESH_PROCESSES=1`` starts each one as a fresh interpreter instead."""
    if os.environ.get("DILOCOX_TEST_FRESH_PROCESSES") == "1":
        yield
        return
    zygote = Zygote()
    LocalCluster.launcher = staticmethod(zygote.launch)
    yield
    LocalCluster.launcher = staticmethod(start_process)
    zygote.close()


@pytest.fixture(autouse=True)
def logging_as_before() -> Iterator[None]:
    """A test that runs a CLI command in this process (``cli.main.main``) sets the root logger up
    for it, writing to the stream pytest captured for that test: the handlers and level are put
    back afterwards, so a later test's log lines never go to a stream that has since been closed."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def make_config(tmp_path: Path) -> Callable[..., Path]:
    """Write a small config (sections overridden by keyword) and return its path."""

    def make(**sections: object) -> Path:
        path = tmp_path / "config.json"
        small_config(**sections).save(path)
        return path

    return make


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path / "run") as local:
        yield local


class Holds:
    """Test-controlled pauses of the cluster's workers (trainer.worker.hold): ``hold(w, r)`` before
    starting worker ``w`` keeps it in phase TRAINING of round ``r``, before its inner steps, until
    ``release(w, r)``; the test waits on that phase instead of on a long round."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def hold(self, worker_id: str, round_: int) -> None:
        hold_file(self.directory, worker_id, round_).touch()

    def release(self, worker_id: str, round_: int) -> None:
        hold_file(self.directory, worker_id, round_).unlink(missing_ok=True)


@pytest.fixture
def holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Holds:
    """Workers started in this test honour holds in ``<tmp>/holds`` (they inherit the variable)."""
    directory = tmp_path / "holds"
    monkeypatch.setenv(HOLD_DIR_ENV, str(directory))
    return Holds(directory)


@pytest.fixture
def chain(tmp_path: Path) -> Iterator[Anvil]:
    """A fresh anvil for one test (the tests that use it deploy, mine and stop it), its state dumped
    into the ``cluster`` fixture's run directory (``<run>/chain/state.json``) like a demo's."""
    with Anvil(state_file=tmp_path / "run" / "chain" / "state.json") as anvil:
        yield anvil
