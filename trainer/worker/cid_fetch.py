"""A worker's global state fetched by CID from any source, verified (issues 29 and 30).

The downlink of a round is the same bytes for every worker. A worker started with ``--store-source
URL`` (repeatable) asks the coordinator to name the payload rather than stream it
(FetchGlobalRequest.payload_by_cid); when the run's store holds it, the coordinator's signed header
carries its CID (GlobalHeader.payload_cid, whose digest is the header's payload_sha256) and no data
chunks, and the worker fetches the bytes from IPFS trustless gateways in order: its mirrors and peers
first, the coordinator's own gateway (JoinResponse.store_port, on the host it dialled, trusted by the
same pin or CA as the gRPC port: trainer.net.tls.gateway_client_tls) last. So with a mirror in front,
the coordinator sends a round's downlink once (to the mirror), not W times.

Every block is fetched and verified by ``storage_client.remote.RemoteStore`` (the one fetch-and-verify
path: sha2-256 against the CID as it arrives, at most the header's ``payload_size`` bytes read, retries
with backoff, a slow drip cut off). A source that lies (bytes that do not hash to the CID, a length
over the bound) is named in one warning line and skipped for the next. When no source has a correct
copy, ``CidFetchError`` names the CID and what each source did, in one line; the worker then asks the
coordinator for the bytes over gRPC for that fetch (trainer.worker.client.CoordinatorClient.fetch), so
a lying or absent mirror costs time, never the round. What the bytes then give (θ⁽ʳ⁾, checked
against the signed params CID) is checked as for a streamed payload.

Bytes fetched here count in the worker's received bytes and its emulated link, not in the
``bytes_received`` of its report: that is the coordinator's count of its FetchGlobal stream (the
header only, for a payload named by CID), which the manifest records.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Iterator, Sequence

from proto import pb
from storage_client import CID, Codec, InvalidCIDError, StoreError
from storage_client.remote import RemoteStore, check_source_url
from trainer.codec.wire import WireError, reassemble, sha256_hex
from trainer.net.limits import clip
from trainer.net.tls import ClientTls, TlsError, gateway_client_tls, split_address

log = logging.getLogger("dilocox.worker")

MAX_STORE_SOURCES = 16  # --store-source URLs a worker tries; the coordinator's gateway comes after them
FETCH_RETRIES = 2  # per source, after the first try (RemoteStore's backoff between them)
FETCH_TIMEOUT_S = 30.0
EMPTY_SHA256 = sha256_hex(b"")
MAX_CODEC_HEADER_BYTES = 4 << 20  # a codec header named by CID (the bound of a pushed one, trainer.net.limits)


class CidFetchError(WireError):
    """No source served a correct copy of the payload a header names by CID (one line, CID and sources)."""


def parse_cid(text: str, codec: Codec, round_: int, what: str) -> CID:
    """A CID a header names, of ``codec`` (WireError naming ``what`` otherwise)."""
    try:
        cid = CID.parse(text)
    except InvalidCIDError:
        raise WireError(f"global state of round {round_} names a malformed {what} CID {clip(text)}") from None
    if cid.codec != codec:
        raise WireError(f"global state of round {round_}: {what} CID {cid} is not of codec {codec.name}")
    return cid


def payload_cid(header: pb.GlobalHeader) -> CID:
    """The CID a signed header names for its payload: a raw-codec CIDv1 whose digest is the header's
    payload_sha256 (WireError otherwise: the two would describe different bytes)."""
    cid = parse_cid(header.payload_cid, Codec.RAW, header.round, "payload")
    if cid.hex != header.payload_sha256:
        raise WireError(f"global state of round {header.round}: payload CID {cid} is not the CID of "
                        f"its payload_sha256 {clip(header.payload_sha256)}")
    return cid


def gateway_url(coordinator_address: str, store_port: int, secure: bool) -> str:
    """The coordinator's gateway: its announced port on the host the worker dialled."""
    host, _ = split_address(coordinator_address)
    host = f"[{host}]" if ":" in host else host
    return f"{'https' if secure else 'http'}://{host}:{store_port}"


