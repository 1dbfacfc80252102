"""The lineage audit against real runs: a real anvil, the real contracts, a real store.

Each run is built here the way a coordinator builds one (genesis, inner loops on a tiny GPT, mean
of pseudo-gradients, outer Nesterov step, manifests, dev evidence and admission records, signed
EIP-712 reports recorded on the ledger), then broken in one way. Where the real ledger would refuse
the breakage (unadmitted signer, bad signature, revoked worker, wrong tallies), the ledger's code is
swapped for ``contracts/test/LyingLedger.sol`` with ``anvil_setCode``: same ABI, events and
storage, no checks. The audit must catch what the ledger let through.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from web3 import Web3

from attestation import (
    DevProvider,
    DevRoot,
    Policy,
    RoundReport,
    SignedReport,
    WorkerKey,
    attest,
    code_measurement,
)
from attestation.signing import update_digest
from audit import run_audit
from audit.cli import main as audit_main
from proto import Encoding
from settlement import DEV_ACCOUNTS, Anvil, Chain, Ledger, Registry, deploy
from settlement.artifacts import CONTRACTS_DIR
from settlement.ledger import RoundHeader, _worker_tuple
from settlement.rewards import RewardPool, RewardToken
from settlement.roster import short_address, unreported_lines
from storage_client import CID, Codec, Manifest, ObjectStore, Participant, Traffic, to_e6
from tests.oracles import mean_pseudo_gradient
from trainer.codec.wire import encode_params
from trainer.config import InnerConfig, ModelConfig, RoundConfig, RunConfig
from trainer.data.corpus import load_corpus, shard_digest
from trainer.model.gpt import build_model
from trainer.model.params import load_params, params_of
from trainer.rounds.outer import outer_step, zero_momentum
from trainer.runstore.update_record import record_bytes, slice_ref, store_slice
from trainer.runtime.inner import InnerLoop, evaluate, inner_state_digest

pytestmark = pytest.mark.integration

LYING_SOURCE = CONTRACTS_DIR / "test" / "LyingLedger.sol"
LYING_ARTIFACT = CONTRACTS_DIR / "out" / "LyingLedger.sol" / "LyingLedger.json"


def tiny_config(run_id: str) -> RunConfig:
    return RunConfig(
        run_id=run_id,
        model=ModelConfig(block_size=8, n_layer=1, n_head=2, n_embd=16),
        inner=InnerConfig(steps=2, batch_size=2, lr=1e-3),
        rounds=RoundConfig(rounds=3, expected_workers=2, quorum=2),
    ).plain_diloco()  # the builder writes dense, synchronous rounds


def lying_artifact() -> dict[str, Any]:
    """The compiled LyingLedger (built with forge here when the artifact is missing or stale)."""
    if not LYING_ARTIFACT.is_file() or LYING_ARTIFACT.stat().st_mtime < LYING_SOURCE.stat().st_mtime:
        subprocess.run([str(CONTRACTS_DIR / "node_modules" / ".bin" / "forge"), "build"], cwd=CONTRACTS_DIR,
                       check=True, capture_output=True)
    return json.loads(LYING_ARTIFACT.read_text())


class RunBuilder:
    """A run made as the coordinator makes one, with hooks to break it."""

    def __init__(self, root: Path, rpc_url: str, *, workers: tuple[str, ...] = ("w0", "w1"),
                 run_name: str = "audit", challenge_window: int = 0) -> None:
        self.root = root
        self.owner = Chain(rpc_url, DEV_ACCOUNTS[0])
        self.coordinator = Chain(rpc_url, DEV_ACCOUNTS[1])
        self.deployment = deploy(self.owner)
        self.deployment.save(root / "chain" / "deployment.json")
        self.owner_registry = Registry(self.owner, self.deployment.registry)
        self.registry = Registry(self.coordinator, self.deployment.registry)
        self.ledger = Ledger(self.coordinator, self.deployment.ledger)
        self.domain = self.ledger.domain()
        self.store = ObjectStore(root / "store")

        self.config = tiny_config(run_name)
        self.config_cid = self.store.put_json(self.config.to_json())
        corpus = load_corpus(self.config.data, self.config.seed, self.config.model.block_size)
        n = self.config.rounds.expected_workers
        self.shard_digests = [shard_digest(corpus.shard(i, n)) for i in range(n)]
        self.measurement = code_measurement(str(self.config_cid))
        self.owner_registry.set_verifier(self.coordinator.address)
        self.owner_registry.set_measurement(self.measurement)

        torch.manual_seed(0)
        self.model = build_model(self.config.model, self.config.seed)
        self.eval = [(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))]
        self.params = params_of(self.model)
        self.momentum = zero_momentum(self.params)
        genesis = Manifest.new(
            run_id=self.config.run_id, round=0, parent=None, config=self.config_cid,
            params=self.store.put(encode_params(self.params)),
            outer_state=self.store.put(encode_params({f"momentum.{k}": v for k, v in self.momentum.items()})),
            participants=(), dropped=(), eval_loss_e6=to_e6(evaluate(self.model, self.eval)), bytes_up=0, bytes_down=0,
        )
        self.manifests: list[tuple[CID, Manifest]] = [(genesis.store(self.store), genesis)]
        self.run_id = self.manifests[0][0].digest
        self.ledger.create_run(self.run_id, CID.parse(genesis.params).digest, self.config_cid.digest, self.run_id,
                               challenge_window)

        self.dev_root = DevRoot.load_or_create(root / "dev-root")
        self.provider = DevProvider(self.dev_root)
        self.keys: dict[str, WorkerKey] = {}
        self.loops = {w: InnerLoop(build_model(self.config.model, self.config.seed), self.config.inner)
                      for w in workers}
        for worker in workers:
            self.keys[worker] = WorkerKey.generate()
            self.admit(self.keys[worker])
        # The key each participant's push is signed with (None: unsigned), as a worker signs its push.
        self.push_keys: dict[str, WorkerKey | None] = dict(self.keys)
        self.reports: dict[int, list[SignedReport]] = {}

    @property
    def policy(self) -> Policy:
        return Policy.development(self.dev_root.address)

    def admit(self, key: WorkerKey) -> CID:
        nonce = os.urandom(32)
        evidence = attest(self.provider, key, self.run_id, nonce, self.measurement)
        record = self.store.put_json({
            "schema": "dilocox.admission/v1", "worker": key.address, "run_id": "0x" + self.run_id.hex(),
            "nonce": "0x" + nonce.hex(), "measurement": "0x" + self.measurement.hex(), "provider": "dev",
            "evidence": str(self.store.put(evidence.to_bytes())),
        })
        self.registry.admit_worker(key.address, self.measurement, record.digest)
        return record

    def report(self, worker: str, manifest: Manifest, key: WorkerKey | None = None,
               manifest_digest: bytes | None = None) -> SignedReport:
        """``worker``'s signed report of ``manifest`` (of the manifest whose digest is ``manifest_digest``,
        when given: the one the worker was shown)."""
        key = key or self.keys[worker]
        entry = next(p for p in manifest.participants if p.worker == worker)
        parent = self.manifests[manifest.round - 1][1]
        report = RoundReport(
            run_id=self.run_id, round=manifest.round, worker=key.address,
            parent_checkpoint=CID.parse(parent.params).digest, checkpoint=CID.parse(manifest.params).digest,
            manifest_digest=manifest_digest or manifest.cid.digest, update_digest=CID.parse(entry.update).digest, data_digest=self.shard_digests[entry.shard],
            train_loss_e6=entry.train_loss_e6, eval_loss_e6=manifest.eval_loss_e6, tokens=entry.tokens,
            inner_steps=entry.inner_steps, bytes_sent=entry.bytes_sent, bytes_received=entry.bytes_received,
        )
        return SignedReport(report, key.sign_digest(report.digest(self.domain)))

    def round(self, *, parent: CID | None = None, reports: Callable[[Manifest], list[SignedReport]] | None = None,
              nudge: bool = False, mangle: Callable[[dict[str, Any]], None] | None = None,
              unreported: Callable[[Manifest], list[bytes]] | None = None, record: bool = True,
              recorder: Chain | None = None, header_from_recorded: bool = False) -> Manifest:
        """Train, aggregate, store and record the next round. ``parent`` overrides the manifest's
        parent, ``reports`` makes the reports, ``unreported`` the update digests recorded without a
        report, ``nudge`` moves θ off what the updates give, ``mangle`` edits the manifest's JSON
        before it is stored (and recorded) without validation; ``record=False`` only stores it;
        ``recorder`` sends the recording transaction instead of the run's coordinator."""
        r = len(self.manifests)
        global_bytes = len(encode_params(self.params))  # what each worker fetched, as if sent dense
        generator = torch.Generator().manual_seed(r)
        deltas, participants = {}, []
        for shard, (worker, loop) in enumerate(self.loops.items()):
            batches = [(x, torch.roll(x, -1, 1)) for x in (torch.randint(0, 256, (2, 8), generator=generator)
                                                        for _ in range(self.config.inner.steps))]
            state = inner_state_digest(loop.state())  # what a worker's push commits to
            result = loop.run(self.params, batches)
            payload = encode_params(result.pseudo_gradient)
            deltas[worker] = result.pseudo_gradient
            key = self.push_keys.get(worker)
            signature = b"" if key is None else key.sign_digest(
                update_digest(self.run_id, r, 0, 1, hashlib.sha256(payload).hexdigest()))
            ref = slice_ref(0, 1, Encoding.DENSE_F32, payload, None, signature)  # as the coordinator keeps a push
            store_slice(self.store, ref, payload, None)
            record_cid = self.store.put(record_bytes([ref]), Codec.JSON)
            participants.append(Participant(worker=worker, update=str(record_cid),
                                            train_loss_e6=to_e6(result.mean_loss), tokens=result.tokens,
                                            inner_steps=result.steps, bytes_sent=len(payload),
                                            bytes_received=global_bytes, shard=shard % len(self.shard_digests),
                                            state=state))
        self.params, self.momentum = outer_step(self.config.outer, self.params, self.momentum,
                                                mean_pseudo_gradient(deltas))
        if nudge:
            first = next(iter(self.params))
            self.params[first] = self.params[first] + 1e-3
        load_params(self.model, self.params)
        prev_cid, prev = self.manifests[-1]
        manifest = Manifest.new(
            run_id=self.config.run_id, round=r, parent=parent or prev_cid, config=self.config_cid,
            params=self.store.put(encode_params(self.params)),
            outer_state=self.store.put(encode_params({f"momentum.{k}": v for k, v in self.momentum.items()})),
            participants=participants, dropped=(), eval_loss_e6=to_e6(evaluate(self.model, self.eval)),
            bytes_up=sum(p.bytes_sent for p in participants), bytes_down=sum(p.bytes_received for p in participants),
            traffic=[Traffic(p.worker, p.bytes_sent, p.bytes_received) for p in participants],
        )
        if mangle is None:
            cid = manifest.store(self.store)
        else:
            obj = manifest.to_json()
            mangle(obj)
            cid = self.store.put_json(obj)
        self.manifests.append((cid, manifest))
        signed = reports(manifest) if reports else [self.report(w, manifest, manifest_digest=cid.digest)
                                                    for w in self.keys]
        self.reports[r] = signed
        if record and header_from_recorded:
            # Straight to the contract: the round's header names the recorded manifest whatever the
            # reports signed (the client refuses to send reports that disagree with their round).
            header = RoundHeader(self.run_id, r, CID.parse(prev.params).digest, CID.parse(manifest.params).digest,
                                 cid.digest, signed[0].report.eval_loss_e6, signed[0].report.tokens,
                                 signed[0].report.inner_steps)
            ordered = sorted(signed, key=lambda s: int(s.report.worker, 16))
            self.coordinator.transact(self.ledger._contract.functions.recordRound(
                header.as_abi(), [_worker_tuple(s) for s in ordered], []))
        elif record:
            ledger = self.ledger if recorder is None else Ledger(recorder, self.deployment.ledger)
            ledger.record_round(self.run_id, r, CID.parse(prev.params).digest,
                                     CID.parse(manifest.params).digest, cid.digest, signed,
                                     unreported(manifest) if unreported else [])
        return manifest

    def add_ghost(self, name: str, key: WorkerKey | None) -> None:
        """A participant the coordinator adds to every later round, its push signed by ``key``
        (None: unsigned); it has no admission and sends no report."""
        self.loops[name] = InnerLoop(build_model(self.config.model, self.config.seed), self.config.inner)
        self.push_keys[name] = key

    def lie(self) -> Any:
        """Swap the ledger's code for LyingLedger's (state kept); returns a contract for its extras."""
        artifact = lying_artifact()
        address = self.owner.deploy(artifact["abi"], artifact["bytecode"]["object"], self.deployment.registry).address
        code = self.owner.w3.eth.get_code(address)
        self.owner.w3.provider.make_request("anvil_setCode", [self.deployment.ledger, "0x" + bytes(code).hex()])
        return self.coordinator.contract(self.deployment.ledger, artifact["abi"])

    def audit(self, store: ObjectStore | None = None, policy: Policy | None = None, rederive: bool = True,
              max_unrecorded: int = 0):
        rewards = RewardPool(self.coordinator, self.deployment.rewards, self.ledger)
        return run_audit(store or self.store, self.ledger, self.registry, policy=policy or self.policy,
                         rederive=rederive, max_unrecorded=max_unrecorded, rewards=rewards)

    def fund(self, amount: int, rounds: int) -> RewardPool:
        """Open the run's reward pool as its coordinator (the owner mints the tokens)."""
        RewardToken(self.owner, self.deployment.token).mint(self.coordinator.address, amount)
        RewardToken(self.coordinator, self.deployment.token).approve(self.deployment.rewards, amount)
        pool = RewardPool(self.coordinator, self.deployment.rewards, self.ledger)
        pool.open_pool(self.run_id, amount, rounds)
        return pool


