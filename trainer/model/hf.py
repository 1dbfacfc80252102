"""Decoder models of the Hugging Face ``transformers`` families (Llama, Qwen2), built from a
:class:`trainer.config.ModelConfig` alone: no hub id, no download, no weights read. A local
``config.json`` can supply that model section (:func:`read_hf_config`, ``dilocox config
--model-config`` / ``--init-from``); the built-in GPT maps onto GPT-2 (:func:`gpt2_name`).

``hf_config(cfg)`` is the family's ``transformers`` configuration (``LlamaConfig`` /
``Qwen2Config``) with the sizes of ``cfg``, and every setting this project depends on pinned
explicitly rather than left to the library's defaults:

    hidden_size = n_embd, num_hidden_layers = n_layer, num_attention_heads = n_head,
    num_key_value_heads = kv_heads, intermediate_size = mlp_width, vocab_size,
    max_position_embeddings = block_size (yarn: its pretraining context, max_position_embeddings),
    rope_parameters = {rope_type, rope_theta, and the type's fields} (rope_parameters),
    rms_norm_eps, hidden_act silu, initializer_range 0.02, no dropout, tie_word_embeddings,
    attn_implementation "sdpa", dtype float32;
    llama: attention_bias (q, k, v, o), no MLP bias, head_dim = ModelConfig.head_dim;
    qwen2: biases on q, k, v (the class has them fixed), no sliding window.

The model trains with transformers' own rotary module built from those ``rope_parameters``, so the
run computes the RoPE the exported model computes (linear: positions / factor; llama3: the
wavelength-banded division of the frequencies by factor; yarn: the ramp between interpolated and
extrapolated frequencies over the correction range of beta_fast..beta_slow rotations, cos and sin
scaled by attention_factor; all as transformers.modeling_rope_utils states them). A tied model's
``lm_head.weight`` is ``model.embed_tokens.weight`` (one Parameter, so one tensor in θ, in
checkpoints and in the export; transformers ties it again on load).

:func:`hf_config_json` is the exported ``config.json``: every field transformers 4.4x and 5 read,
in both spellings (``rope_theta`` + ``rope_scaling`` for 4.4x, ``rope_parameters`` for 5, which
prefers ``rope_scaling`` when both are present: they are written to agree).

:class:`HFDecoder` holds the ``transformers`` model's two top-level modules under their own names,
``model`` (``LlamaModel`` / ``Qwen2Model``: embed_tokens, layers, norm, rotary_emb) and
``lm_head``, so its parameter names are exactly the Hugging Face ones (``model.embed_tokens.weight``,
``model.layers.0.self_attn.q_proj.weight``, ..., ``model.norm.weight``, ``lm_head.weight``) and a
checkpoint is a Hugging Face state dict as it stands (``dilocox export``). It is called as the
built-in GPT is, ``model(idx, targets) -> (logits, loss)`` with ``targets`` the next tokens
(already shifted, unlike ``transformers``' ``labels``) and the loss the mean cross-entropy over
every token.

:class:`HFStage` is one pipeline stage of an :class:`HFDecoder` (trainer.model.stages states the
split): stage 0 holds ``model.embed_tokens``, every stage its contiguous ``model.layers.<i>`` and
its own reference to the rotary module (buffers only, no parameters: each stage computes the
(cos, sin) of positions 0..T-1 itself rather than receiving them), the last stage ``model.norm``
and ``lm_head``. A decoder layer is called as ``LlamaModel.forward`` calls it for a sequence
without padding: ``layer(h, attention_mask=None, position_embeddings=(cos, sin),
position_ids=[0..T-1])``; with no mask, ``transformers``' sdpa attention runs causal
(``is_causal=True``), which is what ``LlamaModel`` does too when no padding mask is given.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.config import ROPE_FAMILIES, ROPE_TYPES, ConfigError, ModelConfig

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


def rope_scaling(cfg: ModelConfig) -> dict[str, Any] | None:
    """``cfg``'s RoPE scaling as transformers 4.4x reads it (``rope_scaling``; None for unscaled
    RoPE), complete for transformers 5 too given the top-level ``rope_theta`` and
    ``max_position_embeddings`` (5 takes ``rope_scaling`` over ``rope_parameters`` when a config.json
    has both, so the two must agree). yarn's ``attention_factor`` is written out (0.1 ln(factor) + 1
    when the config leaves it 0), so the versions need not agree on its default."""
    if cfg.rope_type == "default":
        return None
    scaling: dict[str, Any] = {"rope_type": cfg.rope_type, "factor": cfg.rope_factor}
    if cfg.rope_type == "llama3":
        scaling.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                       original_max_position_embeddings=cfg.rope_original_max_position_embeddings)
    elif cfg.rope_type == "yarn":
        scaling.update(attention_factor=cfg.rope_attention_factor or 0.1 * math.log(cfg.rope_factor) + 1.0,
                       beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow)
    return scaling


def rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """``cfg``'s RoPE as transformers 5 reads it (``rope_parameters``): the type, the base and the
    scaling's fields (:func:`rope_scaling`)."""
    params: dict[str, Any] = {**(rope_scaling(cfg) or {"rope_type": "default"}), "rope_theta": cfg.rope_theta}
    if cfg.rope_type == "yarn":
        params["original_max_position_embeddings"] = cfg.rope_original_max_position_embeddings
    return params


