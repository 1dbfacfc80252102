"""Real configs trained by a real coordinator and two workers over TLS on BPE tokens, exported, and
loaded back by transformers as trained, with the run's tokenizer ids: a Qwen2 with tied embeddings
(its RoPE base of 1e6, batched generation with padding), and a Llama with llama3 RoPE scaling started
from existing weights (``dilocox config --init-from``, θ⁽⁰⁾ pinned by its CID and checked by the
workers), its exported config carrying the run's RoPE parameters in both transformers spellings."""

from __future__ import annotations

import dataclasses
import io
import json
from contextlib import redirect_stdout
from pathlib import Path
from typing import Sequence

import pytest
import torch

from cli.cluster import LocalCluster, provision
from cli.main import main
from settlement import Anvil
from storage_client import CID, Codec, lineage
from tests.conftest import small_config
from trainer.codec.wire import decode_params
from trainer.config import DataConfig, InnerConfig, ModelConfig, RunConfig
from trainer.model.gpt import build_model
from trainer.model.params import load_params

pytestmark = pytest.mark.integration

QWEN2_TIED = ModelConfig(family="qwen2", vocab_size=300, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                         tie_word_embeddings=True, rope_theta=1e6)
LLAMA3 = ModelConfig(family="llama", vocab_size=300, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                     intermediate_size=96, rope_theta=5e5, rope_type="llama3", rope_factor=8.0, rope_original_max_position_embeddings=16)


TEXT = "\n\n".join(f"{i} the miller carried 1234 broken lanterns by the mill, said the queen. Café\n"
                   for i in range(60))


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    """BPE tokens (vocabulary 300) of a small text with digits and accents, in two shards."""
    from trainer.data.prepare import prepare

    source = tmp_path_factory.mktemp("text") / "corpus.txt"
    source.write_text(TEXT)
    out = tmp_path_factory.mktemp("prepared") / "tokens"
    prepare([source], out, tokenizer="bpe", vocab_size=300, shards=2, eval_fraction=0.1)
    return out


def assert_the_runs_tokenizer(out: Path, tokens: Path):
    """The export's AutoTokenizer gives the run's ids, pads with a token of the vocabulary."""
    from transformers import AutoTokenizer

    from trainer.data.tokenizer import BpeTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    ours = BpeTokenizer.load(tokens / "tokenizer.json")
    for sample in (TEXT[:500], "Café, cafe\u0301 and 98765 lanterns"):
        assert tokenizer(sample, add_special_tokens=False)["input_ids"] == ours.encode_batch([sample])[0]
    assert tokenizer.pad_token_id == ours.eos_id < 300
    return tokenizer


def train(cluster: LocalCluster, config: RunConfig, path: Path, coordinator_args: Sequence[str] = (),
          worker_args: Sequence[str] = ()) -> list:
    """Two workers train ``config`` to its end; the run's lineage."""
    config.save(path)
    cluster.start_coordinator(path, extra=coordinator_args)
    cluster.start_worker("w0", extra=worker_args)
    cluster.start_worker("w1", extra=worker_args)
    for name in ("w0", "w1", "coordinator"):
        assert cluster.wait_exit(name, 240) == 0, cluster.log(name)
    chain = lineage(cluster.run_dir.store, cluster.run_dir.head())
    assert [m.round for _, m in chain] == list(range(config.rounds.rounds + 1))
    assert all(sorted(p.worker for p in m.participants) == ["w0", "w1"] for _, m in chain[1:])
    return chain