def update_of(manifest: Manifest, worker: str) -> bytes:
    """The digest of a participant's update: what reports and the unreported list name."""
    (p,) = [p for p in manifest.participants if p.worker == worker]
    return CID.parse(p.update).digest


def checks(result) -> set[tuple[int | None, str]]:
    return {(f.round, f.check) for f in result.failures}


@pytest.fixture(scope="module")
def anvil():
    with Anvil() as chain:
        yield chain


@pytest.fixture(scope="module")
def honest(anvil: Anvil, tmp_path_factory: pytest.TempPathFactory) -> RunBuilder:
    builder = RunBuilder(tmp_path_factory.mktemp("honest"), anvil.rpc_url)
    for _ in range(3):
        builder.round()
    return builder


def tampered_store(builder: RunBuilder, tmp_path: Path) -> ObjectStore:
    shutil.copytree(builder.store.root, tmp_path / "store")
    return ObjectStore(tmp_path / "store")


def test_happy_path(honest: RunBuilder) -> None:
    result = honest.audit()
    assert result.ok, [str(f) for f in result.failures]
    assert result.run_id == honest.run_id
    assert [row.round for row in result.rounds] == [0, 1, 2, 3]
    assert all(row.status == "ok" for row in result.rounds)
    for row, (cid, manifest) in zip(result.rounds, honest.manifests, strict=True):
        assert row.manifest == str(cid)
        assert row.checkpoint == "0x" + CID.parse(manifest.params).hex
        assert row.participants == len(manifest.participants)
        assert row.reports == (0 if row.round == 0 else 2)
        assert row.eval_loss == pytest.approx(manifest.eval_loss_e6 / 1e6)
    assert sum("PROVES NOTHING" in w for w in result.warnings) == 1  # once for the run, naming the workers
    assert all(key.address in result.warnings[0] for key in honest.keys.values())

    doc = json.loads(json.dumps(result.to_json()))
    assert {"ok", "failures", "rounds", "warnings"} <= set(doc)
    assert doc["ok"] is True and doc["failures"] == []
    assert set(doc["rounds"][1]) == {"round", "manifest", "checkpoint", "participants", "reports", "eval_loss",
                                     "status", "unreported"}


