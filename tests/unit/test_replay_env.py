"""audit.replay_env's pure parts: which kernels a chain is replayed in, the fallback tolerance, the
child's environment, and the child's answer read as hostile input."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from audit.replay_env import (
    EXACT_TOLERANCE, FALLBACK_MARGIN, FALLBACK_MEASURED, FALLBACK_TOLERANCE, MAX_CHILD_THREADS, ChildError,
    chain_kernels, child_environment, fallback_horizon, fallback_tolerance, judge, parse_answer,
)
from storage_client import Kernels
from trainer.config import REPLAY_HORIZON, ConfigError, RoundConfig, RunConfig
from trainer.runtime.kernels import agreed_kernels, cpu_runs, current_kernels

AVX2 = Kernels("avx2", 1)
CHAINS = {"w0": [1, 2]}


def _manifests(*kernels_by_round: Kernels | None) -> dict:
    return {r: SimpleNamespace(participants=[SimpleNamespace(worker="w0", kernels=k)])
            for r, k in enumerate(kernels_by_round, start=1)}


def test_a_chain_is_replayed_in_its_workers_kernels_only_when_all_agree_and_this_cpu_runs_them() -> None:
    assert chain_kernels(_manifests(AVX2, AVX2), "w0", [1, 2]).kernels == (AVX2 if cpu_runs("avx2") else None)
    assert chain_kernels(_manifests(Kernels("default", 3)), "w0", [1]).kernels == Kernels("default", 3)
    assert chain_kernels(_manifests(AVX2, None), "w0", [1, 2]).reason == "no kernels recorded"
    assert chain_kernels(_manifests(AVX2, Kernels("avx2", 2)), "w0", [1, 2]).reason == \
        "the chain's recorded kernels change"
    foreign = "vsx" if torch.backends.cpu.get_cpu_capability().lower() != "vsx" else "zvector"
    assert "cannot run" in chain_kernels(_manifests(Kernels(foreign, 1)), "w0", [1]).reason
    # A claim of more threads than a replay here runs is replayed in the auditor's kernels, said.
    many = chain_kernels(_manifests(Kernels("default", MAX_CHILD_THREADS + 1)), "w0", [1])
    assert many.kernels is None and f"more than a replay here runs ({MAX_CHILD_THREADS})" in many.reason
    assert chain_kernels(_manifests(Kernels("default", MAX_CHILD_THREADS)), "w0", [1]).kernels is not None


def test_a_worker_of_stages_records_the_kernels_all_its_stages_ran_or_none_and_why() -> None:
    assert agreed_kernels([AVX2, Kernels("avx2", 1)]) == (AVX2, "")
    none, why = agreed_kernels([Kernels("avx2", 2), AVX2])
    assert none is None and why == "the pipeline stages ran different kernels (stage 0: avx2, 2 threads; " \
                                   "stage 1: avx2, 1 thread)"
    none, why = agreed_kernels([AVX2, None])
    assert none is None and "stage(s) [1]" in why


def test_this_process_names_its_own_kernels_on_the_cpu_and_none_elsewhere() -> None:
    mine = current_kernels(torch.device("cpu"))
    assert mine is not None and mine.threads == torch.get_num_threads() and cpu_runs(mine.capability)
    assert current_kernels(torch.device("meta")) is None


def test_the_fallback_tolerance_holds_while_its_margin_over_the_measured_does_and_then_stops() -> None:
    decided = [n for n in range(1, len(FALLBACK_MEASURED) + 1) if fallback_tolerance(n) is not None]
    assert decided == list(range(1, len(decided) + 1)) and len(decided) == 5  # the demo: chain positions 1..5
    assert all(fallback_tolerance(n) == FALLBACK_TOLERANCE >= FALLBACK_MARGIN * max(FALLBACK_MEASURED[:n])
               for n in decided)
    assert FALLBACK_TOLERANCE > EXACT_TOLERANCE and fallback_tolerance(0) is None
    assert fallback_tolerance(len(FALLBACK_MEASURED) + 1) is None


def test_the_replay_horizon_is_where_the_measurements_stop_deciding_and_bounds_state_every() -> None:
    """One constant (trainer.config.REPLAY_HORIZON) bounds rounds.state_every and the fallback: it is
    the last chain position the measured honest distances support, and no run may store its
    states more rarely."""
    assert fallback_horizon() == REPLAY_HORIZON
    assert fallback_tolerance(REPLAY_HORIZON) == FALLBACK_TOLERANCE and fallback_tolerance(REPLAY_HORIZON + 1) is None
    assert 1 <= RoundConfig().state_every <= REPLAY_HORIZON
    RunConfig(rounds=dataclasses.replace(RunConfig().rounds, state_every=REPLAY_HORIZON))
    for outside in (0, REPLAY_HORIZON + 1):
        with pytest.raises(ConfigError, match="rounds.state_every"):
            RunConfig(rounds=dataclasses.replace(RunConfig().rounds, state_every=outside))


def test_the_child_runs_the_workers_kernels_whatever_the_auditors(monkeypatch) -> None:
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    env = child_environment(Kernels("avx512", 2))
    assert (env["ATEN_CPU_CAPABILITY"], env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]) == ("avx512", "2", "2")


def _row(**over: object) -> dict:
    row = {"round": 1, "worker": "w0", "sampled": True, "distance": 0.0, "status": "ok", "note": "",
           "kernels": "worker's (avx2, 1 thread)", "tolerance": EXACT_TOLERANCE}
    return {**row, **over}


def _answer(**over: object) -> bytes:
    answer = {"kernels": AVX2.to_json(), "rows": [_row()], "steps": 50, "round_steps": {"1": 50}, "problems": []}
    return ("progress on stdout is ignored\n" + json.dumps({**answer, **over})).encode()


def test_the_childs_answer_is_read_strictly() -> None:
    ok = parse_answer(_answer(), AVX2, CHAINS)
    assert ok["rows"][0]["distance"] == 0.0 and ok["steps"] == 50 and ok["round_steps"] == {1: 50}
    bad = [_answer(kernels={"capability": "avx512", "threads": 1}),  # ran in other kernels
           _answer(rows=[_row(worker="w9")]), _answer(rows=[_row(round=3)]),  # not asked for
           _answer(rows=[_row(status="fine")]), _answer(rows=[_row(distance="0")]),
           _answer(rows=[_row(distance=float("nan"))]), _answer(rows=[_row(extra=1)]),
           _answer(steps="50"), _answer(round_steps={"x": 1}), _answer(problems=[["1", "o", "m"]]),
           b"", b"not json", b"[]"]
    for out in bad:
        with pytest.raises(ChildError) as caught:
            parse_answer(out, AVX2, CHAINS)
        assert len(str(caught.value)) < 400


def test_a_verdict_is_exact_in_the_workers_kernels_and_inconclusive_where_the_fallback_cannot_decide() -> None:
    assert judge(0.0, 8, exact=True) == ("ok", "", EXACT_TOLERANCE)
    assert judge(2e-6, 1, exact=True)[0] == "MISMATCH"  # an update scaled by 1.00001
    assert judge(0.04, 1, exact=False) == ("ok", "", FALLBACK_TOLERANCE)
    assert judge(0.06, 5, exact=False)[0] == "MISMATCH"
    status, note, tolerance = judge(0.3, 6, exact=False)  # the demo's honest 0.047 there, 0.28 at 8
    assert status == "inconclusive" and tolerance is None and "contribution 6 of its chain" in note
