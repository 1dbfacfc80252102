"""Tests for storage_client.manifest: strict round records and their hash chain."""

import copy
import json
import math

import pytest

from storage_client import (
    CID,
    MAX_KERNEL_THREADS,
    SCHEMA,
    Codec,
    Downlink,
    Kernels,
    Manifest,
    ManifestError,
    MissingObjectError,
    ObjectStore,
    Participant,
    Traffic,
    canonical_json,
    from_e6,
    lineage,
    to_e6,
)

CONFIG = str(CID.of(b'{"model":"tiny"}', Codec.JSON))
PARAMS = str(CID.of(b"params"))
OUTER = str(CID.of(b"outer state"))
DOWNLINK = Downlink(payload=str(CID.of(b"compressed global update")),
                    header=str(CID.of(b'{"codec":"lowrank-int4"}', Codec.JSON)))
# Three participants (1 MB up, 1.5 MB down each) and w3, dropped after fetching the global state.
TRAFFIC = [Traffic("w3", 0, 1_500_000)] + [Traffic(w, 1_000_000, 1_500_000) for w in ("w2", "w0", "w1")]


def _participant(worker: str, loss: float = 2.5) -> Participant:
    return Participant(
        worker=worker,
        update=str(CID.of(f"update from {worker}".encode(), Codec.JSON)),
        train_loss_e6=to_e6(loss),
        tokens=4096,
        inner_steps=50,
        bytes_sent=1_000_000,
        bytes_received=1_500_000,
    )


def _manifest(round: int = 1, parent: str | None = None, **overrides) -> Manifest:
    if round > 0 and parent is None:
        parent = str(CID.of(b"some parent", Codec.JSON))
    fields = dict(
        run_id="run-1",
        round=round,
        parent=parent,
        config=CONFIG,
        params=PARAMS,
        outer_state=OUTER,
        participants=[_participant("w2", 2.25), _participant("w0"), _participant("w1", 3.0)],
        dropped=["w4", "w3"],
        eval_loss_e6=to_e6(2.75),
        bytes_up=3_000_000,
        bytes_down=6_000_000,
        downlink=DOWNLINK if round > 0 else None,
        traffic=TRAFFIC,
    )
    fields.update(overrides)
    return Manifest.new(**fields)


def test_e6_helpers():
    assert to_e6(2.5) == 2_500_000
    assert to_e6(0.1234564) == 123456
    assert to_e6(-0.0000004) == 0
    assert to_e6(1) == 1_000_000
    assert from_e6(to_e6(3.141592)) == pytest.approx(3.141592)
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError):
            to_e6(bad)


def test_json_round_trip():
    m = _manifest()
    obj = m.to_json()
    assert obj["schema"] == SCHEMA
    assert [p["worker"] for p in obj["participants"]] == ["w0", "w1", "w2"]
    assert obj["dropped"] == ["w3", "w4"]
    assert [t["worker"] for t in obj["traffic"]] == ["w0", "w1", "w2", "w3"]
    assert obj["traffic"][0] == {"worker": "w0", "up": 1_000_000, "down": 1_500_000}
    assert obj["downlink"] == {"payload": DOWNLINK.payload, "header": DOWNLINK.header}
    assert obj["participants"][0]["bytes_received"] == 1_500_000
    assert Manifest.from_json(obj) == m
    # And through canonical bytes, as another implementation would see it.
    assert Manifest.from_json(json.loads(canonical_json(m.to_json()))) == m
    assert m.cid == CID.of(canonical_json(obj), Codec.JSON)


def test_genesis_has_no_parent():
    g = _manifest(round=0, parent=None, participants=[], dropped=[])
    assert g.parent is None and Manifest.from_json(g.to_json()) == g
    with pytest.raises(ManifestError, match="'parent'"):
        _manifest(round=0, parent=str(CID.of(b"p", Codec.JSON)))
    with pytest.raises(ManifestError, match="'parent'"):
        Manifest.from_json({**_manifest().to_json(), "parent": None})


