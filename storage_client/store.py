"""A content-addressed object store on local disk.

Objects are immutable byte strings filed under the sha256 of their contents:
root/objects/<hex[:2]>/<hex[2:]>. Because the name is the hash, every read is
re-hashed and a mismatch is reported rather than returned: silent disk
corruption or tampering with a checkpoint must never flow into training.

The codec is not part of the path: the same bytes stored as RAW and as JSON are
one file, and the caller's CID says how to interpret them.

All writes go through `write_atomic` (temp file, fsync, rename, fsync the
directory) so a crash leaves either the old state or the complete new object at
the final path, never a partial file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .canonical import canonical_json
from .cid import CID, Codec
from .errors import DilocoxError

_TMP_PREFIX = ".tmp-"
_CHUNK = 1 << 20  # hash large checkpoints in 1 MiB pieces instead of loading them whole


class StoreError(DilocoxError):
    """Base class for object store failures."""


class MissingObjectError(StoreError):
    """The requested object is not in the store."""

    def __init__(self, cid: CID, path: Path) -> None:
        super().__init__(f"object {cid} not found at {path}")
        self.cid = cid
        self.path = path


class CorruptObjectError(StoreError):
    """The stored bytes do not hash to the requested CID."""

    def __init__(self, cid: CID, path: Path, expected: str, actual: str) -> None:
        super().__init__(
            f"object {cid} at {path} is corrupt: expected sha256 {expected}, got {actual}"
        )
        self.cid = cid
        self.path = path
        self.expected = expected
        self.actual = actual


def _fsync_dir(path: Path) -> None:
    # A rename is only durable once the directory entry itself is on disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _ensure_dir(path: Path) -> None:
    """mkdir -p, fsyncing the parent of each directory we create so it survives a crash."""
    if path.is_dir():
        return
    _ensure_dir(path.parent)
    try:
        path.mkdir()
    except FileExistsError:  # another writer got there first
        return
    _fsync_dir(path.parent)


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` with `data` so that readers see the old file or the new one, never a mix.

    Creates missing parent directories. The file is made `mode`, 0644 by default (mkstemp's 0600
    would hide objects from other local readers); keys pass 0600.
    """
    path = Path(path)
    _ensure_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def _sha256_file(path: Path) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.digest()


def _as_cid(cid: CID | str) -> CID:
    if isinstance(cid, CID):
        return cid
    if isinstance(cid, str):
        return CID.parse(cid)
    raise TypeError(f"expected CID or str, got {type(cid).__name__}")


class ObjectStore:
    """Immutable, hash-verified objects under `root/objects/`."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.objects = self.root / "objects"
        _ensure_dir(self.objects)

    def path_of(self, cid: CID | str) -> Path:
        """Where the object's bytes live (whether or not they are there yet)."""
        h = _as_cid(cid).hex
        return self.objects / h[:2] / h[2:]

    def put(self, data: bytes, codec: Codec = Codec.RAW) -> CID:
        """Store `data` and return its CID; a no-op if a good copy is already stored."""
        cid = CID.of(data, codec)
        path = self.path_of(cid)
        try:
            if _sha256_file(path) == cid.digest:
                return cid
            # Present but corrupt: fall through and overwrite with the good bytes.
        except FileNotFoundError:
            pass
        write_atomic(path, data)
        return cid

    def put_json(self, obj: Any) -> CID:
        """Store `obj` as canonical JSON under a JSON-codec CID."""
        return self.put(canonical_json(obj), Codec.JSON)

    def get(self, cid: CID | str) -> bytes:
        """Return the object's bytes, verified against the CID."""
        cid = _as_cid(cid)
        path = self.path_of(cid)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise MissingObjectError(cid, path) from None
        actual = hashlib.sha256(data).digest()
        if actual != cid.digest:
            raise CorruptObjectError(cid, path, cid.hex, actual.hex())
        return data

    def get_json(self, cid: CID | str) -> Any:
        """Return the decoded JSON object stored under a JSON-codec CID."""
        cid = _as_cid(cid)
        if cid.codec != Codec.JSON:
            raise StoreError(f"object {cid} has codec {cid.codec.name}, not JSON; use get()")
        data = self.get(cid)
        try:
            return json.loads(data.decode("utf-8"))
        except ValueError as e:  # covers UnicodeDecodeError and JSONDecodeError
            path = self.path_of(cid)
            raise StoreError(f"object {cid} at {path} is not valid JSON: {e}") from None

    def has(self, cid: CID | str) -> bool:
        """Whether a file exists for the object (its contents are not checked)."""
        return self.path_of(cid).is_file()

    def verify(self, cid: CID | str) -> None:
        """Re-hash the stored object; raise MissingObjectError or CorruptObjectError if bad."""
        cid = _as_cid(cid)
        path = self.path_of(cid)
        try:
            actual = _sha256_file(path)
        except FileNotFoundError:
            raise MissingObjectError(cid, path) from None
        if actual != cid.digest:
            raise CorruptObjectError(cid, path, cid.hex, actual.hex())

    def __iter__(self) -> Iterator[str]:
        """Yield the sha256 hex of every stored object, in sorted order.

        Hex rather than CIDs because the codec is not recorded on disk.
        """
        for fanout in sorted(self.objects.iterdir()):
            if not fanout.is_dir() or len(fanout.name) != 2:
                continue
            for entry in sorted(fanout.iterdir()):
                if entry.name.startswith(_TMP_PREFIX) or not entry.is_file():
                    continue  # leftovers of interrupted writes are not objects
                yield fanout.name + entry.name

    def __contains__(self, cid: CID | str) -> bool:
        return self.has(cid)
