"""A ledger that always catches up: unreported rounds, and a chain that comes back behind.

Real anvil, contracts, coordinator and worker processes. "m" is an attested, hand-driven client
(test_bad_input.Mallory) that pushes an update and is gone before the round it took part in is
published, so it never reports: exactly a worker killed between push and report.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from rich.console import Console

from attestation import DevProvider, DevRoot, WorkerKey, attest, code_measurement
from attestation.signing import update_digest
from audit.cli import audit_run_dir
from audit.disputes import DisputeOptions
from cli.cluster import LocalCluster, provision
from proto import PROTOCOL_VERSION, pb, session_metadata
from settlement import DEV_ACCOUNTS, Anvil, Registry
from settlement.records import Contribution
from storage_client import CID, Codec, lineage
from tests.conftest import small_config
from tests.integration.test_bad_input import Mallory
from tests.integration.test_trust import ledger_of, pinned, start
from trainer.codec.wire import encode_params, sha256_hex
from trainer.config import InnerConfig, RoundConfig, RunConfig

pytestmark = pytest.mark.integration

GHOST_SITE = Path(__file__).parent / "ghost_site"  # a patched coordinator's start-up hook


def attested_mallory(cluster: LocalCluster, worker_id: str = "m") -> tuple[Mallory, WorkerKey, bytes]:
    stub = cluster.stub()
    challenge = stub.Challenge(pb.ChallengeRequest(protocol_version=PROTOCOL_VERSION, worker_id=worker_id), timeout=10)
    key = WorkerKey.generate()
    provider = DevProvider(DevRoot.load_or_create(cluster.run_dir.path / "dev-root"))
    evidence = attest(provider, key, challenge.run_digest, challenge.nonce, code_measurement(challenge.config_cid))
    joined = stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, worker_id=worker_id, address=key.address,
                                      evidence=evidence.to_bytes(), nonce=challenge.nonce), timeout=30)
    m = Mallory(stub, worker_id, RunConfig.from_json(json.loads(challenge.config_json)),
                session_metadata(worker_id, joined.session_token))
    return m, key, challenge.run_digest


def audit(cluster: LocalCluster, rpc_url: str) -> tuple[int, str]:
    console = Console(record=True, width=200)
    code = audit_run_dir(cluster.run_dir.path, rpc_url=rpc_url, allow_dev=True, console=console)
    return code, console.export_text()


def test_a_round_whose_participant_died_before_reporting_blocks_nothing(cluster: LocalCluster, chain: Anvil,
                                                                        tmp_path: Path) -> None:
    rounds = 11
    config = pinned(small_config(rounds=RoundConfig(rounds=rounds, expected_workers=1, quorum=1,
                                                    heartbeat_interval_s=0.5, liveness_timeout_s=3.0)))
    _, wo_args = start(cluster, chain, config, tmp_path)  # --report-timeout 10
    m, key, run_digest = attested_mallory(cluster)
    sha = sha256_hex(encode_params(m.default))
    m.push(signature=key.sign_digest(update_digest(run_digest, 1, 0, 1, sha)))  # ... and m is gone for good
    cluster.wait_for(lambda s: len(s.rounds) >= 2, 60, "round 1 to close on m's update alone")
    cluster.start_worker("w0", extra=wo_args)  # an honest worker carries the run through ten more rounds
    assert cluster.wait_exit("w0", 240) == 0, cluster.log("w0")
    assert cluster.wait_exit("coordinator", 120) == 0, cluster.log("coordinator", tail=80)
    assert "round 1: no report from m" in cluster.log("coordinator", tail=2000)

    ledger, run_id = ledger_of(cluster, chain)
    assert ledger.run_of(run_id).last_round == rounds
    recorded = ledger.recorded_rounds(run_id)
    assert [r.round for r in recorded] == list(range(1, rounds + 1))  # all of them, once, in order
    manifests = lineage(cluster.run_dir.store, cluster.run_dir.head())[1:]
    (m_update,) = [CID.parse(p.update).digest for p in manifests[0][1].participants]
    assert (len(recorded[0].reports), recorded[0].unreported) == (0, (m_update,))
    assert all(len(r.reports) == 1 and r.unreported == () for r in recorded[1:])
    assert ledger.contribution_of(run_id, key.address) == Contribution(tokens=0, rounds=0)  # nobody is credited

    code, text = audit(cluster, chain.rpc_url)
    assert code == 0, text
    assert "participant m did not report" in text and "AUDIT PASSED" in text


def test_a_chain_restored_behind_gets_every_round_again_once_in_order(cluster: LocalCluster, chain: Anvil,
                                                                     tmp_path: Path) -> None:
    rounds = 10
    # ~1 s of training a round, so the chain moves on by whole rounds between the copy and the kill
    config = pinned(small_config(inner=InnerConfig(steps=400, batch_size=4, lr=1e-3),
                                 rounds=RoundConfig(rounds=rounds, expected_workers=1, quorum=1,
                                                    heartbeat_interval_s=0.5, liveness_timeout_s=3.0)))
    _, wo_args = start(cluster, chain, config, tmp_path)
    cluster.start_worker("w0", extra=wo_args)
    live, run_id = None, None

    def last_round() -> int:
        nonlocal live, run_id
        if live is None:
            try:
                live, run_id = ledger_of(cluster, chain)
            except Exception:  # noqa: BLE001 - no HEAD or deployment yet
                return 0
        run = live.run_of(run_id)
        return 0 if run is None else run.last_round

    def wait_until(target: int) -> int:
        deadline = time.monotonic() + 120
        while (got := last_round()) < target and time.monotonic() < deadline:
            time.sleep(0.1)
        return got

    wait_until(1)
    time.sleep(1.5)  # anvil dumps its state every second: the copy holds at most what the chain has now
    older = tmp_path / "older-state.json"
    shutil.copyfile(chain.state_file, older)
    at_copy = last_round()
    assert at_copy < rounds - 2, "the run went too fast for the chain to move on after the copy"
    killed_at = wait_until(at_copy + 2)
    assert killed_at >= at_copy + 2, cluster.log("coordinator", tail=60)
    port = int(chain.rpc_url.rsplit(":", 1)[1])
    chain._process.kill()  # SIGKILL: no final dump
    chain._process.wait()
    chain.stop()
    with Anvil(state_file=older, port=port) as restored:  # the same node, back from an older state
        ledger, run_id = ledger_of(cluster, restored)
        behind = ledger.run_of(run_id).last_round
        assert behind <= at_copy < killed_at
        assert cluster.wait_exit("w0", 240) == 0, cluster.log("w0")
        assert cluster.wait_exit("coordinator", 120) == 0, cluster.log("coordinator", tail=80)
        log = cluster.log("coordinator", tail=4000)
        assert "the chain came back behind" in log
        recorded = ledger.recorded_rounds(run_id)
        assert [r.round for r in recorded] == list(range(1, rounds + 1))  # once each, in order
        manifests = lineage(cluster.run_dir.store, cluster.run_dir.head())[1:]
        assert [r.manifest_digest for r in recorded] == [cid.digest for cid, _ in manifests]
        assert not list((cluster.run_dir.path / "outbox").glob("*.json"))
        assert len(list((cluster.run_dir.path / "outbox" / "confirmed").glob("*-round.json"))) == rounds
        code, text = audit(cluster, restored.rpc_url)
        assert code == 0, text


def test_a_chain_restored_to_before_the_admissions_gets_them_again_and_every_round(cluster: LocalCluster,
                                                                                  chain: Anvil,
                                                                                  tmp_path: Path) -> None:
    """Issue 28: the node comes back from a state taken before the coordinator started (the
    registry's allowlist and verifier are there; the run, the worker's admission and the rounds are
    not). The coordinator sends the run, the admission it kept (on the evidence it verified) and
    every round again, in order; before, the rounds were refused for good (unadmitted signer)."""
    rounds = 4
    config = pinned(small_config(inner=InnerConfig(steps=400, batch_size=4, lr=1e-3),
                                 rounds=RoundConfig(rounds=rounds, expected_workers=1, quorum=1,
                                                    heartbeat_interval_s=0.5, liveness_timeout_s=3.0)))
    path = tmp_path / "config.json"
    config.save(path)
    co_args, wo_args = provision(cluster.run_dir.path, chain.rpc_url, config)
    time.sleep(1.5)  # anvil dumps its state every second: the copy holds the provisioned chain
    older = tmp_path / "before-admissions.json"
    shutil.copyfile(chain.state_file, older)
    cluster.start_coordinator(path, extra=[*co_args, "--report-timeout", "10"])
    cluster.start_worker("w0", extra=wo_args)
    cluster.wait_for(lambda s: len(s.rounds) >= 3, 120, "round 2 to close")
    deadline = time.monotonic() + 60
    live, run_id = ledger_of(cluster, chain)
    while (live.run_of(run_id) is None or live.run_of(run_id).last_round < 1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live.run_of(run_id).last_round >= 1 and live.chain.w3.eth.get_logs(
        {"address": Registry(live.chain, live.registry_address()).address, "fromBlock": 0})
    port = int(chain.rpc_url.rsplit(":", 1)[1])
    chain._process.kill()  # SIGKILL: no final dump
    chain._process.wait()
    chain.stop()
    with Anvil(state_file=older, port=port) as restored:
        ledger, _ = ledger_of(cluster, restored)
        registry = Registry(ledger.chain, ledger.registry_address())
        assert cluster.wait_exit("w0", 240) == 0, cluster.log("w0")
        assert cluster.wait_exit("coordinator", 120) == 0, cluster.log("coordinator", tail=80)
        # what the coordinator found (the copy had neither the run nor the admission) and sent again
        log = cluster.log("coordinator", tail=4000)
        assert "the chain came back behind: it has no record of the run, but the run and 1 admission(s)" in log, log
        assert "admitted again on the ledger's registry" in log
        assert [r.round for r in ledger.recorded_rounds(run_id)] == list(range(1, rounds + 1))
        (admission,) = registry.admissions()
        assert cluster.run_dir.store.has(CID(Codec.JSON, admission.evidence_digest))  # the record it verified
        code, text = audit(cluster, restored.rpc_url)
        assert code == 0, text


def test_a_ghost_the_coordinator_adds_as_unreported_fails_the_audit_by_name(cluster: LocalCluster, chain: Anvil,
                                                                            tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 28, from outside: a patched coordinator (tests/integration/ghost_site) averages a ghost's
    update into round 1; its unmodified settlement code records the ghost as unreported. Before,
    the audit passed with a warning ("participant ghost did not report"); now no admitted key pushed
    that update, and the audit fails naming it; ``audit --dispute`` turns that into a verdict against
    the coordinator, upheld on chain, which voids the round."""
    monkeypatch.setenv("PYTHONPATH", f"{GHOST_SITE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    config = pinned(small_config(rounds=RoundConfig(rounds=2, expected_workers=1, quorum=1,
                                                    heartbeat_interval_s=0.5, liveness_timeout_s=3.0)))
    path = tmp_path / "config.json"
    config.save(path)
    co_args, wo_args = provision(cluster.run_dir.path, chain.rpc_url, config)
    cluster.start_coordinator(path, extra=[*co_args, "--report-timeout", "2", "--challenge-window", "100"])
    cluster.start_worker("w0", extra=wo_args)
    assert cluster.wait_exit("w0", 120) == 0, cluster.log("w0")
    assert cluster.wait_exit("coordinator", 120) == 0, cluster.log("coordinator", tail=80)
    ledger, run_id = ledger_of(cluster, chain)
    (first, _) = ledger.recorded_rounds(run_id)
    manifests = lineage(cluster.run_dir.store, cluster.run_dir.head())
    ghost = {p.worker: p for p in manifests[1][1].participants}["ghost"]
    assert first.unreported == (CID.parse(ghost.update).digest,)  # on the coordinator's word

    code, text = audit(cluster, chain.rpc_url)
    assert code == 1 and "AUDIT FAILED" in text, text
    assert "push-signature" in text and "participant ghost's update keeps no push signature" in text, text
    assert "rederive" not in text  # the ghost was averaged in as the checkpoint says

    assert ledger.contribution_of(run_id, first.reports[0].report.worker).rounds == 2
    owner = bytes.fromhex(DEV_ACCOUNTS[0].removeprefix("0x"))  # the ledger's deployer owns the disputes contract
    disputed = tmp_path / "disputed.json"
    audit_run_dir(cluster.run_dir.path, rpc_url=chain.rpc_url, allow_dev=True, console=Console(record=True),
                  json_path=disputed, dispute=DisputeOptions(owner, "dev", str(cluster.run_dir.path / "dev-root")))
    rows = json.loads(disputed.read_text())["disputes"]
    coordinator = ledger.run_of(run_id).coordinator
    assert [(d["round"], d["party"], d["check"], d["outcome"]) for d in rows] == \
        [(1, coordinator, "push-signature", "upheld")], rows
    assert ledger.contribution_of(run_id, first.reports[0].report.worker).rounds == 1  # round 1 voided whole