def max_position_embeddings(cfg: ModelConfig) -> int:
    """block_size, except under yarn: its pretraining context. transformers 4.4x's yarn finds its
    correction range from ``max_position_embeddings``, 5's from ``original_max_position_embeddings``;
    equal, the two compute the same frequencies (no other part of these models reads it)."""
    return cfg.rope_original_max_position_embeddings if cfg.rope_type == "yarn" else cfg.block_size


def hf_config(cfg: ModelConfig) -> Any:
    """The family's ``transformers`` configuration for ``cfg`` (see the module doc)."""
    config_class, model_class = _classes(cfg.family)
    extra: dict[str, Any] = {}
    if cfg.family == "llama":
        extra = dict(attention_bias=cfg.attention_bias, mlp_bias=False, head_dim=cfg.head_dim)
    elif cfg.family == "qwen2":
        extra = dict(use_sliding_window=False, sliding_window=None)
    return config_class(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.mlp_width,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=max_position_embeddings(cfg), rope_parameters=rope_parameters(cfg),
        hidden_act="silu", rms_norm_eps=cfg.rms_norm_eps, initializer_range=INITIALIZER_RANGE,
        attention_dropout=0.0, tie_word_embeddings=cfg.tie_word_embeddings,
        architectures=[model_class.__name__], dtype="float32", **extra,
    )


