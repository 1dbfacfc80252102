"""The coordinator's state machine alone: plain types in, typed refusals out, under a fake clock.

No gRPC here (trainer.coordinator.service translates; tests/integration covers the wire): the
refusal order of a push header, the close rules (quorum, stragglers, abandoned and dead workers),
the assembly of a worker's stage slices, the journal across a restart, and a published round.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from attestation import Domain, WorkerKey
from attestation.receipt import NO_REPORT, Receipt, sign_receipt
from proto import PROTOCOL_VERSION, Encoding, WorkerPhase
from storage_client import MAX_KERNEL_THREADS, Kernels, lineage
from tests.conftest import small_config
from trainer.codec import CompressionConfig
from trainer.codec.wire import Params, encode_params, layout_of
from trainer.config import InnerConfig, ModelConfig, RoundConfig
from trainer.coordinator import Coordinator, UpdateHeader, open_run
from trainer.coordinator.checks import check_state_spool
from trainer.model.stages import stage_param_names
from trainer.net.refusal import Reason, Refusal
from trainer.rounds.aggregation import CheckedUpdate, exact_norm
from trainer.rounds.update_source import DenseUpdate, dense
from trainer.runstore.run_dir import RunDir
from trainer.runstore.spool import Spool
from trainer.runtime.inner import FRESH_STATE

STATE = "ab" * 32


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def coordinator(tmp_path, clock: Clock, **sections: object) -> Coordinator:
    return Coordinator(open_run(RunDir(tmp_path / "run"), small_config(**sections)), clock=clock)


def update_of(c: Coordinator, scale: float, names: list[str] | None = None) -> Params:
    g = torch.Generator().manual_seed(int(scale * 1000))
    params = c.global_state.params
    return {n: torch.randn(params[n].shape, generator=g) * 1e-3 * scale for n in (names or params)}


def header(c: Coordinator, worker: str, update: Params, **fields: object) -> UpdateHeader:
    cfg = c.config
    round_ = int(fields.get("round", c.round.number))
    values = dict(
        protocol_version=PROTOCOL_VERSION, run_id=cfg.run_id, worker_id=worker, round=c.round.number, stage=0,
        num_stages=1, encoding=int(Encoding.DENSE_F32),
        tensors=tuple((n, d, s) for n, (d, s) in layout_of(update).items()), payload_size=1000,
        payload_sha256="0" * 64, train_loss=float(c.global_state.eval_loss_e6) / 1e6, tokens=c.run.round_tokens(round_),
        inner_steps=c.run.inner_steps(round_), base_params_cid=str(c.global_state.params_cid), base_bytes_received=0,
        signature=b"", compression_header=b"", inner_state_sha256=STATE,
    )
    values.update(fields)  # every stage slice names the worker's one commitment, as a whole update does
    return UpdateHeader(**values)


def fresh(c: Coordinator, worker: str, update: Params, **fields: object) -> UpdateHeader:
    """A header whose inner state is fresh: a test of many rounds, whose pushes would otherwise have to
    carry the state's bytes at each worker's first counted round of each window of rounds.state_every
    (4 by default) rounds (trainer.runtime.state_commit)."""
    return header(c, worker, update, **{"inner_state_sha256": FRESH_STATE, **fields})


def push(c: Coordinator, h: UpdateHeader, update: Params) -> None:
    """What the service does with a push whose payload decoded to ``update``."""
    try:
        c.admit_header(h)
        c.accept(h, CheckedUpdate(DenseUpdate(update), exact_norm(update)), 1234, encode_params(update))
    except Refusal as refusal:
        c.refuse(h, refusal)
        raise


def refused(c: Coordinator, h: UpdateHeader, update: Params) -> Reason:
    with pytest.raises(Refusal) as caught:
        push(c, h, update)
    return caught.value.reason


def joined(c: Coordinator, *workers: str) -> None:
    for w in workers:
        c.join(w, PROTOCOL_VERSION)


# ----------------------------------------------------------------------------- refusal order


def test_a_push_header_is_refused_by_its_first_fault_in_a_fixed_order(tmp_path) -> None:
    clock = Clock()
    c = coordinator(tmp_path, clock)
    joined(c, "w0", "w1")
    u = update_of(c, 1.0)
    # Each header carries every fault from its row on; the first one is the reason given.
    faults = [
        (dict(protocol_version=PROTOCOL_VERSION + 1), Reason.PROTOCOL),
        (dict(run_id="another"), Reason.WRONG_RUN),
        (dict(worker_id="stranger"), Reason.UNKNOWN_WORKER),
        (dict(round=7), Reason.ROUND_NOT_OPEN),
        (dict(base_params_cid=""), Reason.WRONG_BASE),
        (dict(encoding=99), Reason.MALFORMED),
        (dict(payload_size=10**12), Reason.MALFORMED),
        (dict(tokens=1), Reason.BAD_CLAIM),
        (dict(train_loss=-1.0), Reason.BAD_CLAIM),
        (dict(tensors=()), Reason.MALFORMED),
        (dict(inner_state_sha256="not hex"), Reason.MALFORMED),
    ]
    for i, (_, reason) in enumerate(faults):
        fields: dict = {}
        for later, _ in faults[i:]:
            fields.update(later)
        assert refused(c, header(c, "w0", u, **fields), u) is reason, faults[i]
    assert len(c.round.refused["w0"]) == 7  # those of w0's own open round are filed against it
    push(c, header(c, "w0", u), u)
    assert refused(c, header(c, "w0", u, encoding=99), u) is Reason.DUPLICATE  # held: duplicate comes first
    assert refused(c, header(c, "w1", u), u) is Reason.REPLAYED  # byte-identical to w0's


@pytest.mark.parametrize("fields", [dict(cpu_capability="avx9000", intra_op_threads=1),
                                    dict(cpu_capability="AVX2", intra_op_threads=1),
                                    dict(cpu_capability="avx2", intra_op_threads=0),
                                    dict(cpu_capability="", intra_op_threads=4),
                                    dict(cpu_capability="avx2", intra_op_threads=MAX_KERNEL_THREADS + 1),
                                    dict(cpu_capability="x" * 100, intra_op_threads=2)])
def test_kernels_outside_the_allowlist_are_refused_by_name(tmp_path, fields: dict) -> None:
    """The kernels a push names (trainer.runtime.kernels) are hostile input: one of the allowed
    capabilities with 1..MAX_KERNEL_THREADS threads, or nothing; a refusal echoes a bounded clip."""
    c = coordinator(tmp_path, Clock())
    joined(c, "w0", "w1")
    u = update_of(c, 1.0)
    with pytest.raises(Refusal) as caught:
        c.admit_header(header(c, "w0", u, **fields))
    assert caught.value.reason is Reason.MALFORMED and "cpu_capability" in str(caught.value)
    assert len(str(caught.value)) < 400


def test_a_stale_push_is_refused_as_stale_whatever_else_is_wrong(tmp_path) -> None:
    clock = Clock()
    c = coordinator(tmp_path, clock)
    joined(c, "w0", "w1")
    for w, scale in (("w0", 1.0), ("w1", 2.0)):
        u = update_of(c, scale)
        push(c, header(c, w, u), u)
    assert c.close_due()
    c.close_round()
    u = update_of(c, 3.0)
    assert refused(c, header(c, "w0", u, round=1, encoding=99, tokens=5), u) is Reason.STALE_ROUND
    assert "w0" not in c.round.refused  # a push for a closed round is not filed against the open one


def test_a_push_must_claim_the_rounds_adaptive_inner_steps(tmp_path) -> None:
    # H = 8 falls with the rank of round r-2's downlink (trainer.rounds.schedule); a push claiming the
    # fixed H is refused, and a restarted coordinator derives the same H_r from the store.
    clock = Clock()
    compression = CompressionConfig(enabled=True, min_rank=1, max_rank=4, target_energy=0.05)
    c = coordinator(tmp_path, clock, inner=InnerConfig(steps=8, min_steps=2, batch_size=4, lr=1e-3,
                                                       adaptive_steps=True),
                    compression=compression, rounds=dataclasses.replace(small_config().rounds, rounds=4))
    joined(c, "w0", "w1")
    for scale in (1.0, 3.0):
        assert c.run.inner_steps(c.round.number) == 8  # rounds 1 and 2 train H
        for w, offset in (("w0", 0.0), ("w1", 1.0)):
            u = update_of(c, scale + offset)
            push(c, header(c, w, u), u)
        assert c.close_due()
        c.close_round()
    steps = c.run.inner_steps(3)
    assert 2 <= steps < 8
    u = update_of(c, 5.0)
    fixed_h = header(c, "w0", u, inner_steps=8, tokens=8 * 4 * 32)
    with pytest.raises(Refusal, match=f"round 3 is {steps} inner steps"):
        push(c, fixed_h, u)
    push(c, header(c, "w0", u), u)
    assert c.round.accepted["w0"].entry.inner_steps == steps
    restarted = Coordinator(open_run(RunDir(tmp_path / "run"), None), clock=clock)
    assert restarted.run.inner_steps(3) == steps and restarted.round.accepted["w0"].entry.tokens == steps * 4 * 32


# ----------------------------------------------------------------------------- close rules


def test_a_round_closes_when_everyone_live_delivered_or_after_the_straggler_timeout(tmp_path) -> None:
    clock = Clock()
    c = coordinator(tmp_path, clock, rounds=RoundConfig(rounds=3, expected_workers=3, quorum=2,
                                                         straggler_timeout_s=30.0, liveness_timeout_s=3.0))
    joined(c, "w0", "w1", "w2")
    assert not c.close_due()  # nothing accepted: nothing to close
    u0 = update_of(c, 1.0)
    push(c, header(c, "w0", u0), u0)
    assert not c.close_due()  # below quorum, and w1, w2 are live and have not delivered
    clock.now += 1.0
    u1 = update_of(c, 2.0)
    push(c, header(c, "w1", u1), u1)
    assert not c.close_due()  # quorum, but w2 is live and may still deliver
    c.heartbeat("w2", 1, WorkerPhase.ABANDONED)  # w2 will push nothing this round
    assert c.close_due() and c.round.closing
    assert c.close_round().participants == ("w0", "w1")

    u0 = update_of(c, 3.0)
    push(c, header(c, "w0", u0), u0)
    clock.now += 29.9
    c.heartbeat("w1", 2, WorkerPhase.TRAINING)
    c.heartbeat("w2", 2, WorkerPhase.TRAINING)
    assert not c.close_due()
    clock.now += 0.2  # 30 s after the first accepted update: the stragglers are dropped
    assert c.close_due()
    summary = c.close_round()
    assert summary.participants == ("w0",) and summary.dropped == ("w1", "w2")


def test_a_dead_worker_does_not_hold_a_round_open(tmp_path) -> None:
    clock = Clock()
    c = coordinator(tmp_path, clock)
    joined(c, "w0", "w1")
    clock.now += 2.0
    c.heartbeat("w0", 1, WorkerPhase.TRAINING)
    clock.now += 2.0  # w1 silent for 4 s > liveness 3 s
    u = update_of(c, 1.0)
    push(c, header(c, "w0", u), u)
    assert not c.close_due()  # quorum 2 is not met by one update
    c2 = coordinator(tmp_path / "two", clock, rounds=dataclasses.replace(c.config.rounds, quorum=1))
    joined(c2, "w0", "w1")
    clock.now += 4.0
    c2.heartbeat("w0", 1, WorkerPhase.TRAINING)
    u = update_of(c2, 1.0)
    push(c2, header(c2, "w0", u), u)
    assert c2.close_due()  # w1 is not live: only w0 could deliver


def test_inner_state_bytes_come_on_the_rounds_state_every_names_and_are_checked(tmp_path) -> None:
    """rounds.state_every = 1 (trainer.runtime.state_commit): a push whose state is not fresh must
    carry it, within the size bound, and the bytes must be a worker's state; a fresh one carries none."""
    clock = Clock()
    c = coordinator(tmp_path, clock, rounds=dataclasses.replace(small_config().rounds, state_every=1))
    joined(c, "w0", "w1")
    u = update_of(c, 1.0)
    assert refused(c, header(c, "w0", u), u) is Reason.MALFORMED  # STATE is not fresh: its bytes must come
    assert refused(c, header(c, "w0", u, inner_state_size=10**12), u) is Reason.MALFORMED
    assert refused(c, header(c, "w0", u, inner_state_sha256=FRESH_STATE, inner_state_size=10), u) is Reason.MALFORMED
    with pytest.raises(Refusal, match="no worker's state holds") as caught:
        check_state_spool(spool_of(c, encode_params({"exp_avg_sq.nothing": torch.zeros(2)})), c.layout, c.config)
    assert caught.value.reason is Reason.MALFORMED
    push(c, header(c, "w0", u, inner_state_sha256=FRESH_STATE), u)  # a fresh state carries none


