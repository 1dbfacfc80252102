"""Which overlapped contributions the audit can replay (audit.replay.unreplayable_reason), and where
it starts them (``Replayer._start``). Since issue 28 an overlapped worker whose update did not count
starts over from the newest global state with its inner state rewound (trainer.worker.loops), so
every start of a one-process worker is built from stored objects; a worker of several stages is
named, never guessed."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from audit.replay import ReplayOutcome, Replayer, missing_states, unreplayable_reason
from storage_client import open_store
from tests.conftest import small_config
from trainer.config import RoundConfig
from trainer.rounds.outer import eager_weight
from trainer.runtime.inner import FRESH_STATE
from trainer.runtime.state_commit import state_cid

STEPPED = "0" * 64  # an inner state that is not fresh


def manifests(*rounds: dict[str, str | None]) -> dict[int, SimpleNamespace]:
    """Round k+1 ← rounds[k]: the counted workers and the inner state each committed."""
    out = {0: SimpleNamespace(participants=[])}
    for k, workers in enumerate(rounds, start=1):
        out[k] = SimpleNamespace(participants=[SimpleNamespace(worker=w, state=s, kernels=None) for w, s in workers.items()])
    return out


def config(start: str):
    return small_config(rounds=RoundConfig(rounds=4, overlap=True, overlap_start=start))


@pytest.mark.parametrize("start", ["delayed", "eager"])
def test_a_chain_of_counted_rounds_is_replayable(start: str) -> None:
    m = manifests({"a": FRESH_STATE}, {"a": STEPPED}, {"a": STEPPED})
    assert [unreplayable_reason(config(start), m, r, "a") for r in (1, 2, 3)] == [None, None, None]


@pytest.mark.parametrize("start", ["delayed", "eager"])
def test_after_an_update_that_did_not_count_the_worker_starts_over_so_its_start_is_stored(start: str) -> None:
    m = manifests({"a": FRESH_STATE}, {}, {"a": STEPPED}, {"a": STEPPED})
    assert [unreplayable_reason(config(start), m, r, "a") for r in (1, 3, 4)] == [None, None, None]
    # a worker that joins afresh starts from the newest global state: replayable
    assert unreplayable_reason(config(start), manifests({}, {}, {"a": FRESH_STATE}), 3, "a") is None


def starts(start: str, m: dict[int, SimpleNamespace]) -> Replayer:
    """A replayer whose θ⁽ᵗ⁾ is [t] and whose Δ̂ of round t is [10 t], to read which rule built a start."""
    replayer = Replayer(store=None, config=config(start), manifests=m)  # type: ignore[arg-type]
    replayer._params = lambda r, what: {"x": torch.tensor([float(r)])}  # type: ignore[method-assign]
    replayer._sent = lambda r, worker, p, like: {"x": torch.tensor([10.0 * r])}  # type: ignore[method-assign]
    return replayer


@pytest.mark.parametrize("start", ["delayed", "eager"])
def test_a_round_after_one_that_did_not_count_or_with_a_fresh_state_starts_from_the_newest_global(start: str) -> None:
    # round 2 refused: the worker dropped round 3's first try and trained it again from θ⁽²⁾
    after_refusal = starts(start, manifests({"a": FRESH_STATE}, {}, {"a": STEPPED}))
    assert after_refusal._start(3, "a")["x"].item() == 2.0
    # nothing of the worker's counted before round 3 (a straggler): its state is fresh, its start θ⁽²⁾
    straggler = starts(start, manifests({}, {}, {"a": FRESH_STATE}))
    assert straggler._start(3, "a")["x"].item() == 2.0
    # a worker restarted (fresh state) after a counted round 2 starts from the newest global too
    restarted = starts(start, manifests({"a": FRESH_STATE}, {"a": STEPPED}, {"a": FRESH_STATE}))
    assert restarted._start(3, "a")["x"].item() == 2.0


def test_the_eager_start_has_no_history_right_after_the_worker_started_over() -> None:
    c = eager_weight(config("eager").outer, config("eager").rounds.expected_workers)
    # rounds 1, 3, 4 counted, round 2 not: round 3 started over from θ⁽²⁾, so round 4's eager start
    # is θ⁽²⁾ − c Δ̂⁽³⁾ (no history), not θ⁽²⁾ − ((θ⁽¹⁾ − θ⁽²⁾) + c (Δ̂⁽³⁾ − Δ̂⁽²⁾))
    gap = starts("eager", manifests({"a": FRESH_STATE}, {}, {"a": STEPPED}, {"a": STEPPED}))
    assert gap._start(4, "a")["x"].item() == pytest.approx(2.0 - c * 30.0)
    # in sequence (rounds 2, 3, 4 counted) the history is there
    chain = starts("eager", manifests({"a": FRESH_STATE}, {"a": STEPPED}, {"a": STEPPED}, {"a": STEPPED}))
    assert chain._start(4, "a")["x"].item() == pytest.approx(2.0 - ((1.0 - 2.0) + c * (30.0 - 20.0)))
    assert starts("delayed", gap.manifests)._start(4, "a")["x"].item() == 2.0 - 30.0


def test_pipelined_workers_of_runs_from_before_their_commitment_are_not_replayable() -> None:
    m = manifests({"a": None})
    assert "several pipeline stages" in unreplayable_reason(config("delayed"), m, 1, "a")


@pytest.mark.parametrize("start", ["delayed", "eager"])
def test_a_round_whose_state_moved_through_an_uncounted_one_is_sampled_and_named(start: str, tmp_path: Path) -> None:
    """The cheat of issue 28: its round-1 push is refused, and it trains round 2 on from the state
    round 1 left (an honest worker rewinds). Before, round 2 was "not replayable" and skipped in
    silence; now it is sampled, and its replay fails by worker and round (audit.recompute turns the
    row into a ``replay`` failure) before a step is trained."""
    cheat = manifests({}, {"a": STEPPED})
    replayer = Replayer(store=open_store(tmp_path), config=config(start), manifests=cheat)  # no stored state
    assert replayer.sample(4, seed=1) == ([(2, "a")], [])
    rows, steps = replayer.replay([(2, "a")])
    assert steps == 0 and [(row.round, row.worker, row.sampled, row.status) for row in rows] == [
        (2, "a", True, "MISMATCH")]
    assert "the committed inner state is not fresh" in rows[0].note


def test_what_cannot_be_replayed_is_named_by_worker_and_round_in_the_json_and_one_line() -> None:
    m = manifests({"a": None, "b": FRESH_STATE}, {"a": None, "b": STEPPED})
    replayer = Replayer(store=None, config=config("delayed"), manifests=m)  # type: ignore[arg-type]
    picked, skipped = replayer.sample(8, seed=1)
    assert picked == [(1, "b"), (2, "b")] and [(row.round, row.worker) for row in skipped] == [(1, "a"), (2, "a")]
    outcome = ReplayOutcome(skipped, [], seed=1, steps=0, checked_steps=0, seconds=0.0, problems=[])
    assert outcome.to_json()["not_replayed"] == {"a": [1, 2]}
    assert outcome.not_replayed_line() == ("2 contribution(s) could not be replayed and were not sampled: a round(s) "
                                           "1, 2 (the worker ran several pipeline stages and committed no inner state (a run from before "
                                           "they did))")
    assert ReplayOutcome([], [], 1, 0, 0, 0.0, []).not_replayed_line() is None


def test_the_audit_expects_a_stored_state_at_a_workers_first_counted_round_of_each_window() -> None:
    """rounds.state_every = 4 (trainer.runtime.state_commit.state_due, from the manifests): absent from
    round 4, present at 1-3 and 5-8, the worker's state is due at round 5 (and 8), so an audit names
    those two when the store lacks them, and with them stored no chain is longer than K."""
    m = manifests(*[{} if r == 4 else {"a": FRESH_STATE if r == 1 else f"{r:064x}"}
                    for r in range(1, 9)])
    cfg = small_config(rounds=RoundConfig(rounds=8, state_every=4))
    empty = SimpleNamespace(has=lambda cid: False)
    assert [r for r, _, _ in missing_states(empty, cfg, m, "a", [1, 2, 3, 5, 6, 7, 8])] == [5, 8]
    stored = {state_cid(f"{r:064x}") for r in (5, 8)}
    store = SimpleNamespace(has=lambda cid: cid in stored)
    replayer = Replayer(store=store, config=cfg, manifests=m)  # type: ignore[arg-type]
    assert [replayer.chain(r, "a") for r in (3, 5, 7, 8)] == [[1, 2, 3], [5], [5, 6, 7], [8]]
