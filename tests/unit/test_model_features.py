"""Real configs' model features (tied embeddings, RoPE scaling, attention biases, an explicit head
dimension), the export's own check and the GPT exported as GPT-2, and θ⁽⁰⁾ from existing weights
(``dilocox config --init-from``): offline, from local folders, with transformers 5 as installed."""

from __future__ import annotations

import dataclasses
import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from cli.main import main
from storage_client import CID
from trainer.codec.wire import encode_params
from trainer.config import (
    ConfigError,
    DataConfig,
    InnerConfig,
    ModelConfig,
    RunConfig,
    estimated_parameters,
)
from trainer.model.gpt import build_model
from trainer.model.hf import hf_config_json, model_section_from_hf
from trainer.model.init_weights import InitWeightsError, init_params_cid
from trainer.model.params import params_of
from trainer.runstore.run_dir import RunDir
from trainer.runtime.pipeline import split_model

LLAMA = ModelConfig(family="llama", vocab_size=300, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                    intermediate_size=96)
QWEN2_TIED = dataclasses.replace(LLAMA, family="qwen2", tie_word_embeddings=True, rope_theta=1e6)
LLAMA3 = dataclasses.replace(LLAMA, rope_theta=5e5, rope_type="llama3", rope_factor=8.0,
                             rope_original_max_position_embeddings=8)
LINEAR = dataclasses.replace(LLAMA, rope_type="linear", rope_factor=2.0)
YARN = dataclasses.replace(LLAMA, rope_type="yarn", rope_factor=4.0, rope_original_max_position_embeddings=16,
                           rope_beta_fast=16.0)
BIASED = dataclasses.replace(LLAMA, attention_bias=True, head_size=16)
GPT = ModelConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
FEATURES = {"qwen2-tied": QWEN2_TIED, "llama3": LLAMA3, "linear": LINEAR, "yarn": YARN, "bias-head_dim": BIASED}


def run_config(model: ModelConfig, run_id: str = "features") -> RunConfig:
    return RunConfig(run_id=run_id, model=model, inner=InnerConfig(batch_size=2), data=DataConfig(eval_batches=1))


def open_genesis(path: Path, config: RunConfig):
    from trainer.coordinator.run import open_run

    return open_run(RunDir(path), config)


# ----------------------------------------------------------------------------- the model section


def test_new_fields_are_left_out_at_their_defaults_so_existing_cids_stand() -> None:
    model_json = RunConfig().to_json()["model"]
    assert set(model_json) == {"family", "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_kv_head",
                               "intermediate_size", "rope_theta", "rms_norm_eps"}
    # the CID of the default configuration before these fields existed (and before DiLoCoX revealed
    # its states on challenge: tests/unit/test_config_declarations.py)
    before = RunConfig().replace(rounds=dataclasses.replace(RunConfig().rounds, state_reveal="upload"))
    assert str(before.cid) == "bagaaieramt5qbht2jzjfu6kotd7w5y7fdjdbbcmrflli42qnlp6sc44ferda"
    for model in FEATURES.values():
        config = run_config(model)
        assert RunConfig.from_json(json.loads(config.canonical())) == config
        assert config.cid != run_config(LLAMA).cid
    assert run_config(LLAMA).with_settings(["model.rope_type=linear", "model.rope_factor=2"]).model == LINEAR


