"""Pipeline stages: the split of the GPT, and P local stage processes matching the plain InnerLoop.

The tests that spawn stage processes are marked ``integration``; they talk only to 127.0.0.1 and
stop by themselves (gloo timeouts of a few seconds, and a deadline on the whole run).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from trainer import pipeline as pp
from trainer.config import InnerConfig, ModelConfig
from trainer.diloco import InnerLoop, params_of
from trainer.model import build_model

SEED = 1234
MODEL = ModelConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
INNER = InnerConfig(steps=4, batch_size=4, lr=1e-3)  # grad_clip 1.0: active (‖g‖ ≈ 1.5 at start)


def make_batches(count: int, seed: int, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(MODEL.vocab_size, (batch, MODEL.block_size), generator=g),
             torch.randint(MODEL.vocab_size, (batch, MODEL.block_size), generator=g))
            for _ in range(count)]


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b)
    return max((a[n] - b[n]).abs().max().item() for n in a)


# ------------------------------------------------------------------------ the split (no processes)


@pytest.mark.parametrize("n_layer", [1, 2, 5])
def test_stage_names_partition_the_model(n_layer: int) -> None:
    cfg = ModelConfig(block_size=16, n_layer=n_layer, n_head=2, n_embd=32)
    model = build_model(cfg, SEED)
    full = [n for n, _ in model.named_parameters()]
    for stages in range(1, n_layer + 1):
        names = pp.stage_param_names(cfg, stages)
        assert len(names) == stages
        # Concatenated in stage order, they are the model's names in the model's order: disjoint,
        # complete, contiguous.
        assert [n for stage in names for n in stage] == full
        assert "wte.weight" in names[0] and "wpe.weight" in names[0]
        assert "lm_head.weight" in names[-1] and "ln_f.weight" in names[-1]
        # Each stage built on its own is exactly that slice of build_model(cfg, seed).
        for s in range(stages):
            stage = pp.build_stage(cfg, SEED, s, stages)
            own = dict(stage.named_parameters())
            assert list(own) == names[s]
            for name, p in own.items():
                assert torch.equal(p, dict(model.named_parameters())[name]), name


def test_stage_blocks_are_balanced_and_contiguous() -> None:
    assert pp.stage_blocks(5, 2) == [range(0, 3), range(3, 5)]
    assert pp.stage_blocks(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert pp.stage_blocks(4, 4) == [range(i, i + 1) for i in range(4)]
    for bad in (0, 3):
        with pytest.raises(ValueError, match="pipeline stages"):
            pp.stage_blocks(2, bad)


def test_chained_stages_compute_the_model() -> None:
    cfg = ModelConfig(block_size=16, n_layer=3, n_head=2, n_embd=32)
    model = build_model(cfg, SEED)
    x, y = make_batches(1, 0)[0]
    logits, loss = model(x, y)
    for stages in (1, 2, 3):
        h = x
        for stage in pp.split_model(model, stages):
            h = stage(h)
        assert torch.equal(h, logits)
        assert torch.equal(pp.lm_loss(h, y), loss)


# --------------------------------------------------------------- stage processes (integration)


@pytest.mark.integration
def test_two_stages_train_like_one_process() -> None:
    """PP=2 with 2 microbatches, 2 rounds of 4 AdamW steps, equals the plain InnerLoop."""
    start = params_of(build_model(MODEL, SEED))
    reference = InnerLoop(build_model(MODEL, SEED), INNER)
    piped = pp.PipelinedInnerLoop(MODEL, INNER, 2, n_microbatches=2, timeout_s=20, deadline_s=60)
    names = pp.stage_param_names(MODEL, 2)
    for round_ in range(2):  # round 2 checks that each stage's AdamW state carried over
        batches = make_batches(INNER.steps, seed=round_)
        want = reference.run(start, batches)
        got = piped.run(start, batches)
        diff = max_abs_diff(got.pseudo_gradient, want.pseudo_gradient)
        print(f"round {round_}: max |Δ_PP2 − Δ_PP1| = {diff:.3e}")
        assert diff < 1e-5
        assert got.mean_loss == pytest.approx(want.mean_loss, abs=1e-5)
        assert (got.tokens, got.steps) == (want.tokens, want.steps)
        assert piped.optimizer_states is not None
        # Each stage's AdamW covers exactly its slice and has taken every step so far.
        for s, state in enumerate(piped.optimizer_states):
            assert len(state["state"]) == len(names[s])
            assert all(v["step"].item() == INNER.steps * (round_ + 1) for v in state["state"].values())
        start = {n: p - 0.7 * got.pseudo_gradient[n] for n, p in start.items()}  # a plain outer step


@pytest.mark.integration
def test_stage_results_are_slices_and_one_stage_runs_too() -> None:
    # No clipping here, and a single stage through the same pipelining path; 4 microbatches.
    inner = InnerConfig(steps=3, batch_size=4, lr=1e-3, grad_clip=0.0)
    start = params_of(build_model(MODEL, SEED))
    batches = make_batches(3, seed=7)
    want = InnerLoop(build_model(MODEL, SEED), inner).run(start, batches)
    for stages in (1, 2):
        got = pp.run_pipelined_inner(MODEL, inner, start, batches, stages, n_microbatches=4,
                                     timeout_s=20, deadline_s=60)
        assert max_abs_diff(got.pseudo_gradient, want.pseudo_gradient) < 1e-5
        for s, names in enumerate(pp.stage_param_names(MODEL, stages)):
            assert list(got.stage_pseudo_gradients[s]) == names
            for n in names:
                assert torch.equal(got.stage_pseudo_gradients[s][n], got.pseudo_gradient[n])


@pytest.mark.integration
def test_a_failing_stage_is_named() -> None:
    start = params_of(build_model(MODEL, SEED))
    x, y = make_batches(1, seed=0)[0]
    bad = [(x + MODEL.vocab_size, y)]  # token ids out of range: stage 0's embedding fails
    with pytest.raises(pp.PipelineError, match=r"pipeline stage 0 of 2 failed: .*index out of range"):
        pp.run_pipelined_inner(MODEL, INNER, start, bad, 2, timeout_s=10, deadline_s=60)


def _stage_1_exits(job: pp._Job) -> object:
    if dist.get_rank() == 1:
        os._exit(3)
    return pp._pipelined_stage(job)


def _stage_1_hangs(job: pp._Job) -> object:
    if dist.get_rank() == 1:
        time.sleep(600)  # alive, but never takes part: its peer must time out, not wait forever
    return pp._pipelined_stage(job)


def _job(timeout_s: float) -> pp._Job:
    start = params_of(build_model(MODEL, SEED))
    return pp._Job(MODEL, INNER, pp._to_numpy(start), pp._to_numpy(make_batches(2, seed=0)),
                   n_microbatches=2, optimizer_states=None, timeout_s=timeout_s, threads=1)


@pytest.mark.integration
def test_a_dead_stage_is_named() -> None:
    with pytest.raises(pp.PipelineError, match=r"pipeline stage 1 of 2 \(pid \d+\) exited with code 3"):
        pp._launch(_job(timeout_s=10), 2, _stage_1_exits, deadline_s=60)


@pytest.mark.integration
def test_a_hung_stage_times_out() -> None:
    began = time.monotonic()
    with pytest.raises(pp.PipelineError, match=r"pipeline stage 0 of 2 failed: .*[Tt]imed out"):
        pp._launch(_job(timeout_s=3), 2, _stage_1_hangs, deadline_s=60)
    assert time.monotonic() - began < 30  # the gloo timeout ended it, not the deadline
