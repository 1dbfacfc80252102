"""benchmarks.ablation: a mode that fails is a ``failed: <one line>`` row and the others still run;
rows hold the mean and spread over seeds, and ratios are taken seed by seed.

The per-run measurements are replaced by stand-ins (no process is started): one mode raises as
run_diloco does when a worker exits non-zero, the rest return made-up runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import ablation
from benchmarks.ablation import measure


def fake_convergence(mode: ablation.Mode, s: ablation.Settings, data: Any, evaluate: Any, root: Path, seed: int,
                     **_: Any) -> dict[str, Any]:
    if mode.key == "no-overlap":
        raise RuntimeError(f"{mode.name}: w1 exited with 1:\nstarting\nTraceback (most recent call last):\n"
                           "WorkerError: the coordinator refused every push")
    # AllReduce 2.0 on every seed; every DiLoCo mode 2.1 + 0.01 per seed past the first.
    loss = 2.0 if mode.allreduce else 2.1 + 0.01 * (seed - s.seeds[0])
    return {"seed": seed, "outer": [0.7, 0.9], "warnings": [], "seconds": 1.0, "tokens": 1000,
            "curve": [(0, 5.5), (1000, loss)], "final_loss": loss, "sent": 10.0, "received": 10.0,
            "bytes_per_token": 1.0 if mode.allreduce else 0.01, "t_step_s": 0.01,
            "per_round": [{"round": 1, "bytes_sent": 10.0, "bytes_received": 10.0, "inner_steps": 4,
                           "mean_rank": 8.0, "stages": 1}]}


def fake_throughput(mode: ablation.Mode, *_: Any) -> dict[str, Any]:
    if mode.key == "pipeline":
        raise ValueError("no `finished` metrics record")
    return {"steps": 4, "tokens": 1000, "wall_s": 2.0, "compute_s": 1.5, "utilisation": 0.75,
            "steady_tokens": 500, "steady_wall_s": 1.0, "steady_utilisation": 0.8, "steady_step_s": 0.01,
            "tokens_per_s": 500.0, "steady_tokens_per_s": 500.0, "rounds": 2, "comm_to_step": 20.0,
            "startup_s": 0.5, "last_exchange_s": 0.2, "run_tokens_per_s": 700.0, "run_utilisation": 0.9,
            "stages": 1, "threads_per_stage": 1}


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ablation.Settings:
    """The smoke settings (two seeds), on the embedded corpus (no data folder), writing under tmp_path."""
    monkeypatch.setattr(ablation, "topk_density", lambda s: 0.01)
    p = argparse.ArgumentParser()
    ablation.add_arguments(p)
    return ablation.settings_of(p.parse_args(["--smoke", "--seeds", "1337,1338", "--out", str(tmp_path),
                                                   "--data", str(tmp_path / "none")]))


def test_a_failing_mode_is_a_row_and_the_benchmark_goes_on(settings: ablation.Settings,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(measure, "convergence_run", fake_convergence)
    monkeypatch.setattr(measure, "throughput_row", fake_throughput)
    result = ablation.run(settings)

    conv, thr = result["convergence"], result["throughput"]
    assert set(conv) == {m.key for m in ablation.MODES if m.convergence}  # every mode has its row
    assert set(thr) == set(ablation.SMOKE_THROUGHPUT)  # the smoke times the baseline and DiLoCoX, 1 and 2 stages
    failed = conv["no-overlap"]["failed"]
    assert failed.startswith("failed: RuntimeError: DiLoCoX −overlap: w1 exited with 1:") and "\n" not in failed
    assert failed.endswith("WorkerError: the coordinator refused every push")  # the log's last line
    assert thr["pipeline"]["failed"] == "failed: ValueError: no `finished` metrics record"
    dilocox = conv["dilocox"]  # the others were compared as usual, seed by seed
    assert dilocox["loss_mean"] == pytest.approx(2.105) and dilocox["loss_sd"] == pytest.approx(0.00707, abs=1e-5)
    assert dilocox["ratio_mean"] == pytest.approx(2.105 / 2.0)
    assert dilocox["diloco_ratio_mean"] == 1.0  # against DiLoCo seed by seed (the fakes lose alike)
    assert thr["dilocox"]["steady_throughput_x"] == 1.0
    assert result["targets"]  # DiLoCoX and AllReduce both ran: judged

    markdown = (settings.out / "ablation.md").read_text()
    row = next(line for line in markdown.splitlines() if line.startswith("| DiLoCoX −overlap | failed:"))
    assert row.count("|") == 15  # the table's 14 columns
    assert "| DiLoCoX, 2 stages | failed: ValueError" in markdown
    assert "2.1050 ± 0.0071" in markdown
    assert json.loads((settings.out / "ablation.json").read_text())["convergence"]["no-overlap"]["failed"] == failed


def test_without_the_baseline_ratios_are_blank_and_part_2_says_why(settings: ablation.Settings,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def convergence(mode: ablation.Mode, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if mode.allreduce:
            raise OSError("gloo rendezvous timed out")
        return fake_convergence(mode, *args, **kwargs)

    monkeypatch.setattr(measure, "convergence_run", convergence)
    monkeypatch.setattr(measure, "throughput_row", fake_throughput)
    result = ablation.run(settings)
    assert result["convergence"]["allreduce"]["failed"] == "failed: OSError: gloo rendezvous timed out"
    assert all("calibrates it, failed" in r["failed"] for r in result["throughput"].values())
    assert result["convergence"]["diloco"]["ratio_mean"] != result["convergence"]["diloco"]["ratio_mean"]  # NaN
    assert result["targets"] == []
    assert "not judged" in (settings.out / "ablation.md").read_text()
