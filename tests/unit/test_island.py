"""The pure parts of a worker that is an island (trainer.runtime.island): which rank is which, the
replicas' slices of a batch, the rank-order mean of their gradients, its buckets, the replay's
arithmetic of N replicas, and ``data_parallel`` as hostile input (manifest, push)."""

from __future__ import annotations

import pytest
import torch

from storage_client import MAX_DATA_PARALLEL, Kernels, ManifestError
from tests.unit.test_coordinator_machine import Clock, coordinator, header, joined, update_of
from trainer.config import InnerConfig, ModelConfig
from trainer.model.gpt import build_model
from trainer.net.refusal import Reason, Refusal
from trainer.runtime import island
from trainer.runtime.island import Island, mean_in_rank_order, replica_slice
from trainer.runtime.pipeline import plan_stages
from trainer.runtime.staged import staged_arithmetic

MODEL = ModelConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)


def test_ranks_are_replica_major_and_named() -> None:
    two_by_two = Island(2, 2)
    assert [(two_by_two.replica_of(r), two_by_two.stage_of(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert two_by_two.pipeline_ranks(1) == [2, 3] and two_by_two.replica_ranks(1) == [1, 3]
    assert two_by_two.who(3) == "data-parallel replica 1 of 2, pipeline stage 1 of 2"
    assert Island(2, 1).who(1) == "data-parallel replica 1 of 2"
    assert Island(1, 3).who(2) == "pipeline stage 2 of 3"  # a pipeline alone is named as before
    with pytest.raises(ValueError, match="at least one replica"):
        Island(0, 2)


def test_a_batch_must_cut_into_equal_replica_slices_and_microbatches() -> None:
    Island(2, 2).check_batch(4, 2)
    Island(4, 1).check_batch(4, 2)  # one stage: no microbatches
    with pytest.raises(ValueError, match="3 equal data-parallel slices"):
        Island(3, 1).check_batch(4, 2)
    with pytest.raises(ValueError, match="2 equal data-parallel slices of 2 microbatches"):
        Island(2, 2).check_batch(6, 2)
    x = torch.arange(12).reshape(6, 2)
    assert torch.equal(torch.cat([replica_slice(x, k, 3) for k in range(3)]), x)
    assert torch.equal(replica_slice(x, 1, 3), x[2:4])
    with pytest.raises(ValueError, match="4 equal data-parallel slices"):
        replica_slice(x, 0, 4)


def test_the_mean_is_summed_in_rank_order_which_rounding_can_tell() -> None:
    """ḡ = ((g₀ + g₁) + g₂) / 3 in float32: the order is pinned because another one rounds otherwise
    (a ring all-reduce may add g₁ + g₂ first)."""
    a, b, c = (torch.tensor([1e8], dtype=torch.float32), torch.tensor([-1e8], dtype=torch.float32),
               torch.tensor([1e-3], dtype=torch.float32))
    (mean,) = mean_in_rank_order([[a], [b], [c]])
    assert torch.equal(mean, ((a + b) + c) / 3) and mean.item() > 0
    assert (a + (b + c)).item() == 0.0  # the other order loses c
    assert a.item() == 1e8  # the inputs are left alone
    with pytest.raises(ValueError, match="different numbers"):
        mean_in_rank_order([[a], [b, c]])


def test_an_island_on_cuda_needs_a_gpu_a_rank() -> None:
    island.check_devices(Island(2, 2), "cuda", 4)
    island.check_devices(Island(2, 2), "cpu", 0)
    island.check_devices(Island(1, 2), "cuda", 1)  # stages alone: trainer.runtime.device's placement, as before
    with pytest.raises(ValueError, match="need 4 GPUs, one a rank; this machine has 1"):
        island.check_devices(Island(2, 2), "cuda", 1)


def test_buckets_bound_what_a_rank_gathers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(island, "BUCKET_ELEMENTS", 10)
    sizes = [[t.numel() for t in bucket] for bucket in island._buckets([torch.zeros(n) for n in (4, 5, 3, 12, 1)])]
    assert sizes == [[4, 5], [3], [12], [1]]


def test_the_replays_arithmetic_of_replicas_is_the_full_batch_gradient_up_to_rounding() -> None:
    """N equal slices, each's mean loss, averaged: in exact arithmetic the full-batch gradient, so
    an island trains what one process would (the replay computes it the island's way, bit for bit)."""
    torch.manual_seed(0)
    x, y = torch.randint(MODEL.vocab_size, (4, 16)), torch.randint(MODEL.vocab_size, (4, 16))
    grads = {}
    for replicas, stages in ((1, 1), (2, 1), (4, 1), (2, 2)):
        model = build_model(MODEL, 7)
        arithmetic = staged_arithmetic(MODEL, stages, replicas=replicas)
        if arithmetic is None:
            _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), InnerConfig().grad_clip)
        else:
            arithmetic.gradients(model, x, y, InnerConfig().grad_clip)
        grads[(replicas, stages)] = {n: p.grad for n, p in model.named_parameters()}
    full = grads[(1, 1)]
    for key, got in grads.items():
        assert max((got[n] - full[n]).abs().max().item() for n in full) < 1e-6, key
    assert any(not torch.equal(grads[(2, 1)][n], full[n]) for n in full)  # but not the same bits


def test_auto_plans_one_stage_per_replica_and_shares_the_threads() -> None:
    assert plan_stages(None, 2, 8, replicas=2) == plan_stages(1, 2, 8, replicas=2)
    plan = plan_stages(None, 2, 8, replicas=2)
    assert (plan.stages, plan.threads_per_stage, plan.worker_threads) == (1, 4, 1)
    plan = plan_stages(2, 2, 8, replicas=2)
    assert (plan.stages, plan.threads_per_stage) == (2, 2)
    assert plan_stages(None, 2, 1, replicas=4).threads_per_stage == 1


def test_data_parallel_in_a_manifest_is_bounded_and_absent_for_one_process() -> None:
    assert Kernels("avx2", 1).to_json() == {"capability": "avx2", "threads": 1}  # schema v5's bytes
    island_kernels = Kernels("avx2", 1, data_parallel=8)
    assert island_kernels.to_json() == {"capability": "avx2", "threads": 1, "data_parallel": 8}
    assert Kernels.from_json(island_kernels.to_json()) == island_kernels
    assert str(island_kernels) == "avx2, 1 thread, 8 data-parallel ranks"
    for bad, why in ((1, ">= 2"), (0, ">= 2"), (True, "expected int"), ("2", "expected int"),
                     (MAX_DATA_PARALLEL + 1, f"<= {MAX_DATA_PARALLEL}")):
        with pytest.raises(ManifestError, match=why):
            Kernels.from_json({"capability": "avx2", "threads": 1, "data_parallel": bad})


@pytest.mark.parametrize("fields, reason, why", [
    (dict(data_parallel=2), Reason.MALFORMED, "without kernels"),
    (dict(cpu_capability="avx2", intra_op_threads=1, data_parallel=MAX_DATA_PARALLEL + 1), Reason.MALFORMED,
     "data_parallel"),
    (dict(cpu_capability="avx2", intra_op_threads=1, data_parallel=3), Reason.BAD_CLAIM,
     "cannot be cut into 3 equal data-parallel slices"),
])
def test_a_push_naming_ranks_no_island_could_have_is_refused(tmp_path, fields: dict, reason: Reason,
                                                             why: str) -> None:
    c = coordinator(tmp_path, Clock())  # batch_size 4
    joined(c, "w0", "w1")
    u = update_of(c, 1.0)
    c.admit_header(header(c, "w0", u, cpu_capability="avx2", intra_op_threads=1, data_parallel=2))
    with pytest.raises(Refusal) as caught:
        c.admit_header(header(c, "w1", u, **fields))
    assert caught.value.reason is reason and why in str(caught.value), caught.value
    assert len(str(caught.value)) < 400