def test_changed_checkpoint_byte(honest: RunBuilder, tmp_path: Path) -> None:
    store = tampered_store(honest, tmp_path)
    params = honest.manifests[2][1].params
    path = store.path_of(params)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))

    result = honest.audit(store)
    assert not result.ok
    hit = [f for f in result.failures if f.object == params]
    assert hit and hit[0].round == 2 and hit[0].check == "object"
    assert "re-hash" in hit[0].message
    # Round 2's stored bytes are damaged, but its updates re-derive θ⁽²⁾ to bytes that hash to the
    # manifest's CID; round 3 re-derives from those, so only round 2 is named.
    assert [row.status for row in result.rounds] == ["ok", "ok", "FAIL", "ok"]
    assert checks(result) == {(2, "object")}


def test_missing_update(honest: RunBuilder, tmp_path: Path) -> None:
    store = tampered_store(honest, tmp_path)
    update = honest.manifests[1][1].participants[1].update
    store.path_of(update).unlink()

    result = honest.audit(store)
    assert not result.ok
    missing = [f for f in result.failures if f.object == update]
    assert missing and missing[0].round == 1 and missing[0].check == "object" and "missing" in missing[0].message
    assert result.rounds[1].status == "FAIL"
    # Rounds 2 and 3 take round 1's update norms into their clip threshold (rounds.clip_history_rounds
    # = 2, trainer.rounds.aggregation): they cannot be re-derived either, and nothing else about them fails.
    later = {(f.round, f.check) for f in result.failures if f.round != 1}
    assert later == {(2, "rederive"), (3, "rederive")}
    assert all("previous 2 round(s)' updates" in f.message for f in result.failures if f.round != 1)