def spool_of(c: Coordinator, data: bytes) -> Spool:
    """``data`` as the service spools a push's inner state (trainer.runstore.spool), finished."""
    spool = Spool(c.run.run_dir.scratch, len(data), hashlib.sha256(data).hexdigest(), what="a test's state")
    spool.add(data)
    spool.finish()
    return spool


def push_with_state(c: Coordinator, worker: str, update: Params, state: bytes) -> None:
    """A push that carries the inner state ``state`` (its header commits to those bytes), stored as
    the service stores it."""
    h = header(c, worker, update, inner_state_sha256=hashlib.sha256(state).hexdigest(), inner_state_size=len(state))
    c.admit_header(h)
    spool = spool_of(c, state)
    try:
        c.accept(h, CheckedUpdate(DenseUpdate(update), exact_norm(update)), 1234, encode_params(update), spool)
    finally:
        spool.discard()


def test_the_inner_state_is_due_at_a_workers_first_counted_round_of_each_window(tmp_path) -> None:
    """rounds.state_every = 3 (trainer.runtime.state_commit): windows [0, 3), [3, 6). Absent from round 3
    (the window's first), w1 must carry its state at its next contribution, round 4, where w0, which
    uploaded in round 3, need not. A state sent unasked (a worker in doubt after a refused push) is
    taken while the worker's window holds fewer than MAX_STORED_PER_WINDOW stored states, refused
    past that, also by a restarted coordinator (its view comes from the manifests and the store)."""
    clock = Clock()
    c = coordinator(tmp_path, clock, rounds=RoundConfig(rounds=6, expected_workers=2, quorum=1, state_every=3,
                                                         straggler_timeout_s=10.0, liveness_timeout_s=60.0))
    joined(c, "w0", "w1")
    for _ in range(2):  # window 0: nothing is due (every chain starts fresh in it)
        for w, offset in (("w0", 0.0), ("w1", 0.5)):
            u = update_of(c, c.round.number + offset)
            push(c, header(c, w, u), u)
        assert c.close_due()
        c.close_round()
    u = update_of(c, 3.0)
    assert refused(c, header(c, "w0", u), u) is Reason.MALFORMED  # round 3 is w0's first of window 1
    push_with_state(c, "w0", u, b"w0 at round 3")
    clock.now += 10.0  # w1 is absent from round 3
    assert c.close_due()
    c.close_round()
    v, u = update_of(c, 4.5), update_of(c, 4.0)
    with pytest.raises(Refusal, match="must carry it") as caught:
        push(c, header(c, "w1", v), v)  # round 4 is w1's first counted one of window 1
    assert caught.value.reason is Reason.MALFORMED
    push_with_state(c, "w1", v, b"w1 at round 4")
    push_with_state(c, "w0", u, b"w0 at round 4")  # unasked: its second stored state of the window
    assert c.close_due()
    c.close_round()
    restarted = Coordinator(open_run(RunDir(tmp_path / "run"), None), clock=clock)
    u, v = update_of(restarted, 5.0), update_of(restarted, 5.5)
    with pytest.raises(Refusal, match="already stored 2 inner states") as caught:
        push_with_state(restarted, "w0", u, b"w0 at round 5")
    assert caught.value.reason is Reason.MALFORMED and len(str(caught.value)) < 300
    push(restarted, header(restarted, "w0", u), u)  # not due, so none is needed
    push_with_state(restarted, "w1", v, b"w1 at round 5")  # w1's window holds one: one more is taken
    assert restarted.close_due()
    restarted.close_round()
    u = update_of(restarted, 6.0)
    assert refused(restarted, header(restarted, "w0", u, stage=0, inner_state_sha256=FRESH_STATE, inner_state_size=9),
                   u) is Reason.MALFORMED  # a fresh state is never sent
    assert refused(restarted, header(restarted, "w0", u), u) is Reason.MALFORMED  # round 6: window 2 begins


