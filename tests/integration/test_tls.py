"""TLS between coordinator and clients: real gRPC servers on 127.0.0.1 serving the health service."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import socket
import ssl
import stat
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from trainer.net.tls import (
    ClientTls,
    ServerIdentity,
    TlsError,
    TlsUnreachable,
    client_tls_from_flags,
    ensure_self_signed,
    fetch_server_certificate,
    fingerprint,
    load_identity,
    open_channel,
    parse_fingerprint,
    server_credentials,
    server_identity,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

RPC_TIMEOUT_S = 5.0


class CountingHealth(health.HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def Check(self, request, context):  # noqa: N802 - gRPC method name
        self.calls += 1
        return super().Check(request, context)


@contextlib.contextmanager
def serving(identity: ServerIdentity | None, client_ca: Path | None = None) -> Iterator[tuple[int, CountingHealth]]:
    """A health server on 127.0.0.1: TLS with ``identity`` (mTLS with ``client_ca``), or plaintext."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = CountingHealth()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if identity is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", server_credentials(identity, client_ca))
    assert port != 0
    server.start()
    try:
        yield port, servicer
    finally:
        server.stop(0).wait(5)


def check(address: str, tls: ClientTls, options: list[tuple[str, object]] | None = None) -> int:
    with open_channel(address, tls, options or []) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S)
    return reply.status


def check_fails(address: str, tls: ClientTls) -> grpc.StatusCode:
    """The status code of a failing Check, asserting it failed well within the RPC timeout."""
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        check(address, tls)
    assert time.monotonic() - start < RPC_TIMEOUT_S / 2
    return info.value.code()


SERVING = health_pb2.HealthCheckResponse.SERVING


# ---------------------------------------------------------------- certificates made by the tests

def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_cert(common_name: str, issuer: tuple[ec.EllipticCurvePrivateKey, x509.Certificate] | None = None,
              ca: bool = False, dns: tuple[str, ...] = (),
              usage: x509.ObjectIdentifier = ExtendedKeyUsageOID.SERVER_AUTH):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    signer, issuer_cert = issuer if issuer else (key, None)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name)
               .issuer_name(issuer_cert.subject if issuer_cert else name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if dns:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(d) for d in dns]), critical=False)
    if not ca:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return key, builder.sign(signer, hashes.SHA256())


def write_pair(folder: Path, name: str, key, cert) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    cert_path.write_bytes(_pem(cert))
    key_path.write_bytes(_key_pem(key))
    key_path.chmod(0o600)
    return cert_path, key_path


@pytest.fixture
def identity(tmp_path: Path) -> ServerIdentity:
    return server_identity(tmp_path / "run" / "tls")


# ---------------------------------------------------------------- server identity

def test_self_signed_identity_is_created_once_and_reused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "run" / "tls"
    with caplog.at_level(logging.DEBUG, logger="dilocox.tls"):
        first = server_identity(folder, hosts=["coordinator.example", "10.1.2.3", "0.0.0.0"])
        second = server_identity(folder, hosts=["coordinator.example"])
    assert first.fingerprint == second.fingerprint and first.cert_pem == second.cert_pem
    assert first.key_pem == second.key_pem
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "cert.pem", "key.pem"]  # no temp files left
    assert stat.S_IMODE((folder / "key.pem").stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) & 0o077 == 0

    cert = x509.load_pem_x509_certificate(first.cert_pem)
    der = cert.public_bytes(serialization.Encoding.DER)
    assert first.fingerprint == hashlib.sha256(der).hexdigest() == fingerprint(der) == fingerprint(first.cert_pem)
    assert len(first.fingerprint) == 64 and first.fingerprint == first.fingerprint.lower()
    key = serialization.load_pem_private_key(first.key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"localhost", "coordinator.example"}
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1", "10.1.2.3"}
    now = datetime.datetime.now(datetime.timezone.utc)
    assert cert.not_valid_before_utc < now - datetime.timedelta(minutes=5)
    assert cert.not_valid_after_utc > now + datetime.timedelta(days=9 * 365)

    # The fingerprint is logged; the key never is, nor is it in the identity's repr.
    key_body = b"".join(first.key_pem.splitlines()[1:-1]).decode()
    assert first.fingerprint in caplog.text
    assert key_body[:40] not in caplog.text and key_body[:40] not in repr(first)
    assert "key_pem" not in repr(first)


def test_concurrent_first_starts_make_one_identity(tmp_path: Path) -> None:
    folder = tmp_path / "tls"
    barrier = threading.Barrier(8)
    made: list[str] = []
    errors: list[BaseException] = []

    def start() -> None:
        barrier.wait()
        try:
            made.append(ensure_self_signed(folder).fingerprint)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert not errors and len(made) == 8 and len(set(made)) == 1
    assert load_identity(folder / "cert.pem", folder / "key.pem").fingerprint == made[0]


