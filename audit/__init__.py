"""Lineage audit: re-verify a run from the ledger and the store alone (``dilocox audit``).

    core       run_audit(store, ledger, registry, *, run_id, policy, rederive) -> AuditResult;
               the list of checks is in its docstring
    result     AuditResult (ok, failures, rounds, warnings, to_json), Failure, RoundRow
    rederive   a round's params and outer state recomputed from the stored updates
    admission  from an on-chain admission to the admission record and its evidence
    cli        ``dilocox audit --run DIR``: add_arguments, run, audit_run_dir, main
"""

from typing import Any

from .result import AuditResult, Failure, RoundRow

__all__ = ["AuditResult", "Failure", "RoundRow", "run_audit"]


def __getattr__(name: str) -> Any:
    # run_audit pulls in torch and web3; `dilocox --help` imports this package only for its options.
    if name == "run_audit":
        from .core import run_audit

        return run_audit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
