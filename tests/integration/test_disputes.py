"""Verdicts with teeth (docs/trust.md "Disputes"), on a real anvil and real processes (nothing mocked).

``test_a_verdict_voids_a_credit_and_its_pay`` drives the Python clients alone: an auditor key made
under the dev attestation provider, bound to the audit code's measurement, admitted by the disputes
contract's owner; its EIP-712 verdict (digest equal to the contract's) voids a worker's credit inside
the window; the pool then refuses that credit while the honest worker is paid in full, and returns
what the round leaves unpaid to the funder; a verdict from an unadmitted key, after the window, or
twice is refused by name. ~3 s of CPU (one anvil, no training).

``test_scaled_cheats_are_named_disputed_and_not_paid`` is the whole loop on real processes, for a
one-process cheat and a cheat of two pipeline stages in the same run.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from attestation import DevProvider, DevRoot, Domain, Policy, RoundReport, SignedReport, WorkerKey, attest, \
    code_measurement, open_provider
from attestation.measurement import audit_code_measurement
from attestation.signing import update_digest
from attestation.verdict import Verdict
from audit.auditor import Auditor, admit
from audit.cli import audit_run_dir
from audit.disputes import DisputeOptions
from audit.verdict_file import read_verdicts, write_verdicts
from benchmarks.hostile import Heartbeats, Mallory, Trainer
from cli.cluster import LocalCluster, provision
from cli.settle import settle_run_dir
from proto import PROTOCOL_VERSION, pb, session_metadata
from settlement import DEV_ACCOUNTS, Anvil, Chain, Deployment, Ledger, TxReverted
from settlement.disputes import Disputes
from settlement.records import RoundRecord
from settlement.provision import fund_pool, mine
from settlement.rewards import RewardPool, RewardToken
from storage_client import CID, Codec, canonical_json, lineage, open_store
from tests.conftest import small_config
from trainer.codec.wire import encode_params, sha256_hex
from trainer.config import ModelConfig, RoundConfig, RunConfig
from trainer.data.corpus import load_corpus, shard_digest
from trainer.model.stages import stage_param_names

from .test_settlement import Setup, anvil, h, make_setup, record  # noqa: F401  (anvil: the fixture)

pytestmark = pytest.mark.integration

WINDOW = 30
FUNDED = 1_000_003
ROUNDS = 2


@pytest.fixture
def disputed(anvil, tmp_path: Path) -> tuple[Setup, Disputes, Auditor]:
    s = make_setup(anvil)
    s.ledger.create_run(s.run_id, s.genesis, h("config"), s.run_id, challenge_window=WINDOW)
    fund_pool(s.coordinator, s.deployment, s.run_id, FUNDED, ROUNDS, minter=s.owner)
    root = DevRoot.load_or_create(tmp_path / "dev-root")
    config_cid = str(CID(Codec.JSON, h("config")))
    auditor = Auditor.attest(open_provider("dev", dev_root_dir=tmp_path / "dev-root"), s.run_id, config_cid)
    owner = Disputes(s.owner, s.ledger.disputes_address(), from_block=s.deployment.deployed_block)
    record_cid = admit(owner, open_store(tmp_path / "run"), auditor, config_cid,
                       Policy.development(root.address))
    assert owner.admissions(s.run_id)[0].evidence_digest == record_cid.digest
    assert owner.admissions(s.run_id)[0].measurement == audit_code_measurement(config_cid)
    return s, owner, auditor


def test_a_verdict_voids_a_credit_and_its_pay(disputed: tuple[Setup, Disputes, Auditor]) -> None:
    s, disputes, auditor = disputed
    record(s, 1)
    record(s, 2)
    rounds = s.ledger.recorded_rounds(s.run_id)
    cheat, honest = rounds[0].workers[1], rounds[0].workers[0]
    verdict = Verdict(s.run_id, 1, cheat, "replay", h("update", 1, 1))
    assert disputes.verdict_digest(verdict) == verdict.digest(disputes.domain())
    assert disputes.panel_of(s.run_id) == (1, 1)

    with pytest.raises(TxReverted) as refused:  # an unadmitted key: a worker's, or any other
        disputes.dispute(verdict, rounds[0], [WorkerKey.generate().sign_digest(verdict.digest(disputes.domain()))])
    assert refused.value.error == "DisputesNotAuditor"
    disputes.dispute(verdict, rounds[0], [auditor.sign(verdict, disputes)])
    assert disputes.is_voided(s.run_id, 1, cheat) and not disputes.is_voided(s.run_id, 1, honest)
    with pytest.raises(TxReverted) as refused:
        disputes.dispute(verdict, rounds[0], [auditor.sign(verdict, disputes)])
    assert refused.value.error == "DisputesAlreadyVoided"
    assert s.ledger.contribution_of(s.run_id, cheat).rounds == 1  # round 2 only
    assert [(v.worker, v.round) for v in s.ledger.voided_credits(s.run_id)] == [(cheat, 1)]
    upheld = disputes.verdicts(s.run_id)
    assert [(v.round, v.party, v.signers) for v in upheld] == [(1, cheat, (auditor.address,))]

    mine(s.owner, WINDOW)
    late = Verdict(s.run_id, 2, cheat, "replay", h("update", 2, 1))
    with pytest.raises(TxReverted) as refused:
        disputes.dispute(late, rounds[1], [auditor.sign(late, disputes)])
    assert refused.value.error == "DisputesWindowClosed"

    pool = RewardPool(s.owner, s.deployment.rewards, s.ledger, from_block=s.deployment.deployed_block)
    share = FUNDED // ROUNDS // 2
    statement = pool.statement(s.run_id)
    assert statement.workers[cheat].voided == [1] and statement.workers[cheat].claimable == share
    assert pool.claim(s.run_id, cheat)[0] == share  # round 2 only: round 1 is not claimed
    assert pool.claim(s.run_id, honest)[0] == 2 * share  # paid in full
    funder = RewardPool(s.coordinator, s.deployment.rewards, s.ledger, from_block=s.deployment.deployed_block)
    back, _ = funder.reclaim(s.run_id)
    assert back == FUNDED - 3 * share  # the voided share and every rounding remainder
    statement = pool.statement(s.run_id)
    assert statement.paid + statement.reclaimed == FUNDED == statement.paid + statement.pool_reclaimed
    token = RewardToken(s.owner, s.deployment.token)
    assert token.balance_of(s.deployment.rewards) == 0


# --- end to end, on real processes: coordinator, an honest worker, two attested cheats, anvil, an auditor ---

E2E_WINDOW = 100  # blocks: wide enough for the pool's funding and the auditor's admission inside it


def _attested_cheat(cluster: LocalCluster, run_dir: Path, name: str) -> tuple[Mallory, WorkerKey, bytes]:
    """A client joined as ``name`` with a dev-attested key, as a worker joins (tests/integration/test_trust.py)."""

    stub = cluster.stub()
    challenge = stub.Challenge(pb.ChallengeRequest(protocol_version=PROTOCOL_VERSION, worker_id=name), timeout=10)
    key = WorkerKey.generate()
    provider = DevProvider(DevRoot.load_or_create(run_dir / "dev-root"))
    evidence = attest(provider, key, challenge.run_digest, challenge.nonce, code_measurement(challenge.config_cid))
    joined = stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, worker_id=name, address=key.address,
                                      evidence=evidence.to_bytes(), nonce=challenge.nonce), timeout=30)
    m = Mallory(stub, name, RunConfig.from_json(json.loads(challenge.config_json)),
                session_metadata(name, joined.session_token))
    return m, key, challenge.run_digest


def _report(m: Mallory, key: WorkerKey, run_id: bytes, trainer: Trainer, cluster: LocalCluster,
            deployment: Deployment) -> None:
    """m's signed report of round 1, restating the manifest as the coordinator requires."""

    chain_of = lineage(cluster.run_dir.store, cluster.run_dir.head())
    (genesis_cid, genesis), (manifest_cid, manifest) = chain_of[0], chain_of[1]
    entry = next(p for p in manifest.participants if p.worker == m.worker_id)
    report = RoundReport(
        run_id=run_id, round=1, worker=key.address, parent_checkpoint=CID.parse(genesis.params).digest,
        checkpoint=CID.parse(manifest.params).digest, manifest_digest=manifest_cid.digest,
        update_digest=CID.parse(entry.update).digest, data_digest=shard_digest(trainer.shard),
        train_loss_e6=entry.train_loss_e6, eval_loss_e6=manifest.eval_loss_e6, tokens=entry.tokens,
        inner_steps=entry.inner_steps, bytes_sent=entry.bytes_sent, bytes_received=entry.bytes_received)
    signed = SignedReport(report, key.sign_digest(report.digest(Domain(deployment.chain_id, deployment.ledger))))
    m.stub.SubmitReport(pb.SubmitReportRequest(worker_id=m.worker_id, signed_report=canonical_json(signed.to_json())),
                        metadata=m.session, timeout=30)


