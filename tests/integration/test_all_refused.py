"""A run whose every push is refused says so and stops, instead of waiting forever.

A round closes only with an accepted update, and a refused worker does not push the round again,
so when every live worker's push of a round was refused the coordinator says why in one line and
exits 1, and the workers waiting for the round are told the same and exit 1
(trainer.coordinator.machine.Coordinator.stalled, trainer.coordinator.server). Here the workers are
honest but their updates are screened out: an inner learning rate of 1.0 wrecks the model, which
raises the held-out loss far beyond the screening margin. Real coordinator and worker processes.
"""

from __future__ import annotations

import pytest

from cli.cluster import LocalCluster
from trainer.config import InnerConfig, RoundConfig

pytestmark = pytest.mark.integration


def test_a_round_whose_every_push_is_refused_stops_the_run_with_one_line(cluster: LocalCluster, make_config) -> None:
    cluster.start_coordinator(make_config(
        inner=InnerConfig(steps=20, batch_size=4, lr=1.0),
        rounds=RoundConfig(rounds=2, expected_workers=2, quorum=2, straggler_timeout_s=3.0, screen_margin=0.01,
                           heartbeat_interval_s=0.5, liveness_timeout_s=3.0)))
    cluster.start_worker("w0")
    cluster.start_worker("w1")
    for name in ("coordinator", "w0", "w1"):
        assert cluster.wait_exit(name, 90) == 1, cluster.log(name)
    line = "round 1 cannot close: every live worker's push of it was refused and none was accepted"
    coordinator = cluster.log("coordinator", tail=400)
    (said,) = [text for text in coordinator.splitlines() if line in text]
    assert "cannot go on" in said and "screened on held-out batches" in said, said
    for name in ("w0", "w1"):
        log = cluster.log(name, tail=400)
        assert "update refused (INVALID_ARGUMENT): screened on held-out batches" in log, log
        assert f"WorkerError: waiting for round 1: \"the coordinator stopped the run: {line}" in log.splitlines()[-1], log
        assert "Traceback" not in log
