"""``dilocox audit --json [FILE]``: a FILE, or stdout holding nothing but the JSON result."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import audit.cli
from audit import AuditResult, RoundRow
from audit.cli import JSON_STDOUT, add_arguments, main
from settlement import Deployment

ADDRESS = "0x" + "11" * 20


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--run", "runs/demo", *argv])


def test_json_takes_an_optional_file() -> None:
    assert parse().json is None
    assert parse("--json", "out.json").json == "out.json"
    assert parse("--json").json == JSON_STDOUT
    assert parse("--json", "-").json == JSON_STDOUT
    args = parse("--json", "--allow-dev")  # an option after --json is not taken for its FILE
    assert (args.json, args.allow_dev) == (JSON_STDOUT, True)


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run directory whose audit (no chain: ``_audit_on`` stands in) passes with one round."""
    Deployment(chain_id=31337, registry=ADDRESS, ledger=ADDRESS, owner=ADDRESS, deployed_block=1, token=ADDRESS,
               rewards=ADDRESS).save(tmp_path / "chain" / "deployment.json")
    (tmp_path / "store").mkdir()
    result = AuditResult(run_id=bytes(range(32)), rederived=True,
                         rounds=[RoundRow(0, "bagaaieragenesis", "0x" + "00" * 32, 0, 0, 5.5)])
    monkeypatch.setattr(audit.cli, "_audit_on", lambda *args, **kwargs: result)
    return tmp_path


def test_json_alone_writes_only_the_result_to_stdout(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--run", str(run_dir), "--rpc", "http://127.0.0.1:1", "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["ok"] is True and doc["run_id"] == "0x" + bytes(range(32)).hex()
    assert "AUDIT PASSED" in err and "AUDIT PASSED" not in out


def test_json_file_keeps_the_tables_on_stdout(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = run_dir / "audit.json"
    assert main(["--run", str(run_dir), "--rpc", "http://127.0.0.1:1", "--json", str(path)]) == 0
    out, _ = capsys.readouterr()
    assert json.loads(path.read_text())["ok"] is True
    assert "AUDIT PASSED" in out and "result written to" in out


def test_json_alone_keeps_stdout_empty_when_the_audit_cannot_run(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--run", str(tmp_path), "--json"]) == 2  # no deployment file
    out, err = capsys.readouterr()
    assert out == "" and "cannot audit" in err
