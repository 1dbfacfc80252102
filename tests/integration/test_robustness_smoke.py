"""``dilocox bench robust --quick``: real runs with mallory, and a report that holds together.

Two scenarios under two settings (the plain-mean reference and the median), plus the honest-only
runs: every run produces its cells, an honest mallory trains exactly as a worker process does (its
run equals the honest-only run to the bit), a refused push shows its status and reason, and every
run re-derives. The quick model is tiny, so no loss or timing is judged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.main import main

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_quick_robustness_reports_every_row(tmp_path: Path) -> None:
    assert main(["bench", "robust", "--quick", "--scenarios", "honest,zero", "--aggregations", "median",
                 "--out", str(tmp_path)]) == 0

    result = json.loads((tmp_path / "robustness.json").read_text())
    assert list(result["honest_only"]) == ["clip-off", "median"]  # the reference always runs
    assert set(result["attacked"]) == {"honest", "zero"}
    runs = [*result["honest_only"].values(), *(r for row in result["attacked"].values() for r in row.values())]
    assert all("failed" not in r and r["rederives"] for r in runs), runs

    honest = result["attacked"]["honest"]["clip-off"]
    assert [o["accepted"] for o in honest["outcomes"]] == [True, True]
    assert honest["final_loss"] == result["honest_only"]["clip-off"]["final_loss"]
    zero = result["attacked"]["zero"]["median"]["outcomes"]
    assert {(o["accepted"], o["code"]) for o in zero} == {(False, "INVALID_ARGUMENT")}

    markdown = (tmp_path / "robustness.md").read_text()
    assert "| honest (mallory honest) |" in markdown and "| zero update |" in markdown
    assert "refused INVALID_ARGUMENT (all-zero update), every round" in markdown
    assert "| median |" in markdown and "cores" in markdown and "seed 1337" in markdown
    assert not (tmp_path / "runs").exists()