@pytest.mark.parametrize("cfg", FEATURES.values(), ids=FEATURES.keys())
def test_each_feature_builds_the_model_transformers_builds_from_the_exported_config(cfg: ModelConfig) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    ours = build_model(cfg, 3)
    assert estimated_parameters(cfg) == sum(p.numel() for p in ours.parameters())
    hf = hf_config_json(cfg)
    # every field transformers 4.4x reads beside transformers 5's rope_parameters
    assert hf["rope_theta"] == cfg.rope_theta and hf["rope_parameters"]["rope_theta"] == cfg.rope_theta
    assert (hf["rope_scaling"] or {"rope_type": "default"})["rope_type"] == hf["rope_parameters"]["rope_type"]
    assert hf["torch_dtype"] == hf["dtype"] == "float32" and hf["tie_word_embeddings"] == cfg.tie_word_embeddings
    loaded_config = AutoConfig.for_model(**hf)
    theirs = AutoModelForCausalLM.from_config(loaded_config)
    assert loaded_config.rope_parameters["rope_type"] == cfg.rope_type
    # The run trains with the RoPE the exported model computes: the same frequencies and scale.
    assert torch.equal(ours.model.rotary_emb.inv_freq, theirs.model.rotary_emb.inv_freq)
    assert ours.model.rotary_emb.attention_scaling == theirs.model.rotary_emb.attention_scaling
    theirs.load_state_dict({**params_of(ours), **({"lm_head.weight": ours.lm_head.weight}
                                                  if cfg.tie_word_embeddings else {})})
    x = torch.randint(cfg.vocab_size, (2, cfg.block_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(theirs(x).logits, ours(x)[0], atol=1e-6)
    # and the exported config.json reads back as the same model section
    body = {**run_config(cfg).to_json(), "model": model_section_from_hf(json.loads(json.dumps(hf)))}
    assert RunConfig.from_json(body).model == cfg


def test_tied_embeddings_are_one_tensor_which_pipeline_stages_cannot_split() -> None:
    model = build_model(QWEN2_TIED, 0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in params_of(model)  # one tensor, stored once
    with pytest.raises(ValueError, match="pipeline stages cannot split"):
        split_model(model, 2)
    assert len(split_model(model, 1)) == 1


def test_yarn_exports_its_pretraining_context_as_max_position_embeddings() -> None:
    # transformers 4.4x finds yarn's correction range from max_position_embeddings, 5 from
    # original_max_position_embeddings: written equal, and the attention factor written out.
    hf = hf_config_json(dataclasses.replace(YARN, rope_original_max_position_embeddings=4096))
    assert hf["max_position_embeddings"] == hf["rope_parameters"]["original_max_position_embeddings"] == 4096
    assert hf["rope_scaling"]["attention_factor"] == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)


@pytest.mark.parametrize(("model", "message"), [
    (dataclasses.replace(LLAMA, rope_type="dynamic"), "model.rope_type = 'dynamic' is not supported"),
    (dataclasses.replace(LLAMA, rope_type="llama3", rope_factor=8.0), "needs model.rope_original_max_position"),
    (dataclasses.replace(LLAMA3, rope_high_freq_factor=0.5), "model.rope_high_freq_factor = 0.5 must exceed"),
    (dataclasses.replace(YARN, rope_beta_slow=64.0), "model.rope_beta_fast = 16.0 must exceed"),
    (dataclasses.replace(LLAMA, rope_factor=2.0), "model.rope_factor = 2.0 applies to rope_type linear or llama3"),
    (dataclasses.replace(LINEAR, rope_beta_fast=8.0), "model.rope_beta_fast = 8.0 applies to rope_type yarn only"),
    (dataclasses.replace(LINEAR, rope_factor=0.5), "model.rope_factor = 0.5 is out of range"),
    (dataclasses.replace(LLAMA, family="qwen2", attention_bias=True), "qwen2's q, k, v biases are fixed"),
    (dataclasses.replace(LLAMA, family="qwen2", head_size=16), "Qwen2Config has no head_dim"),
    (dataclasses.replace(LLAMA, head_size=15), "= 15 (the head dimension) must be even"),
    (dataclasses.replace(GPT, tie_word_embeddings=True), "model.tie_word_embeddings = True applies to the llama"),
    (dataclasses.replace(GPT, rope_type="linear"), "model.rope_type = 'linear' applies to the llama"),
    (dataclasses.replace(LLAMA, init_params="bafkrei"), "model.init_params is not a CID"),
    (dataclasses.replace(LLAMA, init_params=str(CID.of(b"x"))), "model.init_from (the weights' folder) is not"),
])
def test_bad_feature_settings_are_refused_by_name(model: ModelConfig, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_config(model)


def test_config_json_features_read_from_either_transformers_spelling() -> None:
    base = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 1024,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "attention_bias": True, "head_dim": 32}
    llama31 = model_section_from_hf({**base, "rope_theta": 5e5, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert llama31 == model_section_from_hf({**base, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert (llama31["rope_type"], llama31["rope_factor"], llama31["rope_theta"]) == ("llama3", "8.0", "500000.0")
    assert (llama31["tie_word_embeddings"], llama31["attention_bias"], llama31["head_size"]) == (True, True, 32)
    # Qwen2.5's yarn: the "type" spelling, the context as the pretraining context; mscale folded in
    qwen2 = {k: v for k, v in base.items() if k not in ("attention_bias", "head_dim")}
    yarn = model_section_from_hf({**qwen2, "model_type": "qwen2", "rope_scaling": {
        "type": "yarn", "factor": 4.0, "mscale": 2.0, "mscale_all_dim": 1.0}})
    assert yarn["rope_type"] == "yarn" and yarn["rope_original_max_position_embeddings"] == 1024
    ln4 = 1.3862943611198906
    assert float(yarn["rope_attention_factor"]) == pytest.approx((0.2 * ln4 + 1) / (0.1 * ln4 + 1))


# ------------------------------------------------------------------------------------ exports


def test_the_gpt_exports_as_gpt2_and_generates(tmp_path: Path, capsys) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    run = open_genesis(tmp_path / "run", run_config(GPT))
    out = tmp_path / "hf"
    assert main(["export", "--run", str(tmp_path / "run"), "--round", "0", str(out)]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["GPT2LMHeadModel"] and hf["activation_function"] == "gelu"
    assert hf["tie_word_embeddings"] is False and hf["n_positions"] == GPT.block_size
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "transformer.h.0.attn.c_attn.weight" in f.keys() and "lm_head.weight" in f.keys()
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    x = torch.randint(GPT.vocab_size, (2, GPT.block_size), generator=torch.Generator().manual_seed(1))
    ours = build_model(GPT, run.config.seed)
    with torch.no_grad():
        assert torch.allclose(loaded(x).logits, ours(x)[0], atol=1e-5)
        generated = loaded.generate(x[:, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generated.shape == (2, 7)


def test_a_tied_qwen2_exports_its_embedding_once_and_loads_tied(tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig

    open_genesis(tmp_path / "run", run_config(QWEN2_TIED))
    assert main(["export", "--run", str(tmp_path / "run"), "--round", "0", str(tmp_path / "hf")]) == 0
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    loaded = AutoConfig.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert loaded.tie_word_embeddings is True and loaded.rope_parameters["rope_theta"] == 1e6


def test_an_export_that_fails_its_own_check_is_refused_and_leaves_nothing(tmp_path: Path, monkeypatch,
                                                                        capsys) -> None:
    import trainer.model.hf

    open_genesis(tmp_path / "run", run_config(LLAMA3))
    export_state = trainer.model.hf.export_state

    def perturbed(cfg, params):  # a wrong tensor written: what the check must catch
        state = export_state(cfg, params)
        state["model.norm.weight"] = state["model.norm.weight"] * 1.5
        return state

    monkeypatch.setattr(trainer.model.hf, "export_state", perturbed)
    assert main(["export", "--run", str(tmp_path / "run"), "--round", "0", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert "does not compute the run's logits" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no folder, no partial one


def test_a_bpe_qwen2_export_gives_the_runs_ids_pads_and_generates_in_batches(tmp_path: Path, monkeypatch,
                                                                           capsys) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import cli.export
    from trainer.data.prepare import prepare
    from trainer.data.tokenizer import BpeTokenizer

    text = "\n\n".join(f"{i} the miller carried 1234 broken lanterns, said the queen. Café\n" for i in range(40))
    (tmp_path / "corpus.txt").write_text(text)
    prepare([tmp_path / "corpus.txt"], tmp_path / "tokens", tokenizer="bpe", vocab_size=300, shards=2,
            eval_fraction=0.1)
    config = run_config(QWEN2_TIED).replace(data=DataConfig(tokens=str(tmp_path / "tokens"), eval_batches=1))
    open_genesis(tmp_path / "run", config)
    out = tmp_path / "hf"
    assert main(["export", "--run", str(tmp_path / "run"), "--round", "0", str(out)]) == 0
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert type(tokenizer).__name__ != "Qwen2Tokenizer"
    ours = BpeTokenizer.load(tmp_path / "tokens" / "tokenizer.json")
    sample = "The queen's 2024 lanterns: cafe\u0301, caf\u00e9 and \ufb01ne 12345."
    assert tokenizer(sample, add_special_tokens=False)["input_ids"] == ours.encode_batch([sample])[0]
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == ours.eos_id < QWEN2_TIED.vocab_size
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    batch = tokenizer(["the miller", "said the queen to the miller"], return_tensors="pt", padding=True)
    generated = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert generated.shape[0] == 2 and generated.shape[1] == batch["input_ids"].shape[1] + 3

    # Without the auto_map, transformers 5 loads a qwen2 folder's tokenizer as Qwen2Tokenizer, which
    # rebuilds the pre-tokenizer: the check sees other ids and refuses the export.
    def bare(tokenizer, config):
        obj = tokenizer_config(tokenizer, config)
        obj.pop("auto_map")
        return obj

    tokenizer_config = cli.export.tokenizer_config
    monkeypatch.setattr(cli.export, "tokenizer_config", bare)
    capsys.readouterr()
    assert main(["export", "--run", str(tmp_path / "run"), "--round", "0", str(tmp_path / "bare")]) == 1
    err = capsys.readouterr().err
    assert "loaded by AutoTokenizer as Qwen2Tokenizer, encodes a sample differently" in err, err[-2000:]
    assert not (tmp_path / "bare").exists()


# --------------------------------------------------------------------------------- --init-from


def export_of(tmp_path: Path, model: ModelConfig, seed: int) -> Path:
    """A Hugging Face folder of ``model``'s parameters built from ``seed``: a round-0 export."""
    open_genesis(tmp_path / f"source-{seed}", run_config(model, "source").replace(seed=seed))
    out = tmp_path / f"weights-{seed}"
    assert main(["export", "--run", str(tmp_path / f"source-{seed}"), "--round", "0", str(out)]) == 0
    return out


def config_from(weights: Path, *settings: str) -> RunConfig:
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert main(["config", "--init-from", str(weights), *[a for s in settings for a in ("--set", s)]]) == 0
    return RunConfig.from_json(json.loads(printed.getvalue()))


@pytest.mark.parametrize("model", [LLAMA3, GPT], ids=["llama3", "gpt"])
def test_a_run_starts_from_given_weights_pinned_by_their_cid(tmp_path: Path, model: ModelConfig) -> None:
    weights = export_of(tmp_path, model, seed=7)
    config = config_from(weights, "run_id=from-weights", "inner.batch_size=2", "data.eval_batches=1")
    given = params_of(build_model(model, 7))
    assert dataclasses.replace(config.model, init_from="", init_params="") == model
    assert config.model.init_from == str(weights.resolve())
    assert config.model.init_params == str(init_params_cid(given)) == str(CID.of(encode_params(given)))
    run = open_genesis(tmp_path / "run", config)
    assert str(run.global_state.params_cid) == config.model.init_params  # θ⁽⁰⁾ is the given weights
    assert all(torch.equal(run.global_state.params[n], t) for n, t in given.items())


def test_tampered_or_mismatched_weights_are_refused(tmp_path: Path, capsys) -> None:
    from safetensors.torch import load_file, save_file

    weights = export_of(tmp_path, LLAMA, seed=7)
    config = config_from(weights, "inner.batch_size=2", "data.eval_batches=1")
    state = load_file(str(weights / "model.safetensors"))
    state["model.norm.weight"][0] += 1e-3  # one value changed after the config pinned the weights
    save_file(state, str(weights / "model.safetensors"))
    pinned = config.model.init_params
    with pytest.raises(InitWeightsError, match=f"its weights hash to .*pins model.init_params = {pinned}"):
        open_genesis(tmp_path / "run", config)
    assert not (tmp_path / "run" / "HEAD").exists()

    cases = [
        ({k: v for k, v in state.items() if k != "model.norm.weight"},
         "lacks parameters of the run's model: model.norm.weight"),
        ({**state, "model.extra.weight": torch.zeros(2)},
         "holds tensors the run's model does not have: model.extra.weight"),
        ({**state, "model.norm.weight": torch.zeros(31)}, "model.norm.weight has shape [31], the run's model [32]"),
        ({**state, "model.norm.weight": torch.zeros(32, dtype=torch.int32)}, "model.norm.weight is int32"),
    ]
    for tensors, message in cases:
        save_file(tensors, str(weights / "model.safetensors"))
        assert main(["config", "--init-from", str(weights)]) == 1
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    (weights / "model.safetensors").write_bytes(b"not safetensors")
    assert main(["config", "--init-from", str(weights)]) == 1
    assert "is not a safetensors file" in capsys.readouterr().err
    # bfloat16 weights start a float32 run exactly
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(weights / "model.safetensors"))
    config = config_from(weights)
    assert config.model.init_params == str(init_params_cid({k: v.to(torch.bfloat16).float() for k, v in state.items()}))
    assert main(["config", "--init-from", str(weights), "--model-config", str(weights)]) == 2


def test_a_worker_refuses_a_genesis_that_is_not_the_pinned_weights(tmp_path: Path) -> None:
    from proto import pb
    from trainer.worker.client import WorkerError, check_pinned_genesis

    weights = export_of(tmp_path, LLAMA, seed=7)
    config = config_from(weights)
    pinned = config.model.init_params
    check_pinned_genesis(config, pb.GlobalHeader(round=0, params_cid=pinned))
    check_pinned_genesis(config, pb.GlobalHeader(round=1, params_cid=str(CID.of(b"later"))))
    check_pinned_genesis(run_config(LLAMA), pb.GlobalHeader(round=0, params_cid=str(CID.of(b"seed"))))
    with pytest.raises(WorkerError, match=f"but the run's config pins model.init_params = {pinned}"):
        check_pinned_genesis(config, pb.GlobalHeader(round=0, params_cid=str(CID.of(b"other"))))


def test_the_audit_checks_the_genesis_checkpoint_against_the_pinned_weights(tmp_path: Path) -> None:
    from audit.findings import Findings
    from audit.lineage import Lineage
    from audit.result import AuditResult
    from settlement.records import RunRecord
    from storage_client import Manifest

    weights = export_of(tmp_path, LLAMA, seed=7)
    run = open_genesis(tmp_path / "run", config_from(weights, "inner.batch_size=2", "data.eval_batches=1"))
    store = run.run_dir.store
    honest_cid, honest = run.manifests[0]
    # A genesis that names the seed's θ⁽⁰⁾ under the same config: every digest on the chain agrees
    # with it, only the config's pin does not.
    seed_params = store.put(encode_params(params_of(build_model(LLAMA, run.config.seed))))
    forged = dataclasses.replace(honest, params=str(seed_params))
    forged_cid = forged.store(store)

    def failures(cid: CID, manifest: Manifest) -> list:
        findings = Findings(AuditResult(), store)
        record = RunRecord(coordinator="0x" + "11" * 20, last_round=0, challenge_window=0, last_checkpoint=b"",
                           genesis_checkpoint=CID.parse(manifest.params).digest,
                           config_digest=CID.parse(manifest.config).digest, genesis_manifest=cid.digest)
        assert Lineage(findings, ledger=None).check_genesis(cid.digest, record) is not None
        return findings.result.failures

    assert failures(honest_cid, honest) == []
    [failure] = failures(forged_cid, forged)
    assert failure.check == "genesis-checkpoint" and "not the weights the config pins" in failure.message


@pytest.mark.parametrize("cfg", [LLAMA3, YARN, BIASED], ids=["llama3", "yarn", "bias-head_dim"])
def test_pipeline_stages_compute_the_features_as_the_whole_model(cfg: ModelConfig) -> None:
    model = build_model(cfg, 5)
    x = torch.randint(cfg.vocab_size, (2, cfg.block_size), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = x
        for stage in split_model(model, 2):  # each stage builds its own (cos, sin) from the rotary module
            hidden = stage(hidden)
        assert torch.equal(hidden, model(x)[0])


def test_an_export_transformers_cannot_load_is_refused_in_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    import trainer.model.hf

    open_genesis(tmp_path / "run", run_config(LLAMA))
    config_json = trainer.model.hf.exported_config_json
    monkeypatch.setattr(trainer.model.hf, "exported_config_json",
                        lambda cfg: {**config_json(cfg), "model_type": "no-such-model"})
    assert main(["export", "--run", str(tmp_path / "run"), "--round", "0", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert "the export does not load back with transformers (ValueError" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
