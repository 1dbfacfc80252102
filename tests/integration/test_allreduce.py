"""The AllReduce baseline: W local ranks on gloo, checked against a one-process reference.

Every test spawns real rank processes talking only to 127.0.0.1; each run stops by itself (gloo
timeouts of a few seconds). The W = 2 run without a link is shared by the tests that only read it.
"""

from __future__ import annotations

import time

import pytest
import torch

from benchmarks.allreduce import AllReduceError, AllReduceResult, ring_allreduce_bytes, run_allreduce
from tests.conftest import small_config
from trainer.config import InnerConfig, RunConfig
from trainer.data.corpus import load_corpus, round_batches
from trainer.model.gpt import build_model, param_count
from trainer.model.params import params_of
from trainer.runtime.inner import InnerLoop

pytestmark = pytest.mark.integration

WORKERS = 2
STEPS = 6  # H = 4: crosses into the second round's batches
SNAPSHOT_EVERY = 4
CONFIG: RunConfig = small_config(inner=InnerConfig(steps=4, batch_size=4, lr=1e-3, grad_clip=1.0))


def buffer_bytes(cfg: RunConfig) -> int:
    """One fp32 buffer: every gradient element, plus the step's loss."""
    return 4 * (param_count(build_model(cfg.model, cfg.seed)) + 1)


def ring_bytes_per_step(cfg: RunConfig, workers: int) -> float:
    return 2 * (workers - 1) / workers * buffer_bytes(cfg)


@pytest.fixture(scope="module")
def plain_run() -> AllReduceResult:
    return run_allreduce(CONFIG, workers=WORKERS, steps=STEPS, snapshot_every=SNAPSHOT_EVERY,
                         timeout_s=30)


Params = dict[str, torch.Tensor]


def reference(cfg: RunConfig, workers: int, steps: int) -> tuple[list[float], list[Params], int]:
    """One process: each step, the mean of the W ranks' gradients on DiLoCo's batches, then
    InnerLoop's AdamW (built by InnerLoop itself) and clip. Returns the mean losses, θ after every
    step, and how many steps the clip was active."""
    corpus = load_corpus(cfg.data, cfg.seed, cfg.model.block_size)
    shards = [corpus.shard(k, workers) for k in range(workers)]
    model = build_model(cfg.model, cfg.seed)
    optimizer = InnerLoop(model, cfg.inner).optimizer
    horizon = cfg.inner.steps
    losses: list[float] = []
    history: list[Params] = []
    clipped = 0
    for t in range(steps):
        rnd, h = t // horizon + 1, t % horizon
        grads: list[torch.Tensor] | None = None
        step_loss = 0.0
        for k in range(workers):
            x, y = list(round_batches(shards[k], seed=cfg.seed, shard_index=k, round_=rnd,
                                      steps=horizon, batch_size=cfg.inner.batch_size,
                                      block_size=cfg.model.block_size))[h]
            optimizer.zero_grad(set_to_none=True)
            _, loss = model(x, y)
            loss.backward()
            step_loss += loss.item()
            mine = [p.grad.clone() for p in model.parameters()]
            grads = mine if grads is None else [g + m for g, m in zip(grads, mine)]
        assert grads is not None
        for p, g in zip(model.parameters(), grads):
            p.grad = g / workers
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
        clipped += int(norm.item() > cfg.inner.grad_clip)
        optimizer.step()
        losses.append(step_loss / workers)
        history.append(params_of(model))
    return losses, history, clipped


