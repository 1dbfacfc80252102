"""Tokenizers: byte tokens, and byte-level BPE through Hugging Face ``tokenizers``.

* ``ByteTokenizer``: the UTF-8 bytes of a text are its tokens (vocabulary 256, no special token);
  what :mod:`trainer.data.corpus` has always used.
* ``BpeTokenizer``: byte-level BPE (GPT-2 style). The ByteLevel pre-tokenizer maps every byte to
  one of 256 printable symbols, so any UTF-8 text encodes with no unknown token and decodes back
  exactly; merges are learned on top of those 256 symbols. One special token ends each document
  (:data:`EOS_TOKEN`, or the first of :data:`EOS_CANDIDATES` a given tokenizer.json has).

A BPE tokenizer is loaded from a local ``tokenizer.json`` (at most :data:`MAX_TOKENIZER_BYTES`,
never from a hub) or trained offline with ``BpeTrainer`` on an iterator of documents. Its identity
is the CID (RAW codec) of its ``tokenizer.json`` bytes: the bytes are what is stored, pinned and
compared. Training is deterministic: the same documents and vocabulary size give the same bytes
(the trainer counts pairs exactly and breaks ties by the pair itself; tests/unit/test_tokenizer.py
trains twice and compares).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Protocol

from storage_client import CID
from trainer.data.corpus import CorpusError

EOS_TOKEN = "<|endoftext|>"
# The end-of-text tokens of common tokenizer.json files (GPT-2/Qwen2, Llama 3, Llama 2/Mistral).
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>")
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024  # Qwen2's tokenizer.json is about 7 MB
MIN_BPE_VOCAB = 260  # the 256 byte symbols, the end-of-text token, and a few merges
MAX_VOCAB = 1 << 20  # uint32 token files hold any id; a bound keeps embeddings and checks sane
BYTE_VOCAB = 256


class TokenizerError(CorpusError):
    """A tokenizer that cannot be read, trained or used, or that is not the one pinned."""


class Tokenizer(Protocol):
    kind: str  # "byte" or "bpe"
    vocab_size: int
    eos_id: int | None

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens; no end-of-text token (documents are separated by a blank line)."""

    kind = "byte"
    vocab_size = BYTE_VOCAB
    eos_id = None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class BpeTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` with its tokenizer.json bytes and their CID."""

    kind = "bpe"

    def __init__(self, json_bytes: bytes, what: str = "tokenizer.json") -> None:
        from tokenizers import Tokenizer as HfTokenizer

        if len(json_bytes) > MAX_TOKENIZER_BYTES:
            raise TokenizerError(f"{what} is {len(json_bytes)} bytes, more than the {MAX_TOKENIZER_BYTES} allowed")
        try:
            text = json_bytes.decode("utf-8")
            self._tokenizer = HfTokenizer.from_str(text)
        except Exception as exc:  # UnicodeDecodeError, or the Rust parser's own Exception type
            reason = " ".join(str(exc).split())[:200]
            raise TokenizerError(f"{what} is not a tokenizer.json that `tokenizers` can load: {reason}") from None
        self.json_bytes = bytes(json_bytes)
        self.cid = CID.of(self.json_bytes)
        self.vocab_size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))
        if not MIN_BPE_VOCAB <= self.vocab_size <= MAX_VOCAB:
            raise TokenizerError(f"{what} has a vocabulary of {self.vocab_size}; it must be in "
                                 f"[{MIN_BPE_VOCAB}, {MAX_VOCAB}]")
        ids = [self._tokenizer.token_to_id(token) for token in EOS_CANDIDATES]
        found = next(((token, i) for token, i in zip(EOS_CANDIDATES, ids) if i is not None), None)
        if found is None:
            raise TokenizerError(f"{what} has no end-of-text token (one of {', '.join(EOS_CANDIDATES)})")
        self.eos_token, self.eos_id = found[0], int(found[1])

    @classmethod
    def load(cls, path: Path) -> BpeTokenizer:
        """A local tokenizer.json; its size is checked before it is read."""
        try:
            size = path.stat().st_size
            if size > MAX_TOKENIZER_BYTES:
                raise TokenizerError(f"tokenizer {path} is {size} bytes, more than the {MAX_TOKENIZER_BYTES} allowed")
            data = path.read_bytes()
        except OSError as exc:
            raise TokenizerError(f"cannot read tokenizer {path}: {exc.strerror}") from None
        return cls(data, what=f"tokenizer {path}")

    @classmethod
    def train(cls, documents: Iterable[str], vocab_size: int) -> BpeTokenizer:
        """Byte-level BPE trained on ``documents`` up to ``vocab_size`` tokens (fewer when the text
        has fewer distinct pairs), with :data:`EOS_TOKEN` as id 0."""
        from tokenizers import Tokenizer as HfTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        if not MIN_BPE_VOCAB <= vocab_size <= MAX_VOCAB:
            raise TokenizerError(f"--vocab-size {vocab_size} is out of range: must be in [{MIN_BPE_VOCAB}, {MAX_VOCAB}]")
        tokenizer = HfTokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tokenizer.train_from_iterator(documents, trainer=trainer)
        return cls(tokenizer.to_str().encode("utf-8"), what="the trained tokenizer")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)


def tokenizer_for(spec: str, documents: Iterable[str] | None = None, vocab_size: int = 0) -> Tokenizer:
    """``byte``, ``bpe`` (trained on ``documents`` to ``vocab_size``) or a path to a tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "bpe":
        if documents is None:
            raise TokenizerError("a BPE tokenizer is trained on documents; none were given")
        return BpeTokenizer.train(documents, vocab_size)
    return BpeTokenizer.load(Path(spec))
