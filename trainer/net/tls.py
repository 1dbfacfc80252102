"""TLS for the coordinator's gRPC port: its identity, its credentials, and how workers trust it.

Trust model:

* The coordinator always has a certificate: one given by path (``--tls-cert``/``--tls-key``), or a
  self-signed ECDSA P-256 pair it creates in ``<run>/tls/`` on first start and reuses after. It
  logs the certificate's SHA-256 fingerprint (64 lowercase hex characters) at start-up.
* A client trusts it one of three ways, exactly one of which must be chosen: ``--tls-ca FILE``
  (ordinary verification against that CA, host name included); ``--tls-fingerprint HEX`` (a pin:
  the server must present exactly the certificate whose SHA-256 is HEX; gRPC verifies every
  connection against that one certificate, so a pin proves the peer holds that certificate's key,
  nothing about who runs it); or ``--insecure`` (plaintext, no identity at all, loudly logged).
* TOFU ("trust on first use") here means an operator copies the fingerprint the coordinator
  prints on its first start to the workers out of band; it is never learnt silently from the
  network. A new identity (a deleted ``tls/`` folder) gets a new fingerprint and old pins refuse it.
* Plaintext happens only with an explicit ``--insecure`` on both sides: a TLS server refuses a
  plaintext client and a TLS client refuses a plaintext server.
* Mutual TLS is optional: a server given a client-CA file requires every client to present a
  certificate issued by (or equal to) a certificate in that file.

The private key is never logged and never part of any ``repr``.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import ipaddress
import logging
import re
import socket
import ssl
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import grpc
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes, PublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from storage_client import DilocoxError, write_atomic

log = logging.getLogger("dilocox.tls")

CERT_FILE = "cert.pem"
KEY_FILE = "key.pem"
DEFAULT_VALIDITY_DAYS = 3650
NOT_BEFORE_SKEW = datetime.timedelta(hours=1)  # tolerate clients whose clocks run a little behind
DEFAULT_SAN_HOSTS = ("localhost", "127.0.0.1", "::1")
FETCH_TIMEOUT_S = 5.0
MAX_PIN_CHARS = 128  # 'sha256:' + 32 colon-separated pairs is 102; anything longer is not a pin
MAX_PEM_BYTES = 1 << 20  # a certificate, chain or key file larger than 1 MiB is not one
TARGET_NAME_OVERRIDE = "grpc.ssl_target_name_override"

_HEX64 = re.compile(r"[0-9a-f]{64}", re.ASCII)
_PAIRS = re.compile(r"[0-9a-f]{2}(?::[0-9a-f]{2}){31}", re.ASCII)
_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)", re.ASCII)


class TlsError(DilocoxError, ValueError):
    """A TLS setting, file, certificate or handshake that cannot be used; the message is one line."""


class TlsUnreachable(TlsError):
    """Nothing answered TLS at the address (refused, timed out, closed, unresolvable): the one
    TlsError worth retrying, e.g. while the coordinator is still starting."""


# --------------------------------------------------------------------------- fingerprints


def fingerprint(cert: bytes | x509.Certificate) -> str:
    """Canonical SHA-256 fingerprint (64 lowercase hex) of a certificate given as PEM, DER or object."""
    if isinstance(cert, x509.Certificate):
        der = cert.public_bytes(serialization.Encoding.DER)
    elif cert.lstrip().startswith(b"-----BEGIN"):
        der = _load_cert(cert, "certificate").public_bytes(serialization.Encoding.DER)
    else:
        der = bytes(cert)
    return hashlib.sha256(der).hexdigest()


def parse_fingerprint(text: str) -> str:
    """A pin in canonical form: accepts 64 hex digits or 32 colon-separated pairs, any case,
    optionally prefixed ``sha256:``; raises TlsError for anything else."""
    if not isinstance(text, str):
        raise TlsError("TLS fingerprint must be text")
    if len(text) > MAX_PIN_CHARS:
        raise TlsError(f"TLS fingerprint is {len(text)} characters long; expected a SHA-256 (64 hex digits)")
    value = text.strip().lower()
    if value.startswith("sha256:"):
        value = value[len("sha256:"):]
    if _PAIRS.fullmatch(value):
        value = value.replace(":", "")
    if not _HEX64.fullmatch(value):
        raise TlsError(f"TLS fingerprint {text.strip()!r} is not a SHA-256: expected 64 hex digits, "
                       "optionally colon-separated pairs and an optional 'sha256:' prefix")
    return value


# --------------------------------------------------------------------------- server identity


@dataclass(frozen=True)
class ServerIdentity:
    """A certificate (chain) and its private key, in PEM, as the coordinator serves them, with the
    files they were read from and the leaf certificate's fingerprint."""

    cert_pem: bytes
    key_pem: bytes = field(repr=False)
    fingerprint: str
    cert_path: Path
    key_path: Path


