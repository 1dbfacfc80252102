"""Decoder models of the Hugging Face ``transformers`` families (Llama, Qwen2), built from a
:class:`trainer.config.ModelConfig` alone: no hub id, no download, no file read.

``hf_config(cfg)`` is the family's ``transformers`` configuration (``LlamaConfig`` /
``Qwen2Config``) with the sizes of ``cfg``, and every setting this project depends on pinned
explicitly rather than left to the library's defaults:

    hidden_size = n_embd, num_hidden_layers = n_layer, num_attention_heads = n_head,
    num_key_value_heads = kv_heads, intermediate_size = mlp_width, vocab_size,
    max_position_embeddings = block_size, rope_parameters = {rope_type: default, rope_theta},
    hidden_act silu, rms_norm_eps 1e-6, initializer_range 0.02, no dropout,
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
RMS_NORM_EPS = 1e-6
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
        hidden_act="silu", rms_norm_eps=RMS_NORM_EPS, initializer_range=INITIALIZER_RANGE,
        attention_dropout=0.0, tie_word_embeddings=False, use_cache=False,
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
