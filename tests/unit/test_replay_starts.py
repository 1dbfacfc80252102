"""Which overlapped contributions the audit can replay (audit.replay.unreplayable_reason): a start
built only from stored objects is replayed; one that depends on an update that did not count is
named, never guessed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from audit.replay import unreplayable_reason
from tests.conftest import small_config
from trainer.config import RoundConfig
from trainer.runtime.inner import FRESH_STATE

STEPPED = "0" * 64  # an inner state that is not fresh


def manifests(*rounds: dict[str, str | None]) -> dict[int, SimpleNamespace]:
    """Round k+1 ← rounds[k]: the counted workers and the inner state each committed."""
    out = {0: SimpleNamespace(participants=[])}
    for k, workers in enumerate(rounds, start=1):
        out[k] = SimpleNamespace(participants=[SimpleNamespace(worker=w, state=s) for w, s in workers.items()])
    return out


def config(start: str):
    return small_config(rounds=RoundConfig(rounds=4, overlap=True, overlap_start=start))


@pytest.mark.parametrize("start", ["delayed", "eager"])
def test_a_chain_of_counted_rounds_is_replayable(start: str) -> None:
    m = manifests({"a": FRESH_STATE}, {"a": STEPPED}, {"a": STEPPED})
    assert [unreplayable_reason(config(start), m, r, "a") for r in (1, 2, 3)] == [None, None, None]


@pytest.mark.parametrize("start", ["delayed", "eager"])
def test_after_an_update_that_did_not_count_the_start_is_not_stored(start: str) -> None:
    m = manifests({"a": FRESH_STATE}, {}, {"a": STEPPED})
    assert "round before did not count" in unreplayable_reason(config(start), m, 3, "a")
    # a worker that joins afresh starts from the newest global state: replayable
    assert unreplayable_reason(config(start), manifests({}, {}, {"a": FRESH_STATE}), 3, "a") is None


def test_the_eager_start_also_needs_round_r_minus_2_unless_round_r_minus_1_was_the_first() -> None:
    gap = manifests({"a": FRESH_STATE}, {}, {"a": STEPPED}, {"a": STEPPED})
    assert "round r-2 did not count" in unreplayable_reason(config("eager"), gap, 4, "a")
    assert unreplayable_reason(config("delayed"), gap, 4, "a") is None  # delayed needs r-1 only
    rejoined = manifests({"a": FRESH_STATE}, {}, {"a": FRESH_STATE}, {"a": STEPPED})
    assert unreplayable_reason(config("eager"), rejoined, 4, "a") is None  # no history after a fresh start


def test_pipelined_workers_commit_no_inner_state() -> None:
    m = manifests({"a": None})
    assert "several pipeline stages" in unreplayable_reason(config("delayed"), m, 1, "a")
