"""Decoder models of the Hugging Face ``transformers`` families (Llama, Qwen2), built from a
:class:`trainer.config.ModelConfig` alone: no hub id, no download, no weights read. A local
``config.json`` can supply that model section (:func:`read_hf_config`, ``dilocox config
--model-config``).

``hf_config(cfg)`` is the family's ``transformers`` configuration (``LlamaConfig`` /
``Qwen2Config``) with the sizes of ``cfg``, and every setting this project depends on pinned
explicitly rather than left to the library's defaults:

    hidden_size = n_embd, num_hidden_layers = n_layer, num_attention_heads = n_head,
    num_key_value_heads = kv_heads, intermediate_size = mlp_width, vocab_size,
    max_position_embeddings = block_size, rope_parameters = {rope_type: default, rope_theta},
    rms_norm_eps, hidden_act silu, initializer_range 0.02, no dropout,
    tie_word_embeddings False (tied weights share storage, which safetensors refuses),
    attn_implementation "sdpa", dtype float32;
    llama: no biases (attention_bias, mlp_bias False); qwen2: biases on q, k, v (the class has
    them fixed), no sliding window.

:class:`HFDecoder` holds the ``transformers`` model's two top-level modules under their own names,
``model`` (``LlamaModel`` / ``Qwen2Model``: embed_tokens, layers, norm, rotary_emb) and
``lm_head``, so its parameter names are exactly the Hugging Face ones (``model.embed_tokens.weight``,
``model.layers.0.self_attn.q_proj.weight``, ..., ``model.norm.weight``, ``lm_head.weight``) and a
checkpoint is a Hugging Face state dict as it stands (``dilocox export``). It is called as the
built-in GPT is, ``model(idx, targets) -> (logits, loss)`` with ``targets`` the next tokens
(already shifted, unlike ``transformers``' ``labels``) and the loss the mean cross-entropy over
every token.

:class:`HFStage` is one pipeline stage of an :class:`HFDecoder` (trainer.pipeline states the
split): stage 0 holds ``model.embed_tokens``, every stage its contiguous ``model.layers.<i>`` and
its own reference to the rotary module (buffers only, no parameters: each stage computes the
(cos, sin) of positions 0..T-1 itself rather than receiving them), the last stage ``model.norm``
and ``lm_head``. A decoder layer is called as ``LlamaModel.forward`` calls it for a sequence
without padding: ``layer(h, attention_mask=None, position_embeddings=(cos, sin),
position_ids=[0..T-1])``; with no mask, ``transformers``' sdpa attention runs causal
(``is_causal=True``), which is what ``LlamaModel`` does too when no padding mask is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.config import ROPE_FAMILIES, ConfigError, ModelConfig

# family -> (transformers configuration class, causal LM class), imported by name when needed
# (importing transformers takes seconds; the GPT never needs it).
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}
INITIALIZER_RANGE = 0.02


def _classes(family: str) -> tuple[type, type]:
    if family not in HF_CLASSES:
        raise ConfigError(f"model.family = {family[:40]!r} has no transformers class: "
                          f"{', '.join(HF_CLASSES)} have one")
    import transformers

    config_name, model_name = HF_CLASSES[family]
    return getattr(transformers, config_name), getattr(transformers, model_name)


def hf_config(cfg: ModelConfig) -> Any:
    """The family's ``transformers`` configuration for ``cfg`` (see the module doc)."""
    config_class, model_class = _classes(cfg.family)
    extra: dict[str, Any] = {}
    if cfg.family == "llama":
        extra = dict(attention_bias=False, mlp_bias=False)
    elif cfg.family == "qwen2":
        extra = dict(use_sliding_window=False, sliding_window=None)
    return config_class(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.mlp_width,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.block_size,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        hidden_act="silu", rms_norm_eps=cfg.rms_norm_eps, initializer_range=INITIALIZER_RANGE,
        attention_dropout=0.0, tie_word_embeddings=False,
        architectures=[model_class.__name__], dtype="float32", **extra,
    )