def test_wrong_parent_on_the_real_ledger(anvil: Anvil, tmp_path: Path) -> None:
    builder = RunBuilder(tmp_path, anvil.rpc_url, run_name="wrong-parent")
    builder.round()
    builder.round(parent=builder.manifests[0][0])  # round 2 names genesis as its parent; the ledger cannot tell
    result = builder.audit()
    assert not result.ok
    (failure,) = [f for f in result.failures if f.check == "parent"]
    assert failure.round == 2 and failure.object == str(builder.manifests[2][0])
    assert str(builder.manifests[1][0]) in failure.message
    assert checks(result) == {(2, "parent")}


def test_rederivation_catches_a_checkpoint_the_updates_do_not_give(anvil: Anvil, tmp_path: Path) -> None:
    builder = RunBuilder(tmp_path, anvil.rpc_url, run_name="bad-math")
    builder.round()
    # Round 2's θ is nudged before storing: every hash and signature is consistent, the arithmetic is not.
    builder.round(nudge=True)
    result = builder.audit()
    assert checks(result) == {(2, "rederive")}
    assert builder.audit(rederive=False).ok


def test_lying_ledger_unadmitted_forged_and_revoked(anvil: Anvil, tmp_path: Path) -> None:
    builder = RunBuilder(tmp_path, anvil.rpc_url, run_name="lying")
    builder.round()
    builder.lie()
    stranger = WorkerKey.generate()

    def unadmitted(manifest: Manifest) -> list[SignedReport]:  # w1's update, signed by a key never admitted
        return [builder.report("w0", manifest), builder.report("w1", manifest, key=stranger)]

    builder.round(reports=unadmitted)

    def forged(manifest: Manifest) -> list[SignedReport]:
        good = builder.report("w0", manifest)
        sig = bytearray(good.signature)
        sig[5] ^= 0xFF
        return [SignedReport(good.report, bytes(sig)), builder.report("w1", manifest)]

    builder.round(reports=forged)
    builder.registry.revoke_worker(builder.keys["w1"].address)
    builder.round()  # w1 reports after its revocation

    result = builder.audit()
    assert not result.ok
    found = checks(result)
    assert (2, "admitted") in found
    assert (3, "report-signature") in found
    assert (4, "revoked") in found
    assert (1, "revoked") not in found and result.rounds[1].status == "ok"
    by_check = {f.check: f for f in result.failures}
    assert stranger.address in by_check["admitted"].object
    assert builder.keys["w0"].address in by_check["report-signature"].object
    assert builder.keys["w1"].address in by_check["revoked"].object
    # The lying ledger tallied everything it was handed, so its tallies agree with the reports.
    assert not any(f.check == "tally" for f in result.failures)


