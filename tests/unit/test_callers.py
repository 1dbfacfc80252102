"""Who may act for a worker, and what one caller may cost: the pure parts, under a fake clock.

The state machine's registry (join takeover, the bound on remembered ids), stateless join nonces,
field bounds, rate limits, stream slots and the log budget. The gRPC path over TLS is in
tests/integration/test_hostile_network.py.
"""

from __future__ import annotations

import contextlib
import logging

import pytest

from proto import PROTOCOL_VERSION, WorkerPhase, pb
from settlement.gate import JoinNonces
from tests.conftest import small_config
from trainer.coordinator import Coordinator, open_run
from trainer.net.limits import (
    ConnectionCap,
    Exhausted,
    FieldError,
    LogBudget,
    Progress,
    StreamBudget,
    TokenBucket,
    check_fields,
    check_phase,
    check_worker_id,
    clip,
)
from trainer.net.refusal import Reason, Refusal
from trainer.runstore.run_dir import RunDir


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def coordinator(tmp_path) -> tuple[Coordinator, Clock]:
    clock = Clock()
    config = small_config()  # liveness 3 s, 2 expected workers: at most 16 ids remembered
    return Coordinator(open_run(RunDir(tmp_path / "run"), config), clock=clock), clock


def test_a_live_workers_id_is_taken_over_only_by_that_worker(coordinator) -> None:
    c, clock = coordinator
    c.join("w0", PROTOCOL_VERSION)
    with pytest.raises(Refusal) as refused:
        c.join("w0", PROTOCOL_VERSION)  # someone else, while w0 is live
    assert refused.value.reason is Reason.ID_HELD and "held by a live worker" in refused.value.message
    c.join("w0", PROTOCOL_VERSION, proves_session=True)  # w0 itself, with its session
    clock.now += 3.5  # w0's liveness lapses: a restarted w0 (new process, no session) may take its id
    assert c.join("w0", PROTOCOL_VERSION) == (0, 1)


def test_the_registry_is_bounded_and_forgets_the_longest_silent(coordinator) -> None:
    c, clock = coordinator
    for i in range(c.registry.max_registered):
        c.join(f"w{i}", PROTOCOL_VERSION)
        clock.now += 0.01
    with pytest.raises(Refusal) as full:
        c.join("late", PROTOCOL_VERSION)  # every remembered id is live
    assert full.value.reason is Reason.REGISTRY_FULL
    clock.now += 10  # all silent now
    c.heartbeat("w0", 1, WorkerPhase.TRAINING)
    c.join("late", PROTOCOL_VERSION)
    assert len(c.registered()) == c.registry.max_registered
    assert "w1" not in c.registered() and {"w0", "late"} <= c.registered()  # w1 was silent longest
    assert set(c.run.run_dir.workers()) == c.registered()


def test_join_nonces_are_bound_to_their_worker_id_single_use_and_expire() -> None:
    clock = Clock(5000.0)
    nonces = JoinNonces(ttl_s=300.0, clock=clock)
    mine = nonces.issue("w0")
    for _ in range(100):  # a flood of challenges in w0's name changes nothing for w0's own nonce
        nonces.issue("w0")
    with pytest.raises(Refusal, match="not issued to this worker id"):
        nonces.take("eve", mine)
    nonces.take("w0", mine)
    with pytest.raises(Refusal, match="already used"):
        nonces.take("w0", mine)
    late = nonces.issue("w0")
    clock.now += 301
    with pytest.raises(Refusal, match="expired"):
        nonces.take("w0", late)
    with pytest.raises(Refusal, match="not issued"):
        nonces.take("w0", b"\x00" * 32)
    with pytest.raises(Refusal, match="not issued"):
        JoinNonces(clock=clock).take("w0", nonces.issue("w0"))  # another coordinator's secret