class HFDecoder(nn.Module):
    """A ``transformers`` causal LM's ``model`` and ``lm_head``, called as the built-in GPT is."""

    def __init__(self, cfg: ModelConfig, causal_lm: nn.Module) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = causal_lm.model
        self.lm_head = causal_lm.lm_head

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        time_ = idx.shape[1]
        if time_ > self.cfg.block_size:
            raise ValueError(f"sequence of {time_} tokens exceeds block_size {self.cfg.block_size}")
        hidden = self.model(input_ids=idx, use_cache=False).last_hidden_state
        logits = self.lm_head(hidden)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def build_hf_model(cfg: ModelConfig) -> HFDecoder:
    """A fresh model of ``cfg``'s family, initialised from torch's global generator (the caller
    seeds it: trainer.model.build_model), float32, sdpa attention."""
    if cfg.family not in ROPE_FAMILIES:
        raise ConfigError(f"model.family = {cfg.family[:40]!r} is not a transformers family")
    config = hf_config(cfg)
    _, model_class = _classes(cfg.family)
    causal_lm = model_class(config)
    if causal_lm.config._attn_implementation != "sdpa":  # noqa: SLF001 - the one place transformers records it
        raise ConfigError(f"transformers chose attention {causal_lm.config._attn_implementation!r}, not sdpa")
    return HFDecoder(cfg, causal_lm.float())


