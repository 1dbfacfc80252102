"""Step commitments (trainer.runtime.step_commit): leaves are the sha256 of the revealed files, the
Merkle tree's proofs hold and refuse what they should, the recorder changes nothing of the training,
an honest segment replays at distance 0 here, and each cheat is named at its segment and its step."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.codec.wire import encode_params, layout_of
from trainer.config import InnerConfig, ModelConfig
from trainer.model.gpt import build_model
from trainer.model.params import params_of
from trainer.runtime import step_commit as sc
from trainer.runtime.inner import InnerLoop, load_optimizer_state
from trainer.runtime.state_commit import check_inner_state

MODEL = ModelConfig(block_size=8, n_layer=1, n_head=2, n_embd=16)
INNER = InnerConfig(steps=12, batch_size=2, lr=1e-2)
H, EVERY = 12, 4
REPO = Path(__file__).resolve().parents[2]


def batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(MODEL.vocab_size, (2, 8), generator=g), torch.randint(MODEL.vocab_size, (2, 8), generator=g))
            for _ in range(n)]


def warmed() -> sc.StepState:
    """A round's start with a warmed AdamW (5 steps of an earlier round): round 2, shard 1, step 0."""
    loop = InnerLoop(build_model(MODEL, 3), INNER)
    loop.run(params_of(loop.model), batches(5, seed=9))
    return sc.StepState(2, 1, 0, params_of(loop.model), loop.state())


def trajectory(start: sc.StepState, data: list, *, skip: int | None = None, bf16: bool = False) -> list[sc.StepState]:
    """Every step's state from ``start`` (a cheat: step ``skip`` not taken but counted; every step in bf16)."""
    loop = InnerLoop(build_model(MODEL, 3), INNER)
    load_optimizer_state(loop.model, loop.optimizer, start.optimizer)
    states, theta = [start], start.params
    for k, batch in enumerate(data, start=1):
        if k == skip:
            for state in loop.optimizer.state.values():
                state["step"] += 1
        elif bf16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loop.run(theta, [batch])
        else:
            loop.run(theta, [batch])
        theta = params_of(loop.model)
        states.append(sc.capture(loop.model, loop.optimizer, start.round, start.shard, k))
    return states


@pytest.fixture(scope="module")
def honest() -> tuple[list, list[sc.StepState]]:
    data = batches(H)
    return data, trajectory(warmed(), data)


# --------------------------------------------------------------------------------------------------
# Leaves.


def test_a_leaf_is_the_sha256_of_the_revealed_file(tmp_path: Path, honest) -> None:
    _, states = honest
    state = states[5]
    tensors = state.tensors()
    raw = sc.step_state_bytes(tensors)
    assert raw == encode_params(tensors)  # the canonical safetensors bytes, int64 positions first
    assert hashlib.sha256(raw).digest() == sc.leaf_digest(tensors) == state.digest()
    assert sc.write_step_state(tmp_path / "leaf", tensors) == state.digest()
    assert (tmp_path / "leaf").read_bytes() == raw
    back = sc.decode_step_state(raw, layout_of(state.params), round_=2, shard=1, step=5)
    assert back.digest() == state.digest() and (back.round, back.shard, back.step) == (2, 1, 5)
    check_inner_state(back.optimizer, layout_of(state.params), compressed=False)


def test_the_streamed_header_is_safetensors_own_for_mixed_dtypes_and_empty_tensors() -> None:
    tensors = {"param.b": torch.arange(3.0), "position.round": torch.tensor(5), "position.step": torch.tensor(-1),
               "exp_avg.a": torch.ones(2, 2), "step.a": torch.tensor(3.0), "param.e": torch.zeros(0, 4),
               "param.big": torch.randn(3 << 20)}  # 12 MiB: two pieces
    assert sc.step_state_bytes(tensors) == encode_params(tensors)
    assert sc.leaf_digest(tensors) == hashlib.sha256(encode_params(tensors)).digest()


def test_the_same_state_has_the_same_digest_on_1_and_2_threads_and_in_another_process(tmp_path: Path, honest) -> None:
    _, states = honest
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = states[H].digest()
        torch.set_num_threads(2)
        two = states[H].digest()
    finally:
        torch.set_num_threads(before)
    assert one == two
    path = tmp_path / "leaf"
    sc.write_step_state(path, states[H].tensors())
    code = ("import sys, torch; from trainer.runtime import step_commit as sc; from trainer.codec.wire import decode_params;"
            "t = decode_params(open(sys.argv[1], 'rb').read()); torch.set_num_threads(2); print(sc.leaf_digest(t).hex())")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, check=True, cwd=REPO, text=True)
    assert out.stdout.strip() == one.hex()


# --------------------------------------------------------------------------------------------------
# The tree.


