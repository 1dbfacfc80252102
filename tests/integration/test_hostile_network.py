"""Attacks from the network on a real coordinator: each refused by code, honest rounds unharmed.

The attacker is a client written from proto/dilocox.proto alone (``Hostile``): it can reach the
coordinator's port over TLS like anyone, may join under its own id (in runs without a ledger, where
joining proves nothing), and sends what no worker would. Honest workers are real processes; the
chain is a real anvil; every channel is TLS unless a test says otherwise.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attestation import DevProvider, DevRoot, WorkerKey, attest, code_measurement
from cli.cluster import LocalCluster
from proto import CHANNEL_OPTIONS, PROTOCOL_VERSION, SERVICE_NAME, Encoding, WorkerPhase, pb, pb_grpc, session_metadata
from settlement import Anvil
from storage_client import lineage
from tests.conftest import shared_path, small_config
from tests.integration.test_trust import ledger_of, pinned, start
from trainer.config import InnerConfig, RoundConfig
from trainer.net.tls import ClientTls, open_channel

pytestmark = pytest.mark.integration

UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def code_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    """The status code and details of a call expected to fail."""
    try:
        result = call()
        if isinstance(result, Iterator):
            list(result)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


class Hostile:
    """A client that knows only the .proto: it speaks every RPC, with or without a session."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.channel = cluster.channel()
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.session: tuple = ()

    def join(self, worker_id: str) -> pb.JoinResponse:
        joined = self.stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, worker_id=worker_id), timeout=10)
        self.session = session_metadata(worker_id, joined.session_token)
        return joined

    def fetch(self, worker_id: str, metadata: tuple = (), min_round: int = 0, wait_s: float = 0.0):
        return self.stub.FetchGlobal(pb.FetchGlobalRequest(worker_id=worker_id, min_round=min_round, wait_s=wait_s),
                                     timeout=10, metadata=metadata)

    def push(self, worker_id: str, metadata: tuple = (), **header: object) -> pb.PushUpdateResponse:
        fields = dict(protocol_version=PROTOCOL_VERSION, run_id="test", round=1, worker_id=worker_id,
                      encoding=Encoding.DENSE_F32, payload_size=4, payload_sha256="0" * 64, train_loss=1.0, inner_steps=1,
                      num_stages=1)
        fields.update(header)
        return self.stub.PushUpdate(iter([pb.UpdateChunk(header=pb.UpdateHeader(**fields))]), timeout=10,
                                    metadata=metadata)

    def heartbeat(self, worker_id: str, phase: WorkerPhase = WorkerPhase.ABANDONED, metadata: tuple = ()) -> pb.HeartbeatResponse:
        return self.stub.Heartbeat(pb.HeartbeatRequest(worker_id=worker_id, round=1, phase=phase), timeout=10,
                                   metadata=metadata)

    def report(self, worker_id: str, body: bytes, metadata: tuple = ()) -> pb.SubmitReportResponse:
        return self.stub.SubmitReport(pb.SubmitReportRequest(worker_id=worker_id, signed_report=body), timeout=10,
                                      metadata=metadata)

    def responsive_within(self, seconds: float) -> float:
        """Time health Check and Status take together; fails the test beyond ``seconds``."""
        started = time.monotonic()
        for service in ("", SERVICE_NAME):
            reply = self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=seconds)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        self.stub.Status(pb.StatusRequest(), timeout=seconds)
        took = time.monotonic() - started
        assert took < seconds, f"health and Status took {took:.2f}s"
        return took

    def close(self) -> None:
        self.channel.close()