def max_abs_diff(a: Params, b: Params) -> float:
    assert list(a) == list(b)
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_equals_one_process_averaging_the_ranks_gradients(plain_run: AllReduceResult) -> None:
    losses, history, clipped = reference(CONFIG, WORKERS, STEPS)
    assert clipped > 0, "the clip must be active for the test to pin clip-after-averaging"
    run = plain_run
    assert run.workers == WORKERS and run.steps == STEPS
    assert max_abs_diff(run.params, history[-1]) < 1e-5
    assert run.train_losses == pytest.approx(losses, abs=1e-5)
    # Snapshots after every SNAPSHOT_EVERY steps and after the last: (steps, tokens so far, θ).
    per_step = WORKERS * CONFIG.inner.batch_size * CONFIG.model.block_size
    assert [(s, tok) for s, tok, _ in run.snapshots] == [(4, 4 * per_step), (6, 6 * per_step)]
    assert max_abs_diff(run.snapshots[0][2], history[3]) < 1e-5
    assert max_abs_diff(run.snapshots[1][2], run.params) == 0.0
    assert run.tokens == STEPS * per_step
    # Training moved the parameters: the equality above is not two copies of the genesis.
    assert max_abs_diff(run.params, params_of(build_model(CONFIG.model, CONFIG.seed))) > 1e-4


def test_counts_the_ring_all_reduce_bytes(plain_run: AllReduceResult) -> None:
    expected = STEPS * ring_bytes_per_step(CONFIG, WORKERS)
    assert expected == int(expected)  # W = 2: every rank sends exactly the buffer once a step
    assert plain_run.bytes_sent_per_worker == int(expected)
    assert plain_run.bytes_received_per_worker == int(expected)


def test_link_paces_each_all_reduce_full_duplex(plain_run: AllReduceResult) -> None:
    transfer_s, latency_s = 0.15, 0.05
    bandwidth = 8 * ring_bytes_per_step(CONFIG, WORKERS) / transfer_s
    run = run_allreduce(CONFIG, workers=WORKERS, steps=STEPS, link_bandwidth_bps=bandwidth,
                        link_latency_s=latency_s, timeout_s=30)
    # Up and down each take transfer_s, at the same time: a step costs latency + transfer_s
    # (0.20 s), not latency + 2·transfer_s (0.35 s) as it would if the directions were summed.
    assert run.comm_s >= STEPS * (latency_s + transfer_s) * 0.9
    assert run.comm_s < STEPS * 0.3
    assert run.wall_s >= run.comm_s
    assert run.comm_s > 3 * run.compute_s
    assert plain_run.wall_s < run.wall_s / 3
    # The link changes the time, not the numbers.
    assert run.train_losses == plain_run.train_losses
    assert max_abs_diff(run.params, plain_run.params) == 0.0


@pytest.mark.parametrize("fault, expected", [
    ((1, 2, "raise"), r"^rank 1 of 2 failed: RuntimeError: injected fault at step 2"),
    ((1, 2, "exit"), r"^rank 1 of 2 \(pid \d+\) died: exit code 3 before reporting a result"),
    ((0, 3, "nan"), r"^rank \d of 2 failed: FloatingPointError: step 3 of 6: mean training loss"),
    ((1, 2, "hang"), r"^rank 0 of 2 failed: .*[Tt]imed out.*; rank\(s\) \[1\] had not reported"),
])
def test_a_failing_rank_is_named_and_nothing_hangs(fault: tuple[int, int, str],
                                                   expected: str) -> None:
    # The timeout also bounds the rendezvous, so it must cover the ranks' start-up skew; only the
    # hanging rank makes the run wait for it.
    timeout_s = 5.0 if fault[2] == "hang" else 30.0
    started = time.monotonic()
    with pytest.raises(AllReduceError, match=expected):
        run_allreduce(CONFIG, workers=WORKERS, steps=STEPS, timeout_s=timeout_s, _fault=fault)
    # Start-up (torch imports in the spawned ranks) is most of it; a hang would never return.
    assert time.monotonic() - started < 60


def test_refuses_bad_arguments_before_starting_processes() -> None:
    for kwargs in ({"workers": 0, "steps": 1}, {"workers": 1, "steps": 0},
                   {"workers": 1, "steps": 1, "link_bandwidth_bps": -1.0},
                   {"workers": 1, "steps": 1, "threads_per_worker": 0}):
        with pytest.raises(ValueError):
            run_allreduce(CONFIG, **kwargs)  # type: ignore[arg-type]
    assert ring_allreduce_bytes(1000, 1) == 0  # one worker sends nothing
    assert ring_allreduce_bytes(1000, 2) == 1000
    assert ring_allreduce_bytes(1200, 3) == 1600
