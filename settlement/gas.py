"""What the trust path costs on chain: gas used by each ledger write, measured on a fresh anvil.

``gas_table`` deploys the registry and the ledger on a throwaway in-memory anvil, admits 16
workers, creates a run and records consecutive rounds with 1, 2, 4, 8 and 16 correctly signed
reports (realistic, non-zero digests, losses and counts, since zero bytes are cheaper in calldata),
and reads ``gasUsed`` from each receipt. The numbers are what a coordinator pays per round and
show how the cost grows with the number of workers.

    python -m settlement.gas        # the same table as `dilocox bench gas`
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

from attestation.keys import WorkerKey
from attestation.report import RoundReport, SignedReport

from .anvil import DEV_ACCOUNTS, Anvil
from .artifacts import ledger_artifact, registry_artifact
from .chain import Chain
from .ledger import Ledger, Registry

__all__ = ["format_markdown", "gas_table", "main"]


def _digest(*parts: Any) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


def _deploy_gas(chain: Chain, abi: list[dict[str, Any]], bytecode: str, *args: Any) -> tuple[str, int]:
    receipt = chain.transact(chain.w3.eth.contract(abi=abi, bytecode=bytecode).constructor(*args))
    return receipt["contractAddress"], int(receipt["gasUsed"])


def _row(operation: str, gas: int, reports: int | None = None) -> dict[str, Any]:
    return {"operation": operation, "reports": reports, "gas_used": gas,
            "gas_per_report": gas // reports if reports else None}


def gas_table(report_counts: Sequence[int] = (1, 2, 4, 8, 16)) -> list[dict[str, Any]]:
    """Measure the gas of each ledger write on a fresh local chain.

    @param report_counts the number of signed reports in each recorded round (consecutive rounds
        1, 2, ...); workers are admitted for the largest
    @return rows ``{operation, reports, gas_used, gas_per_report}`` (reports and gas_per_report are
        None for writes without reports), in the order they were sent
    """
    if not report_counts or min(report_counts) < 1:
        raise ValueError("report_counts must be positive")
    rows: list[dict[str, Any]] = []
    with Anvil() as anvil:
        chain = Chain(anvil.rpc_url, DEV_ACCOUNTS[0])
        reg = registry_artifact()
        registry_address, gas = _deploy_gas(chain, reg.abi, reg.bytecode, chain.address)
        rows.append(_row("deploy WorkerRegistry", gas))
        led = ledger_artifact()
        ledger_address, gas = _deploy_gas(chain, led.abi, led.bytecode, registry_address)
        rows.append(_row("deploy ContributionLedger", gas))
        registry, ledger = Registry(chain, registry_address), Ledger(chain, ledger_address)

        measurement = _digest("code measurement")
        rows.append(_row("setMeasurement", int(registry.set_measurement(measurement)["gasUsed"])))
        rows.append(_row("setVerifier", int(registry.set_verifier(chain.address)["gasUsed"])))
        workers = [WorkerKey.generate() for _ in range(max(report_counts))]
        admit_gas = [int(registry.admit_worker(w.address, measurement, _digest("admission", w.address))["gasUsed"])
                     for w in workers]
        rows.append(_row("admitWorker", max(admit_gas)))

        run_id = _digest("genesis manifest", os.urandom(8))
        parent = _digest("checkpoint", 0)
        rows.append(_row("createRun", int(ledger.create_run(run_id, parent, _digest("config"), run_id)["gasUsed"])))

        domain = ledger.domain()
        for round_, count in enumerate(report_counts, start=1):
            checkpoint = _digest("checkpoint", round_)
            reports = []
            for i, key in enumerate(workers[:count]):
                report = RoundReport(
                    run_id=run_id, round=round_, worker=key.address, parent_checkpoint=parent, checkpoint=checkpoint,
                    update_digest=_digest("update", round_, i), data_digest=_digest("shard", i),
                    train_loss_e6=3_412_345 - 97_531 * round_ + 1_234 * i, eval_loss_e6=3_398_765 - 95_001 * round_,
                    tokens=2_048_000 + 512 * i, inner_steps=500, bytes_sent=24_117_248 + 4_096 * i,
                    bytes_received=25_165_824 + 2_048 * i,
                )
                reports.append(SignedReport(report, key.sign_digest(report.digest(domain))))
            receipt = ledger.record_round(run_id, round_, parent, checkpoint, _digest("manifest", round_), reports)
            rows.append(_row("recordRound", int(receipt["gasUsed"]), count))
            parent = checkpoint
        # a round no worker reported, recorded on the coordinator's word with one unreported update
        round_ = len(report_counts) + 1
        receipt = ledger.record_round(run_id, round_, parent, _digest("checkpoint", round_), _digest("manifest", round_),
                                      [], [_digest("update", round_, 0)])
        rows.append(_row("recordRound, 1 unreported update", int(receipt["gasUsed"])))
    return rows


def format_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table: operation | reports | gas used | gas per report."""
    lines = ["| operation | reports | gas used | gas per report |", "| --- | ---: | ---: | ---: |"]
    for row in rows:
        reports = "" if row.get("reports") is None else str(row["reports"])
        per = "" if row.get("gas_per_report") is None else f"{row['gas_per_report']:,}"
        lines.append(f"| {row['operation']} | {reports} | {row['gas_used']:,} | {per} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    print(format_markdown(gas_table()), end="")


if __name__ == "__main__":
    main()