# ----------------------------------------------------------------------------- stage slices


def two_stage(tmp_path, clock: Clock) -> Coordinator:
    return coordinator(tmp_path, clock, model=ModelConfig(block_size=32, n_layer=2, n_head=2, n_embd=32))


def test_a_workers_stage_slices_count_once_all_are_in_as_their_union(tmp_path) -> None:
    clock = Clock()
    c = two_stage(tmp_path, clock)
    joined(c, "w0", "w1")
    names = stage_param_names(c.config.model, 2)
    whole = update_of(c, 1.0)
    slices = [{n: whole[n] for n in names[s]} for s in range(2)]
    push(c, header(c, "w0", slices[0], stage=0, num_stages=2), slices[0])
    assert "w0" not in c.round.accepted and set(c.round.partial["w0"].slices) == {0}
    assert refused(c, header(c, "w0", slices[0], stage=0, num_stages=2), slices[0]) is Reason.DUPLICATE
    assert refused(c, header(c, "w0", slices[1], stage=1, num_stages=3), slices[1]) is Reason.MALFORMED
    assert "w0" not in c.round.partial  # a refused slice drops the worker's others
    for s in range(2):
        push(c, header(c, "w0", slices[s], stage=s, num_stages=2), slices[s])
    accepted = c.round.accepted["w0"]
    held = dense(accepted.source)
    assert set(held) == set(whole) and all(torch.equal(held[n], whole[n]) for n in whole)
    assert accepted.entry.bytes_sent == 2 * 1234 and accepted.entry.state == STATE


