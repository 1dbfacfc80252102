"""Dead peers: SIGKILL a worker mid-round, SIGKILL and restart the coordinator, tampered objects."""

from __future__ import annotations

import signal

import pytest

from cli.cluster import ClusterError, LocalCluster
from proto import WorkerPhase
from storage_client import CID, lineage
from tests.conftest import Holds
from tests.integration.test_cluster import assert_rederivable
from trainer.codec import CompressionConfig
from trainer.config import InnerConfig, RoundConfig

pytestmark = pytest.mark.integration


def phase_of(status, worker: str) -> tuple[int, WorkerPhase | None]:
    for w in status.workers:
        if w.worker_id == worker:
            return w.round, w.phase
    return -1, None


def test_sigkilled_worker_is_dropped_and_rejoins(cluster: LocalCluster, make_config, holds: Holds) -> None:
    # w1 is held before round 1's inner steps, so it is mid-round until the test kills it; w0 is
    # held before round 2's until the restarted w1 is back, so w1 catches round 3 whatever its
    # start-up takes.
    cluster.start_coordinator(make_config(
        rounds=RoundConfig(rounds=3, expected_workers=2, quorum=2, straggler_timeout_s=4.0,
                           heartbeat_interval_s=0.3, liveness_timeout_s=2.0)))
    holds.hold("w1", 1)
    holds.hold("w0", 2)
    cluster.start_worker("w0")
    cluster.start_worker("w1")
    cluster.wait_for(lambda s: phase_of(s, "w1") == (1, WorkerPhase.TRAINING), 60, "w1 to train round 1")
    cluster.kill("w1", signal.SIGKILL)
    shards = cluster.run_dir.workers()
    assert sorted(shards.values()) == [0, 1]

    status = cluster.wait_for(lambda s: len(s.rounds) >= 2, 60, "round 1 to close without w1")
    assert list(status.rounds[1].participants) == ["w0"]
    assert list(status.rounds[1].dropped) == ["w1"]

    holds.release("w1", 1)
    cluster.start_worker("w1")  # same id: same shard, back in at the next round it catches
    cluster.wait_for(lambda s: any(w.worker_id == "w1" and w.alive and w.round >= 2 for w in s.workers), 60,
                     "the restarted w1 to take part in round 2")
    holds.release("w0", 2)
    for name in ("w0", "w1", "coordinator"):
        assert cluster.wait_exit(name, 120) == 0, cluster.log(name)
    chain = [m for _, m in lineage(cluster.run_dir.store, cluster.run_dir.head())]
    assert [m.round for m in chain] == [0, 1, 2, 3]
    assert [p.worker for p in chain[1].participants] == ["w0"]
    assert [p.worker for p in chain[3].participants] == ["w0", "w1"]
    assert cluster.run_dir.workers() == shards  # the restarted w1 kept its shard


def test_coordinator_sigkill_and_restart_loses_no_round(cluster: LocalCluster, make_config) -> None:
    # Compressed both ways: the restarted coordinator carries on the downlink error from the stored
    # outer state, and workers holding the round before still get the compressed global update.
    config = make_config(
        compression=CompressionConfig(enabled=True, min_rank=1, max_rank=4),
        inner=InnerConfig(steps=20, batch_size=4, lr=1e-3),
        rounds=RoundConfig(rounds=5, expected_workers=2, quorum=2, straggler_timeout_s=10.0,
                           heartbeat_interval_s=0.3, liveness_timeout_s=3.0))
    cluster.start_coordinator(config)
    port = int(cluster.address.rsplit(":", 1)[1])
    cluster.start_worker("w0")
    cluster.start_worker("w1")
    cluster.wait_for(lambda s: len(s.rounds) >= 3, 120, "round 2 to close")
    cluster.kill("coordinator", signal.SIGKILL)

    run = cluster.run_dir
    before = lineage(run.store, run.head())
    assert before[-1][1].round >= 2

    # Same port, no --config: the run is resumed from its HEAD manifest and stored config.
    cluster.start_coordinator(port=port)
    for name in ("w0", "w1", "coordinator"):
        assert cluster.wait_exit(name, 180) == 0, cluster.log(name)
    after = lineage(run.store, run.head())
    assert [m.round for _, m in after] == [0, 1, 2, 3, 4, 5]
    assert after[: len(before)] == before  # every round finished before the kill is still there
    assert "resumed at round" in cluster.log("coordinator", tail=400)
    for _, m in after[1:]:
        assert [p.worker for p in m.participants] == ["w0", "w1"]
    assert_rederivable(run)


