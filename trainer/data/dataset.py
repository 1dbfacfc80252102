"""A run's training and held-out tokens: the byte-token corpus, or a prepared token directory.

Every process that needs tokens (coordinator, worker, audit) opens them through :func:`open_dataset`,
so each derives the same shards, the same held-out split and the same dataDigest:

* ``data.tokens`` empty: :class:`CorpusDataset`, the corpus text as byte tokens
  (:func:`trainer.data.corpus.load_corpus`); slot k trains on ``Corpus.shard(k, W)``, its dataDigest is
  :func:`trainer.data.corpus.shard_digest` of it. Unchanged from before prepared data existed.
* ``data.tokens`` a directory written by ``dilocox data prepare`` (:mod:`trainer.data.prepare`):
  :class:`PreparedDataset`. The directory holds flat token files (nanoGPT style: the token ids of
  document after document, little-endian ``uint16`` where the vocabulary fits in 65536 ids, else
  ``uint32``), ``tokenizer.json`` for BPE, and ``index.json``, the canonical JSON below. The
  index's CID (JSON codec, over the file's bytes) is the data's identity, pinned in
  ``data.tokens_cid`` when the run is created.

Index (schema ``dilocox-tokens/1``)::

    {"schema": "dilocox-tokens/1",
     "tokenizer": {"kind": "byte" | "bpe", "cid": CID of tokenizer.json | null (byte),
                   "vocab_size": V, "eos_id": id | null (byte tokens have none)},
     "dtype": "uint16" | "uint32",
     "documents": {"train": n, "eval": m},
     "train": [{"file": "train-00000.bin", "tokens": t, "sha256": hex}, ...],
     "eval": {"file": "eval.bin", "tokens": t, "sha256": hex}}

With W = ``rounds.expected_workers`` and N train shards (N >= W, else refused), worker slot k
trains on shards k, k+W, k+2W, ... read as one sequence (windows may cross from one shard into
the next). Slot k's dataDigest is the shard's sha256 when it has one shard, else
sha256(d_k || d_{k+W} || ...) over the shards' 32-byte digests in that order.

Before any token is used, a file is verified against the index: present, size = tokens x itemsize,
sha256 equal (streamed in chunks), and every token < the tokenizer's vocabulary (checked in the same
pass, its progress shown when it is long: trainer.progress); then it is opened with
``numpy.memmap``, so a worker maps only its own shards and the held-out file, and corpora larger
than memory work. Every refusal is a :class:`DataError` naming the file or field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from storage_client import (
    CID,
    Codec,
    InvalidCIDError,
    JSONBoundsError,
    Store,
    canonical_json,
    loads_bounded,
)
from trainer.config import RunConfig
from trainer.data.corpus import Corpus, CorpusError, load_corpus, shard_digest
from trainer.progress import BYTES, Progress

INDEX_SCHEMA = "dilocox-tokens/1"
INDEX_FILE = "index.json"
TOKENIZER_FILE = "tokenizer.json"
MAX_INDEX_BYTES = 4 * 1024 * 1024
MAX_SHARDS = 4096
MAX_FILE_TOKENS = 1 << 40  # 2 TB of uint16: far beyond any single file here, small enough to multiply safely
MAX_VOCAB = 1 << 20  # = trainer.data.tokenizer.MAX_VOCAB
UINT16_VOCAB = 1 << 16  # ids 0..65535 fit uint16
HASH_CHUNK_BYTES = 8 * 1024 * 1024  # a multiple of every itemsize
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # no separators: files live in the directory itself
_SHA256 = re.compile(r"[0-9a-f]{64}")


class DataError(CorpusError):
    """Prepared tokens that cannot be used: a missing, truncated or altered file, a wrong dtype,
    an index or tokenizer that is not the pinned one, or a token outside the vocabulary."""


def dtype_for(vocab_size: int) -> str:
    """``uint16`` where every id of the vocabulary fits (vocab <= 65536), else ``uint32``."""
    return "uint16" if vocab_size <= UINT16_VOCAB else "uint32"


@dataclass(frozen=True)
class TokenFile:
    file: str
    tokens: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "tokens": self.tokens, "sha256": self.sha256}


@dataclass(frozen=True)
class TokenIndex:
    """The parsed, validated ``index.json`` of a prepared directory."""

    kind: str
    tokenizer_cid: str | None
    vocab_size: int
    eos_id: int | None
    dtype: str
    train_documents: int
    eval_documents: int
    train: tuple[TokenFile, ...]
    eval: TokenFile

    def to_json(self) -> dict[str, Any]:
        return {"schema": INDEX_SCHEMA,
                "tokenizer": {"kind": self.kind, "cid": self.tokenizer_cid, "vocab_size": self.vocab_size,
                              "eos_id": self.eos_id},
                "dtype": self.dtype, "documents": {"train": self.train_documents, "eval": self.eval_documents},
                "train": [f.to_json() for f in self.train], "eval": self.eval.to_json()}

    def canonical(self) -> bytes:
        return canonical_json(self.to_json())

    @property
    def cid(self) -> CID:
        return CID.of(self.canonical(), Codec.JSON)

    @classmethod
    def from_bytes(cls, data: bytes, what: str) -> TokenIndex:
        """Parse and validate every field; the bytes must be the canonical form (so one index has
        one CID)."""
        try:
            obj = loads_bounded(data, max_bytes=MAX_INDEX_BYTES, what=what)
        except JSONBoundsError as exc:
            raise DataError(str(exc)) from None
        if not isinstance(obj, dict) or obj.get("schema") != INDEX_SCHEMA:
            raise DataError(f"{what} is not a token index (schema {INDEX_SCHEMA!r})")
        index = _parse_index(obj, what)
        if index.canonical() != bytes(data):
            raise DataError(f"{what} is not in canonical form (sorted keys, no spaces), so its CID is not the index's")
        return index


def _field(obj: Any, key: str, kind: type | tuple, what: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise DataError(f"{what}: field {key!r} is missing")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise DataError(f"{what}: field {key!r} has the wrong type")
    return value


def _token_file(obj: Any, what: str) -> TokenFile:
    name = _field(obj, "file", str, what)
    tokens = _field(obj, "tokens", int, what)
    sha = _field(obj, "sha256", str, what)
    if not _FILE_NAME.fullmatch(name) or name in (INDEX_FILE, TOKENIZER_FILE):
        raise DataError(f"{what}: file name must match [A-Za-z0-9][A-Za-z0-9._-]{{0,63}}")
    if not 0 <= tokens <= MAX_FILE_TOKENS:
        raise DataError(f"{what}: tokens {tokens} is out of range [0, {MAX_FILE_TOKENS}]")
    if not _SHA256.fullmatch(sha):
        raise DataError(f"{what}: sha256 must be 64 lowercase hex digits")
    return TokenFile(name, tokens, sha)


def _parse_index(obj: dict, what: str) -> TokenIndex:
    tok = _field(obj, "tokenizer", dict, what)
    kind = _field(tok, "kind", str, f"{what} tokenizer")
    vocab = _field(tok, "vocab_size", int, f"{what} tokenizer")
    cid, eos = tok.get("cid"), tok.get("eos_id")
    if kind == "byte":
        if vocab != 256 or cid is not None or eos is not None:
            raise DataError(f"{what}: byte tokens have vocab_size 256, no tokenizer cid and no eos_id")
    elif kind == "bpe":
        if not 256 < vocab <= MAX_VOCAB:
            raise DataError(f"{what}: tokenizer vocab_size {vocab} is out of range (256, {MAX_VOCAB}]")
        if not isinstance(eos, int) or isinstance(eos, bool) or not 0 <= eos < vocab:
            raise DataError(f"{what}: tokenizer eos_id must be an id below vocab_size {vocab}")
        try:
            if not isinstance(cid, str) or CID.parse(cid).codec != Codec.RAW:
                raise DataError(f"{what}: tokenizer cid must be the raw CID of tokenizer.json")
        except InvalidCIDError:
            raise DataError(f"{what}: tokenizer cid is not a CID") from None
    else:
        raise DataError(f"{what}: tokenizer kind must be 'byte' or 'bpe'")
    dtype = _field(obj, "dtype", str, what)
    if dtype != dtype_for(vocab):
        raise DataError(f"{what}: dtype {dtype[:16]!r} does not fit vocab_size {vocab} (it must be {dtype_for(vocab)})")
    docs = _field(obj, "documents", dict, what)
    counts = [_field(docs, k, int, f"{what} documents") for k in ("train", "eval")]
    if not all(0 <= c <= MAX_FILE_TOKENS for c in counts):
        raise DataError(f"{what}: document counts are out of range")
    train = _field(obj, "train", list, what)
    if not 1 <= len(train) <= MAX_SHARDS:
        raise DataError(f"{what}: train lists {len(train)} shards; must be 1 to {MAX_SHARDS}")
    shards = tuple(_token_file(entry, f"{what} train[{i}]") for i, entry in enumerate(train))
    held_out = _token_file(_field(obj, "eval", dict, what), f"{what} eval")
    names = [f.file for f in shards] + [held_out.file]
    if len(set(names)) != len(names):
        raise DataError(f"{what}: two entries name the same file")
    return TokenIndex(kind, cid, vocab, eos, dtype, counts[0], counts[1], shards, held_out)


def verify_token_file(directory: Path, entry: TokenFile, dtype: str, vocab_size: int) -> np.ndarray:
    """The file as a read-only memmap, after checking it against its index entry: present, of
    tokens x itemsize bytes, of the index's sha256, every token < ``vocab_size`` (one streamed pass)."""
    path = directory / entry.file
    itemsize = np.dtype(dtype).itemsize
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise DataError(f"token file {path} is missing or unreadable ({exc.strerror})") from None
    if size != entry.tokens * itemsize:
        raise DataError(f"token file {path} is {size} bytes, but the index says {entry.tokens} tokens of {dtype} "
                        f"({entry.tokens * itemsize} bytes): wrong dtype, truncated or not this index's file")
    digest, buffer = hashlib.sha256(), bytearray(HASH_CHUNK_BYTES)
    with path.open("rb") as f, Progress(f"verifying {entry.file}", size, unit=BYTES, final_if_shown=True) as read:
        while n := f.readinto(buffer):
            read.advance(n)
            chunk = memoryview(buffer)[:n]
            digest.update(chunk)
            if n % itemsize:  # the size was checked; only a file growing under us gets here
                raise DataError(f"token file {path} changed while it was read")
            ids = np.frombuffer(chunk, dtype=np.dtype(dtype).newbyteorder("<"))
            if ids.size and int(ids.max()) >= vocab_size:
                raise DataError(f"token file {path} holds token {int(ids.max())}, outside the vocabulary of "
                                f"{vocab_size}")
    if digest.hexdigest() != entry.sha256:
        raise DataError(f"token file {path} has sha256 {digest.hexdigest()}, but the index says {entry.sha256}")
    if entry.tokens == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", shape=(entry.tokens,))