def test_slices_of_one_round_must_agree_on_their_metrics(tmp_path) -> None:
    clock = Clock()
    c = two_stage(tmp_path, clock)
    joined(c, "w0", "w1")
    names = stage_param_names(c.config.model, 2)
    whole = update_of(c, 1.0)
    first = {n: whole[n] for n in names[0]}
    second = {n: whole[n] for n in names[1]}
    loss = float(c.global_state.eval_loss_e6) / 1e6
    push(c, header(c, "w0", first, stage=0, num_stages=2, train_loss=loss), first)
    assert refused(c, header(c, "w0", second, stage=1, num_stages=2, train_loss=loss * 0.9), second) is Reason.BAD_CLAIM
    # ... and on the inner state they commit to: one worker's, named by every slice.
    push(c, header(c, "w0", first, stage=0, num_stages=2, train_loss=loss), first)
    assert refused(c, header(c, "w0", second, stage=1, num_stages=2, train_loss=loss,
                              inner_state_sha256="cd" * 32), second) is Reason.BAD_CLAIM
    # ... and on the kernels they ran: the ones every stage ran, named by every slice.
    for kernels in (dict(cpu_capability="avx2", intra_op_threads=1), {}):  # other threads; none
        push(c, header(c, "w0", first, stage=0, num_stages=2, train_loss=loss, cpu_capability="avx2",
                       intra_op_threads=2), first)
        assert refused(c, header(c, "w0", second, stage=1, num_stages=2, train_loss=loss, **kernels),
                       second) is Reason.BAD_CLAIM
    assert refused(c, header(c, "w1", first, stage=0, num_stages=2, cpu_capability="avx9",
                              intra_op_threads=1), first) is Reason.MALFORMED
    assert refused(c, header(c, "w1", first, stage=0, num_stages=2, inner_state_sha256=""), first) is Reason.MALFORMED


