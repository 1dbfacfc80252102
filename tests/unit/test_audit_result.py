"""audit.result and the CLI's rendering and policy: the shape of what an audit reports."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

from rich.console import Console

from attestation import DevRoot, Policy
from audit import AuditResult, Failure, RoundRow
from audit.cli import add_arguments, policy_for, render


def sample(failures: list[Failure]) -> AuditResult:
    result = AuditResult(run_id=bytes(range(32)), rederived=True)
    result.rounds = [RoundRow(0, "bagaaieragenesis", "0x" + "00" * 32, 0, 0, 5.5),
                     RoundRow(1, "bagaaierarround1", "0x" + "11" * 32, 2, 2, 5.25)]
    result.failures = failures
    for row in result.rounds:
        row.status = "FAIL" if result.failures_of(row.round) else "ok"
    return result


def test_json_shape() -> None:
    ok = sample([])
    doc = json.loads(json.dumps(ok.to_json()))
    assert doc["ok"] is True and doc["failures"] == [] and doc["warnings"] == []
    assert doc["run_id"] == "0x" + bytes(range(32)).hex()
    assert doc["rounds"][1] == {"round": 1, "manifest": "bagaaierarround1", "checkpoint": "0x" + "11" * 32,
                                "participants": 2, "reports": 2, "eval_loss": 5.25, "status": "ok",
                                "unreported": 0}

    bad = sample([Failure(1, "bafkreiupdate", "object", "the update of participant w1 is missing from the store")])
    doc = bad.to_json()
    assert doc["ok"] is False
    assert doc["failures"] == [{"round": 1, "object": "bafkreiupdate", "check": "object",
                                "message": "the update of participant w1 is missing from the store"}]
    assert [r["status"] for r in doc["rounds"]] == ["ok", "FAIL"]
    assert str(bad.failures[0]).startswith("round 1: object [bafkreiupdate]")
    assert str(Failure(None, "0xabc", "tally", "off by one")) == "run: tally [0xabc]: off by one"


def render_text(result: AuditResult) -> str:
    out = io.StringIO()
    render(result, Console(file=out, width=160, color_system=None))
    return out.getvalue()


def test_render_table_and_verdict() -> None:
    text = render_text(sample([]))
    assert "…aierarround1" in text and "5.2500" in text and "AUDIT PASSED" in text
    text = render_text(sample([Failure(1, "bafkreiupdate", "object", "missing")]))
    assert "FAIL" in text and "AUDIT FAILED: 1 check(s) failed" in text and "bafkreiupdate" in text


def test_arguments() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--run", "runs/demo", "--rpc", "http://127.0.0.1:8545", "--json", "out.json",
                              "--allow-dev", "--no-rederive"])
    assert (args.run, args.rpc, args.json, args.allow_dev, args.no_rederive) == (
        "runs/demo", "http://127.0.0.1:8545", "out.json", True, True)


def test_policy_trusts_the_runs_dev_root_only_with_allow_dev(tmp_path: Path) -> None:
    root = DevRoot.load_or_create(tmp_path / "dev-root")
    assert policy_for(tmp_path, allow_dev=False) == (Policy(), [])
    policy, notes = policy_for(tmp_path, allow_dev=True)
    assert policy.allow_dev and policy.dev_roots == frozenset({root.address}) and notes == []
    policy, notes = policy_for(tmp_path / "elsewhere", allow_dev=True)
    assert policy.allow_dev and not policy.dev_roots and "does not exist" in notes[0]
