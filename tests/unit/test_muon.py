"""The Muon inner optimiser (trainer.runtime.muon): which parameters it trains, that its update is
orthogonalised and scaled as stated, that its AdamW part is torch's AdamW, that its state commits and
is refused as a worker's state must be, and that a replay from the committed state is bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer.codec.wire import layout_of
from trainer.config import InnerConfig, ModelConfig, RunConfig, SettingError
from trainer.model.gpt import build_model
from trainer.model.params import params_of
from trainer.model.stages import hidden_matrix, stage_param_names
from trainer.runtime.inner import InnerLoop, inner_optimizer, load_optimizer_state, optimizer_state
from trainer.runtime.muon import MuonWithAdamW, orthogonalised
from trainer.runtime.state_commit import StateError, check_inner_state

TINY = ModelConfig(block_size=16, n_layer=2, n_head=2, n_embd=16)
MUON = InnerConfig(steps=3, batch_size=2, lr=1e-3, optimizer="muon", muon_lr=2e-3)


def batches(seed: int, count: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randint(0, TINY.vocab_size, (2, TINY.block_size), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


@pytest.mark.parametrize("shape", [(24, 64), (64, 24), (32, 32)])
def test_the_update_is_close_to_the_orthogonal_factor(shape: tuple[int, int]) -> None:
    m = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    sigma = torch.linalg.svdvals(orthogonalised(m).double())
    # NS₅ with these coefficients leaves the singular values in a band around 1, not exactly 1.
    assert sigma.min() > 0.5 and sigma.max() < 1.3, sigma


def test_muon_trains_the_blocks_matrices_and_adamw_the_rest() -> None:
    model = build_model(TINY, 1)
    optimizer = inner_optimizer(model, MUON)
    assert isinstance(optimizer, MuonWithAdamW)
    muon_group, adamw_group = optimizer.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in muon_group["params"]) == sorted(
        n for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2)
    assert {"wte.weight", "wpe.weight", "lm_head.weight", "ln_f.weight"} <= {names[id(p)] for p in adamw_group["params"]}
    assert hidden_matrix("model.layers.3.mlp.up_proj.weight", (8, 4))
    assert not hidden_matrix("model.embed_tokens.weight", (8, 4)) and not hidden_matrix("blocks.0.ln1.weight", (4,))
    assert muon_group["lr"] == MUON.muon_lr and adamw_group["lr"] == MUON.lr


def test_adamw_parameters_step_as_torch_adamw() -> None:
    """The same gradients, three steps: every parameter Muon does not train ends where torch's AdamW
    puts it."""
    ours, theirs = build_model(TINY, 1), build_model(TINY, 1)
    cfg = dataclasses.replace(MUON, weight_decay=0.1)
    reference = torch.optim.AdamW(theirs.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                  weight_decay=cfg.weight_decay)
    optimizer = inner_optimizer(ours, cfg)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        for a, b in zip(ours.parameters(), theirs.parameters()):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        optimizer.step()
        reference.step()
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        if not hidden_matrix(name, tuple(a.shape)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-7, msg=name)


def test_a_muon_step_moves_a_matrix_by_the_stated_rms() -> None:
    torch.manual_seed(0)
    model = build_model(TINY, 1)
    cfg = dataclasses.replace(MUON, weight_decay=0.0)
    optimizer = inner_optimizer(model, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = batches(3, 1)[0]
    model(x, y)[1].backward()
    optimizer.step()
    name, p = "blocks.0.mlp.fc.weight", dict(model.named_parameters())["blocks.0.mlp.fc.weight"]
    rms = float((p.detach() - before[name]).pow(2).mean().sqrt())
    # 0.2·η: the update's RMS is AdamW's (NS₅'s singular values are near, not at, 1).
    assert 0.1 * cfg.muon_lr < rms < 0.3 * cfg.muon_lr


def test_the_committed_state_names_momentum_for_muon_matrices_and_is_checked_by_optimiser() -> None:
    model = build_model(TINY, 1)
    loop = InnerLoop(model, MUON)
    loop.run(params_of(model), batches(4))
    state = loop.state()
    layout = layout_of(params_of(model))
    assert "momentum.blocks.0.attn.qkv.weight" in state and "exp_avg.blocks.0.attn.qkv.weight" not in state
    assert "exp_avg.wte.weight" in state and "momentum.wte.weight" not in state
    check_inner_state(state, layout, compressed=False, optimizer="muon")
    with pytest.raises(StateError, match="but not all of exp_avg, exp_avg_sq"):
        check_inner_state(state, layout, compressed=False, optimizer="adamw")
    forged = {**state, "exp_avg.blocks.0.attn.qkv.weight": state["momentum.blocks.0.attn.qkv.weight"]}
    with pytest.raises(StateError, match="no worker's state holds"):
        check_inner_state(forged, layout, compressed=False, optimizer="muon")


def test_a_replay_from_the_committed_state_is_bit_for_bit() -> None:
    """Round 2 trained on in the worker's process and re-run from round 1's committed state in a
    fresh loop (the audit's replay: trainer.runtime.inner.load_optimizer_state) give the same Δ."""
    model = build_model(TINY, 1)
    worker = InnerLoop(model, MUON)
    start = params_of(model)
    first = worker.run(start, batches(5))
    committed = worker.state()
    after = {n: start[n] - first.pseudo_gradient[n] for n in start}
    second = worker.run(after, batches(6))

    replay = InnerLoop(build_model(TINY, 1), MUON)
    load_optimizer_state(replay.model, replay.optimizer, committed)
    again = replay.run(after, batches(6))
    for name, delta in second.pseudo_gradient.items():
        assert torch.equal(delta, again.pseudo_gradient[name]), name
    assert optimizer_state(replay.model, replay.optimizer).keys() == worker.state().keys()


def test_pipeline_stages_split_the_same_rule() -> None:
    """A stage's optimiser sorts its slice by the same rule on names (trainer.model.stages)."""
    names = stage_param_names(TINY, 2)
    model = dict(build_model(TINY, 1).named_parameters())
    for stage in names:
        hidden = [n for n in stage if hidden_matrix(n, tuple(model[n].shape))]
        assert all(n.startswith("blocks.") for n in hidden)
    assert sum(len(s) for s in names) == len(model)


def test_the_optimizer_is_a_choice_and_absent_means_adamw() -> None:
    assert RunConfig().inner.optimizer == "adamw"
    with pytest.raises(SettingError):
        RunConfig().with_settings(["inner.optimizer=sgd"])
    # Left out at its default, so every configuration written before the field existed keeps its CID
    # and means AdamW; Muon's fields are written when chosen, and read back.
    assert not {"optimizer", "muon_lr", "muon_momentum"} & set(RunConfig().to_json()["inner"])
    muon = RunConfig().with_settings(["inner.optimizer=muon", "inner.muon_lr=0.004"])
    assert muon.to_json()["inner"]["optimizer"] == "muon" and muon.inner.muon_lr == 4e-3
    assert RunConfig.from_json(muon.to_json()) == muon and muon.cid != RunConfig().cid
