"""``dilocox data prepare``: tokenize a corpus once into flat token files and their index.

Inputs, in the order given:

* a text file: cut into documents at blank lines (a line holding only whitespace), and a document
  growing past :data:`MAX_DOCUMENT_CHARS` is cut at the next line end; lines longer than
  :data:`MAX_LINE_CHARS` are read in pieces of that size.
* a JSON-lines file (name ending ``.jsonl``): one document per non-blank line, an object with a
  string field ``"text"``; a line longer than :data:`MAX_JSONL_LINE_BYTES` or that is not such an
  object is refused, naming the file and the line.
* a directory: every ``.txt``, ``.text``, ``.md`` (text) and ``.jsonl`` file below it, walked in
  sorted order (directories and files by name); hidden names (starting with ``.``), symbolic links
  and other suffixes are skipped (and counted as skipped).

Split. With ``eval_inputs``, every document of those files is held out and every document of the
inputs trains. Otherwise document i (0-based, over all inputs in order) is held out iff
⌊(i+1)·F⌋ > ⌊i·F⌋ for F = ``eval_fraction``, which holds out ⌊n·F⌋ of the first n documents spread
evenly (F = 0.1: documents 9, 19, 29, ...). Train document j (0-based among the train documents)
goes to shard j mod N.

Tokens. BPE: each document's ids followed by the end-of-text id. Byte tokens (no end-of-text id):
each document's UTF-8 bytes with its trailing newlines replaced by one blank line (``\\n\\n``).
Documents are tokenized in batches and written as they are tokenized, so at most one batch of
tokens is in memory; a BPE tokenizer is trained first, in one streaming pass over the train
documents. The input bytes read are shown as progress (trainer.progress), once for the BPE pass
and once for tokenizing. The index (trainer.data.dataset) is written last; a refused input removes the token files
written so far, and a directory without ``index.json`` is never a prepared one.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Iterator

import numpy as np

from storage_client import JSONBoundsError, loads_bounded
from trainer.data.dataset import (
    INDEX_FILE,
    MAX_SHARDS,
    TOKENIZER_FILE,
    DataError,
    TokenFile,
    TokenIndex,
    dtype_for,
)
from trainer.data.tokenizer import BpeTokenizer, ByteTokenizer, Tokenizer, tokenizer_for
from trainer.progress import BYTES, Progress

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIX = ".jsonl"
MAX_LINE_CHARS = 1 << 20
MAX_DOCUMENT_CHARS = 1 << 20
MAX_JSONL_LINE_BYTES = 16 << 20
BATCH_CHARS = 1 << 20  # text tokenized per batch: bounds the tokens held in memory
MAX_INPUT_FILES = 1_000_000


@dataclass(frozen=True)
class Source:
    path: Path
    jsonl: bool


@dataclass
class Sources:
    files: list[Source] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)


def find_sources(inputs: list[Path]) -> Sources:
    """The files that count, in order: given files as they are, directories walked sorted."""
    out = Sources()
    for given in inputs:
        if given.is_dir():
            for root, dirs, files in os.walk(given, followlinks=False):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(files):
                    path = Path(root) / name
                    counts = not name.startswith(".") and not path.is_symlink() and path.is_file() and (
                        name.endswith(TEXT_SUFFIXES) or name.endswith(JSONL_SUFFIX))
                    (out.files.append(Source(path, name.endswith(JSONL_SUFFIX))) if counts
                     else out.skipped.append(path))
        elif given.is_file():
            out.files.append(Source(given, given.name.endswith(JSONL_SUFFIX)))
        else:
            raise DataError(f"input {given} is neither a file nor a directory")
        if len(out.files) > MAX_INPUT_FILES:
            raise DataError(f"more than {MAX_INPUT_FILES} input files")
    if not out.files:
        raise DataError("no input file counts (text: .txt .text .md; JSON lines: .jsonl)")
    return out


def _text_documents(path: Path) -> Iterator[str]:
    lines: list[str] = []
    size = 0
    number = 0
    try:
        with path.open("r", encoding="utf-8", newline=None) as f:
            while line := f.readline(MAX_LINE_CHARS):
                number += 1
                if not line.strip():
                    if lines:
                        yield "".join(lines)
                    lines, size = [], 0
                    continue
                lines.append(line)
                size += len(line)
                if size >= MAX_DOCUMENT_CHARS and line.endswith("\n"):
                    yield "".join(lines)
                    lines, size = [], 0
    except UnicodeDecodeError:
        raise DataError(f"{path} near line {number + 1}: not UTF-8 text") from None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}") from None
    if lines:
        yield "".join(lines)


def _jsonl_documents(path: Path) -> Iterator[str]:
    try:
        with path.open("rb") as f:
            number = 0
            while line := f.readline(MAX_JSONL_LINE_BYTES + 1):
                number += 1
                if len(line) > MAX_JSONL_LINE_BYTES:
                    raise DataError(f"{path} line {number}: longer than {MAX_JSONL_LINE_BYTES} bytes")
                if not line.strip():
                    continue
                try:
                    obj = loads_bounded(line, max_bytes=MAX_JSONL_LINE_BYTES, what=f"{path} line {number}")
                except JSONBoundsError as exc:
                    raise DataError(str(exc)) from None
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                    raise DataError(f"{path} line {number}: not an object with a string field \"text\"")
                if obj["text"]:
                    yield obj["text"]
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}") from None


def documents(sources: list[Source], progress: Progress | None = None) -> Iterator[str]:
    """The documents of ``sources`` in order; ``progress`` counts the input bytes read (a document's
    characters while in a file, the file's exact size at its end)."""
    for source in sources:
        before = progress.done if progress is not None else 0
        for doc in (_jsonl_documents if source.jsonl else _text_documents)(source.path):
            if progress is not None:
                progress.advance(len(doc))
            yield doc
        if progress is not None:
            progress.advance(before + _size(source.path) - progress.done)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def held_out(i: int, fraction: Fraction) -> bool:
    """Document i is held out iff ⌊(i+1)·F⌋ > ⌊i·F⌋."""
    return (i + 1) * fraction.numerator // fraction.denominator > i * fraction.numerator // fraction.denominator


class TokenWriter:
    """One flat token file, hashed and counted as it is written."""

    def __init__(self, path: Path, dtype: str) -> None:
        self.path = path
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.file = path.open("xb")
        self.sha256 = hashlib.sha256()
        self.tokens = 0
        self.documents = 0

    def write(self, ids: list[int]) -> None:
        data = np.asarray(ids, dtype=self.dtype).tobytes()
        self.file.write(data)
        self.sha256.update(data)
        self.tokens += len(ids)
        self.documents += 1

    def close(self) -> TokenFile:
        self.file.close()
        return TokenFile(self.path.name, self.tokens, self.sha256.hexdigest())


@dataclass(frozen=True)
class Prepared:
    index: TokenIndex
    sources: Sources
    eval_sources: Sources | None


def _document_ids(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    if tokenizer.eos_id is None:
        return tokenizer.encode_batch([t.rstrip("\n") + "\n\n" for t in texts])
    return [ids + [tokenizer.eos_id] for ids in tokenizer.encode_batch(texts)]


def _routed(train: list[Source], held: list[Source] | None, fraction: Fraction,
            progress: Progress | None = None) -> Iterator[tuple[bool, str]]:
    """(held out?, document) in order."""
    if held is not None:
        yield from ((False, d) for d in documents(train, progress))
        yield from ((True, d) for d in documents(held, progress))
        return
    for i, doc in enumerate(documents(train, progress)):
        yield held_out(i, fraction), doc


def prepare(inputs: list[Path], out: Path, *, tokenizer: str = "byte", vocab_size: int = 8192, shards: int = 1,
            eval_fraction: float = 0.05, eval_inputs: list[Path] | None = None) -> Prepared:
    """Tokenize ``inputs`` into ``out`` (created; must not exist or be empty) and write its index."""
    if not 1 <= shards <= MAX_SHARDS:
        raise DataError(f"--shards {shards} is out of range: must be in [1, {MAX_SHARDS}]")
    if not 0 < eval_fraction < 1:
        raise DataError(f"--eval-fraction {eval_fraction} is out of range: must be in (0, 1)")
    fraction = Fraction(eval_fraction).limit_denominator(1_000_000)
    sources = find_sources(inputs)
    eval_sources = find_sources(eval_inputs) if eval_inputs else None
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"--out {out} exists and is not an empty directory")
    held = eval_sources.files if eval_sources else None
    input_bytes = sum(_size(s.path) for s in [*sources.files, *(held or [])])
    if tokenizer == "bpe":
        with Progress("data prepare: reading for the BPE tokenizer", input_bytes, unit=BYTES) as reading:
            tok: Tokenizer = tokenizer_for(
                tokenizer, (d for h, d in _routed(sources.files, held, fraction, reading) if not h), vocab_size)
    else:
        tok = tokenizer_for(tokenizer)
    dtype = dtype_for(tok.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    writers = [TokenWriter(out / f"train-{k:05d}.bin", dtype) for k in range(shards)]
    eval_writer = TokenWriter(out / "eval.bin", dtype)
    trained = 0
    batch: list[tuple[bool, str]] = []
    size = 0

    def flush() -> None:
        nonlocal trained
        for (is_eval, _), ids in zip(batch, _document_ids(tok, [d for _, d in batch])):
            if is_eval:
                eval_writer.write(ids)
            else:
                writers[trained % shards].write(ids)
                trained += 1
        batch.clear()

    try:
        with Progress("data prepare: tokenizing", input_bytes, unit=BYTES) as tokenizing:
            for routed in _routed(sources.files, held, fraction, tokenizing):
                batch.append(routed)
                size += len(routed[1])
                if size >= BATCH_CHARS:
                    flush()
                    size = 0
            flush()
    except BaseException:  # a refused input leaves no half-written token files behind
        for writer in [*writers, eval_writer]:
            writer.close()
            writer.path.unlink(missing_ok=True)
        raise
    files = [w.close() for w in writers]
    held_file = eval_writer.close()
    if held_file.tokens == 0:
        raise DataError("no document was held out for evaluation: give --eval-input, a larger --eval-fraction, "
                        "or more documents")
    empty = [f.file for f in files if f.tokens == 0]
    if empty:
        raise DataError(f"{trained} train documents leave {len(empty)} of {shards} shards empty ({empty[0]}, ...): "
                        f"use fewer --shards")
    bpe = isinstance(tok, BpeTokenizer)
    if bpe:
        (out / TOKENIZER_FILE).write_bytes(tok.json_bytes)
    index = TokenIndex(tok.kind, str(tok.cid) if bpe else None, tok.vocab_size, tok.eos_id, dtype, trained,
                       eval_writer.documents, tuple(files), held_file)
    (out / INDEX_FILE).write_bytes(index.canonical())
    return Prepared(index, sources, eval_sources)


__all__ = ["ByteTokenizer", "Prepared", "find_sources", "held_out", "prepare"]