def _validate_host(host: str) -> x509.GeneralName | None:
    """The SAN entry for a host name or IP; None for unspecified (bind-all) addresses."""
    name = host.strip()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        pass
    else:
        return None if ip.is_unspecified else x509.IPAddress(ip)
    lowered = name.lower().rstrip(".")
    if not lowered or len(lowered) > 253 or not all(_LABEL.fullmatch(label) for label in lowered.split(".")):
        raise TlsError(f"{host!r} is neither an IP address nor a valid DNS host name")
    return x509.DNSName(lowered)


def _san_entries(hosts: Iterable[str]) -> list[x509.GeneralName]:
    entries: list[x509.GeneralName] = []
    for host in (*DEFAULT_SAN_HOSTS, *hosts):
        entry = _validate_host(host)
        if entry is not None and entry not in entries:
            entries.append(entry)
    return entries


def generate_self_signed(hosts: Sequence[str] = (), common_name: str = "dilocox coordinator",
                         validity_days: int = DEFAULT_VALIDITY_DAYS) -> tuple[bytes, bytes]:
    """A fresh ECDSA P-256 key and a self-signed certificate for it, as (cert PEM, key PEM).

    SANs: localhost, 127.0.0.1, ::1 and ``hosts``; usable for server and client authentication.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - NOT_BEFORE_SKEW)
        .not_valid_after(now + datetime.timedelta(days=validity_days))
        .add_extension(x509.SubjectAlternativeName(_san_entries(hosts)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _read_pem(path: str | Path, what: str) -> bytes:
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_PEM_BYTES:
            raise TlsError(f"{what} {p} is {size} bytes; not a PEM file")
        return p.read_bytes()
    except OSError as exc:
        raise TlsError(f"cannot read {what} {p}: {exc.strerror or exc}") from exc


def _load_certs(pem: bytes, what: str) -> list[x509.Certificate]:
    try:
        certs = x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise TlsError(f"{what} holds no valid PEM certificate") from exc
    if not certs:
        raise TlsError(f"{what} holds no PEM certificate")
    return certs


def _load_cert(pem: bytes, what: str) -> x509.Certificate:
    return _load_certs(pem, what)[0]


def _load_key(pem: bytes, what: str) -> PrivateKeyTypes:
    try:
        return serialization.load_pem_private_key(pem, password=None)
    except TypeError as exc:  # encrypted key, no password
        raise TlsError(f"{what} is encrypted; give an unencrypted key (mode 0600)") from exc
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise TlsError(f"{what} is not a valid PEM private key") from exc


def _public_der(public_key: PublicKeyTypes) -> bytes:
    return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _check_pair(cert_pem: bytes, key_pem: bytes, cert_what: str, key_what: str) -> x509.Certificate:
    """The leaf certificate, after checking the key is its key and it has not expired."""
    cert = _load_cert(cert_pem, cert_what)
    key = _load_key(key_pem, key_what)
    if _public_der(key.public_key()) != _public_der(cert.public_key()):
        raise TlsError(f"{key_what} is not the private key of {cert_what}")
    if cert.not_valid_after_utc <= datetime.datetime.now(datetime.timezone.utc):
        raise TlsError(f"{cert_what} expired on {cert.not_valid_after_utc:%Y-%m-%d}")
    return cert


def load_identity(cert_file: str | Path, key_file: str | Path) -> ServerIdentity:
    """A certificate (chain) and key from PEM files, checked to belong together and be unexpired."""
    cert_pem = _read_pem(cert_file, "TLS certificate")
    key_pem = _read_pem(key_file, "TLS key")
    leaf = _check_pair(cert_pem, key_pem, f"TLS certificate {cert_file}", f"TLS key {key_file}")
    return ServerIdentity(cert_pem, key_pem, fingerprint(leaf), Path(cert_file), Path(key_file))


def _san_names(cert: x509.Certificate) -> tuple[list[str], list[ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return [], []
    ips = [ip for ip in san.get_values_for_type(x509.IPAddress)
           if isinstance(ip, (ipaddress.IPv4Address, ipaddress.IPv6Address))]  # not the networks of name constraints
    return [n.lower() for n in san.get_values_for_type(x509.DNSName)], ips


def ensure_self_signed(directory: str | Path, hosts: Sequence[str] = ()) -> ServerIdentity:
    """The self-signed identity in ``directory`` (``cert.pem``, ``key.pem``), created on first use.

    The key is written first, then the certificate, each atomically, the key 0600; a certificate
    without its key is an error (never silently replaced: its fingerprint may be pinned).
    Names in ``hosts`` missing from an existing certificate are only warned about.
    """
    folder = Path(directory)
    cert_path, key_path = folder / CERT_FILE, folder / KEY_FILE
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(folder / ".lock", "a") as lock:  # two processes starting at once make one identity
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if not cert_path.exists():
            cert_pem, key_pem = generate_self_signed(hosts)
            write_atomic(key_path, key_pem, mode=0o600)
            write_atomic(cert_path, cert_pem, mode=0o644)
            log.info("created a self-signed TLS identity in %s", folder)
        elif not key_path.exists():
            raise TlsError(f"{cert_path} exists without its key {key_path}; restore the key or remove both "
                           "to create a new identity (pinned clients must then be given the new fingerprint)")
    mode = key_path.stat().st_mode & 0o777
    if mode & 0o077:
        log.warning("TLS key %s is readable by others (mode %o); it should be 0600", key_path, mode)
    identity = load_identity(cert_path, key_path)
    leaf = _load_cert(identity.cert_pem, str(cert_path))
    dns, ips = _san_names(leaf)
    missing = [h for h in hosts
               if (entry := _validate_host(h)) is not None
               and not (entry.value in ips if isinstance(entry, x509.IPAddress) else entry.value in dns)]
    if missing:
        log.warning("TLS certificate %s does not name %s; clients reaching it by those names need "
                    "--tls-fingerprint (a name override) or a new identity", cert_path, ", ".join(missing))
    return identity


def server_identity(tls_dir: str | Path, cert_file: str | Path | None = None, key_file: str | Path | None = None,
                    hosts: Sequence[str] = ()) -> ServerIdentity:
    """The coordinator's identity: ``cert_file``/``key_file`` when given (both or neither), else the
    self-signed pair in ``tls_dir``. Logs the fingerprint clients pin."""
    if (cert_file is None) != (key_file is None):
        raise TlsError("give both a TLS certificate and its key, or neither (for a self-signed identity)")
    identity = (load_identity(cert_file, key_file) if cert_file is not None and key_file is not None
                else ensure_self_signed(tls_dir, hosts))
    log.info("TLS certificate %s, sha256 fingerprint %s", identity.cert_path, identity.fingerprint)
    return identity


def server_credentials(identity: ServerIdentity, client_ca_file: str | Path | None = None) -> grpc.ServerCredentials:
    """gRPC server credentials for ``identity``; with ``client_ca_file``, mutual TLS (client
    certificates required, verified against the CA certificates in that file)."""
    client_ca = None
    if client_ca_file is not None:
        client_ca = _read_pem(client_ca_file, "TLS client CA file")
        _load_certs(client_ca, f"TLS client CA file {client_ca_file}")
    return grpc.ssl_server_credentials([(identity.key_pem, identity.cert_pem)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


# --------------------------------------------------------------------------- client side


@dataclass(frozen=True)
class ClientTls:
    """How a client trusts the coordinator: exactly one of ``ca_file``, ``fingerprint`` (canonical
    after construction) or ``insecure``; an optional client certificate and key for mutual TLS."""

    ca_file: Path | None = None
    fingerprint: str | None = None
    insecure: bool = False
    client_cert_file: Path | None = None
    client_key_file: Path | None = None

    def __post_init__(self) -> None:
        chosen = [self.ca_file is not None, self.fingerprint is not None, bool(self.insecure)]
        if sum(chosen) != 1:
            raise TlsError("client TLS needs exactly one of a CA file, a server fingerprint, or insecure=True")
        if (self.client_cert_file is None) != (self.client_key_file is None):
            raise TlsError("a TLS client certificate needs its key, and a key its certificate")
        if self.insecure and self.client_cert_file is not None:
            raise TlsError("a TLS client certificate makes no sense with insecure (plaintext)")
        if self.fingerprint is not None:
            object.__setattr__(self, "fingerprint", parse_fingerprint(self.fingerprint))
        for name in ("ca_file", "client_cert_file", "client_key_file"):
            value = getattr(self, name)
            if value is not None:
                if not str(value):
                    raise TlsError(f"{name} is empty")
                object.__setattr__(self, name, Path(value))


def client_tls_from_flags(tls_ca: str | None, tls_fingerprint: str | None, insecure: bool,
                          tls_client_cert: str | None = None, tls_client_key: str | None = None) -> ClientTls:
    """ClientTls from the CLI flags --tls-ca, --tls-fingerprint, --insecure, --tls-client-cert/-key;
    refuses missing or contradictory combinations with one line naming the flags."""
    given = [flag for flag, value in (("--tls-ca", tls_ca), ("--tls-fingerprint", tls_fingerprint),
                                      ("--insecure", insecure or None)) if value is not None]
    if not given:
        raise TlsError("say how to trust the coordinator: --tls-ca FILE, --tls-fingerprint HEX, "
                       "or --insecure (plaintext)")
    if len(given) > 1:
        raise TlsError(f"{' and '.join(given)} contradict each other; give exactly one")
    if (tls_client_cert is None) != (tls_client_key is None):
        raise TlsError("--tls-client-cert and --tls-client-key go together")
    if insecure and tls_client_cert is not None:
        raise TlsError("--tls-client-cert/--tls-client-key contradict --insecure (plaintext)")
    for flag, value in (("--tls-ca", tls_ca), ("--tls-client-cert", tls_client_cert),
                        ("--tls-client-key", tls_client_key)):
        if value is not None and not value.strip():
            raise TlsError(f"{flag} needs a file name")
    return ClientTls(ca_file=Path(tls_ca) if tls_ca is not None else None, fingerprint=tls_fingerprint,
                     insecure=insecure,
                     client_cert_file=Path(tls_client_cert) if tls_client_cert is not None else None,
                     client_key_file=Path(tls_client_key) if tls_client_key is not None else None)


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of "host:port" or "[v6]:port"."""
    host, sep, port_text = address.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    if (not sep or not host or len(port_text) > 5 or not port_text.isascii() or not port_text.isdigit()
            or not 0 < int(port_text) < 65536):
        raise TlsError(f"address {address[:200]!r} is not host:port")
    if ":" in host or bracketed:
        try:
            if not bracketed:
                raise ValueError(host)
            ipaddress.IPv6Address(host)
        except ValueError as exc:
            raise TlsError(f"address {address[:200]!r} is not host:port (write IPv6 hosts as [addr]:port)") from exc
    return host, int(port_text)