def test_lying_ledger_tally(anvil: Anvil, tmp_path: Path) -> None:
    builder = RunBuilder(tmp_path, anvil.rpc_url, run_name="tally")
    builder.round()
    lying = builder.lie()
    w0 = builder.keys["w0"].address
    true_tokens = builder.reports[1][0].report.tokens
    builder.coordinator.transact(lying.functions.forgeTally(builder.run_id, w0, true_tokens * 10, 1))
    result = builder.audit()
    # the run's tally, and so the total over runs, which the ledger sums from its run tallies
    assert {(f.check, f.round, f.object) for f in result.failures} == {("tally", None, w0),
                                                                       ("total-contribution", None, w0)}
    assert all(str(true_tokens * 10) in f.message and str(true_tokens) in f.message for f in result.failures)


def test_lying_ledger_total(anvil: Anvil, tmp_path: Path) -> None:
    """A total over runs that drifts from the runs' records is named, though every run tally is right."""
    builder = RunBuilder(tmp_path, anvil.rpc_url, run_name="total")
    builder.round()
    builder.round()
    lying = builder.lie()
    w1 = builder.keys["w1"].address
    true_tokens = 2 * builder.reports[1][0].report.tokens
    builder.coordinator.transact(lying.functions.forgeTotal(w1, true_tokens + 1, 2))
    result = builder.audit()
    (failure,) = result.failures
    assert (failure.check, failure.round, failure.object) == ("total-contribution", None, w1)
    assert f"is {true_tokens + 1} tokens" in failure.message and f"credit {true_tokens} tokens" in failure.message


def test_a_round_recorded_by_another_account(anvil: Anvil, tmp_path: Path) -> None:
    """The real ledger refuses any sender but the run's coordinator (LedgerNotCoordinator, forge and
    test_settlement); a ledger that does not is caught by the audit, which checks the sender of every
    recording transaction."""
    builder = RunBuilder(tmp_path, anvil.rpc_url, run_name="recorder")
    builder.round()
    builder.lie()
    builder.round(recorder=builder.owner)
    result = builder.audit()
    (failure,) = result.failures
    assert (failure.check, failure.round, failure.object) == ("recorder", 2, "round 2 on chain")
    assert builder.owner.address in failure.message and builder.coordinator.address in failure.message


def test_a_manifest_changed_after_the_workers_signed(anvil: Anvil, tmp_path: Path) -> None:
    """The coordinator shows its workers one manifest and records another with other traffic (a field no
    report restates): every report signed the first manifest's digest. The real ledger refuses the
    recording (LedgerInvalidSignature: testReportForAnotherManifestRefused); a ledger that takes it is
    caught by the audit, which recomputes every report's digest with the recorded manifest and names
    each signature."""
    builder = RunBuilder(tmp_path, anvil.rpc_url, run_name="traffic")
    builder.round()

    def inflate(obj: dict[str, Any]) -> None:
        for t in obj["traffic"]:
            t["up"] *= 10
        obj["bytes_up"] = sum(t["up"] for t in obj["traffic"])

    def signed_as_shown(manifest: Manifest) -> list[SignedReport]:  # the workers saw the honest manifest
        return [builder.report(w, manifest, manifest_digest=manifest.cid.digest) for w in builder.keys]

    builder.lie()
    builder.round(mangle=inflate, reports=signed_as_shown, header_from_recorded=True)
    result = builder.audit()
    failures = result.failures
    assert {(f.check, f.round) for f in failures} == {("report-signature", 2)} and len(failures) == 2
    assert {f.object.split()[-1] for f in failures} == {key.address for key in builder.keys.values()}


def test_a_manifest_claiming_other_inner_steps_is_named(anvil: Anvil, tmp_path: Path) -> None:
    """A coordinator credits its workers with more inner steps and tokens than the round trains, and
    they sign it: ledger and reports agree, but H_r is not the coordinator's or a worker's to claim.
    The audit re-derives it (trainer.rounds.schedule: here the fixed H = 2) and names the round."""
    builder = RunBuilder(tmp_path, anvil.rpc_url, run_name="steps")
    builder.round()

    def more_steps(obj: dict[str, Any]) -> None:
        for p in obj["participants"]:
            p["inner_steps"], p["tokens"] = 3, 3 * 2 * 8

    def signed_as_recorded(_: Manifest) -> list[SignedReport]:
        cid = builder.manifests[-1][0]
        recorded = Manifest.from_json(builder.store.get_json(cid))
        return [builder.report(w, recorded, manifest_digest=cid.digest) for w in builder.keys]

    builder.round(mangle=more_steps, reports=signed_as_recorded)
    result = builder.audit(rederive=False)  # the builder's rounds travel dense: the arithmetic is not at issue
    failures = result.failures
    assert {(f.check, f.round) for f in failures} == {("inner-steps", 2)} and len(failures) == 2, failures
    assert "recorded with 3 inner steps and 48 tokens; round 2 trains 2 steps, 32 tokens" in failures[0].message


