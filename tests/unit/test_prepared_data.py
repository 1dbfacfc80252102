"""``dilocox data prepare`` and prepared token directories: inputs, split, dtype, memmapped reads,
every refusal before training, and byte-token runs unchanged."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from storage_client import CID, Codec, ObjectStore
from tests.conftest import small_config
from trainer.config import DataConfig, ModelConfig, RoundConfig, RunConfig
from trainer.data.corpus import _generator, eval_batches, load_corpus, round_batches, sample_batch, shard_digest
from trainer.data.dataset import (
    CorpusDataset,
    DataError,
    PreparedDataset,
    TokenFile,
    TokenIndex,
    TokenSpan,
    dtype_for,
    open_dataset,
    pin_dataset,
    run_dataset,
    slot_digest,
    verify_token_file,
)
from trainer.data.prepare import TokenWriter, find_sources, held_out, prepare

PARAGRAPH = "the miller carried the broken lantern by the mill.\nit is done, said the queen.\n"


def write_text(path: Path, documents: int, prefix: str = "") -> Path:
    path.write_text("\n\n".join(f"{prefix}{i} {PARAGRAPH}" for i in range(documents)))
    return path


def config_for(directory: Path, *, workers: int = 2, vocab: int = 256, block: int = 8) -> RunConfig:
    return small_config(model=ModelConfig(block_size=block, n_layer=1, n_head=2, n_embd=16, vocab_size=vocab),
                        data=DataConfig(tokens=str(directory), eval_batches=2),
                        rounds=RoundConfig(rounds=2, expected_workers=workers, quorum=workers))


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bpe") / "tokens"
    source = write_text(tmp_path_factory.mktemp("src") / "corpus.txt", 40)
    prepare([source], out, tokenizer="bpe", vocab_size=300, shards=4, eval_fraction=0.1)
    return out


# -- inputs and split ------------------------------------------------------------------------------

def test_a_text_file_is_cut_into_documents_at_blank_lines(tmp_path: Path) -> None:
    source = write_text(tmp_path / "a.txt", 20)
    done = prepare([source], tmp_path / "out", shards=3, eval_fraction=0.1)
    index = done.index
    # documents 9 and 19 are held out; the 18 others go round robin to 3 shards
    assert (index.train_documents, index.eval_documents) == (18, 2)
    assert index.kind == "byte" and index.dtype == "uint16" and index.eos_id is None and len(index.train) == 3
    eval_text = bytes(np.fromfile(tmp_path / "out" / "eval.bin", dtype="<u2").astype(np.uint8)).decode()
    assert eval_text == f"9 {PARAGRAPH}\n19 {PARAGRAPH}\n"
    shard0 = bytes(np.fromfile(tmp_path / "out" / "train-00000.bin", dtype="<u2").astype(np.uint8)).decode()
    assert shard0.startswith(f"0 {PARAGRAPH}\n3 {PARAGRAPH}\n")  # train documents 0, 3, 6, ...
    raw = (tmp_path / "out" / "index.json").read_bytes()
    assert json.loads(raw)["schema"] == "dilocox-tokens/1" and TokenIndex.from_bytes(raw, "x") == index
    assert index.cid == CID.of(raw, Codec.JSON)


def test_held_out_rule_spreads_the_fraction_evenly() -> None:
    from fractions import Fraction

    picked = [i for i in range(100) if held_out(i, Fraction(1, 10))]
    assert picked == list(range(9, 100, 10))
    assert sum(held_out(i, Fraction(1, 3)) for i in range(30)) == 10


def test_a_directory_is_walked_in_sorted_order_and_says_what_it_skipped(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    (root / "b").mkdir(parents=True)
    write_text(root / "b" / "2.txt", 3, "b2-")
    write_text(root / "a.md", 3, "a-")
    (root / "c.jsonl").write_text("\n".join(json.dumps({"text": f"c-{i}"}) for i in range(3)) + "\n")
    (root / "image.png").write_bytes(b"\x89PNG")
    (root / ".hidden.txt").write_text("secret")
    sources = find_sources([root])
    assert [s.path.relative_to(root).as_posix() for s in sources.files] == ["a.md", "c.jsonl", "b/2.txt"]
    assert sorted(p.name for p in sources.skipped) == [".hidden.txt", "image.png"]
    done = prepare([root], tmp_path / "out", eval_inputs=[write_text(tmp_path / "held.txt", 2)])
    assert (done.index.train_documents, done.index.eval_documents) == (9, 2)
    text = bytes(np.fromfile(tmp_path / "out" / "train-00000.bin", dtype="<u2").astype(np.uint8)).decode()
    assert text.index("a-0") < text.index("c-0") < text.index("b2-0")


def test_json_lines_give_one_document_a_line_and_a_malformed_line_is_named(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps({"text": f"doc {i}", "id": i}) for i in range(10)) + "\n\n")
    done = prepare([good], tmp_path / "out", eval_fraction=0.2)
    assert (done.index.train_documents, done.index.eval_documents) == (8, 2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n{\"text\": oops}\n")
    with pytest.raises(DataError, match=r"bad.jsonl line 2 is not JSON"):
        prepare([bad], tmp_path / "out2")
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl line 2: not an object with a string field \"text\""):
        prepare([bad], tmp_path / "out3")


def test_prepare_refuses_what_cannot_work(tmp_path: Path) -> None:
    source = write_text(tmp_path / "a.txt", 4)
    with pytest.raises(DataError, match="missing.txt is neither a file nor a directory"):
        prepare([tmp_path / "missing.txt"], tmp_path / "o1")
    with pytest.raises(DataError, match="no document was held out"):
        prepare([source], tmp_path / "o2", eval_fraction=0.1)
    with pytest.raises(DataError, match="leave 7 of 10 shards empty"):
        prepare([source], tmp_path / "o3", eval_fraction=0.25, shards=10)
    (tmp_path / "o4").mkdir()
    (tmp_path / "o4" / "x").write_text("")
    with pytest.raises(DataError, match="o4 exists and is not an empty directory"):
        prepare([source], tmp_path / "o4")
    (tmp_path / "latin1.txt").write_bytes(b"ok\ncaf\xe9\n")
    with pytest.raises(DataError, match="latin1.txt near line .*not UTF-8"):
        prepare([tmp_path / "latin1.txt"], tmp_path / "o5")


# -- dtype and memmapped reads ----------------------------------------------------------------------

def test_dtype_is_uint16_while_the_vocabulary_fits_else_uint32(tmp_path: Path) -> None:
    assert (dtype_for(256), dtype_for(65536), dtype_for(65537)) == ("uint16", "uint16", "uint32")
    writer = TokenWriter(tmp_path / "big.bin", "uint32")
    writer.write([0, 65536, 99_999])
    entry = writer.close()
    assert entry.tokens == 3 and (tmp_path / "big.bin").stat().st_size == 12
    tokens = verify_token_file(tmp_path, entry, "uint32", 100_000)
    assert tokens.tolist() == [0, 65536, 99_999]
    index = TokenIndex("bpe", str(CID.of(b"t")), 100_000, 0, "uint32", 1, 1, (entry,), entry)
    index_json = index.to_json()
    index_json["dtype"] = "uint16"
    with pytest.raises(DataError, match="dtype 'uint16' does not fit vocab_size 100000"):
        TokenIndex.from_bytes(json.dumps(index_json, sort_keys=True, separators=(",", ":")).encode(), "idx")


def test_windows_from_memmapped_shards_equal_windows_from_a_tensor(tmp_path: Path) -> None:
    parts = [np.arange(0, 50, dtype=np.uint16), np.arange(50, 120, dtype=np.uint16)]
    span = TokenSpan(parts)
    assert len(span) == 120 and span.window(45, 10).tolist() == list(range(45, 55))
    whole = torch.arange(120)
    for a, b in zip(round_batches(span, seed=1, shard_index=0, round_=3, steps=3, batch_size=4, block_size=16),
                    round_batches(whole, seed=1, shard_index=0, round_=3, steps=3, batch_size=4, block_size=16)):
        assert a[0].dtype == torch.int64 and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    x, y = sample_batch(span, 2, 8, _generator("any"))
    assert torch.equal(x[:, 1:], y[:, :-1])


# -- opening a prepared run, and every refusal -----------------------------------------------------

def test_a_prepared_run_pins_its_index_and_workers_read_only_their_shards(tmp_path: Path, bpe_dir: Path) -> None:
    store = ObjectStore(tmp_path / "store")
    config, dataset = pin_dataset(config_for(bpe_dir, vocab=300), store)
    assert isinstance(dataset, PreparedDataset)
    raw_index = (bpe_dir / "index.json").read_bytes()
    assert config.data.tokens_cid == str(CID.of(raw_index, Codec.JSON))
    assert store.get(config.data.tokens_cid) == raw_index
    assert store.get(dataset.index.tokenizer_cid) == (bpe_dir / "tokenizer.json").read_bytes()
    worker = open_dataset(config)
    span = worker.slot_tokens(1)  # shards 1 and 3 of 4
    assert sorted(worker._verified) == [1, 3] and len(span) == sum(worker.index.train[i].tokens for i in (1, 3))
    digests = [bytes.fromhex(worker.index.train[i].sha256) for i in (1, 3)]
    assert worker.shard_digests[1] == hashlib.sha256(b"".join(digests)).digest() == slot_digest(worker.index, 1, 2)
    one_slot = config_for(bpe_dir, workers=4, vocab=300)
    assert open_dataset(one_slot).shard_digests[2] == bytes.fromhex(worker.index.train[2].sha256)
    audit = run_dataset(config, store)  # from the store alone: no token file is read
    assert audit.shard_digests == worker.shard_digests and audit._verified == {}
    batches = eval_batches(worker.eval_tokens(), seed=1, count=2, batch_size=2, block_size=8)
    assert all(int(x.max()) < 300 for x, _ in batches)


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_damaged_pinned_index_is_a_data_error_naming_the_object(tmp_path: Path, bpe_dir: Path, damage: str) -> None:
    """What the audit and a resuming coordinator read: a store object that no longer hashes to its
    CID, or is gone, is refused as the run's token index (a DataError, which the audit turns into a
    failed check), never an uncaught store error."""
    store = ObjectStore(tmp_path / "store")
    config, _ = pin_dataset(config_for(bpe_dir, vocab=300), store)
    path = store.path_of(config.data.tokens_cid)
    if damage == "corrupt":
        path.write_bytes(path.read_bytes().replace(b'"bpe"', b'"BPE"'))
    else:
        path.unlink()
    with pytest.raises(DataError, match=f"token index {config.data.tokens_cid} cannot be read from its store"):
        run_dataset(config, store)


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_every_bad_prepared_directory_is_refused_by_name(tmp_path: Path, bpe_dir: Path) -> None:
    config, _ = pin_dataset(config_for(bpe_dir, vocab=300))
    pinned = config.data.tokens_cid

    def opened(directory: Path, **data) -> PreparedDataset:
        cfg = config.replace(data=dataclasses.replace(config.data, tokens=str(directory), **data))
        dataset = open_dataset(cfg)
        dataset.verify_tokenizer()
        dataset.slot_tokens(0), dataset.slot_tokens(1), dataset.eval_tokens()
        return dataset

    bad = _copy(bpe_dir, tmp_path / "tokenizer")
    (bad / "tokenizer.json").write_bytes((bad / "tokenizer.json").read_bytes().replace(b"<|endoftext|>", b"<|end|>"))
    with pytest.raises(DataError, match="tokenizer .*tokenizer.json has CID .* but the index pins"):
        opened(bad)
    bad = _copy(bpe_dir, tmp_path / "dtype")
    (bad / "train-00002.bin").write_bytes(np.fromfile(bad / "train-00002.bin", "<u2").astype("<u4").tobytes())
    with pytest.raises(DataError, match="train-00002.bin is .* bytes, but the index says .* tokens of uint16"):
        opened(bad)
    bad = _copy(bpe_dir, tmp_path / "truncated")
    (bad / "eval.bin").write_bytes((bad / "eval.bin").read_bytes()[:-2])
    with pytest.raises(DataError, match="eval.bin is .* bytes, but the index says"):
        opened(bad)
    bad = _copy(bpe_dir, tmp_path / "missing")
    (bad / "train-00003.bin").unlink()
    with pytest.raises(DataError, match="token file .*train-00003.bin is missing"):
        opened(bad)
    bad = _copy(bpe_dir, tmp_path / "altered")
    altered = np.fromfile(bad / "train-00000.bin", "<u2")
    altered[5] = (altered[5] + 1) % 300
    altered.tofile(bad / "train-00000.bin")
    with pytest.raises(DataError, match="train-00000.bin has sha256 .* but the index says"):
        opened(bad)
    with pytest.raises(DataError, match="has CID .* but the run pinned data.tokens_cid"):
        opened(bpe_dir, tokens_cid=str(CID.of(b"{}", Codec.JSON)))
    with pytest.raises(DataError, match="token index .*index.json is missing"):
        opened(tmp_path / "nowhere")
    assert opened(bpe_dir, tokens_cid=pinned).cid == CID.parse(pinned)


def test_a_token_outside_the_vocabulary_is_refused_while_hashing(tmp_path: Path) -> None:
    ids = np.array([1, 2, 300, 4], dtype="<u2")
    (tmp_path / "s.bin").write_bytes(ids.tobytes())
    entry = TokenFile("s.bin", 4, hashlib.sha256(ids.tobytes()).hexdigest())
    with pytest.raises(DataError, match="s.bin holds token 300, outside the vocabulary of 300"):
        verify_token_file(tmp_path, entry, "uint16", 300)


def test_a_run_that_does_not_fit_its_tokens_is_refused(bpe_dir: Path) -> None:
    with pytest.raises(DataError, match="model.vocab_size 256 is smaller than the tokenizer's vocabulary 300"):
        open_dataset(config_for(bpe_dir, vocab=256))
    with pytest.raises(DataError, match="has 4 train shards, fewer than rounds.expected_workers 5"):
        open_dataset(config_for(bpe_dir, workers=5, vocab=300))


def test_a_non_canonical_index_is_refused(tmp_path: Path, bpe_dir: Path) -> None:
    bad = _copy(bpe_dir, tmp_path / "pretty")
    (bad / "index.json").write_text(json.dumps(json.loads((bad / "index.json").read_bytes()), indent=1))
    with pytest.raises(DataError, match="not in canonical form"):
        open_dataset(config_for(bad, vocab=300))
    obj = json.loads((bpe_dir / "index.json").read_bytes())
    obj["train"][0]["file"] = "../../etc/passwd"
    (bad / "index.json").write_text(json.dumps(obj, sort_keys=True, separators=(",", ":")))
    with pytest.raises(DataError, match=r"train\[0\]: file name must match"):
        open_dataset(config_for(bad, vocab=300))


# -- byte tokens unchanged ------------------------------------------------------------------------

def test_byte_token_runs_keep_their_digests_and_batches() -> None:
    """Digests and batches of the embedded corpus as the code before prepared data computed them."""
    config = small_config()
    dataset = open_dataset(config)
    assert isinstance(dataset, CorpusDataset)
    assert [d.hex() for d in dataset.shard_digests] == [
        "2030d8b2ec0565f1f603054ffb278d95a85867c06594fb860d8555729383ddf8",
        "3476e4d349cdfd45112a304c3f4fec87a49a53e0b7c0db9cc9af06c04a6285bf"]
    corpus = load_corpus(config.data, config.seed, config.model.block_size)
    assert dataset.shard_digests[0] == shard_digest(corpus.shard(0, 2))
    batches = eval_batches(dataset.eval_tokens(), seed=config.seed, count=2, batch_size=2,
                           block_size=config.model.block_size)
    assert batches[0][0][0][:10].tolist() == [97, 115, 107, 101, 100, 46, 32, 65, 32, 121]
    assert batches[1][1][1][:10].tolist() == [100, 32, 97, 110, 32, 105, 114, 111, 110, 32]
    pinned, _ = pin_dataset(config)
    assert pinned.data.corpus_sha256 == "84f521652ddea96a5ca46957f25fa58bbf649910eaf302a50e9c8505c42620bc"
    assert pinned.data.tokens_cid == ""


def test_a_local_tokenizer_json_is_used_and_copied_by_cid(tmp_path: Path, bpe_dir: Path) -> None:
    source = write_text(tmp_path / "a.txt", 10)
    done = prepare([source], tmp_path / "out", tokenizer=str(bpe_dir / "tokenizer.json"), eval_fraction=0.2)
    assert done.index.tokenizer_cid == str(CID.of((bpe_dir / "tokenizer.json").read_bytes()))
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (bpe_dir / "tokenizer.json").read_bytes()
    ids = np.fromfile(tmp_path / "out" / "eval.bin", "<u2")
    assert ids[-1] == done.index.eos_id and (ids == done.index.eos_id).sum() == done.index.eval_documents


def test_the_cli_prepares_and_refuses_contradictory_split_flags(tmp_path: Path, capsys) -> None:
    from cli.main import main

    source = write_text(tmp_path / "a.txt", 10)
    assert main(["data", "prepare", str(source), "--out", str(tmp_path / "out"), "--shards", "2",
                 "--eval-fraction", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "8 train documents in 2 shards" in out and "index " in out and "--set data.tokens=" in out
    assert main(["data", "prepare", str(source), "--out", str(tmp_path / "o2"), "--eval-fraction", "0.2",
                 "--eval-input", str(source)]) == 1
    assert not (tmp_path / "o2").exists()


def test_a_refused_input_leaves_no_token_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n[1]\n")
    with pytest.raises(DataError, match="bad.jsonl line 2"):
        prepare([bad], tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []
