"""Pipeline stages: the split of the GPT, and P local stage processes matching the plain InnerLoop.

The tests that spawn stage processes are marked ``integration``; they talk only to 127.0.0.1 and
stop by themselves (gloo timeouts of a few seconds, and a deadline on the whole run).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch

from proto import Encoding
from trainer.codec import CompressionConfig, decompress
from trainer.codec.uplink import Uplink
from trainer.codec.wire import layout_of
from trainer.config import InnerConfig, ModelConfig
from trainer.model.gpt import build_model
from trainer.model.params import params_of
from trainer.runtime import pipeline as pp
from trainer.runtime.inner import InnerLoop, inner_state_digest
from trainer.runtime.staged import staged_arithmetic

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


LLAMA = ModelConfig(family="llama", block_size=16, n_layer=3, n_head=4, n_kv_head=2, n_embd=32)


@pytest.mark.parametrize("cfg", [LLAMA, dataclasses.replace(LLAMA, family="qwen2")], ids=["llama", "qwen2"])
def test_hf_stages_partition_the_names_and_compute_the_model(cfg: ModelConfig) -> None:
    """A transformers family split into P stages: the names partition the model's (HF names, in
    order), each stage built alone is that slice, and the chained stages give the whole model's
    logits, loss and gradients."""
    model = build_model(cfg, SEED)
    full = dict(model.named_parameters())
    x, y = make_batches(1, 0)[0]
    logits, loss = model(x, y)
    loss.backward()
    want = {n: p.grad.clone() for n, p in full.items()}
    for stages in (1, 2, 3):
        names = pp.stage_param_names(cfg, stages)
        assert [n for stage in names for n in stage] == list(full)
        assert names[0][0] == "model.embed_tokens.weight" and names[-1][-2:] == ["model.norm.weight", "lm_head.weight"]
        assert all(n.startswith("model.layers.2.") for n in names[-1][:-2]) or stages < 3
        for s in range(stages):
            own = dict(pp.build_stage(cfg, SEED, s, stages).named_parameters())
            assert list(own) == names[s] and all(torch.equal(p, full[n]) for n, p in own.items())
        model.zero_grad(set_to_none=True)
        h = x
        for stage in pp.split_model(model, stages):
            h = stage(h)
        piped = pp.lm_loss(h, y)
        piped.backward()
        assert torch.allclose(h, logits, atol=1e-6) and torch.allclose(piped, loss, atol=1e-6)
        assert max((p.grad - want[n]).abs().max().item() for n, p in full.items()) < 1e-6


def test_a_model_of_no_family_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="Linear cannot be split into pipeline stages"):
        pp.split_model(torch.nn.Linear(2, 2), 2)


# --------------------------------------------------------------- stage processes (integration)


@pytest.mark.integration
def test_two_llama_stages_train_like_one_process() -> None:
    """PP=2 stage processes on a tiny Llama (grouped-query attention): a round of 3 AdamW steps
    equals the plain InnerLoop on the whole model."""
    inner = InnerConfig(steps=3, batch_size=4, lr=1e-3)
    start = params_of(build_model(LLAMA, SEED))
    batches = make_batches(inner.steps, seed=3)
    want = InnerLoop(build_model(LLAMA, SEED), inner).run(start, batches)
    with pp.PipelinedInnerLoop(LLAMA, inner, 2, n_microbatches=2, timeout_s=30, deadline_s=120) as piped:
        got = piped.run(start, batches)
    assert max_abs_diff(got.pseudo_gradient, want.pseudo_gradient) < 1e-5
    assert got.mean_loss == pytest.approx(want.mean_loss, abs=1e-5)
    assert [list(d) for d in got.stage_pseudo_gradients] == pp.stage_param_names(LLAMA, 2)


@pytest.mark.integration
def test_two_stages_train_like_one_process() -> None:
    """PP=2 with 2 microbatches, 3 rounds of 4 AdamW steps on one persistent pair of stage
    processes, equals the plain InnerLoop."""
    start = params_of(build_model(MODEL, SEED))
    reference = InnerLoop(build_model(MODEL, SEED), INNER)
    names = pp.stage_param_names(MODEL, 2)
    with pp.PipelinedInnerLoop(MODEL, INNER, 2, n_microbatches=2, timeout_s=20, deadline_s=60) as piped:
        pids: list[int] = []
        for round_ in range(3):  # rounds 2 and 3 check that each stage's AdamW state carried over
            batches = make_batches(INNER.steps, seed=round_)
            want = reference.run(start, batches)
            got = piped.run(start, batches)
            diff = max_abs_diff(got.pseudo_gradient, want.pseudo_gradient)
            print(f"round {round_}: max |Δ_PP2 − Δ_PP1| = {diff:.3e}")
            assert diff < 1e-5
            assert got.mean_loss == pytest.approx(want.mean_loss, abs=1e-5)
            assert (got.tokens, got.steps) == (want.tokens, want.steps)
            # The same two processes served every round, and their AdamW took every step so far.
            pids = pids or piped.pids
            assert piped.pids == pids and len(pids) == 2 and piped.groups_started == 1
            assert piped.last is not None
            assert piped.last.optimizer_steps == [INNER.steps * (round_ + 1)] * 2
            assert [list(d) for d in piped.last.stage_pseudo_gradients] == names
            start = {n: p - 0.7 * got.pseudo_gradient[n] for n, p in start.items()}  # a plain outer step
    assert piped.group is None and all(not _alive(pid) for pid in pids)


@pytest.mark.integration
def test_one_process_computes_two_stages_bit_for_bit_and_an_undone_round_is_gone() -> None:
    """What the audit's replay relies on (trainer.runtime.staged): on one torch thread, an InnerLoop
    computing with the stages' arithmetic (2 microbatches, the stages' clipping; grad_clip active)
    gives the two stage processes' Δ bit for bit, round after round, and the stages' AdamW states
    taken together have the one-process state's digest at every round's start. A round undone
    (``undo``, as a worker whose push was refused) leaves no trace: the next round starts from
    the state the undone one started from, as the one-process loop's restored snapshot does."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = params_of(build_model(MODEL, SEED))
        reference = InnerLoop(build_model(MODEL, SEED), INNER)
        staged = staged_arithmetic(MODEL, 2)
        with pp.PipelinedInnerLoop(MODEL, INNER, 2, timeout_s=20, deadline_s=60, threads_per_stage=1) as piped:
            for round_ in range(4):
                batches = make_batches(INNER.steps, seed=round_)
                before, snapshot = reference.state(), reference.snapshot()
                want = reference.run(start, batches, staged=staged)
                got = piped.run(start, batches)
                assert inner_state_digest(got.start_state) == inner_state_digest(before)
                assert all(torch.equal(got.pseudo_gradient[n], want.pseudo_gradient[n]) for n in start), round_
                assert got.mean_loss == want.mean_loss
                if round_ == 1:  # round 1 does not count: both go back to where it started
                    piped.undo(got.start_state)
                    reference.restore(snapshot)
                start = {n: p - 0.7 * got.pseudo_gradient[n] for n, p in start.items()}
            assert piped.last is not None and piped.last.optimizer_steps == [INNER.steps * 3] * 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.integration
def test_stage_results_are_slices_and_one_stage_runs_too() -> None:
    # No clipping here, and a single stage (the whole model's own forward, as a data-parallel replica of
    # one stage computes it: trainer.runtime.island) through the same stage processes; 4 microbatches for 2.
    inner = InnerConfig(steps=3, batch_size=4, lr=1e-3, grad_clip=0.0)
    start = params_of(build_model(MODEL, SEED))
    batches = make_batches(3, seed=7)
    want = InnerLoop(build_model(MODEL, SEED), inner).run(start, batches)
    for stages in (1, 2):
        with pp.StageGroup(MODEL, stages, n_microbatches=4, timeout_s=20) as group:
            got = group.run(inner, start, batches, deadline_s=60)
        assert max_abs_diff(got.pseudo_gradient, want.pseudo_gradient) < 1e-5
        for s, names in enumerate(pp.stage_param_names(MODEL, stages)):
            assert list(got.stage_pseudo_gradients[s]) == names
            for n in names:
                assert torch.equal(got.stage_pseudo_gradients[s][n], got.pseudo_gradient[n])


@pytest.mark.integration
def test_each_stage_compresses_its_own_slice_with_the_workers_error_feedback() -> None:
    """Compression on: every stage returns its slice compressed, with its error feedback state,
    and over two rounds Σ Δ̂ + e = Σ Δ for every tensor (what compression dropped is kept)."""
    start = params_of(build_model(MODEL, SEED))
    config = CompressionConfig(enabled=True, min_rank=1, max_rank=2)
    uplink = Uplink(config, 2)
    names = pp.stage_param_names(MODEL, 2)
    sent = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in start.items()}
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in start.items()}
    with pp.PipelinedInnerLoop(MODEL, INNER, 2, compression=config, timeout_s=20, deadline_s=60) as piped:
        for round_ in range(2):
            got = piped.run(start, make_batches(INNER.steps, seed=round_), uplink.states())
            uplink.update(got.uplink_states)
            assert [(p.stage, p.num_stages, p.encoding) for p in got.slices] == [
                (0, 2, Encoding.LOWRANK_INT4), (1, 2, Encoding.LOWRANK_INT4)]
            for s, piece in enumerate(got.slices):
                assert sorted(piece.transmitted) == sorted(names[s])
                rebuilt = decompress(piece.payload, piece.codec_header, layout_of(piece.transmitted))
                assert all(torch.equal(rebuilt[n], piece.transmitted[n]) for n in names[s])
                for n in names[s]:
                    sent[n] += piece.transmitted[n].double()
                    total[n] += got.pseudo_gradient[n].double()
    for s, compressor in enumerate(uplink.compressors):
        assert compressor.policy.round == 2
        for n in names[s]:
            assert torch.allclose(sent[n] + compressor.errors[n].double(), total[n], atol=1e-7), n


