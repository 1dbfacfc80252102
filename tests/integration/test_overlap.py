"""One-step-delay overlap: the exchange of round r-1 runs while round r trains."""

from __future__ import annotations

import json
import statistics

import pytest

from audit.replay import REPLAY_TOLERANCE, Replayer, replay_run
from cli.cluster import LocalCluster
from tests.integration.test_cluster import assert_rederivable
from trainer.codec import CompressionConfig
from trainer.config import InnerConfig, RoundConfig, RunConfig
from trainer.runtime.inner import FRESH_STATE
from trainer.runtime.state_commit import state_cid

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("start", ["delayed", "eager"])
def test_overlapped_compressed_workers_train_and_the_lineage_rederives(cluster: LocalCluster, make_config,
                                                                       start: str) -> None:
    """DiLoCoX's whole exchange: overlap (either start rule), and compression both ways (the global
    update reaches a worker one round late and compressed against the round before, which it holds)."""
    cluster.start_coordinator(make_config(rounds=RoundConfig(
        rounds=3, expected_workers=2, quorum=2, overlap=True, overlap_start=start, heartbeat_interval_s=0.5,
        liveness_timeout_s=3.0), compression=CompressionConfig(enabled=True, min_rank=1, max_rank=4)))
    cluster.start_worker("w0")
    cluster.start_worker("w1")
    for name in ("w0", "w1", "coordinator"):
        assert cluster.wait_exit(name, 120) == 0, cluster.log(name)
    chain = assert_rederivable(cluster.run_dir)
    assert [m.round for _, m in chain] == [0, 1, 2, 3]
    for _, m in chain[1:]:
        assert [p.worker for p in m.participants] == ["w0", "w1"]
    assert "waited" in cluster.log("w0")
    assert f"overlapped rounds, {start} start" in cluster.log("w0")
    assert "fetching them dense" not in cluster.log("w0", tail=400)

    # The replay rebuilds an overlapped round's start from the store (delayed: θ⁽ʳ⁻²⁾ − Δ̂ᵢ⁽ʳ⁻¹⁾; eager:
    # round 2 from θ⁽⁰⁾ − cΔ̂ᵢ⁽¹⁾, round 3 with the history θ⁽⁰⁾, Δ̂ᵢ⁽¹⁾) and re-runs the work.
    manifests = {m.round: m for _, m in chain}
    config = RunConfig.from_json(cluster.run_dir.store.get_json(manifests[0].config))
    outcome = replay_run(cluster.run_dir.store, config, manifests, k=6, seed=1)
    assert not outcome.problems, outcome.problems
    rows = {(row.round, row.worker): row for row in outcome.rows}
    replayed = [key for key, row in rows.items() if row.distance is not None]
    assert sorted(replayed) == [(r, w) for r in (1, 2, 3) for w in ("w0", "w1")]
    assert all(rows[key].status == "ok" and rows[key].distance < REPLAY_TOLERANCE / 5 for key in replayed), rows
    print({key: f"{row.distance:.2e}" for key, row in sorted(rows.items())})

LINK_MBPS = 2.0


def round_timings(cluster: LocalCluster, overlap: bool, make_config, tmp_path,
                  link_mbps: float = LINK_MBPS) -> tuple[float, float, float]:
    """(median round wall time, median compute time, median transfer time) of rounds 3.. of one
    worker behind an emulated link, from its --metrics records; the transfer time is what the
    link needs for the bytes the round actually moved, 8·(sent + received) / bandwidth."""
    metrics = tmp_path / f"metrics-{'overlap' if overlap else 'sync'}.jsonl"
    cluster.start_coordinator(make_config(
        inner=InnerConfig(steps=600, batch_size=4, lr=1e-3),
        rounds=RoundConfig(rounds=5, expected_workers=1, quorum=1, overlap=overlap,
                           heartbeat_interval_s=0.5, liveness_timeout_s=5.0)))
    cluster.start_worker("w0", extra=["--link-bandwidth", str(link_mbps), "--metrics", str(metrics)])
    for name in ("w0", "coordinator"):
        assert cluster.wait_exit(name, 180) == 0, cluster.log(name)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    rounds = {r["round"]: r for r in records if r["event"] == "round"}
    # A round's record is written once it has trained and exchanged (synchronous: pushed, after
    # fetching the round before; overlapped: received the round before's exchange), so the time
    # between consecutive records is one whole round. Rounds 1-2 hold start-up and the first fetch.
    later = range(3, max(rounds) + 1)
    wall = [rounds[r]["time"] - rounds[r - 1]["time"] for r in later]
    compute = [rounds[r]["compute_s"] for r in later]
    transfer = [8 * (rounds[r]["bytes_sent"] + rounds[r]["bytes_received"]) / (link_mbps * 1e6) for r in later]
    return statistics.median(wall), statistics.median(compute), statistics.median(transfer)


