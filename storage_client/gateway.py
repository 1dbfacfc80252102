"""An IPFS Trustless Gateway (https://specs.ipfs.tech/http-gateways/trustless-gateway/) over any
``Store``: what the store holds, fetchable by CID from anywhere and verifiable by the fetcher.

    GET|HEAD /ipfs/<cid>            Accept: application/vnd.ipld.raw   (or ?format=raw)  the block
    GET|HEAD /ipfs/<cid>            Accept: application/vnd.ipld.car   (or ?format=car)  a CARv1
                                                                       whose root and only block is <cid>

Every response names its type (``Content-Type``), ``X-Content-Type-Options: nosniff``, an ``Etag``
of ``"<cid>.raw"`` / ``"<cid>.car"`` and, for a block, ``Cache-Control: public, max-age=29030400,
immutable`` (content named by its hash never changes). 400: a malformed CID or path; 404: a CID the
store does not hold; 406: an Accept or format the gateway does not serve (a trustless gateway
serves no deserialized responses); 405: any method but GET and HEAD; 414: a request line over 2 KiB;
431: headers over 8 KiB or 32 of them; 500: a stored copy that does not hash to its CID (the
gateway never serves bytes it has not verified: the store's ``get`` re-hashes them). Bodies of
refusals are one short line that never echoes the request.

A raw block is served whatever its size: our CIDs name an object's whole bytes (storage_client.cid;
docs/trust.md "The store over HTTP" says which CID ``ipfs add`` gives for them). A CID whose codec
the store does not know (dag-pb, dag-cbor) is a 400, like any CID we cannot name.

Bounds: at most ``MAX_CONNECTIONS_PER_CLIENT`` connections from one address at a time and
``MAX_CONNECTIONS`` from all of them (more are closed at once, unanswered), a socket timeout on every read and write (a client that drips its request is cut
off), one request per connection. Read-only: nothing here writes to the store (a read-through
store it serves may keep what it fetched, storage_client.readthrough). TLS, when asked, with a
certificate and key (the coordinator's, trainer.net.tls). ``GatewayServer.bytes_out`` counts every
byte of every response it wrote (status lines, headers and bodies): its egress.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections import Counter
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .backend import CorruptObjectError, MissingObjectError, Store, StoreError
from .car import encode_car
from .cid import CID, InvalidCIDError

log = logging.getLogger(__name__)

RAW_TYPE = "application/vnd.ipld.raw"
CAR_TYPE = "application/vnd.ipld.car"
CAR_TYPE_PARAMS = "application/vnd.ipld.car; version=1; order=dfs; dups=n"
FORMATS = {"raw": RAW_TYPE, "car": CAR_TYPE}
IMMUTABLE = "public, max-age=29030400, immutable"
MAX_REQUEST_LINE = 2048
MAX_HEADER_BYTES = 8192
MAX_HEADERS = 32
MAX_CONNECTIONS_PER_CLIENT = 8
MAX_CONNECTIONS = 256  # from all clients at once: each holds a thread (a coordinator serves one beside its gRPC port)
SOCKET_TIMEOUT_S = 30.0


class GatewayRequestError(Exception):
    """A request the gateway refuses: its status and a one-line reason that echoes nothing sent."""

    def __init__(self, status: HTTPStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def parse_request_target(target: str) -> tuple[CID, str | None]:
    """The CID of ``/ipfs/<cid>`` and the ``format`` query parameter if any (GatewayRequestError)."""
    parts = urlsplit(target)
    segments = parts.path.split("/")
    if len(segments) != 3 or segments[0] != "" or segments[1] != "ipfs":
        raise GatewayRequestError(HTTPStatus.BAD_REQUEST, "the path must be /ipfs/<cid> (no subpaths)")
    try:
        cid = CID.parse(segments[2])
    except InvalidCIDError:
        raise GatewayRequestError(HTTPStatus.BAD_REQUEST,
                                  "malformed CID: a CIDv1 in base32, sha2-256, codec raw or json") from None
    try:
        query = parse_qs(parts.query, strict_parsing=bool(parts.query), max_num_fields=8)
    except ValueError:
        raise GatewayRequestError(HTTPStatus.BAD_REQUEST, "malformed query string") from None
    formats = query.get("format", [])
    if len(formats) > 1:
        raise GatewayRequestError(HTTPStatus.BAD_REQUEST, "more than one format parameter")
    return cid, formats[0] if formats else None


def choose_type(format_param: str | None, accept: str | None) -> str:
    """The response type: ``?format=`` wins over ``Accept``; 406 when neither names raw or car."""
    if format_param is not None:
        if format_param not in FORMATS:
            raise GatewayRequestError(HTTPStatus.NOT_ACCEPTABLE, "format must be raw or car")
        return FORMATS[format_param]
    for entry in (accept or "").split(",")[:16]:
        media = entry.split(";")[0].strip().lower()
        if media in (RAW_TYPE, CAR_TYPE):
            return media
    raise GatewayRequestError(HTTPStatus.NOT_ACCEPTABLE,
                              f"a trustless gateway serves only {RAW_TYPE} and {CAR_TYPE} (Accept or ?format=)")


class GatewayHandler(BaseHTTPRequestHandler):
    """One request to the gateway; ``server.store`` is what it serves."""

    server: GatewayServer
    protocol_version = "HTTP/1.1"
    server_version = "dilocox-gateway"
    sys_version = ""
    timeout = SOCKET_TIMEOUT_S

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes: without this, Nagle's algorithm holds the body
        # until the client acknowledges the headers.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def handle_one_request(self) -> None:
        # The request line and headers are read here with tighter bounds than http.server's 64 KiB.
        self.close_connection = True
        try:
            line = self.rfile.readline(MAX_REQUEST_LINE + 1)
        except (TimeoutError, OSError):
            return
        if not line:
            return
        if len(line) > MAX_REQUEST_LINE:
            self.requestline, self.request_version, self.command = "", "HTTP/1.1", "GET"
            self._refuse(HTTPStatus.REQUEST_URI_TOO_LONG, "request line over its bound")
            return
        self.raw_requestline = line
        if not self._read_bounded_headers():
            return
        method = getattr(self, "do_" + self.command, None) if self.command in ("GET", "HEAD") else None
        if method is None:
            self._refuse(HTTPStatus.METHOD_NOT_ALLOWED, "only GET and HEAD", allow="GET, HEAD")
            return
        method()

    def _read_bounded_headers(self) -> bool:
        """parse_request's request line, and headers read within MAX_HEADER_BYTES / MAX_HEADERS."""
        import email.parser
        import http.client

        words = self.raw_requestline.decode("iso-8859-1").rstrip("\r\n").split()
        if len(words) != 3 or not words[2].startswith("HTTP/1."):
            self.requestline, self.request_version, self.command = "", "HTTP/1.1", "GET"
            self._refuse(HTTPStatus.BAD_REQUEST, "malformed request line")
            return False
        self.command, self.path, self.request_version = words
        self.requestline = f"{self.command} (target of {len(self.path)} bytes) {self.request_version}"
        raw, count = b"", 0
        while True:
            line = self.rfile.readline(MAX_HEADER_BYTES + 1)
            if line in (b"\r\n", b"\n", b""):
                break
            raw += line
            count += 1
            if len(raw) > MAX_HEADER_BYTES or count > MAX_HEADERS:
                self._refuse(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "headers over their bound")
                return False
        self.headers = email.parser.Parser(_class=http.client.HTTPMessage).parsestr(raw.decode("iso-8859-1"))
        return True

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._serve(with_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(with_body=False)

    def _serve(self, with_body: bool) -> None:
        store = self.server.store
        try:
            cid, format_param = parse_request_target(self.path)
            content_type = choose_type(format_param, self.headers.get("Accept"))
            data = store.get(cid) if with_body or content_type == CAR_TYPE else None
            size = store.size(cid) if data is None else len(data)
        except GatewayRequestError as exc:
            self._refuse(exc.status, str(exc))
            return
        except MissingObjectError:
            self._refuse(HTTPStatus.NOT_FOUND, "no such block here")
            return
        except CorruptObjectError as exc:
            log.error("gateway: refusing to serve %s: the stored copy is corrupt", exc.cid)
            self._refuse(HTTPStatus.INTERNAL_SERVER_ERROR, "the stored copy does not hash to its CID")
            return
        except StoreError:
            self._refuse(HTTPStatus.INTERNAL_SERVER_ERROR, "the store could not read the block")
            return
        if content_type == RAW_TYPE:
            self._respond(cid, RAW_TYPE, "raw", [data] if with_body else [], size)
        else:
            assert data is not None
            pieces = list(encode_car([cid], [(cid, data)]))
            self._respond(cid, CAR_TYPE_PARAMS, "car", pieces if with_body else [], sum(map(len, pieces)))

    def flush_headers(self) -> None:
        self.server.count_out(sum(map(len, getattr(self, "_headers_buffer", []))))
        super().flush_headers()

    def _write_body(self, piece: bytes) -> None:
        self.wfile.write(piece)
        self.server.count_out(len(piece))

    def _respond(self, cid: CID, content_type: str, suffix: str, body: list[bytes | None], length: int) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(length))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Etag", f'"{cid}.{suffix}"')
        self.send_header("Cache-Control", IMMUTABLE)
        self.send_header("Vary", "Accept")
        self.send_header("X-Ipfs-Roots", str(cid))
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            for piece in body:
                self._write_body(piece or b"")
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the client went away: nothing to tell it

    def _refuse(self, status: HTTPStatus, reason: str, allow: str | None = None) -> None:
        body = f"{status.value} {status.phrase}: {reason}\n".encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-Content-Type-Options", "nosniff")
            if allow:
                self.send_header("Allow", allow)
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self._write_body(body)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        log.debug("gateway %s: " + format, self.client_address[0], *args)


