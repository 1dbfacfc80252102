"""Tests for storage_client.store: round trips, tamper detection, atomic writes."""

import os
import threading
from pathlib import Path

import pytest

from storage_client import (
    CID,
    Codec,
    CorruptObjectError,
    MissingObjectError,
    ObjectStore,
    StoreError,
    canonical_json,
    write_atomic,
)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return ObjectStore(tmp_path / "store")


def test_init_creates_objects_dir(tmp_path):
    ObjectStore(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b" / "objects").is_dir()


def test_bytes_round_trip_and_layout(store):
    data = b"checkpoint bytes \x00\xff"
    cid = store.put(data)
    assert cid == CID.of(data, Codec.RAW)
    assert store.get(cid) == data
    assert store.get(str(cid)) == data  # CID text is accepted too
    path = store.path_of(cid)
    assert path == store.root / "objects" / cid.hex[:2] / cid.hex[2:]
    assert path.read_bytes() == data
    assert store.has(cid) and cid in store
    store.verify(cid)
    assert list(store) == [cid.hex]


def test_json_round_trip(store):
    obj = {"lr": 700, "name": "run-ü", "workers": ["a", "b"], "nested": {"x": None}}
    cid = store.put_json(obj)
    assert cid.codec is Codec.JSON
    assert store.get_json(cid) == obj
    assert store.get(cid) == canonical_json(obj)


def test_get_json_refuses_raw_codec(store):
    cid = store.put(b"{}")
    with pytest.raises(StoreError, match="RAW, not JSON"):
        store.get_json(cid)


def test_get_json_reports_invalid_json(store):
    cid = store.put(b"not json", Codec.JSON)
    with pytest.raises(StoreError, match="not valid JSON"):
        store.get_json(cid)


def test_idempotent_put_and_codec_shares_file(store):
    a = store.put(b"same")
    b = store.put(b"same")
    c = store.put(b"same", Codec.JSON)
    assert a == b and a.digest == c.digest and a != c
    assert _files(store.objects) == [store.path_of(a)]


def test_idempotent_put_does_not_rewrite(store, monkeypatch):
    cid = store.put(b"once")
    monkeypatch.setattr(os, "replace", lambda *a: pytest.fail("rewrote an intact object"))
    assert store.put(b"once") == cid


def test_flipped_byte_is_detected(store):
    cid = store.put(b"precious parameters")
    path = store.path_of(cid)
    raw = bytearray(path.read_bytes())
    raw[3] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptObjectError) as info:
        store.get(cid)
    msg = str(info.value)
    assert str(cid) in msg and str(path) in msg and cid.hex in msg
    assert info.value.expected == cid.hex
    assert info.value.actual == CID.of(bytes(raw)).hex
    with pytest.raises(CorruptObjectError):
        store.verify(cid)
    assert store.has(cid)  # has() only checks existence


def test_truncated_file_is_detected(store):
    cid = store.put(b"x" * 1000)
    path = store.path_of(cid)
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(CorruptObjectError, match=str(cid)):
        store.get(cid)


def test_missing_object(store):
    cid = CID.of(b"never stored")
    assert not store.has(cid)
    for call in (store.get, store.verify):
        with pytest.raises(MissingObjectError) as info:
            call(cid)
        assert str(cid) in str(info.value)
        assert str(store.path_of(cid)) in str(info.value)
    assert issubclass(MissingObjectError, StoreError)
    assert issubclass(CorruptObjectError, StoreError)


def test_bad_cid_text_is_rejected(store):
    with pytest.raises(ValueError):
        store.get("bafkrei-not-a-cid")


def test_put_repairs_corrupt_object(store):
    cid = store.put(b"good bytes")
    store.path_of(cid).write_bytes(b"evil bytes")
    assert store.put(b"good bytes") == cid
    assert store.get(cid) == b"good bytes"


def _boom(src, dst):
    raise OSError("disk on fire")


def test_failed_write_leaves_nothing(store, monkeypatch):
    monkeypatch.setattr(os, "replace", _boom)
    with pytest.raises(OSError, match="disk on fire"):
        store.put(b"doomed")
    cid = CID.of(b"doomed")
    assert not store.path_of(cid).exists()
    assert _files(store.objects) == []  # no temp file left behind either
    monkeypatch.undo()
    assert store.get(store.put(b"doomed")) == b"doomed"


def test_failed_repair_keeps_old_file_whole(store, monkeypatch):
    cid = store.put(b"good")
    path = store.path_of(cid)
    path.write_bytes(b"bad!")
    monkeypatch.setattr(os, "replace", _boom)
    with pytest.raises(OSError, match="disk on fire"):
        store.put(b"good")
    assert path.read_bytes() == b"bad!"
    assert _files(store.objects) == [path]


def test_temp_files_are_not_listed(store):
    cid = store.put(b"real")
    (store.path_of(cid).parent / ".tmp-leftover").write_bytes(b"partial")
    assert list(store) == [cid.hex]


def test_concurrent_puts_of_same_bytes(store):
    data = os.urandom(1 << 20)
    barrier = threading.Barrier(4)
    results: list[CID] = []

    def worker() -> None:
        barrier.wait()
        results.append(store.put(data))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and len(set(results)) == 1
    assert _files(store.objects) == [store.path_of(results[0])]
    assert store.get(results[0]) == data


def test_write_atomic_creates_and_replaces(tmp_path):
    head = tmp_path / "runs" / "r1" / "HEAD"
    write_atomic(head, b"first")
    assert head.read_bytes() == b"first"
    write_atomic(head, b"second")
    assert head.read_bytes() == b"second"
    assert _files(tmp_path) == [head]
    assert head.stat().st_mode & 0o777 == 0o644