def _push_scaled(m: Mallory, key: WorkerKey, run_id: bytes, trainer: Trainer, stages: int) -> None:
    """Round 1 of a cheat that pushes 1.5 × the update it trained, as ``stages`` signed dense stage slices
    (trainer.model.stages' split; one whole-model push for 1), each signed as a worker signs it."""
    base, params = trainer.fetch(0)
    delta = {k: 1.5 * v for k, v in trainer.train(params, 1).items()}
    for stage, names in enumerate(stage_param_names(m.config.model, stages)):
        piece = {n: delta[n] for n in names}
        signature = key.sign_digest(update_digest(run_id, 1, stage, stages, sha256_hex(encode_params(piece))))
        m.push(piece, round=1, stage=stage, num_stages=stages, base_params_cid=base, train_loss=trainer.loss,
               inner_state_sha256=trainer.state, base_bytes_received=trainer.received[base], signature=signature)


def start_provisioned(cluster: LocalCluster, chain: Anvil, config: RunConfig, tmp_path: Path, window: int) -> list[str]:
    """``config`` with its corpus pinned, provisioned on ``chain`` (contracts, the run allowed) and its
    coordinator started with a challenge window of ``window`` blocks; the arguments its workers need."""
    corpus = load_corpus(config.data, config.seed, config.model.block_size)
    config = config.replace(data=dataclasses.replace(config.data, corpus_sha256=corpus.sha256))
    path = tmp_path / "config.json"
    config.save(path)
    co_args, wo_args = provision(cluster.run_dir.path, chain.rpc_url, config)
    cluster.start_coordinator(path, extra=[*co_args, "--report-timeout", "30", "--challenge-window", str(window)])
    return wo_args


