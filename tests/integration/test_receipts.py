"""A coordinator that records an honest worker as unreported is proven wrong by the worker's receipt.

Real anvil, contracts, coordinator and worker processes (as tests/integration/test_trust.py). The
coordinator is a patched copy of the real one: its report book takes w0's signed reports (the
coordinator checks them and signs the report receipt, as an honest one does) and then drops them, so
every round is recorded with w0's update unreported and w0 credited nothing, the cheat the issue
measured from outside ("3 of 5"). The patch is loaded into the coordinator's process alone, through
a ``sitecustomize`` on its PYTHONPATH; the workers are the real ``dilocox worker``.

The other worker, w1, loses the reply of its first push of each round (a patched gRPC stub in its
process alone) and pushes again: the coordinator answers the repeat with the update receipt it
already signed, so w1 holds every receipt as if no reply had been lost.

Then w0, with nothing but its receipts folder, proves each omission on chain (``dilocox settle
prove-receipt``), a second time changes nothing, and the audit fails the coordinator by name for each
round (``receipt-fault``). The honest worker w1's receipts prove nothing: the rounds credit it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from attestation.receipt import NO_REPORT
from audit.cli import audit_run_dir
from cli.cluster import LocalCluster, provision
from cli.settle import EXIT_FAILED, EXIT_OK, settle_run_dir
from settlement import Anvil, DEV_ACCOUNTS, Chain, Deployment
from settlement.receipt_court import ReceiptCourt
from tests.conftest import small_config
from tests.integration.test_trust import ledger_of, pinned
from trainer.config import RoundConfig
from trainer.worker.receipts import ReceiptBook

pytestmark = pytest.mark.integration

ROUNDS = 2
REPORT_TIMEOUT_S = 2.0  # how long the coordinator waits for the report it dropped before recording
# The patched coordinator: a report of the named worker is taken (and receipted by the caller, the
# state machine) but never filed for the ledger.
LYING_REPORT_BOOK = '''
import os
from settlement import report_book

_add = report_book.ReportBook.add


def _drop(self, worker_id, signed):
    if worker_id != os.environ["DILOCOX_TEST_DROP_REPORTS_OF"]:
        _add(self, worker_id, signed)


report_book.ReportBook.add = _drop
'''

# The patched worker (w1's process only): the reply of its first push of each round and stage is lost
# after the coordinator took the push, so the worker pushes it again; the coordinator answers that
# repeat with the update receipt it signed (docs/trust.md "Receipts"), which the worker keeps.
LOSING_PUSH_REPLIES = '''
import grpc
from proto import pb_grpc

_init = pb_grpc.CoordinatorStub.__init__
_lost = set()


class _ReplyLost(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "test: the push reply was lost"


def _losing_init(self, channel):
    _init(self, channel)
    push = self.PushUpdate

    def losing(stream, **kwargs):
        messages = list(stream)
        reply = push(iter(messages), **kwargs)
        key = (messages[0].header.round, messages[0].header.stage)
        if key not in _lost:
            _lost.add(key)
            raise _ReplyLost()
        return reply

    self.PushUpdate = losing


pb_grpc.CoordinatorStub.__init__ = _losing_init
'''


def test_a_worker_proves_the_coordinator_left_it_unreported(cluster: LocalCluster, chain: Anvil, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(LYING_REPORT_BOOK)
    config = pinned(small_config(rounds=RoundConfig(rounds=ROUNDS, expected_workers=2, quorum=2,
                                                    straggler_timeout_s=30.0, heartbeat_interval_s=0.5,
                                                    liveness_timeout_s=3.0)))
    with monkeypatch.context() as patched:  # the coordinator's process only
        patched.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p))
        patched.setenv("DILOCOX_TEST_DROP_REPORTS_OF", "w0")
        config.save(tmp_path / "config.json")
        co_args, wo_args = provision(cluster.run_dir.path, chain.rpc_url, config)
        cluster.start_coordinator(tmp_path / "config.json", extra=[*co_args, "--report-timeout", str(REPORT_TIMEOUT_S)])
    losing = tmp_path / "losing"
    losing.mkdir()
    (losing / "sitecustomize.py").write_text(LOSING_PUSH_REPLIES)
    cluster.start_worker("w0", extra=wo_args)
    with monkeypatch.context() as patched:  # w1's process only
        patched.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(losing), os.environ.get("PYTHONPATH")) if p))
        cluster.start_worker("w1", extra=wo_args)
    for name in ("w0", "w1", "coordinator"):
        assert cluster.wait_exit(name, 180) == 0, cluster.log(name)

    ledger, run_id = ledger_of(cluster, chain)
    recorded = ledger.recorded_rounds(run_id)
    assert [r.round for r in recorded] == list(range(1, ROUNDS + 1))
    assert all(len(r.workers) == 1 and r.unreported_count == 1 for r in recorded), recorded  # the cheat

    # Each worker kept, for each round, the coordinator's update and report receipts, signed by the
    # run's coordinator on chain over what the worker sent: w1 too, whose every first push reply was
    # lost (its update receipts came with the replies to its repeated pushes).
    assert cluster.log("w1").count("the push reply was lost") == ROUNDS, cluster.log("w1")[-3000:]
    coordinator = ledger.run_of(run_id).coordinator
    held = {}
    for name in ("w0", "w1"):
        kept, problems = ReceiptBook(cluster.receipts_dir(name)).receipts(run_id)
        assert not problems and [(s.receipt.round, s.receipt.reported) for s in kept] == [
            (r, reported) for r in range(1, ROUNDS + 1) for reported in (False, True)], (name, kept)
        assert all(s.signer(ledger.domain()) == coordinator for s in kept)
        held[name] = kept
    w1 = held["w1"][1].receipt.worker
    assert all(r.workers == (w1,) for r in recorded)
    w0 = held["w0"][1].receipt.worker
    assert {s.receipt.update_digest for s in held["w0"]} == {u for r in recorded for u in r.unreported}
    assert all(s.receipt.report_digest == NO_REPORT for s in held["w0"][::2])

    # w1's receipts prove nothing: it is credited. w0's prove each round's omission, once.
    run_dir = cluster.run_dir.path
    assert settle_run_dir(run_dir, rpc_url=chain.rpc_url, receipts=cluster.receipts_dir("w1")) == EXIT_OK
    assert "the round credits" in capsys.readouterr().out
    assert settle_run_dir(run_dir, rpc_url=chain.rpc_url, receipts=cluster.receipts_dir("w0")) == EXIT_OK
    out = capsys.readouterr().out
    assert out.count("proven") == ROUNDS, out
    deployment = Deployment.load(run_dir / "chain" / "deployment.json")
    court = ReceiptCourt(Chain(chain.rpc_url, DEV_ACCOUNTS[2]), deployment.receipt_court)
    # The digest the coordinator signed in Python is the one the court computes on chain.
    assert court.receipt_digest(held["w0"][1].receipt) == held["w0"][1].receipt.digest(ledger.domain())
    faults = court.faults(run_id)
    assert [(f.round, f.worker, f.coordinator) for f in faults] == [(r, w0, coordinator) for r in range(1, ROUNDS + 1)]
    assert settle_run_dir(run_dir, rpc_url=chain.rpc_url, receipts=cluster.receipts_dir("w0")) == EXIT_OK
    assert "already proven" in capsys.readouterr().out and len(court.faults(run_id)) == ROUNDS

    # The audit reads the proven faults from the chain and fails the coordinator for each round.
    result_path = tmp_path / "audit.json"
    assert audit_run_dir(run_dir, rpc_url=chain.rpc_url, allow_dev=True, rederive=False,
                         json_path=result_path) == EXIT_FAILED
    failures = json.loads(result_path.read_text())["failures"]
    named = [f for f in failures if f["check"] == "receipt-fault"]
    assert [f["round"] for f in named] == list(range(1, ROUNDS + 1)), failures
    assert all(coordinator in f["message"] and w0 in f["message"] for f in named)
    assert {f["check"] for f in failures} == {"receipt-fault"}, failures  # nothing else is wrong with the run