def digests(n: int) -> list[bytes]:
    return [hashlib.sha256(bytes([i])).digest() for i in range(n)]


def test_leaf_steps_end_at_the_last_step_even_when_s_does_not_divide_h() -> None:
    assert sc.leaf_steps(7, 3) == [0, 3, 6, 7]
    assert sc.leaf_steps(6, 3) == [0, 3, 6]
    assert sc.leaf_steps(5, 10) == [0, 5]
    assert sc.segment_bounds(7, 3) == [(0, 3), (3, 6), (6, 7)]
    with pytest.raises(sc.StepCommitError):
        sc.leaf_steps(2_000_000, 1)


@pytest.mark.parametrize("n", range(1, 12))
def test_every_leaf_has_a_proof_of_its_depth_that_verifies(n: int) -> None:
    ds = digests(n)
    root = sc.merkle_root(ds)
    for i in range(n):
        proof = sc.inclusion_proof(ds, i)
        assert len(proof) == sc.proof_length(i, n) <= math.ceil(math.log2(n)) if n > 1 else len(proof) == 0
        sc.verify_inclusion(root, ds[i], i, n, proof)


def test_a_tampered_leaf_a_wrong_index_and_a_wrong_proof_length_are_refused() -> None:
    ds = digests(7)
    root = sc.merkle_root(ds)
    proof = sc.inclusion_proof(ds, 3)
    with pytest.raises(sc.ProofError, match="does not verify"):
        sc.verify_inclusion(root, hashlib.sha256(b"tampered").digest(), 3, 7, proof)
    with pytest.raises(sc.ProofError, match="does not verify"):
        sc.verify_inclusion(root, ds[3], 2, 7, proof)  # same depth, other index
    with pytest.raises(sc.ProofError):
        sc.verify_inclusion(root, ds[3], 7, 7, proof)  # out of range
    with pytest.raises(sc.ProofError, match="has 3 hashes"):
        sc.verify_inclusion(root, ds[3], 3, 7, proof + [proof[0]])
    with pytest.raises(sc.ProofError, match="has 3 hashes"):
        sc.verify_inclusion(root, ds[3], 3, 7, proof[:-1])
    with pytest.raises(sc.ProofError, match="does not verify"):
        sc.verify_inclusion(root, ds[3], 3, 7, [proof[0], hashlib.sha256(b"x").digest(), proof[2]])


def test_an_inner_node_never_verifies_as_a_leaf_and_odd_nodes_are_promoted() -> None:
    ds = digests(4)
    root = sc.merkle_root(ds)
    left = sc.node_hash(sc.leaf_hash(ds[0]), sc.leaf_hash(ds[1]))
    right = sc.node_hash(sc.leaf_hash(ds[2]), sc.leaf_hash(ds[3]))
    assert root == sc.node_hash(left, right)
    # The node's preimage passed as a leaf's bytes: not a digest.
    with pytest.raises(sc.ProofError):
        sc.verify_inclusion(root, sc.leaf_hash(ds[0]) + sc.leaf_hash(ds[1]), 0, 2, [right])
    # The node itself passed as a leaf of a 2-leaf tree with the one-hash proof: the prefixes differ.
    with pytest.raises(sc.ProofError, match="does not verify"):
        sc.verify_inclusion(root, left, 0, 2, [right])
    # ... or as a leaf of the 4-leaf tree: the proof is one hash short.
    with pytest.raises(sc.ProofError, match="has 2 hashes"):
        sc.verify_inclusion(root, left, 0, 4, [right])
    # Promotion, not duplication: a repeated last leaf is another tree.
    three = digests(3)
    assert sc.merkle_root(three) != sc.merkle_root(three + [three[-1]])
    assert sc.merkle_root(three) == sc.node_hash(
        sc.node_hash(sc.leaf_hash(three[0]), sc.leaf_hash(three[1])), sc.leaf_hash(three[2]))


def test_a_header_commitment_round_trips_and_is_bounded() -> None:
    c = sc.StepCommitment(hashlib.sha256(b"r").digest(), 10, 50)
    assert sc.StepCommitment.from_json(json.loads(str(c))) == c
    for bad in ({"root": "ab", "every": 1, "steps": 1}, {"root": "0" * 64, "every": 0, "steps": 1},
                {"root": "0" * 64, "every": 1, "steps": 2_000_000}, {"root": "0" * 64, "every": True, "steps": 1},
                {"root": "0" * 64, "every": 1, "steps": 1, "x": 1}, [1]):
        with pytest.raises(sc.StepCommitError):
            sc.StepCommitment.from_json(bad)


# --------------------------------------------------------------------------------------------------
# The recorder.


