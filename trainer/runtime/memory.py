"""Giving freed memory back to the operating system, where the C library allows it.

torch allocates CPU tensors with the C library's malloc. glibc serves a request below its mmap
threshold from a heap arena, and that threshold rises (up to 32 MiB) each time a larger mmapped
block is freed, so after the first few multi-megabyte tensors are freed nearly every tensor comes
from an arena; freed, its pages stay in the process (RSS) until ``malloc_trim`` hands free pages
back. The coordinator frees a model's worth of tensors at every push and every close, in several
threads (each with its own arena), so without trimming its RSS keeps the high-water mark of every
phase rather than what is live (docs/measurements.md). ``release_free_memory`` is that trim: cheap
(it walks the arenas' free lists) and a no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim with
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Return the free pages of every malloc arena to the OS; False where that is not possible."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
