"""The trustless gateway (storage_client.gateway), the verifying remote store (storage_client.remote)
and CARv1 (storage_client.car): real HTTP on loopback over a real on-disk store, and independent
readers for the CIDs and CARs we write: PyPI's ``multiformats`` (CIDs, multihashes) and ``ipld-car``
(a CARv1 reader over ``dag-cbor``), none of which shares code with ours."""

from __future__ import annotations

import http.client
import io
import socket
import time
from collections.abc import Iterator

import pytest

from benchmarks.gateway import FlippingStore, hostile_server
from storage_client import CID, Codec, MissingObjectError, ObjectStore, Store
from storage_client.car import CarError, encode_car, read_car
from storage_client.gateway import CAR_TYPE, RAW_TYPE, start_gateway
from storage_client.remote import RemoteStore, UnverifiedObjectError


@pytest.fixture
def store(tmp_path) -> ObjectStore:
    return ObjectStore(tmp_path / "store")


@pytest.fixture
def gateway(store) -> Iterator[str]:
    server, thread = start_gateway(store)
    yield server.url
    server.shutdown()
    server.server_close()
    thread.join(5)


def _request(url: str, method: str, target: str, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request(method, target, headers=headers or {})
    return conn.getresponse()


def test_raw_block_and_headers(store, gateway):
    data = b"\x00checkpoint" * 200_000  # over 1 MiB: served as one raw block all the same
    cid = store.put(data)
    response = _request(gateway, "GET", f"/ipfs/{cid}", {"Accept": RAW_TYPE})
    body = response.read()
    assert response.status == 200 and body == data
    assert response.headers["Content-Type"] == RAW_TYPE
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert response.headers["Etag"] == f'"{cid}.raw"'
    assert "immutable" in response.headers["Cache-Control"]
    head = _request(gateway, "HEAD", f"/ipfs/{cid}?format=raw")
    assert head.status == 200 and head.headers["Content-Length"] == str(len(data)) and head.read() == b""


def independently_verified(car: bytes) -> tuple[list[str], dict[str, bytes]]:
    """The roots and blocks of ``car`` as ipld-car reads it, each block's CID checked by multiformats."""
    import ipld_car
    from multiformats import multihash

    roots, blocks = ipld_car.decode(car)
    found = {}
    for cid, data in blocks:
        assert cid.version == 1 and cid.hashfun.name == "sha2-256"
        assert multihash.digest(bytes(data), "sha2-256") == bytes(cid.digest)
        found[cid.encode("base32")] = bytes(data)
    return [r.encode("base32") for r in roots], found


def test_car_response_read_by_an_independent_reader(store, gateway):
    cid = store.put_json({"schema": "x", "n": 1})
    response = _request(gateway, "GET", f"/ipfs/{cid}?format=car")
    body = response.read()
    assert response.status == 200 and response.headers["Content-Type"].startswith(CAR_TYPE)
    assert response.headers["Etag"] == f'"{cid}.car"'
    assert independently_verified(body) == ([str(cid)], {str(cid): store.get(cid)})
    assert read_car(io.BytesIO(body)).roots == [cid]


@pytest.mark.parametrize("target, headers, status", [
    ("/ipfs/not-a-cid", {"Accept": RAW_TYPE}, 400),
    ("/ipfs/bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku", {"Accept": RAW_TYPE}, 404),
    ("/ipfs/bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku", {"Accept": "text/html"}, 406),
    ("/ipfs/bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku?format=tar", {}, 406),
    ("/ipfs/bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku/sub", {"Accept": RAW_TYPE}, 400),
    ("/" + "a" * 5000, {}, 414),
])
def test_refusals_name_the_problem_without_echoing(gateway, target, headers, status):
    response = _request(gateway, "GET", target, headers)
    body = response.read()
    assert response.status == status
    assert len(body) < 200 and b"aaaa" not in body and b"not-a-cid" not in body


def test_oversized_headers_and_other_methods_are_refused(gateway):
    response = _request(gateway, "GET", "/ipfs/x", {f"X-H{i}": "v" * 200 for i in range(60)})
    assert response.status == 431
    assert _request(gateway, "POST", "/ipfs/x").status == 405


def assert_refused_past(address: tuple[str, int], held: int) -> None:
    """With ``held`` idle connections open to ``address``, one more is closed at once, unanswered."""
    idle = [socket.create_connection(address) for _ in range(held)]  # each holds a slot
    try:
        time.sleep(0.2)  # let the server accept them
        extra = socket.create_connection(address)
        extra.settimeout(5)
        assert extra.recv(1) == b""  # closed at once, unanswered
        extra.close()
    finally:
        for s in idle:
            s.close()


def test_connections_per_client_are_bounded(gateway):
    host, port = gateway.removeprefix("http://").rsplit(":", 1)
    assert_refused_past((host, int(port)), 8)


def test_remote_store_reads_and_verifies(store, gateway, tmp_path):
    data = b"weights" * 1000
    cid = store.put(data)
    manifest = store.put_json({"round": 3})
    missing = ObjectStore(tmp_path / "empty")
    empty_server, empty_thread = start_gateway(missing)
    try:
        remote = RemoteStore([empty_server.url, gateway], retries=0)  # a mirror without it, then the source
        assert remote.get(cid) == data and remote.size(cid) == len(data) and remote.has(cid)
        assert remote.get_json(manifest) == {"round": 3}
        assert remote.read_small_json(manifest, 1000) == {"round": 3}
        absent = CID.of(b"never stored")
        assert not remote.has(absent)
        with pytest.raises(MissingObjectError):
            remote.get(absent)
        assert list(remote) == []
    finally:
        empty_server.shutdown()
        empty_server.server_close()
        empty_thread.join(5)


def test_a_lying_source_is_named_and_the_next_one_used(tmp_path):
    honest, liar = ObjectStore(tmp_path / "a"), FlippingStore(tmp_path / "b")
    cid = honest.put(b"x" * 4096)
    liar.put(b"x" * 4096)
    servers = [start_gateway(s) for s in (liar, honest)]
    try:
        urls = [s.url for s, _ in servers]
        assert RemoteStore(urls, retries=0).get(cid) == b"x" * 4096
        with pytest.raises(UnverifiedObjectError) as caught:
            RemoteStore(urls[:1], retries=0).get(cid)
        assert str(cid) in str(caught.value) and caught.value.lied == urls[:1]
    finally:
        for server, thread in servers:
            server.shutdown()
            server.server_close()
            thread.join(5)


def test_truncated_oversized_and_dripping_bodies_are_cut_off():
    cid = CID.of(b"y" * 100)
    url = hostile_server(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", b"y" * 50)
    with pytest.raises(UnverifiedObjectError, match="truncated|Incomplete"):
        RemoteStore([url], retries=0).get(cid)
    url = hostile_server(b"HTTP/1.1 200 OK\r\nContent-Length: 999999\r\n\r\n", b"")
    with pytest.raises(UnverifiedObjectError, match="over the bound"):
        RemoteStore([url], retries=0, max_bytes=1000).get(cid)
    url = hostile_server(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", b"y" * 5000)
    with pytest.raises(UnverifiedObjectError, match="over 1000 bytes"):
        RemoteStore([url], retries=0, max_bytes=1000).get(cid)
    url = hostile_server(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", b"y" * 100, drip_s=0.05)
    started = time.monotonic()
    with pytest.raises(UnverifiedObjectError, match="too slow"):
        RemoteStore([url], retries=0, timeout_s=0.5).get(cid)
    assert time.monotonic() - started < 3


def test_transport_failures_are_retried_with_backoff(store):
    cid = CID.of(b"z")
    unused = socket.create_server(("127.0.0.1", 0))
    port = unused.getsockname()[1]
    unused.close()  # nothing listens there now
    started = time.monotonic()
    with pytest.raises(UnverifiedObjectError, match="failed"):
        RemoteStore([f"http://127.0.0.1:{port}"], retries=2, backoff_s=0.1).get(cid)
    assert time.monotonic() - started >= 0.3  # 0.1 + 0.2


def test_car_round_trip_and_independent_reader():
    blocks = [(CID.of(b"{}", Codec.JSON), b"{}"), (CID.of(b"tensor" * 300_000), b"tensor" * 300_000)]
    car = b"".join(encode_car([blocks[0][0]], blocks))
    parsed = read_car(io.BytesIO(car))
    assert parsed.roots == [blocks[0][0]] and parsed.blocks == blocks
    assert independently_verified(car) == ([str(blocks[0][0])], {str(c): d for c, d in blocks})


@pytest.mark.parametrize("damage, match", [
    (lambda car: car[:-10], "truncated"),
    (lambda car: car[:-1] + bytes([car[-1] ^ 1]), "does not hash"),
    (lambda car: b"\x05" + car[1:], "header"),
    (lambda car: b"", "empty"),
])
def test_damaged_cars_are_refused(damage, match):
    block = b"payload" * 100
    car = b"".join(encode_car([CID.of(block)], [(CID.of(block), block)]))
    with pytest.raises(CarError, match=match):
        read_car(io.BytesIO(damage(car)))


def test_remote_store_is_a_read_only_store(tmp_path):
    remote = RemoteStore(["http://127.0.0.1:9"])
    assert isinstance(remote, Store)
    with pytest.raises(Exception, match="read-only"):
        remote.put(b"x")