def hf_config_json(cfg: ModelConfig) -> dict[str, Any]:
    """The exported ``config.json`` object of ``cfg``: :func:`hf_config` with every field that
    transformers 4.4x and 5.x read, in both spellings where they differ: ``rope_theta`` and
    ``rope_scaling`` (4.4x) beside ``rope_parameters`` (5), ``torch_dtype`` (4) beside ``dtype`` (5)."""
    hf = hf_config(cfg).to_dict()
    hf["rope_parameters"] = rope_parameters(cfg)
    hf["rope_theta"] = cfg.rope_theta
    hf["rope_scaling"] = rope_scaling(cfg)
    hf["torch_dtype"] = hf["dtype"] = "float32"
    hf["tie_word_embeddings"] = cfg.tie_word_embeddings
    if cfg.family == "llama":
        hf["head_dim"] = cfg.head_dim
    return hf


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
    seeds it: trainer.model.gpt.build_model), float32, sdpa attention."""
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


# --------------------------------------------------------------------- the built-in GPT as GPT-2

# GPT (trainer.model.gpt) parameter -> GPT-2 (transformers' GPT2LMHeadModel) parameter, and whether the
# tensor is transposed: GPT-2's Conv1D keeps a linear map's weight as (in, out), nn.Linear as (out, in).
# The blocks match GPT-2's exactly: pre-LayerNorm (eps 1e-5), fused q, k, v in that order, exact
# (erf) GELU (GPT-2's activation_function "gelu"), a 4x MLP, biases on every linear map but the head,
# learned positions, attention scaled by 1/sqrt(head dim), no dropout; the head is untied.
_GPT2_BLOCK = {"ln1.weight": ("ln_1.weight", False), "ln1.bias": ("ln_1.bias", False),
               "attn.qkv.weight": ("attn.c_attn.weight", True), "attn.qkv.bias": ("attn.c_attn.bias", False),
               "attn.proj.weight": ("attn.c_proj.weight", True), "attn.proj.bias": ("attn.c_proj.bias", False),
               "ln2.weight": ("ln_2.weight", False), "ln2.bias": ("ln_2.bias", False),
               "mlp.fc.weight": ("mlp.c_fc.weight", True), "mlp.fc.bias": ("mlp.c_fc.bias", False),
               "mlp.proj.weight": ("mlp.c_proj.weight", True), "mlp.proj.bias": ("mlp.c_proj.bias", False)}
_GPT2_TOP = {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight",
             "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias",
             "lm_head.weight": "lm_head.weight"}


def gpt2_name(name: str) -> tuple[str, bool]:
    """The GPT-2 name of a GPT parameter, and whether its tensor is transposed there."""
    if name in _GPT2_TOP:
        return _GPT2_TOP[name], False
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit() and parts[2] in _GPT2_BLOCK:
        gpt2, transposed = _GPT2_BLOCK[parts[2]]
        return f"transformer.h.{parts[1]}.{gpt2}", transposed
    raise ConfigError(f"{name[:80]!r} is not a parameter of the built-in GPT")


def gpt2_config_json(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of ``cfg``'s GPT as ``GPT2LMHeadModel`` (transformers 4.4x and 5.x)."""
    from transformers import GPT2Config

    hf = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_inner=4 * cfg.n_embd, activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, layer_norm_epsilon=1e-5, initializer_range=INITIALIZER_RANGE, scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False, tie_word_embeddings=False,
        architectures=["GPT2LMHeadModel"], dtype="float32", bos_token_id=None, eos_token_id=None,
    ).to_dict()
    hf["n_ctx"] = cfg.block_size  # read by transformers 4.x as the context
    hf["torch_dtype"] = hf["dtype"] = "float32"
    hf["tie_word_embeddings"] = False
    return hf


