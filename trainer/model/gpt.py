"""A small decoder-only transformer (GPT), readable in one sitting, and :func:`build_model`, the
one entry point that builds a model of any family (the GPT here; Llama and Qwen2 from
``transformers``, trainer.model.hf).

Pre-norm blocks of causal self-attention and a 4x MLP, learned positional embeddings, and an
untied output head (tied weights would share storage, which safetensors refuses to serialise).
Every parameter is float32; :func:`build_model` seeds the initialisation so every process that
builds a model from the same configuration gets the same genesis parameters bit for bit.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        # (B, T, C) -> (B, heads, T, C/heads)
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(batch, time, channels))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * layers) so depth keeps the variance.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, time = idx.shape
        if time > self.cfg.block_size:
            raise ValueError(f"sequence of {time} tokens exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(time, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def new_model(cfg: ModelConfig) -> nn.Module:
    """A model of ``cfg``'s family, initialised from torch's global generator as it stands: the
    GPT, or a ``transformers`` decoder (trainer.model.hf). Unseeded: for parameter names and
    shapes (under ``torch.device("meta")``); a run's model comes from :func:`build_model`."""
    if cfg.family == "gpt":
        return GPT(cfg)
    from trainer.model.hf import build_hf_model  # imports transformers: only for its families

    return build_hf_model(cfg)


def build_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """The genesis model of a run, of any family: same ``cfg`` and ``seed`` give the same
    parameters, bit for bit. The global generator is seeded for the build and restored after, so
    building a model leaves the caller's random stream as it was."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return new_model(cfg)
    finally:
        torch.random.set_rng_state(generator_state)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
