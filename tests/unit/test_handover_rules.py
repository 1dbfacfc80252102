"""The pure rules of a run that outlives its coordinator: who held each round (settlement.records.Tenures,
from the ledger's handover events), and when a worker trusts a coordinator it moved to
(trainer.worker.succession). The contract's own rules are tested by forge (ContributionLedgerHandover.t.sol);
a whole handover with real processes by tests/integration/test_handover.py."""

from __future__ import annotations

import pytest

from attestation import Domain
from settlement.records import Handover, Tenures
from trainer.net.tls import ClientTls
from trainer.worker.succession import Endpoint, Succession, SuccessionError, Successors

A, B, C = ("0x" + c * 40 for c in "ABC")
RUN, OTHER_RUN = b"\x01" * 32, b"\x02" * 32
LEDGER = Domain(31337, "0x" + "1" * 40)


def handover(previous: str, next_: str, from_round: int) -> Handover:
    return Handover(run_id=RUN, previous=previous, next=next_, from_round=from_round, by_vote=False, block=1,
                    tx_hash="0x00", log_index=0)


def test_each_round_is_held_by_the_coordinator_of_its_tenure() -> None:
    tenures = Tenures.of(C, [handover(A, B, 5), handover(B, C, 7)])
    assert tenures.tenures == ((1, A), (5, B), (7, C))
    assert [tenures.at(r) for r in range(0, 9)] == [A, A, A, A, A, B, B, C, C]
    assert tenures.coordinators == {A, B, C}
    assert Tenures.of(A, []).tenures == ((1, A),) == Tenures.coerce(A).tenures
    assert Tenures.coerce(tenures) is tenures


def test_a_handover_before_the_successor_recorded_anything_replaces_its_tenure() -> None:
    tenures = Tenures.of(C, [handover(A, B, 5), handover(B, C, 5)])
    assert tenures.tenures == ((1, A), (5, C))
    assert Tenures.of(A, [handover(A, B, 1), handover(B, A, 1)]).tenures == ((1, A),)