@pytest.mark.integration
def test_a_failing_stage_is_named() -> None:
    start = params_of(build_model(MODEL, SEED))
    x, y = make_batches(1, seed=0)[0]
    bad = [(x + MODEL.vocab_size, y)]  # token ids out of range: stage 0's embedding fails
    with pytest.raises(pp.PipelineError, match=r"pipeline stage 0 of 2 failed: .*index out of range"):
        with pp.StageGroup(MODEL, 2, timeout_s=10) as group:
            group.run(INNER, start, bad, deadline_s=60)


def _alive(pid: int) -> bool:
    """Still running (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _stage_1_exits(runner: pp.StageRunner, job: pp.RoundJob) -> dict:
    if runner.index == 1:
        os._exit(3)
    return pp.run_round(runner, job)


def _stage_1_hangs(runner: pp.StageRunner, job: pp.RoundJob) -> dict:
    if runner.index == 1:
        time.sleep(600)  # alive, but never takes part: its peer must time out, not wait forever
    return pp.run_round(runner, job)


def _stage_1_killed_in_second_round(runner: pp.StageRunner, job: pp.RoundJob) -> dict:
    if runner.index == 1 and job.seq == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return pp.run_round(runner, job)


@pytest.mark.integration
def test_a_dead_stage_is_named() -> None:
    start = params_of(build_model(MODEL, SEED))
    with pp.StageGroup(MODEL, 2, timeout_s=10, round_fn=_stage_1_exits) as group:
        with pytest.raises(pp.PipelineError, match=r"pipeline stage 1 of 2 \(pid \d+\) died: exit code 3"):
            group.run(INNER, start, make_batches(2, seed=0), deadline_s=60)
        assert group.closed


@pytest.mark.integration
def test_a_hung_stage_times_out() -> None:
    start = params_of(build_model(MODEL, SEED))
    with pp.StageGroup(MODEL, 2, timeout_s=3, round_fn=_stage_1_hangs) as group:
        began = time.monotonic()
        with pytest.raises(pp.PipelineError, match=r"pipeline stage 0 of 2 failed: .*[Tt]imed out"):
            group.run(INNER, start, make_batches(2, seed=0), deadline_s=60)
        assert time.monotonic() - began < 30  # the gloo timeout ended it, not the deadline
        assert group.closed and not any(_alive(pid) for pid in group.pids)


@pytest.mark.integration
def test_a_stage_killed_mid_round_fails_the_round_and_the_next_round_restarts() -> None:
    start = params_of(build_model(MODEL, SEED))
    batches = make_batches(INNER.steps, seed=0)
    fresh = InnerLoop(build_model(MODEL, SEED), INNER).run(start, batches)  # fresh AdamW state
    with pp.PipelinedInnerLoop(MODEL, INNER, 2, timeout_s=30,
                               round_fn=_stage_1_killed_in_second_round) as piped:
        piped.run(start, batches)
        first = piped.pids
        began = time.monotonic()
        with pytest.raises(pp.PipelineError, match=r"pipeline stage 1 of 2 \(pid \d+\) died: exit code -9"):
            piped.run(start, batches)
        assert time.monotonic() - began < 10  # noticed by polling, not at the gloo timeout (30 s)
        assert piped.group is None and not any(_alive(pid) for pid in first)  # the peer is gone too

        # The next round starts a fresh group: new processes, new AdamW state.
        got = piped.run(start, batches)
        assert piped.groups_started == 2 and not set(piped.pids) & set(first)
        assert piped.last is not None and piped.last.optimizer_steps == [INNER.steps] * 2
        assert max_abs_diff(got.pseudo_gradient, fresh.pseudo_gradient) < 1e-5

        # A stage that dies between rounds is replaced before the round, which does not fail.
        assert piped.group is not None
        os.kill(piped.pids[1], signal.SIGKILL)
        piped.group.procs[1].join(timeout=30)  # reaped: a zombie's threads may still be exiting
        piped.run(start, batches)
        assert piped.groups_started == 3 and piped.last.optimizer_steps == [INNER.steps] * 2


@pytest.mark.integration
def test_stages_launched_by_torchrun_train_like_one_process(tmp_path) -> None:
    """The torchrun path of the module doc: each process joins with init_from_env and runs its own
    StageRunner; together their Δ_s are the plain InnerLoop's Δ."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from trainer.codec.wire import decode_params

    script = Path(__file__).with_name("torchrun_stages.py")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), str(tmp_path), "5"],
        env=env, cwd=repo, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    want = InnerLoop(build_model(MODEL, SEED), INNER).run(params_of(build_model(MODEL, SEED)),
                                                         make_batches(INNER.steps, seed=5))
    got: dict[str, torch.Tensor] = {}
    for s, names in enumerate(pp.stage_param_names(MODEL, 2)):
        delta = decode_params((tmp_path / f"stage{s}.safetensors").read_bytes())
        assert sorted(delta) == sorted(names)  # safetensors stores names sorted
        got.update(delta)
        info = json.loads((tmp_path / f"stage{s}.json").read_text())
        assert info["world_size"] == 2 and info["tokens"] == want.tokens
        assert sum(info["losses"]) / len(info["losses"]) == pytest.approx(want.mean_loss, abs=1e-5)
    assert max_abs_diff({n: got[n] for n in want.pseudo_gradient}, want.pseudo_gradient) < 1e-5