class HFStage(nn.Module):
    """Stage ``index`` of ``num_stages`` of an :class:`HFDecoder` holding decoder ``layers``,
    holding (not copying) its modules under the full model's names (see the module doc)."""

    def __init__(self, model: HFDecoder, index: int, num_stages: int, layers: range) -> None:
        super().__init__()
        if not 0 <= index < num_stages:
            raise ValueError(f"stage {index} out of range for {num_stages} stages")
        self.index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.block_size = model.cfg.block_size
        # Registration order follows the HF model's, so named_parameters() lists names in its order.
        self.model = nn.Module()
        if self.is_first:
            self.model.embed_tokens = model.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layers})
        if self.is_last:
            self.model.norm = model.model.norm
        self.model.rotary_emb = model.model.rotary_emb
        if self.is_last:
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (stage 0) or hidden states in; hidden states or logits (last stage) out."""
        if self.is_first:
            if x.shape[1] > self.block_size:
                raise ValueError(f"sequence of {x.shape[1]} tokens exceeds block_size {self.block_size}")
            x = self.model.embed_tokens(x)
        position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        position_embeddings = self.model.rotary_emb(x, position_ids)
        for layer in self.model.layers.values():
            x = layer(x, attention_mask=None, position_embeddings=position_embeddings, position_ids=position_ids)
        if self.is_last:
            x = self.lm_head(self.model.norm(x))
        return x


# ------------------------------------------------------------------- a local config.json in

MAX_HF_CONFIG_BYTES = 1 << 20  # a model's config.json is a few kB
# config.json field -> ModelConfig field, for the integer sizes.
_HF_SIZES = {"vocab_size": "vocab_size", "max_position_embeddings": "block_size",
             "num_hidden_layers": "n_layer", "num_attention_heads": "n_head", "hidden_size": "n_embd",
             "num_key_value_heads": "n_kv_head", "intermediate_size": "intermediate_size"}


def _field(name: str, value: Any) -> str:
    return f"config.json: {name} = {str(value)[:60]!r}"


def _number(obj: dict, name: str, kind: type, default: Any = None) -> Any:
    value = obj.get(name, default)
    if value is None:
        raise ConfigError(f"config.json: {name} is missing")
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind:
        raise ConfigError(f"{_field(name, value)} is not {'an integer' if kind is int else 'a number'}")
    return value


def _rope_theta(obj: dict) -> float:
    """The RoPE base of a config.json in either spelling (``rope_theta``, or transformers 5's
    ``rope_parameters``); any scaled RoPE (``rope_scaling``, a rope_type other than default) is refused."""
    if obj.get("rope_scaling") is not None:
        raise ConfigError(f"{_field('rope_scaling', obj['rope_scaling'])} is not supported: only unscaled RoPE")
    params = obj.get("rope_parameters")
    if params is None:
        return _number(obj, "rope_theta", float, 10000.0)
    if not isinstance(params, dict):
        raise ConfigError(f"{_field('rope_parameters', params)} is not an object")
    if params.get("rope_type", "default") != "default":
        raise ConfigError(f"{_field('rope_parameters.rope_type', params.get('rope_type'))} is not supported: "
                          f"only 'default' (unscaled RoPE)")
    return _number(params, "rope_theta", float, obj.get("rope_theta", 10000.0))


def _refuse_unsupported(obj: dict, family: str) -> None:
    """One line naming the first field that asks for something this loader does not build."""
    expected = {"tie_word_embeddings": False, "hidden_act": "silu", "attention_dropout": 0.0,
                "attention_bias": False, "mlp_bias": False, "use_sliding_window": False,
                "quantization_config": None}
    if family == "qwen2":  # its q, k, v biases are fixed by the class, not a setting
        del expected["attention_bias"], expected["mlp_bias"]
    for name, want in expected.items():
        if name in obj and obj[name] != want:
            raise ConfigError(f"{_field(name, obj[name])} is not supported: this loader builds {want!r}")
    layer_types = obj.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list)
                                    or any(t != "full_attention" for t in layer_types)):
        raise ConfigError(f"{_field('layer_types', layer_types)} is not supported: every layer must be "
                          f"'full_attention' (no sliding windows)")
    head_dim = obj.get("head_dim")
    if head_dim is not None and head_dim != _number(obj, "hidden_size", int) // _number(obj, "num_attention_heads", int):
        raise ConfigError(f"{_field('head_dim', head_dim)} is not supported: must be hidden_size / "
                          f"num_attention_heads")


def model_section_from_hf(obj: Any) -> dict[str, Any]:
    """The ``model`` section (its JSON form, unvalidated: the run configuration validates it) of
    a Hugging Face ``config.json`` object of a supported ``model_type`` (llama, qwen2).

    hidden_size -> n_embd, num_hidden_layers -> n_layer, num_attention_heads -> n_head,
    num_key_value_heads -> n_kv_head (absent: n_head), intermediate_size, vocab_size,
    max_position_embeddings -> block_size, rope_theta, rms_norm_eps. A field asking for what the
    loader does not build (scaled RoPE, sliding windows, tied embeddings, biases Llama lacks,
    another activation, dropout, quantization) is refused with one line naming it and its value.
    """
    if not isinstance(obj, dict):
        raise ConfigError("config.json: not a JSON object")
    family = obj.get("model_type")
    if family not in HF_CLASSES:
        raise ConfigError(f"{_field('model_type', family)} is not supported: must be one of {', '.join(HF_CLASSES)}")
    _refuse_unsupported(obj, family)
    section: dict[str, Any] = {"family": family}
    for hf_name, name in _HF_SIZES.items():
        default = obj.get("num_attention_heads") if hf_name == "num_key_value_heads" else None
        section[name] = _number(obj, hf_name, int, default)
    section["rope_theta"] = repr(_rope_theta(obj))
    section["rms_norm_eps"] = repr(_number(obj, "rms_norm_eps", float, 1e-6))
    return section


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """:func:`model_section_from_hf` of a local ``config.json`` (or a folder holding one), read
    with a bound on its size and nesting."""
    from storage_client import loads_bounded

    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_HF_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"--model-config {str(path)[:200]}: {exc.strerror or exc}") from None
    try:
        obj = loads_bounded(data, max_bytes=MAX_HF_CONFIG_BYTES, what=f"{str(path)[:200]}")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return model_section_from_hf(obj)
