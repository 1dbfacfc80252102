"""What the trust path costs on chain: gas used by each ledger and reward write, on a fresh anvil.

``gas_table`` deploys the registry, the ledger, a reward token and the reward pool on a throwaway
in-memory anvil, admits 16 workers, creates a run, records one round in which all 16 report for the
first time in the run (each first credit opens the worker's tally slot and lists the run under
it), then consecutive rounds with 1, 2, 4, 8 and 16 correctly signed reports of workers already
credited in the run (the steady state), a round recorded with one unreported update only, and
opens the run's reward pool and claims one and eight rounds; then, on a second run with a
challenge window, a round of four workers disputed: an auditor admitted, a verdict against a worker
upheld 1 of 1 and one 2 of 3, one against the coordinator (voiding the round's other credits), and
the funder's reclaim of that round. Digests, losses and counts are
realistic and non-zero, since zero bytes are cheaper in calldata. ``gasUsed`` comes from each
receipt: what a coordinator pays per round, and how the cost grows with the number of workers.

    python -m settlement.gas        # the same table as `dilocox bench gas`
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

from attestation.keys import WorkerKey
from attestation.receipt import Receipt, sign_receipt
from attestation.report import RoundReport, SignedReport
from attestation.verdict import Verdict

from .anvil import DEV_ACCOUNTS, Anvil
from .artifacts import ledger_artifact, load_artifact, registry_artifact
from .chain import Chain
from .disputes import Disputes
from .ledger import Ledger, Registry
from .receipt_court import Omission, ReceiptCourt
from storage_client import bytes32
from .rewards import RewardPool, RewardToken

__all__ = ["format_markdown", "gas_table", "main"]

TOKENS = 2_048_000  # tokens the run's config credits each report


def _digest(*parts: Any) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


def _row(operation: str, gas: int, reports: int | None = None) -> dict[str, Any]:
    return {"operation": operation, "reports": reports, "gas_used": gas,
            "gas_per_report": gas // reports if reports else None}


def _reports(workers: Sequence[WorkerKey], run_id: bytes, round_: int, parent: bytes, checkpoint: bytes,
             manifest: bytes, domain: Any) -> list[SignedReport]:
    out = []
    for i, key in enumerate(workers):
        report = RoundReport(
            run_id=run_id, round=round_, worker=key.address, parent_checkpoint=parent, checkpoint=checkpoint,
            manifest_digest=manifest, update_digest=_digest("update", round_, i), data_digest=_digest("shard", i),
            train_loss_e6=3_412_345 - 97_531 * round_ + 1_234 * i, eval_loss_e6=3_398_765 - 95_001 * round_,
            tokens=TOKENS, inner_steps=500, bytes_sent=24_117_248 + 4_096 * i, bytes_received=25_165_824 + 2_048 * i,
        )
        out.append(SignedReport(report, key.sign_digest(report.digest(domain))))
    return out


def gas_table(report_counts: Sequence[int] = (1, 2, 4, 8, 16)) -> list[dict[str, Any]]:
    """Measure the gas of each ledger and reward write on a fresh local chain.

    @param report_counts the number of signed reports in each steady-state round (consecutive rounds
        after the first, in which every worker reports); workers are admitted for the largest
    @return rows ``{operation, reports, gas_used, gas_per_report}`` (reports and gas_per_report are
        None for writes without reports), in the order they were sent
    """
    if not report_counts or min(report_counts) < 1:
        raise ValueError("report_counts must be positive")
    rows: list[dict[str, Any]] = []
    with Anvil() as anvil:
        chain = Chain(anvil.rpc_url, DEV_ACCOUNTS[0])
        reg = registry_artifact()
        registry_address, _, gas = chain.deploy(reg.abi, reg.bytecode, chain.address)
        rows.append(_row("deploy WorkerRegistry", gas))
        led = ledger_artifact()
        ledger_address, _, gas = chain.deploy(led.abi, led.bytecode, registry_address)
        rows.append(_row("deploy ContributionLedger", gas))
        tok = load_artifact("RewardToken")
        token_address, _, gas = chain.deploy(tok.abi, tok.bytecode, chain.address)
        rows.append(_row("deploy RewardToken", gas))
        rew = load_artifact("RewardPool")
        pool_address, _, gas = chain.deploy(rew.abi, rew.bytecode, ledger_address, token_address)
        rows.append(_row("deploy RewardPool", gas))
        registry, ledger = Registry(chain, registry_address), Ledger(chain, ledger_address)
        token, pool = RewardToken(chain, token_address), RewardPool(chain, pool_address, ledger)

        measurement = _digest("code measurement")
        rows.append(_row("setMeasurement", int(registry.set_measurement(measurement)["gasUsed"])))
        rows.append(_row("setVerifier", int(registry.set_verifier(chain.address)["gasUsed"])))
        workers = [WorkerKey.generate() for _ in range(max(report_counts))]
        admit_gas = [int(registry.admit_worker(w.address, measurement, _digest("admission", w.address))["gasUsed"])
                     for w in workers]
        rows.append(_row("admitWorker", max(admit_gas)))

        run_id = _digest("genesis manifest", os.urandom(8))
        parent = _digest("checkpoint", 0)
        rows.append(_row("createRun", int(ledger.create_run(run_id, parent, _digest("config"), run_id, 0)["gasUsed"])))

        domain = ledger.domain()
        blocks: dict[int, int] = {}
        for round_, count in enumerate((len(workers), *report_counts), start=1):
            checkpoint, manifest = _digest("checkpoint", round_), _digest("manifest", round_)
            reports = _reports(workers[:count], run_id, round_, parent, checkpoint, manifest, domain)
            receipt = ledger.record_round(run_id, round_, parent, checkpoint, manifest, reports)
            what = "recordRound, every worker's first round in the run" if round_ == 1 else "recordRound"
            rows.append(_row(what, int(receipt["gasUsed"]), count))
            blocks[round_] = int(receipt["blockNumber"])
            parent = checkpoint
        # a round no worker reported, recorded on the coordinator's word with one unreported update
        round_ = len(report_counts) + 2
        receipt = ledger.record_round(run_id, round_, parent, _digest("checkpoint", round_), _digest("manifest", round_),
                                      [], [_digest("update", round_, 0)])
        rows.append(_row("recordRound, 1 unreported update", int(receipt["gasUsed"])))
        rows.append(_receipt_proof(chain, ledger, run_id, round_, workers[0]))

        funded = 10**24
        token.mint(chain.address, funded)
        token.approve(pool_address, funded)
        rows.append(_row("openPool", int(pool.open_pool(run_id, funded, round_)["gasUsed"])))
        first = workers[0].address  # reported in every round
        rows.append(_row("claim, 1 round", int(_claim(pool, run_id, first, rounds=1)["gasUsed"])))
        rows.append(_row("claim, 8 rounds", int(_claim(pool, run_id, first, rounds=8)["gasUsed"])))
        rows.extend(_dispute_rows(ledger, pool, workers[:4]))
    return rows


def _dispute_rows(ledger: Ledger, pool: RewardPool, workers: Sequence[WorkerKey]) -> list[dict[str, Any]]:
    """A second run (window 1,000 blocks, its own pool) whose one round of ``workers`` is disputed: an
    auditor's admission, verdicts 1 of 1 and 2 of 3 against workers, one against the coordinator, and
    the funder's reclaim past the window. The ledger's sender is the disputes contract's owner."""
    chain = ledger.chain
    run_id, genesis = _digest("second run", os.urandom(8)), _digest("checkpoint", 0)
    ledger.create_run(run_id, genesis, _digest("config"), run_id, 1_000)
    checkpoint, manifest = _digest("checkpoint", 1), _digest("manifest", 1)
    ledger.record_round(run_id, 1, genesis, checkpoint, manifest,
                        _reports(workers, run_id, 1, genesis, checkpoint, manifest, ledger.domain()))
    RewardToken(chain, pool.token_address()).mint(chain.address, 10**24)
    RewardToken(chain, pool.token_address()).approve(pool.address, 10**24)
    pool.open_pool(run_id, 10**24, 1)
    (record,) = ledger.recorded_rounds(run_id)
    disputes = Disputes(chain, str(ledger.disputes_address()))
    auditors = [WorkerKey.generate() for _ in range(3)]
    rows = [_row("admitAuditor", int(disputes.admit_auditor(run_id, auditors[0].address, _digest("audit code"),
                                                            _digest("auditor evidence"))["gasUsed"]))]
    disputes.set_threshold(run_id, 1)

    def upheld(party: str, signers: Sequence[WorkerKey]) -> int:
        verdict = Verdict(run_id, 1, party, "replay", _digest("update", 1, party))
        signatures = [key.sign_digest(verdict.digest(disputes.domain())) for key in signers]
        return int(disputes.dispute(verdict, record, signatures)["gasUsed"])

    rows.append(_row("dispute, 1 of 1, against a worker", upheld(record.workers[0], auditors[:1])))
    for key in auditors[1:]:
        disputes.admit_auditor(run_id, key.address, _digest("audit code"), _digest("auditor evidence", key.address))
    disputes.set_threshold(run_id, 2)
    rows.append(_row("dispute, 2 of 3, against a worker", upheld(record.workers[1], auditors[:2])))
    rows.append(_row("dispute, 2 of 3, against the coordinator (voids 2 more credits)",
                     upheld(chain.address, auditors[1:])))
    chain.read(lambda: chain.w3.provider.make_request("anvil_mine", [hex(1_000)]), "anvil_mine")
    receipt = chain.transact(pool._contract.functions.reclaim(bytes32(run_id, "run_id"), [(1, record.facts())]))
    rows.append(_row("reclaim, 1 round", int(receipt["gasUsed"])))
    return rows