def test_every_request_field_is_bounded_and_refusals_quote_little() -> None:
    check_fields(pb.JoinRequest(worker_id="w0", evidence=b"x" * 1000))
    with pytest.raises(FieldError, match=r"JoinRequest.worker_id is 100000 characters, more than 128"):
        check_fields(pb.JoinRequest(worker_id="x" * 100_000))
    with pytest.raises(FieldError, match="UpdateHeader.run_id"):
        check_fields(pb.UpdateChunk(header=pb.UpdateHeader(run_id="r" * 2_500_000)))
    with pytest.raises(FieldError, match="TensorSpec.shape has 9 entries"):
        check_fields(pb.UpdateHeader(tensors=[pb.TensorSpec(name="a", shape=[1] * 9)]))
    with pytest.raises(FieldError, match="nonce is 300 bytes"):
        check_fields(pb.JoinRequest(nonce=b"n" * 300))
    with pytest.raises(FieldError) as bad_id:
        check_worker_id("é" * 10_000)
    assert len(str(bad_id.value)) < 200
    with pytest.raises(FieldError):
        check_phase(99)
    with pytest.raises(FieldError):
        check_phase(WorkerPhase.JOINED)  # the coordinator's to set
    check_phase(WorkerPhase.TRAINING)
    assert clip("a" * 1000).endswith("(1000 characters)") and len(clip("a" * 1000)) < 100


def test_token_bucket_limits_each_key_and_forgets_old_ones() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=1.0, burst=3.0, max_keys=2, clock=clock)
    assert [bucket.allow("a") for _ in range(4)] == [True, True, True, False]
    assert bucket.allow("b")  # another host is not limited by a's flood
    clock.now += 1.0
    assert bucket.allow("a") and not bucket.allow("a")
    bucket.allow("c")
    assert len(bucket._buckets) == 2


def test_streams_are_budgeted_per_worker_and_no_other_id_can_take_them() -> None:
    streams = StreamBudget({"push": 2, "fetch": 1})
    with streams.hold("push", "a"), streams.hold("push", "a"):
        with pytest.raises(Exhausted, match="'a' already holds 2 push"):
            with streams.hold("push", "a"):
                pass
        with contextlib.ExitStack() as others:
            for i in range(100):  # a hundred other ids hold what they may ...
                others.enter_context(streams.hold("push", f"m{i}"))
                others.enter_context(streams.hold("fetch", f"m{i}"))
            with streams.hold("fetch", "a"):  # ... and a still has its fetch
                assert streams.held("fetch") == 101
            assert streams.held("push") == 102
    with pytest.raises(RuntimeError), streams.hold("push", "a"):  # given back when the call raised too
        raise RuntimeError
    assert streams.held() == 0


def test_calls_are_held_on_a_bounded_number_of_connections_per_host() -> None:
    cap = ConnectionCap(per_host=2)
    with cap.hold("ipv4:10.0.0.1:1000"), cap.hold("ipv4:10.0.0.1:1000"), cap.hold("ipv4:10.0.0.1:1001"):
        with pytest.raises(Exhausted, match="2 connections"):
            with cap.hold("ipv4:10.0.0.1:1002"):
                pass
        with cap.hold("ipv4:10.0.0.2:1002"):  # another host is not limited by this one
            assert cap.connections("ipv4:10.0.0.2") == 1
    assert cap.connections("ipv4:10.0.0.1") == 0
    with cap.hold("ipv4:10.0.0.1:1002"):
        pass


def test_a_stream_keeps_its_pace_after_a_grace_and_never_idles_too_long() -> None:
    pace = Progress(started=100.0, grace_s=10.0, min_rate=1000.0, idle_s=5.0)
    assert pace.allowance(100.0) == 5.0  # idle allowance first
    pace.moved(100_000, 104.0)           # a fast start earns slack ...
    assert pace.allowance(104.0) == 5.0
    for t in range(105, 300, 4):         # ... and a drip of a byte every 4 s spends it
        if pace.allowance(float(t)) <= 0:
            break
        pace.moved(1, float(t))
    assert pace.allowance(float(t)) <= 0 and 100 + 10 + 100 <= t + 4, t
    assert "KiB/s" in pace.describe(float(t))
    drip = Progress(started=0.0, grace_s=10.0, min_rate=1000.0, idle_s=5.0)
    for t in range(0, 60, 4):
        if drip.allowance(float(t)) <= 0:
            break
        drip.moved(1, float(t))
    assert t <= 16, t  # cut within the grace and an idle allowance