def test_scaled_cheats_are_named_disputed_and_not_paid(cluster: LocalCluster, chain: Anvil, tmp_path: Path) -> None:
    """Two workers push 1.5 × their update, "m" as one process and "m2" as a worker of two pipeline
    stages (two signed stage slices, its stages' arithmetic: trainer.runtime.staged); the coordinator
    accepts both and credits them on chain; the replay names both; ``audit --dispute`` (a dev-attested
    auditor) voids both credits inside the window; their claims are refused while the honest worker is
    paid in full; the verdict again, from an unadmitted key, or after the window is refused by name;
    the audit of the disputed run shows the disputes and its payout and tally checks pass. Costs ~13 s
    of CPU with its processes (one round of three tiny workers, two audits, a settle)."""
    config = small_config(model=ModelConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),  # 2 layers: 2 stages
                          rounds=RoundConfig(rounds=1, expected_workers=3, quorum=3, straggler_timeout_s=60.0,
                                             heartbeat_interval_s=0.5, liveness_timeout_s=10.0,
                                             max_update_norm=1000.0))
    run_dir = cluster.run_dir.path
    wo_args = start_provisioned(cluster, chain, config, tmp_path, E2E_WINDOW)
    cheats = {name: _attested_cheat(cluster, run_dir, name) for name in ("m", "m2")}
    cluster.start_worker("w0", extra=wo_args)
    trainers = {name: Trainer(m, cluster, stages=2 if name == "m2" else 1) for name, (m, _, _) in cheats.items()}
    deployment = Deployment.load(run_dir / "chain" / "deployment.json")
    (_, _, run_id), keys = cheats["m"], {name: key.address for name, (_, key, _) in cheats.items()}
    with Heartbeats(cheats["m"][0], 0.5), Heartbeats(cheats["m2"][0], 0.5):
        for name, (m, key, _) in cheats.items():
            _push_scaled(m, key, run_id, trainers[name], 2 if name == "m2" else 1)
        cluster.wait_for(lambda s: len(s.rounds) > 1, 120, "round 1 to close")
    for name, (m, key, _) in cheats.items():
        _report(m, key, run_id, trainers[name], cluster, deployment)
    assert cluster.wait_exit("w0", 120) == 0, cluster.log("w0")
    assert cluster.wait_exit("coordinator", 120) == 0, cluster.log("coordinator", tail=60)

    owner, coordinator = Chain(chain.rpc_url, DEV_ACCOUNTS[0]), Chain(chain.rpc_url, DEV_ACCOUNTS[1])
    ledger = Ledger(owner, deployment.ledger, from_block=deployment.deployed_block)
    (round1,) = ledger.recorded_rounds(run_id)
    assert set(keys.values()) < set(round1.workers) and len(round1.workers) == 3  # accepted and credited
    (honest,) = set(round1.workers) - set(keys.values())
    fund_pool(coordinator, deployment, run_id, FUNDED, 1, minter=owner)

    options = DisputeOptions(bytes.fromhex(DEV_ACCOUNTS[0].removeprefix("0x")), "dev", str(run_dir / "dev-root"))
    first = tmp_path / "disputed.json"
    assert audit_run_dir(run_dir, rpc_url=chain.rpc_url, allow_dev=True, replay=(3, 1), dispute=options,
                         json_path=first) == 1  # the replay's MISMATCHes stay failures
    result = json.loads(first.read_text())
    statuses = {(row["round"], row["worker"]): row["status"] for row in result["replay"]["contributions"]}
    assert statuses == {(1, "m"): "MISMATCH", (1, "m2"): "MISMATCH", (1, "w0"): "ok"}, result["replay"]
    assert sorted((d["round"], d["party"], d["party_id"], d["check"], d["outcome"]) for d in result["disputes"]) == \
        sorted((1, keys[name], name, "replay", "upheld") for name in ("m", "m2"))
    _refusals_after(run_dir, run_id, owner, ledger, deployment, round1, keys["m"], honest)

    pool = RewardPool(owner, deployment.rewards, ledger, from_block=deployment.deployed_block)
    for cheat in keys.values():
        assert pool.claim(run_id, cheat) == (0, None)  # the voided round is not claimed
        with pytest.raises(TxReverted) as voided:
            owner.transact(pool._contract.functions.claim(run_id, cheat, [(1, round1.workers.index(cheat),
                                                                           round1.facts())]))
        assert voided.value.error == "RewardPoolVoided"
    assert pool.claim(run_id, honest)[0] == FUNDED // 3  # paid in full
    # `dilocox settle --reclaim`: only the funder (the run's coordinator) gets back what the voided
    # credits and rounding left, once.
    said = Console(file=io.StringIO(), width=200)
    assert settle_run_dir(run_dir, rpc_url=chain.rpc_url, reclaim=True, key=DEV_ACCOUNTS[0], console=said) == 2
    assert f"only the pool's funder {coordinator.address} can" in said.file.getvalue()
    for says in (f"for the funder {coordinator.address}", "nothing to reclaim"):  # the amount: the audit below
        said = Console(file=io.StringIO(), width=200)
        assert settle_run_dir(run_dir, rpc_url=chain.rpc_url, reclaim=True, key=DEV_ACCOUNTS[1], console=said) == 0
        assert says in said.file.getvalue()

    again = tmp_path / "after.json"
    audit_run_dir(run_dir, rpc_url=chain.rpc_url, allow_dev=True, json_path=again)
    result = json.loads(again.read_text())
    assert {f["check"] for f in result["failures"]} <= {"replay"}, result["failures"]  # books and payouts agree
    assert sorted((d["party_id"], d["outcome"]) for d in result["disputes"]) == [("m", "upheld"), ("m2", "upheld")]
    assert result["rewards"]["reclaimed"] == FUNDED - FUNDED // 3
    shown = Console(file=io.StringIO(), width=200)
    assert settle_run_dir(run_dir, rpc_url=chain.rpc_url, console=shown) == 0
    assert "round 1 is not payable: an upheld verdict against its contribution (check replay)" in \
        shown.file.getvalue()


