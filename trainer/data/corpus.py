"""Tokens: a byte-level tokenizer, the embedded corpus, shards and deterministic batches.

* Tokenizer: UTF-8 bytes are the tokens (vocabulary 256), so nothing is downloaded and every
  process tokenizes identically.
* Corpus: a local text file, or ``"embedded"``: English-like prose the project generates from the
  run seed (a small grammar over a fixed lexicon), so the default run needs no data at all.
* Split: the last ``eval_fraction`` of the tokens is held out for evaluation; the rest is cut into
  ``num_shards`` contiguous shards, one per worker slot.
* Batches: the windows of round r, step s on shard k are drawn from a generator seeded by
  (seed, k, r), so a round can be replayed exactly from the configuration alone.

Processes open a run's tokens through :mod:`trainer.data.dataset`, which uses this module for a corpus
and reads prepared token files (``dilocox data prepare``, BPE or bytes) otherwise; the batches of
either come from :func:`sample_batch`.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np
import torch

from storage_client import DilocoxError
from trainer.config import DataConfig

EMBEDDED_CORPUS_BYTES = 400_000


def encode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(tokens: torch.Tensor) -> str:
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


_SUBJECTS = [
    "the miller", "the old captain", "a young weaver", "the queen", "my brother", "the farmer",
    "the river pilot", "a quiet scholar", "the blacksmith", "her mother", "the merchant",
    "the night watchman", "a travelling singer", "the shepherd", "the harbour master",
]
_VERBS = [
    "carried", "mended", "sold", "painted", "found", "lost", "counted", "watched", "opened",
    "remembered", "planted", "burned", "followed", "buried", "wrote to",
]
_OBJECTS = [
    "the broken lantern", "a basket of apples", "the letters", "an iron key", "the red boat",
    "a map of the valley", "the silver cup", "three grey horses", "the winter wheat",
    "a book of songs", "the old bridge", "the tower bell", "a sack of flour", "the north gate",
]
_PLACES = [
    "by the mill", "in the market", "before dawn", "at the edge of the forest", "on the hill",
    "near the harbour", "after the storm", "under the bridge", "in the long hall",
    "beside the well", "across the river", "during the fair",
]
_REASONS = [
    "because the winter was long", "although nobody asked", "so that the children could eat",
    "while the town slept", "as the bells rang", "before the rain came", "for the last time",
]
_REPLIES = [
    "It is done", "We shall see", "Not tonight", "The road is long", "Bring the light",
    "Nobody will know", "Count them again", "The river is rising",
]


def embedded_corpus(seed: int, n_bytes: int = EMBEDDED_CORPUS_BYTES) -> str:
    """Deterministic English-like prose of about ``n_bytes`` bytes, generated from ``seed``.

    A fixed lexicon and a handful of sentence shapes give a language with real structure (word
    spelling, agreement of templates, dialogue turns) that a tiny model learns within minutes.
    """
    rng = random.Random(seed)
    paragraphs: list[str] = []
    size = 0
    while size < n_bytes:
        sentences = []
        for _ in range(rng.randint(3, 7)):
            shape = rng.random()
            subject, verb, obj = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)
            if shape < 0.45:
                sentence = f"{subject} {verb} {obj} {rng.choice(_PLACES)}."
            elif shape < 0.75:
                sentence = f"{subject} {verb} {obj} {rng.choice(_REASONS)}."
            elif shape < 0.9:
                sentence = f"\"{rng.choice(_REPLIES)},\" said {subject}."
            else:
                other = rng.choice(_SUBJECTS)
                sentence = f"{rng.choice(_PLACES).capitalize()}, {subject} and {other} {verb} {obj}."
            sentences.append(sentence[0].upper() + sentence[1:])
        paragraph = " ".join(sentences)
        paragraphs.append(paragraph)
        size += len(paragraph) + 2
    return "\n\n".join(paragraphs) + "\n"


class CorpusError(DilocoxError, ValueError):
    """The corpus cannot be read, or is not the one the run was configured with."""


def corpus_text(cfg: DataConfig, seed: int) -> str:
    if cfg.corpus == "embedded":
        return embedded_corpus(seed)
    path = Path(cfg.corpus)
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CorpusError(f"cannot read corpus {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise CorpusError(f"corpus {path} is not UTF-8 text: {exc}") from exc


def corpus_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # int64 tokens
    eval: torch.Tensor
    sha256: str  # of the UTF-8 text the tokens came from

    def shard(self, index: int, num_shards: int) -> torch.Tensor:
        if not 0 <= index < num_shards:
            raise CorpusError(f"shard {index} out of range for {num_shards} shards")
        size = len(self.train) // num_shards
        return self.train[index * size : (index + 1) * size]


def shard_digest(shard: torch.Tensor) -> bytes:
    """dataDigest of a report: sha256 of the shard's byte tokens (``Corpus.shard``), one byte each.
    The worker signs it; the coordinator and the audit derive it from the config and the corpus."""
    return hashlib.sha256(shard.to(torch.uint8).numpy().tobytes()).digest()


def load_corpus(cfg: DataConfig, seed: int, block_size: int) -> Corpus:
    """Read, check against ``cfg.corpus_sha256`` (when set) and split the corpus."""
    text = corpus_text(cfg, seed)
    if not text:
        raise CorpusError(f"corpus {cfg.corpus} is empty")
    digest = corpus_digest(text)
    if cfg.corpus_sha256 and digest != cfg.corpus_sha256:
        raise CorpusError(
            f"corpus {cfg.corpus!r} has sha256 {digest}, but the run was configured with "
            f"{cfg.corpus_sha256}: every process must train on the same bytes"
        )
    tokens = encode(text)
    n_eval = int(len(tokens) * cfg.eval_fraction)
    if n_eval <= block_size + 1 or len(tokens) - n_eval <= block_size + 1:
        need = int((block_size + 2) / min(cfg.eval_fraction, 1 - cfg.eval_fraction)) + 1
        raise CorpusError(f"corpus {cfg.corpus} is too small ({len(tokens)} tokens) to split: with "
                          f"data.eval_fraction {cfg.eval_fraction} and model.block_size {block_size} it "
                          f"needs at least about {need} bytes")
    return Corpus(train=tokens[:-n_eval], eval=tokens[-n_eval:], sha256=digest)


class Windowed(Protocol):
    """Tokens read a window at a time (trainer.data.dataset.TokenSpan)."""

    def __len__(self) -> int: ...

    def window(self, start: int, length: int) -> np.ndarray: ...


def _generator(*key: object) -> torch.Generator:
    seed = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") >> 1
    return torch.Generator().manual_seed(seed)


def sample_batch(
    tokens: torch.Tensor | Windowed, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows: inputs and the same windows shifted by one token.

    ``tokens`` is an int64 tensor, or memory-mapped token files (trainer.data.dataset.TokenSpan) from
    which only the drawn windows are copied out, as int64; the same generator draws the same
    starts either way."""
    if len(tokens) <= block_size + 1:
        raise CorpusError(f"{len(tokens)} tokens cannot hold a window of {block_size + 1}")
    starts = torch.randint(len(tokens) - block_size - 1, (batch_size,), generator=generator)
    if not isinstance(tokens, torch.Tensor):
        windows = torch.from_numpy(np.stack([tokens.window(s, block_size + 1) for s in starts.tolist()]))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    x = torch.stack([tokens[s : s + block_size] for s in starts.tolist()])
    y = torch.stack([tokens[s + 1 : s + 1 + block_size] for s in starts.tolist()])
    return x, y


def round_batches(
    shard: torch.Tensor | Windowed, *, seed: int, shard_index: int, round_: int, steps: int,
    batch_size: int, block_size: int,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The ``steps`` training batches of one worker slot in one round, replayable exactly."""
    generator = _generator("train", seed, shard_index, round_)
    for _ in range(steps):
        yield sample_batch(shard, batch_size, block_size, generator)


def eval_batches(
    corpus: Corpus | torch.Tensor | Windowed, *, seed: int, count: int, batch_size: int, block_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed held-out batches every global checkpoint is evaluated on."""
    held_out = corpus.eval if isinstance(corpus, Corpus) else corpus
    generator = _generator("eval", seed)
    return [sample_batch(held_out, batch_size, block_size, generator) for _ in range(count)]
