"""Which parameters each pipeline stage of a model holds: a rule on parameter names, nothing run.

With L = ``n_layer`` blocks and P stages, ``q, r = divmod(L, P)``; stage s holds blocks

    [s·q + min(s, r), (s+1)·q + min(s+1, r))          (the first r stages hold one block more)

and, besides its blocks, stage 0 holds the input embeddings and stage P−1 everything else outside
the blocks (the final norm and the output head). 1 ≤ P ≤ L, so no stage is empty. Parameters keep
the whole model's names, so a block's parameters name their global index:

    family        a block's parameters        stage 0 also             stage P−1 also
    gpt           ``blocks.<i>.…``             ``wte``, ``wpe``          ``ln_f``, ``lm_head``
    llama, qwen2  ``model.layers.<i>.…``       ``model.embed_tokens``    ``model.norm``, ``lm_head``

The stages of a model partition its parameter names exactly. The process runtime
(trainer.runtime.pipeline) builds each stage as a module holding exactly these parameters, and its tests
check that the names here are those modules' ``named_parameters``. A model whose embedding and
output head are one tensor (``model.tie_word_embeddings``) runs as one stage: its first and last
stage would otherwise train two copies of it.

Decoding a stored or pushed stage slice needs only :func:`stage_layout` (the rule applied to the
model's layout), so the walk from an update record to a rebuilt checkpoint builds no model.
"""

from __future__ import annotations

import functools
import re

from trainer.codec.wire import Layout
from trainer.config import ROPE_FAMILIES, ModelConfig

# Where each family keeps its blocks (the index is the block's) and its input embeddings.
_BLOCK = {"gpt": re.compile(r"blocks\.(\d+)\."), **{f: re.compile(r"model\.layers\.(\d+)\.") for f in ROPE_FAMILIES}}
_EMBEDDINGS = {"gpt": ("wte.", "wpe."), **{f: ("model.embed_tokens.",) for f in ROPE_FAMILIES}}


def hidden_matrix(name: str, shape: tuple[int, ...]) -> bool:
    """Whether parameter ``name`` of ``shape`` is a hidden matrix: 2-D and inside a block, in any
    family (not the embeddings, the final norm or the output head). Muon trains these
    (trainer.runtime.muon); the rule is on names, so a pipeline stage applies it to its slice alike."""
    return len(shape) == 2 and any(block.match(name) for block in _BLOCK.values())


def stage_blocks(n_layer: int, num_stages: int) -> list[range]:
    """The block indices of each stage: contiguous, balanced by count, the first ones larger."""
    if not 1 <= num_stages <= n_layer:
        raise ValueError(f"{num_stages} pipeline stages cannot split {n_layer} blocks (1 <= P <= n_layer)")
    q, r = divmod(n_layer, num_stages)
    return [range(s * q + min(s, r), (s + 1) * q + min(s + 1, r)) for s in range(num_stages)]


def check_split(cfg: ModelConfig, num_stages: int) -> list[range]:
    """``stage_blocks`` of the model, after refusing a split its tied embedding forbids."""
    blocks = stage_blocks(cfg.n_layer, num_stages)
    if cfg.tie_word_embeddings and num_stages > 1:
        # Stage 0 would train the embedding and the last stage the head as two copies: the
        # sum of their gradients, which tying needs, is never formed across stage processes.
        raise ValueError("model.tie_word_embeddings: the embedding and the output head are one tensor, which "
                         "pipeline stages cannot split: run this model as one stage (--stages 1)")
    return blocks


def stage_of(cfg: ModelConfig, name: str, blocks: list[range]) -> int:
    """The stage (index into ``blocks``, ``check_split``'s) that holds parameter ``name``."""
    if len(blocks) == 1:
        return 0
    block = _BLOCK[cfg.family].match(name)
    if block is not None:
        index = int(block.group(1))
        return next(s for s, held in enumerate(blocks) if index in held)
    return 0 if name.startswith(_EMBEDDINGS[cfg.family]) else len(blocks) - 1


def split_names(cfg: ModelConfig, names: list[str], num_stages: int) -> list[list[str]]:
    """``names`` (some of the model's parameter names) by the stage that holds them, each stage's
    in the order given."""
    blocks = check_split(cfg, num_stages)
    out: list[list[str]] = [[] for _ in blocks]
    for name in names:
        out[stage_of(cfg, name, blocks)].append(name)
    return out


def stage_layout(layout: Layout, cfg: ModelConfig, stage: int, num_stages: int) -> Layout:
    """The entries of ``layout`` (the whole model's tensors, by name) that stage
    ``stage`` of ``num_stages`` holds."""
    if num_stages == 1:
        return layout
    blocks = check_split(cfg, num_stages)
    return {name: spec for name, spec in layout.items() if stage_of(cfg, name, blocks) == stage}


def stage_param_names(cfg: ModelConfig, num_stages: int) -> list[list[str]]:
    """The parameter names of each stage, in the model's ``named_parameters`` order."""
    return [list(names) for names in _stage_names(cfg, num_stages)]


@functools.lru_cache(maxsize=16)
def _stage_names(cfg: ModelConfig, num_stages: int) -> tuple[tuple[str, ...], ...]:
    # Cached: a pipelined worker asks once per stage group, tests once per stage, and building even
    # a meta model of a transformers family means importing and running its constructors.
    check_split(cfg, num_stages)  # refuse an impossible split before building anything
    import torch

    # Imported here: only a caller that wants the names in the model's order builds a (meta) model;
    # stage_layout, which decoding a stored slice uses, needs no model code.
    from trainer.model.gpt import new_model

    with torch.device("meta"):
        names = [n for n, _ in new_model(cfg).named_parameters()]
    return tuple(tuple(stage) for stage in split_names(cfg, names, num_stages))
