"""``dilocox worker --stages 2``: a worker as two local pipeline-stage processes in a real cluster.

The stage processes live as long as the worker; when one dies mid-round, the worker abandons that
round (the coordinator closes it with the others at once), then rejoins with fresh stages.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from cli.cluster import LocalCluster
from proto import WorkerPhase, pb
from tests.conftest import small_config
from tests.integration.test_cluster import assert_rederivable
from trainer.config import InnerConfig, ModelConfig, RoundConfig
from trainer.net.tls import ClientTls

pytestmark = pytest.mark.integration

TINY = ModelConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)
STAGE_PID = re.compile(r"pipeline stage (\d+) of 2: pid (\d+)")


def stage_pids(cluster: LocalCluster, worker: str) -> list[tuple[int, int]]:
    """(stage, pid) of every stage process the worker has started, in order."""
    text = (cluster.run_dir.logs / f"{worker}.log").read_text(errors="replace")
    return [(int(s), int(pid)) for s, pid in STAGE_PID.findall(text)]


def alive(pid: int) -> bool:
    """Running: neither gone nor a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_with_two_stages_trains_with_a_plain_one(cluster: LocalCluster, tmp_path) -> None:
    config = tmp_path / "config.json"
    small_config(model=TINY).save(config)
    cluster.start_coordinator(config)
    cluster.start_worker("w0")
    metrics = tmp_path / "w1.jsonl"
    cluster.start_worker("w1", extra=["--stages", "2", "--metrics", str(metrics)])
    for name in ("w0", "w1", "coordinator"):
        assert cluster.wait_exit(name, 120) == 0, cluster.log(name)

    chain = assert_rederivable(cluster.run_dir)
    assert len(chain) == 3
    for _, m in chain[1:]:
        assert [p.worker for p in m.participants] == ["w0", "w1"]
        assert all(p.inner_steps == 3 and p.tokens == 3 * 4 * 32 for p in m.participants)
    # One group of stages served both rounds, and left with the worker.
    log = cluster.log("w1", tail=500)
    pids = stage_pids(cluster, "w1")
    assert [s for s, _ in pids] == [0, 1], log
    assert log.count("pipeline stages ready") == 1, log
    assert "abandoned" not in log and "fresh group" not in log
    assert not any(alive(pid) for _, pid in pids)
    # The stages started at set-up, before round 1 trained, and the start-up is reported apart.
    assert "worker w1: 2 stage(s) x 1 torch thread(s)" in log
    assert log.index("pipeline stages ready") < log.index("round 1:"), log
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    rounds = [r for r in records if r["event"] == "round"]
    assert [(r["stages"], r["threads_per_stage"]) for r in rounds] == [(2, 1), (2, 1)]
    done = records[-1]
    assert done["event"] == "finished" and done["startup_s"] > 0 and done["last_exchange_s"] > 0
    assert done["steady_compute_s"] <= done["steady_wall_s"] <= done["wall_s"]
    # wall runs from the join; start-up from the worker's start, before it: the parts fit inside.
    assert done["steady_wall_s"] + done["last_exchange_s"] <= done["wall_s"] + 1e-6
    assert done["startup_s"] + done["steady_wall_s"] + done["last_exchange_s"] >= done["wall_s"]


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) a process has used."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlapped"])
def test_a_dead_stage_drops_its_worker_from_one_round_only(cluster: LocalCluster, tmp_path,
                                                          overlap: bool) -> None:
    config = tmp_path / "config.json"
    # Quorum 1, so the round may close with w0 alone; straggler timeout far above what the test
    # waits; rounds of a second or more on two stages, to kill a stage in the middle of one.
    small_config(
        model=TINY, inner=InnerConfig(steps=100, batch_size=4, lr=1e-3),
        rounds=RoundConfig(rounds=3, expected_workers=2, quorum=1, straggler_timeout_s=120.0,
                           heartbeat_interval_s=0.2, liveness_timeout_s=10.0, overlap=overlap),
    ).save(config)
    cluster.start_coordinator(config)
    cluster.start_worker("w0")
    cluster.start_worker("w1", extra=["--stages", "2"])

    # Round 2 is under way once stage 1, idle since round 1 ended, computes again.
    deadline = time.monotonic() + 90
    while "round 1: 100 steps" not in cluster.log("w1", tail=500):
        assert time.monotonic() < deadline, cluster.log("w1")
        time.sleep(0.05)
    [victim] = [pid for s, pid in stage_pids(cluster, "w1") if s == 1]
    idle = cpu_seconds(victim)
    while cpu_seconds(victim) < idle + 0.05:
        assert time.monotonic() < deadline, cluster.log("w1")
        time.sleep(0.01)
    os.kill(victim, signal.SIGKILL)
    # The coordinator closes round 2 as soon as w0 has pushed: w1 said it abandoned it, so the
    # round does not wait for the straggler timeout (120 s).
    cluster.wait_for(lambda s: s.open_round > 2 or s.finished, 60, "round 2 to close without w1")
    for name in ("w0", "w1", "coordinator"):
        assert cluster.wait_exit(name, 120) == 0, cluster.log(name)

    chain = assert_rederivable(cluster.run_dir)
    rounds = {m.round: m for _, m in chain}
    assert sorted(rounds) == [0, 1, 2, 3]
    assert [p.worker for p in rounds[1].participants] == ["w0", "w1"]
    assert [p.worker for p in rounds[2].participants] == ["w0"] and rounds[2].dropped == ("w1",)
    assert [p.worker for p in rounds[3].participants] == ["w0", "w1"]  # back, on fresh stages

    log = cluster.log("w1", tail=500)
    assert re.search(rf"pipeline stage 1 of 2 \(pid {victim}\) died: exit code -9", log), log
    assert "round 2: abandoned, no update pushed" in log
    assert "starting a fresh group of 2 pipeline stages after a failure" in log
    pids = stage_pids(cluster, "w1")
    assert [s for s, _ in pids] == [0, 1, 0, 1], log  # started twice: at round 1, after the failure
    assert not any(alive(pid) for _, pid in pids)