def test_log_budget_keeps_ten_lines_a_minute_per_kind(caplog) -> None:
    clock = Clock()
    budget = LogBudget(logging.getLogger("test.budget"), per_minute=10, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.budget"):
        for i in range(1000):
            budget.warning("field", "bad field %d", i)
        budget.warning("other", "another kind")
        clock.now += 61
        budget.warning("field", "after a minute")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 12 and "another kind" in lines
    assert lines[-1] == "after a minute (990 more like it from '*' not logged)"


def test_log_budget_is_per_party_and_capped_for_all_parties_together(caplog) -> None:
    """1,000 refusals from one worker cost its 10 lines a minute and leave other parties theirs;
    1,000 parties together cost at most ``all_per_minute`` lines; each party's next line says how
    many of its own were not logged; memory stays within ``max_keys`` windows."""
    clock = Clock()
    budget = LogBudget(logging.getLogger("test.budget"), per_minute=10, clock=clock, all_per_minute=50, max_keys=64)
    with caplog.at_level(logging.INFO, logger="test.budget"):
        for i in range(1000):
            budget.log(logging.INFO, "refused push", "mallory", "refused push %d from mallory", i)
        budget.warning("refused push", "refused push from w0", party="w0")
        assert [r.getMessage() for r in caplog.records].count("refused push from w0") == 1
        assert len(caplog.records) == 11
        caplog.clear()
        clock.now += 61
        budget.log(logging.INFO, "refused push", "mallory", "refused push again")
        assert [r.getMessage() for r in caplog.records] == [
            "refused push again (990 more like it from 'mallory' not logged)"]
        caplog.clear()
        for i in range(1000):
            budget.warning("field", "bad field from host %d", i, party=f"host{i}")
        assert len(caplog.records) == 50
        assert len(budget._window) <= 64


def test_after_a_restart_registered_workers_get_one_liveness_window_to_come_back(tmp_path) -> None:
    clock = Clock()
    run = RunDir(tmp_path / "run")
    first = Coordinator(open_run(run, small_config()), clock=clock)
    first.join("w0", PROTOCOL_VERSION)
    restarted = Coordinator(open_run(run, None), clock=clock)  # w0 has not reconnected yet
    assert not restarted.live_workers_done()  # the final checkpoint is not left unfetched
    clock.now += 3.5  # liveness_timeout_s = 3: w0 is gone for good
    assert restarted.live_workers_done()


def test_a_worker_trains_only_from_a_global_state_its_coordinator_signed() -> None:
    from attestation import WorkerKey
    from attestation.signing import global_digest
    from storage_client import CID
    from trainer.codec.wire import WireError
    from trainer.net.tls import ClientTls
    from trainer.worker import Worker

    worker = Worker("127.0.0.1:1", "w0", tls=ClientTls(insecure=True))  # no connection is made
    client = worker.client
    client.close()
    coordinator, mallory = WorkerKey.generate(), WorkerKey.generate()
    client.run_digest = b"\x07" * 32
    client.check_coordinator_key(coordinator.address)
    params, manifest = CID.of(b"params"), CID.of(b"manifest")

    def header(key: WorkerKey, round_: int = 3) -> pb.GlobalHeader:
        signature = key.sign_digest(global_digest(client.run_digest, round_, params.digest, manifest.digest))
        return pb.GlobalHeader(available=True, round=3, params_cid=str(params), manifest_cid=str(manifest),
                               signature=signature)

    client.checked_signature(header(coordinator))
    with pytest.raises(WireError, match="is signed by .*, not by the coordinator's key"):
        client.checked_signature(header(mallory))
    with pytest.raises(WireError, match="is signed by"):
        client.checked_signature(header(coordinator, round_=2))  # a signature of another round
    with pytest.raises(WireError, match="no valid coordinator signature"):
        client.checked_signature(pb.GlobalHeader(available=True, round=3, params_cid=str(params),
                                                  manifest_cid=str(manifest)))
    from trainer.worker import WorkerError

    with pytest.raises(WorkerError, match="signing key changed"):
        client.check_coordinator_key(mallory.address)