def assert_same_logits(out: Path, config: RunConfig, params_bytes: bytes):
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    ours = build_model(config.model, config.seed)
    load_params(ours, decode_params(params_bytes))
    x = torch.randint(config.model.vocab_size, (2, config.model.block_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(loaded(x).logits, ours(x)[0], atol=1e-5)
    return loaded


def test_a_tied_qwen2_on_bpe_tokens_trains_exports_and_loads_with_the_runs_tokenizer(
        cluster: LocalCluster, tmp_path: Path, tokens: Path) -> None:
    config = small_config(model=QWEN2_TIED, data=DataConfig(tokens=str(tokens), eval_batches=2))
    chain = train(cluster, config, tmp_path / "config.json")
    # Tied: one tensor, and the workers ran one stage (auto cannot split it).
    assert "lm_head.weight" not in decode_params(cluster.run_dir.store.get(chain[-1][1].params))
    assert "1 stage(s)" in cluster.log("w0", tail=400)

    out = tmp_path / "hf"
    assert main(["export", "--run", str(cluster.run_dir.path), "--round", "2", str(out)]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert hf["tie_word_embeddings"] is True and hf["rope_theta"] == 1e6 and hf["rope_scaling"] is None
    loaded = assert_same_logits(out, config, cluster.run_dir.store.get(chain[-1][1].params))
    assert loaded.config.tie_word_embeddings and loaded.config.rope_parameters["rope_theta"] == 1e6
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    tokenizer = assert_the_runs_tokenizer(out, tokens)
    assert type(tokenizer).__name__ != "Qwen2Tokenizer"
    batch = tokenizer(["the miller", "said the queen by the mill"], return_tensors="pt", padding=True)
    generated = loaded.generate(**batch, max_new_tokens=4, do_sample=False)
    assert generated.shape == (2, batch["input_ids"].shape[1] + 4)


def test_a_llama3_rope_run_from_given_weights_trains_exports_and_loads_with_its_rope(
        cluster: LocalCluster, tmp_path: Path, tokens: Path) -> None:
    from transformers import AutoConfig

    from trainer.coordinator.run import open_run
    from trainer.runstore.run_dir import RunDir

    # The given weights: round 0 of another run of the same model, from another seed, exported.
    data = DataConfig(tokens=str(tokens), eval_batches=2)
    source = small_config(model=LLAMA3, data=data).replace(seed=7)
    open_run(RunDir(tmp_path / "source"), source)
    assert main(["export", "--run", str(tmp_path / "source"), "--round", "0", str(tmp_path / "weights")]) == 0
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert main(["config", "--init-from", str(tmp_path / "weights")]) == 0
    pinned = RunConfig.from_json(json.loads(printed.getvalue())).model
    assert dataclasses.replace(pinned, init_from="", init_params="") == LLAMA3
    # the tokens pinned as genesis pins them, so that the measurements provisioned are of the run's own config
    index_cid = CID.of((tokens / "index.json").read_bytes(), Codec.JSON)
    config = small_config(model=pinned, inner=InnerConfig(steps=3, batch_size=4, lr=1e-3),
                          data=dataclasses.replace(data, tokens_cid=str(index_cid)),
                          rounds=dataclasses.replace(small_config().rounds, rounds=1))
    with Anvil(state_file=cluster.run_dir.path / "chain" / "state.json") as anvil:
        co_args, wo_args = provision(cluster.run_dir.path, anvil.rpc_url, config)
        chain = train(cluster, config, tmp_path / "config.json", [*co_args, "--report-timeout", "10"], wo_args)
        # θ⁽⁰⁾ is the given weights (the workers checked the CID the config pins), not the seed's;
        # the audit checks the genesis checkpoint against that CID and replays a contribution from it.
        source_chain = lineage(RunDir(tmp_path / "source").store, RunDir(tmp_path / "source").head())
        assert chain[0][1].params == pinned.init_params == source_chain[0][1].params
        printed = io.StringIO()
        with redirect_stdout(printed):
            assert main(["audit", "--run", str(cluster.run_dir.path), "--rpc", anvil.rpc_url, "--allow-dev",
                         "--replay", "1", "--replay-seed", "3"]) == 0
        assert "AUDIT PASSED" in printed.getvalue() and "MISMATCH" not in printed.getvalue(), printed.getvalue()[-3000:]

    out = tmp_path / "hf"
    assert main(["export", "--run", str(cluster.run_dir.path), "--round", "1", str(out)]) == 0
    hf = json.loads((out / "config.json").read_text())
    # transformers 4.4x reads rope_theta and rope_scaling; 5 reads rope_parameters (rope_scaling first)
    assert hf["rope_theta"] == 5e5
    assert hf["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    assert hf["rope_parameters"] == {**hf["rope_scaling"], "rope_theta": 5e5}
    loaded_config = AutoConfig.from_pretrained(out, local_files_only=True)
    assert loaded_config.rope_parameters == {**hf["rope_scaling"], "rope_theta": 5e5}
    assert_same_logits(out, config, cluster.run_dir.store.get(chain[-1][1].params))
    assert_the_runs_tokenizer(out, tokens)
