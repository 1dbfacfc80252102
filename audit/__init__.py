"""Lineage audit: re-verify a run from the ledger and the store alone (``dilocox audit``).

    core       run_audit(store, ledger, registry, *, run_id, policy, rederive) -> AuditResult
    checks     AuditCheck: every check by name, what it checks, and which module makes it
    result     AuditResult (ok, failures, rounds, warnings, to_json), Failure, RoundRow
    findings   the failures and warnings being collected, and the store read through them
    lineage    genesis, manifests, parent links and checkpoints; what the store holds past the ledger
    tallies    the ledger's records of the rounds, its tallies and totals, and the reward pool's payouts
    reports    the signed reports against the chain's record and the manifest; every participant answered for
    push_signatures  every participant's update pushed by an admitted key (reported or not)
    signers    each report's signer as the registry saw it at the recording block
    recompute  the checks that recompute the work: rederive, replay and rescore
    rederive   a round's params and outer state recomputed from the stored updates
    replay     sampled contributions re-run, and their rounds re-scored
    admission  from an on-chain admission to the admission record and its evidence
    cli        ``dilocox audit --run DIR``: add_arguments, run, audit_run_dir, main
"""

from typing import Any

from .checks import AuditCheck
from .result import AuditResult, Failure, RoundRow

__all__ = ["AuditCheck", "AuditResult", "Failure", "RoundRow", "run_audit"]


def __getattr__(name: str) -> Any:
    # run_audit pulls in torch and web3; `dilocox --help` imports this package only for its options.
    if name == "run_audit":
        from .core import run_audit

        return run_audit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
