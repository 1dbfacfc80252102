"""The store door: what a run's readers and writers need of a content-addressed store, and the one
place that opens a run's store.

Every object is an immutable byte string named by a CID (storage_client.cid): the sha256 of its
bytes plus a codec that says how to read them. ``Store`` is the interface the trainer, settlement
and audit code is written against; ``ObjectStore`` (storage_client.store, files under
``<run>/store/objects``) is its local implementation, and ``open_store`` is where a run directory
becomes a store. A new backend (an IPFS gateway, S3) is one module that subclasses ``Store`` and
implements its primitives, plus the line in ``open_store`` that chooses it.

Removing objects is not part of the door: garbage collection works on a local run directory (its
lock, HEAD and pending journals; trainer.runstore.gc) and removes through ``ObjectStore.remove``.
"""

from __future__ import annotations

import json
import os
from abc import abstractmethod
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .canonical import canonical_json
from .cid import CID, Codec
from .errors import DilocoxError

if TYPE_CHECKING:
    from .store import ObjectStore

RUN_STORE_DIR = "store"  # a run's objects live under <run>/store


class StoreError(DilocoxError, ValueError):
    """Base class for object store failures: a ValueError, like every refusal of bytes read from
    outside, so a reader that catches (OSError, ValueError) around a read names a missing or
    corrupt object instead of crashing on it."""


class MissingObjectError(StoreError):
    """The requested object is not in the store."""

    def __init__(self, cid: CID, path: Path | str) -> None:
        super().__init__(f"object {cid} not found at {path}")
        self.cid = cid
        self.path = path


class CorruptObjectError(StoreError):
    """The stored bytes do not hash to the requested CID."""

    def __init__(self, cid: CID, path: Path | str, expected: str, actual: str) -> None:
        super().__init__(
            f"object {cid} at {path} is corrupt: expected sha256 {expected}, got {actual}"
        )
        self.cid = cid
        self.path = path
        self.expected = expected
        self.actual = actual


def as_cid(cid: CID | str) -> CID:
    """A CID given as one or as its text (InvalidCIDError for bad text)."""
    if isinstance(cid, CID):
        return cid
    if isinstance(cid, str):
        return CID.parse(cid)
    raise TypeError(f"expected CID or str, got {type(cid).__name__}")


@runtime_checkable
class Store(Protocol):
    """Immutable objects named by their CID; every read is checked against the CID.

    Primitives (a backend implements these): ``location``, ``put``, ``get``, ``has``, ``size``,
    ``__iter__`` and ``read_small_json``. ``put_json``, ``get_json`` and ``in`` are written once here
    on top of them. Failures are ``StoreError``: ``MissingObjectError`` for an absent object,
    ``CorruptObjectError`` for bytes that do not hash to the CID.
    """

    @property
    @abstractmethod
    def location(self) -> str:
        """Where the objects live, for messages (a directory, a URL)."""

    @abstractmethod
    def put(self, data: bytes, codec: Codec = Codec.RAW) -> CID:
        """Store ``data`` and return its CID; a no-op if a good copy is already stored."""

    @abstractmethod
    def get(self, cid: CID | str) -> bytes:
        """The object's bytes, verified against the CID."""

    @abstractmethod
    def has(self, cid: CID | str) -> bool:
        """Whether the object is stored (its contents are not checked)."""

    @abstractmethod
    def size(self, cid: CID | str) -> int:
        """The stored object's length in bytes, without reading it (MissingObjectError if absent)."""

    @abstractmethod
    def __iter__(self) -> Iterator[str]:
        """The sha256 hex of every stored object, sorted. Hex rather than CIDs: one stored object
        serves every codec, so the codec is the caller's to choose."""

    @abstractmethod
    def read_small_json(self, cid: CID | str, max_bytes: int) -> Any | None:
        """The object parsed as a JSON object when it is one of at most ``max_bytes`` bytes; None
        when it is larger or does not start with ``{`` (a tensor, a payload), told apart as cheaply
        as the backend can. Malformed JSON raises ValueError, a missing or corrupt object StoreError.
        For walks over every object (gc, the audit's search for unrecorded rounds)."""

    def put_chunks(self, chunks: Iterable[bytes], codec: Codec = Codec.RAW) -> CID:
        """``put`` of the bytes ``chunks`` join to; a backend that can write them as they come (the
        local store) does not join them first."""
        return self.put(b"".join(chunks), codec)

    def put_json(self, obj: Any) -> CID:
        """Store ``obj`` as canonical JSON under a JSON-codec CID."""
        return self.put(canonical_json(obj), Codec.JSON)

    def get_json(self, cid: CID | str) -> Any:
        """The decoded JSON object stored under a JSON-codec CID."""
        cid = as_cid(cid)
        if cid.codec != Codec.JSON:
            raise StoreError(f"object {cid} has codec {cid.codec.name}, not JSON; use get()")
        data = self.get(cid)
        try:
            return json.loads(data.decode("utf-8"))
        except ValueError as e:  # covers UnicodeDecodeError and JSONDecodeError
            raise StoreError(f"object {cid} in {self.location} is not valid JSON: {e}") from None

    def __contains__(self, cid: CID | str) -> bool:
        return self.has(cid)


def open_store(run_dir: str | os.PathLike[str]) -> ObjectStore:
    """The store of the run directory ``run_dir`` (created if absent): every caller that opens a
    run's store opens it here. Typed as the local store because gc removes through it."""
    from .store import ObjectStore  # store.py implements Store, so it imports this module first

    return ObjectStore(Path(run_dir) / RUN_STORE_DIR)