def _receipt_proof(chain: Chain, ledger: Ledger, run_id: bytes, round_: int, worker: WorkerKey) -> dict[str, Any]:
    """Deploy a ReceiptCourt and prove, with the coordinator's report receipt, that ``round_`` (recorded
    with its one update unreported) left ``worker`` uncredited: what a wronged worker pays."""
    art = load_artifact("ReceiptCourt")
    court = ReceiptCourt(chain, chain.deploy(art.abi, art.bytecode, ledger.address)[0])
    receipt = Receipt(run_id, round_, worker.address, _digest("update", round_, 0), _digest("report", round_, 0))
    signed = sign_receipt(WorkerKey(bytes.fromhex(DEV_ACCOUNTS[0][2:])), ledger.domain(), receipt)
    record = ledger.recorded_round_events(run_id)[-1]
    return _row("proveOmission (a receipted worker left uncredited)",
                int(court.prove(Omission(signed, record))["gasUsed"]))


def _claim(pool: RewardPool, run_id: bytes, worker: str, rounds: int) -> Any:
    """Claim the first ``rounds`` unpaid rounds of ``worker`` in one call."""
    paid = {p.round for p in pool.payments(run_id, worker)}
    claims = []
    for event in pool.ledger.recorded_round_events(run_id):
        if worker in event.workers and event.round not in paid and len(claims) < rounds:
            claims.append((event.round, event.workers.index(worker), event.facts()))
    return pool.chain.transact(pool._contract.functions.claim(bytes32(run_id, "run_id"), worker, claims))


def format_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table: operation | reports | gas used | gas per report | gas per further
    report (a steady-state round's cost over the 1-report round's, per added report: what one more
    worker costs the coordinator each round)."""
    lines = ["| operation | reports | gas used | gas per report | gas per further report |",
             "| --- | ---: | ---: | ---: | ---: |"]
    single = next((r["gas_used"] for r in rows if r["operation"] == "recordRound" and r.get("reports") == 1), None)
    for row in rows:
        reports = "" if row.get("reports") is None else str(row["reports"])
        per = "" if row.get("gas_per_report") is None else f"{row['gas_per_report']:,}"
        further = ""
        if row["operation"] == "recordRound" and single is not None and (row.get("reports") or 0) > 1:
            further = f"{(row['gas_used'] - single) // (row['reports'] - 1):,}"
        lines.append(f"| {row['operation']} | {reports} | {row['gas_used']:,} | {per} | {further} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    print(format_markdown(gas_table()), end="")


if __name__ == "__main__":
    main()
