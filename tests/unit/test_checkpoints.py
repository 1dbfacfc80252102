"""trainer.runstore.checkpoints and trainer.runstore.update_record: rounds kept as the bytes that were pushed, full
checkpoints every K rounds, and every other round rebuilt bit for bit from its manifest."""

from __future__ import annotations

import pytest
import torch

from proto import Encoding
from storage_client import CID, Codec, Manifest, ObjectStore, canonical_json, to_e6
from storage_client.manifest import Downlink, Participant
from trainer.codec import AdaptiveRankPolicy, CompressionConfig
from trainer.codec.downlink import DownlinkCompressor
from trainer.codec.uplink import new_compressor
from trainer.codec.wire import encode_params, layout_of
from trainer.config import ModelConfig, RoundConfig, RunConfig
from trainer.rounds.outer import zero_momentum
from trainer.rounds.transition import OuterState, round_transition
from trainer.rounds.update_source import dense
from trainer.runstore.checkpoints import CheckpointError, checkpoint_at, is_full_checkpoint
from trainer.runstore.update_record import RecordError, open_update, record_bytes, slice_ref, store_slice

COMPRESSION = CompressionConfig(enabled=True, min_rank=1, max_rank=2)
MODEL = ModelConfig(n_layer=1)


def theta0() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(12, 8, generator=g), "b.bias": torch.randn(8, generator=g)}


def push(store: ObjectStore, delta: dict, compressor) -> str:
    """What the coordinator stores of a one-process worker's push; returns the record's CID."""
    if compressor is None:
        payload, header = encode_params(delta), None
    else:
        payload, codec, _ = compressor.compress(delta)
        header = canonical_json(codec)
    ref = slice_ref(0, 1, Encoding.LOWRANK_INT4 if header else Encoding.DENSE_F32, payload, header)
    store_slice(store, ref, payload, header)
    return str(store.put(record_bytes([ref]), Codec.JSON))


def run(store: ObjectStore, config: RunConfig, down: bool) -> tuple[list, list[OuterState]]:
    """A hand-driven run of ``config.rounds.rounds`` rounds, two workers, stored as the coordinator
    stores it (full checkpoints only where ``is_full_checkpoint``); the chain and every true state."""
    state = OuterState(theta0(), zero_momentum(theta0()))
    config_cid = str(store.put_json(config.to_json()))
    genesis = Manifest.new(run_id="t", round=0, parent=None, config=config_cid,
                           params=str(store.put(state.params_bytes())), outer_state=str(store.put(state.outer_state_bytes())),
                           participants=[], dropped=[], eval_loss_e6=0, bytes_up=0, bytes_down=0)
    chain, states = [(genesis.store(store), genesis)], [state]
    workers = {w: new_compressor(COMPRESSION) if config.compression.enabled else None for w in ("w0", "w1")}
    encoder = DownlinkCompressor(AdaptiveRankPolicy(COMPRESSION)) if down else None
    norms: list[float] = []
    for r in range(1, config.rounds.rounds + 1):
        g = torch.Generator().manual_seed(r)
        cids = {w: push(store, {n: torch.randn(t.shape, generator=g) * 1e-2 for n, t in theta0().items()}, c)
                for w, c in workers.items()}
        updates = {w: open_update(store, cid, layout_of(theta0()), MODEL) for w, cid in cids.items()}
        result = round_transition(state, updates, outer=config.outer, rounds=config.rounds,
                                  history=norms[-config.rounds.clip_history_rounds:], downlink=encoder)
        norms.append(sorted(result.aggregated.norms.values())[0])
        state = result.state
        full = is_full_checkpoint(config.rounds, r)
        params, outer = state.params_bytes(), state.outer_state_bytes()
        downlink = None
        if result.downlink is not None:
            downlink = Downlink(payload=str(store.put(result.downlink.payload)),
                                header=str(store.put_json(dict(result.downlink.header))))
        m = Manifest.new(run_id="t", round=r, parent=str(chain[-1][0]), config=config_cid,
                         params=str(store.put(params) if full else CID.of(params)),
                         outer_state=str(store.put(outer) if full else CID.of(outer)),
                         participants=[Participant(worker=w, update=cid, train_loss_e6=to_e6(2.0), tokens=1,
                                                   inner_steps=1, bytes_sent=1) for w, cid in sorted(cids.items())],
                         dropped=[], eval_loss_e6=0, bytes_up=0, bytes_down=0, downlink=downlink)
        chain.append((m.store(store), m))
        states.append(state)
    return chain, states


@pytest.mark.parametrize("uplink, down", [(False, False), (True, False), (True, True)],
                         ids=["dense", "compressed-uplink", "compressed-both-ways"])
def test_every_round_rebuilds_bit_for_bit_from_the_last_full_checkpoint(tmp_path, uplink: bool, down: bool) -> None:
    config = RunConfig(compression=COMPRESSION if down or uplink else CompressionConfig(),
                       rounds=RoundConfig(rounds=7, checkpoint_every=3, clip_multiple=2.0, clip_history_rounds=2))
    store = ObjectStore(tmp_path)
    chain, states = run(store, config, down)
    assert [r for r, (_, m) in enumerate(chain) if store.has(m.params)] == [0, 3, 6, 7]
    for r, truth in enumerate(states):
        got = checkpoint_at(store, chain, r, config)
        assert got.params_bytes() == truth.params_bytes() and got.outer_state_bytes() == truth.outer_state_bytes()
    if down:
        assert chain[5][1].downlink is not None and states[5].downlink_error