def test_certificate_without_its_key_is_not_silently_replaced(tmp_path: Path) -> None:
    folder = tmp_path / "tls"
    made = ensure_self_signed(folder)
    (folder / "key.pem").unlink()
    with pytest.raises(TlsError, match="without its key"):
        ensure_self_signed(folder)
    assert (folder / "cert.pem").read_bytes() == made.cert_pem


def test_given_certificate_and_key_must_match(tmp_path: Path) -> None:
    a = ensure_self_signed(tmp_path / "a")
    b = ensure_self_signed(tmp_path / "b")
    assert load_identity(a.cert_path, a.key_path).fingerprint == a.fingerprint
    assert server_identity(tmp_path / "unused", a.cert_path, a.key_path).fingerprint == a.fingerprint
    assert not (tmp_path / "unused").exists()
    with pytest.raises(TlsError, match="not the private key"):
        load_identity(a.cert_path, b.key_path)
    with pytest.raises(TlsError, match="both"):
        server_identity(tmp_path / "unused", cert_file=a.cert_path)
    with pytest.raises(TlsError, match="no valid PEM certificate|no PEM certificate"):
        load_identity(a.key_path, a.key_path)


# ---------------------------------------------------------------- clients that trust the server

@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_ca_file_and_pin_both_connect(identity: ServerIdentity, host: str) -> None:
    with serving(identity) as (port, servicer):
        address = f"{host}:{port}"
        assert check(address, ClientTls(ca_file=identity.cert_path)) == SERVING
        assert check(address, ClientTls(fingerprint=identity.fingerprint)) == SERVING
        colons = "SHA256:" + ":".join(identity.fingerprint[i:i + 2] for i in range(0, 64, 2)).upper()
        assert check(address, ClientTls(fingerprint=colons)) == SERVING
        assert servicer.calls == 3


def test_fetch_returns_exactly_the_served_certificate(identity: ServerIdentity) -> None:
    with serving(identity) as (port, _):
        pem = fetch_server_certificate(f"127.0.0.1:{port}", timeout_s=2.0)
    assert fingerprint(pem) == identity.fingerprint


def test_wrong_pin_is_refused_before_any_rpc(identity: ServerIdentity, tmp_path: Path) -> None:
    other = ensure_self_signed(tmp_path / "other")
    with serving(identity) as (port, servicer):
        with pytest.raises(TlsError) as info:
            open_channel(f"127.0.0.1:{port}", ClientTls(fingerprint=other.fingerprint))
        assert servicer.calls == 0
    message = str(info.value)
    assert identity.fingerprint in message and other.fingerprint in message and "\n" not in message


def test_certificate_of_another_identity_as_ca_fails(identity: ServerIdentity, tmp_path: Path) -> None:
    other = ensure_self_signed(tmp_path / "other")
    with serving(identity) as (port, servicer):
        assert check_fails(f"127.0.0.1:{port}", ClientTls(ca_file=other.cert_path)) == grpc.StatusCode.UNAVAILABLE
        assert servicer.calls == 0


