"""Bytes a peer streams in, written to the run's scratch folder as they arrive instead of joined in
memory: a push's inner state (trainer.runtime.state_commit) is three times the model, and the
coordinator's memory must not grow with it (issue 30: its peak RSS within 4 × the model + 1 GiB).

A ``Spool`` is a ``trainer.codec.wire.Reassembly`` (its refusals: a chunk over ``CHUNK_BYTES``, a
byte past the declared size, a short total, a digest that is not the declared one) that keeps the
bytes in a file instead of a buffer. It is read back in pieces (``chunks``) or checked from its
file by a worker thread (each inside ``in_use``), and is removed by ``discard``, which its owner always calls, also when the call is cancelled while a thread
still reads it: the file goes when the last reader is done, and a reader that comes after the
discard is refused (a coordinator's start also empties the folder: a crash's leftovers). The file
is made at the first byte, so a push that carries no state costs no file. An ``OSError`` (a full
disk) goes to the caller as it is: the coordinator answers UNAVAILABLE and the worker retries.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import BinaryIO, Iterator

from trainer.codec.wire import Reassembly

READ_PIECE = 8 << 20  # bytes handed out at a time by ``chunks``


class Spool(Reassembly):
    def __init__(self, folder: Path, size: int, sha256: str, *, what: str) -> None:
        super().__init__(size, sha256, what=what)
        self.folder = folder
        self.path: Path | None = None
        self._file: BinaryIO | None = None
        self._lock = threading.Lock()
        self._readers, self._discarded = 0, False

    def _keep(self, chunk: bytes) -> None:
        if self._file is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(dir=self.folder, prefix="spool-")
            self.path, self._file = Path(name), os.fdopen(fd, "wb")
        self._file.write(chunk)

    def finish(self) -> None:
        """``check_whole``, then the file closed for its readers."""
        self.check_whole()
        if self._file is not None:
            self._file.close()
            self._file = None

    @contextlib.contextmanager
    def in_use(self) -> Iterator[Path | None]:
        """The file (None for no bytes) kept until the block ends, whatever ``discard`` does meanwhile;
        OSError once it was discarded."""
        with self._lock:
            if self._discarded:
                raise OSError(f"{self.what}: the spool was discarded (its call ended)")
            self._readers += 1
        try:
            yield self.path
        finally:
            with self._lock:
                self._readers -= 1
                last = self._discarded and not self._readers
            if last:
                self._remove()

    def chunks(self) -> Iterator[memoryview]:
        """The finished bytes, ``READ_PIECE`` at a time, each a view of one reused buffer: valid until
        the next is asked for (a consumer that hashes and writes each as it comes, as
        ``Store.put_chunks`` does, never allocates a piece). Read inside ``in_use``."""
        if self.path is None:
            return
        buffer = bytearray(READ_PIECE)
        with open(self.path, "rb") as f:
            while n := f.readinto(buffer):
                yield memoryview(buffer)[:n]

    def discard(self) -> None:
        """Remove the file now, or when its last reader is done."""
        with self._lock:
            self._discarded = True
            if self._readers:
                return
        self._remove()

    def _remove(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None


def empty_scratch(folder: Path) -> None:
    """Remove what a previous process left in ``folder`` (spools of pushes it never finished)."""
    shutil.rmtree(folder, ignore_errors=True)