def test_dev_evidence_needs_allow_dev(honest: RunBuilder) -> None:
    result = honest.audit(policy=Policy())
    assert not result.ok
    refused = [f for f in result.failures if f.check == "evidence"]
    assert len(refused) == 2  # once per worker, at its first report
    assert all(f.round == 1 and "dev" in f.message and "--allow-dev" in f.message for f in refused)
    # Every later report of those workers fails too, pointing back at round 1.
    assert checks(result) == {(1, "evidence"), (2, "admission"), (3, "admission")}
    assert [row.status for row in result.rounds] == ["ok", "FAIL", "FAIL", "FAIL"]
    assert not any("ACCEPTED" in w for w in result.warnings)
    # A dev root the auditor does not trust is refused too.
    other = Policy.development(DevRoot(os.urandom(32)).address)
    untrusted = honest.audit(policy=other)
    assert {f.check for f in untrusted.failures} == {"evidence", "admission"}
    assert all("not a trusted dev root" in f.message for f in untrusted.failures if f.check == "evidence")


def test_report_that_restates_the_manifest_wrongly(anvil: Anvil, tmp_path: Path) -> None:
    """The real ledger cannot see manifests: an inflated token count is recorded and tallied."""
    builder = RunBuilder(tmp_path, anvil.rpc_url, run_name="inflated")

    def inflated(manifest: Manifest) -> list[SignedReport]:  # w1 claims 1000 extra tokens; w0 never reports
        key = builder.keys["w1"]
        honest_report = builder.report("w1", manifest).report
        report = dataclasses.replace(honest_report, tokens=honest_report.tokens + 1000)
        return [SignedReport(report, key.sign_digest(report.digest(builder.domain)))]

    builder.round(reports=inflated, unreported=lambda m: [update_of(m, "w0")])
    builder.round()
    result = builder.audit()
    assert checks(result) == {(1, "report-fields")}
    (failure,) = result.failures
    assert builder.keys["w1"].address in failure.object and "tokens" in failure.message
    w0 = builder.keys["w0"].address  # unreported in round 1, bound to its id by its report of round 2
    assert [(u.round, u.worker, u.address) for u in result.roster.unreported] == [(1, "w0", w0)]
    assert result.roster.ids == {w0: ["w0"], builder.keys["w1"].address: ["w1"]}
    assert [row.reports for row in result.rounds] == [0, 1, 2]


def test_report_with_another_shards_data_digest(anvil: Anvil, tmp_path: Path) -> None:
    """w1 trained on shard 1 but signs shard 0's digest: the ledger cannot tell, the audit derives
    each shard's digest from the config and the corpus and names the report."""
    builder = RunBuilder(tmp_path, anvil.rpc_url, run_name="data")

    def wrong_data(manifest: Manifest) -> list[SignedReport]:
        honest = [builder.report("w0", manifest)]
        report = dataclasses.replace(builder.report("w1", manifest).report, data_digest=builder.shard_digests[0])
        return honest + [SignedReport(report, builder.keys["w1"].sign_digest(report.digest(builder.domain)))]

    builder.round()
    builder.round(reports=wrong_data)
    result = builder.audit()
    assert checks(result) == {(2, "data-digest")}
    (failure,) = result.failures
    assert builder.keys["w1"].address in failure.object and "shard 1 of 2" in failure.message


def test_a_ghost_participant_fails_the_audit(anvil: Anvil, tmp_path: Path) -> None:
    """An update in the average that no worker signed for, and the coordinator did not own up to."""
    builder = RunBuilder(tmp_path, anvil.rpc_url, run_name="ghost")
    builder.round(reports=lambda m: [builder.report("w0", m)])  # w1's update is in; nobody answers for it
    builder.round()
    result = builder.audit()
    assert checks(result) == {(1, "ghost")}
    (failure,) = result.failures
    assert "w1" in failure.message and failure.object == [p.update for p in builder.manifests[1][1].participants
                                                          if p.worker == "w1"][0]


@pytest.mark.parametrize("signed", [True, False], ids=["unadmitted-key", "unsigned"])
def test_a_ghost_listed_as_unreported_fails_the_audit_by_name(anvil: Anvil, tmp_path: Path, signed: bool) -> None:
    """A coordinator adds a ghost participant and lists it as unreported, as if a worker had died
    before reporting: its update is averaged in, but no admitted key pushed it (issue 28)."""
    builder = RunBuilder(tmp_path, anvil.rpc_url, run_name=f"ghost-{signed}")
    builder.add_ghost("ghost", WorkerKey.generate() if signed else None)
    builder.round(unreported=lambda m: [update_of(m, "ghost")])
    result = builder.audit()
    ghost_update = [p.update for p in builder.manifests[1][1].participants if p.worker == "ghost"][0]
    if signed:  # a real signature, by a key the registry never admitted
        assert checks(result) == {(1, "admitted")}, [str(f) for f in result.failures]
        (failure,) = result.failures
        assert failure.object == f"the push of participant ghost ({ghost_update})"
        assert builder.push_keys["ghost"].address in failure.message and "never admitted" in failure.message
    else:  # no signature kept: what an old record, or a push nobody signed, looks like
        assert checks(result) == {(1, "push-signature")}, [str(f) for f in result.failures]
        (failure,) = result.failures
        assert failure.object == ghost_update
        assert "participant ghost's update keeps no push signature" in failure.message
    assert not result.ok