def test_new_sorts_but_constructor_does_not():
    a = _manifest(participants=[_participant("b"), _participant("a")], dropped=["z", "y"])
    b = _manifest(participants=[_participant("a"), _participant("b")], dropped=["y", "z"])
    assert canonical_json(a.to_json()) == canonical_json(b.to_json()) and a.cid == b.cid

    fields = {k: getattr(a, k) for k in a.__dataclass_fields__}
    with pytest.raises(ManifestError, match="'participants'.*not sorted"):
        Manifest(**{**fields, "participants": tuple(reversed(a.participants))})
    with pytest.raises(ManifestError, match="'dropped'.*not sorted"):
        Manifest(**{**fields, "dropped": ("z", "y")})

    obj = a.to_json()
    obj["participants"].reverse()
    with pytest.raises(ManifestError, match="'participants'.*not sorted"):
        Manifest.from_json(obj)


def test_constructor_freezes_lists():
    m = _manifest()
    assert isinstance(m.participants, tuple) and isinstance(m.dropped, tuple)
    hash(m)


def _mutated(path: list, value) -> dict:
    obj = copy.deepcopy(_manifest().to_json())
    target = obj
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return obj


@pytest.mark.parametrize(
    "path, value, field",
    [
        (["schema"], "dilocox.manifest/v1", "'schema'"),
        (["schema"], "dilocox.manifest/v9", "'schema'"),
        (["schema"], KeyError, "schema"),
        (["eval_loss_e6"], KeyError, "eval_loss_e6"),
        (["surprise"], 1, "surprise"),
        (["round"], True, "'round'"),
        (["round"], -1, "'round'"),
        (["round"], "1", "'round'"),
        (["run_id"], "", "'run_id'"),
        (["run_id"], 7, "'run_id'"),
        (["params"], "bafkrei-nope", "'params'"),
        (["params"], CONFIG, "'params'"),  # JSON codec where RAW is expected
        (["config"], PARAMS, "'config'"),
        (["parent"], PARAMS, "'parent'"),
        (["bytes_up"], -5, "'bytes_up'"),
        (["bytes_down"], 1.0, "'bytes_down'"),
        (["dropped"], "w3", "'dropped'"),
        (["dropped"], ["w3", "w3"], "'dropped'"),
        (["dropped"], ["w0"], "'dropped'"),  # also a participant
        (["dropped", 0], 3, "'dropped[0]'"),
        (["participants"], {}, "'participants'"),
        (["participants", 1], "w1", "'participants[1]'"),
        (["participants", 1, "tokens"], False, "'participants[1].tokens'"),
        (["participants", 2, "inner_steps"], -1, "'participants[2].inner_steps'"),
        (["participants", 0, "update"], "Qm123", "'participants[0].update'"),
        (["participants", 0, "train_loss_e6"], 2.5, "'participants[0].train_loss_e6'"),
        (["participants", 0, "extra"], 1, "extra"),
        (["participants", 0, "worker"], KeyError, "worker"),
        (["participants", 2, "worker"], "w1", "duplicate worker 'w1'"),
        (["participants", 0, "bytes_received"], KeyError, "bytes_received"),
        (["participants", 0, "bytes_received"], -1, "'participants[0].bytes_received'"),
        (["participants", 1, "bytes_received"], True, "'participants[1].bytes_received'"),
        (["downlink"], KeyError, "downlink"),
        (["downlink"], "bafkrei", "'downlink'"),
        (["downlink", "payload"], KeyError, "payload"),
        (["downlink", "payload"], str(CID.of(b"x", Codec.JSON)), "'downlink.payload'"),
        (["downlink", "header"], str(CID.of(b"x")), "'downlink.header'"),
        (["downlink", "header"], "", "'downlink.header'"),
        (["downlink", "extra"], 1, "extra"),
        (["traffic"], KeyError, "traffic"),
        (["traffic"], {}, "'traffic'"),
        (["traffic", 0], "w0", "'traffic[0]'"),
        (["traffic", 0, "worker"], "", "'traffic[0].worker'"),
        (["traffic", 1, "up"], -1, "'traffic[1].up'"),
        (["traffic", 2, "down"], 1.5, "'traffic[2].down'"),
        (["traffic", 3, "down"], KeyError, "down"),
        (["traffic", 3, "extra"], 0, "extra"),
        (["traffic", 2, "worker"], "w1", "duplicate worker 'w1'"),
        (["traffic", 0, "worker"], "w9", "'traffic'"),  # not sorted
        (["traffic", 0, "up"], 999_999, "up bytes sum to 2999999, bytes_up is 3000000"),
        (["traffic", 3, "down"], 0, "down bytes sum to 4500000, bytes_down is 6000000"),
        (["bytes_up"], 3_000_001, "'traffic'"),
    ],
)
def test_strict_validation_names_the_field(path, value, field):
    with pytest.raises(ManifestError) as info:
        Manifest.from_json(_mutated(path, value))
    assert field in str(info.value)