def export_state(cfg: ModelConfig, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """θ under the exported model's names: the Hugging Face families' as they stand (their names are
    transformers' already), the GPT's as GPT-2's (:func:`gpt2_name`), contiguous."""
    if cfg.family in HF_CLASSES:
        return {name: t.contiguous() for name, t in params.items()}
    out = {}
    for name, tensor in params.items():
        gpt2, transposed = gpt2_name(name)
        out[gpt2] = (tensor.t() if transposed else tensor).contiguous()
    return out


def import_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`export_state`: a Hugging Face state dict under the run's names (a GPT's
    from GPT-2's); a name the run's model does not have is kept as it is, for the caller to refuse."""
    if cfg.family in HF_CLASSES:
        return dict(state)
    from trainer.model.gpt import new_model

    with torch.device("meta"):
        names = [n for n, _ in new_model(cfg).named_parameters()]
    back = {gpt2_name(n)[0]: (n, gpt2_name(n)[1]) for n in names}
    out = {}
    for name, tensor in state.items():
        ours, transposed = back.get(name, (name, False))
        out[ours] = tensor.t().contiguous() if transposed else tensor
    return out


def exported_config_json(cfg: ModelConfig) -> dict[str, Any]:
    """The exported ``config.json`` of any family: :func:`hf_config_json`, or :func:`gpt2_config_json`."""
    return hf_config_json(cfg) if cfg.family in HF_CLASSES else gpt2_config_json(cfg)


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


# The keys of a rope_scaling / rope_parameters object this loader reads (the rest are refused by name).
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
              "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim", "truncate"}


def _rope_fields(obj: dict) -> dict[str, Any]:
    """The RoPE fields of the model section (floats as their repr, as the JSON form holds them) from a
    config.json in either spelling: ``rope_scaling`` and ``rope_theta`` (transformers 4.4x), or
    ``rope_parameters`` (5), ``rope_scaling`` first when both are there, as transformers 5 reads them.
    Defaults are transformers': 10000 for the base, ``max_position_embeddings`` for the pretraining
    context, 32 and 1 for yarn's betas; yarn's ``mscale`` and ``mscale_all_dim`` become the
    ``attention_factor`` transformers 5 derives from them."""
    params = obj.get("rope_scaling") or obj.get("rope_parameters") or {}
    name = "rope_scaling" if obj.get("rope_scaling") else "rope_parameters"
    if not isinstance(params, dict):
        raise ConfigError(f"{_field(name, params)} is not an object")
    unknown = sorted(str(k)[:40] for k in params if k not in _ROPE_KEYS)
    if unknown:
        raise ConfigError(f"config.json: {name} has {', '.join(unknown[:5])}, which this loader does not build")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{_field(name + '.rope_type', rope_type)} is not supported: must be one of "
                          f"{', '.join(ROPE_TYPES)} (dynamic and longrope change the frequencies with the "
                          f"sequence's length)")
    # as transformers 5 fills it in: the object's own, else the top-level rope_theta (4.4x's only one)
    theta = params.get("rope_theta", obj.get("rope_theta", 10000.0))
    fields: dict[str, Any] = {"rope_theta": repr(_number({"rope_theta": theta}, "rope_theta", float))}
    if rope_type == "default":
        return fields

    def number(key: str, kind: type = float, default: Any = None) -> Any:
        return _number({f"{name}.{key}": params.get(key, default)}, f"{name}.{key}", kind)

    fields.update(rope_type=rope_type, rope_factor=repr(number("factor")))
    if rope_type in ("llama3", "yarn"):
        fields["rope_original_max_position_embeddings"] = number(
            "original_max_position_embeddings", int, obj.get("max_position_embeddings"))
    if rope_type == "llama3":
        fields.update(rope_low_freq_factor=repr(number("low_freq_factor")),
                      rope_high_freq_factor=repr(number("high_freq_factor")))
    elif rope_type == "yarn":
        if params.get("truncate", True) is not True:
            raise ConfigError(f"{_field(name + '.truncate', params.get('truncate'))} is not supported: "
                              f"transformers 4.4x always truncates yarn's correction range")
        fields.update(rope_beta_fast=repr(number("beta_fast", float, 32.0)),
                      rope_beta_slow=repr(number("beta_slow", float, 1.0)))
        factor, attention = float(fields["rope_factor"]), params.get("attention_factor")
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if attention is None and mscale and mscale_all_dim:  # transformers 5's rule

            def scale(m: float) -> float:
                return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

            attention = scale(number("mscale")) / scale(number("mscale_all_dim"))
        # The default (0: derived from factor) when it is the derived value, as an export writes it.
        if attention is not None and attention != 0.1 * math.log(factor) + 1.0:
            fields["rope_attention_factor"] = repr(_number({name: attention}, name, float))
    return fields


def _refuse_unsupported(obj: dict, family: str) -> None:
    """One line naming the first field that asks for something this loader does not build."""
    expected = {"hidden_act": "silu", "attention_dropout": 0.0, "mlp_bias": False, "use_sliding_window": False,
                "quantization_config": None, "partial_rotary_factor": 1.0}
    if family == "qwen2":  # its q, k, v biases are fixed by the class, not a setting (attention_bias is ignored)
        del expected["mlp_bias"]
    for name, want in expected.items():
        if name in obj and obj[name] != want:
            raise ConfigError(f"{_field(name, obj[name])} is not supported: this loader builds {want!r}")
    for name in ("tie_word_embeddings", "attention_bias"):
        if name in obj and type(obj[name]) is not bool:
            raise ConfigError(f"{_field(name, obj[name])} is not true or false")
    layer_types = obj.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list)
                                    or any(t != "full_attention" for t in layer_types)):
        raise ConfigError(f"{_field('layer_types', layer_types)} is not supported: every layer must be "
                          f"'full_attention' (no sliding windows)")
    head_dim = obj.get("head_dim")
    if (family == "qwen2" and head_dim is not None
            and head_dim != _number(obj, "hidden_size", int) // _number(obj, "num_attention_heads", int)):
        raise ConfigError(f"{_field('head_dim', head_dim)} is not supported for qwen2: transformers' Qwen2Config "
                          f"has no head_dim (its attention uses hidden_size / num_attention_heads)")


def model_section_from_hf(obj: Any) -> dict[str, Any]:
    """The ``model`` section (its JSON form, unvalidated: the run configuration validates it) of
    a Hugging Face ``config.json`` object of a supported ``model_type`` (llama, qwen2).

    hidden_size -> n_embd, num_hidden_layers -> n_layer, num_attention_heads -> n_head,
    num_key_value_heads -> n_kv_head (absent: n_head), intermediate_size, vocab_size,
    max_position_embeddings -> block_size, rms_norm_eps, tie_word_embeddings, attention_bias
    (llama; qwen2's biases are fixed by its class, which ignores the field), head_dim -> head_size
    (llama; left 0 when it is hidden_size / heads), the RoPE fields (:func:`_rope_fields`). A field
    the loader does not build (dynamic or longrope RoPE, sliding windows, an MLP bias, another
    activation, dropout, quantization, partial rotary) is refused with one line naming it and its
    value. A ``gpt2`` config.json is read as the built-in GPT's (:func:`_gpt2_section`).
    """
    if not isinstance(obj, dict):
        raise ConfigError("config.json: not a JSON object")
    family = obj.get("model_type")
    if family == "gpt2":
        return _gpt2_section(obj)
    if family not in HF_CLASSES:
        raise ConfigError(f"{_field('model_type', family)} is not supported: must be one of "
                          f"{', '.join(HF_CLASSES)}, gpt2")
    _refuse_unsupported(obj, family)
    section: dict[str, Any] = {"family": family}
    for hf_name, name in _HF_SIZES.items():
        default = obj.get("num_attention_heads") if hf_name == "num_key_value_heads" else None
        section[name] = _number(obj, hf_name, int, default)
    section.update(_rope_fields(obj))
    section["rms_norm_eps"] = repr(_number(obj, "rms_norm_eps", float, 1e-6))
    if obj.get("tie_word_embeddings"):
        section["tie_word_embeddings"] = True
    if obj.get("attention_bias") and family == "llama":
        section["attention_bias"] = True
    head_dim = obj.get("head_dim")
    if head_dim is not None and head_dim != section["n_embd"] // section["n_head"]:
        section["head_size"] = _number(obj, "head_dim", int)
    return section


def _gpt2_section(obj: dict) -> dict[str, Any]:
    """The built-in GPT's model section of a GPT-2 config.json that computes what it computes
    (:func:`gpt2_config_json`, as ``dilocox export`` writes it): exact GELU, LayerNorm eps 1e-5, a 4x
    MLP, an untied head. The hub's GPT-2 checkpoints use the tanh GELU and a tied head: refused."""
    # (field, GPT2Config's default, what the GPT computes)
    for name, default, want in (("activation_function", "gelu_new", "gelu"), ("layer_norm_epsilon", 1e-5, 1e-5),
                                ("tie_word_embeddings", True, False), ("scale_attn_weights", True, True),
                                ("scale_attn_by_inverse_layer_idx", False, False),
                                ("reorder_and_upcast_attn", False, False)):
        value = obj.get(name, default)
        if value != want:
            raise ConfigError(f"{_field(name, value)} is not supported: the built-in GPT (family gpt) computes "
                              f"{name} = {want!r}")
    section: dict[str, Any] = {"family": "gpt"}
    for hf_name, name in (("vocab_size", "vocab_size"), ("n_positions", "block_size"), ("n_layer", "n_layer"),
                          ("n_head", "n_head"), ("n_embd", "n_embd")):
        section[name] = _number(obj, hf_name, int)
    if obj.get("n_inner") not in (None, 4 * section["n_embd"]):
        raise ConfigError(f"{_field('n_inner', obj['n_inner'])} is not supported: the built-in GPT's MLP is 4 x n_embd")
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
