"""trainer.runtime.pipeline.plan_stages: how many stages and threads a worker runs on the cores it is given."""

from __future__ import annotations

import pytest

from trainer.runtime.pipeline import StagePlan, plan_stages


@pytest.mark.parametrize("cores, n_layer, plan", [
    (1, 4, StagePlan(1, 1, 1)),   # one core: a second stage would only time-share it
    (2, 1, StagePlan(1, 2, 2)),   # one layer cannot be cut
    (2, 4, StagePlan(2, 1, 1)),   # a core per stage
    (16, 4, StagePlan(2, 8, 1)),  # auto stays at two stages; the cores become threads
])
def test_auto_runs_two_stages_only_where_there_is_a_core_for_each(cores: int, n_layer: int, plan: StagePlan) -> None:
    assert plan_stages(None, n_layer, cores) == plan


def test_explicit_threads_are_the_budget_and_never_oversubscribed() -> None:
    assert plan_stages(None, 4, cores=16, threads=1) == StagePlan(1, 1, 1)  # --threads 1: one stage
    assert plan_stages(3, 4, cores=16, threads=6) == StagePlan(3, 2, 1)
    assert plan_stages(4, 4, cores=2) == StagePlan(4, 1, 1)  # explicit: allowed, one thread each
    for stages in (1, 2, 4):
        plan = plan_stages(stages, 4, cores=8)
        assert plan.stages * plan.threads_per_stage <= 8


@pytest.mark.parametrize("requested, n_layer, cores, threads", [(3, 2, 4, None), (0, 2, 4, None), (1, 2, 0, None),
                                                                 (1, 2, 2, 0)])
def test_impossible_plans_are_refused(requested: int, n_layer: int, cores: int, threads: int | None) -> None:
    with pytest.raises(ValueError):
        plan_stages(requested, n_layer, cores, threads)
