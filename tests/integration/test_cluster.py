"""A coordinator and two workers, as real processes over gRPC on 127.0.0.1, for two rounds (and the
workers fetching the downlink by CID from a mirror, past a liar: trainer.worker.cid_fetch)."""

import contextlib
from dataclasses import dataclass

import pytest

from audit.rederive import rederive
from benchmarks.gateway import FlippingStore
from cli.cluster import LocalCluster
from cli.mirror import ReadThroughStore
from proto import MAX_MESSAGE_BYTES
from storage_client import CID, ObjectStore, lineage
from storage_client.gateway import GatewayServer, start_gateway
from storage_client.remote import RemoteStore
from trainer.codec import CompressionConfig
from trainer.codec.wire import decode_params, layout_of
from trainer.config import ModelConfig, RoundConfig, RunConfig
from trainer.model.gpt import build_model
from trainer.runstore.checkpoints import is_full_checkpoint
from trainer.runstore.round_inputs import ClipHistory, round_updates
from trainer.runstore.run_dir import RunDir

pytestmark = pytest.mark.integration


def assert_rederivable(run: RunDir) -> list:
    """Every round re-derives bit for bit from stored objects alone (the audit's arithmetic,
    audit.rederive, including a compressed downlink); returns the lineage."""
    chain = lineage(run.store, run.head())
    assert [m.round for _, m in chain] == list(range(len(chain)))
    config = RunConfig.from_json(run.store.get_json(chain[0][1].config))
    assert config.data.corpus_sha256  # pinned at genesis
    clip = ClipHistory(config.rounds)  # each round's ρ̃ (round_norm): the next rounds' clip history
    layout = layout_of(decode_params(run.store.get(chain[0][1].params)))
    state = (run.store.get(chain[0][1].params), run.store.get(chain[0][1].outer_state))
    for (parent_cid, parent), (_, m) in zip(chain, chain[1:], strict=False):
        assert m.parent == str(parent_cid)
        assert (m.downlink is not None) == config.compression.enabled
        # Full checkpoints are stored exactly where rounds.checkpoint_every says; the others are not.
        assert run.store.has(m.params) == is_full_checkpoint(config.rounds, m.round), f"round {m.round}"
        downlink = m.downlink and (run.store.get(m.downlink.payload), run.store.get_json(m.downlink.header))
        updates = round_updates(run.store, m, layout, config.model)  # from the pushed bytes
        history = clip.history(m.round)
        derived = rederive(config.outer, *state, updates, downlink, rounds=config.rounds, history=history)
        clip.keep_updates(m.round, updates)
        state = (derived.params, derived.outer_state)
        assert derived.params_digest == CID.parse(m.params).digest, f"round {m.round} params do not re-derive"
        assert derived.outer_state_digest == CID.parse(m.outer_state).digest, f"round {m.round} outer state"
        # Every byte of the round is accounted for, per worker and direction.
        assert sum(t.up for t in m.traffic) == m.bytes_up and sum(t.down for t in m.traffic) == m.bytes_down
        for p in m.participants:
            assert p.bytes_sent > 0 and p.bytes_received > 0, p
    return chain


def test_two_workers_two_rounds_store_a_rederivable_lineage(cluster: LocalCluster, make_config) -> None:
    # 1.7M parameters: every checkpoint and update exceeds grpc's 4 MiB message limit, so both
    # directions must travel chunked.
    config = make_config(model=ModelConfig(block_size=32, n_layer=2, n_head=4, n_embd=256))
    cluster.start_coordinator(config)
    cluster.start_worker("w0")
    cluster.start_worker("w1")
    for name in ("w0", "w1", "coordinator"):
        assert cluster.wait_exit(name, 180) == 0, cluster.log(name)

    run = cluster.run_dir
    chain = assert_rederivable(run)
    for _, m in chain[1:]:
        assert [p.worker for p in m.participants] == ["w0", "w1"]
        assert m.dropped == ()
        assert all(p.inner_steps == 3 and p.tokens == 3 * 4 * 32 for p in m.participants)
        assert m.bytes_up > 2 * MAX_MESSAGE_BYTES
    # Workers build θ⁽⁰⁾ from the seed: its fetch is the header alone, which names the CID they
    # checked their own build against. θ⁽¹⁾ travels dense, chunked.
    assert all(t.down < 1000 for t in chain[1][1].traffic), chain[1][1].traffic
    assert chain[2][1].bytes_down > 2 * MAX_MESSAGE_BYTES

    status_log = cluster.log("coordinator", tail=200)
    assert "round 2 closed" in status_log
    assert not (run.path / "pending").exists() or not any((run.path / "pending").iterdir())