def test_spoofed_calls_change_nothing_and_the_ledger_records_every_round(
        cluster: LocalCluster, chain: Anvil, tmp_path: Path) -> None:
    """Fetch, push, heartbeat, report and challenge in an honest worker's name, all while it trains."""
    config = pinned(small_config(
        inner=InnerConfig(steps=300, batch_size=4, lr=1e-3),
        rounds=RoundConfig(rounds=3, expected_workers=2, quorum=2, straggler_timeout_s=60.0,
                           heartbeat_interval_s=0.5, liveness_timeout_s=5.0)))
    _, wo_args = start(cluster, chain, config, tmp_path)
    eve = Hostile(cluster)
    # Evidence and reports nested past any sane depth are malformed, not a crash.
    challenge = eve.stub.Challenge(pb.ChallengeRequest(protocol_version=PROTOCOL_VERSION, worker_id="eve"), timeout=10)
    key = WorkerKey.generate()
    code, details = code_of(lambda: eve.stub.Join(pb.JoinRequest(
        protocol_version=PROTOCOL_VERSION, worker_id="eve", address=key.address, evidence=nested(50_000),
        nonce=challenge.nonce), timeout=10))
    assert code == INVALID and "nests deeper" in details, details
    # Eve is a worker of her own, admitted on dev evidence: her session is hers, not w0's.
    provider = DevProvider(DevRoot.load_or_create(cluster.run_dir.path / "dev-root"))
    challenge = eve.stub.Challenge(pb.ChallengeRequest(protocol_version=PROTOCOL_VERSION, worker_id="eve"), timeout=10)
    evidence = attest(provider, key, challenge.run_digest, challenge.nonce, code_measurement(challenge.config_cid))
    joined = eve.stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, worker_id="eve", address=key.address,
                                          evidence=evidence.to_bytes(), nonce=challenge.nonce), timeout=30)
    eve.session = session_metadata("eve", joined.session_token)
    code, details = code_of(lambda: eve.report("eve", nested(5_000), eve.session))
    assert code == INVALID and "nests deeper" in details, details

    cluster.start_worker("w0", extra=wo_args)
    cluster.start_worker("w1", extra=wo_args)

    codes: dict[str, set[grpc.StatusCode]] = {}
    stop = threading.Event()

    def spoof() -> None:
        forged = session_metadata("w0", b"\x00" * 32)
        while not stop.is_set():
            for what, call in (
                ("fetch", lambda: eve.fetch("w0")),
                ("fetch-forged", lambda: eve.fetch("w0", forged)),
                ("push", lambda: eve.push("w0")),
                ("push-forged", lambda: eve.push("w0", forged)),
                ("heartbeat", lambda: eve.heartbeat("w0")),
                ("heartbeat-forged", lambda: eve.heartbeat("w0", WorkerPhase.DONE, forged)),
                ("report", lambda: eve.report("w0", b"{}")),
                ("fetch-as-eve", lambda: eve.fetch("w0", eve.session)),
                ("push-as-eve", lambda: eve.push("w0", eve.session)),
                ("heartbeat-as-eve", lambda: eve.heartbeat("w0", WorkerPhase.DONE, eve.session)),
                ("report-as-eve", lambda: eve.report("w0", b"{}", eve.session)),
                ("challenge", lambda: eve.stub.Challenge(pb.ChallengeRequest(
                    protocol_version=PROTOCOL_VERSION, worker_id="w0"), timeout=10)),
            ):
                codes.setdefault(what, set()).add(code_of(call)[0])
            stop.wait(0.05)

    spoofer = threading.Thread(target=spoof, daemon=True)
    spoofer.start()
    try:
        for name in ("w0", "w1", "coordinator"):
            assert cluster.wait_exit(name, 240) == 0, cluster.log(name)
    finally:
        stop.set()
        spoofer.join(timeout=30)
        eve.close()

    for what in ("fetch", "fetch-forged", "push", "push-forged", "heartbeat", "heartbeat-forged", "report",
                 "fetch-as-eve", "push-as-eve", "heartbeat-as-eve", "report-as-eve"):
        # UNAVAILABLE / CANCELLED: the call was in flight when the finished coordinator shut down.
        assert codes[what] <= {UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}, (what, codes[what])
        assert UNAUTHENTICATED in codes[what], what
    # Challenges for w0's id are answered (or rate-limited) and never disturb w0's own join.
    assert codes["challenge"] <= {grpc.StatusCode.OK, EXHAUSTED, grpc.StatusCode.UNAVAILABLE}

    # Nothing was filed against the honest workers, and every round is on the ledger with both reports.
    manifests = lineage(cluster.run_dir.store, cluster.run_dir.head())
    assert [len(m.participants) for _, m in manifests] == [0, 2, 2, 2]
    assert all(set(m.dropped) <= {"eve"} for _, m in manifests)  # eve joined and never trained
    assert all(not s["refused"] for s in cluster.run_dir.logged_rounds())
    ledger, run_id = ledger_of(cluster, chain)
    assert ledger.run_of(run_id).last_round == 3
    assert [len(r.reports) for r in ledger.recorded_rounds(run_id)] == [2, 2, 2]
    assert "Traceback" not in cluster.log("coordinator", tail=100_000)