# ----------------------------------------------------------------------------- durability


def test_accepted_updates_and_slices_survive_a_restart_and_the_round_publishes(tmp_path) -> None:
    clock = Clock()
    c = two_stage(tmp_path, clock)
    joined(c, "w0", "w1")
    names = stage_param_names(c.config.model, 2)
    u0 = update_of(c, 1.0)
    push(c, header(c, "w0", u0, cpu_capability="avx2", intra_op_threads=3), u0)
    u1 = update_of(c, 2.0)
    first = {n: u1[n] for n in names[0]}
    push(c, header(c, "w1", first, stage=0, num_stages=2, cpu_capability="default", intra_op_threads=2), first)

    restarted = Coordinator(open_run(RunDir(tmp_path / "run"), None), clock=clock)
    assert set(restarted.round.accepted) == {"w0"} and set(restarted.round.partial["w1"].slices) == {0}
    joined(restarted, "w0", "w1")
    second = {n: u1[n] for n in names[1]}
    push(restarted, header(restarted, "w1", second, stage=1, num_stages=2, cpu_capability="default",
                           intra_op_threads=2), second)
    assert restarted.close_due()
    summary = restarted.close_round()
    assert summary.participants == ("w0", "w1") and restarted.round.number == 2
    chain = lineage(restarted.run.run_dir.store, restarted.run.run_dir.head())
    manifest = chain[-1][1]
    assert [p.worker for p in manifest.participants] == ["w0", "w1"]
    assert manifest.participants[0].state == STATE and manifest.participants[1].state == STATE
    # The kernels each trained with (w1's: its stages', named by both slices), through the journal and the restart.
    assert manifest.participants[0].kernels == Kernels("avx2", 3)
    assert manifest.participants[1].kernels == Kernels("default", 2)
    assert all(p.tokens == restarted.run.round_tokens(manifest.round) for p in manifest.participants)


