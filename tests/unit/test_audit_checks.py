"""Audit checks are one enum (audit.checks.AuditCheck) with a one-line description each, and a
failure names its check exactly as the bare strings did (printed text and ``--json`` unchanged)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from audit import AuditCheck, Failure

REPO = Path(__file__).resolve().parents[2]
# The names the audit's failures carried as bare strings before the enum.
NAMES = {
    "run", "registry", "run-id", "object", "update-record", "manifest", "genesis", "genesis-checkpoint", "config",
    "rounds", "ledger", "manifest-round", "parent", "inner-steps", "checkpoint", "parent-checkpoint", "rederive",
    "report-count", "report-signature", "report-binding", "report-participant", "report-duplicate",
    "report-fields", "report-eval-loss", "data-digest", "admitted", "revoked", "measurement-allowed", "admission",
    "admission-record", "evidence", "unreported", "ghost", "tally", "total-contribution", "payout", "recorder",
    "unrecorded", "replay", "rescore",
    "receipt-fault", "receipt-withheld",  # added with the coordinator's receipts (audit.receipts)
    "push-signature",  # added with audit.push_signatures (issue 28)
    "auditor-evidence",  # added with k-of-n verdicts: audit.disputes.unverified_auditors (issue 28)
    "replay-horizon",  # added with the replay horizon run rule (issue 28)
    "reveal",  # added with states revealed on challenge (audit.reveal)
}


def test_every_check_has_its_old_name_and_a_one_line_description() -> None:
    assert {check.value for check in AuditCheck} == NAMES
    for check in AuditCheck:
        assert check.description and "\n" not in check.description and len(check.description) <= 200, check
        assert check.name == check.value.upper().replace("-", "_")


def test_a_failure_prints_and_serialises_its_check_by_name() -> None:
    failure = Failure(3, "bafkreiupdate", AuditCheck.REPORT_EVAL_LOSS, "off by one")
    assert str(failure) == "round 3: report-eval-loss [bafkreiupdate]: off by one"
    assert json.loads(json.dumps(failure.to_json()))["check"] == "report-eval-loss"
    assert failure == Failure(3, "bafkreiupdate", "report-eval-loss", "off by one")  # type: ignore[arg-type]


def test_the_audit_fails_with_enum_members_only() -> None:
    """No bare string where a check is named: every ``fail(...)`` call in audit/ passes an AuditCheck
    (or a check read from an AdmissionCheck's failures, which hold members)."""
    bare = []
    for path in sorted((REPO / "audit").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "fail":
                strings = [a for a in node.args if isinstance(a, ast.Constant) and a.value in NAMES]
                checks = [a for a in node.args if isinstance(a, ast.Attribute) and getattr(a.value, "id", "") ==
                          "AuditCheck"]
                if strings and not checks:
                    bare.append(f"{path.name}:{node.lineno}")
    assert not bare, bare