@pytest.mark.parametrize("coordinator_now, handovers, says", [
    (C, [handover(A, B, 5), handover(A, C, 7)], "names 0xA+ as the coordinator before it, but 0xB+ held"),
    (C, [handover(A, B, 5), handover(B, C, 3)], "from round 3"),
    (A, [handover(A, B, 5)], "end with 0xB+, but its coordinator now is 0xA+"),
])
def test_handovers_that_do_not_chain_are_refused(coordinator_now: str, handovers: list[Handover], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        Tenures.of(coordinator_now, handovers)


def succession(check=None) -> Succession:
    tls = ClientTls(insecure=True)
    return Succession(Endpoint("127.0.0.1:1", tls), Successors((Endpoint("127.0.0.1:2", tls),), check))


def test_the_first_coordinators_key_is_pinned_and_kept() -> None:
    moves = succession()
    assert moves.accept(None, A, b"", RUN, None, LEDGER) == A  # the first Join pins
    assert moves.accept(A, A, RUN, RUN, LEDGER, LEDGER) == A  # the same key again


def test_a_new_key_is_trusted_only_when_the_chain_names_it_the_runs_coordinator() -> None:
    asked: list[tuple[Domain, bytes, str]] = []

    def chain_says(who: str | None):
        def check(domain: Domain, run: bytes, key: str) -> str | None:
            asked.append((domain, run, key))
            return who
        return check

    assert succession(chain_says(B)).accept(A, B, RUN, RUN, LEDGER, LEDGER) == B
    assert asked == [(LEDGER, RUN, B)]  # the pinned ledger is asked, not the one the coordinator names
    with pytest.raises(SuccessionError, match="signs with 0xC+, but the ledger names 0xB+ as the run's coordinator"):
        succession(chain_says(B)).accept(A, C, RUN, RUN, LEDGER, LEDGER)
    with pytest.raises(SuccessionError, match="names no such run"):
        succession(chain_says(None)).accept(A, B, RUN, RUN, LEDGER, LEDGER)


def test_a_successor_of_another_run_or_ledger_or_without_a_chain_is_refused() -> None:
    def anything(domain: Domain, run: bytes, key: str) -> str:
        return key  # a chain that would say yes: the refusals come before it is asked

    with pytest.raises(SuccessionError, match="serves run 0x0202.*not this worker's run 0x0101"):
        succession(anything).accept(A, A, RUN, OTHER_RUN, LEDGER, LEDGER)
    with pytest.raises(SuccessionError, match="names the ledger .*not the run's"):
        succession(anything).accept(A, B, RUN, RUN, LEDGER, Domain(31337, "0x" + "2" * 40))
    with pytest.raises(SuccessionError, match="signing key changed from 0xA+ to 0xB+.*no ledger"):
        succession(anything).accept(A, B, RUN, RUN, None, None)
    with pytest.raises(SuccessionError, match="give the worker --chain-rpc"):
        succession(None).accept(A, B, RUN, RUN, LEDGER, LEDGER)

    def unreachable(domain: Domain, run: bytes, key: str) -> str:
        raise ConnectionError("chain RPC http://127.0.0.1:9 is unreachable")

    with pytest.raises(SuccessionError, match="cannot be asked whether it is the run's: chain RPC"):
        succession(unreachable).accept(A, B, RUN, RUN, LEDGER, LEDGER)


def test_the_succession_moves_forward_once_per_lost_coordinator() -> None:
    moves = succession()
    assert moves.advance(0).address == "127.0.0.1:2"
    assert moves.advance(0).address == "127.0.0.1:2"  # a second thread that lost the same one: no skip
    assert moves.advance(1) is None  # the last one: nowhere to go


def test_a_rejoin_with_the_pinned_key_is_refused_once_the_run_was_handed_over() -> None:
    def chain_says(who: str | None):
        def check(domain: Domain, run: bytes, key: str) -> str | None:
            return who
        return check

    assert succession(chain_says(A)).accept(A, A, RUN, RUN, LEDGER, LEDGER) == A
    assert succession(chain_says(None)).accept(A, A, RUN, RUN, LEDGER, LEDGER) == A  # not created on chain yet
    with pytest.raises(SuccessionError, match="signs with 0xA+, but the ledger names 0xB+ .* handed over"):
        succession(chain_says(B)).accept(A, A, RUN, RUN, LEDGER, LEDGER)

    def unreachable(domain: Domain, run: bytes, key: str) -> str:
        raise ConnectionError("down")

    assert succession(unreachable).accept(A, A, RUN, RUN, LEDGER, LEDGER) == A  # the pinned key stays trusted


@pytest.mark.parametrize("argv, says", [
    (["coordinator", "--run-dir", "{tmp}/b", "--take-over", "0x" + "ab" * 32],
     "--take-over needs --ledger, --chain-rpc and --chain-key-file"),
    (["coordinator", "--run-dir", "{tmp}/b", "--take-over", "0x12", "--ledger", "d.json", "--chain-rpc", "http://h:1",
      "--chain-key-file", "k"], "--take-over must be 0x followed by 64 hex digits, got '0x12'"),
    (["worker", "--coordinator", "127.0.0.1:5", "--worker-id", "w", "--tls-fingerprint", "ab" * 32,
      "--successor", "127.0.0.1:6"], "--successor needs its own --successor-fingerprint"),
    (["worker", "--coordinator", "127.0.0.1:5", "--worker-id", "w", "--tls-fingerprint", "ab" * 32,
      "--successor", "127.0.0.1:6", "--successor-fingerprint", "cd" * 32, "--successor-fingerprint", "ef" * 32],
     "2 --successor-fingerprint for 1 --successor"),
    (["worker", "--coordinator", "127.0.0.1:5", "--worker-id", "w", "--insecure", "--successor", "nowhere"],
     "--successor 'nowhere' is not host:port"),
])
def test_handover_flags_are_refused_before_anything_starts(argv: list[str], says: str, tmp_path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "b").exists()  # no run directory made for a refused coordinator


def test_a_coordinator_whose_run_was_handed_over_stops_recording_with_one_line(tmp_path) -> None:
    """settlement.Outbox: the first coordinator, back after the handover, does not send recordRound
    calls the ledger would refuse forever; it stops (a RecordConflict ends the settlement loop)."""
    from dataclasses import replace

    from settlement import Outbox, RecordConflict
    from tests.unit.test_settlement_outbox import RUN, FakeLedger, h, queue_run, reports

    outbox, ledger = Outbox(tmp_path), FakeLedger()
    queue_run(outbox, 2)
    outbox.flush(ledger)
    ledger.runs[RUN] = replace(ledger.runs[RUN], coordinator=B)  # the creator handed the run to B
    outbox.enqueue_round(RUN, 3, h("ckpt", 2), h("ckpt", 3), h("manifest", 3), reports(3))
    with pytest.raises(RecordConflict, match="coordinated by 0xB+ on the ledger now, not this account .* handed over"):
        outbox.flush(ledger)
    assert len(outbox.pending()) == 1 and "round 3" not in ledger.sent  # kept, not sent