def test_a_torn_stage_journal_is_refused_by_name_not_half_used(tmp_path) -> None:
    clock = Clock()
    c = two_stage(tmp_path, clock)
    joined(c, "w0", "w1")
    run_dir = c.run.run_dir
    for bad, says in (({"num_stages": "2", "slices": {}}, "num_stages >= 2"),
                      ({"num_stages": 2, "slices": {"7": {}}}, "stage '7' is not one of 0..1"),
                      ({"num_stages": 2, "slices": {"0": {"cid": 3}}}, "field 'cid'")):
        run_dir.save_pending(1, {"w0": bad}, "stages")
        with pytest.raises(ValueError, match=says):
            Coordinator(open_run(RunDir(tmp_path / "run"), None), clock=clock)


# ----------------------------------------------------------------------------- honest claims at any H


def test_any_finite_nonnegative_train_loss_is_accepted_whatever_the_held_out_loss(tmp_path) -> None:
    """Overfitting a shard at a large H drives the mean train loss far below the held-out loss of
    the start (0.39 against 2.28 with the demo model at H = 500), and a shard of another
    distribution, or a diverging learning rate, can put it far above: honest either way."""
    clock = Clock()
    c = coordinator(tmp_path, clock, rounds=RoundConfig(rounds=3, expected_workers=4, quorum=4))
    joined(c, "w0", "w1", "w2", "w3")
    start_loss = c.global_state.eval_loss_e6 / 1e6
    for i, loss in enumerate((0.0, start_loss / 50, start_loss * 20 + 10)):
        u = update_of(c, 1.0 + i)
        push(c, header(c, f"w{i}", u, train_loss=loss), u)
    u = update_of(c, 9.0)
    for impossible in (-1e-6, float("nan"), float("inf"), 1e6):  # no mean cross-entropy, or beyond the e6 fields
        assert refused(c, header(c, "w3", u, train_loss=impossible), u) is Reason.BAD_CLAIM
    assert set(c.round.accepted) == {"w0", "w1", "w2"}


# ----------------------------------------------------------------------------- a round that cannot close


def test_a_round_whose_every_live_push_was_refused_stops_the_run_with_its_reasons(tmp_path) -> None:
    clock = Clock()
    c = coordinator(tmp_path, clock, rounds=RoundConfig(rounds=3, expected_workers=2, quorum=2,
                                                         straggler_timeout_s=10.0, liveness_timeout_s=3.0))
    joined(c, "w0", "w1")
    assert c.stalled() is None  # nothing pushed yet
    u0 = update_of(c, 1.0)
    assert refused(c, header(c, "w0", u0, tokens=1), u0) is Reason.BAD_CLAIM
    clock.now += 20.0
    c.heartbeat("w0", 1, WorkerPhase.WAITING)
    c.heartbeat("w1", 1, WorkerPhase.TRAINING)
    assert c.stalled() is None  # w1 is live and may still deliver
    u1 = update_of(c, 2.0)
    assert refused(c, header(c, "w1", u1, base_params_cid=""), u1) is Reason.WRONG_BASE
    assert c.stalled() is None  # every live push refused: said once that held straggler_timeout_s
    clock.now += 2.0
    c.heartbeat("w0", 1, WorkerPhase.WAITING)
    c.heartbeat("w1", 1, WorkerPhase.WAITING)
    assert c.stalled() is None
    clock.now += 8.0
    c.heartbeat("w0", 1, WorkerPhase.WAITING)
    c.heartbeat("w1", 1, WorkerPhase.WAITING)
    why = c.stalled()
    assert why is not None and why.startswith("round 1 cannot close: every live worker's push of it was refused")
    assert "w0: claimed tokens 1" in why and "w1: update for round 1 names no base_params_cid" in why
    assert "\n" not in why
    c.halt(why)
    with pytest.raises(Refusal) as caught:
        c.global_for("w0", 2)
    assert caught.value.reason is Reason.HALTED and why in caught.value.message