def test_a_round_nobody_reported_is_recorded_listed_and_credits_nobody(anvil: Anvil, tmp_path: Path) -> None:
    builder = RunBuilder(tmp_path, anvil.rpc_url, run_name="unreported")
    builder.round(reports=lambda m: [], unreported=lambda m: [update_of(m, "w0"), update_of(m, "w1")])
    builder.round()  # the next round is not blocked behind it
    result = builder.audit()
    assert result.ok, [str(f) for f in result.failures]
    assert [(row.reports, row.unreported) for row in result.rounds] == [(0, 0), (0, 2), (2, 0)]
    keys = builder.keys
    assert [(u.round, u.worker, u.address) for u in result.roster.unreported] == [
        (1, "w0", keys["w0"].address), (1, "w1", keys["w1"].address)]
    lines = unreported_lines(result.roster)
    assert len(lines) == 2 and all("round 1 was recorded with 0 report(s) for 2 update(s)" in line for line in lines)
    assert f"participant w0 did not report ({short_address(keys['w0'].address)})" in lines[0]
    assert f"participant w1 did not report ({short_address(keys['w1'].address)})" in lines[1]
    assert builder.ledger.contribution_of(builder.run_id, builder.keys["w0"].address).rounds == 1


def test_an_unreported_entry_must_be_an_unreported_participant(anvil: Anvil, tmp_path: Path) -> None:
    builder = RunBuilder(tmp_path, anvil.rpc_url, run_name="vouched")
    stranger = hashlib.sha256(b"no participant's update").digest()
    builder.round(reports=lambda m: [builder.report("w0", m)], unreported=lambda m: [update_of(m, "w1"), stranger])
    result = builder.audit()
    assert checks(result) == {(1, "unreported")}
    assert "no participant's update" in result.failures[0].message


def test_a_store_lineage_past_the_ledger_fails_the_audit(anvil: Anvil, tmp_path: Path) -> None:
    """A 3-round run of which the ledger records only round 1 does not pass as a 1-round run."""
    builder = RunBuilder(tmp_path, anvil.rpc_url, run_name="unrecorded")
    builder.round()
    builder.round(record=False)
    builder.round(record=False)
    result = builder.audit()
    assert checks(result) == {(None, "unrecorded")}
    assert "rounds 2..3" in result.failures[0].message and "last round 1" in result.failures[0].message
    assert str(builder.manifests[3][0]) == result.failures[0].object
    allowed = builder.audit(max_unrecorded=2)  # a run still catching up, audited with a stated lag
    assert allowed.ok and any("rounds 2..3" in w for w in allowed.warnings)


def test_report_that_misstates_the_download(anvil: Anvil, tmp_path: Path) -> None:
    """bytesReceived is signed and must restate the participant's bytes_received like bytesSent."""
    builder = RunBuilder(tmp_path, anvil.rpc_url, run_name="download")

    def understated(manifest: Manifest) -> list[SignedReport]:
        key = builder.keys["w1"]
        honest_report = builder.report("w1", manifest).report
        assert honest_report.bytes_received > 0
        report = dataclasses.replace(honest_report, bytes_received=honest_report.bytes_received - 1)
        return [builder.report("w0", manifest), SignedReport(report, key.sign_digest(report.digest(builder.domain)))]

    builder.round(reports=understated)
    result = builder.audit()
    assert checks(result) == {(1, "report-fields")}
    (failure,) = result.failures
    assert builder.keys["w1"].address in failure.object
    assert "bytesReceived" in failure.message and "bytesSent" not in failure.message


def test_manifest_whose_traffic_does_not_add_up(anvil: Anvil, tmp_path: Path) -> None:
    builder = RunBuilder(tmp_path, anvil.rpc_url, run_name="traffic")
    builder.round()

    def inflate(obj: dict[str, Any]) -> None:  # one worker's download grows, the round's total does not
        obj["traffic"][0]["down"] += 1

    builder.round(mangle=inflate)
    result = builder.audit()
    assert not result.ok
    bad = [f for f in result.failures if f.check == "manifest"]
    assert bad and all(f.round == 2 for f in bad)
    assert "round 2" in bad[0].message and "'traffic'" in bad[0].message and "bytes_down" in bad[0].message
    assert result.rounds[1].status == "ok" and result.rounds[2].status == "FAIL"


