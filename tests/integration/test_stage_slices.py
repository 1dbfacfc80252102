"""A worker of P pipeline stages pushes P slices; the coordinator counts the worker when all are in.

"mallory" is the hand-driven client of test_bad_input, here pushing stage slices of a two-layer
model; "w0" is an honest one-process worker.
"""

from __future__ import annotations

import signal

import grpc
import pytest
import torch

from cli.cluster import LocalCluster
from proto import Encoding
from storage_client import CID, Codec, lineage
from tests.conftest import Holds
from tests.integration.test_bad_input import Mallory
from tests.integration.test_cluster import assert_rederivable
from trainer.codec.wire import encode_params
from trainer.config import ModelConfig, RoundConfig
from trainer.model.stages import stage_param_names
from trainer.runstore.update_record import record_bytes, slice_ref

pytestmark = pytest.mark.integration

TWO_LAYERS = ModelConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)
INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


def cut(m: Mallory, tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The two stage slices of a whole-model update."""
    return [{n: tensors[n] for n in names} for names in stage_param_names(m.config.model, 2)]


def stage_record(*slices: dict[str, torch.Tensor]) -> bytes:
    """The update record (trainer.runstore.update_record) of dense stage slices pushed as Mallory pushes them."""
    return record_bytes([slice_ref(s, len(slices), Encoding.DENSE_F32, encode_params(piece), None)
                         for s, piece in enumerate(slices)])


def test_slices_count_together_and_an_incomplete_worker_is_dropped(cluster: LocalCluster, make_config,
                                                                   holds: Holds) -> None:
    cluster.start_coordinator(make_config(
        model=TWO_LAYERS,
        rounds=RoundConfig(rounds=3, expected_workers=2, quorum=1, straggler_timeout_s=60.0,
                           heartbeat_interval_s=0.3, liveness_timeout_s=2.0)))
    m = Mallory.joined(cluster)
    update = {k: torch.full_like(v, 1e-4) for k, v in m.zero.items()}
    first, second = cut(m, update)

    # A slice holds exactly its stage's tensors, of a split the model allows.
    details = m.refused(INVALID, update, stage=0, num_stages=2)
    assert "stage 0 of 2: tensor names do not match the model: unexpected tensors" in details
    assert "stage 2 out of range for 2 stages" in m.refused(INVALID, second, stage=2, num_stages=2)
    assert "num_stages 3: this run's model of 2 layer(s)" in m.refused(INVALID, second, stage=0, num_stages=3)

    # Stage 0 is held; pushed again it is a duplicate; a stage 1 from another inner loop (other
    # metrics) is refused, and takes the held stage 0 with it: the worker is out until it re-pushes.
    m.push(first, stage=0, num_stages=2)
    assert "already pushed stage 0 of 2 for round 1" in m.refused(grpc.StatusCode.ALREADY_EXISTS, first,
                                                                   stage=0, num_stages=2)
    assert "stage 1 of 2 says train_loss_e6 2500000, but stage 0" in m.refused(INVALID, second, stage=1,
                                                                              num_stages=2, train_loss=2.5)
    assert "splits into" in m.refused(INVALID, second, stage=1, num_stages=5)
    base = m.fetch()
    m.push(first, stage=0, num_stages=2, **base)
    sent = m.wire_bytes
    m.push(second, stage=1, num_stages=2, **base)
    sent += m.wire_bytes
    status = cluster.wait_for(lambda s: len(s.rounds) >= 2, 60, "round 1 to close with mallory's two slices")
    assert list(status.rounds[1].participants) == ["mallory"]

    # Round 2: mallory sends stage 0 only, then falls silent; w0 delivers, and once mallory's
    # liveness lapses the round closes without it.
    # w0 is held before round 3's inner steps, so the run is still open to hear mallory's stale slice.
    m.push(first, round=2, stage=0, num_stages=2, **m.fetch(min_round=1))
    holds.hold("w0", 3)
    cluster.start_worker("w0")
    cluster.wait_for(lambda s: len(s.rounds) >= 3, 120, "round 2 to close without mallory")
    assert "stale round 2" in m.refused(PRECONDITION, second, round=2, stage=1, num_stages=2)
    holds.release("w0", 3)
    assert cluster.wait_exit("w0", 120) == 0, cluster.log("w0")
    assert cluster.wait_exit("coordinator", 60) == 0, cluster.log("coordinator")
    assert "mallory dropped with 1 of its 2 stage slices" in cluster.log("coordinator", tail=200)

    chain = [manifest for _, manifest in lineage(cluster.run_dir.store, cluster.run_dir.head())]
    (entry,) = chain[1].participants
    # The round's record of mallory names both slices as pushed, and its bytes are both streams'.
    assert entry.update == str(CID.of(stage_record(first, second), Codec.JSON))
    assert entry.bytes_sent == sent
    for later in chain[2:]:
        assert [p.worker for p in later.participants] == ["w0"] and later.dropped == ("mallory",)
    assert_rederivable(cluster.run_dir)


def test_a_coordinator_restart_keeps_the_slices_it_accepted(cluster: LocalCluster, make_config) -> None:
    config = make_config(model=TWO_LAYERS, rounds=RoundConfig(
        rounds=1, expected_workers=1, quorum=1, heartbeat_interval_s=0.3, liveness_timeout_s=2.0))
    cluster.start_coordinator(config)
    m = Mallory.joined(cluster)
    update = {k: torch.full_like(v, -2e-4) for k, v in m.zero.items()}
    first, second = cut(m, update)
    base = m.fetch()
    m.push(first, stage=0, num_stages=2, **base)

    cluster.kill("coordinator", signal.SIGKILL)
    cluster.start_coordinator()  # resumes from the run directory
    m = Mallory.joined(cluster)  # a restarted coordinator knows no sessions: mallory joins again
    assert "already pushed stage 0 of 2" in m.refused(grpc.StatusCode.ALREADY_EXISTS, first, stage=0, num_stages=2)
    m.push(second, stage=1, num_stages=2, **base)
    assert cluster.wait_exit("coordinator", 60) == 0, cluster.log("coordinator")
    chain = assert_rederivable(cluster.run_dir)
    (entry,) = chain[1][1].participants
    assert entry.update == str(CID.of(stage_record(first, second), Codec.JSON))
