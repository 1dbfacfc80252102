"""``dilocox audit --replay``: the work itself re-checked, on a real run.

An honest worker process ("w0") and four dishonest clients train together (benchmarks.hostile:
each computes the update an honest worker on its shard would, as a worker does, and commits its
inner state like one). Each cheats in one way, inside every bound the coordinator enforces:

    scaled   pushes 1.5 × its update
    noisy    adds Gaussian noise of half its update's norm
    lazy     trains H/2 steps and claims H
    stale    trains from the checkpoint before the round's (from round 2 on) and names the round's

The coordinator accepts all of them (their norms are within the clip's reach); the replay names
every dishonest contribution, with its round and distance, and passes every honest one, including
w0's, computed in another process.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from audit.replay import REPLAY_TOLERANCE, Replayer, replay_run
from audit.replay_env import EXACT_TOLERANCE
from benchmarks.hostile import Heartbeats, Mallory, Trainer
from cli.cluster import LocalCluster
from storage_client import Kernels, lineage
from trainer.codec import CompressionConfig
from trainer.config import InnerConfig, ModelConfig, RoundConfig, RunConfig
from trainer.model.stages import stage_param_names
from trainer.runstore.gc import reachable
from trainer.runtime.state_commit import state_cid

pytestmark = pytest.mark.integration

CHEATS = ("lazy", "noisy", "scaled", "stale")
ROUNDS = 3
REPO = Path(__file__).resolve().parents[2]
# An auditor's process: ``replay_run`` of the run (audit.replay) with k = argv[2], its rows as JSON.
_AUDITOR = """
import json, sys
import torch
from audit.replay import replay_run
from storage_client import lineage
from trainer.config import RunConfig
from trainer.runstore.run_dir import RunDir
from trainer.runtime.kernels import current_kernels
run = RunDir(sys.argv[1])
manifests = {m.round: m for _, m in lineage(run.store, run.head())}
config = RunConfig.from_json(run.store.get_json(manifests[0].config))
outcome = replay_run(run.store, config, manifests, k=int(sys.argv[2]), seed=1)
print(json.dumps({"auditor": str(current_kernels(torch.device("cpu"))), "problems": outcome.problems,
                  "rows": [row.to_json() for row in outcome.rows]}))