def test_stages_must_split_the_model() -> None:
    from trainer.runtime.pipeline import PipelinedInnerLoop
    from trainer.worker import Worker, WorkerError

    config = small_config(model=TINY)
    for stages in (0, 3):
        worker = Worker("127.0.0.1:1", "w0", stages=stages, tls=ClientTls(insecure=True))  # no connection is made
        with pytest.raises(WorkerError, match=rf"{stages} pipeline stages: this run's model has 2 layers"):
            worker.set_up(config, 0, 2)
        worker.client.close()
    worker = Worker("127.0.0.1:1", "w0", stages=2, tls=ClientTls(insecure=True))
    odd = config.replace(inner=InnerConfig(steps=3, batch_size=3))
    with pytest.raises(WorkerError, match="batch of 3 sequences cannot be cut into 2 equal microbatches"):
        worker.set_up(odd, 0, 2)
    worker.set_up(config, 0, 2)
    assert isinstance(worker.inner, PipelinedInnerLoop) and worker.inner.group is not None  # started at set-up
    worker.inner.close()
    worker.client.close()


class _Coordinator:
    """Stands in for the coordinator's stub: records heartbeats, answers Status."""

    def __init__(self, open_round: int, workers: list) -> None:
        self.heartbeats: list = []
        self.status = pb.StatusResponse(open_round=open_round, workers=workers)

    def Heartbeat(self, request, timeout: float, metadata=()):  # noqa: N802 - the gRPC method's name
        self.heartbeats.append((request.worker_id, request.round, request.phase))
        return pb.HeartbeatResponse(open_round=self.status.open_round)

    def Status(self, request, timeout: float, metadata=()):  # noqa: N802
        return self.status


@pytest.mark.parametrize(("w0", "go_on_from"), [
    (dict(alive=True, round=2, phase=WorkerPhase.TRAINING), 2),  # w0 will deliver: wait for round 2 to close
    (dict(alive=True, round=2, phase=WorkerPhase.WAITING), 2),  # w0 has delivered
    (dict(alive=True, round=1, phase=WorkerPhase.ABANDONED), 2),  # w0 left round 1, and is about to train 2
    (dict(alive=True, round=2, phase=WorkerPhase.ABANDONED), 1),  # nobody will deliver round 2: train it again
    (dict(alive=False, round=2, phase=WorkerPhase.TRAINING), 1),
])
def test_an_abandoned_round_is_trained_again_when_no_one_else_is_on_it(w0: dict, go_on_from: int) -> None:
    from trainer.runtime.pipeline import PipelineError
    from trainer.worker import Worker

    worker = Worker("127.0.0.1:1", "w1", stages=2, tls=ClientTls(insecure=True))
    worker.client.close()
    worker.client.stub = _Coordinator(2, [pb.WorkerStatus(worker_id="w0", **w0),
                                   pb.WorkerStatus(worker_id="w1", alive=True, round=2, phase=WorkerPhase.ABANDONED)])
    assert worker.abandon(2, PipelineError("pipeline stage 1 of 2 (pid 7) died: exit code -9")) == go_on_from
    assert worker.client.stub.heartbeats == [("w1", 2, WorkerPhase.ABANDONED)]
    assert worker.client.phase is WorkerPhase.ABANDONED
