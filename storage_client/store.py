"""The local implementation of the Store door (storage_client.backend): objects on local disk.

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
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from .backend import CorruptObjectError, MissingObjectError, Store, as_cid
from .canonical import loads_bounded
from .cid import CID, Codec

_TMP_PREFIX = ".tmp-"
_CHUNK = 1 << 20  # hash large checkpoints in 1 MiB pieces instead of loading them whole


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
    tmp = _write_temp(path.parent, (data,), mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    _fsync_dir(path.parent)


def _write_temp(directory: Path, chunks: Iterable[bytes], mode: int,
                seen: Callable[[bytes], object] = lambda _: None) -> str:
    """A new temporary file in ``directory`` holding the bytes ``chunks`` join to (each passed to
    ``seen`` as it is written), made ``mode`` and fsynced: its path. Nothing is left if writing fails."""
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            for chunk in chunks:
                seen(chunk)
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return tmp


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _sha256_file(path: Path) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.digest()


class ObjectStore(Store):
    """Immutable, hash-verified objects under `root/objects/`; opened for a run by
    storage_client.backend.open_store."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.objects = self.root / "objects"
        _ensure_dir(self.objects)

    @property
    def location(self) -> str:
        return str(self.root)

    def path_of(self, cid: CID | str) -> Path:
        """Where the object's bytes live (whether or not they are there yet); for this store and
        tests that tamper with files, not for callers of the Store door."""
        h = as_cid(cid).hex
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

    def put_chunks(self, chunks: Iterable[bytes], codec: Codec = Codec.RAW) -> CID:
        """Store the bytes ``chunks`` join to, written and hashed as they come (never whole in
        memory), and return their CID; as ``put``, a good copy already stored is kept."""
        digest = hashlib.sha256()
        tmp = _write_temp(self.objects, chunks, 0o644, digest.update)  # not in a fan-out: never listed
        try:
            cid = CID(codec, digest.digest())
            path = self.path_of(cid)
            try:
                if _sha256_file(path) == cid.digest:
                    os.unlink(tmp)
                    return cid
            except FileNotFoundError:
                pass
            _ensure_dir(path.parent)
            os.replace(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        _fsync_dir(path.parent)
        return cid

    def get(self, cid: CID | str) -> bytes:
        """Return the object's bytes, verified against the CID."""
        cid = as_cid(cid)
        path = self.path_of(cid)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise MissingObjectError(cid, path) from None
        actual = hashlib.sha256(data).digest()
        if actual != cid.digest:
            raise CorruptObjectError(cid, path, cid.hex, actual.hex())
        return data

    def has(self, cid: CID | str) -> bool:
        """Whether a file exists for the object (its contents are not checked)."""
        return self.path_of(cid).is_file()

    def verify(self, cid: CID | str) -> None:
        """Re-hash the stored object; raise MissingObjectError or CorruptObjectError if bad."""
        cid = as_cid(cid)
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

    def size(self, cid: CID | str) -> int:
        cid = as_cid(cid)
        path = self.path_of(cid)
        try:
            return path.stat().st_size
        except FileNotFoundError:
            raise MissingObjectError(cid, path) from None

    def read_small_json(self, cid: CID | str, max_bytes: int) -> Any | None:
        # Size and first byte first: a walk over every object must not read and hash each tensor.
        cid = as_cid(cid)
        if self.size(cid) > max_bytes:
            return None
        try:
            with self.path_of(cid).open("rb") as f:
                if f.read(1) != b"{":
                    return None
        except FileNotFoundError:
            raise MissingObjectError(cid, self.path_of(cid)) from None
        return loads_bounded(self.get(cid), max_bytes=max_bytes, what=f"object {cid}")

    def remove(self, cid: CID | str) -> None:
        """Delete the object (MissingObjectError if absent). Local only: see trainer.runstore.gc."""
        cid = as_cid(cid)
        path = self.path_of(cid)
        try:
            path.unlink()
        except FileNotFoundError:
            raise MissingObjectError(cid, path) from None