IDLE_S = 8  # the flood test's --idle-timeout: longer than its 80 calls take to arrive on a busy machine


def test_floods_are_bounded_and_health_answers_within_a_second(cluster: LocalCluster, make_config) -> None:
    """Forty stalled pushes, forty long-polls, forty 100 kB ids and a 2.5 MB run id, while w0 trains."""
    cluster.start_coordinator(make_config(
        inner=InnerConfig(steps=60, batch_size=4, lr=1e-3),
        rounds=RoundConfig(rounds=100_000, expected_workers=1, quorum=1, straggler_timeout_s=60.0,
                           heartbeat_interval_s=0.5, liveness_timeout_s=5.0)),
        extra=["--idle-timeout", str(IDLE_S)])
    mallory = Hostile(cluster)
    mallory.join("mallory")
    cluster.start_worker("w0")
    before = len(cluster.wait_for(lambda s: len(s.rounds) >= 2, 60, "w0's first round").rounds)

    release = threading.Event()
    outcomes: list[grpc.StatusCode] = []
    lock = threading.Lock()

    def stalled_push() -> None:
        def messages() -> Iterator[pb.UpdateChunk]:
            release.wait(60)  # the stream opens, and not a byte follows
            yield pb.UpdateChunk(data=b"late")
        code, _ = code_of(lambda: mallory.stub.PushUpdate(messages(), timeout=60, metadata=mallory.session))
        with lock:
            outcomes.append(code)

    def long_poll() -> None:
        code, _ = code_of(lambda: mallory.fetch("mallory", mallory.session, min_round=99, wait_s=IDLE_S + 2))
        with lock:
            outcomes.append(code)

    threads = [threading.Thread(target=f, daemon=True) for f in [stalled_push] * 40 + [long_poll] * 40]
    for t in threads:
        t.start()
    # Every call beyond the id's budget is refused at once; the budget's own calls are held until the
    # idle timeout (pushes) or their wait (long-polls). HTTP/2 lets one connection open 32 streams at
    # a time, so on a busy machine the 80 calls arrive over seconds: count once the refusals are in,
    # which is before any held call can end and free its place.
    deadline = time.monotonic() + IDLE_S - 1
    while len(outcomes) < 80 - 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    with lock:
        refused_at_once = Counter(outcomes)
    # Refused by the id's budget, or (a stream the client opened before it heard the connection's
    # 32-stream limit) by HTTP/2 itself: either way, nothing beyond the budget was held.
    refused = refused_at_once[EXHAUSTED] + refused_at_once[grpc.StatusCode.UNAVAILABLE]
    assert refused == 80 - 6 == sum(refused_at_once.values()), refused_at_once
    worst = max(mallory.responsive_within(1.0) for _ in range(5))

    # Calls that name no session, and fields of absurd size, are refused at once.
    started = time.monotonic()
    for _ in range(40):
        assert code_of(lambda: mallory.push("w0"))[0] == UNAUTHENTICATED
        code, details = code_of(lambda: mallory.stub.Challenge(pb.ChallengeRequest(
            protocol_version=PROTOCOL_VERSION, worker_id="x" * 100_000), timeout=10))
        assert code in (INVALID, EXHAUSTED) and len(details) < 300, (code, len(details))
    assert time.monotonic() - started < 20
    worst = max(worst, mallory.responsive_within(1.0))

    # The stalled pushes end when their header is late (the idle timeout); the long-polls when their
    # wait does.
    while len(outcomes) < 80 - 4 and time.monotonic() < deadline + 10:
        worst = max(worst, mallory.responsive_within(1.0))
        time.sleep(0.5)
    release.set()
    for t in threads:
        t.join(timeout=90)
    assert len(outcomes) == 80
    held = [code for code in outcomes if code not in (EXHAUSTED, grpc.StatusCode.UNAVAILABLE)]
    assert len(held) == 6, Counter(outcomes)  # 2 pushes and 4 fetches at most per worker id
    assert grpc.StatusCode.DEADLINE_EXCEEDED in outcomes or grpc.StatusCode.OK in outcomes, Counter(outcomes)
    # With her streams free again, a 2.5 MB run id is refused by its length, quoted by its name only.
    code, details = code_of(lambda: mallory.push("mallory", mallory.session, run_id="r" * 2_500_000))
    assert code == INVALID and "run_id" in details and len(details) < 300, (code, details[:300])

    # w0's rounds kept completing through every flood, with nothing filed against it.
    status = cluster.status()
    assert len(status.rounds) > before + 3, (before, len(status.rounds))
    assert all(list(r.participants) == ["w0"] for r in status.rounds[1:])
    assert status.ByteSize() < 256_000
    log = cluster.log("coordinator", tail=100_000)
    assert "Traceback" not in log
    assert f"did not arrive within {IDLE_S}s" in log  # the arrival deadline named what it ended
    print(f"health+Status under flood: worst {worst * 1000:.0f} ms")


