"""benchmarks.ablation: a mode that fails is a ``failed: <one line>`` row and the others still run.

The per-mode runners are replaced by stand-ins (no process is started): one mode raises as
run_diloco does when a worker exits non-zero, the rest return made-up rows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import ablation


def fake_convergence(mode: ablation.Mode, s: ablation.Settings, *_: Any) -> dict[str, Any]:
    if mode.key == "no-overlap":
        raise RuntimeError(f"{mode.name}: w1 exited with 1:\nstarting\nTraceback (most recent call last):\n"
                           "WorkerError: the coordinator refused every push")
    loss = 2.0 if mode.allreduce else 2.1
    return {"name": mode.name, "stages": mode.stages, "overlap": mode.overlap, "compression": "none",
            "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True}, "warnings": [], "seconds": 1.0,
            "tokens": 1000, "curve": [(0, 5.5), (1000, loss)], "final_loss": loss,
            "bytes_sent_per_worker": 10.0, "bytes_received_per_worker": 10.0, "tokens_per_worker": 500.0,
            "bytes_per_token": 1.0 if mode.allreduce else 0.01, "t_step_s": 0.01}


def fake_throughput(mode: ablation.Mode, *_: Any) -> dict[str, Any]:
    if mode.key == "fixed-rank":
        raise ValueError("no `finished` metrics record")
    return {"name": mode.name, "steps": 4, "tokens": 1000, "wall_s": 2.0, "compute_s": 1.5, "utilisation": 0.75,
            "steady_tokens": 500, "steady_wall_s": 1.0, "steady_utilisation": 0.8, "steady_step_s": 0.01,
            "tokens_per_s": 500.0, "steady_tokens_per_s": 500.0, "rounds": 2, "comm_to_step": 20.0}


@pytest.fixture
def settings(tmp_path: Path) -> ablation.Settings:
    """The smoke settings, on the embedded corpus (no data folder), writing under tmp_path."""
    p = argparse.ArgumentParser()
    ablation.add_arguments(p)
    return ablation.settings_of(p.parse_args(["--smoke", "--out", str(tmp_path), "--data", str(tmp_path / "none")]))


def test_a_failing_mode_is_a_row_and_the_benchmark_goes_on(settings: ablation.Settings,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ablation, "convergence_row", fake_convergence)
    monkeypatch.setattr(ablation, "throughput_row", fake_throughput)
    result = ablation.run(settings)

    conv, thr = result["convergence"], result["throughput"]
    assert set(conv) == set(thr) == {m.key for m in ablation.MODES}  # every mode has its row
    failed = conv["no-overlap"]["failed"]
    assert failed.startswith("failed: RuntimeError: DiLoCoX −overlap: w1 exited with 1:") and "\n" not in failed
    assert failed.endswith("WorkerError: the coordinator refused every push")  # the log's last line
    assert thr["fixed-rank"]["failed"] == "failed: ValueError: no `finished` metrics record"
    assert conv["dilocox"]["loss_ratio"] == pytest.approx(1.05)  # the others were compared as usual
    assert thr["no-overlap"]["throughput_x"] == 1.0  # a mode that failed Part 1 still ran Part 2
    assert result["targets"]  # DiLoCoX and AllReduce both ran: judged

    markdown = (settings.out / "ablation.md").read_text()
    row = next(line for line in markdown.splitlines() if line.startswith("| DiLoCoX −overlap | failed:"))
    assert row.count("|") == 13  # the table's 12 columns
    assert "| DiLoCoX −adaptive rank | failed: ValueError" in markdown
    assert json.loads((settings.out / "ablation.json").read_text())["convergence"]["no-overlap"]["failed"] == failed


def test_without_the_baseline_ratios_are_blank_and_part_2_says_why(settings: ablation.Settings,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def convergence(mode: ablation.Mode, *args: Any) -> dict[str, Any]:
        if mode.allreduce:
            raise OSError("gloo rendezvous timed out")
        return fake_convergence(mode, *args)

    monkeypatch.setattr(ablation, "convergence_row", convergence)
    monkeypatch.setattr(ablation, "throughput_row", fake_throughput)
    result = ablation.run(settings)
    assert result["convergence"]["allreduce"]["failed"] == "failed: OSError: gloo rendezvous timed out"
    assert all("calibrates it, failed" in r["failed"] for r in result["throughput"].values())
    assert result["convergence"]["diloco"]["loss_ratio"] != result["convergence"]["diloco"]["loss_ratio"]  # NaN
    assert result["targets"] == []
    assert "not judged" in (settings.out / "ablation.md").read_text()
