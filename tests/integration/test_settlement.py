"""The settlement client against real contracts on a real anvil (127.0.0.1 only; nothing mocked).

Covers: deployment and admission, rounds recorded with signed reports and read back (views, logs
and calldata), the EIP-712 digest computed in Python against the ledger's, decoded reverts, the
outbox's idempotent flush and its behaviour while the RPC node is down, and chain state that
survives an anvil restart.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from attestation import DevProvider, DevRoot, Policy, attest, code_measurement
from attestation.keys import WorkerKey
from attestation.report import RoundReport, SignedReport
from settlement import (
    DEV_ACCOUNTS,
    Anvil,
    AnvilError,
    Chain,
    ChainError,
    ChainUnavailable,
    Deployment,
    Ledger,
    Outbox,
    Registry,
    TxReverted,
    deploy,
)
from settlement.gate import TrustGate
from settlement.records import Contribution
from storage_client import CID, Codec, ObjectStore

pytestmark = pytest.mark.integration

MEASUREMENT = hashlib.sha256(b"code measurement").digest()


def h(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


@dataclass
class Setup:
    anvil: Anvil
    owner: Chain
    coordinator: Chain
    deployment: Deployment
    registry: Registry  # as the owner
    ledger: Ledger  # as the coordinator
    workers: list[WorkerKey]
    run_id: bytes
    genesis: bytes


def make_setup(anvil: Anvil, n_workers: int = 2, **chain_kwargs: object) -> Setup:
    owner = Chain(anvil.rpc_url, DEV_ACCOUNTS[0], **chain_kwargs)
    coordinator = Chain(anvil.rpc_url, DEV_ACCOUNTS[1], **chain_kwargs)
    deployment = deploy(owner)
    registry = Registry(owner, deployment.registry)
    registry.set_measurement(MEASUREMENT)
    registry.set_verifier(coordinator.address)
    as_verifier = Registry(coordinator, deployment.registry)
    workers = [WorkerKey.generate() for _ in range(n_workers)]
    for w in workers:
        as_verifier.admit_worker(w.address, MEASUREMENT, h("admission", w.address))
    ledger = Ledger(coordinator, deployment.ledger, from_block=deployment.deployed_block)
    run_id, genesis = h("genesis manifest", anvil.port), h("checkpoint", 0)
    return Setup(anvil, owner, coordinator, deployment, registry, ledger, workers, run_id, genesis)


def signed_reports(s: Setup, round_: int, parent: bytes, checkpoint: bytes,
                   workers: list[WorkerKey] | None = None) -> list[SignedReport]:
    domain = s.ledger.domain()
    out = []
    for i, key in enumerate(workers if workers is not None else s.workers):
        report = RoundReport(
            run_id=s.run_id, round=round_, worker=key.address, parent_checkpoint=parent, checkpoint=checkpoint,
            manifest_digest=h("manifest", round_), update_digest=h("update", round_, i), data_digest=h("shard", i),
            train_loss_e6=-5 if i else 3_400_000 - 1000 * round_, eval_loss_e6=3_390_000, tokens=1000 + round_,
            inner_steps=50, bytes_sent=4096 + i, bytes_received=8192 + 3 * i,
        )
        out.append(SignedReport(report, key.sign_digest(report.digest(domain))))
    # in the order the ledger takes them, and gives them back
    return sorted(out, key=lambda signed: int(signed.report.worker, 16))


def record(s: Setup, round_: int) -> list[SignedReport]:
    """Record round ``round_`` (its parent is round_-1's checkpoint) directly; returns its reports."""
    parent = s.genesis if round_ == 1 else h("checkpoint", round_ - 1)
    reports = signed_reports(s, round_, parent, h("checkpoint", round_))
    s.ledger.record_round(s.run_id, round_, parent, h("checkpoint", round_), h("manifest", round_), reports)
    return reports


@pytest.fixture
def anvil(tmp_path: Path) -> Iterator[Anvil]:
    with Anvil(state_file=tmp_path / "chain" / "state.json") as node:
        yield node


@pytest.fixture
def setup(anvil: Anvil) -> Setup:
    s = make_setup(anvil)
    s.ledger.create_run(s.run_id, s.genesis, h("config"), s.run_id)
    return s


def test_rounds_recorded_and_read_back(setup: Setup, tmp_path: Path) -> None:
    s = setup
    assert s.deployment.chain_id == 31337 and s.deployment.owner == s.owner.address
    s.deployment.save(tmp_path / "deployment.json")
    assert Deployment.load(tmp_path / "deployment.json") == s.deployment
    assert s.registry.owner() == s.owner.address and s.ledger.registry_address() == s.deployment.registry
    assert s.registry.is_verifier(s.coordinator.address) and s.registry.is_measurement_allowed(MEASUREMENT)
    assert all(s.registry.is_active(w.address) for w in s.workers)
    record_of = s.registry.worker_of(s.workers[0].address)
    assert record_of.measurement == MEASUREMENT and record_of.verifier == s.coordinator.address
    assert record_of.evidence_digest == h("admission", s.workers[0].address) and record_of.revoked_at == 0
    admissions = s.registry.admissions()
    assert [a.worker for a in admissions] == [w.address for w in s.workers]
    assert admissions[0].evidence_digest == record_of.evidence_digest
    assert admissions[0].block == record_of.admitted_at
    assert admissions[0].measurement == MEASUREMENT and admissions[0].verifier == s.coordinator.address
    assert [(c.measurement, c.allowed) for c in s.registry.measurement_changes()] == [(MEASUREMENT, True)]

    sent = {1: record(s, 1), 2: record(s, 2)}

    # The digest a worker signs in Python is the one the ledger computes.
    report = sent[2][1].report
    assert s.ledger.report_digest(report) == report.digest(s.ledger.domain())

    run = s.ledger.run_of(s.run_id)
    assert run is not None and run.coordinator == s.coordinator.address
    assert run.last_round == 2 and run.last_checkpoint == h("checkpoint", 2)
    assert run.genesis_checkpoint == s.genesis
    assert s.ledger.run_of(h("no such run")) is None
    assert s.ledger.round_of(s.run_id, 2).manifest_digest == h("manifest", 2)
    assert s.ledger.round_of(s.run_id, 2).report_count == 2
    assert s.ledger.round_of(s.run_id, 3) is None
    for w in s.workers:
        expected = sum(sent[r][0].report.tokens for r in (1, 2))  # every report of a round: the same tokens
        assert s.ledger.contribution_of(s.run_id, w.address) == Contribution(tokens=expected, rounds=2)
        assert s.ledger.total_contribution_of(w.address) == Contribution(tokens=expected, rounds=2)
        assert s.ledger.runs_of(w.address) == [s.run_id]
    (created,) = s.ledger.runs_created()
    assert (created.run_id, created.coordinator, created.genesis_checkpoint) == (s.run_id, s.coordinator.address,
                                                                                 s.genesis)

    recorded = s.ledger.recorded_rounds(s.run_id)
    assert [r.round for r in recorded] == [1, 2]
    for r in recorded:
        assert r.reports == tuple(sent[r.round])  # exactly what was sent, signatures included
        assert r.checkpoint == h("checkpoint", r.round) and r.manifest_digest == h("manifest", r.round)
        assert r.report_count == 2 and r.tx_hash.startswith("0x") and r.block > s.deployment.deployed_block
        assert all(sr.signer(s.ledger.domain()) == sr.report.worker for sr in r.reports)
        assert r.sender == s.coordinator.address
        # the one slot the ledger keeps of a round commits to what its event and calldata say
        assert s.ledger.round_commitment(s.run_id, r.round) == r.commitment == r.facts_commitment()
        assert r.workers == tuple(sr.report.worker for sr in r.reports)
    assert recorded[0].parent_checkpoint == s.genesis and recorded[1].parent_checkpoint == h("checkpoint", 1)
    assert s.ledger.round_commitment(s.run_id, 3) == bytes(32)

    s.registry.revoke_worker(s.workers[0].address)
    assert not s.registry.is_active(s.workers[0].address)
    assert [(e.worker, e.by) for e in s.registry.revocations()] == [(s.workers[0].address, s.owner.address)]


def test_reverts_are_decoded(setup: Setup) -> None:
    s = setup
    record(s, 1)
    record(s, 2)
    wrong_parent = h("not the parent")
    with pytest.raises(TxReverted) as exc:
        s.ledger.record_round(s.run_id, 3, wrong_parent, h("checkpoint", 3), h("manifest", 3),
                              signed_reports(s, 3, wrong_parent, h("checkpoint", 3)))
    assert str(exc.value) == f"LedgerWrongParent(expected=0x{h('checkpoint', 2).hex()}, got=0x{wrong_parent.hex()})"
    assert exc.value.error == "LedgerWrongParent" and exc.value.fields["got"] == wrong_parent

    stranger = WorkerKey.generate()
    with pytest.raises(TxReverted, match=f"WorkerNotActive\\(worker={stranger.address}\\)"):
        s.ledger.record_round(s.run_id, 3, h("checkpoint", 2), h("checkpoint", 3), h("manifest", 3),
                              signed_reports(s, 3, h("checkpoint", 2), h("checkpoint", 3), [stranger]))
    with pytest.raises(TxReverted, match=f"NotVerifier\\(caller={s.owner.address}\\)"):
        s.registry.admit_worker(stranger.address, MEASUREMENT, h("evidence"))
    with pytest.raises(TxReverted, match=f"OwnableUnauthorizedAccount\\(account={s.coordinator.address}\\)"):
        Registry(s.coordinator, s.deployment.registry).set_measurement(h("other"))
    with pytest.raises(TxReverted, match="RoundOutOfOrder\\(expected=3, got=5\\)"):
        s.ledger.record_round(s.run_id, 5, h("checkpoint", 2), h("checkpoint", 5), h("manifest", 5),
                              signed_reports(s, 5, h("checkpoint", 2), h("checkpoint", 5)))
    # A transaction mined with too little gas estimate skipped: the revert is replayed and decoded.
    with pytest.raises(TxReverted, match="LedgerWrongParent") as mined:
        s.ledger.chain.transact(s.ledger._contract.functions.recordRound(
            (s.run_id, 3, wrong_parent, h("checkpoint", 3), h("manifest", 3), 0, 0, 0), [], [h("u")]), gas=200_000)
    assert mined.value.tx_hash is not None
    assert s.ledger.run_of(s.run_id).last_round == 2  # nothing refused changed the run


def test_outbox_flush_is_idempotent(setup: Setup, tmp_path: Path) -> None:
    s = setup
    outbox = Outbox(tmp_path / "outbox")
    outbox.enqueue_create_run(s.run_id, s.genesis, h("config"), s.run_id)  # exists already: recognised
    parent, checkpoint = s.genesis, h("checkpoint", 1)
    reports = signed_reports(s, 1, parent, checkpoint)
    outbox.enqueue_round(s.run_id, 1, parent, checkpoint, h("manifest", 1), [r.to_json() for r in reports])
    assert [i["kind"] for i in outbox.pending()] == ["create_run", "round"]
    assert outbox.flush(s.ledger) == [1]
    assert outbox.pending() == []
    block = s.coordinator.w3.eth.block_number

    # As after a crash between the receipt and the file's removal: the same round queued again.
    outbox.enqueue_round(s.run_id, 1, parent, checkpoint, h("manifest", 1), reports)
    assert outbox.flush(s.ledger) == [1]
    assert outbox.pending() == [] and s.coordinator.w3.eth.block_number == block  # no second tx
    assert len(s.ledger.recorded_rounds(s.run_id)) == 1

    # A different round 1 is a conflict, not something to retry.
    outbox.enqueue_round(s.run_id, 1, parent, h("other checkpoint"), h("manifest", 1),
                         signed_reports(s, 1, parent, h("other checkpoint")))
    other = h("other checkpoint")
    with pytest.raises(ChainError, match=f"checkpoint 0x{checkpoint.hex()}.*checkpoint 0x{other.hex()}"):
        outbox.flush(s.ledger)
    assert len(outbox.pending()) == 1


def test_outbox_waits_out_a_dead_rpc(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = tmp_path / "chain" / "state.json"
    with Anvil(state_file=state) as node:
        s = make_setup(node)
        s.ledger.create_run(s.run_id, s.genesis, h("config"), s.run_id)
        port = node.port
    # The node is gone; a coordinator keeps finishing rounds.
    dead = Chain(f"http://127.0.0.1:{port}", DEV_ACCOUNTS[1], retries=2, backoff_s=0.01)
    with pytest.raises(ChainUnavailable) as exc:
        dead.call(Ledger(dead, s.deployment.ledger)._contract.functions.registry())
    assert str(exc.value) == f"chain RPC http://127.0.0.1:{port} is unreachable: connection refused"

    outbox = Outbox(tmp_path / "outbox")
    reports = signed_reports(s, 1, s.genesis, h("checkpoint", 1))
    path = outbox.enqueue_round(s.run_id, 1, s.genesis, h("checkpoint", 1), h("manifest", 1), reports)
    queued = path.read_bytes()
    with caplog.at_level(logging.INFO, logger="dilocox.settlement"):
        assert outbox.flush(Ledger(dead, s.deployment.ledger)) == []
        assert outbox.flush(Ledger(dead, s.deployment.ledger)) == []  # a settlement loop goes on trying
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "unreachable: connection refused" in errors[0].getMessage()
    assert path.read_bytes() == queued
    item = json.loads(queued)
    assert [SignedReport.from_json(r) for r in item["reports"]] == reports

    with Anvil(state_file=state, port=port) as revived:
        live = Ledger(Chain(revived.rpc_url, DEV_ACCOUNTS[1]), s.deployment.ledger)
        assert outbox.flush(live) == [1]
        assert outbox.pending() == []
        assert live.run_of(s.run_id).last_round == 1
        assert live.recorded_rounds(s.run_id)[0].reports == tuple(reports)


def test_chain_state_survives_restart(tmp_path: Path) -> None:
    state = tmp_path / "chain" / "state.json"
    with Anvil(state_file=state) as node:
        s = make_setup(node)
        s.ledger.create_run(s.run_id, s.genesis, h("config"), s.run_id)
        sent = record(s, 1)
        before = (s.ledger.run_of(s.run_id), s.ledger.round_of(s.run_id, 1), s.registry.admissions())
    assert state.is_file()
    with Anvil(state_file=state) as node:  # another port: only the state file carries over
        ledger = Ledger(Chain(node.rpc_url, DEV_ACCOUNTS[2]), s.deployment.ledger)
        registry = Registry(ledger.chain, s.deployment.registry)
        assert (ledger.run_of(s.run_id), ledger.round_of(s.run_id, 1), registry.admissions()) == before
        recorded = ledger.recorded_rounds(s.run_id)
        assert len(recorded) == 1 and recorded[0].reports == tuple(sent)
        assert ledger.round_commitment(s.run_id, 1) == recorded[0].facts_commitment()
        # And the chain goes on from there.
        s.ledger = Ledger(Chain(node.rpc_url, DEV_ACCOUNTS[1]), s.deployment.ledger)
        record(s, 2)
        assert ledger.run_of(s.run_id).last_round == 2


def test_unknown_run_and_not_coordinator(setup: Setup) -> None:
    s = setup
    stray = replace(s, ledger=Ledger(s.owner, s.deployment.ledger))
    with pytest.raises(TxReverted, match=f"NotCoordinator\\(caller={s.owner.address}\\)"):
        record(stray, 1)
    with pytest.raises(TxReverted, match="LedgerUnknownRun"):
        s.ledger.record_round(h("nope"), 1, s.genesis, h("c"), h("m"), [], [h("u")])
    with pytest.raises(ValueError, match="differs from round 1's other reports or the recording call in run_id"):
        s.ledger.record_round(h("nope"), 1, s.genesis, h("c"), h("m"), signed_reports(s, 1, s.genesis, h("c")))
    with pytest.raises(TxReverted, match=f"RunExists\\(runId=0x{s.run_id.hex()}\\)"):
        s.ledger.create_run(s.run_id, s.genesis, h("config"), s.run_id)


def test_anvil_refuses_a_taken_port(anvil: Anvil) -> None:
    # Otherwise the node already there would answer the readiness probe and pass for the new one.
    with pytest.raises(AnvilError, match="already in use"):
        Anvil(port=anvil.port).start()
    assert anvil.running


def test_a_chain_restored_to_before_the_admissions_gets_them_again_then_every_round(anvil: Anvil,
                                                                                   tmp_path: Path) -> None:
    """Issue 28: the chain comes back from a state before the run and its workers' admissions
    (``evm_revert``). The gate kept each admission it verified in the outbox, so the run, the
    admissions and every round are sent again, in order, on the evidence that admitted them."""
    owner, coordinator = Chain(anvil.rpc_url, DEV_ACCOUNTS[0]), Chain(anvil.rpc_url, DEV_ACCOUNTS[1])
    deployment = deploy(owner)
    code = code_measurement(str(CID.of(b"a run config", Codec.JSON)))
    Registry(owner, deployment.registry).set_measurement(code)  # the owner's writes: before the snapshot
    Registry(owner, deployment.registry).set_verifier(coordinator.address)
    snapshot = owner.w3.provider.make_request("evm_snapshot", [])["result"]
    run_id, genesis = h("restored run"), h("checkpoint", 0)
    outbox = Outbox(tmp_path / "outbox")
    registry = Registry(coordinator, deployment.registry)
    ledger = Ledger(coordinator, deployment.ledger, from_block=deployment.deployed_block)
    root = DevRoot.load_or_create(tmp_path / "dev-root")
    gate = TrustGate(store=ObjectStore(tmp_path / "store"), registry=registry,
                     policy=Policy.development(root.address), run_id=run_id, domain=ledger.domain(), code=code,
                     outbox=outbox)
    outbox.enqueue_create_run(run_id, genesis, h("config"), run_id)
    assert outbox.flush(ledger) == []
    workers = [WorkerKey.generate() for _ in range(2)]
    for i, key in enumerate(workers):
        nonce = gate.challenge(f"w{i}")
        evidence = attest(DevProvider(root), key, run_id, nonce, code)
        assert gate.admit(f"w{i}", key.address, evidence.to_bytes(), nonce) == key.address
    evidence_digests = {key.address: registry.worker_of(key.address).evidence_digest for key in workers}
    s = Setup(anvil, owner, coordinator, deployment, registry, ledger, workers, run_id, genesis)
    parent = genesis
    for round_ in (1, 2, 3):
        checkpoint = h("checkpoint", round_)
        outbox.enqueue_round(run_id, round_, parent, checkpoint, h("manifest", round_),
                             signed_reports(s, round_, parent, checkpoint))
        parent = checkpoint
    assert outbox.flush(ledger) == [1, 2, 3]

    assert owner.w3.provider.make_request("evm_revert", [snapshot])["result"] is True
    assert ledger.run_of(run_id) is None and all(registry.worker_of(k.address).admitted_at == 0 for k in workers)
    assert outbox.flush(ledger) == [1, 2, 3]
    assert [r.round for r in ledger.recorded_rounds(run_id)] == [1, 2, 3]
    assert {a.worker: a.evidence_digest for a in registry.admissions()} == evidence_digests  # the same evidence
    assert outbox.pending() == [] and outbox.flush(ledger) == []  # each sent once
    assert [i["kind"] for i in outbox.confirmed()] == ["create_run", "admit", "admit", "round", "round", "round"]