def test_undecodable_messages_cost_a_log_line_each_at_most(cluster: LocalCluster, make_config) -> None:
    cluster.start_coordinator(make_config())
    with cluster.channel() as channel:
        for method in ("Challenge", "Join", "Heartbeat", "SubmitReport"):
            call = channel.unary_unary(f"/{SERVICE_NAME}/{method}", request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
            for garbage in (b"\xff" * 64, b"\x0a\xff\xff\xff\xff\x0f", bytes(range(256)) * 8):
                code, details = code_of(lambda: call(garbage, timeout=10))
                assert code in (INVALID, UNAUTHENTICATED, EXHAUSTED), (method, code, details)
        hostile = Hostile(cluster)
        for _ in range(200):
            code, _ = code_of(lambda: hostile.stub.Challenge(pb.ChallengeRequest(
                protocol_version=PROTOCOL_VERSION, worker_id="bad id!"), timeout=10))
            assert code in (INVALID, EXHAUSTED)
        hostile.responsive_within(1.0)
        hostile.close()
    log = cluster.log("coordinator", tail=100_000)
    assert "Traceback" not in log
    refusals = len(re.findall(r"refused", log))
    assert refusals <= 40, f"{refusals} log lines for 212 bad messages"


def test_a_malformed_health_check_and_a_flood_of_refused_pushes_cost_a_budgeted_few_lines(
        cluster: LocalCluster, make_config) -> None:
    """A Health/Check whose service name is not UTF-8 is INVALID_ARGUMENT, never INTERNAL with a
    traceback; 1,000 refused pushes from a joined worker cost its log budget (trainer.net.limits.LogBudget),
    not a line each, and health still answers."""
    cluster.start_coordinator(make_config())
    log_file = cluster.run_dir.logs / "coordinator.log"
    hostile = Hostile(cluster)
    check = hostile.channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda b: b,
                                        response_deserializer=lambda b: b)
    not_utf8 = b"\x0a\x02\xff\xfe"  # field 1 (service), wire type 2 (bytes), 2 bytes that are not UTF-8
    for _ in range(20):
        code, details = code_of(lambda: check(not_utf8, timeout=10))
        assert code == INVALID, (code, details)
    watch = hostile.channel.unary_stream("/grpc.health.v1.Health/Watch", request_serializer=lambda b: b,
                                         response_deserializer=lambda b: b)
    for request in (b"", not_utf8):  # Watch would hold a thread per caller: not served, whatever is sent
        assert code_of(lambda: watch(request, timeout=10))[0] == grpc.StatusCode.UNIMPLEMENTED
    hostile.responsive_within(1.0)

    hostile.join("mallory")
    before = log_file.stat().st_size
    for _ in range(1000):
        code, details = code_of(lambda: hostile.push("mallory", hostile.session, run_id="not-this-run"))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "not-this-run" in details, (code, details)
    hostile.responsive_within(1.0)
    hostile.close()
    grown = log_file.stat().st_size - before
    log = cluster.log("coordinator", tail=100_000)
    assert "Traceback" not in log and "Exception deserializing" not in log
    assert len(re.findall(r"Health/Check from .* refused", log)) <= 10
    assert len([line for line in log.splitlines() if "not-this-run" in line]) <= 10
    assert grown < 4096, f"1,000 refused pushes logged {grown} bytes"
    print(f"1,000 refused pushes from a joined worker: {grown} bytes of coordinator log")


