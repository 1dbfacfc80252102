"""Bad pushes against a real coordinator: each refused by name, none entering the average.

"mallory" is a hand-driven gRPC client that joins the run like a worker (benchmarks.hostile); "w0"
is an honest worker process. Round 1 closes with both valid updates despite every bad push before them; round 2 closes
with w0 alone once silent mallory is no longer live.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from benchmarks.hostile import Mallory
from cli.cluster import LocalCluster
from proto import Encoding, WorkerPhase
from storage_client import CID, Codec, Manifest, canonical_json, lineage
from tests.conftest import Holds
from trainer.codec import AdaptiveRankPolicy, compress
from trainer.codec.wire import encode_params, layout_of
from trainer.config import RoundConfig

pytestmark = pytest.mark.integration


def test_bad_updates_are_refused_and_the_round_completes(cluster: LocalCluster, make_config,
                                                         holds: Holds) -> None:
    # quorum 1: a round closes once every live worker has delivered. w0 is held before round 1's
    # inner steps until mallory's pushes have landed, so round 1 is still open for them.
    cluster.start_coordinator(make_config(
        rounds=RoundConfig(rounds=2, expected_workers=2, quorum=1, straggler_timeout_s=60.0,
                           heartbeat_interval_s=0.3, liveness_timeout_s=2.0)))
    m = Mallory.joined(cluster)
    name = "blocks.0.mlp.fc.weight"
    INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION

    # wrong shape, wrong dtype, wrong tensor names
    wrong_shape = {**m.zero, name: torch.zeros(3, 3)}
    assert f"tensor {name}: shape [3, 3], expected [128, 32]" in m.refused(INVALID, wrong_shape)
    wrong_dtype = {**m.zero, name: m.zero[name].double()}
    assert f"tensor {name}: dtype float64, expected float32" in m.refused(INVALID, wrong_dtype)
    renamed = {("evil." + k if k == name else k): v for k, v in m.zero.items()}
    details = m.refused(INVALID, renamed)
    assert f"missing tensors ['{name}']" in details and f"unexpected tensors ['evil.{name}']" in details
    # NaN and Inf
    for value, kind in ((float("nan"), "NaN"), (float("inf"), "Inf")):
        poisoned = {k: v.clone() for k, v in m.zero.items()}
        poisoned[name][0, 0] = value
        assert f"tensor {name} has 1 non-finite value(s) ({kind})" in m.refused(INVALID, poisoned)
    # a digest that does not match the bytes, a length that does not either
    assert "digest mismatch" in m.refused(INVALID, payload_sha256="0" * 64)
    assert "header declared" in m.refused(INVALID, payload_size=len(encode_params(m.zero)) + 1)
    # a header that describes the model while the bytes hold something else
    assert "payload disagrees with its header" in m.refused(INVALID, wrong_shape, layout=layout_of(m.zero))
    # an update far larger than any honest inner loop could produce
    huge = {k: torch.full_like(v, 100.0) for k, v in m.zero.items()}
    assert "exceeds the bound" in m.refused(INVALID, huge)
    assert "unsupported update encoding" in m.refused(INVALID, encoding=99)
    # a compressed update whose codec header disagrees with its bytes is refused by name
    payload, codec = compress({k: torch.randn_like(v) * 1e-3 for k, v in m.zero.items()}, None,
                              AdaptiveRankPolicy.fixed(2))
    entry = next(e for e in codec["tensors"] if e["name"] == name)
    entry["rank"] = 3
    details = m.refused(INVALID, payload=payload, encoding=Encoding.LOWRANK_INT4,
                        compression_header=canonical_json(codec))
    assert f"compressed update refused: tensor {name}" in details
    assert "not JSON" in m.refused(INVALID, payload=payload, encoding=Encoding.LOWRANK_INT4,
                                   compression_header=b"{oops")
    assert "nests deeper" in m.refused(INVALID, payload=payload, encoding=Encoding.LOWRANK_INT4,
                                       compression_header=b"[" * 100_000)
    # wrong run, a round not open yet, a stranger, an old protocol
    assert "this coordinator runs 'test'" in m.refused(PRECONDITION, run_id="other")
    assert "round 2 is not open yet; the open round is 1" in m.refused(PRECONDITION, round=2)
    # a push in another worker's name is not mallory's to make, whoever "eve" is
    assert "names worker 'eve', but the session is 'mallory''s" in m.refused(grpc.StatusCode.UNAUTHENTICATED,
                                                                           worker_id="eve")
    assert "protocol version 0 is not supported" in m.refused(PRECONDITION, protocol_version=0)
    # a worker that says it has no stages, or more than the model has layers
    assert "num_stages 0: this run's model of 1 layer(s)" in m.refused(INVALID, num_stages=0)
    assert "num_stages 2" in m.refused(INVALID, num_stages=2)

    # While w0 trains round 1: a valid update is accepted; a second push for it is not.
    holds.hold("w0", 1)
    holds.hold("w0", 2)  # and before round 2's, so the run is still open to hear mallory's stale push
    cluster.start_worker("w0")
    cluster.wait_for(lambda s: any(w.worker_id == "w0" and w.phase == WorkerPhase.TRAINING for w in s.workers),
                     60, "w0 to train round 1")
    accepted = m.push()
    assert accepted.accepted and CID.parse(accepted.update_cid).codec == Codec.JSON  # the update record
    assert f"already pushed an update for round 1 ({accepted.update_cid})" in m.refused(grpc.StatusCode.ALREADY_EXISTS)
    holds.release("w0", 1)

    status = cluster.wait_for(lambda s: len(s.rounds) >= 2, 120, "round 1 to close")
    assert list(status.rounds[1].participants) == ["mallory", "w0"]
    assert any(r.startswith("mallory: ") for r in status.rounds[1].refused)

    # Round 1 has closed: a push for it is stale.
    assert "stale round 1" in m.refused(PRECONDITION)
    holds.release("w0", 2)

    # Mallory falls silent in round 2: once its liveness lapses the round closes with w0 alone.
    assert cluster.wait_exit("w0", 120) == 0, cluster.log("w0")
    assert cluster.wait_exit("coordinator", 60) == 0, cluster.log("coordinator")
    run = cluster.run_dir
    chain = [manifest for _, manifest in lineage(run.store, run.head())]
    assert [len(x.participants) for x in chain] == [0, 2, 1]
    assert chain[2].dropped == ("mallory",)
    # Only mallory's valid push entered the round-1 average, no bad one: the manifest names it.
    round1: Manifest = chain[1]
    assert {p.worker for p in round1.participants} == {"mallory", "w0"}
    assert round1.participants[0].update == accepted.update_cid