class TokenSpan:
    """Several token arrays read as one sequence; windows are copied out (never the whole span)."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = [p for p in parts if len(p)]
        self.starts = np.cumsum([0] + [len(p) for p in self.parts]).tolist()

    def __len__(self) -> int:
        return self.starts[-1]

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64."""
        out = np.empty(length, dtype=np.int64)
        filled = 0
        part = bisect_right(self.starts, start) - 1
        offset = start - self.starts[part]
        while filled < length:
            take = min(length - filled, len(self.parts[part]) - offset)
            out[filled:filled + take] = self.parts[part][offset:offset + take]
            filled, part, offset = filled + take, part + 1, 0
        return out


def slot_shards(slot: int, num_shards: int, slots: int) -> list[int]:
    """The train shards worker slot ``slot`` of ``slots`` trains on: slot, slot + W, ..."""
    return list(range(slot, num_shards, slots))


def slot_digest(index: TokenIndex, slot: int, slots: int) -> bytes:
    """dataDigest of slot ``slot``: its one shard's sha256, or sha256 over its shards' digests."""
    digests = [bytes.fromhex(index.train[i].sha256) for i in slot_shards(slot, len(index.train), slots)]
    return digests[0] if len(digests) == 1 else hashlib.sha256(b"".join(digests)).digest()


