"""A run's panel of auditors on the command line: ``dilocox settle admit-auditor`` and ``settle dispute``.

``admit-auditor --auditor-dir ADIR [--threshold K]`` is the disputes contract owner's step (its key:
``--chain-key-file``; on the run's local anvil, the dev deployer account): it reads the persistent
auditor's public part (ADIR/auditor.json and evidence.bin, never its key: audit.auditor), checks it is
bound to this run directory's run and the run's config, verifies its evidence under the owner's policy
(``--allow-dev`` trusts DIR/dev-root, as the audit does) and admits it as ``audit.auditor.admit`` does;
with ``--threshold K`` it then sets the run's k (``Disputes.setThreshold``).

``dispute --verdicts F1 F2 …`` sends the disputes k auditors' verdict files support
(audit.verdict_file.gather: each dropped file or unsent verdict said in one line); any key may send
them. Each outcome is printed, a refusal by the contract's error name.

Exit status: 0 when everything asked went through; 1 when the contract refused, or a verdict was not
sent; 2 when it could not run (bad auditor directory or verdicts file, no disputes contract).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from settlement import Deployment, Ledger
    from settlement.disputes import Disputes
    from storage_client import Store

EXIT_OK, EXIT_FAILED, EXIT_ERROR = 0, 1, 2


@dataclass(frozen=True)
class PanelAction:
    """What ``settle admit-auditor`` / ``settle dispute`` was asked to do."""

    action: str  # "admit-auditor" or "dispute"
    auditor_dir: Path | None = None
    threshold: int | None = None
    verdicts: tuple[Path, ...] = ()
    allow_dev: bool = False

    def run_on(self, rpc_url: str, run_dir: Path, deployment: Deployment, key: str, console: Console) -> int:
        """Do it on ``rpc_url`` with the chain key ``key``; returns the exit status (module docstring)."""
        from rich.markup import escape

        from settlement import Chain, Ledger
        from settlement.disputes import Disputes
        from settlement.provision import run_of
        from storage_client import open_store

        chain = Chain(rpc_url, key)
        ledger = Ledger(chain, deployment.ledger, from_block=deployment.deployed_block)
        store = open_store(run_dir)
        run_id, address = run_of(store, ledger), ledger.disputes_address()
        if run_id is None or address is None:
            console.print("[bold red]cannot act[/]: no run on the ledger has its genesis in this store, or the ledger "
                          "has no disputes contract")
            return EXIT_ERROR
        disputes = Disputes(chain, address, from_block=deployment.deployed_block)
        try:
            if self.action == "admit-auditor":
                return self._admit(disputes, ledger, store, run_dir, run_id, console)
            return self._dispute(disputes, ledger, run_id, console)
        except ValueError as exc:  # AuditorDirError, VerdictFileError, PolicyViolation, key errors
            console.print(f"[bold red]cannot {self.action}[/]: {escape(str(exc)[:400])}")
            return EXIT_ERROR

    def _admit(self, disputes: Disputes, ledger: Ledger, store: Store, run_dir: Path, run_id: bytes,
               console: Console) -> int:
        """Verify and admit the auditor of ``auditor_dir`` to ``run_id``, then set k if asked."""
        from rich.markup import escape

        from attestation import AttestationError, PolicyViolation
        from audit.auditor import AuditorCredentials, admit
        from audit.cli import policy_for
        from settlement import TxReverted
        from storage_client import CID, Codec

        assert self.auditor_dir is not None
        auditor = AuditorCredentials.load(self.auditor_dir)
        config_cid = str(CID(Codec.JSON, ledger.run_of(run_id).config_digest))
        if auditor.run_id != run_id or auditor.config_cid != config_cid:
            raise ValueError(f"{self.auditor_dir} holds the auditor of run 0x{auditor.run_id.hex()[:12]}… (config "
                             f"{auditor.config_cid}), not of this run 0x{run_id.hex()[:12]}… ({config_cid})")
        policy, notes = policy_for(run_dir, self.allow_dev)
        for note in notes:
            console.print(f"[yellow]{escape(note)}[/]")
        try:
            record = admit(disputes, store, auditor, config_cid, policy)
            console.print(f"auditor {auditor.address} admitted to run 0x{run_id.hex()[:12]}… (admission record "
                          f"{record})")
            if self.threshold is not None:
                disputes.set_threshold(run_id, self.threshold)
        except (AttestationError, PolicyViolation) as exc:
            console.print(f"[bold red]refused[/]: the auditor's evidence does not verify: {escape(str(exc)[:300])}")
            return EXIT_FAILED
        except TxReverted as exc:
            console.print(f"[bold red]refused[/]: {escape(str(exc)[:300])}")
            return EXIT_FAILED
        auditors, k = disputes.panel_of(run_id)
        console.print(f"the run's panel: {auditors} admitted auditor(s), a verdict needs {k}")
        return EXIT_OK

    def _dispute(self, disputes: Disputes, ledger: Ledger, run_id: bytes, console: Console) -> int:
        """Send what the ``verdicts`` files support (audit.verdict_file.gather), each outcome printed."""
        from rich.markup import escape

        from audit.disputes import labeller, submit
        from audit.verdict_file import gather, read_verdicts

        files = [read_verdicts(path) for path in self.verdicts]
        _, threshold = disputes.panel_of(run_id)
        found, lines = gather(files, disputes.domain(), run_id, threshold,
                              lambda address: disputes.is_auditor(run_id, address))
        for line in lines:
            console.print(f"[yellow]{escape(line)}[/]")
        signatures = {d.verdict: list(d.signatures) for d in found}
        rows = submit(disputes, [d.verdict for d in found], ledger.recorded_rounds(run_id), signatures.__getitem__,
                      labeller(ledger.tenures(run_id, ledger.run_of(run_id)), None))
        for row, dispute in zip(rows, found):
            v = row.verdict
            said = f"round {v.round}, {row.party_id} ({v.party}), check {v.check_name}, signed by " \
                   f"{', '.join(dispute.signers)}"
            mark = "[bold green]upheld[/]" if row.outcome == "upheld" else f"[bold red]{escape(row.outcome)}[/]"
            console.print(f"{mark}: {escape(said)}")
        upheld = sum(row.outcome == "upheld" for row in rows)
        return EXIT_OK if upheld == len(rows) and not any("not sent" in line for line in lines) else EXIT_FAILED