class GatewayServer(ThreadingHTTPServer):
    """The gateway's listening socket: one thread per connection, at most
    MAX_CONNECTIONS_PER_CLIENT per client address."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], store: Store, tls: ssl.SSLContext | None = None) -> None:
        self.store = store
        self.tls = tls
        self._open: Counter[str] = Counter()
        self._open_lock = threading.Lock()
        self.bytes_out = 0  # response bytes written (status lines, headers, bodies): the gateway's egress
        self.per_client, self.max_connections = MAX_CONNECTIONS_PER_CLIENT, MAX_CONNECTIONS
        super().__init__(address, GatewayHandler)

    def count_out(self, nbytes: int) -> None:
        with self._open_lock:
            self.bytes_out += nbytes

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in str(host) else host
        return f"{'https' if self.tls else 'http'}://{host}:{port}"

    def verify_request(self, request: Any, client_address: Any) -> bool:
        with self._open_lock:
            if self._open[client_address[0]] >= self.per_client or self._open.total() >= self.max_connections:
                return False
            self._open[client_address[0]] += 1
        return True

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            if self.tls is not None:
                request.settimeout(SOCKET_TIMEOUT_S)
                try:
                    request = self.tls.wrap_socket(request, server_side=True)
                except (ssl.SSLError, OSError):
                    return
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open[client_address[0]] -= 1
                if not self._open[client_address[0]]:
                    del self._open[client_address[0]]


def server_tls(cert_file: str | Path, key_file: str | Path) -> ssl.SSLContext:
    """A TLS 1.2+ server context from a certificate chain and its key (ssl.SSLError / OSError when
    they do not load)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(cert_file), str(key_file))
    return context


def start_gateway(store: Store, host: str = "127.0.0.1", port: int = 0,
                  tls: ssl.SSLContext | None = None) -> tuple[GatewayServer, threading.Thread]:
    """Serve ``store`` on ``host:port`` (0: a free port) in a background thread; ``server.url`` is its
    address, ``server.shutdown()`` stops it."""
    server = GatewayServer((host, port), store, tls)
    # A 0.1 s poll: shutdown() returns within it (the default 0.5 s slows every test that stops one).
    thread = threading.Thread(target=server.serve_forever, args=(0.1,), name="dilocox-gateway", daemon=True)
    thread.start()
    return server, thread
