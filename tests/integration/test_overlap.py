"""One-step-delay overlap: the exchange of round r-1 runs while round r trains."""

from __future__ import annotations

import statistics

import pytest

from tests.integration.test_cluster import assert_rederivable
from trainer.cluster import LocalCluster
from trainer.compression import CompressionConfig
from trainer.config import InnerConfig, RoundConfig

pytestmark = pytest.mark.integration


def test_overlapped_compressed_workers_train_and_the_lineage_rederives(cluster: LocalCluster, make_config) -> None:
    """DiLoCoX's whole exchange: overlap, and compression both ways (the global update reaches a
    worker one round late and compressed against the round before, which it holds)."""
    cluster.start_coordinator(make_config(rounds=RoundConfig(
        rounds=3, expected_workers=2, quorum=2, overlap=True, heartbeat_interval_s=0.5, liveness_timeout_s=3.0),
        compression=CompressionConfig(enabled=True, max_rank=4)))
    cluster.start_worker("w0")
    cluster.start_worker("w1")
    for name in ("w0", "w1", "coordinator"):
        assert cluster.wait_exit(name, 120) == 0, cluster.log(name)
    chain = assert_rederivable(cluster.run_dir)
    assert [m.round for _, m in chain] == [0, 1, 2, 3]
    for _, m in chain[1:]:
        assert [p.worker for p in m.participants] == ["w0", "w1"]
    assert "waited" in cluster.log("w0")
    assert "fetching them dense" not in cluster.log("w0", tail=400)


def round_seconds(cluster: LocalCluster, overlap: bool, make_config, link_mbps: float) -> list[float]:
    cluster.start_coordinator(make_config(
        inner=InnerConfig(steps=600, batch_size=4, lr=1e-3),
        rounds=RoundConfig(rounds=4, expected_workers=1, quorum=1, overlap=overlap,
                           heartbeat_interval_s=0.5, liveness_timeout_s=5.0)))
    cluster.start_worker("w0", extra=["--link-bandwidth", str(link_mbps)])
    for name in ("w0", "coordinator"):
        assert cluster.wait_exit(name, 180) == 0, cluster.log(name)
    # A round opens when the one before closes, so its duration is the interval between closes.
    return [r["seconds"] for r in cluster.run_dir.logged_rounds() if r["round"] >= 2]


def test_overlap_hides_a_slow_link_behind_compute(make_config, tmp_path) -> None:
    # ~120 kB each way a round at 1 Mbit/s: about 1 s up and 1 s down, against ~1.5 s of compute.
    with LocalCluster(tmp_path / "sync") as sync_cluster:
        sync = round_seconds(sync_cluster, False, make_config, link_mbps=1.0)
    with LocalCluster(tmp_path / "overlap") as overlap_cluster:
        overlapped = round_seconds(overlap_cluster, True, make_config, link_mbps=1.0)
    sync_s, overlap_s = statistics.median(sync), statistics.median(overlapped)
    # Synchronous rounds pay compute + transfer; overlapped ones about max(compute, transfer).
    assert overlap_s < 0.75 * sync_s, (sync, overlapped)
