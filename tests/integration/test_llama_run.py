"""A tiny Llama trained by a real coordinator and two attested workers over TLS on 127.0.0.1, with
compressed updates, recorded on a real chain, then `dilocox audit` (replaying contributions) and
`dilocox export` of the last round, loaded back by transformers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from cli.cluster import LocalCluster, provision
from cli.main import main
from settlement import Anvil
from storage_client import lineage
from tests.conftest import small_config
from trainer.codec import CompressionConfig
from trainer.config import ModelConfig, RunConfig
from trainer.data.corpus import load_corpus

pytestmark = pytest.mark.integration

LLAMA = ModelConfig(family="llama", block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)


def test_a_llama_run_trains_audits_and_exports(cluster: LocalCluster, tmp_path: Path, capsys) -> None:
    config = small_config(model=LLAMA, compression=CompressionConfig(enabled=True, min_rank=1, max_rank=4))
    corpus = load_corpus(config.data, config.seed, config.model.block_size)
    config = config.replace(data=dataclasses.replace(config.data, corpus_sha256=corpus.sha256))
    path = tmp_path / "config.json"
    config.save(path)
    with Anvil(state_file=cluster.run_dir.path / "chain" / "state.json") as anvil:
        co_args, wo_args = provision(cluster.run_dir.path, anvil.rpc_url, config)
        cluster.start_coordinator(path, extra=[*co_args, "--report-timeout", "10"])
        cluster.start_worker("w0", extra=wo_args)
        cluster.start_worker("w1", extra=wo_args)
        for name in ("w0", "w1", "coordinator"):
            assert cluster.wait_exit(name, 180) == 0, cluster.log(name)
        assert "compressed" in cluster.log("w0")

        chain = lineage(cluster.run_dir.store, cluster.run_dir.head())
        assert [m.round for _, m in chain] == [0, 1, 2]
        assert all([p.worker for p in m.participants] == ["w0", "w1"] for _, m in chain[1:])
        assert RunConfig.from_json(cluster.run_dir.store.get_json(chain[0][1].config)).model == LLAMA
        # The eval loss of the byte-level corpus falls from ln(256) as the Llama trains.
        assert chain[-1][1].eval_loss_e6 < chain[0][1].eval_loss_e6

        # In this process (which has imported torch and transformers already): the same command line.
        assert main(["audit", "--run", str(cluster.run_dir.path), "--rpc", anvil.rpc_url, "--allow-dev",
                     "--replay", "2", "--replay-seed", "3"]) == 0
        audit = capsys.readouterr().out
        assert "AUDIT PASSED" in audit and "MISMATCH" not in audit, audit[-3000:]

    out = tmp_path / "hf"
    assert main(["export", "--run", str(cluster.run_dir.path), "--round", "2", str(out)]) == 0
    assert str(chain[2][0]) in capsys.readouterr().out

    from transformers import AutoModelForCausalLM

    from trainer.codec.wire import decode_params
    from trainer.model.gpt import build_model
    from trainer.model.params import load_params

    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    ours = build_model(LLAMA, config.seed)
    load_params(ours, decode_params(cluster.run_dir.store.get(chain[2][1].params)))
    x = torch.randint(LLAMA.vocab_size, (2, LLAMA.block_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(loaded(x).logits, ours(x)[0], atol=1e-5)