class PayloadSources:
    """The gateways a worker fetches payloads named by CID from: ``mirrors`` in order, then the
    coordinator's gateway once its port is known (``fetch``'s ``store_port``, from JoinResponse)."""

    def __init__(self, mirrors: Sequence[str], coordinator_address: str, tls: ClientTls,
                 received: Callable[[int], None]) -> None:
        if len(mirrors) > MAX_STORE_SOURCES:
            raise StoreError(f"{len(mirrors)} store sources, more than {MAX_STORE_SOURCES}")
        self.mirrors = [check_source_url(url) for url in mirrors]
        self.coordinator_address, self.tls, self.received = coordinator_address, tls, received
        self._coordinator: tuple[str, ssl.SSLContext | None] | None = None  # its URL and how to trust it

    def follow(self, coordinator_address: str, tls: ClientTls) -> None:
        """The coordinator served now (trainer.worker.succession): its gateway is the last source."""
        if (coordinator_address, tls) != (self.coordinator_address, self.tls):
            self.coordinator_address, self.tls, self._coordinator = coordinator_address, tls, None

    @property
    def enabled(self) -> bool:
        """Whether to ask for payloads by CID: only a worker given a source to take them from."""
        return bool(self.mirrors)

    def coordinator_gateway(self, store_port: int) -> list[tuple[str, ssl.SSLContext | None]]:
        """[(URL, TLS context)] of the coordinator's gateway, or [] when it serves none (port 0)."""
        if not 0 < store_port < 65536:
            return []
        url = gateway_url(self.coordinator_address, store_port, not self.tls.insecure)
        if self._coordinator is None or self._coordinator[0] != url:
            try:
                self._coordinator = (url, gateway_client_tls(self.coordinator_address, self.tls))
            except TlsError as exc:  # TlsUnreachable too: the mirrors may still have it
                log.warning("cannot trust the coordinator's store gateway %s: %s", url, exc)
                return []
        return [self._coordinator]

    def fetch(self, header: pb.GlobalHeader, store_port: int, rest: Iterator[bytes]) -> bytes:
        """The payload ``header`` names by CID, verified; CidFetchError when no source has it. ``rest``
        (the data chunks of the stream after the header) must be empty. A codec header named by CID
        is fetched too and put in ``header.compression_header``, where a streamed one is."""
        reassemble(rest, 0, EMPTY_SHA256, what=f"global state of round {header.round} named by CID")
        if header.compression_header_cid:
            if header.compression_header:
                raise WireError(f"global state of round {header.round} names its codec header by CID and sends it")
            cid = parse_cid(header.compression_header_cid, Codec.JSON, header.round, "codec header")
            header.compression_header = self._get(header, cid, store_port, MAX_CODEC_HEADER_BYTES)
        cid = payload_cid(header)
        data = self._get(header, cid, store_port, header.payload_size)
        if len(data) != header.payload_size:  # the CID binds the bytes; the signed header their length
            raise WireError(f"global state of round {header.round}: payload {cid} is {len(data)} bytes, "
                            f"the header declares {header.payload_size}")
        return data

    def _get(self, header: pb.GlobalHeader, cid: CID, store_port: int, max_bytes: int) -> bytes:
        """One object from the sources in order, verified, liars named (CidFetchError: none had it)."""
        coordinator = self.coordinator_gateway(store_port)
        urls = [*self.mirrors, *(url for url, _ in coordinator)]
        store = RemoteStore(urls, max_bytes=max_bytes, timeout_s=FETCH_TIMEOUT_S, retries=FETCH_RETRIES,
                            source_tls={url: context for url, context in coordinator if context is not None})
        try:
            data, skipped = store.get_reporting(cid)
        except StoreError as exc:
            raise CidFetchError(f"round {header.round}: {str(exc)[:600]}") from None
        for url, what in skipped:
            if what.startswith("lied"):
                log.warning("round %d: store source %s lied about %s (%s); skipped", header.round, url, cid, what)
            else:
                log.info("round %d: store source %s did not serve %s (%s)", header.round, url, cid, what)
        self.received(len(data))
        return data