def test_plaintext_and_wrong_pins_are_refused(cluster: LocalCluster, make_config) -> None:
    cluster.start_coordinator(make_config())
    plain = grpc.insecure_channel(cluster.address, options=CHANNEL_OPTIONS)
    code, _ = code_of(lambda: pb_grpc.CoordinatorStub(plain).Status(pb.StatusRequest(), timeout=5))
    assert code == grpc.StatusCode.UNAVAILABLE
    plain.close()
    from trainer.net.tls import TlsError

    with pytest.raises(TlsError, match="but the pin is"):
        open_channel(cluster.address, ClientTls(fingerprint="ab" * 32), CHANNEL_OPTIONS)
    # A worker given the wrong pin exits at once with one line; one given the right pin trains.
    process = cluster._spawn("wrong-pin", ["worker", "--coordinator", cluster.address, "--worker-id", "w9",
                                           "--tls-fingerprint", "ab" * 32])
    assert process.wait(timeout=60) == 1
    assert "but the pin is" in cluster.log("wrong-pin")
    assert "Traceback" not in cluster.log("wrong-pin")
    # dilocox status verifies the coordinator like a worker does, and says how when not told.
    import subprocess
    import sys

    status = subprocess.run([sys.executable, "-m", "cli.main", "status", "--coordinator", cluster.address,
                             *cluster.tls_args(), "--json"], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)  # proto field names, every field, integers as numbers
    assert doc["run_id"] == "test" and isinstance(doc["open_round"], int) and doc["ledger_lag_rounds"] == 0
    assert isinstance(doc["total_rounds"], int) and doc["finished"] in (True, False) and "workers" in doc
    untold = subprocess.run([sys.executable, "-m", "cli.main", "status", "--coordinator", cluster.address],
                            capture_output=True, text=True, timeout=60)
    assert untold.returncode == 1 and "--tls-fingerprint" in untold.stderr and "Traceback" not in untold.stderr


def test_one_coordinator_per_run_directory_and_port(cluster: LocalCluster, make_config, tmp_path: Path) -> None:
    cluster.start_coordinator(make_config())
    second = cluster._spawn("second", ["coordinator", "--run-dir", str(cluster.run_dir.path), "--port", "0"])
    assert second.wait(timeout=60) == 1
    assert "another coordinator is serving" in cluster.log("second")
    port = cluster.address.rsplit(":", 1)[1]
    other = LocalCluster(tmp_path / "other")
    config = tmp_path / "config.json"
    try:
        same_port = other._spawn("same-port", ["coordinator", "--run-dir", str(other.run_dir.path), "--config",
                                               str(config), "--host", "127.0.0.1", "--port", port])
        assert same_port.wait(timeout=60) == 1
        assert f"cannot listen on 127.0.0.1:{port}" in other.log("same-port")
    finally:
        other.stop()
    status = cluster.status()  # the first is untouched
    assert status.run_id == "test"


INSIDE_COLLATERAL_WINDOW = 1750809600  # 2025-06-25: the sample collateral was issued 06-19, next update 07-19