def test_a_refused_worker_beside_an_accepted_one_does_not_stop_the_run(tmp_path) -> None:
    clock = Clock()
    c = coordinator(tmp_path, clock, rounds=RoundConfig(rounds=3, expected_workers=2, quorum=2,
                                                         straggler_timeout_s=10.0, liveness_timeout_s=30.0))
    joined(c, "w0", "w1")
    u0, u1 = update_of(c, 1.0), update_of(c, 2.0)
    assert refused(c, header(c, "w0", u0, tokens=1), u0) is Reason.BAD_CLAIM
    push(c, header(c, "w1", u1), u1)
    c.stalled()
    clock.now += 11.0
    assert c.stalled() is None and c.close_due()


def test_a_live_id_that_never_pushes_holds_back_one_round_once_not_every_round(tmp_path) -> None:
    """An insider id kept live (heartbeats, long-polls) that never pushes is waited for once, up to
    the straggler timeout; from the next round on it is a laggard, and rounds close without it,
    until it delivers again."""
    clock = Clock()
    c = coordinator(tmp_path, clock, rounds=RoundConfig(rounds=5, expected_workers=2, quorum=1,
                                                         straggler_timeout_s=10.0, liveness_timeout_s=30.0))
    joined(c, "w0", "idle")
    u = update_of(c, 1.0)
    push(c, fresh(c, "w0", u), u)
    assert not c.close_due()          # round 1 waits for the live id ...
    clock.now += 10.0
    c.heartbeat("idle", 1, WorkerPhase.TRAINING)
    assert c.close_due()              # ... until the straggler timeout
    c.close_round()
    for _ in range(2):                # then rounds close as soon as w0 is in
        c.heartbeat("idle", c.round.number, WorkerPhase.TRAINING)
        u = update_of(c, 2.0 + c.round.number)
        push(c, fresh(c, "w0", u), u)
        assert c.close_due()
        c.close_round()
    u, v = update_of(c, 7.0), update_of(c, 8.0)   # once it delivers again, it is waited for again
    push(c, fresh(c, "idle", v), v)
    c.close_due()
    clock.now += 10.0
    assert c.close_due()
    c.close_round()
    push(c, fresh(c, "w0", u), u)
    assert not c.close_due()


def test_a_refused_push_does_not_make_a_laggard_awaited_again(tmp_path) -> None:
    """Only an accepted update earns being waited for: an insider whose pushes are refused (or cut
    before they finish) stays a laggard, so it cannot hold back every other round."""
    clock = Clock()
    c = coordinator(tmp_path, clock, rounds=RoundConfig(rounds=5, expected_workers=2, quorum=1,
                                                         straggler_timeout_s=10.0, liveness_timeout_s=30.0))
    joined(c, "w0", "mallory")
    u = update_of(c, 1.0)
    push(c, fresh(c, "w0", u), u)
    clock.now += 10.0
    c.heartbeat("mallory", 1, WorkerPhase.TRAINING)
    assert c.close_due()
    c.close_round()
    for i in range(3):
        c.heartbeat("mallory", c.round.number, WorkerPhase.TRAINING)
        if i == 0:  # refused in round 2, then silent (a push that never finishes) in round 3 and 4
            bad = update_of(c, 3.0 + c.round.number)
            assert refused(c, fresh(c, "mallory", bad, tokens=1), bad) is Reason.BAD_CLAIM
        u = update_of(c, 5.0 + c.round.number)
        push(c, fresh(c, "w0", u), u)
        assert c.close_due()  # no straggler wait for mallory in any of these rounds
        c.close_round()