def _client_pair(tls: ClientTls) -> tuple[bytes, bytes] | tuple[None, None]:
    """(key PEM, cert chain PEM) of the client certificate, checked, or (None, None)."""
    if tls.client_cert_file is None or tls.client_key_file is None:
        return None, None
    cert_pem = _read_pem(tls.client_cert_file, "TLS client certificate")
    key_pem = _read_pem(tls.client_key_file, "TLS client key")
    _check_pair(cert_pem, key_pem, f"TLS client certificate {tls.client_cert_file}",
                f"TLS client key {tls.client_key_file}")
    return key_pem, cert_pem


def fetch_server_certificate(address: str, timeout_s: float = FETCH_TIMEOUT_S,
                             client_pair: tuple[bytes, bytes] | None = None) -> bytes:
    """The certificate the server at ``address`` presents, as PEM, from one unverified TLS handshake
    (ALPN h2, as gRPC servers expect; ``client_pair`` = (key PEM, cert PEM) for servers that want a
    client certificate). Only ever trusted after its fingerprint matches a pin. Raises
    TlsUnreachable when nothing answers, TlsError when something answers but not with TLS."""
    host, port = split_address(address)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    if client_pair is not None:  # a server requiring client certificates may end a TLS 1.2 handshake without one
        key_pem, cert_pem = client_pair
        with tempfile.TemporaryDirectory(prefix="dilocox-tls-") as tmp:
            cert_tmp, key_tmp = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
            write_atomic(cert_tmp, cert_pem, mode=0o600)
            write_atomic(key_tmp, key_pem, mode=0o600)
            context.load_cert_chain(cert_tmp, key_tmp)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            with context.wrap_socket(sock, server_hostname=host) as tls_sock:
                der = tls_sock.getpeercert(binary_form=True)
    except OSError as exc:  # ssl.SSLError, TimeoutError, ConnectionRefusedError, socket.gaierror
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        protocol = isinstance(exc, ssl.SSLError) and not isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError))
        kind = TlsError if protocol else TlsUnreachable
        raise kind(f"TLS handshake with {address} failed: {reason}") from exc
    if not der:
        raise TlsError(f"the server at {address} presented no certificate")
    return ssl.DER_cert_to_PEM_cert(der).encode("ascii")