"""


@pytest.mark.parametrize("compressed, codec", [(False, "lowrank-int4"), (True, "lowrank-int4"), (True, "topk")],
                         ids=["dense", "compressed", "topk"])
def test_the_replay_names_scaled_noisy_lazy_and_stale_updates(cluster: LocalCluster, make_config,
                                                              compressed: bool, codec: str) -> None:
    """Compressed: each update is decompress(C(Δ + e)); the cheats feed their lie to their own
    compressor, so their error feedback stays consistent with it, and the replay rebuilds each
    worker's e along its chain (audit.replay)."""
    cluster.start_coordinator(make_config(
        inner=InnerConfig(steps=12, batch_size=4, lr=1e-3),
        rounds=RoundConfig(rounds=ROUNDS, expected_workers=5, quorum=5, straggler_timeout_s=120.0,
                           heartbeat_interval_s=0.5, liveness_timeout_s=10.0, max_update_norm=1000.0),
        # top-k as SparseLoCo runs it: A = Δ + β·e (β < 1), the broadcast the whole average of the top-k updates
        compression=CompressionConfig(enabled=compressed, min_rank=2, max_rank=8, codec=codec, topk_density=0.1,
                                      error_decay=0.9 if codec == "topk" else 1.0,
                                      topk_downlink_union=codec == "topk")))
    clients = {name: Mallory.joined(cluster, name) for name in CHEATS}
    trainers = {name: Trainer(m, cluster) for name, m in clients.items()}
    cluster.start_worker("w0")
    noise = torch.Generator().manual_seed(7)
    held: dict[str, dict] = {}  # the checkpoint each client fetched last round (what "stale" trains from)
    beats = [Heartbeats(m, 0.5).__enter__() for m in clients.values()]
    try:
        for r in range(1, ROUNDS + 1):
            for name, m in clients.items():
                t = trainers[name]
                base, params = t.fetch(r - 1)
                start = held.get(name, params) if name == "stale" else params
                delta = t.train(start, r, steps=m.config.inner.steps // 2 if name == "lazy" else None)
                held[name] = params
                if name == "scaled":
                    delta = {k: 1.5 * v for k, v in delta.items()}
                elif name == "noisy":
                    norm = math.sqrt(sum(float(v.double().square().sum()) for v in delta.values()))
                    size = sum(v.numel() for v in delta.values())
                    delta = {k: v + 0.5 * norm / math.sqrt(size) * torch.randn(v.shape, generator=noise)
                             for k, v in delta.items()}
                sent = t.compressed(delta) if compressed else {"tensors": delta}
                m.push(**sent, round=r, base_params_cid=base, train_loss=t.loss, inner_state_sha256=t.state,
                       base_bytes_received=t.received[base])
            cluster.wait_for(lambda s, r=r: len(s.rounds) > r, 120, f"round {r} to close")
    finally:
        for beat in beats:
            beat.__exit__(None, None, None)
    assert cluster.wait_exit("w0", 120) == 0, cluster.log("w0")
    assert cluster.wait_exit("coordinator", 60) == 0, cluster.log("coordinator")

    chain = lineage(cluster.run_dir.store, cluster.run_dir.head())
    manifests = {m.round: m for _, m in chain}
    assert all(len(manifests[r].participants) == 5 for r in range(1, ROUNDS + 1))  # every cheat was accepted
    config = RunConfig.from_json(cluster.run_dir.store.get_json(manifests[0].config))
    outcome = replay_run(cluster.run_dir.store, config, manifests, k=5 * ROUNDS, seed=1)
    assert not outcome.problems, outcome.problems
    verdict = {(row.round, row.worker): row for row in outcome.rows}
    assert len(verdict) == 5 * ROUNDS and all(row.sampled for row in outcome.rows)
    for (r, worker), row in sorted(verdict.items()):
        print(f"round {r} {worker:>6}: distance {row.distance:.3g} {row.status}")
    honest = [(r, "w0") for r in range(1, ROUNDS + 1)] + [(1, "stale")]  # round 1's "stale" start is current
    for key in honest:
        assert verdict[key].status == "ok", (key, verdict[key])
        assert verdict[key].distance < REPLAY_TOLERANCE / 5  # far inside the tolerance
    for key, row in verdict.items():
        if key not in honest:
            assert row.status == "MISMATCH", (key, row)
            assert row.distance > 2 * REPLAY_TOLERANCE  # far outside it
    # Re-scoring: every round's held-out loss, recomputed, is the manifest's.
    assert sorted(s.round for s in outcome.rescored) == list(range(1, ROUNDS + 1))
    assert all(s.ok for s in outcome.rescored)
    assert outcome.steps == outcome.checked_steps == 5 * ROUNDS * config.inner.steps



def test_workers_of_two_stages_are_replayed_and_a_scaled_one_is_named(cluster: LocalCluster, make_config) -> None:
    """No way out of the sample: an honest ``dilocox worker --stages 2`` commits its inner state
    (its two stage processes' AdamW states and their error feedback, one digest) and is replayed,
    round after round, in one process with the stages' arithmetic (trainer.runtime.staged); a
    client that trains as a two-stage worker and pushes 1.5 × its update as two compressed stage
    slices (its error feedback consistent with its lie) is named in every round. Compressed, so
    that the commitment and the replay of each stage's error feedback are checked too (the dense
    stages are checked bit for bit in tests/integration/test_pipeline.py).

    With ``rounds.state_every`` = 2 both send their round-2 inner state with the push, the
    coordinator stores it by CID (trainer.runtime.state_commit), and a replay of round 3 starts there:
    2 rounds of history, not 3; it names the cheat all the same. A push of round 2 without its
    state, or with bytes that are not its commitment, is refused.

    w0 records its kernels (trainer.runtime.kernels: those its two stage processes ran), so an auditor
    whose process runs other kernels (another ATEN_CPU_CAPABILITY, 2 threads: a process of its own)
    replays w0's rounds in w0's, in a replay child, with d = 0; the cheat names none, and is replayed
    in the auditor's own kernels and named all the same."""
    rounds = 3
    cluster.start_coordinator(make_config(
        model=ModelConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),
        inner=InnerConfig(steps=8, batch_size=4, lr=1e-3),
        rounds=RoundConfig(rounds=rounds, expected_workers=2, quorum=2, straggler_timeout_s=120.0,
                           heartbeat_interval_s=0.5, liveness_timeout_s=10.0, max_update_norm=1000.0,
                           state_every=2),
        compression=CompressionConfig(enabled=True, min_rank=2, max_rank=8)))
    m = Mallory.joined(cluster, "scaled")
    trainer = Trainer(m, cluster, stages=2)
    cluster.start_worker("w0", extra=["--stages", "2"])
    names = stage_param_names(m.config.model, 2)
    with Heartbeats(m, 0.5):
        for r in range(1, rounds + 1):
            base, params = trainer.fetch(r - 1)
            delta = {k: 1.5 * v for k, v in trainer.train(params, r).items()}
            pieces = [trainer.compressed({n: delta[n] for n in stage_names}) for stage_names in names]
            claims = dict(round=r, num_stages=2, base_params_cid=base, train_loss=trainer.loss,
                          inner_state_sha256=trainer.state, base_bytes_received=trainer.received[base],
                          cpu_capability="", intra_op_threads=0)  # no kernels named: replayed in the auditor's
            state = trainer.state_bytes if r == 2 else b""
            if r == 2:
                assert "must carry it" in m.refused(grpc.StatusCode.INVALID_ARGUMENT, **pieces[0], stage=0, **claims)
                assert "digest mismatch" in m.refused(grpc.StatusCode.INVALID_ARGUMENT, **pieces[0], stage=0,
                                                      state=state[:-1] + b"\0", **claims)
                # Bytes that hash to what their header commits to but are not a state's canonical file:
                # refused by name, from the coordinator's spool (none is left once the run ends, below).
                forged = state + b"\0" * 8
                assert "its header describes" in m.refused(
                    grpc.StatusCode.INVALID_ARGUMENT, **pieces[0], stage=0, state=forged,
                    **{**claims, "inner_state_sha256": hashlib.sha256(forged).hexdigest()})
            for s, piece in enumerate(pieces):
                m.push(**piece, stage=s, state=state if s == 0 else b"", **claims)
            cluster.wait_for(lambda st, r=r: len(st.rounds) > r, 120, f"round {r} to close")
    assert cluster.wait_exit("w0", 120) == 0, cluster.log("w0")
    assert cluster.wait_exit("coordinator", 60) == 0, cluster.log("coordinator")
    assert not list((cluster.run_dir.path / "scratch").glob("*"))  # every spool, refused or stored, removed

    chain = lineage(cluster.run_dir.store, cluster.run_dir.head())
    manifests = {m.round: m for _, m in chain}
    assert all(p.state is not None for r in range(1, rounds + 1) for p in manifests[r].participants)
    config = RunConfig.from_json(cluster.run_dir.store.get_json(manifests[0].config))
    outcome, kernels = _replayed_by_another_auditor(cluster, manifests, rounds)
    verdict = {(row["round"], row["worker"]): row for row in outcome["rows"]}
    for (r, worker), row in sorted(verdict.items()):
        print(f"round {r} {worker:>6}: distance {row['distance']:.3g} {row['status']} ({row['kernels']})")
    assert sorted(verdict) == [(r, w) for r in range(1, rounds + 1) for w in ("scaled", "w0")]
    for r in range(1, rounds + 1):
        # In the kernels w0's stages ran, the replay is the worker's arithmetic bit for bit: its update
        # is the codec's best at the update's ranks (d = 0), whatever kernels the auditor's process runs.
        assert (verdict[(r, "w0")]["status"], verdict[(r, "w0")]["distance"], verdict[(r, "w0")]["tolerance"],
                verdict[(r, "w0")]["kernels"]) == ("ok", 0.0, EXACT_TOLERANCE, f"worker's ({kernels})")
        assert verdict[(r, "scaled")]["status"] == "MISMATCH" and verdict[(r, "scaled")]["distance"] > 0.2
        assert verdict[(r, "scaled")]["kernels"].startswith(f"auditor's ({outcome['auditor']}): no kernels recorded")

    # Round 3 replays from the stored round-2 states: two rounds each, not the whole history.
    # (In this process's kernels: the chains are what is checked here, and no replay child is started.)
    replayer = Replayer(cluster.run_dir.store, config, manifests, worker_kernels=False)
    assert all(cluster.run_dir.store.has(state_cid(p.state)) for p in manifests[2].participants)
    assert {p.state for p in manifests[2].participants} <= reachable(cluster.run_dir)  # dilocox gc keeps them
    assert replayer.chain(3, "w0") == replayer.chain(3, "scaled") == [2, 3]
    bounded, steps = replayer.replay([(3, "w0"), (3, "scaled")])
    assert not replayer.problems, replayer.problems
    assert steps == 2 * 2 * config.inner.steps
    assert [(row.round, row.worker, row.status) for row in bounded] == [
        (2, "scaled", "MISMATCH"), (2, "w0", "ok"), (3, "scaled", "MISMATCH"), (3, "w0", "ok")]
    assert bounded[3].distance < REPLAY_TOLERANCE / 5
    # A stored state gone from the store is named, and the chain goes back further (to round 1).
    lost = manifests[2].participants[0]
    cluster.run_dir.store.path_of(state_cid(lost.state)).unlink()
    longer = Replayer(cluster.run_dir.store, config, manifests, worker_kernels=False)
    assert longer.chain(3, lost.worker) == [1, 2, 3]
    longer.replay([(3, lost.worker)])
    assert [(r, message) for r, _, message in longer.problems] == [
        (2, f"{lost.worker}'s inner state of round 2, its first counted contribution in rounds 2..3 "
            f"(rounds.state_every 2), is not in the store")]


def _replayed_by_another_auditor(cluster: LocalCluster, manifests: dict, rounds: int) -> tuple[dict, Kernels]:
    """``replay_run`` of every contribution by an auditor whose process runs other kernels than the
    ones w0 (two stage processes) recorded: another capability, 2 threads. Its answer, and w0's kernels."""
    recorded = {p.kernels for r in range(1, rounds + 1) for p in manifests[r].participants if p.worker == "w0"}
    assert recorded == {Kernels(torch.backends.cpu.get_cpu_capability().lower(), 1)}, recorded  # cli.cluster: --threads 1
    assert all(p.kernels is None for r in range(1, rounds + 1) for p in manifests[r].participants if p.worker != "w0")
    (kernels,) = recorded
    other = "default" if kernels.capability != "default" else "avx2"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(ATEN_CPU_CAPABILITY=other, OMP_NUM_THREADS="2", PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", _AUDITOR, str(cluster.run_dir.path), str(2 * rounds)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["auditor"] == f"{other}, 2 threads" and not outcome["problems"], outcome
    return outcome, kernels
