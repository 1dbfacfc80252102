"""Shared fixtures: small run configurations and a local cluster of real processes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator

import pytest

from benchmarks.cluster import LocalCluster
from trainer.config import DataConfig, InnerConfig, ModelConfig, RoundConfig, RunConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
