"""The global state fetched by CID (trainer.worker.cid_fetch), the worker's fall-back to gRPC, the
coordinator's choice to name it (trainer.coordinator.service._global_messages), the gateway's TLS, the
mirror that reads through (cli.mirror.ReadThroughStore) and the gateway's egress count: real HTTP
gateways on loopback over real on-disk stores, a real gRPC server for the client."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from attestation import WorkerKey
from attestation.signing import global_digest
from benchmarks.gateway import FlippingStore
from benchmarks.hostile_coordinator import MANIFEST_CID, RUN_DIGEST, Hostile
from benchmarks.hostile_coordinator import served as serving
from cli.mirror import ReadThroughStore
from proto import Encoding, pb
from storage_client import CID, Codec, ObjectStore, StoreError
from storage_client.gateway import GatewayServer, start_gateway
from storage_client.remote import RemoteStore
from tests.conftest import small_config
from tests.unit.test_gateway import assert_refused_past
from trainer.codec.wire import WireError, encode_params, sha256_hex
from trainer.coordinator.service import CoordinatorService
from trainer.coordinator.state import CompressedGlobal, GlobalState
from trainer.net.link import Link
from trainer.net.tls import ClientTls, TlsError, ensure_self_signed, gateway_client_tls, gateway_server_tls
from trainer.worker.client import CoordinatorClient
from trainer.worker.cid_fetch import CidFetchError, PayloadSources, gateway_url, payload_cid

PAYLOAD = bytes(range(256)) * 300
CODEC_HEADER = b'{"tensors":{}}'


@pytest.fixture
def served(tmp_path) -> Iterator[tuple[ObjectStore, list[GatewayServer]]]:
    """An honest store, and the gateways a test starts (stopped after it)."""
    servers: list[GatewayServer] = []
    yield ObjectStore(tmp_path / "store"), servers
    for server in servers:
        server.shutdown()
        server.server_close()


def serve(servers: list[GatewayServer], store) -> str:
    server, _ = start_gateway(store)
    servers.append(server)
    return server.url


def header(payload: bytes = PAYLOAD, **fields: object) -> pb.GlobalHeader:
    h = pb.GlobalHeader(available=True, round=3, payload_size=len(payload), payload_sha256=sha256_hex(payload),
                        payload_cid=str(CID.of(payload)), encoding=Encoding.LOWRANK_INT4)
    for name, value in fields.items():
        setattr(h, name, value)
    return h


def sources(mirrors: list[str]) -> tuple[PayloadSources, list[int]]:
    got: list[int] = []
    return PayloadSources(mirrors, "127.0.0.1:1", ClientTls(insecure=True), got.append), got


def test_payload_cid_must_be_the_raw_cid_of_the_signed_digest() -> None:
    assert payload_cid(header()) == CID.of(PAYLOAD)
    for bad in ("nonsense", str(CID.of(PAYLOAD, Codec.JSON)), str(CID.of(b"other bytes"))):
        with pytest.raises(WireError, match="round 3"):
            payload_cid(header(payload_cid=bad))


def test_gateway_url_is_the_announced_port_on_the_dialled_host() -> None:
    assert gateway_url("10.0.0.5:7000", 8480, secure=True) == "https://10.0.0.5:8480"
    assert gateway_url("[::1]:7000", 8480, secure=False) == "http://[::1]:8480"


def test_fetched_from_a_mirror_verified_with_its_codec_header(served) -> None:
    store, servers = served
    store.put(PAYLOAD)
    codec_cid = store.put(CODEC_HEADER, Codec.JSON)
    fetch, got = sources([serve(servers, store)])
    assert fetch.enabled
    h = header(compression_header_cid=str(codec_cid))
    assert fetch.fetch(h, 0, iter(())) == PAYLOAD
    assert h.compression_header == CODEC_HEADER  # where a streamed one is read
    assert got == [len(CODEC_HEADER), len(PAYLOAD)]  # counted as received bytes


def test_a_lying_source_is_named_and_the_next_one_used(served, caplog) -> None:
    store, servers = served
    store.put(PAYLOAD)
    liar = serve(servers, FlippingStore(store.root))
    fetch, _ = sources([liar, serve(servers, store)])
    with caplog.at_level(logging.WARNING, logger="dilocox.worker"):
        assert fetch.fetch(header(), 0, iter(())) == PAYLOAD
    assert f"store source {liar} lied about {CID.of(PAYLOAD)}" in caplog.text


def test_no_correct_copy_anywhere_is_one_error_naming_the_liar(served) -> None:
    store, servers = served
    store.put(PAYLOAD)
    liar = serve(servers, FlippingStore(store.root))
    empty = serve(servers, ObjectStore(store.root.parent / "empty"))
    fetch, got = sources([empty, liar])
    with pytest.raises(CidFetchError) as refused:
        fetch.fetch(header(), 0, iter(()))
    assert str(CID.of(PAYLOAD)) in str(refused.value) and f"lied: {liar}" in str(refused.value)
    assert "\n" not in str(refused.value) and got == []


def test_data_after_a_payload_named_by_cid_and_a_wrong_length_are_refused(served) -> None:
    store, servers = served
    store.put(PAYLOAD)
    fetch, _ = sources([serve(servers, store)])
    with pytest.raises(WireError):
        fetch.fetch(header(), 0, iter([b"extra"]))
    with pytest.raises(CidFetchError, match="over the bound"):  # declared shorter than the bytes
        fetch.fetch(header(payload_size=len(PAYLOAD) - 1), 0, iter(()))


def test_a_worker_without_sources_asks_for_bytes() -> None:
    assert not sources([])[0].enabled


def _service(store: ObjectStore, gateway: object) -> CoordinatorService:
    service = object.__new__(CoordinatorService)  # _global_messages reads these only
    run = SimpleNamespace(run_dir=SimpleNamespace(store=store), inner_steps=lambda r: 2)
    service.c, service.gateway = SimpleNamespace(run=run, global_signature=lambda s: b"s" * 65), gateway
    return service


@pytest.mark.parametrize("by_cid,stored,named", [(True, True, True), (False, True, False), (True, False, False)])
def test_the_coordinator_names_a_stored_payload_only_when_asked(tmp_path, by_cid, stored, named) -> None:
    store = ObjectStore(tmp_path / "store")
    if stored:
        store.put(PAYLOAD)
        store.put(CODEC_HEADER, Codec.JSON)
    base = CID.of(b"theta r-1")
    state = GlobalState(round=3, params={}, momentum={}, payload=b"dense", params_cid=CID.of(b"dense"),
                        manifest_cid=CID.of(b"m", Codec.JSON), eval_loss_e6=0,
                        downlink=CompressedGlobal(PAYLOAD, CODEC_HEADER, str(base)))
    messages = list(_service(store, object())._global_messages(state, 4, False, str(base), by_cid))
    h = messages[0].header
    assert h.payload_sha256 == sha256_hex(PAYLOAD) and h.payload_size == len(PAYLOAD)
    if named:
        assert h.payload_cid == str(CID.of(PAYLOAD)) and len(messages) == 1
        assert h.compression_header_cid == str(CID.of(CODEC_HEADER, Codec.JSON)) and not h.compression_header
    else:
        assert not h.payload_cid and b"".join(m.data for m in messages[1:]) == PAYLOAD
        assert h.compression_header == CODEC_HEADER


def test_a_read_through_mirror_fetches_each_block_once(served, tmp_path) -> None:
    store, servers = served
    cid = store.put(PAYLOAD)
    server, _ = start_gateway(store)
    servers.append(server)
    mirror = ReadThroughStore(ObjectStore(tmp_path / "mirror" / "store"), RemoteStore([server.url]))
    readers = [threading.Thread(target=mirror.get, args=(cid,)) for _ in range(8)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(30)
    assert mirror.fetched == 1 and mirror.local.get(cid) == PAYLOAD
    assert len(PAYLOAD) < server.bytes_out < 2 * len(PAYLOAD)  # one copy (and its headers) left upstream


def test_the_coordinators_gateway_is_trusted_as_its_grpc_port_is(served, tmp_path) -> None:
    store, servers = served
    cid = store.put(PAYLOAD)
    identity, worker = ensure_self_signed(tmp_path / "tls"), ensure_self_signed(tmp_path / "worker-tls")
    server, _ = start_gateway(store, tls=gateway_server_tls(identity, worker.cert_path))  # mutual TLS
    servers.append(server)
    address, mine = f"127.0.0.1:{server.server_address[1]}", {"client_cert_file": worker.cert_path,
                                                                "client_key_file": worker.key_path}
    for tls in (ClientTls(fingerprint=identity.fingerprint, **mine), ClientTls(ca_file=identity.cert_path, **mine)):
        context = gateway_client_tls(address, tls)
        assert RemoteStore([server.url], source_tls={server.url: context}).get(cid) == PAYLOAD
    without = gateway_client_tls(address, ClientTls(ca_file=identity.cert_path))  # no client certificate
    with pytest.raises(StoreError):
        RemoteStore([server.url], source_tls={server.url: without}, retries=0).get(cid)
    with pytest.raises(TlsError, match="but the pin is"):
        gateway_client_tls(address, ClientTls(fingerprint=worker.fingerprint, **mine))
    assert gateway_client_tls(address, ClientTls(insecure=True)) is None


def test_no_correct_copy_by_cid_and_the_worker_takes_the_bytes_over_grpc(tmp_path, served, caplog) -> None:
    """A real CoordinatorClient against an in-process coordinator (benchmarks.hostile_coordinator)
    that names θ by CID, which the worker's only source serves wrong: one line, then gRPC."""
    store, servers = served
    payload = encode_params({"w": torch.arange(8, dtype=torch.float32)})
    params = store.put(payload)
    liar = serve(servers, FlippingStore(store.root))
    coordinator = Hostile(WorkerKey.generate(), small_config())
    digest = global_digest(RUN_DIGEST, 1, params.digest, CID.parse(MANIFEST_CID).digest)
    signed = pb.GlobalHeader(available=True, round=1, params_cid=str(params), manifest_cid=MANIFEST_CID,
                             encoding=Encoding.DENSE_F32, signature=coordinator.key.sign_digest(digest),
                             payload_size=len(payload), payload_sha256=sha256_hex(payload),
                             next_inner_steps=1, second_inner_steps=1)
    by_cid = pb.GlobalHeader()
    by_cid.CopyFrom(signed)
    by_cid.payload_cid = str(params)
    answers = [[pb.GlobalChunk(header=by_cid)], [pb.GlobalChunk(header=signed), pb.GlobalChunk(data=payload)]]
    coordinator.fetch = lambda: iter(answers.pop(0))
    with serving(coordinator, threads=4) as (address, _):
        client = CoordinatorClient(address, "w0", tls=ClientTls(insecure=True), attestation=None,
                                   reconnect_timeout_s=30, fetch_wait_s=5, link=Link(),
                                   on_first_join=lambda config, shard, shards: None, store_sources=[liar])
        client.join()
        with caplog.at_level(logging.INFO, logger="dilocox.worker"):
            checkpoint = client.fetch(1)
    assert checkpoint.params_cid == str(params) and coordinator.fetches == 2 and answers == []
    refused = [r.getMessage() for r in caplog.records if "over gRPC" in r.getMessage()]
    assert len(refused) == 1 and f"lied: {liar}" in refused[0] and str(params) in refused[0]


def test_connections_from_all_clients_are_bounded_too(served) -> None:
    store, servers = served
    server, _ = start_gateway(store)
    servers.append(server)
    server.per_client, server.max_connections = 8, 3  # the bound on all clients, as one client can reach it
    assert_refused_past(server.server_address[:2], 3)
