"""The trust path end to end: attested workers, signed updates and reports, rounds on a real chain.

Real anvil, real contracts, real coordinator and worker processes; nothing is mocked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from attestation import DevProvider, DevRoot, Domain, RoundReport, SignedReport, WorkerKey, attest, code_measurement
from attestation.signing import update_digest
from cli.cluster import LocalCluster, provision
from proto import PROTOCOL_VERSION, pb, session_metadata
from settlement import DEV_ACCOUNTS, Anvil, Chain, Deployment, Ledger
from storage_client import CID, canonical_json, lineage
from tests.conftest import small_config
from tests.integration.test_bad_input import Mallory
from trainer.codec import CompressionConfig
from trainer.codec.wire import encode_params, sha256_hex
from trainer.config import InnerConfig, RoundConfig, RunConfig
from trainer.data.corpus import load_corpus, shard_digest

pytestmark = pytest.mark.integration


def pinned(config: RunConfig) -> RunConfig:
    corpus = load_corpus(config.data, config.seed, config.model.block_size)
    return config.replace(data=dataclasses.replace(config.data, corpus_sha256=corpus.sha256))


def start(cluster: LocalCluster, anvil: Anvil, config: RunConfig, tmp_path: Path) -> tuple[list[str], list[str]]:
    path = tmp_path / "config.json"
    config.save(path)
    co_args, wo_args = provision(cluster.run_dir.path, anvil.rpc_url, config)
    cluster.start_coordinator(path, extra=[*co_args, "--report-timeout", "10"])
    return co_args, wo_args


def ledger_of(cluster: LocalCluster, anvil: Anvil) -> tuple[Ledger, bytes]:
    deployment = Deployment.load(cluster.run_dir.path / "chain" / "deployment.json")
    reader = Chain(anvil.rpc_url, DEV_ACCOUNTS[2])
    genesis_cid = lineage(cluster.run_dir.store, cluster.run_dir.head())[0][0]
    return Ledger(reader, deployment.ledger), genesis_cid.digest


@pytest.mark.parametrize("compressed", [False, True], ids=["dense", "lowrank-int4"])
def test_attested_workers_every_round_recorded(cluster: LocalCluster, chain: Anvil, tmp_path: Path,
                                              compressed: bool) -> None:
    # With compression the reports restate the dense reconstruction's digest, which the
    # coordinator stores: both sides rebuild it from the same bytes.
    config = small_config(compression=CompressionConfig(enabled=compressed, min_rank=1, max_rank=4))
    _, wo_args = start(cluster, chain, pinned(config), tmp_path)
    cluster.start_worker("w0", extra=wo_args)
    cluster.start_worker("w1", extra=wo_args)
    for name in ("w0", "w1", "coordinator"):
        assert cluster.wait_exit(name, 180) == 0, cluster.log(name)
    assert "PROVES NOTHING" in cluster.log("coordinator", tail=400)

    ledger, run_id = ledger_of(cluster, chain)
    run = ledger.run_of(run_id)
    assert run is not None and run.last_round == 2
    chain_rounds = ledger.recorded_rounds(run_id)
    manifests = lineage(cluster.run_dir.store, cluster.run_dir.head())
    for recorded, (cid, manifest) in zip(chain_rounds, manifests[1:], strict=True):
        assert recorded.manifest_digest == cid.digest
        assert recorded.checkpoint == CID.parse(manifest.params).digest
        assert len(recorded.reports) == 2  # both participants signed
    total = {}
    for recorded in chain_rounds:
        for signed in recorded.reports:
            total[signed.report.worker] = total.get(signed.report.worker, 0) + signed.report.tokens
    for worker, tokens in total.items():
        assert ledger.contribution_of(run_id, worker).tokens == tokens
    assert not list((cluster.run_dir.path / "outbox").glob("*.json"))

    # The full audit, replaying every contribution, in a fresh process: the dense run's under torch's
    # generic kernels, the compressed run's under this machine's best (every capability and thread
    # count on one run is test_progress.py's replay matrix).
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if not compressed:
        env["ATEN_CPU_CAPABILITY"] = "default"
    done = subprocess.run([sys.executable, "-m", "cli.main", "audit", "--run", str(cluster.run_dir.path),
                           "--rpc", chain.rpc_url, "--allow-dev", "--replay", "4", "--replay-seed", "5"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "AUDIT PASSED" in done.stdout, (done.stdout[-3000:], done.stderr[-2000:])
    assert f"replayed {4 * config.inner.steps} inner steps" in done.stdout and "MISMATCH" not in done.stdout, done.stdout[-3000:]


def test_unattested_and_untrusted_workers_are_refused(cluster: LocalCluster, chain: Anvil, tmp_path: Path) -> None:
    start(cluster, chain, pinned(small_config()), tmp_path)
    cluster.start_worker("plain")  # --attestation none
    assert cluster.wait_exit("plain", 60) != 0
    assert "requires attestation" in cluster.log("plain")

    # Dev evidence from a root the coordinator does not trust.
    cluster.start_worker("stranger", extra=["--attestation", "dev", "--dev-root-dir", str(tmp_path / "other-root")])
    assert cluster.wait_exit("stranger", 60) != 0
    assert "evidence refused" in cluster.log("stranger")


def test_updates_and_reports_need_the_admitted_key(cluster: LocalCluster, chain: Anvil, tmp_path: Path) -> None:
    config = pinned(small_config(rounds=RoundConfig(rounds=1, expected_workers=1, quorum=1)))
    start(cluster, chain, config, tmp_path)
    stub = cluster.stub()
    challenge = stub.Challenge(pb.ChallengeRequest(protocol_version=PROTOCOL_VERSION, worker_id="m"), timeout=10)
    assert challenge.attestation_required
    key = WorkerKey.generate()
    provider = DevProvider(DevRoot.load_or_create(cluster.run_dir.path / "dev-root"))
    evidence = attest(provider, key, challenge.run_digest, challenge.nonce, code_measurement(challenge.config_cid))

    # A replayed nonce is refused; then a proper join.
    with pytest.raises(grpc.RpcError) as stale:
        stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, worker_id="m", address=key.address,
                                 evidence=evidence.to_bytes(), nonce=b"\x00" * 32), timeout=30)
    assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "nonce" in stale.value.details()
    challenge = stub.Challenge(pb.ChallengeRequest(protocol_version=PROTOCOL_VERSION, worker_id="m"), timeout=10)
    evidence = attest(provider, key, challenge.run_digest, challenge.nonce, code_measurement(challenge.config_cid))
    joined = stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, worker_id="m", address=key.address,
                                      evidence=evidence.to_bytes(), nonce=challenge.nonce), timeout=30)

    # An update signed by some other key is refused before its payload is read.
    m = Mallory(stub, "m", RunConfig.from_json(json.loads(challenge.config_json)),
                session_metadata("m", joined.session_token))
    sha = sha256_hex(encode_params(m.default))
    forged = WorkerKey.generate().sign_digest(update_digest(challenge.run_digest, 1, 0, 1, sha))
    details = m.refused(grpc.StatusCode.UNAUTHENTICATED, signature=forged)
    assert f"not by worker 'm''s admitted key {key.address}" in details
    assert "update signature refused" in m.refused(grpc.StatusCode.UNAUTHENTICATED, signature=b"\x01" * 65)
    # The stage is signed too: the whole-model signature does not pass for a slice.
    signed = key.sign_digest(update_digest(challenge.run_digest, 1, 0, 1, sha))
    assert "not by worker" in m.refused(grpc.StatusCode.UNAUTHENTICATED, signature=signed, num_stages=2)
    m.push(signature=signed)

    cluster.wait_for(lambda s: len(s.rounds) >= 2, 60, "round 1 to close")
    # A report signed by another key, and one restating the manifest wrongly, are refused.
    manifest_cid, manifest = lineage(cluster.run_dir.store, cluster.run_dir.head())[-1]
    deployment = Deployment.load(cluster.run_dir.path / "chain" / "deployment.json")
    domain = Domain(deployment.chain_id, deployment.ledger)
    entry = manifest.participants[0]
    genesis = lineage(cluster.run_dir.store, cluster.run_dir.head())[0][1]
    corpus = load_corpus(m.config.data, m.config.seed, m.config.model.block_size)
    report = RoundReport(
        run_id=challenge.run_digest, round=1, worker=key.address, parent_checkpoint=CID.parse(genesis.params).digest,
        checkpoint=CID.parse(manifest.params).digest, manifest_digest=manifest_cid.digest,
        update_digest=CID.parse(entry.update).digest, data_digest=shard_digest(corpus.shard(0, 1)),
        train_loss_e6=entry.train_loss_e6, eval_loss_e6=manifest.eval_loss_e6, tokens=entry.tokens,
        inner_steps=entry.inner_steps, bytes_sent=entry.bytes_sent, bytes_received=entry.bytes_received,
    )

    def submit(signed: SignedReport) -> pb.SubmitReportResponse:
        return stub.SubmitReport(pb.SubmitReportRequest(worker_id="m", signed_report=canonical_json(signed.to_json())),
                                 metadata=m.session,
                                 timeout=30)

    other = WorkerKey.generate()
    with pytest.raises(grpc.RpcError) as wrong_key:
        submit(SignedReport(report, other.sign_digest(report.digest(domain))))
    assert wrong_key.value.code() == grpc.StatusCode.UNAUTHENTICATED
    lying = dataclasses.replace(report, tokens=report.tokens + 1)
    with pytest.raises(grpc.RpcError) as wrong_tokens:
        submit(SignedReport(lying, key.sign_digest(lying.digest(domain))))
    assert "tokens is" in wrong_tokens.value.details() and "the manifest says" in wrong_tokens.value.details()
    lying = dataclasses.replace(report, bytes_received=report.bytes_received + 1)
    with pytest.raises(grpc.RpcError) as wrong_download:
        submit(SignedReport(lying, key.sign_digest(lying.digest(domain))))
    assert "bytesReceived is" in wrong_download.value.details()
    # A report signing another manifest (one with other traffic, say) is refused by name.
    lying = dataclasses.replace(report, manifest_digest=bytes(32))
    with pytest.raises(grpc.RpcError) as wrong_manifest:
        submit(SignedReport(lying, key.sign_digest(lying.digest(domain))))
    assert "manifestDigest is 0x00" in wrong_manifest.value.details()
    assert submit(SignedReport(report, key.sign_digest(report.digest(domain)))).accepted
    assert cluster.wait_exit("coordinator", 120) == 0, cluster.log("coordinator", tail=100)


def test_chain_down_rounds_stay_queued_then_recorded(cluster: LocalCluster, chain: Anvil, tmp_path: Path) -> None:
    # ~1 s of training a round, so rounds 2-3 certainly finish after the chain is gone.
    config = pinned(small_config(inner=InnerConfig(steps=400, batch_size=4, lr=1e-3),
                                 rounds=RoundConfig(rounds=3, expected_workers=1, quorum=1,
                                                    heartbeat_interval_s=0.5, liveness_timeout_s=3.0)))
    _, wo_args = start(cluster, chain, config, tmp_path)
    cluster.start_worker("w0", extra=wo_args)
    cluster.wait_for(lambda s: len(s.rounds) >= 2, 60, "round 1")
    port = int(chain.rpc_url.rsplit(":", 1)[1])
    chain.stop()  # the chain dies mid-run; training goes on
    assert cluster.wait_exit("w0", 120) == 0, cluster.log("w0")
    # Status shows how far the ledger is behind while the chain is away.
    cluster.wait_for(lambda s: s.finished and s.ledger_lag_rounds >= 2, 60, "the run to finish, the ledger behind")
    deadline = time.monotonic() + 30  # the last rounds are queued once reported (or --report-timeout)
    while not list((cluster.run_dir.path / "outbox").glob("*-round.json")) and time.monotonic() < deadline:
        time.sleep(0.2)
    queued = list((cluster.run_dir.path / "outbox").glob("*-round.json"))
    assert queued, "rounds finished while the chain was down must wait in the outbox"
    deadline = time.monotonic() + 30  # the outbox says so once its retries are spent
    while "is unreachable" not in cluster.log("coordinator", tail=400) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "is unreachable" in cluster.log("coordinator", tail=400)

    with Anvil(state_file=chain.state_file, port=port) as revived:
        assert cluster.wait_exit("coordinator", 180) == 0, cluster.log("coordinator", tail=60)
        ledger, run_id = ledger_of(cluster, revived)
        assert ledger.run_of(run_id).last_round == 3
        assert not list((cluster.run_dir.path / "outbox").glob("*.json"))


def test_tdx_worker_without_configfs_tsm_says_so() -> None:
    import subprocess
    import sys

    if Path("/sys/kernel/config/tsm/report").exists():
        pytest.skip("this machine has configfs-tsm")  # the message under test is for machines without it
    done = subprocess.run([sys.executable, "-m", "cli.main", "worker", "--coordinator", "127.0.0.1:1",
                           "--worker-id", "w", "--attestation", "tdx"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "configfs-tsm is missing at /sys/kernel/config/tsm/report" in done.stderr