def _refusals_after(run_dir: Path, run_id: bytes, owner: Chain, ledger: Ledger, deployment: Deployment,
                    round1: RoundRecord, cheat: str, honest: str) -> None:
    """The verdict against ``cheat`` again (from an unadmitted key, or a second admitted auditor) and,
    once the window has passed, one against ``honest`` are refused by name."""
    disputes = Disputes(owner, ledger.disputes_address(), from_block=deployment.deployed_block)
    verdict = Verdict(run_id, 1, cheat, "replay", round1.reports[0].report.update_digest)
    for signer, refusal in ((WorkerKey.generate(), "DisputesNotAuditor"), (None, "DisputesAlreadyVoided")):
        sig = (signer.sign_digest(verdict.digest(disputes.domain())) if signer else
               _auditor_signature(disputes, run_dir, run_id, owner, verdict))
        with pytest.raises(TxReverted) as refused:
            disputes.dispute(verdict, round1, [sig])
        assert refused.value.error == refusal

    mine(owner, E2E_WINDOW)
    against_honest = Verdict(run_id, 1, honest, "replay", round1.reports[0].report.update_digest)
    with pytest.raises(TxReverted) as late:
        disputes.dispute(against_honest, round1, [_auditor_signature(disputes, run_dir, run_id, owner,
                                                                     against_honest)])
    assert late.value.error == "DisputesWindowClosed"