def test_a_round_that_rebuilds_to_other_bytes_is_named(tmp_path) -> None:
    config = RunConfig(rounds=RoundConfig(rounds=4, checkpoint_every=4, clip_multiple=0.0))
    store = ObjectStore(tmp_path)
    chain, _ = run(store, config, False)
    # Round 2's update bytes swapped for round 1's: the rebuild goes through round 1 and stops at 2.
    tampered = Manifest.from_json({**chain[2][1].to_json(), "participants": [p.to_json() for p in chain[1][1].participants]})
    chain[2] = (tampered.cid, tampered)
    with pytest.raises(CheckpointError, match="round 2: the rebuilt params"):
        checkpoint_at(store, chain, 3, config)


def test_a_record_is_the_pushed_bytes_and_opens_as_they_arrived(tmp_path) -> None:
    store = ObjectStore(tmp_path)
    delta = {n: torch.full_like(t, 1e-3) for n, t in theta0().items()}
    cid = push(store, delta, None)
    assert torch.equal(dense(open_update(store, cid, layout_of(theta0()), MODEL))["a.weight"], delta["a.weight"])
    compressor = new_compressor(COMPRESSION)
    cid = push(store, delta, compressor)
    # Kept: the dense payload and its record, the compressed payload, its codec header and its record;
    # no dense reconstruction of the compressed one.
    assert len(list(store)) == 5
    assert CID.parse(str(cid)).digest.hex() in set(store)
    # A record that does not fit the model is refused by name.
    with pytest.raises(RecordError, match="does not match|missing|unexpected|tensor"):
        open_update(store, cid, {"a.weight": ("float32", (12, 8))}, MODEL)
    with pytest.raises(RecordError, match="schema"):
        open_update(store, store.put_json({"schema": "other", "slices": []}), layout_of(theta0()), MODEL)
    bad = store.put_json({"schema": "dilocox.update/v1", "slices": [
        {"stage": 0, "num_stages": 1, "encoding": "lowrank_int4", "payload": str(CID.of(b"x")), "header": None}]})
    with pytest.raises(RecordError, match="header must be a RAW CID"):
        open_update(store, bad, layout_of(theta0()), MODEL)
    with pytest.raises(RecordError, match="not a JSON record"):
        open_update(store, CID.of(b"x"), layout_of(theta0()), MODEL)


def test_gc_removes_only_what_nothing_the_run_needs_references(tmp_path, capsys) -> None:
    import argparse
    import os

    from cli.gc import run as gc
    from trainer.coordinator.server import lock_run_dir
    from trainer.runstore.gc import reachable
    from trainer.runstore.run_dir import RunDir

    rd = RunDir(tmp_path / "run")
    config = RunConfig(compression=COMPRESSION, rounds=RoundConfig(rounds=4, checkpoint_every=2))
    chain, _ = run(rd.store, config, True)
    rd.set_head(chain[-1][0])
    delta = {n: torch.full_like(t, 1e-3) for n, t in theta0().items()}
    journalled = push(rd.store, delta, new_compressor(COMPRESSION))  # the open round's, in its journal
    carried = rd.store.put(b"the inner state the push carried")  # rounds.state_every: named by digest only
    rd.save_pending(5, {"w0": {"cid": journalled, "state": carried.hex}})
    before = set(rd.store)
    abandoned = push(rd.store, {n: t * 2 for n, t in delta.items()}, new_compressor(COMPRESSION))  # never journalled
    admission = rd.store.put_json({"schema": "dilocox.admission/v2", "evidence": str(rd.store.put(b"evidence"))})
    planted = set(rd.store) - before
    unreferenced = planted - {admission.hex, CID.of(b"evidence").hex}  # the push's record, payload (, header)
    assert CID.parse(abandoned).hex in unreferenced and len(unreferenced) >= 2

    held = lock_run_dir(rd)  # a coordinator serving the run: gc refuses and removes nothing
    assert gc(argparse.Namespace(run=str(rd.path), dry_run=False)) == 2 and "refused" in capsys.readouterr().out
    os.close(held)
    assert gc(argparse.Namespace(run=str(rd.path), dry_run=True)) == 0
    assert f"would remove {len(unreferenced)} unreferenced object(s)" in capsys.readouterr().out
    assert planted <= set(rd.store)
    assert gc(argparse.Namespace(run=str(rd.path), dry_run=False)) == 0
    assert f"removed {len(unreferenced)} unreferenced object(s)" in capsys.readouterr().out
    assert set(rd.store) == before | {admission.hex, CID.of(b"evidence").hex} == reachable(rd)
    for r in range(len(chain)):  # every checkpoint still rebuilds
        checkpoint_at(rd.store, chain, r, config)
    open_update(rd.store, journalled, layout_of(theta0()), MODEL)
    assert carried.hex in set(rd.store)  # the open round's manifest will name it
