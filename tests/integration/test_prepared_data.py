"""A run on prepared tokens, end to end: ``dilocox data prepare`` trains a byte-level BPE tokenizer on
tiny Shakespeare (../shared/data) and writes two token shards; ``dilocox demo`` runs a real
coordinator and two workers on them for two rounds, on a local chain, and its ``dilocox audit``
(with replay) passes from the store and the token files. A worker whose shard file is missing
fails at start, naming the file, before any training."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli.cluster import LocalCluster
from storage_client import CID, Codec, lineage
from tests.conftest import shared_path, small_config
from trainer.config import DataConfig, InnerConfig, ModelConfig, RoundConfig, RunConfig
from trainer.runstore.run_dir import RunDir

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SHAKESPEARE = "data/tinyshakespeare/input.txt"  # under ../shared
VOCAB = 512


def dilocox(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=REPO, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    shakespeare = shared_path(SHAKESPEARE)
    from cli.main import main  # `dilocox data prepare`, in this process (torch is already imported)

    out = tmp_path_factory.mktemp("prepared") / "shakespeare"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["data", "prepare", str(shakespeare), "--out", str(out), "--tokenizer", "bpe",
                     "--vocab-size", str(VOCAB), "--shards", "2", "--eval-fraction", "0.05"])
    assert code == 0 and "dtype uint16" in printed.getvalue() and "2 shards" in printed.getvalue()
    return out


def test_a_llama_demo_run_on_prepared_bpe_tokens_trains_audits_and_exports_with_its_tokenizer(
        tmp_path: Path, tokens: Path) -> None:
    run_dir = tmp_path / "demo"
    settings = [f"data.tokens={tokens}", f"model.vocab_size={VOCAB}", "model.family=llama", "model.n_layer=1",
                "model.n_embd=64", "model.n_head=2", "model.block_size=32", "inner.steps=12", "inner.batch_size=8",
                "rounds.rounds=2", "data.eval_batches=2"]
    done = dilocox("demo", "--run-dir", str(run_dir), *[a for s in settings for a in ("--set", s)], timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "prepared tokens" in done.stdout
    # The demo runs DiLoCoX, the product's default: compressed both ways, overlapped rounds, each
    # round's line saying how many times fewer bytes than dense crossed the wire; every overlapped
    # round's report names the round's parent and is accepted (none counts on the coordinator's word).
    out = " ".join(done.stdout.split())
    assert "DiLoCoX: adaptive low-rank + int4" in out and "delayed one-step overlap" in out, out[:2000]
    assert out.count("fewer than dense fp32") >= 2 and "did not report" not in out, out[-3000:]
    assert "AUDIT PASSED" in out
    local = RunDir(run_dir)
    chain = lineage(local.store, local.head())
    assert [m.round for _, m in chain] == [0, 1, 2]
    config = RunConfig.from_json(local.store.get_json(chain[-1][1].config))
    index = (tokens / "index.json").read_bytes()
    assert config.data.tokens_cid == str(CID.of(index, Codec.JSON))
    # what the audit reads from the store alone: the index and the tokenizer it pins
    assert local.store.get(config.data.tokens_cid) == index
    assert local.store.get(json.loads(index)["tokenizer"]["cid"]) == (tokens / "tokenizer.json").read_bytes()

    # The export carries the pinned tokenizer: transformers encodes text as the run did.
    out = tmp_path / "hf"
    done = dilocox("export", "--run", str(run_dir), "--round", "2", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "tokenizer.json").read_bytes() == (tokens / "tokenizer.json").read_bytes()
    from transformers import AutoConfig, AutoTokenizer

    from trainer.data.tokenizer import EOS_TOKEN, BpeTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    ours = BpeTokenizer.load(tokens / "tokenizer.json")
    text = shared_path(SHAKESPEARE).read_text(encoding="utf-8")[:2000]
    assert hf_tokenizer(text)["input_ids"] == ours.encode_batch([text])[0]
    assert hf_tokenizer.eos_token == EOS_TOKEN
    assert AutoConfig.from_pretrained(out, local_files_only=True).eos_token_id == ours.eos_id == 0


def test_a_worker_whose_shard_file_is_missing_fails_at_start_naming_it(tmp_path: Path, tokens: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tokens, broken)
    (broken / "train-00000.bin").unlink()  # the coordinator reads only index.json and eval.bin
    config = small_config(model=ModelConfig(block_size=16, n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB),
                          inner=InnerConfig(steps=2, batch_size=2, lr=1e-3),
                          data=DataConfig(tokens=str(broken), eval_batches=2),
                          rounds=RoundConfig(rounds=1, expected_workers=2, quorum=2))
    config.save(tmp_path / "config.json")
    with LocalCluster(tmp_path / "run") as cluster:
        cluster.start_coordinator(tmp_path / "config.json")
        cluster.start_worker("w0")  # the first to join takes shard 0
        assert cluster.wait_exit("w0", 60) != 0
        log = cluster.log("w0")
        errors = [line for line in log.splitlines() if "ERROR" in line]
        assert len(errors) == 1 and "train-00000.bin is missing" in errors[0], log
        assert "Traceback" not in log
        assert len(cluster.run_dir.logged_rounds()) == 1  # genesis only: nothing trained


def test_a_coordinator_whose_model_cannot_hold_the_vocabulary_exits_with_one_line(tmp_path: Path, tokens: Path,
                                                                                 capfd) -> None:
    from cli.main import main  # in process: the refusal comes before anything listens

    code = main(["coordinator", "--run-dir", str(tmp_path / "run"), "--insecure", "--port", "0",
                 "--set", f"data.tokens={tokens}", "--set", "model.vocab_size=256"])
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if "ERROR" in line]
    assert code == 1 and len(errors) == 1 and "Traceback" not in err, err
    assert f"model.vocab_size 256 is smaller than the tokenizer's vocabulary {VOCAB}" in errors[0]
    assert not (tmp_path / "run" / "HEAD").exists()