def test_an_observer_changes_nothing_and_the_root_is_the_same_with_and_without_files(tmp_path: Path, honest) -> None:
    data, states = honest
    start = warmed()
    deltas, roots = [], []
    for observer in (None, sc.StepCommitter(EVERY + 1, H, 2, 1), sc.StepCommitter(EVERY + 1, H, 2, 1, tmp_path / "leaves")):
        loop = InnerLoop(build_model(MODEL, 3), INNER)
        load_optimizer_state(loop.model, loop.optimizer, start.optimizer)
        result = loop.run(start.params, data, observer=observer)
        deltas.append(result.pseudo_gradient)
        if observer is not None:
            roots.append(observer.commitment())
    assert all(torch.equal(deltas[0][n], d[n]) for d in deltas[1:] for n in deltas[0])  # bit for bit
    assert roots[0].root == roots[1].root and roots[0].leaves == roots[1].leaves
    # The leaves are the states of the per-step trajectory at 0, 5, 10 and 12, and the files hash to them.
    assert sc.leaf_steps(H, EVERY + 1) == [0, 5, 10, 12]
    for i, j in enumerate([0, 5, 10, 12]):
        assert roots[0].leaves[i] == states[j].digest()
        raw = (tmp_path / "leaves" / sc.StepCommitter.leaf_name(j)).read_bytes()
        assert hashlib.sha256(raw).digest() == roots[0].leaves[i]
        roots[0].verify(j, roots[0].leaves[i], roots[0].proof(j))
    with pytest.raises(sc.StepCommitError, match="not a leaf"):
        roots[0].index(3)


def test_a_round_that_ends_early_has_no_commitment() -> None:
    committer = sc.StepCommitter(2, 6, 1, 0)
    loop = InnerLoop(build_model(MODEL, 3), INNER)
    loop.run(params_of(loop.model), batches(3), observer=committer)
    with pytest.raises(sc.StepCommitError, match="before step 4"):
        committer.commitment()


# --------------------------------------------------------------------------------------------------
# The check.


def segment_check(replayer: sc.SegmentReplayer, data: list, states: list[sc.StepState], every: int):
    bounds = sc.segment_bounds(H, every)

    def check(i: int) -> sc.SegmentDistance:
        j, e = bounds[i]
        return replayer.distance(states[j], data[j:e], states[e])

    return bounds, check


def test_an_honest_segment_replays_at_distance_zero_in_the_same_process(honest) -> None:
    data, states = honest
    replayer = sc.SegmentReplayer(MODEL, INNER)
    for every in (1, 5, EVERY):
        bounds, check = segment_check(replayer, data, states, every)
        audit = sc.first_bad_segment(check, range(len(bounds)))
        assert audit.bad is None and audit.replayed_steps == H
        assert all(d.theta == 0 and d.worst_moment == 0 and d.step_counts_agree for _, d in audit.checked)
    d = sc.segment_distance(MODEL, INNER, states[0], data[:EVERY], states[EVERY])
    assert (d.theta, d.moments) == (0.0, {"exp_avg": 0.0, "exp_avg_sq": 0.0})
    # A fresh round start (no optimiser state yet) replays too.
    fresh = trajectory(sc.StepState(1, 0, 0, states[0].params, {}), data[:3])
    assert replayer.distance(fresh[0], data[:3], fresh[3]).within(0.0, 0.0)
    assert sc.anchor_faults(states[0], states[H], states[0].params,
                            {n: states[0].params[n] - states[H].params[n] for n in states[0].params},
                            states[0].optimizer) == []


def _final(states: list[sc.StepState], theta: dict) -> list[sc.StepState]:
    last = states[-1]
    return states[:-1] + [sc.StepState(last.round, last.shard, last.step, theta, last.optimizer)]


@pytest.fixture(scope="module")
def cheats(honest) -> dict[str, tuple[list[sc.StepState], int]]:
    """Each cheat's trajectory and the step it first touches."""
    data, states = honest
    start, end = states[0].params, states[H].params
    delta = {n: start[n] - end[n] for n in start}
    norm = math.sqrt(sum(float(d.double().pow(2).sum()) for d in delta.values()))
    g = torch.Generator().manual_seed(1)
    noise = {n: torch.randn(t.shape, generator=g) for n, t in delta.items()}
    noise_norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in noise.values()))
    return {
        "scale": (_final(states, {n: start[n] - 1.01 * delta[n] for n in start}), H),
        "noise": (_final(states, {n: end[n] + 0.01 * norm / noise_norm * noise[n] for n in start}), H),
        "skip": (trajectory(states[0], data, skip=6), 6),
        "bf16": (trajectory(states[0], data, bf16=True), 1),
    }


@pytest.mark.parametrize("name", ["scale", "noise", "skip", "bf16"])
def test_each_cheat_is_named_at_its_segment_and_narrowed_to_its_step(honest, cheats, name: str) -> None:
    data, states = honest
    trajectory_, step = cheats[name]
    replayer = sc.SegmentReplayer(MODEL, INNER)
    bounds, check = segment_check(replayer, data, trajectory_, EVERY)
    audit = sc.first_bad_segment(check, range(len(bounds)))
    j, e = bounds[audit.bad]
    assert j < step <= e
    assert all(d.within(sc.SEGMENT_TOLERANCE) for _, d in audit.checked[:-1])
    bad = audit.checked[-1][1]
    assert max(bad.theta / sc.SEGMENT_TOLERANCE, bad.worst_moment / sc.MOMENT_TOLERANCE) >= 10
    narrowed = sc.narrow_to_step(replayer, trajectory_[j:e + 1], data[j:e], trajectory_[j].digest(), trajectory_[e])
    assert narrowed.step == step and narrowed.end_distance == 0
    assert all(d.within(sc.STEP_TOLERANCE) for d in narrowed.distances[:-1])
    # The sample always holds the last segment, where the lies about the update land.
    assert sc.sample_segments(len(bounds), 1, seed=3) == [len(bounds) - 1]
    if name in ("scale", "noise"):
        assert sc.first_bad_segment(check, sc.sample_segments(len(bounds), 1, seed=3)).bad == len(bounds) - 1
        faults = sc.anchor_faults(trajectory_[0], trajectory_[H], states[0].params,
                                  {n: states[0].params[n] - states[H].params[n] for n in states[0].params})
        assert faults == ["the update is not the state at step 0 minus the state at the last step"]


def test_a_per_step_reveal_must_start_at_the_committed_state(honest) -> None:
    data, states = honest
    replayer = sc.SegmentReplayer(MODEL, INNER)
    with pytest.raises(sc.StepCommitError, match="does not start"):
        sc.narrow_to_step(replayer, states[4:9], data[4:8], states[0].digest())
    with pytest.raises(sc.StepCommitError, match="one state per step"):
        sc.narrow_to_step(replayer, states[4:8], data[4:8], states[4].digest())
    # An honest reveal of a segment the auditor found bad names no step.
    narrowed = sc.narrow_to_step(replayer, states[4:9], data[4:8], states[4].digest(), states[8])
    assert narrowed.step is None and narrowed.end_distance == 0 and narrowed.note


def test_the_worker_recomputes_its_per_step_states_from_its_leaf(honest) -> None:
    data, states = honest
    again = sc.SegmentReplayer(MODEL, INNER).trajectory(states[4], data[4:8])
    assert [s.digest() for s in again] == [s.digest() for s in states[4:9]]


# --------------------------------------------------------------------------------------------------
# Revealed states, as hostile input.


def refused(raw: bytes, layout, match: str, **position) -> str:
    with pytest.raises(sc.StepStateError, match=match) as info:
        sc.decode_step_state(raw, layout, **position)
    message = str(info.value)
    assert "\n" not in message and "EVIL" not in message
    return message


def test_a_revealed_state_that_is_not_one_of_this_model_is_refused(honest) -> None:
    _, states = honest
    state = states[3]
    layout = layout_of(state.params)
    good = state.tensors()
    name = next(iter(state.params))
    refused(encode_params({**good, "EVIL.x": torch.zeros(1)}), layout, "no training state of this model holds")
    refused(encode_params({**good, f"param.{name}": torch.zeros(3)}), layout, "is not float32 of shape")
    nan = good[f"param.{name}"].clone()
    nan.view(-1)[0] = math.nan
    refused(encode_params({**good, f"param.{name}": nan}), layout, "is not finite")
    refused(encode_params({k: v for k, v in good.items() if k != f"param.{name}"}), layout, "no param")
    refused(encode_params({k: v for k, v in good.items() if k != f"exp_avg.{name}"}), layout, "but not all")
    refused(encode_params({**good, "position.step": torch.tensor(3.0)}), layout, "position.step is not int64")
    refused(encode_params({**good, f"step.{name}": torch.tensor(7.0)}), layout, "step counts")
    refused(encode_params({**good, "position.round": torch.tensor(-1)}), layout, "out of range")
    refused(encode_params(good), layout, "not the step", step=4)
    refused(encode_params(good), layout, "not the round", round_=1)
    refused(b"EVIL" * 10, layout, "not a valid safetensors")
    refused(b"\0" * (sc.step_state_limit(layout) + 1), layout, "more than the")
    assert len(encode_params(good)) <= sc.step_state_limit(layout)
    assert sc.decode_step_state(encode_params(good), layout, round_=2, shard=1, step=3).digest() == state.digest()
