"""The Store door (storage_client.backend): a second implementation, held in memory, backs the code
that reads a run (manifests, update records, checkpoint rebuilding, the audit's search for unrecorded
rounds) with no other change; the local store and it answer alike; gc reads through the door."""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from audit.findings import Findings
from audit.lineage import check_unrecorded
from audit.result import AuditResult
from storage_client import (
    CID,
    Codec,
    CorruptObjectError,
    MissingObjectError,
    ObjectStore,
    Store,
    canonical_json,
    lineage,
    loads_bounded,
    open_store,
)
from storage_client.backend import as_cid
from tests.unit.test_checkpoints import COMPRESSION, MODEL, push, run, theta0
from trainer.codec.wire import layout_of
from trainer.config import RoundConfig, RunConfig
from trainer.rounds.update_source import dense
from trainer.runstore.checkpoints import checkpoint_at
from trainer.runstore.run_dir import RunDir
from trainer.runstore.update_record import open_update

CONFIG = RunConfig(compression=COMPRESSION, rounds=RoundConfig(rounds=5, checkpoint_every=2, clip_multiple=2.0))


class MemoryStore(Store):
    """Objects in a dict keyed by sha256 hex: the Store primitives and nothing else."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    @property
    def location(self) -> str:
        return "memory"

    def put(self, data: bytes, codec: Codec = Codec.RAW) -> CID:
        cid = CID.of(data, codec)
        self.objects[cid.hex] = bytes(data)
        return cid

    def get(self, cid: CID | str) -> bytes:
        cid = as_cid(cid)
        if cid.hex not in self.objects:
            raise MissingObjectError(cid, self.location)
        data = self.objects[cid.hex]
        actual = hashlib.sha256(data).hexdigest()
        if actual != cid.hex:
            raise CorruptObjectError(cid, self.location, cid.hex, actual)
        return data

    def has(self, cid: CID | str) -> bool:
        return as_cid(cid).hex in self.objects

    def size(self, cid: CID | str) -> int:
        return len(self.get(cid))

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.objects))

    def read_small_json(self, cid: CID | str, max_bytes: int) -> Any | None:
        if self.size(cid) > max_bytes or not self.get(cid).startswith(b"{"):
            return None
        return loads_bounded(self.get(cid), max_bytes=max_bytes)


def test_both_stores_are_stores_and_answer_alike(tmp_path) -> None:
    local, memory = open_store(tmp_path / "run"), MemoryStore()
    assert local.root == tmp_path / "run" / "store" and isinstance(local, Store) and isinstance(memory, Store)
    for store in (local, memory):
        manifest = store.put_json({"schema": "x", "n": 1})
        tensor = store.put(b"\x00" * 64)
        assert store.get_json(manifest) == {"schema": "x", "n": 1} and str(manifest) in store
        assert store.read_small_json(manifest, 1 << 10) == {"schema": "x", "n": 1}
        assert store.read_small_json(tensor, 1 << 10) is None  # not JSON: told apart, not parsed
        assert store.read_small_json(manifest, 4) is None  # larger than asked for
        assert store.size(tensor) == 64 and list(store) == sorted([manifest.hex, tensor.hex])
        with pytest.raises(MissingObjectError):
            store.size(CID.of(b"absent"))
        assert CID.of(b"absent") not in store


def test_a_run_stored_in_memory_reads_and_rebuilds_as_on_disk(tmp_path) -> None:
    """The same hand-driven run into each store: the same CIDs, and every read path gives the same."""
    local, memory = ObjectStore(tmp_path), MemoryStore()
    on_disk, _ = run(local, CONFIG, down=True)
    in_memory, states = run(memory, CONFIG, down=True)
    assert [cid for cid, _ in in_memory] == [cid for cid, _ in on_disk]
    assert set(memory) == set(local)
    assert lineage(memory, in_memory[-1][0]) == in_memory  # manifests loaded and linked from the store
    for r, truth in enumerate(states):
        got = checkpoint_at(memory, in_memory, r, CONFIG)
        assert got.params_bytes() == truth.params_bytes() and got.outer_state_bytes() == truth.outer_state_bytes()
    update = in_memory[1][1].participants[0].update
    assert all(torch.equal(a, b) for a, b in zip(
        dense(open_update(memory, update, layout_of(theta0()), MODEL)).values(),
        dense(open_update(local, update, layout_of(theta0()), MODEL)).values()))


def test_the_audit_finds_unrecorded_rounds_in_memory(tmp_path) -> None:
    memory = MemoryStore()
    chain, _ = run(memory, CONFIG, down=False)
    memory.put(b"{" + b"x" * 100)  # JSON-looking but not JSON: skipped, not fatal
    result = AuditResult()
    check_unrecorded(Findings(result, memory), "t", chain[2][0], 2, max_unrecorded=1)
    assert [(f.check, f.object) for f in result.failures] == [("unrecorded", str(chain[-1][0]))]
    assert "rounds 3..5" in result.failures[0].message


def test_gc_refuses_when_an_object_it_needs_is_corrupt(tmp_path, capsys) -> None:
    from cli.gc import run as gc

    rd = RunDir(tmp_path / "run")
    chain, _ = run(rd.store, CONFIG, down=False)
    rd.set_head(chain[-1][0])
    push(rd.store, {n: torch.full_like(t, 1e-3) for n, t in theta0().items()}, None)  # unreferenced
    record = chain[-1][1].participants[0].update
    rd.store.path_of(record).write_bytes(canonical_json({"schema": "dilocox.update/v1", "slices": []}))
    before = set(rd.store)
    assert gc(argparse.Namespace(run=str(rd.path), dry_run=False)) == 2
    assert f"object {CID(Codec.JSON, CID.parse(record).digest)} is corrupt" in capsys.readouterr().out
    assert set(rd.store) == before  # nothing removed on account of a record that cannot be read