def test_plaintext_client_fails_against_tls_server(identity: ServerIdentity,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    with serving(identity) as (port, servicer), caplog.at_level(logging.WARNING, logger="dilocox.tls"):
        assert check_fails(f"127.0.0.1:{port}", ClientTls(insecure=True)) == grpc.StatusCode.UNAVAILABLE
        assert servicer.calls == 0
    assert any("INSECURE" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_tls_client_fails_against_plaintext_server(identity: ServerIdentity) -> None:
    with serving(None) as (port, servicer):
        address = f"127.0.0.1:{port}"
        assert check(address, ClientTls(insecure=True)) == SERVING  # the server itself works
        assert check_fails(address, ClientTls(ca_file=identity.cert_path)) == grpc.StatusCode.UNAVAILABLE
        start = time.monotonic()
        with pytest.raises(TlsError, match="handshake") as info:
            open_channel(address, ClientTls(fingerprint=identity.fingerprint), fetch_timeout_s=2.0)
        assert time.monotonic() - start < 2.0
        assert not isinstance(info.value, TlsUnreachable)  # something answered, just not TLS: do not retry
        assert servicer.calls == 1


def test_pin_against_nothing_listening_is_unreachable(identity: ServerIdentity) -> None:
    with serving(identity) as (port, _):
        pass  # the port is free again once its server stopped
    with pytest.raises(TlsUnreachable, match="handshake"):
        open_channel(f"127.0.0.1:{port}", ClientTls(fingerprint=identity.fingerprint), fetch_timeout_s=2.0)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections, never speaks
    try:
        start = time.monotonic()
        with pytest.raises(TlsUnreachable, match="timed out"):
            fetch_server_certificate(f"127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.3)
        assert time.monotonic() - start < 2.0
    finally:
        silent.close()


def test_pin_overrides_the_name_when_the_host_is_not_in_the_certificate(tmp_path: Path) -> None:
    ca_key, ca_cert = make_cert("test ca", ca=True)
    key, cert = make_cert("coordinator", issuer=(ca_key, ca_cert), dns=("coordinator.test",))
    cert_path, key_path = write_pair(tmp_path, "server", key, cert)
    ca_path = tmp_path / "ca.pem"
    ca_path.write_bytes(_pem(ca_cert))
    served = load_identity(cert_path, key_path)
    with serving(served) as (port, _):
        address = f"127.0.0.1:{port}"
        # A CA-verified client checks the host name, which 127.0.0.1 does not match...
        assert check_fails(address, ClientTls(ca_file=ca_path)) == grpc.StatusCode.UNAVAILABLE
        assert check(address, ClientTls(ca_file=ca_path), [("grpc.ssl_target_name_override", "coordinator.test")]) \
            == SERVING
        # ...while a pin (here of a CA-issued leaf) is about the certificate, not the name.
        assert check(address, ClientTls(fingerprint=served.fingerprint)) == SERVING


# ---------------------------------------------------------------- mutual TLS

def test_mutual_tls_requires_a_client_certificate_from_the_client_ca(identity: ServerIdentity,
                                                                     tmp_path: Path) -> None:
    ca_key, ca_cert = make_cert("worker ca", ca=True)
    ca_path = tmp_path / "worker-ca.pem"
    ca_path.write_bytes(_pem(ca_cert))
    w_key, w_cert = make_cert("worker-1", issuer=(ca_key, ca_cert), usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    w_cert_path, w_key_path = write_pair(tmp_path, "worker", w_key, w_cert)
    stranger = ensure_self_signed(tmp_path / "stranger")
    with serving(identity, client_ca=ca_path) as (port, servicer):
        address = f"127.0.0.1:{port}"
        assert check_fails(address, ClientTls(ca_file=identity.cert_path)) == grpc.StatusCode.UNAVAILABLE
        assert check_fails(address, ClientTls(fingerprint=identity.fingerprint)) == grpc.StatusCode.UNAVAILABLE
        assert check_fails(address, ClientTls(ca_file=identity.cert_path, client_cert_file=stranger.cert_path,
                                              client_key_file=stranger.key_path)) == grpc.StatusCode.UNAVAILABLE
        assert servicer.calls == 0
        assert check(address, ClientTls(ca_file=identity.cert_path, client_cert_file=w_cert_path,
                                        client_key_file=w_key_path)) == SERVING
        assert check(address, ClientTls(fingerprint=identity.fingerprint, client_cert_file=w_cert_path,
                                        client_key_file=w_key_path)) == SERVING
        assert servicer.calls == 2


def test_mutual_tls_with_a_self_signed_client_certificate_as_the_client_ca(identity: ServerIdentity,
                                                                           tmp_path: Path) -> None:
    worker = ensure_self_signed(tmp_path / "worker-tls")  # the same generator makes client identities
    with serving(identity, client_ca=worker.cert_path) as (port, _):
        address = f"localhost:{port}"
        assert check_fails(address, ClientTls(ca_file=identity.cert_path)) == grpc.StatusCode.UNAVAILABLE
        assert check(address, ClientTls(ca_file=identity.cert_path, client_cert_file=worker.cert_path,
                                        client_key_file=worker.key_path)) == SERVING


@contextlib.contextmanager
def tls12_server(identity: ServerIdentity, client_ca: Path) -> Iterator[tuple[int, list[object]]]:
    """A bare Python TLS 1.2 server that requires a client certificate and records, per handshake,
    the ALPN protocol it agreed, or the error."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(identity.cert_path, identity.key_path)
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(client_ca)
    context.set_alpn_protocols(["h2"])
    seen: list[object] = []
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(2)
            try:
                with context.wrap_socket(conn, server_side=True) as tls_conn:
                    seen.append(tls_conn.selected_alpn_protocol())
            except (OSError, ssl.SSLError) as exc:
                seen.append(exc)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], seen
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_fetch_offers_h2_and_presents_the_client_certificate_to_tls12_servers(identity: ServerIdentity,
                                                                              tmp_path: Path) -> None:
    worker = ensure_self_signed(tmp_path / "worker-tls")
    with tls12_server(identity, worker.cert_path) as (port, seen):
        address = f"127.0.0.1:{port}"
        with pytest.raises(TlsError, match="handshake"):  # TLS 1.2 refuses during the handshake
            fetch_server_certificate(address, timeout_s=2.0)
        pem = fetch_server_certificate(address, timeout_s=2.0, client_pair=(worker.key_pem, worker.cert_pem))
        deadline = time.monotonic() + 2
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert fingerprint(pem) == identity.fingerprint
    assert isinstance(seen[0], ssl.SSLError) and seen[1] == "h2"


def test_unusable_ca_file_is_refused_before_connecting(identity: ServerIdentity, tmp_path: Path) -> None:
    with pytest.raises(TlsError, match="cannot read"):
        open_channel("127.0.0.1:1", ClientTls(ca_file=tmp_path / "missing.pem"))
    with pytest.raises(TlsError, match="no valid PEM certificate|no PEM certificate"):
        open_channel("127.0.0.1:1", ClientTls(ca_file=identity.key_path))
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    with pytest.raises(TlsError, match="no valid PEM certificate|no PEM certificate"):
        open_channel("127.0.0.1:1", ClientTls(ca_file=garbage))
    with pytest.raises(TlsError, match="no valid PEM certificate|no PEM certificate"):
        server_credentials(identity, client_ca_file=garbage)


def test_client_key_must_match_client_certificate(identity: ServerIdentity, tmp_path: Path) -> None:
    a = ensure_self_signed(tmp_path / "a")
    b = ensure_self_signed(tmp_path / "b")
    with pytest.raises(TlsError, match="not the private key"):
        open_channel("127.0.0.1:1", ClientTls(ca_file=identity.cert_path, client_cert_file=a.cert_path,
                                              client_key_file=b.key_path))


# ---------------------------------------------------------------- settings and their text

def test_pin_text_is_normalised_and_validated() -> None:
    canonical = "ab" * 32
    for text in (canonical, canonical.upper(), f"sha256:{canonical}", f"SHA256:{canonical.upper()}",
                 ":".join(["AB"] * 32), f"  sha256:{':'.join(['ab'] * 32)}\n"):
        assert parse_fingerprint(text) == canonical
    bad = ["", "sha256:", "ab" * 31, "ab" * 32 + "a", "zz" * 32, "ab:" * 31 + "abab", ":".join(["ab"] * 32) + ":",
           "a:b" + "ab" * 31, "\u0661" * 64, "sha1:" + canonical, "ab " * 32, canonical + "\x00"]
    for text in bad:
        with pytest.raises(TlsError):
            parse_fingerprint(text)
    with pytest.raises(TlsError) as info:
        parse_fingerprint("a" * 100_000)
    assert len(str(info.value)) < 200 and "\n" not in str(info.value)
    with pytest.raises(TlsError):
        ClientTls(fingerprint="not-a-pin")


def test_flags_need_exactly_one_way_to_trust(tmp_path: Path) -> None:
    pin = "CD" * 32
    ca = str(tmp_path / "ca.pem")
    assert client_tls_from_flags(ca, None, False) == ClientTls(ca_file=Path(ca))
    assert client_tls_from_flags(None, pin, False).fingerprint == "cd" * 32
    assert client_tls_from_flags(None, None, True) == ClientTls(insecure=True)
    assert client_tls_from_flags(None, pin, False, "c.pem", "c.key").client_key_file == Path("c.key")
    refused: list[tuple[tuple[Any, ...], str]] = [
        ((None, None, False), "--tls-ca FILE, --tls-fingerprint HEX, or --insecure"),
        ((ca, pin, False), "--tls-ca and --tls-fingerprint"),
        ((ca, None, True), "--tls-ca and --insecure"),
        ((None, pin, True), "--tls-fingerprint and --insecure"),
        ((ca, pin, True), "--tls-ca and --tls-fingerprint and --insecure"),
        ((ca, None, False, "c.pem", None), "--tls-client-cert and --tls-client-key"),
        ((ca, None, False, None, "c.key"), "--tls-client-cert and --tls-client-key"),
        ((None, None, True, "c.pem", "c.key"), "contradict --insecure"),
        ((None, "12345", False), "not a SHA-256"),
        (("", None, False), "--tls-ca needs a file"),
    ]
    for args, words in refused:
        with pytest.raises(TlsError) as info:
            client_tls_from_flags(*args)
        assert words in str(info.value) and "\n" not in str(info.value), (args, str(info.value))
    for kwargs in ({}, {"ca_file": Path(ca), "insecure": True}, {"fingerprint": pin, "ca_file": Path(ca)},
                   {"insecure": True, "client_cert_file": Path("c"), "client_key_file": Path("k")},
                   {"ca_file": Path(ca), "client_cert_file": Path("c")}):
        with pytest.raises(TlsError):
            ClientTls(**kwargs)


def test_pin_needs_a_host_and_port() -> None:
    for address in ("127.0.0.1", "localhost:", ":50051", "host:http", "::1:50051", "host:70000", "[host]:1", "[::1:1"):
        with pytest.raises(TlsError, match="host:port"):
            open_channel(address, ClientTls(fingerprint="ab" * 32))