def _target_name(cert: x509.Certificate, host: str) -> str | None:
    """A name for ``grpc.ssl_target_name_override``: None when ``host`` is already in the
    certificate's SANs, else its first DNS SAN (or IP SAN, or common name)."""
    dns, ips = _san_names(cert)
    try:
        if ipaddress.ip_address(host) in ips:
            return None
    except ValueError:
        if host.lower().rstrip(".") in dns:
            return None
    if dns:
        return dns[0]
    if ips:
        return str(ips[0])
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if cns and isinstance(cns[0].value, str):
        return cns[0].value
    raise TlsError("the pinned certificate names no host (no SAN, no common name); cannot verify it")


def open_channel(address: str, tls: ClientTls, options: Sequence[tuple[str, object]] = (),
                 fetch_timeout_s: float = FETCH_TIMEOUT_S) -> grpc.Channel:
    """A gRPC channel to ``address`` ("host:port") secured as ``tls`` says.

    With a pin, first fetches the server's certificate, refuses it unless its SHA-256 is the pin,
    then trusts exactly that certificate (gRPC re-verifies it on every connection). So unlike
    ``grpc.insecure_channel`` this can fail before any RPC: TlsUnreachable while the server is not
    up yet (retry), TlsError for a wrong pin or a non-TLS server (do not retry).
    """
    opts = list(options)
    if tls.insecure:
        log.warning("INSECURE: plaintext gRPC to %s (--insecure): no server identity, no encryption; "
                    "anyone on the path can read and alter this traffic", address)
        return grpc.insecure_channel(address, options=opts)
    key_pem, chain_pem = _client_pair(tls)
    if tls.ca_file is not None:
        roots = _read_pem(tls.ca_file, "TLS CA file")
        _load_certs(roots, f"TLS CA file {tls.ca_file}")
    else:
        host, _ = split_address(address)
        roots = _pinned_certificate(address, tls, fetch_timeout_s, key_pem, chain_pem)
        override = _target_name(_load_cert(roots, f"certificate of {address}"), host)
        if override is not None and not any(name == TARGET_NAME_OVERRIDE for name, _ in opts):
            opts.append((TARGET_NAME_OVERRIDE, override))
    credentials = grpc.ssl_channel_credentials(root_certificates=roots, private_key=key_pem,
                                               certificate_chain=chain_pem)
    return grpc.secure_channel(address, credentials, options=opts)


