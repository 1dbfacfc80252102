"""Reports never wait on training: an overlapped run whose rounds train longer than the report
timeout still has every honest worker's signed report of every round on the ledger. And honest
claims are not refused at a large H: the run's workers overfit their shards (a high inner learning
rate over 1,000 steps), so their mean train loss falls far below the held-out loss of the round's
start, which is honest (trainer.coordinator.checks.check_form).

The coordinator records round r ``--report-timeout`` after publishing θ⁽ʳ⁾, with the reports it
holds by then (settlement.report_book); an overlapped worker reports round r from its exchange thread
as soon as it holds and has checked θ⁽ʳ⁾, while round r+1 trains (trainer.worker.loops). Real
anvil, contracts, coordinator and worker processes, as tests/integration/test_trust.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.cluster import LocalCluster, provision
from settlement import Anvil
from storage_client import lineage
from tests.conftest import small_config
from tests.integration.test_trust import ledger_of, pinned
from trainer.config import InnerConfig, RoundConfig

pytestmark = pytest.mark.integration

REPORT_TIMEOUT_S = 1.0
ROUNDS = 4


def test_rounds_that_train_longer_than_the_report_timeout_credit_every_worker(cluster: LocalCluster, chain: Anvil,
                                                                               tmp_path: Path) -> None:
    config = pinned(small_config(
        inner=InnerConfig(steps=1000, batch_size=4, lr=1e-2),
        rounds=RoundConfig(rounds=ROUNDS, expected_workers=2, quorum=2, overlap=True, straggler_timeout_s=60.0,
                           heartbeat_interval_s=0.5, liveness_timeout_s=5.0)))
    path = tmp_path / "config.json"
    config.save(path)
    co_args, wo_args = provision(cluster.run_dir.path, chain.rpc_url, config)
    cluster.start_coordinator(path, extra=[*co_args, "--report-timeout", str(REPORT_TIMEOUT_S)])
    for name in ("w0", "w1"):
        cluster.start_worker(name, extra=[*wo_args, "--metrics", str(tmp_path / f"{name}.jsonl")])
    for name in ("w0", "w1", "coordinator"):
        assert cluster.wait_exit(name, 120) == 0, cluster.log(name)

    # The regime under test: every round of every worker trained longer than the report timeout,
    # so a report sent after the next round's training would come too late.
    for name in ("w0", "w1"):
        records = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        trained = {r["round"]: r["compute_s"] for r in records if r["event"] == "round"}
        print(name, {r: f"{s:.2f}s" for r, s in sorted(trained.items())})
        assert sorted(trained) == list(range(1, ROUNDS + 1)) and min(trained.values()) > REPORT_TIMEOUT_S, trained
        assert "report refused" not in cluster.log(name, tail=400)
    assert "unreported" not in cluster.log("coordinator", tail=400)

    ledger, run_id = ledger_of(cluster, chain)
    recorded = ledger.recorded_rounds(run_id)
    manifests = lineage(cluster.run_dir.store, cluster.run_dir.head())[1:]
    assert [r.round for r in recorded] == list(range(1, ROUNDS + 1))
    for record, (_, manifest) in zip(recorded, manifests, strict=True):
        assert len(manifest.participants) == 2
        # As many signed reports as updates, none on the coordinator's word alone.
        assert (len(record.reports), record.unreported_count, record.unreported) == (2, 0, ()), record
    workers = {signed.report.worker for record in recorded for signed in record.reports}
    assert len(workers) == 2
    for worker in workers:
        assert ledger.contribution_of(run_id, worker).rounds == ROUNDS

    # Every push was accepted, though some claim a train loss below a fifth of the held-out loss of
    # the checkpoint the round opened on (the band this check once had refused them).
    eval_loss = {m.round: m.eval_loss_e6 for _, m in lineage(cluster.run_dir.store, cluster.run_dir.head())}
    ratios = [p.train_loss_e6 / eval_loss[m.round - 1] for _, m in manifests for p in m.participants]
    print("train loss / start's held-out loss:", [f"{x:.3f}" for x in ratios])
    assert min(ratios) < 0.2, ratios