def test_restart_on_a_tampered_checkpoint_fails_naming_the_object(cluster: LocalCluster, make_config) -> None:
    cluster.start_coordinator(make_config(rounds=RoundConfig(rounds=1, expected_workers=1, quorum=1)))
    cluster.start_worker("w0")
    assert cluster.wait_exit("w0", 120) == 0, cluster.log("w0")
    assert cluster.wait_exit("coordinator", 60) == 0

    run = cluster.run_dir
    _, tip = lineage(run.store, run.head())[-1]
    path = run.store.path_of(tip.params)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))

    with pytest.raises(ClusterError, match="coordinator exited with 1") as failed:
        cluster.start_coordinator()
    assert "is corrupt" in str(failed.value)
    assert str(CID.parse(tip.params)) in str(failed.value)


def test_update_accepted_before_a_coordinator_crash_is_kept(cluster: LocalCluster, make_config) -> None:
    # quorum 2 with only w0 running: w0's round-1 update is accepted and journalled, the round
    # stays open, and the coordinator dies before it closes.
    cluster.start_coordinator(make_config(rounds=RoundConfig(
        rounds=1, expected_workers=2, quorum=2, straggler_timeout_s=300.0,
        heartbeat_interval_s=0.3, liveness_timeout_s=2.0)))
    port = int(cluster.address.rsplit(":", 1)[1])
    cluster.start_worker("w0")
    cluster.wait_for(lambda s: phase_of(s, "w0")[1] == WorkerPhase.WAITING and phase_of(s, "w0")[0] == 1, 60,
                     "w0 to push round 1")
    pending = cluster.run_dir.pending(1)
    assert set(pending) == {"w0"}
    cluster.kill("coordinator", signal.SIGKILL)
    cluster.kill("w0", signal.SIGKILL)  # w0 cannot re-send: only the journal can keep its update

    cluster.start_coordinator(port=port)
    cluster.start_worker("w1")
    for name in ("w1", "coordinator"):
        assert cluster.wait_exit(name, 120) == 0, cluster.log(name)
    _, round1 = lineage(cluster.run_dir.store, cluster.run_dir.head())[-1]
    assert {p.worker: p.update for p in round1.participants}["w0"] == pending["w0"]["cid"]
    assert [p.worker for p in round1.participants] == ["w0", "w1"]
    assert "kept w0's update" in cluster.log("coordinator", tail=400)


def test_a_round_that_cannot_be_published_stops_the_coordinator_resumably(cluster: LocalCluster, make_config,
                                                                          holds: Holds) -> None:
    """HEAD cannot be written (here: a directory stands where the file goes, which refuses the write
    as a full or failing disk would): the coordinator exits 1 at once with one line, the worker
    waits it out, and a restarted coordinator finishes the run from the old HEAD and the journal."""
    import time

    cluster.start_coordinator(make_config(
        rounds=RoundConfig(rounds=3, expected_workers=1, quorum=1, heartbeat_interval_s=0.3,
                           liveness_timeout_s=3.0)))
    port = int(cluster.address.rsplit(":", 1)[1])
    holds.hold("w0", 2)  # round 2 cannot close before HEAD is blocked
    cluster.start_worker("w0")
    run = cluster.run_dir
    cluster.wait_for(lambda s: len(s.rounds) >= 2 and phase_of(s, "w0") == (2, WorkerPhase.TRAINING), 60,
                     "round 1 to close and w0 to train round 2")
    head = run.path / "HEAD"
    saved = head.read_bytes()
    head.unlink()
    head.mkdir()  # round 2's publication cannot move HEAD
    holds.release("w0", 2)
    started = time.monotonic()
    assert cluster.wait_exit("coordinator", 60) == 1
    assert time.monotonic() - started < 30
    log = cluster.log("coordinator", tail=30)
    assert "cannot go on: round 2 was not published" in log and "Traceback" not in log
    head.rmdir()
    head.write_bytes(saved)
    cluster.start_coordinator(port=port)
    for name in ("w0", "coordinator"):
        assert cluster.wait_exit(name, 120) == 0, cluster.log(name)
    assert [m.round for _, m in lineage(run.store, run.head())] == [0, 1, 2, 3]


def test_sigterm_stops_the_coordinator_promptly_even_mid_round(cluster: LocalCluster, make_config,
                                                               holds: Holds) -> None:
    import time

    cluster.start_coordinator(make_config(
        rounds=RoundConfig(rounds=3, expected_workers=1, quorum=1, heartbeat_interval_s=0.3,
                           liveness_timeout_s=3.0)))
    holds.hold("w0", 1)  # w0 stays in round 1 until the test ends: the round is open when SIGTERM comes
    cluster.start_worker("w0")
    cluster.wait_for(lambda s: phase_of(s, "w0")[1] == WorkerPhase.TRAINING, 60, "w0 to train")
    started = time.monotonic()
    cluster.processes["coordinator"].send_signal(signal.SIGTERM)
    assert cluster.wait_exit("coordinator", 30) == 0
    assert time.monotonic() - started < 10
    assert "stopped at round 1 by a signal" in cluster.log("coordinator")
