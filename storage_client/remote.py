"""``RemoteStore``: the ``Store`` door (read-only) over one or several IPFS trustless gateways.

Each object is fetched as a raw block (``GET /ipfs/<cid>``, ``Accept: application/vnd.ipld.raw``)
from the sources in the order given (a mirror first, then the coordinator), and every block is
verified against its CID (sha2-256 of the bytes) before it is returned: a gateway is trusted for
nothing but availability. Reads are bounded: a declared ``Content-Length`` over ``max_bytes`` is
refused before the body is read, and a body is read only up to ``max_bytes + 1`` bytes, so a source
that streams without end is cut off. A transport failure (refused connection, reset, timeout, a
truncated body, a 5xx) is retried with exponential backoff, ``retries`` times per source; a 404 moves
on to the next source at once. A body that drips (slower than ``MIN_RATE_BYTES_S`` once
``timeout_s`` has passed) is a transport failure too. When no source has a correct copy the error
names the CID and what each source did: ``MissingObjectError`` when every source said 404,
``UnverifiedObjectError`` (naming the sources whose bytes did not hash to the CID, "lied") otherwise.

A trustless gateway cannot list what it holds, so iterating a remote store yields nothing: a walk
over every object (the audit's search for rounds stored past the ledger's last one) sees none of
them, and the audit says so (audit.cli).
"""

from __future__ import annotations

import hashlib
import http.client
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .backend import MissingObjectError, Store, StoreError, as_cid
from .canonical import loads_bounded
from .cid import CID, Codec
from .gateway import RAW_TYPE

DEFAULT_MAX_OBJECT_BYTES = 1 << 30  # a checkpoint of up to 1 GiB
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_RETRIES = 3
BACKOFF_S = 0.2  # the first retry's wait; doubled for each one after
_READ_CHUNK = 1 << 20
MIN_RATE_BYTES_S = 256 << 10  # past the timeout, a body must keep up this rate (a slow drip is cut off)
_MAX_URL_CHARS = 512


class UnverifiedObjectError(StoreError):
    """No source served a copy of the object that hashes to its CID."""

    def __init__(self, cid: CID, outcomes: Sequence[tuple[str, str]]) -> None:
        lied = [url for url, what in outcomes if what.startswith("lied")]
        said = "; ".join(f"{url}: {what}" for url, what in outcomes)
        super().__init__(f"no source has a correct copy of object {cid}"
                         + (f" (lied: {', '.join(lied)})" if lied else "") + f": {said}")
        self.cid = cid
        self.lied = lied
        self.outcomes = list(outcomes)


class _Transient(Exception):
    """A failure worth retrying (transport, 5xx, truncation)."""


@dataclass(frozen=True)
class _Fetched:
    status: str  # "ok", "missing", "lied: ...", "failed (...)", "refused (...)"
    data: bytes | None = None  # a GET's verified body
    size: int | None = None  # a HEAD's declared length


def check_source_url(url: str) -> str:
    """A gateway base URL: http(s)://host[:port][/prefix], no query; trailing slash dropped
    (StoreError naming what is wrong, without echoing more than its start)."""
    if not isinstance(url, str) or len(url) > _MAX_URL_CHARS:
        raise StoreError(f"a store URL must be a string of at most {_MAX_URL_CHARS} characters")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise StoreError(f"store URL {url[:80]!r} is not http(s)://host[:port][/path] without query or fragment")
    return url.rstrip("/")


