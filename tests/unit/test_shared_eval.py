"""The shared evaluation (trainer.data.shared_eval): the coordinator's per-batch held-out losses are
checked whole by every worker, and each worker re-evaluates only its share, refusing to sign when a
claim in its share is wrong. Real models and batches; no network."""

from __future__ import annotations

import dataclasses

import pytest

from storage_client import to_e6
from trainer.config import DataConfig, InnerConfig, ModelConfig, RoundConfig, RunConfig
from trainer.data.corpus import eval_batches, load_corpus
from trainer.data.shared_eval import EVAL_TOLERANCE_E6, MAX_EVAL_LOSS_E6, eval_share, shared_evaluation_problem
from trainer.model.gpt import build_model
from trainer.model.params import params_of
from trainer.runtime.inner import evaluate, evaluate_batches
from trainer.worker.client import Checkpoint
from trainer.worker.reporter import Reporter

CONFIG = RunConfig(model=ModelConfig(n_layer=1, n_embd=32, n_head=2, block_size=16), inner=InnerConfig(batch_size=2),
                   data=DataConfig(eval_batches=5), rounds=RoundConfig(expected_workers=2, quorum=2))


@pytest.fixture(scope="module")
def evaluated():
    """The run's model, its held-out batches, and the honest per-batch claims and manifest value."""
    corpus = load_corpus(CONFIG.data, CONFIG.seed, CONFIG.model.block_size)
    batches = eval_batches(corpus, seed=CONFIG.seed, count=CONFIG.data.eval_batches,
                           batch_size=CONFIG.inner.batch_size, block_size=CONFIG.model.block_size)
    model = build_model(CONFIG.model, CONFIG.seed)
    losses = evaluate_batches(model, batches)
    assert sum(losses) / len(losses) == evaluate(model, batches)  # the manifest's mean, unchanged
    return model, batches, [to_e6(x) for x in losses], to_e6(evaluate(model, batches))


def worker(slot: int, model, batches) -> Reporter:
    """A worker's reporter as set up at its first Join, without a coordinator (evaluation_problem needs none)."""
    return Reporter(None, CONFIG, slot, b"", batches, model, None)  # type: ignore[arg-type]


def checkpoint(model, claims: list[int], manifest_e6: int) -> Checkpoint:
    return Checkpoint(1, "params", "manifest", manifest_e6, False, params_of(model), tuple(claims))


def test_shares_cover_every_batch_once() -> None:
    for count, workers in ((5, 2), (8, 8), (3, 8), (10_000, 7)):
        shares = [eval_share(count, workers, s) for s in range(workers)]
        assert sorted(j for share in shares for j in share) == list(range(count))
    assert eval_share(5, 2, 0) == [0, 2, 4] and eval_share(5, 2, 1) == [1, 3] and eval_share(5, 2, 2) == []


def test_honest_claims_pass_every_worker(evaluated) -> None:
    model, batches, claims, manifest_e6 = evaluated
    for slot in (0, 1):
        assert worker(slot, model, batches).evaluation_problem(checkpoint(model, claims, manifest_e6)) is None


def test_a_wrong_claim_in_a_workers_share_is_refused_by_that_worker(evaluated) -> None:
    model, batches, claims, manifest_e6 = evaluated
    # Batch 3 (slot 1's) claimed 0.01 nats low and batch 4 (slot 0's) as much high: the mean, and
    # so the manifest's value, still agree; only the worker re-evaluating batch 3 can tell.
    forged = list(claims)
    forged[3] -= 10 * EVAL_TOLERANCE_E6
    forged[4] += 10 * EVAL_TOLERANCE_E6
    bad = checkpoint(model, forged, manifest_e6)
    problem = worker(1, model, batches).evaluation_problem(bad)
    assert problem is not None and "held-out batch 3" in problem
    problem = worker(0, model, batches).evaluation_problem(bad)
    assert problem is not None and "held-out batch 4" in problem
    # Within the tolerance is not a mismatch.
    close = list(claims)
    close[3] += EVAL_TOLERANCE_E6 // 2
    assert worker(1, model, batches).evaluation_problem(checkpoint(model, close, manifest_e6)) is None


def test_claims_are_checked_whole(evaluated) -> None:
    _, _, claims, manifest_e6 = evaluated
    count = CONFIG.data.eval_batches
    assert "4 per-batch eval losses" in shared_evaluation_problem(claims[:4], count, manifest_e6, {})
    assert "6 per-batch" in shared_evaluation_problem(claims + [claims[0]], count, manifest_e6, {})
    assert shared_evaluation_problem((), count, manifest_e6, {}) is not None  # an older coordinator's header
    for value in (-1, MAX_EVAL_LOSS_E6 + 1):
        out_of_range = list(claims)
        out_of_range[2] = value
        assert "batch 2 is out of range" in shared_evaluation_problem(out_of_range, count, manifest_e6, {})
    assert "average" in shared_evaluation_problem(claims, count, manifest_e6 + 2 * EVAL_TOLERANCE_E6, {})
    assert "not one of the run's" in shared_evaluation_problem(claims, count, manifest_e6, {count: 0})


def test_the_coordinator_claims_its_own_evaluation(tmp_path) -> None:
    """Genesis: the state served carries one claim per batch, averaging to the manifest's loss."""
    from trainer.coordinator.run import open_run
    from trainer.runstore.run_dir import RunDir

    run = open_run(RunDir(tmp_path / "run"), dataclasses.replace(CONFIG))
    claims = run.global_state.eval_losses_e6
    assert len(claims) == CONFIG.data.eval_batches
    assert shared_evaluation_problem(claims, len(claims), run.global_state.eval_loss_e6, {}) is None
    resumed = open_run(RunDir(tmp_path / "run"), None)
    assert resumed.global_state.eval_losses_e6 == claims  # re-evaluated on resume, the same