def _auditor_signature(disputes: Disputes, run_dir: Path, run_id: bytes, owner: Chain, verdict: Verdict) -> bytes:
    """The signature of a second dev-attested auditor admitted to the run (so it counts)."""
    config_cid = str(CID(Codec.JSON, Ledger(owner, disputes.ledger_address()).run_of(run_id).config_digest))
    auditor = Auditor.attest(open_provider("dev", dev_root_dir=run_dir / "dev-root"), run_id, config_cid)
    admit(disputes, open_store(run_dir), auditor, config_cid,
          Policy.development(DevRoot.load_or_create(run_dir / "dev-root").address))
    return auditor.sign(verdict, disputes)


def test_a_ledger_that_voids_an_honest_credit_is_named(anvil: Anvil, tmp_path: Path) -> None:
    """The audit takes no contract's word for a void: a ledger (LyingLedger's code at its address) that
    takes an honest worker's credit off its tally without an upheld verdict fails ``tally`` by name,
    though its tallies and events agree. ~3 s of CPU (one tiny round)."""
    from .test_audit import RunBuilder

    builder = RunBuilder(tmp_path, anvil.rpc_url)
    builder.round()
    honest = builder.reports[1][0].report
    liar = builder.lie()
    builder.coordinator.transact(liar.functions.voidCredit(builder.run_id, 1, honest.worker, honest.tokens))
    failures = [f for f in builder.audit().failures if f.check == "tally"]
    assert [(f.round, f.object) for f in failures] == [(1, honest.worker)], failures
    assert "the ledger voided its credit, but" in failures[0].message


# --- k of n: persistent auditors, each signing into a file; k signatures sent at once; their evidence audited ---