def _pinned_certificate(address: str, tls: ClientTls, fetch_timeout_s: float, key_pem: bytes | None,
                        chain_pem: bytes | None) -> bytes:
    """The certificate (PEM) the server at ``address`` presents, refused unless its SHA-256 is the pin."""
    assert tls.fingerprint is not None
    roots = fetch_server_certificate(address, fetch_timeout_s,
                                     (key_pem, chain_pem) if key_pem is not None and chain_pem is not None else None)
    got = fingerprint(roots)
    if got != tls.fingerprint:
        raise TlsError(f"server {address} presented certificate sha256 {got}, but the pin is {tls.fingerprint}")
    return roots


# --------------------------------------------------------------------------- the coordinator's gateway


def gateway_server_tls(identity: ServerIdentity, client_ca_file: str | Path | None = None) -> ssl.SSLContext:
    """The TLS of the coordinator's store gateway (storage_client.gateway): the certificate and key of
    its gRPC port, so a worker trusts both by one pin or CA; with ``client_ca_file``, client
    certificates issued by it are required there too."""
    from storage_client.gateway import server_tls

    context = server_tls(identity.cert_path, identity.key_path)
    if client_ca_file is not None:
        _load_certs(_read_pem(client_ca_file, "TLS client CA file"), f"TLS client CA file {client_ca_file}")
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cafile=str(client_ca_file))
    return context


def gateway_client_tls(address: str, tls: ClientTls, fetch_timeout_s: float = FETCH_TIMEOUT_S) -> ssl.SSLContext | None:
    """How a worker trusts its coordinator's gateway: as it trusts the coordinator's gRPC port at
    ``address`` (None: plaintext, --insecure). With a CA, ordinary verification, host name included;
    with a pin, the certificate at ``address`` is fetched and checked against the pin, and exactly
    that certificate is trusted, its host name not checked (the pin is the identity, as the
    target-name override of ``open_channel`` has it). TlsUnreachable / TlsError as ``open_channel``."""
    if tls.insecure:
        return None
    if tls.ca_file is not None:
        context = ssl.create_default_context(cafile=str(tls.ca_file))
    else:
        key_pem, chain_pem = _client_pair(tls)
        pinned = _pinned_certificate(address, tls, fetch_timeout_s, key_pem, chain_pem)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.load_verify_locations(cadata=pinned.decode("ascii"))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.client_cert_file is not None and tls.client_key_file is not None:
        context.load_cert_chain(str(tls.client_cert_file), str(tls.client_key_file))
    return context
