"""Model families: the configuration's checks, deterministic builds of the transformers families
with Hugging Face names, a config.json read as the model section, and `dilocox export` loaded back
by transformers (offline, from the local folder)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from cli.main import main
from storage_client import CID, lineage
from trainer.codec.wire import encode_params
from trainer.config import ConfigError, DataConfig, InnerConfig, ModelConfig, RunConfig, estimated_parameters
from trainer.model.gpt import build_model
from trainer.model.hf import model_section_from_hf, read_hf_config
from trainer.model.params import params_of
from trainer.runstore.run_dir import RunDir

LLAMA = ModelConfig(family="llama", block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
QWEN2 = dataclasses.replace(LLAMA, family="qwen2", n_kv_head=1, n_embd=64, intermediate_size=80)


def run_config(model: ModelConfig, **sections) -> RunConfig:
    return RunConfig(run_id="models", model=model, inner=InnerConfig(batch_size=2), data=DataConfig(eval_batches=1),
                     **sections)


@pytest.mark.parametrize("cfg", [ModelConfig(), LLAMA, QWEN2, dataclasses.replace(LLAMA, n_kv_head=0)],
                         ids=["gpt", "llama", "qwen2", "llama-mha"])
def test_estimated_parameters_is_the_built_models_count(cfg: ModelConfig) -> None:
    assert estimated_parameters(cfg) == sum(p.numel() for p in build_model(cfg, 0).parameters())


@pytest.mark.parametrize("cfg", [LLAMA, QWEN2], ids=["llama", "qwen2"])
def test_hf_builds_are_deterministic_and_named_as_hugging_face_names_them(cfg: ModelConfig) -> None:
    before = torch.random.get_rng_state()
    a, b = build_model(cfg, 7), build_model(cfg, 7)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's stream is untouched
    assert CID.of(encode_params(params_of(a))) == CID.of(encode_params(params_of(b)))
    assert encode_params(params_of(a)) != encode_params(params_of(build_model(cfg, 8)))
    shapes = {n: tuple(p.shape) for n, p in a.named_parameters()}
    hd, kv = cfg.head_dim, cfg.kv_heads
    assert list(shapes)[0] == "model.embed_tokens.weight" and list(shapes)[-2:] == ["model.norm.weight", "lm_head.weight"]
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (cfg.vocab_size, cfg.n_embd)
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (cfg.n_head * hd, cfg.n_embd)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (kv * hd, cfg.n_embd)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (cfg.mlp_width, cfg.n_embd)
    assert ("model.layers.0.self_attn.q_proj.bias" in shapes) == (cfg.family == "qwen2")
    assert all(p.dtype == torch.float32 for p in a.parameters())
    # Untied: the output head is its own tensor (safetensors refuses shared storage).
    assert a.lm_head.weight.data_ptr() != a.model.embed_tokens.weight.data_ptr()
    x = torch.randint(cfg.vocab_size, (2, cfg.block_size))
    logits, loss = a(x, x)
    assert logits.shape == (2, cfg.block_size, cfg.vocab_size) and loss is not None and loss.item() > 0
    with pytest.raises(ValueError, match="exceeds block_size"):
        a(torch.zeros(1, cfg.block_size + 1, dtype=torch.long))


def test_the_derived_mlp_width() -> None:
    assert LLAMA.mlp_width == 96 and dataclasses.replace(LLAMA, n_embd=64).mlp_width == 192
    assert QWEN2.mlp_width == 80 and ModelConfig().mlp_width == 4 * ModelConfig().n_embd


@pytest.mark.parametrize(("model", "message"), [
    (dataclasses.replace(LLAMA, family="mistral"), "model.family = 'mistral' is not supported: must be one of gpt, llama, qwen2"),
    (dataclasses.replace(LLAMA, n_kv_head=3), "model.n_head = 4 must be a multiple of model.n_kv_head = 3"),
    (dataclasses.replace(LLAMA, n_kv_head=300), "model.n_kv_head = 300 is out of range"),
    (dataclasses.replace(LLAMA, n_head=32), "head dimension) must be even"),
    (dataclasses.replace(LLAMA, n_embd=30), "model.n_embd must be divisible by model.n_head"),
    (dataclasses.replace(LLAMA, rope_theta=0.5), "model.rope_theta = 0.5 is out of range"),
    (ModelConfig(n_kv_head=2), "model.n_kv_head = 2 applies to the llama, qwen2 families only"),
    (ModelConfig(intermediate_size=64), "model.intermediate_size = 64 applies to the llama, qwen2 families only"),
])
def test_bad_model_sections_are_refused_by_name(model: ModelConfig, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_config(model)


def test_a_model_family_travels_in_the_config_and_its_cid() -> None:
    config = run_config(LLAMA)
    assert RunConfig.from_json(json.loads(config.canonical())) == config
    assert config.cid != run_config(dataclasses.replace(LLAMA, family="qwen2")).cid
    assert config.with_settings(["model.family=qwen2"]).model.family == "qwen2"


# ---------------------------------------------------------------------------- config.json in


def hf_json(**fields) -> dict:
    base = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 176,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
            "max_position_embeddings": 32768, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}
    base.update(fields)
    return {k: v for k, v in base.items() if v is not ...}


def test_a_config_json_becomes_the_model_section(tmp_path: Path, capsys) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_json()))
    assert main(["config", "--model-config", str(path), "--set", "model.block_size=128", "--set", "inner.steps=3"]) == 0
    config = RunConfig.from_json(json.loads(capsys.readouterr().out))
    assert config.model == ModelConfig(family="llama", vocab_size=300, block_size=128, n_layer=2, n_head=4,
                                       n_embd=64, n_kv_head=2, intermediate_size=176, rope_theta=500000.0,
                                       rms_norm_eps=1e-5)
    assert config.inner.steps == 3
    # The context of the file (32768) is beyond the range until --set lowers it; a folder works too.
    assert main(["config", "--model-config", str(tmp_path)]) == 1
    assert "model.block_size = 32768 is out of range" in capsys.readouterr().err
    # transformers 5 spelling of RoPE, no num_key_value_heads (= heads), qwen2.
    section = model_section_from_hf(hf_json(model_type="qwen2", rope_theta=..., num_key_value_heads=...,
                                            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                            use_sliding_window=False, sliding_window=4096))
    assert (section["family"], section["n_kv_head"], section["rope_theta"]) == ("qwen2", 4, "1000000.0")


@pytest.mark.parametrize(("fields", "message"), [
    ({"model_type": "mistral"}, "model_type = 'mistral' is not supported: must be one of llama, qwen2, gpt2"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type = 'dynamic' is not supported"),
    ({"rope_theta": ..., "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
     "rope_parameters.rope_type = 'longrope'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "mrope_section": [1]}}, "rope_scaling has mrope_section"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": False}}, "transformers 4.4x always truncates"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor is missing"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor = '0.5' is not supported"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings = 'yes' is not true or false"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window = 'True' is not supported"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types = "),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported"),
    ({"mlp_bias": True}, "mlp_bias = 'True' is not supported"),
    ({"model_type": "qwen2", "head_dim": 128}, "head_dim = '128' is not supported for qwen2"),
    ({"model_type": "gpt2", "n_positions": 64, "n_embd": 32, "n_layer": 1, "n_head": 2},
     "activation_function = 'gelu_new' is not supported: the built-in GPT"),
    ({"hidden_size": "64"}, "hidden_size = '64' is not an integer"),
    ({"num_hidden_layers": ...}, "num_hidden_layers is missing"),
])
def test_config_json_features_the_loader_does_not_build_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        model_section_from_hf(hf_json(**fields))


def test_a_config_json_is_read_bounded(tmp_path: Path) -> None:
    big = tmp_path / "config.json"
    big.write_bytes(b"{" + b" " * (2 << 20) + b"}")
    with pytest.raises(ConfigError, match="more than"):
        read_hf_config(big)
    big.write_text("[[[[" * 100)
    with pytest.raises(ConfigError, match="nests deeper"):
        read_hf_config(big)
    with pytest.raises(ConfigError, match="--model-config"):
        read_hf_config(tmp_path / "missing.json")


# ------------------------------------------------------------------------------------ export


def test_export_round_trips_through_transformers(tmp_path: Path, capsys) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from trainer.coordinator.run import open_run

    run = open_run(RunDir(tmp_path / "run"), run_config(QWEN2))
    out = tmp_path / "hf"
    assert main(["export", "--run", str(tmp_path / "run"), "--round", "0", str(out)]) == 0
    manifest_cid, manifest = lineage(run.run_dir.store, run.run_dir.head())[0]
    assert str(manifest_cid) in capsys.readouterr().out
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt", "dilocox.manifest": str(manifest_cid), "dilocox.round": "0",
                                "dilocox.config": manifest.config}
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["Qwen2ForCausalLM"] and hf["torch_dtype"] == "float32"
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert type(loaded).__name__ == "Qwen2ForCausalLM" and loaded.dtype == torch.float32
    x = torch.randint(QWEN2.vocab_size, (2, QWEN2.block_size), generator=torch.Generator().manual_seed(0))
    ours = build_model(run.config.model, run.config.seed)
    with torch.no_grad():
        assert torch.allclose(loaded(x).logits, ours(x)[0], atol=1e-6)
    # The exported config.json reads back as the same model section.
    assert model_section_from_hf(hf) == run.config.to_json()["model"]


def test_export_refusals(tmp_path: Path, capsys) -> None:
    from trainer.coordinator.run import open_run

    open_run(RunDir(tmp_path / "llama"), run_config(LLAMA))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    (tmp_path / "empty").mkdir()
    cases = [
        (["--run", str(tmp_path / "llama"), "--round", "3", str(tmp_path / "a")], 2, "--round 3: run 'models' has rounds 0 to 0"),
        (["--run", str(tmp_path / "llama"), "--round", "-1", str(tmp_path / "a")], 2, "--round -1"),
        (["--run", str(tmp_path / "llama"), "--round", "0", str(tmp_path / "full")], 2, "exists and is not an empty folder"),
        (["--run", str(tmp_path / "empty"), "--round", "0", str(tmp_path / "a")], 1, "holds no run"),
    ]
    for argv, code, message in cases:
        assert main(["export", *argv]) == code, argv
        assert message in capsys.readouterr().err, argv
    assert not (tmp_path / "a").exists() and not list((tmp_path / "empty").iterdir())
    # An existing empty folder is filled.
    assert main(["export", "--run", str(tmp_path / "llama"), "--round", "0", str(tmp_path / "empty")]) == 0
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == ["config.json", "model.safetensors"]