class CorpusDataset:
    """The corpus text as byte tokens (trainer.data.corpus), split as it always was."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.corpus: Corpus = load_corpus(config.data, config.seed, config.model.block_size)
        self.slots = config.rounds.expected_workers
        self.shard_digests = [shard_digest(self.slot_tokens(k)) for k in range(self.slots)]

    def slot_tokens(self, slot: int) -> torch.Tensor:
        return self.corpus.shard(slot, self.slots)

    def eval_tokens(self) -> torch.Tensor:
        return self.corpus.eval


class PreparedDataset:
    """A prepared token directory, checked against the run's config and the pinned index CID.

    ``index_bytes`` are the index as the run's store holds it; without them it is read from the
    directory. Nothing but the index is read until a slot's or the held-out tokens are asked for.
    """

    def __init__(self, config: RunConfig, index_bytes: bytes | None = None) -> None:
        data = config.data
        self.directory = Path(data.tokens)
        self.config = config
        what = f"token index {self.directory / INDEX_FILE}"
        if index_bytes is None:
            index_bytes = read_index_bytes(self.directory)
        cid = CID.of(index_bytes, Codec.JSON)
        if data.tokens_cid and str(cid) != data.tokens_cid:
            raise DataError(f"{what} has CID {cid}, but the run pinned data.tokens_cid {data.tokens_cid}: "
                            f"these are not the run's tokens")
        self.index_bytes = bytes(index_bytes)
        self.cid = cid
        self.index = TokenIndex.from_bytes(index_bytes, what)
        self.slots = config.rounds.expected_workers
        check_index_fits(self.index, config, what)
        self.shard_digests = [slot_digest(self.index, k, self.slots) for k in range(self.slots)]
        self._verified: dict[int, np.ndarray] = {}

    def _file(self, i: int | None) -> np.ndarray:
        key = -1 if i is None else i
        if key not in self._verified:
            entry = self.index.eval if i is None else self.index.train[i]
            self._verified[key] = verify_token_file(self.directory, entry, self.index.dtype, self.index.vocab_size)
        return self._verified[key]

    def slot_tokens(self, slot: int) -> TokenSpan:
        if not 0 <= slot < self.slots:
            raise DataError(f"slot {slot} out of range for {self.slots} worker slots")
        return TokenSpan([self._file(i) for i in slot_shards(slot, len(self.index.train), self.slots)])

    def eval_tokens(self) -> TokenSpan:
        return TokenSpan([self._file(None)])

    def verify_tokenizer(self) -> bytes | None:
        """tokenizer.json's bytes, checked against the index's CID (None for byte tokens)."""
        if self.index.kind != "bpe":
            return None
        path = self.directory / TOKENIZER_FILE
        from trainer.data.tokenizer import MAX_TOKENIZER_BYTES

        try:
            if path.stat().st_size > MAX_TOKENIZER_BYTES:
                raise DataError(f"tokenizer {path} is larger than the {MAX_TOKENIZER_BYTES} bytes allowed")
            raw = path.read_bytes()
        except OSError as exc:
            raise DataError(f"tokenizer {path} is missing or unreadable ({exc.strerror})") from None
        if str(CID.of(raw)) != self.index.tokenizer_cid:
            raise DataError(f"tokenizer {path} has CID {CID.of(raw)}, but the index pins {self.index.tokenizer_cid}")
        return raw


def read_index_bytes(directory: Path) -> bytes:
    path = directory / INDEX_FILE
    try:
        if path.stat().st_size > MAX_INDEX_BYTES:
            raise DataError(f"token index {path} is larger than the {MAX_INDEX_BYTES} bytes allowed")
        return path.read_bytes()
    except OSError as exc:
        raise DataError(f"token index {path} is missing or unreadable ({exc.strerror}): data.tokens must be a "
                        f"directory written by `dilocox data prepare`") from None


def check_index_fits(index: TokenIndex, config: RunConfig, what: str) -> None:
    """The model's vocabulary covers the tokenizer's; every slot has a shard and room for a window;
    the held-out file has room for a window."""
    m, slots = config.model, config.rounds.expected_workers
    if m.vocab_size < index.vocab_size:
        raise DataError(f"model.vocab_size {m.vocab_size} is smaller than the tokenizer's vocabulary "
                        f"{index.vocab_size} ({what})")
    if len(index.train) < slots:
        raise DataError(f"{what} has {len(index.train)} train shards, fewer than rounds.expected_workers {slots}: "
                        f"prepare with --shards {slots} or more")
    for k in range(slots):
        tokens = sum(index.train[i].tokens for i in slot_shards(k, len(index.train), slots))
        if tokens <= m.block_size + 1:
            raise DataError(f"{what}: worker slot {k} has {tokens} train tokens, too few for a window of "
                            f"model.block_size + 1 = {m.block_size + 1}")
    if index.eval.tokens <= m.block_size + 1:
        raise DataError(f"{what}: the held-out file {index.eval.file} has {index.eval.tokens} tokens, too few for "
                        f"a window of model.block_size + 1 = {m.block_size + 1}")


Dataset = CorpusDataset | PreparedDataset


def open_dataset(config: RunConfig, index_bytes: bytes | None = None) -> Dataset:
    """The run's tokens: prepared when ``data.tokens`` is set, else the corpus as byte tokens."""
    if config.data.tokens:
        return PreparedDataset(config, index_bytes)
    return CorpusDataset(config)