@pytest.mark.parametrize("codec", ["lowrank-int4", "topk"])
def test_compressed_updates_travel_small_and_still_rederive(cluster: LocalCluster, make_config, codec: str,
                                                            tmp_path) -> None:
    """Both codecs (trainer.codec): the same framing, validation and exact re-derivation. With the
    low-rank codec the workers also fetch each round's downlink by CID (trainer.worker.cid_fetch):
    from a mirror reading through the coordinator's TLS gateway, w0 past a liar first."""
    config = make_config(model=ModelConfig(block_size=32, n_layer=2, n_head=4, n_embd=128),
                         compression=CompressionConfig(enabled=True, min_rank=1, max_rank=8, codec=codec))
    cluster.start_coordinator(config)
    with contextlib.ExitStack() as servers:
        sources = by_cid_sources(cluster, tmp_path, servers) if codec == "lowrank-int4" else None
        cluster.start_worker("w0", ["--store-source", sources.liar.url, "--store-source", sources.mirror.url]
                             if sources else [])
        cluster.start_worker("w1", ["--store-source", sources.mirror.url] if sources else [])
        for name in ("w0", "w1", "coordinator"):
            assert cluster.wait_exit(name, 180) == 0, cluster.log(name)
    chain = assert_rederivable(cluster.run_dir)
    if sources:
        assert_fetched_by_cid(cluster, sources, [m for _, m in chain])
    dense = 4 * sum(p.numel() for p in build_model(RunConfig.load(config).model, 0).parameters())
    for _, m in chain[1:]:
        assert [p.worker for p in m.participants] == ["w0", "w1"]
        # Both directions travel compressed: far below one dense copy of the model per worker.
        assert all(p.bytes_sent * 10 < dense for p in m.participants), (m.participants, dense)
        assert all(t.down * 10 < dense for t in m.traffic) or m.round == 1, (m.traffic, dense)
    # Round 1 starts from θ⁽⁰⁾, fetched dense; from round 2 on each worker holds the round before.
    assert all(p.bytes_received * 10 < dense for p in chain[2][1].participants), chain[2][1].participants
    assert "compressed" in cluster.log("w0") and "global update compressed" in cluster.log("coordinator")


@dataclass
class BySources:
    mirror: GatewayServer  # reads through the coordinator's gateway (cli.mirror.ReadThroughStore)
    mirrored: ReadThroughStore
    liar: GatewayServer  # serves the run's own store with a byte flipped


def by_cid_sources(cluster: LocalCluster, tmp_path, servers: contextlib.ExitStack) -> BySources:
    """A mirror that trusts the coordinator's gateway by the certificate its workers pin, and a liar."""
    store_port = cluster.status().store_port
    assert store_port > 0  # announced in Status (and to the workers in JoinResponse)
    upstream = RemoteStore([f"https://127.0.0.1:{store_port}"], ca_file=str(cluster.run_dir.path / "tls" / "cert.pem"))
    mirrored = ReadThroughStore(ObjectStore(tmp_path / "mirror" / "store"), upstream)
    started = [start_gateway(mirrored)[0], start_gateway(FlippingStore(cluster.run_dir.store.root))[0]]
    for server in started:
        servers.callback(server.server_close)
        servers.callback(server.shutdown)
    return BySources(started[0], mirrored, started[1])


def assert_fetched_by_cid(cluster: LocalCluster, sources: BySources, manifests: list) -> None:
    w0 = cluster.log("w0", tail=400)
    assert f"store source {sources.liar.url} lied about" in w0, w0  # named, skipped
    assert "fetching it from the coordinator over gRPC" not in w0  # the mirror had a correct copy
    # Every round's downlink came from the mirror, which fetched each block from the coordinator once
    # (the compressed update and its codec header of rounds 1..2; θ⁽²⁾ is fetched at the end).
    blocks = {b for m in manifests[1:] for b in (m.downlink.payload, m.downlink.header)}
    assert all(sources.mirrored.local.has(cid) for cid in blocks)
    assert sources.mirrored.fetched == len(blocks)  # each once, though two workers read it
    for m in manifests[2:]:  # FetchGlobal carried the signed headers only: less than one downlink in all
        assert m.bytes_down < len(cluster.run_dir.store.get(m.downlink.payload)), m.round
    assert sources.mirror.bytes_out > sources.liar.bytes_out > 0


@pytest.mark.parametrize(("aggregator", "trim_fraction", "workers"), [
    ("trimmed_mean", 0.34, 3),  # b = ⌊0.34 × 3⌋ = 1: each coordinate keeps its middle value
    ("median", 0.2, 2),  # the lower median of two: the coordinate-wise minimum
])
def test_a_robust_mean_run_rederives(cluster: LocalCluster, make_config, aggregator: str, trim_fraction: float,
                                     workers: int) -> None:
    config = make_config(rounds=RoundConfig(rounds=2, expected_workers=workers, quorum=workers,
                                            straggler_timeout_s=30.0, heartbeat_interval_s=0.5,
                                            liveness_timeout_s=3.0, aggregator=aggregator,
                                            trim_fraction=trim_fraction))
    cluster.start_coordinator(config)
    names = [f"w{k}" for k in range(workers)]
    for name in names:
        cluster.start_worker(name)
    for name in [*names, "coordinator"]:
        assert cluster.wait_exit(name, 180) == 0, cluster.log(name)
    chain = assert_rederivable(cluster.run_dir)  # with the run's own aggregator, read from its stored config
    assert [[p.worker for p in m.participants] for _, m in chain[1:]] == [names, names]
    stored = RunConfig.from_json(cluster.run_dir.store.get_json(chain[0][1].config)).rounds
    assert (stored.aggregator, stored.trim_fraction) == (aggregator, trim_fraction)


def test_worker_speaking_another_protocol_version_is_refused(cluster: LocalCluster, make_config) -> None:
    import grpc

    from proto import PROTOCOL_VERSION, pb

    cluster.start_coordinator(make_config())
    with pytest.raises(grpc.RpcError) as refused:
        cluster.stub().Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION + 1, worker_id="w9"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"protocol version {PROTOCOL_VERSION + 1} is not supported" in refused.value.details()
    assert f"speaks version {PROTOCOL_VERSION}" in refused.value.details()


def test_health_service_reports_serving(cluster: LocalCluster, make_config) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from proto import SERVICE_NAME

    cluster.start_coordinator(make_config())
    with cluster.channel() as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