def test_an_honest_worker_that_lost_one_round_is_waited_for_in_the_next(tmp_path) -> None:
    """A worker accepted in round 1 whose push of round 2 was refused (late, or a failure it said it
    abandoned) is waited for in round 3, so it is not dropped from every round after one mishap."""
    clock = Clock()
    c = coordinator(tmp_path, clock, rounds=RoundConfig(rounds=5, expected_workers=2, quorum=1,
                                                         straggler_timeout_s=10.0, liveness_timeout_s=30.0))
    joined(c, "w0", "w1")
    for w in ("w0", "w1"):
        u = update_of(c, 1.0 if w == "w0" else 2.0)
        push(c, header(c, w, u), u)
    assert c.close_due()
    c.close_round()
    bad, u = update_of(c, 3.0), update_of(c, 4.0)
    assert refused(c, header(c, "w1", bad, tokens=1), bad) is Reason.BAD_CLAIM
    push(c, header(c, "w0", u), u)
    assert c.close_due()
    c.close_round()
    c.heartbeat("w1", 3, WorkerPhase.TRAINING)
    u = update_of(c, 5.0)
    push(c, header(c, "w0", u), u)
    assert not c.close_due()  # round 3 waits for w1 ...
    v = update_of(c, 6.0)
    push(c, header(c, "w1", v), v)
    assert c.close_due()      # ... which delivers


# ----------------------------------------------------------------------------- a lost push reply


class ReceiptTrust:
    """The run trust's receipt part as settlement.ledger_trust has it (attestation.receipt.sign_receipt);
    admitting a key and checking a push signature are the ledger gate's (tests/integration): here any
    joining address is admitted and every push signature counted as checked."""

    def __init__(self) -> None:
        self.signer = WorkerKey(bytes(range(1, 33)))
        self.domain = Domain(31337, "0x5FbDB2315678afecb367f032d93F642f64180aa3")
        self.checked = 0

    def admit(self, worker_id: str, address: str, evidence: bytes, nonce: bytes) -> str:
        return address

    def check_update(self, *args: object) -> None:
        self.checked += 1

    def receipt(self, worker: str, round_: int, update_digest: bytes, report_digest: bytes = NO_REPORT):
        return sign_receipt(self.signer, self.domain, Receipt(bytes(32), round_, worker, update_digest, report_digest))


def test_a_repeated_push_gets_the_receipt_already_signed_across_a_restart_and_the_close(tmp_path) -> None:
    """A worker whose push reply was lost pushes again: the same (round, payload, signature) from the
    same worker is answered with its update receipt, identical to the first, from the journal after a
    restart and from the manifest once the round closed; anything else gets none (a duplicate)."""
    clock, trust = Clock(), ReceiptTrust()
    keys = {w: WorkerKey(bytes([k]) * 32) for k, w in ((7, "w0"), (8, "w1"))}
    c = Coordinator(open_run(RunDir(tmp_path / "run"), small_config()), clock=clock, trust=trust)
    pushed = {}
    for scale, (w, key) in enumerate(keys.items(), start=1):
        c.join(w, PROTOCOL_VERSION, address=key.address)
        u = update_of(c, float(scale))
        h = header(c, w, u, payload_sha256=hashlib.sha256(encode_params(u)).hexdigest(), signature=bytes([scale]) * 65)
        c.admit_header(h)
        cid, _, receipt = c.accept(h, CheckedUpdate(DenseUpdate(u), exact_norm(u)), 1234, encode_params(u))
        assert receipt is not None and receipt.receipt.worker == key.address
        pushed[w] = (h, cid, receipt)
    h0, cid0, first = pushed["w0"]
    assert c.intake.receipt_again(h0, trust) == (cid0, 1, first)
    assert c.intake.receipt_again(h0, None) is None  # no ledger, no receipt: ALREADY_EXISTS as before
    for other in (dataclasses.replace(h0, payload_sha256="ab" * 32), dataclasses.replace(h0, signature=b"\x09" * 65),
                  dataclasses.replace(h0, worker_id="w1"), dataclasses.replace(h0, round=2),
                  dataclasses.replace(h0, run_id="other")):
        assert c.intake.receipt_again(other, trust) is None
    with pytest.raises(Refusal) as caught:  # and the header's checks refuse it as they did
        c.admit_header(dataclasses.replace(h0, payload_sha256="ab" * 32))
    assert caught.value.reason == Reason.DUPLICATE

    restarted = Coordinator(open_run(RunDir(tmp_path / "run"), None), clock=clock, trust=trust)
    for w, key in keys.items():
        restarted.join(w, PROTOCOL_VERSION, address=key.address)
    assert restarted.intake.receipt_again(h0, trust) == (cid0, 1, first)
    assert restarted.close_due()
    restarted.close_round()
    assert restarted.intake.receipt_again(h0, trust) == (cid0, 2, first)  # the round published: from its manifest
    assert restarted.intake.receipt_again(pushed["w1"][0], trust)[2] == pushed["w1"][2]