def run_dataset(config: RunConfig, store: Store | None) -> Dataset:
    """The tokens of a created run as a holder of its store opens them (the coordinator resuming,
    the audit): a prepared run's index is the pinned one from the store, never the directory's."""
    if not config.data.tokens:
        return CorpusDataset(config)
    cid = config.data.tokens_cid
    if not cid:
        raise DataError("data.tokens is set but data.tokens_cid is not: the run's token index was never pinned")
    try:
        if store is None:
            raise DataError("no store to read it from")
        index_bytes = store.get(cid)
    except (OSError, ValueError) as exc:  # StoreError is a ValueError
        raise DataError(f"the run's token index {cid} cannot be read from its store: {exc}") from None
    return PreparedDataset(config, index_bytes)


def pin_dataset(config: RunConfig, store: Store | None = None) -> tuple[RunConfig, Dataset]:
    """At run creation: open the tokens, pin their identity in the config (``data.corpus_sha256``,
    or ``data.tokens_cid`` with the index and tokenizer.json put into the run's store, when given,
    so the audit reads them from the store alone), and return both."""
    dataset = open_dataset(config)
    if isinstance(dataset, CorpusDataset):
        return config.replace(data=dataclasses.replace(config.data, corpus_sha256=dataset.corpus.sha256)), dataset
    tokenizer = dataset.verify_tokenizer()
    if store is not None:
        if tokenizer is not None:
            store.put(tokenizer)
        store.put(dataset.index_bytes, Codec.JSON)
    return config.replace(data=dataclasses.replace(config.data, tokens_cid=str(dataset.cid))), dataset