def test_v1_manifest_is_refused():
    obj = _manifest().to_json()
    del obj["downlink"], obj["traffic"]
    for p in obj["participants"]:
        del p["bytes_received"]
    obj["schema"] = "dilocox.manifest/v1"
    with pytest.raises(ManifestError, match="'schema'"):
        Manifest.from_json(obj)


def test_new_fields_default_for_existing_callers():
    p = Participant(worker="w", update=str(CID.of(b"u", Codec.JSON)), train_loss_e6=1, tokens=2, inner_steps=3, bytes_sent=4)
    assert p.bytes_received == 0 and p.to_json()["bytes_received"] == 0
    m = _manifest(downlink=None, traffic=())
    assert m.downlink is None and m.traffic == ()
    obj = m.to_json()
    assert obj["downlink"] is None and obj["traffic"] == []
    assert Manifest.from_json(obj) == m
    # Without traffic there is nothing to sum, so bytes_up / bytes_down stand alone.
    assert _manifest(traffic=(), bytes_up=7, bytes_down=9).bytes_up == 7


def test_traffic_sorted_by_new_but_not_by_constructor():
    a = _manifest()
    assert [t.worker for t in a.traffic] == ["w0", "w1", "w2", "w3"] and isinstance(a.traffic, tuple)
    fields = {k: getattr(a, k) for k in a.__dataclass_fields__}
    with pytest.raises(ManifestError, match="'traffic'.*not sorted"):
        Manifest(**{**fields, "traffic": tuple(reversed(a.traffic))})
    with pytest.raises(ManifestError, match="'traffic\\[1\\]'"):
        Manifest(**{**fields, "traffic": (a.traffic[0], {"worker": "w1", "up": 0, "down": 0})})
    with pytest.raises(ManifestError, match="'traffic'.*up bytes sum"):
        Manifest(**{**fields, "traffic": a.traffic[:-1] + (Traffic("w3", 1, 1_500_000),)})
    with pytest.raises(ManifestError, match="'traffic'.*down bytes sum"):
        Manifest(**{**fields, "traffic": a.traffic[:-1]})


def test_traffic_and_downlink_entries_validate():
    with pytest.raises(ManifestError, match="'traffic.up'"):
        Traffic("w0", -1, 0)
    with pytest.raises(ManifestError, match="'traffic.worker'"):
        Traffic("", 0, 0)
    with pytest.raises(ManifestError, match="'downlink.payload'"):
        Downlink(payload=DOWNLINK.header, header=DOWNLINK.header)
    with pytest.raises(ManifestError, match="'downlink.header'"):
        Downlink(payload=DOWNLINK.payload, header=DOWNLINK.payload)
    with pytest.raises(ManifestError, match="'participant.bytes_received'"):
        Participant(**{**_participant("w0").to_json(), "bytes_received": -3})


