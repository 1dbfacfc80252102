"""Tokenizers: byte tokens, byte-level BPE trained offline (deterministically) or loaded by path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from storage_client import CID
from trainer.data import tokenizer as tokenizer_module
from trainer.data.corpus import CorpusError
from trainer.data.tokenizer import EOS_TOKEN, BpeTokenizer, ByteTokenizer, TokenizerError, tokenizer_for

DOCS = ["The miller carried the broken lantern by the mill.", "Ünïcödé — 雪 and emoji 🙂 survive.",
        "\"Count them again,\" said the queen."] * 20


@pytest.fixture(scope="module")
def bpe() -> BpeTokenizer:
    return BpeTokenizer.train(iter(DOCS), 300)


def test_byte_tokens_round_trip() -> None:
    tok = ByteTokenizer()
    [ids] = tok.encode_batch(["héllo"])
    assert ids == list("héllo".encode("utf-8")) and tok.decode(ids) == "héllo"
    assert tok.vocab_size == 256 and tok.eos_id is None


def test_bpe_round_trips_any_text_and_has_an_end_of_text_token(bpe: BpeTokenizer) -> None:
    for text in DOCS[:3] + ["never seen: ∮ ξ 漢字 \t\n tabs"]:
        [ids] = bpe.encode_batch([text])
        assert bpe.decode(ids) == text
        assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode([bpe.eos_id]) == EOS_TOKEN
    [common] = bpe.encode_batch([DOCS[0]])
    assert len(common) < len(DOCS[0].encode())  # merges were learned


def test_bpe_training_is_deterministic(bpe: BpeTokenizer) -> None:
    again = BpeTokenizer.train(iter(DOCS), 300)
    assert again.json_bytes == bpe.json_bytes and again.cid == bpe.cid == CID.of(bpe.json_bytes)


def test_a_tokenizer_json_loads_by_path_with_the_same_cid(tmp_path: Path, bpe: BpeTokenizer) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes(bpe.json_bytes)
    loaded = tokenizer_for(str(path))
    assert isinstance(loaded, BpeTokenizer) and loaded.cid == bpe.cid
    assert loaded.encode_batch(DOCS[:2]) == bpe.encode_batch(DOCS[:2])


def test_bad_tokenizer_files_are_refused_by_name(tmp_path: Path, bpe: BpeTokenizer, monkeypatch) -> None:
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(TokenizerError, match="garbage.json is not a tokenizer.json"):
        BpeTokenizer.load(garbage)
    with pytest.raises(TokenizerError, match="cannot read tokenizer .*missing.json"):
        BpeTokenizer.load(tmp_path / "missing.json")
    no_eos = json.loads(bpe.json_bytes)
    no_eos["added_tokens"] = []
    no_eos["model"]["vocab"] = {k: v for k, v in no_eos["model"]["vocab"].items() if k != EOS_TOKEN}
    (tmp_path / "no_eos.json").write_text(json.dumps(no_eos))
    with pytest.raises(TokenizerError, match="no end-of-text token"):
        BpeTokenizer.load(tmp_path / "no_eos.json")
    monkeypatch.setattr(tokenizer_module, "MAX_TOKENIZER_BYTES", 100)
    (tmp_path / "big.json").write_bytes(bpe.json_bytes)
    with pytest.raises(TokenizerError, match="big.json is .* bytes, more than the 100 allowed"):
        BpeTokenizer.load(tmp_path / "big.json")
    assert issubclass(TokenizerError, CorpusError)  # the CLIs print it as one line


def test_vocab_size_out_of_range_is_refused() -> None:
    with pytest.raises(TokenizerError, match="--vocab-size 100 is out of range"):
        BpeTokenizer.train(iter(DOCS), 100)
