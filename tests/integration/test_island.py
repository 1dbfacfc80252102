"""A worker that is an island (trainer.runtime.island): ``dilocox worker --data-parallel 2`` (two
DDP ranks) and ``--data-parallel 2 --stages 2`` (2 replicas × 2 pipeline stages: four ranks) in one
real run (TLS, dev attestation, a chain), each presenting one identity, one attestation and one
update a round, with Muon inner steps; then ``dilocox audit --replay`` re-derives every contribution
of both bit for bit, and a 1.5 × update pushed under an island's kernels is named.

One run serves the cluster tests here (module scope): the tiny model, one round of 3 steps (an
island's AdamW state carried across rounds, and undone, is checked bit for bit without a cluster,
by the 3-replica test at the end).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Iterator

import pytest
import torch

from audit.replay import Replayer
from audit.replay_env import EXACT_TOLERANCE
from cli.cluster import LocalCluster, provision
from cli.main import main
from settlement import Anvil
from storage_client import Codec, Kernels, Manifest, lineage
from tests.conftest import small_config
from trainer.codec.uplink import encode_slice
from trainer.codec.wire import decode_params, layout_of
from trainer.config import InnerConfig, ModelConfig, RunConfig
from trainer.data.corpus import load_corpus
from trainer.model.gpt import build_model
from trainer.model.params import params_of
from trainer.model.stages import stage_param_names
from trainer.rounds.update_source import dense
from trainer.runstore.run_dir import RunDir
from trainer.runstore.update_record import open_update, parse_record, record_of_slices
from trainer.runtime.inner import InnerLoop, inner_state_digest
from trainer.runtime.pipeline import PipelinedInnerLoop, PipelineError, run_round
from trainer.runtime.staged import staged_arithmetic

pytestmark = pytest.mark.integration

TINY = ModelConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)
ISLANDS = {"ddp": ["--data-parallel", "2"], "ddpxpp": ["--data-parallel", "2", "--stages", "2"]}
RANK_PID = re.compile(r"(data-parallel replica \d of 2(?:, pipeline stage \d of 2)?): pid (\d+)")


@dataclasses.dataclass(frozen=True)
class IslandRun:
    run: RunDir
    manifests: dict[int, Manifest]
    config: RunConfig
    audit: dict
    logs: dict[str, str]


@pytest.fixture(scope="module")
def island_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IslandRun]:
    tmp = tmp_path_factory.mktemp("island")
    config = small_config(model=TINY)
    # Muon inner steps (trainer.runtime.muon): each stage's optimiser trains its slice's matrices by the
    # same rule on names, and the replay re-runs it; the 3-replica test below keeps AdamW.
    config = config.replace(rounds=dataclasses.replace(config.rounds, rounds=1),
                            inner=dataclasses.replace(config.inner, optimizer="muon", muon_lr=2e-3))
    corpus = load_corpus(config.data, config.seed, config.model.block_size)
    config = config.replace(data=dataclasses.replace(config.data, corpus_sha256=corpus.sha256))
    path = tmp / "config.json"
    config.save(path)
    audited = tmp / "audit.json"
    with LocalCluster(tmp / "run") as cluster, \
            Anvil(state_file=cluster.run_dir.path / "chain" / "state.json") as anvil:
        co_args, wo_args = provision(cluster.run_dir.path, anvil.rpc_url, config)
        cluster.start_coordinator(path, extra=[*co_args, "--report-timeout", "10"])
        for worker, extra in ISLANDS.items():
            cluster.start_worker(worker, extra=[*wo_args, *extra])
        for name in (*ISLANDS, "coordinator"):
            assert cluster.wait_exit(name, 180) == 0, cluster.log(name)
        # Every contribution (1 round × 2 workers) sampled: the replay runs in the islands' kernels.
        assert main(["audit", "--run", str(cluster.run_dir.path), "--rpc", anvil.rpc_url, "--allow-dev",
                     "--replay", "2", "--replay-seed", "1", "--json", str(audited)]) == 0
        chain = lineage(cluster.run_dir.store, cluster.run_dir.head())
        manifests = {m.round: m for _, m in chain}
        logs = {w: cluster.log(w, tail=400) for w in ISLANDS}
        yield IslandRun(cluster.run_dir, manifests, config, json.loads(audited.read_text()), logs)


def test_each_island_pushes_one_update_a_round_under_one_identity(island_run: IslandRun) -> None:
    threads = Kernels(torch.backends.cpu.get_cpu_capability().lower(), 1, data_parallel=2)
    for r in (1,):
        participants = {p.worker: p for p in island_run.manifests[r].participants}
        assert sorted(participants) == sorted(ISLANDS)
        for worker, p in participants.items():
            # The ranks each ran 1 thread (cli.cluster: --threads 1 for the worker's whole island).
            assert p.kernels == threads, (worker, p.kernels)
            assert p.tokens == 3 * 4 * 32 and p.inner_steps == 3
        refs = {w: parse_record(island_run.run.store.get(p.update)) for w, p in participants.items()}
        assert [ref.num_stages for ref in refs["ddp"]] == [1]  # rank 0's one update
        assert [(ref.stage, ref.num_stages) for ref in refs["ddpxpp"]] == [(0, 2), (1, 2)]  # replica 0's stages
    ranks = {w: sorted(name for name, _ in RANK_PID.findall(log)) for w, log in island_run.logs.items()}
    assert ranks == {"ddp": ["data-parallel replica 0 of 2", "data-parallel replica 1 of 2"],
                     "ddpxpp": sorted(f"data-parallel replica {k} of 2, pipeline stage {s} of 2"
                                      for k in (0, 1) for s in (0, 1))}, island_run.logs
    assert "worker ddpxpp: 2 data-parallel replica(s) x 2 stage(s) x 1 torch thread(s)" in island_run.logs["ddpxpp"]


def test_the_audit_replays_every_island_contribution_bit_for_bit(island_run: IslandRun) -> None:
    audit = island_run.audit
    assert audit["ok"] and not audit["failures"], audit["failures"]
    rows = {(row["round"], row["worker"]): row for row in audit["replay"]["contributions"]}
    capability = torch.backends.cpu.get_cpu_capability().lower()
    assert sorted(rows) == [(1, w) for w in sorted(ISLANDS)]
    for key, row in rows.items():
        assert (row["status"], row["distance"]) == ("ok", 0.0), (key, row)
        assert row["tolerance"] == EXACT_TOLERANCE and row["kernels"] == f"worker's ({capability}, 1 thread)", row


def test_an_update_scaled_under_an_islands_kernels_is_named(island_run: IslandRun) -> None:
    """The 2 × 2 island's round-1 update, pushed 1.5 × (its own slices, dense), in its place: the
    replay of the island's arithmetic names it (here in this process's kernels: the fallback)."""
    store, config = island_run.run.store, island_run.config
    honest = next(p for p in island_run.manifests[1].participants if p.worker == "ddpxpp")
    genesis = decode_params(store.get(island_run.manifests[0].params))
    delta = dense(open_update(store, honest.update, layout_of(genesis), config.model))
    slices = [encode_slice({n: 1.5 * delta[n] for n in names}, s, 2, None)
              for s, names in enumerate(stage_param_names(config.model, 2))]
    for piece in slices:
        store.put(piece.payload)
    forged = dataclasses.replace(honest, update=str(store.put(record_of_slices(slices), Codec.JSON)))
    manifests = dict(island_run.manifests)
    manifests[1] = dataclasses.replace(manifests[1], participants=tuple(
        forged if p.worker == "ddpxpp" else p for p in manifests[1].participants))
    replayer = Replayer(store, config, manifests, worker_kernels=False)
    rows, _ = replayer.replay([(1, "ddpxpp")])
    assert not replayer.problems, replayer.problems
    assert [(row.round, row.worker, row.status) for row in rows] == [(1, "ddpxpp", "MISMATCH")]
    assert rows[0].distance > 0.3  # ‖Δ − 1.5Δ‖ / ‖1.5Δ‖ = 1/3


def _diverging_after_three(runner, job) -> dict:
    """run_round, except that from the group's 4th round on, replica 1 reports another Δ than it
    computed (as a replica whose arithmetic went its own way would)."""
    out = run_round(runner, job)
    if runner.replica == 1 and job.seq > 3:
        out["delta_sha256"] = "0" * 64
    return out


def test_three_replicas_train_like_the_replay_bit_for_bit_and_an_undone_round_is_gone() -> None:
    """N = 3, where a ring all-reduce would add in an order of its own: the island's rank-order mean
    (trainer.runtime.island) gives the one-process replay arithmetic's Δ bit for bit, round after
    round (grad clip active), with the same state digest at every round's start, and a round undone
    on every replica (a refused push) leaves no trace. A replica that ends a round elsewhere than
    replica 0 fails it by name."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        inner = InnerConfig(steps=3, batch_size=6, lr=1e-3)
        model = ModelConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
        start = params_of(build_model(model, 3))
        reference = InnerLoop(build_model(model, 3), inner)
        arithmetic = staged_arithmetic(model, 1, replicas=3)
        g = torch.Generator().manual_seed(5)
        with PipelinedInnerLoop(model, inner, 1, timeout_s=20, deadline_s=60, threads_per_stage=1,
                                replicas=3, round_fn=_diverging_after_three) as island:
            for round_ in range(3):
                batches = [(torch.randint(model.vocab_size, (6, 16), generator=g),
                            torch.randint(model.vocab_size, (6, 16), generator=g)) for _ in range(inner.steps)]
                before, snapshot = reference.state(), reference.snapshot()
                want = reference.run(start, batches, staged=arithmetic)
                got = island.run(start, batches)
                assert inner_state_digest(got.start_state) == inner_state_digest(before), round_
                assert all(torch.equal(got.pseudo_gradient[n], want.pseudo_gradient[n]) for n in start), round_
                assert got.kernels is not None and got.kernels.data_parallel == 3
                if round_ == 1:  # does not count: every replica goes back to where it started
                    island.undo(got.start_state)
                    reference.restore(snapshot)
                start = {n: p - 0.7 * got.pseudo_gradient[n] for n, p in start.items()}
            assert island.last is not None and island.last.optimizer_steps == [inner.steps * 2]
            with pytest.raises(PipelineError, match="data-parallel replica 1 of 3 ended the round at other parameters"):
                island.run(start, batches)
    finally:
        torch.set_num_threads(threads)