def test_kernels_round_trip_and_refuse_anything_off_the_allowlist():
    """What decided a worker's floating point (schema v5): a capability from the allowlist and a
    bounded thread count, or null; the same bytes back from JSON."""
    p = Participant(**{**_participant("w0").to_json(), "kernels": {"capability": "avx512", "threads": 2}})
    assert p.kernels == Kernels("avx512", 2) and str(p.kernels) == "avx512, 2 threads"
    assert Participant.from_json(p.to_json()) == p and p.to_json()["kernels"] == {"capability": "avx512", "threads": 2}
    m = _manifest()
    obj = m.to_json()
    obj["participants"][0]["kernels"] = {"capability": "default", "threads": 1}
    assert Manifest.from_json(obj).participants[0].kernels == Kernels("default", 1)
    bad = [({"capability": "avx1024", "threads": 1}, "capability"), ({"capability": "AVX2", "threads": 1}, "capability"),
           ({"capability": "avx2", "threads": 0}, "threads"), ({"capability": "avx2", "threads": True}, "threads"),
           ({"capability": "avx2", "threads": MAX_KERNEL_THREADS + 1}, "threads"),
           ({"capability": "avx2"}, "missing"), ({"capability": "avx2", "threads": 1, "mkl": "x"}, "unknown"),
           ("avx2", "expected object"), ({"capability": ["avx2"], "threads": 1}, "capability")]
    for kernels, why in bad:
        obj["participants"][0]["kernels"] = kernels
        with pytest.raises(ManifestError, match=why) as info:
            Manifest.from_json(obj)
        assert "participants[0].kernels" in str(info.value)
    del obj["participants"][0]["kernels"]
    with pytest.raises(ManifestError, match="missing keys"):
        Manifest.from_json(obj)


def test_downlink_null_in_genesis_and_typed():
    g = _manifest(round=0, parent=None, participants=[], dropped=[], traffic=(), bytes_up=0, bytes_down=0)
    assert g.downlink is None and g.to_json()["downlink"] is None
    with pytest.raises(ManifestError, match="'downlink'.*round 0"):
        _manifest(round=0, parent=None, downlink=DOWNLINK)
    with pytest.raises(ManifestError, match="'downlink'.*round 0"):
        Manifest.from_json({**g.to_json(), "downlink": DOWNLINK.to_json()})
    with pytest.raises(ManifestError, match="'downlink'"):
        _manifest(downlink=DOWNLINK.to_json())
    m = _manifest(downlink=None)
    assert m.to_json()["downlink"] is None and m.cid != _manifest().cid


def test_from_json_refuses_non_object():
    with pytest.raises(ManifestError):
        Manifest.from_json([1, 2])


@pytest.fixture
def store(tmp_path) -> ObjectStore:
    return ObjectStore(tmp_path)


def _chain(store: ObjectStore, n: int) -> list[CID]:
    cids: list[CID] = []
    parent = None
    for r in range(n):
        m = _manifest(round=r, parent=parent, params=str(store.put(f"params {r}".encode())))
        cids.append(m.store(store))
        parent = str(cids[-1])
    return cids


def test_store_and_load(store):
    m = _manifest()
    cid = m.store(store)
    assert cid == m.cid and cid.codec is Codec.JSON
    assert Manifest.load(store, cid) == m
    assert Manifest.load(store, str(cid)) == m


def test_lineage_of_three(store):
    cids = _chain(store, 3)
    chain = lineage(store, cids[-1])
    assert [c for c, _ in chain] == cids
    assert [m.round for _, m in chain] == [0, 1, 2]
    assert chain[0][1].parent is None
    assert all(chain[i][1].parent == str(chain[i - 1][0]) for i in (1, 2))
    assert lineage(store, str(cids[0])) == chain[:1]


def test_lineage_wrong_parent_round_names_both_cids(store):
    genesis = _manifest(round=0, parent=None).store(store)
    skip = _manifest(round=2, parent=str(genesis)).store(store)
    with pytest.raises(ManifestError) as info:
        lineage(store, skip)
    assert str(skip) in str(info.value) and str(genesis) in str(info.value)


def test_lineage_other_run_is_refused(store):
    genesis = _manifest(round=0, parent=None, run_id="other").store(store)
    child = _manifest(round=1, parent=str(genesis)).store(store)
    with pytest.raises(ManifestError, match="run") as info:
        lineage(store, child)
    assert str(child) in str(info.value) and str(genesis) in str(info.value)


def test_lineage_missing_parent_propagates(store):
    orphan = _manifest(round=1).store(store)
    with pytest.raises(MissingObjectError):
        lineage(store, orphan)