@pytest.mark.alone  # compute and transfer times, measured against the machine's own load: no other test beside it
def test_overlap_hides_a_slow_link_behind_compute(make_config, tmp_path) -> None:
    # Dense updates of ~120 kB each way: about 1 s on the 2 Mbit/s link against 0.8-1.5 s of compute.
    with LocalCluster(tmp_path / "sync") as sync_cluster:
        sync_wall, sync_compute, sync_transfer = round_timings(sync_cluster, False, make_config, tmp_path)
    # The overlapped run's link is set from the synchronous run's compute and bytes, so that its
    # transfer takes about 60% of a round's compute on whatever machine runs the test.
    link_mbps = LINK_MBPS * sync_transfer / (0.6 * sync_compute)
    with LocalCluster(tmp_path / "overlap") as overlap_cluster:
        wall, compute, transfer = round_timings(overlap_cluster, True, make_config, tmp_path, link_mbps)
    figures = (f"synchronous: round {sync_wall:.2f}s, compute {sync_compute:.2f}s, transfer {sync_transfer:.2f}s; "
               f"overlapped: round {wall:.2f}s, compute {compute:.2f}s, transfer {transfer:.2f}s")
    print(figures)
    # The regime under test: the transfer is a sizeable part of a round, yet shorter than its
    # compute, so that overlap can hide all of it.
    assert 0.4 * compute < transfer < compute, figures
    # Synchronous rounds pay compute and transfer one after the other ...
    assert sync_wall > sync_compute + 0.8 * sync_transfer, figures
    # ... overlapped ones only compute: the exchange runs meanwhile.
    assert wall < compute + 0.4 * transfer, figures


def test_an_overlapped_straggler_starts_over_fresh_and_every_contribution_replays(cluster: LocalCluster, make_config,
                                                                                  holds) -> None:
    """Issue 28. w1 is held before round 1's inner steps until round 1 has closed on w0 alone; it then
    trains round 1 and, overlapped, round 2 on it, while its round-1 push is refused as stale. It drops
    both, rewinds its inner state (trainer.worker.loops.overlapped) and starts over from the newest
    global state: its first counted round commits a fresh state, the eager start after it has no
    history. w0, held before round 3 until round 3 closed on w1, has its round-3 push refused in turn
    and rewinds to its state after round 2. The replay rebuilds every contribution of the run (before,
    a round after a refused one was "not replayable", or failed as "not fresh").

    With ``rounds.state_every`` = 3 (windows [0, 3), [3, 6)) w0, absent from round 3, uploads its state at
    its next counted round instead (trainer.runtime.state_commit.state_due), so no chain the replay
    builds is longer than 3 (under the old rule, r % K == 0, w0 stored nothing in this run and its
    chain ran from round 1 through every later round of its)."""
    every = 3
    cluster.start_coordinator(make_config(rounds=RoundConfig(
        rounds=5, expected_workers=2, quorum=1, overlap=True, overlap_start="eager", straggler_timeout_s=5.0,
        heartbeat_interval_s=0.5, liveness_timeout_s=3.0, state_every=every)))
    holds.hold("w1", 1)
    holds.hold("w0", 3)  # so that round 3 waits for w0 and w1's fresh start counts in it
    holds.hold("w1", 5)  # so that round 5 waits for w1 and w0's start after its refusal counts by then
    cluster.start_worker("w0")
    cluster.start_worker("w1")
    cluster.wait_for(lambda s: len(s.rounds) >= 2, 60, "round 1 to close on w0 alone")
    holds.release("w1", 1)
    # w0's round 3 is refused in its turn: w0's chain replays across its refused push
    cluster.wait_for(lambda s: len(s.rounds) >= 4, 60, "round 3 to close on w1 alone")
    holds.release("w0", 3)
    cluster.wait_for(lambda s: len(s.rounds) >= 6, 60, "round 5 to close")
    holds.release("w1", 5)
    for name in ("w0", "w1", "coordinator"):
        assert cluster.wait_exit(name, 120) == 0, cluster.log(name)
    assert "round 1's push was refused" in cluster.log("w1", tail=400)
    assert "round 3's push was refused" in cluster.log("w0", tail=400)

    chain = assert_rederivable(cluster.run_dir)
    manifests = {m.round: m for _, m in chain}
    counted = [r for r in range(1, 6) if any(p.worker == "w1" for p in manifests[r].participants)]
    again = [r for r in range(3, 6) if any(p.worker == "w0" for p in manifests[r].participants)]
    assert again and again[0] > 3, [[p.worker for p in m.participants] for m in manifests.values()]
    assert 1 not in counted and 3 in counted, cluster.log("w1", tail=60) + cluster.log("coordinator", tail=60)
    first = {p.worker: p for p in manifests[counted[0]].participants}["w1"]
    assert first.state == FRESH_STATE  # nothing of w1's counted before: it starts over fresh
    config = RunConfig.from_json(cluster.run_dir.store.get_json(manifests[0].config))
    outcome = replay_run(cluster.run_dir.store, config, manifests, k=16, seed=1)
    assert not outcome.problems, outcome.problems
    assert outcome.not_replayed == {} and outcome.not_replayed_line() is None
    everyone = sorted((r, p.worker) for r, m in manifests.items() if r > 0 for p in m.participants)
    assert sorted((row.round, row.worker) for row in outcome.rows) == everyone
    assert all(row.status == "ok" and row.distance < REPLAY_TOLERANCE / 5 for row in outcome.rows), outcome.rows
    print({(row.round, row.worker): f"{row.distance:.2e}" for row in outcome.rows})
    replayer = Replayer(cluster.run_dir.store, config, manifests, worker_kernels=False)
    chains = {(r, w): replayer.chain(r, w) for r, w in everyone}
    assert max(len(c) for c in chains.values()) <= every, chains
    assert cluster.run_dir.store.has(state_cid(next(p.state for p in manifests[again[0]].participants
                                                    if p.worker == "w0")))  # w0's first of window [3, 6)
