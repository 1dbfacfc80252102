"""Every JSON file and line the project writes is strict JSON: no NaN or Infinity, which strict
parsers (JavaScript's JSON.parse, jq, Go, Rust's serde_json) refuse."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from storage_client import strict_json
from trainer.runstore.run_dir import RunDir

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("attestation", "audit", "benchmarks", "cli", "settlement", "storage_client", "trainer")
# json.dumps where no file is written: canonical JSON itself, a JSON-RPC request body of constants,
# and a string quoted for an error message.
ALLOWED = {"storage_client/canonical.py", "settlement/anvil.py", "settlement/chain.py"}


def _strict_loads(text: str):
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_floats_become_null() -> None:
    text = strict_json({"a": math.nan, "b": [math.inf, -math.inf, 1.5], "c": (2.0, {"d": math.nan})})
    assert _strict_loads(text) == {"a": None, "b": [None, None, 1.5], "c": [2.0, {"d": None}]}


def test_a_round_without_participants_logs_strict_json(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.log_round({"round": 0, "eval_loss": 5.5, "mean_train_loss": math.nan})
    line = (tmp_path / "run" / "rounds.jsonl").read_text().strip()
    assert _strict_loads(line)["mean_train_loss"] is None


def test_no_module_writes_json_around_strict_json() -> None:
    offenders = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            if relative in ALLOWED or "_pb2" in relative:
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                if re.search(r"\bjson\.dumps?\(", line):
                    offenders.append(f"{relative}:{number}: {line.strip()}")
    assert not offenders, "use storage_client.strict_json:\n" + "\n".join(offenders)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_plain_json_would_have_written_it(value: float) -> None:
    # The guard above matters: the standard library writes these by default.
    with pytest.raises(ValueError):
        _strict_loads(json.dumps({"x": value}))