def test_two_of_three_auditors_through_the_cli(anvil: Anvil, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Three persistent auditors (``audit --dispute --auditor-dir --sign-only --verdicts-out``) each sign
    the verdict against a coordinator whose round 1 does not re-derive; the owner admits them once
    (``settle admit-auditor``, k = 2); one file alone is not sent, a duplicate and an unadmitted signer
    are dropped by name, two send one dispute that voids the round with both signers; a second audit
    reuses the same key; the audit shows the dispute and its signers, and fails ``auditor-evidence``
    by name once a signer's stored evidence is corrupted. ~4-9 s wall (one tiny round, five audits)."""
    from cli.main import main
    from settlement.provision import write_dev_keys
    from storage_client import ObjectStore

    from .test_audit import RunBuilder

    monkeypatch.setenv("COLUMNS", "400")  # rich wraps what it prints at the width it is given
    builder = RunBuilder(tmp_path / "run", anvil.rpc_url, challenge_window=E2E_WINDOW)
    builder.round(nudge=True)  # θ off what the updates give: `rederive`, the coordinator's fault
    run, rpc = str(builder.root), ["--rpc", anvil.rpc_url]
    owner_key = str(write_dev_keys(tmp_path / "keys")[0])
    homes = [tmp_path / f"auditor-{i}" for i in range(3)]
    files = [tmp_path / f"verdicts-{i}.json" for i in range(3)]
    for home, file in zip(homes, files):
        assert main(["audit", "--run", run, *rpc, "--allow-dev", "--dispute", "--auditor-dir", str(home),
                     "--sign-only", "--verdicts-out", str(file)]) == 1  # `rederive` fails
    assert all(f.is_file() for f in files), "each auditor signed its verdicts into its file"
    addresses = [json.loads(f.read_text())["auditor"] for f in files]
    assert len(set(addresses)) == 3 and all((h / "auditor.key").is_file() for h in homes)
    said = _settle(["admit-auditor", "--run", run, *rpc, "--chain-key-file", owner_key, "--auditor-dir",
                    str(homes[0])], expect=1)  # dev evidence without --allow-dev: refused
    assert "the auditor's evidence does not verify" in said
    for i, home in enumerate(homes):
        assert main(["settle", "admit-auditor", "--run", run, *rpc, "--chain-key-file", owner_key, "--allow-dev",
                     "--auditor-dir", str(home), *(["--threshold", "2"] if i == 2 else [])]) == 0
    disputes = Disputes(builder.owner, builder.ledger.disputes_address(), from_block=builder.deployment.deployed_block)
    assert disputes.panel_of(builder.run_id) == (3, 2)

    bad = tmp_path / "bad.json"
    bad.write_text("{" * 100)
    said = _settle(["dispute", "--run", run, *rpc, "--verdicts", str(files[0]), str(bad)], expect=2)
    assert "cannot dispute" in said and "bad.json" in said and "Traceback" not in said  # nothing sent
    said = _settle(["dispute", "--run", run, *rpc, "--verdicts", str(files[2])], expect=1)
    assert "signed by 1 admitted auditor(s), the run needs 2: not sent" in said
    outsider = tmp_path / "outsider.json"
    verdict = read_verdicts(files[0]).signed[0][0]
    stranger = WorkerKey.generate()
    write_verdicts(outsider, disputes.domain(), stranger.address,
                   [(verdict, stranger.sign_digest(verdict.digest(disputes.domain())))])
    said = _settle(["dispute", "--run", run, *rpc, "--verdicts", str(files[0]), str(files[0]), str(outsider),
                    str(files[1])], expect=0)
    assert "duplicate signer" in said and f"{stranger.address} is not an auditor admitted" in said
    assert "upheld" in said and f"signed by {addresses[0]}, {addresses[1]}" in said
    (upheld,) = disputes.verdicts(builder.run_id)
    assert upheld.party == builder.coordinator.address and set(upheld.signers) == set(addresses[:2])
    said = _settle(["dispute", "--run", run, *rpc, "--verdicts", str(files[1]), str(files[2])], expect=1)
    assert "DisputesAlreadyVoided" in said  # the contract's refusal, by name

    again = tmp_path / "again.json"  # the same auditor, a second audit: its key is reused, not attested anew
    main(["audit", "--run", run, *rpc, "--allow-dev", "--dispute", "--auditor-dir", str(homes[0]),
          "--sign-only", "--verdicts-out", str(again)])
    assert json.loads(again.read_text())["auditor"] == addresses[0]

    audited = tmp_path / "audit.json"
    main(["audit", "--run", run, *rpc, "--allow-dev", "--json", str(audited)])
    result = json.loads(audited.read_text())
    assert {f["check"] for f in result["failures"]} == {"rederive"}, result["failures"]
    assert [(d["party_id"], d["check"], sorted(d["signers"])) for d in result["disputes"]] == \
        [("coordinator", "rederive", sorted(addresses[:2]))]

    store = ObjectStore(builder.root / "store")
    record = next(a for a in disputes.admissions(builder.run_id) if a.auditor == addresses[1])
    evidence = CID.parse(json.loads(store.get(CID(Codec.JSON, record.evidence_digest)))["evidence"])
    store.path_of(evidence).chmod(0o644)
    store.path_of(evidence).write_bytes(b"{}")  # corrupt: no longer its CID's bytes
    main(["audit", "--run", run, *rpc, "--allow-dev", "--no-rederive", "--json", str(audited)])
    failures = json.loads(audited.read_text())["failures"]
    assert [(f["check"], f["object"]) for f in failures] == [("auditor-evidence", addresses[1])], failures
    assert "its admission does not hold up" in failures[0]["message"]


def _settle(argv: list[str], expect: int) -> str:
    """``dilocox settle ARGV`` through the command line, its exit status checked; what it printed."""
    import argparse
    import contextlib

    from cli.settle import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = run(parser.parse_args(argv))
    assert status == expect, out.getvalue()
    return out.getvalue()
