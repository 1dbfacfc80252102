"""Workers fetch each round's global state by CID from a mirror, and past a lying one
(trainer.worker.cid_fetch): a real coordinator and two workers over gRPC + TLS, a mirror that reads
through the coordinator's own TLS gateway, and a liar serving the run's store with a byte flipped."""

from __future__ import annotations

import pytest

from benchmarks.gateway import FlippingStore
from cli.cluster import LocalCluster
from cli.mirror import ReadThroughStore
from storage_client import ObjectStore, lineage
from storage_client.gateway import start_gateway
from storage_client.remote import RemoteStore
from trainer.codec import CompressionConfig
from trainer.config import RoundConfig

pytestmark = pytest.mark.integration


def test_workers_fetch_the_downlink_from_a_mirror_and_name_a_liar(cluster: LocalCluster, make_config, tmp_path) -> None:
    config = make_config(compression=CompressionConfig(enabled=True, min_rank=1, max_rank=4),
                         rounds=RoundConfig(rounds=2, expected_workers=2, quorum=2, straggler_timeout_s=30.0,
                                            heartbeat_interval_s=0.5, liveness_timeout_s=3.0))
    cluster.start_coordinator(config)
    store_port = cluster.status().store_port
    assert store_port > 0  # announced in Status (and to workers in JoinResponse)
    # The mirror trusts the coordinator's gateway by the certificate the workers pin.
    upstream = RemoteStore([f"https://127.0.0.1:{store_port}"], ca_file=str(cluster.run_dir.path / "tls" / "cert.pem"))
    mirror_store = ReadThroughStore(ObjectStore(tmp_path / "mirror" / "store"), upstream)
    mirror, _ = start_gateway(mirror_store)
    liar, _ = start_gateway(FlippingStore(cluster.run_dir.store.root))  # holds everything, serves it wrong
    try:
        cluster.start_worker("w0", ["--store-source", liar.url, "--store-source", mirror.url])
        cluster.start_worker("w1", ["--store-source", mirror.url])
        for name in ("w0", "w1", "coordinator"):
            assert cluster.wait_exit(name, 180) == 0, cluster.log(name)
    finally:
        for server in (mirror, liar):
            server.shutdown()
            server.server_close()
    w0 = cluster.log("w0", tail=400)
    assert f"store source {liar.url} lied about" in w0, w0
    assert "fetching it from the coordinator over gRPC" not in w0  # the mirror had a correct copy
    manifests = [m for _, m in lineage(cluster.run_dir.store, cluster.run_dir.head())]
    downlinks = [m.downlink.payload for m in manifests[1:]]
    # Every round's downlink came from the mirror, which fetched each block from the coordinator once
    # (the compressed update and its codec header, distinct, of rounds 1..2: θ⁽²⁾ is fetched at the end).
    blocks = {*downlinks, *(m.downlink.header for m in manifests[1:])}
    assert all(mirror_store.local.has(cid) for cid in blocks)
    assert mirror_store.fetched == len(blocks)  # each once, though two workers read it (and one twice)
    for m in manifests[2:]:  # FetchGlobal carried the headers only: less than one downlink for both workers
        assert m.bytes_down < len(cluster.run_dir.store.get(m.downlink.payload)), m.round
    assert mirror.bytes_out > liar.bytes_out > 0