def test_cli_from_saved_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    with Anvil(state_file=run_dir / "chain" / "state.json") as chain:
        builder = RunBuilder(run_dir, chain.rpc_url, run_name="cli")
        builder.round()
        builder.round()
    capsys.readouterr()

    out = tmp_path / "audit.json"
    assert audit_main(["--run", str(run_dir), "--allow-dev", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "AUDIT PASSED" in printed and "PROVES NOTHING" in printed
    doc = json.loads(out.read_text())
    assert doc["ok"] is True and [r["round"] for r in doc["rounds"]] == [0, 1, 2]
    assert all(r["status"] == "ok" for r in doc["rounds"])

    assert audit_main(["--run", str(run_dir), "--no-rederive", "--json", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "AUDIT FAILED" in printed
    doc = json.loads(out.read_text())
    assert doc["ok"] is False and {f["check"] for f in doc["failures"]} == {"evidence", "admission"}


def test_rewards_are_claimed_and_audited(anvil: Anvil, tmp_path: Path) -> None:
    """Each worker claims its share of each recorded round once it is past the challenge window (0
    here); the audit shows what each earned and was paid, and passes."""
    builder = RunBuilder(tmp_path, anvil.rpc_url, run_name="paid")
    pool = builder.fund(1000, rounds=2)
    builder.round()
    builder.round()
    for key in builder.keys.values():
        amount, _ = pool.claim(builder.run_id, key.address)
        assert amount == 2 * (1000 // 2 // 2)  # two rounds of ⌊500 / 2 workers⌋
        assert pool.claim(builder.run_id, key.address) == (0, None)  # nothing left to claim
    result = builder.audit()
    assert result.ok, result.failures
    assert result.rewards is not None and result.rewards.paid == 1000
    assert {w: (a.earned, a.paid) for w, a in result.rewards.workers.items()} == {
        key.address: (500, 500) for key in builder.keys.values()}
    assert result.to_json()["rewards"]["paid"] == 1000


def _set_storage_word(builder: RunBuilder, contract: str, slot: int, value: int) -> None:
    builder.owner.w3.provider.make_request("anvil_setStorageAt", [contract, hex(slot), "0x" + value.to_bytes(32, "big").hex()])


def _mapping_slot(key: bytes, slot: int) -> int:
    """The storage slot of ``mapping[key]`` for a mapping declared at ``slot`` (Solidity's layout:
    keccak256(key . slot), the key left-padded to 32 bytes)."""
    return int.from_bytes(Web3.keccak(key.rjust(32, b"\0") + slot.to_bytes(32, "big")), "big")


@pytest.mark.parametrize("tampered", ["paid", "balance"])
def test_a_pool_whose_books_disagree_with_its_payments_is_named(anvil: Anvil, tmp_path: Path, tampered: str) -> None:
    """The pool's own count of what it paid out of the run must equal its RewardPaid events, and it
    must hold what it has yet to pay: a pool whose ``paid`` was changed, or whose tokens went, fails
    the audit by name. (The chain is changed under the pool with anvil_setStorageAt; the slots are
    ``forge inspect``'s: RewardPool._pools at 0 with {funded, paid} packed in the record's second
    word, RewardToken._balances at 0.)"""
    builder = RunBuilder(tmp_path, anvil.rpc_url, run_name=f"books-{tampered}")
    pool = builder.fund(1000, rounds=2)
    builder.round()
    w0 = builder.keys["w0"].address
    assert pool.claim(builder.run_id, w0)[0] == 250
    assert builder.audit().ok
    if tampered == "paid":  # the record's second word: paid (high 128 bits) | funded (low 128 bits)
        _set_storage_word(builder, pool.address, _mapping_slot(builder.run_id, 0) + 1, (100 << 128) | 1000)
        said = ["the pool counts 100 paid out of this run, but its RewardPaid events add up to 250",
                # by its own count it owes 900 now, and holds the 750 it really had left
                "the pool holds 750 tokens, less than the 900 it has yet to pay out of this run"]
    else:
        holder = bytes.fromhex(pool.address[2:])
        _set_storage_word(builder, builder.deployment.token, _mapping_slot(holder, 0), 700)
        said = ["the pool holds 700 tokens, less than the 750 it has yet to pay out of this run"]
    result = builder.audit()
    failures = [f for f in result.failures if f.check == "payout"]
    assert [f.message for f in failures] == said and {f.object for f in failures} == {pool.address}
    assert result.to_json()["rewards"]["pool_paid"] == (100 if tampered == "paid" else 250)


def test_a_payout_no_record_entitles_is_named(anvil: Anvil, tmp_path: Path) -> None:
    """A ledger that answers the pool with a round of its own making (only w0, so w0 takes the whole
    round) gets the pool to pay; the audit recomputes every entitlement from the RoundRecorded events
    and names the payment."""
    builder = RunBuilder(tmp_path, anvil.rpc_url, run_name="overpaid")
    pool = builder.fund(1000, rounds=1)
    builder.round()
    lying = builder.lie()
    w0 = builder.keys["w0"].address
    (event,) = builder.ledger.recorded_round_events(builder.run_id)
    forged = dataclasses.replace(event, workers=(w0,))
    builder.coordinator.transact(lying.functions.forgeCommitment(builder.run_id, 1, forged.facts_commitment()))
    builder.coordinator.transact(pool._contract.functions.claim(builder.run_id, w0, [(1, 0, forged.facts())]))
    result = builder.audit()
    failures = [f for f in result.failures if f.check == "payout"]
    assert len(failures) == 1 and failures[0].object == w0
    assert "paid 1000, entitled to 500" in failures[0].message