def test_tdx_join_forged_quote_refused_genuine_quote_verified(cluster: LocalCluster, chain: Anvil, tmp_path: Path) -> None:
    from attestation import Evidence, measurement_of, parse_quote, report_data
    from cli.cluster import provision
    from settlement import DEV_ACCOUNTS, Chain, Deployment, Registry

    genuine = shared_path("attestation/dcap-qvl/tdx_quote").read_bytes()
    collateral = shared_path("attestation/dcap-qvl/tdx_quote_collateral.json")
    config = pinned(small_config())
    path = tmp_path / "config.json"
    config.save(path)
    co_args, _ = provision(cluster.run_dir.path, chain.rpc_url, config)
    # The quote's measurement is on the allowlist, as it was in the attack.
    deployment = Deployment.load(cluster.run_dir.path / "chain" / "deployment.json")
    Registry(Chain(chain.rpc_url, DEV_ACCOUNTS[0]), deployment.registry).set_measurement(
        measurement_of(parse_quote(genuine)))
    cluster.start_coordinator(path, extra=[*co_args, "--dcap-collateral", str(collateral),
                                           "--attestation-time", str(INSIDE_COLLATERAL_WINDOW)])
    eve = Hostile(cluster)
    key = WorkerKey.generate()

    def join(forge: bool) -> tuple[grpc.StatusCode, str]:
        challenge = eve.stub.Challenge(pb.ChallengeRequest(protocol_version=PROTOCOL_VERSION, worker_id="eve"),
                                       timeout=10)
        binding = report_data(key.address, challenge.run_digest, challenge.nonce, code_measurement(challenge.config_cid))
        quote = genuine[:568] + binding + genuine[632:] if forge else genuine  # v4: REPORTDATA at 568
        evidence = Evidence(provider="tdx", quote=quote).to_bytes()
        return code_of(lambda: eve.stub.Join(pb.JoinRequest(
            protocol_version=PROTOCOL_VERSION, worker_id="eve", address=key.address, evidence=evidence,
            nonce=challenge.nonce), timeout=60))

    # REPORTDATA rewritten to bind eve's key: the quote's signature no longer verifies.
    code, details = join(forge=True)
    assert code == grpc.StatusCode.PERMISSION_DENIED and "(dcap)" in details and "signature" in details, details
    # The genuine quote passes DCAP inside its collateral window, and is refused because its
    # REPORTDATA binds someone else's key, run and nonce, not eve's.
    code, details = join(forge=False)
    assert code == grpc.StatusCode.PERMISSION_DENIED and "(report_data)" in details, details
    assert len(details) < 400
    status = cluster.status()
    assert not status.workers  # nobody was admitted
    eve.close()


def test_mutual_tls_refuses_workers_without_a_client_certificate(cluster: LocalCluster, make_config,
                                                                tmp_path: Path) -> None:
    from trainer.net.tls import generate_self_signed

    cert, key = generate_self_signed(common_name="site-a worker")
    (tmp_path / "worker.pem").write_bytes(cert)
    (tmp_path / "worker.key").write_bytes(key)
    (tmp_path / "worker.key").chmod(0o600)
    other_cert, other_key = generate_self_signed(common_name="stranger")
    (tmp_path / "other.pem").write_bytes(other_cert)
    (tmp_path / "other.key").write_bytes(other_key)
    cluster.start_coordinator(make_config(rounds=RoundConfig(rounds=1, expected_workers=1, quorum=1)),
                              extra=["--tls-client-ca", str(tmp_path / "worker.pem")])
    fingerprint = cluster.client_tls.fingerprint
    for client in (ClientTls(fingerprint=fingerprint),
                   ClientTls(fingerprint=fingerprint, client_cert_file=tmp_path / "other.pem",
                             client_key_file=tmp_path / "other.key")):
        with open_channel(cluster.address, client, CHANNEL_OPTIONS) as channel:
            code, _ = code_of(lambda: pb_grpc.CoordinatorStub(channel).Status(pb.StatusRequest(), timeout=5))
            assert code == grpc.StatusCode.UNAVAILABLE
    cluster.start_worker("w0", extra=["--tls-client-cert", str(tmp_path / "worker.pem"),
                                      "--tls-client-key", str(tmp_path / "worker.key")])
    assert cluster.wait_exit("w0", 120) == 0, cluster.log("w0")
    assert cluster.wait_exit("coordinator", 60) == 0, cluster.log("coordinator")
