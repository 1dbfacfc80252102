"""trainer.model.stages: the stage partition as a rule on names, and a rebuild that needs no model code."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.codec.wire import layout_of
from trainer.config import ModelConfig
from trainer.model.gpt import new_model
from trainer.model.stages import stage_layout, stage_param_names

REPO = Path(__file__).resolve().parents[2]
HF = dict(vocab_size=256, block_size=16, n_head=2, n_embd=32, n_kv_head=1, intermediate_size=64)
MODELS = [ModelConfig(block_size=16, n_layer=5, n_head=2, n_embd=32),
          ModelConfig(family="llama", n_layer=4, **HF), ModelConfig(family="qwen2", n_layer=3, **HF)]


@pytest.mark.parametrize("cfg", MODELS, ids=lambda c: c.family)
def test_a_layout_in_any_order_splits_as_the_stage_modules_do(cfg: ModelConfig) -> None:
    with torch.device("meta"):
        full = layout_of(dict(new_model(cfg).named_parameters()))
    names = list(full)
    random.Random(0).shuffle(names)  # a decoded checkpoint's tensors come in no particular order
    shuffled = {n: full[n] for n in names}
    for num_stages in range(1, cfg.n_layer + 1):
        want = stage_param_names(cfg, num_stages)  # pinned to the stage modules by test_pipeline
        got = [stage_layout(shuffled, cfg, s, num_stages) for s in range(num_stages)]
        assert [sorted(g) for g in got] == [sorted(w) for w in want]
        assert all(g[n] == full[n] for g in got for n in g)


def test_a_tied_embedding_is_one_stage() -> None:
    cfg = ModelConfig(family="llama", n_layer=2, tie_word_embeddings=True, **HF)
    assert len(stage_param_names(cfg, 1)) == 1
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        stage_layout({}, cfg, 0, 2)


def test_rebuilding_a_checkpoint_walks_only_storage_codec_and_round_maths() -> None:
    """The walk from a stored update record to a rebuilt checkpoint (trainer.runstore.checkpoints)
    loads the storage, codec and round-maths wings, the shared configuration and progress modules,
    and the stage rule on names: no model code, no process runtime, no transformers."""
    probe = "import sys, trainer.runstore.checkpoints; print(' '.join(sorted(sys.modules)))"
    loaded = set(subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.split())
    wings = ("trainer.runstore.", "trainer.codec.", "trainer.rounds.")
    shared = {"trainer", "trainer.runstore", "trainer.codec", "trainer.rounds", "trainer.config",
              "trainer.config_fields", "trainer.progress", "trainer.model", "trainer.model.stages"}
    walked = {m for m in loaded if m.split(".")[0] == "trainer"}
    assert "trainer.runstore.round_inputs" in walked and "trainer.rounds.transition" in walked
    assert not {m for m in walked if not m.startswith(wings) and m not in shared}
    assert "transformers" not in loaded