class RemoteStore(Store):
    """Objects fetched from trustless gateways and verified by CID; read-only."""

    def __init__(self, urls: Sequence[str], *, ca_file: str | None = None,
                 max_bytes: int = DEFAULT_MAX_OBJECT_BYTES, timeout_s: float = DEFAULT_TIMEOUT_S,
                 retries: int = DEFAULT_RETRIES, backoff_s: float = BACKOFF_S,
                 source_tls: Mapping[str, ssl.SSLContext] | None = None) -> None:
        if not urls:
            raise StoreError("a remote store needs at least one gateway URL")
        self.urls = [check_source_url(u) for u in urls]
        self.ca_file = ca_file  # the CA to trust for https sources (None: the system's)
        self.tls = ssl.create_default_context(cafile=ca_file) if ca_file is not None else None
        # A source trusted otherwise (the coordinator's gateway, by the certificate its workers pin).
        self.source_tls = {check_source_url(u): context for u, context in (source_tls or {}).items()}
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._sizes: dict[CID, int] = {}

    @property
    def location(self) -> str:
        return ", ".join(self.urls)

    def put(self, data: bytes, codec: Codec = Codec.RAW) -> CID:
        raise StoreError(f"the remote store {self.location} is read-only")

    def get(self, cid: CID | str) -> bytes:
        return self.get_reporting(cid)[0]

    def get_reporting(self, cid: CID | str) -> tuple[bytes, list[tuple[str, str]]]:
        """``get``, with what each source tried before the one that served a correct copy did
        ((url, "missing" / "lied: ..." / "failed (...)" / "refused (...)"), in order): who to name."""
        cid = as_cid(cid)
        outcomes: list[tuple[str, str]] = []
        for url in self.urls:
            fetched = self._from_source(url, cid, method="GET")
            if fetched.status == "ok" and fetched.data is not None:
                self._sizes[cid] = len(fetched.data)
                return fetched.data, outcomes
            outcomes.append((url, fetched.status))
        if all(what == "missing" for _, what in outcomes):
            raise MissingObjectError(cid, self.location)
        raise UnverifiedObjectError(cid, outcomes)

    def has(self, cid: CID | str) -> bool:
        try:
            self.size(cid)
        except MissingObjectError:
            return False
        return True

    def size(self, cid: CID | str) -> int:
        cid = as_cid(cid)
        if cid in self._sizes:
            return self._sizes[cid]
        outcomes: list[tuple[str, str]] = []
        for url in self.urls:
            fetched = self._from_source(url, cid, method="HEAD")
            if fetched.status == "ok" and fetched.size is not None:
                self._sizes[cid] = fetched.size
                return fetched.size
            outcomes.append((url, fetched.status))
        if all(what == "missing" for _, what in outcomes):
            raise MissingObjectError(cid, self.location)
        raise UnverifiedObjectError(cid, outcomes)

    def __iter__(self) -> Iterator[str]:
        return iter(())  # a trustless gateway cannot be listed (module docstring)

    def read_small_json(self, cid: CID | str, max_bytes: int) -> Any | None:
        cid = as_cid(cid)
        if self.size(cid) > max_bytes:
            return None
        data = self.get(cid)
        if data[:1] != b"{":
            return None
        return loads_bounded(data, max_bytes=max_bytes, what=f"object {cid}")

    def _from_source(self, url: str, cid: CID, method: str) -> _Fetched:
        """One source's answer, retried with backoff on transient failures."""
        last = "unreachable"
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return self._request(url, cid, method)
            except _Transient as exc:
                last = f"failed ({exc})"
        return _Fetched(last)

    def _request(self, url: str, cid: CID, method: str) -> _Fetched:
        request = urllib.request.Request(f"{url}/ipfs/{cid}", method=method, headers={"Accept": RAW_TYPE})
        try:
            context = self.source_tls.get(url, self.tls)
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=context) as response:
                declared = response.headers.get("Content-Length")
                length = int(declared) if declared is not None and declared.isdigit() else None
                if length is not None and length > self.max_bytes:
                    return _Fetched(f"lied: declares {length} bytes, over the bound {self.max_bytes}")
                if method == "HEAD":
                    if length is None:
                        raise _Transient("HEAD without a Content-Length")
                    return _Fetched("ok", size=length)
                data = self._read_bounded(response)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return _Fetched("missing")
            if exc.code >= 500:
                raise _Transient(f"HTTP {exc.code}") from None
            return _Fetched(f"refused (HTTP {exc.code})")
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise _Transient(f"{type(exc).__name__}: {str(reason)[:120]}") from None
        if len(data) > self.max_bytes:
            return _Fetched(f"lied: sent over {self.max_bytes} bytes")
        if length is not None and len(data) != length:
            raise _Transient(f"truncated: {len(data)} of {length} bytes")
        if hashlib.sha256(data).digest() != cid.digest:
            return _Fetched(f"lied: sent {len(data)} bytes that do not hash to the CID")
        return _Fetched("ok", data)

    def _read_bounded(self, response: http.client.HTTPResponse) -> bytes:
        """At most max_bytes + 1 bytes of the body (one more than allowed tells an overrun)."""
        pieces, total = [], 0
        started = time.monotonic()
        while total <= self.max_bytes:
            if time.monotonic() - started > self.timeout_s + total / MIN_RATE_BYTES_S:
                raise _Transient(f"too slow: {total} bytes in {time.monotonic() - started:.0f} s")
            piece = response.read1(min(_READ_CHUNK, self.max_bytes + 1 - total))
            if not piece:
                break
            pieces.append(piece)
            total += len(piece)
        return b"".join(pieces)

