"""DiLoCoX's adaptive number of inner steps on a real run: H_r falls with the downlink's rank,
every worker trains it, the coordinator records it, and the audit re-derives it from the store."""

from __future__ import annotations

import json

import pytest

from audit.replay import replay_run
from cli.cluster import LocalCluster
from storage_client import lineage
from tests.integration.test_cluster import assert_rederivable
from trainer.codec import CompressionConfig
from trainer.codec.wire import decode_params, layout_of
from trainer.config import InnerConfig, ModelConfig, RoundConfig, RunConfig
from trainer.rounds.schedule import round_tokens, stored_inner_steps

pytestmark = pytest.mark.integration

ROUNDS = 5


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlapped"])
def test_inner_steps_follow_the_downlink_rank_and_the_audit_rederives_them(cluster: LocalCluster, make_config,
                                                                           tmp_path, overlap: bool) -> None:
    """Overlapped, a worker trains round r from θ⁽ʳ⁻²⁾, whose header it holds: the same rule; w1 then
    runs two pipeline stages."""
    metrics = tmp_path / "w0.jsonl"
    # A low target energy keeps the downlink's ranks under r_max = 4, so ρ < 1 and H_r < H = 8.
    cluster.start_coordinator(make_config(
        model=ModelConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),  # two layers: two stages
        inner=InnerConfig(steps=8, min_steps=2, batch_size=4, lr=1e-3, adaptive_steps=True),
        rounds=RoundConfig(rounds=ROUNDS, expected_workers=2, quorum=2, overlap=overlap,
                           heartbeat_interval_s=0.5, liveness_timeout_s=5.0),
        compression=CompressionConfig(enabled=True, min_rank=1, max_rank=4, target_energy=0.05)))
    cluster.start_worker("w0", extra=["--metrics", str(metrics)])
    # Overlapped, w1 trains as two pipeline stages: the stages run the round's H_r steps too.
    cluster.start_worker("w1", extra=["--stages", "2"] if overlap else [])
    for name in ("w0", "w1", "coordinator"):
        assert cluster.wait_exit(name, 120) == 0, cluster.log(name)
    assert_rederivable(cluster.run_dir)
    store = cluster.run_dir.store
    chain = lineage(store, cluster.run_dir.head())
    manifests = {m.round: m for _, m in chain}
    config = RunConfig.from_json(store.get_json(manifests[0].config))
    layout = layout_of(decode_params(store.get(manifests[0].params)))
    steps = {r: stored_inner_steps(config, r, manifests, store, layout) for r in range(1, ROUNDS + 1)}
    print(f"H_r by round: {steps}")
    assert steps[1] == steps[2] == 8 and min(steps.values()) < 8, steps
    assert all(2 <= s <= 8 for s in steps.values())
    for r in range(1, ROUNDS + 1):  # what the coordinator recorded is what the store derives
        assert [p.worker for p in manifests[r].participants] == ["w0", "w1"]
        assert {(p.inner_steps, p.tokens) for p in manifests[r].participants} == \
            {(steps[r], round_tokens(config, steps[r]))}, r
    records = {rec["round"]: rec for rec in map(json.loads, metrics.read_text().splitlines())
               if rec["event"] == "round"}
    assert {r: rec["inner_steps"] for r, rec in records.items()} == steps
    assert records[1]["rank_fraction"] is None and all(0 < records[r]["rank_fraction"] <= 1 for r in (3, 4, 5))
    assert "derived, rank fraction" in cluster.log("w0", tail=400)
    if overlap:  # overlapped contributions start from the worker's own previous end: not replayable
        return
    # The audit's replay trains each contribution's H_r steps again and finds every one honest.
    outcome = replay_run(store, config, manifests, k=2 * ROUNDS, seed=1)
    assert not outcome.problems, outcome.problems
    assert all(row.status == "ok" for row in outcome.rows), outcome.rows
    assert outcome.steps == outcome.checked_steps == 2 * sum(steps.values())
