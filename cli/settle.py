"""``dilocox settle --run DIR``: what each worker of a run is owed from its reward pool, and claims.

Reads ``DIR/chain/deployment.json`` and the run's genesis from ``DIR/store`` (to know which run on
the ledger is this directory's). Without ``--rpc`` it starts the local anvil from
``DIR/chain/state.json`` itself (not a copy: claims are kept). The table comes from the ledger's
and the pool's events alone (settlement.rewards.RewardPool.statement): per worker the rounds it was
credited in, what they earn it, what it was paid, what it can claim now (rounds past the run's
challenge window) and what is still inside the window. Each worker is named by its id beside its
address (settlement.roster: the binding its signed reports and the store's manifests give), and
every update a round counted without its worker's report is said loudly, with the worker's id: it
earns that worker nothing. ``--claim`` claims every worker's matured rounds; any account may send a
claim, the tokens always go to the worker.

``dilocox settle prove-receipt --run DIR --receipts RDIR`` is a worker's recourse against its
coordinator (docs/trust.md, "Receipts"): of the receipts kept in RDIR (``dilocox worker --receipts``,
trainer.worker.receipts), every report receipt of a round the ledger recorded without crediting its
worker is proven on chain (``ReceiptCourt.proveOmission``, settlement.receipt_court); no auditor is
needed, and the audit then fails the coordinator for that round by name. Receipts that prove nothing
(the worker is credited, the round not recorded yet, not the run's coordinator's) are listed.

``dilocox settle admit-auditor --run DIR --auditor-dir ADIR [--threshold K]`` (the disputes
contract's owner) and ``dilocox settle dispute --run DIR --verdicts F1 F2 …`` (anyone) manage the run's
panel of auditors and send the verdicts k of them signed (cli.panel, docs/trust.md "Disputes").

Exit status: 0 when the statement (and any claim) went through, or every omission found was proven
(or was already); 1 when the pool paid more than the records entitle, or a proof was refused; 2 when
it could not run (no deployment, no chain, no pool).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from settlement import Ledger
    from settlement.rewards import Statement
    from settlement.roster import Roster

    from .panel import PanelAction

EXIT_OK, EXIT_FAILED, EXIT_ERROR = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=("statement", "prove-receipt", "admit-auditor", "dispute"),
                        default="statement",
                        help="statement (default): what each worker is owed; prove-receipt: prove on chain each "
                             "round that left a worker of --receipts uncredited though the coordinator receipted it; "
                             "admit-auditor: admit the auditor of --auditor-dir (the disputes owner's key); dispute: "
                             "send the verdicts the --verdicts files of k admitted auditors sign")
    parser.add_argument("--run", required=True, metavar="DIR", help="run directory (its store/ and chain/)")
    parser.add_argument("--receipts", metavar="RDIR",
                        help="prove-receipt: a worker's receipts folder (dilocox worker --receipts)")
    parser.add_argument("--auditor-dir", metavar="ADIR",
                        help="admit-auditor: the persistent auditor's directory (dilocox audit --auditor-dir)")
    parser.add_argument("--threshold", type=int, metavar="K",
                        help="admit-auditor: then set how many admitted auditors a verdict on the run needs")
    parser.add_argument("--allow-dev", action="store_true",
                        help="admit-auditor: accept dev evidence, which PROVES NOTHING (trusting DIR/dev-root)")
    parser.add_argument("--verdicts", nargs="+", metavar="FILE",
                        help="dispute: verdicts files (dilocox audit --dispute --sign-only --verdicts-out)")
    parser.add_argument("--rpc", metavar="URL", help="chain RPC; default: the local anvil of DIR/chain/state.json")
    parser.add_argument("--claim", action="store_true", help="claim every worker's matured rounds")
    parser.add_argument("--reclaim", action="store_true",
                        help="return to the pool's funder what its matured rounds leave unpaid (rounds credited to "
                             "nobody, voided credit, rounding); sent with the funder's key (--chain-key-file; on the "
                             "local anvil: the dev account that funded it)")
    parser.add_argument("--chain-key-file", metavar="FILE",
                        help="file with the key (hex) that sends claims; default on the local anvil: a dev account")
    parser.add_argument("--json", metavar="FILE", help="also write the statement as JSON to FILE")


def run(args: argparse.Namespace) -> int:
    from settlement.provision import read_key_file

    key = None
    if args.chain_key_file:
        key = "0x" + read_key_file(Path(args.chain_key_file), "--chain-key-file").hex()
    panel = None
    if args.action in ("admit-auditor", "dispute"):
        from .panel import PanelAction

        panel = PanelAction(args.action, Path(args.auditor_dir) if args.auditor_dir else None, args.threshold,
                            tuple(Path(f) for f in args.verdicts or ()), args.allow_dev)
    return settle_run_dir(Path(args.run), rpc_url=args.rpc, claim=args.claim, reclaim=args.reclaim, key=key,
                          json_path=Path(args.json) if args.json else None,
                          receipts=Path(args.receipts) if args.receipts else None, panel=panel)


def settle_run_dir(run_dir: Path, *, rpc_url: str | None = None, claim: bool = False, key: str | None = None,
                   console: Console | None = None, json_path: Path | None = None, receipts: Path | None = None,
                   reclaim: bool = False, panel: PanelAction | None = None) -> int:
    """Print the run's reward statement and, with ``claim``, claim what is due (with ``reclaim``, return
    to the funder what matured rounds leave unpaid); with ``receipts``, prove the omissions they show
    instead; with ``panel``, admit an auditor or send k auditors' verdicts instead (cli.panel). Returns
    the exit status."""
    from rich.console import Console
    from rich.markup import escape

    from settlement import DEV_ACCOUNTS, Anvil, AnvilError, ChainError, Deployment, DeploymentError

    console = console or Console()
    try:
        deployment = Deployment.load(run_dir / "chain" / "deployment.json")
    except DeploymentError as exc:
        console.print(f"[bold red]cannot settle[/]: {escape(str(exc))}")
        return EXIT_ERROR
    try:
        if rpc_url is not None:
            if (claim or reclaim) and key is None:
                console.print(f"[bold red]cannot settle[/]: --{'claim' if claim else 'reclaim'} on --rpc needs "
                              f"--chain-key-file")
                return EXIT_ERROR
            if receipts is not None:
                return _prove_on(rpc_url, deployment, receipts, key or DEV_ACCOUNTS[3], console)
            if panel is not None:
                if key is None and panel.action == "admit-auditor":
                    console.print("[bold red]cannot settle[/]: admit-auditor on --rpc needs --chain-key-file (the "
                                  "disputes contract owner's key)")
                    return EXIT_ERROR
                return panel.run_on(rpc_url, run_dir, deployment, key or DEV_ACCOUNTS[3], console)
            return _settle_on(rpc_url, run_dir, deployment, (claim, reclaim), key or DEV_ACCOUNTS[3], console, json_path,
                              dev_keys=False)
        state = run_dir / "chain" / "state.json"
        if not state.is_file():
            console.print(f"[bold red]cannot settle[/]: no --rpc given and no chain state at {state}")
            return EXIT_ERROR
        from cli.chain import running_chain

        if (up := running_chain(run_dir / "chain")) is not None:  # a second anvil would dump into its state file
            console.print(f"[bold red]cannot settle[/]: the chain of {run_dir / 'chain'} is up at {escape(up)} "
                          f"(dilocox chain up): give --rpc {escape(up)}")
            return EXIT_ERROR
        with Anvil(state_file=state, chain_id=deployment.chain_id) as anvil:
            console.print(f"local chain {anvil.rpc_url} restored from {state}")
            if receipts is not None:
                return _prove_on(anvil.rpc_url, deployment, receipts, key or DEV_ACCOUNTS[3], console)
            if panel is not None:  # the dev deployer owns the disputes contract of a local run
                default = DEV_ACCOUNTS[0] if panel.action == "admit-auditor" else DEV_ACCOUNTS[3]
                return panel.run_on(anvil.rpc_url, run_dir, deployment, key or default, console)
            return _settle_on(anvil.rpc_url, run_dir, deployment, (claim, reclaim), key or DEV_ACCOUNTS[3], console,
                              json_path, dev_keys=key is None)
    except (ChainError, AnvilError) as exc:
        console.print(f"[bold red]cannot settle[/]: {escape(str(exc))}")
        return EXIT_ERROR


def _settle_on(rpc_url: str, run_dir: Path, deployment, sends: tuple[bool, bool], key: str, console: Console,
               json_path: Path | None, dev_keys: bool) -> int:
    """The statement on ``rpc_url``, after the claims and the reclaim ``sends`` asks for. ``dev_keys``:
    the local anvil without a key file, where the reclaim is sent with the dev account that funded."""
    from settlement import DEV_ACCOUNTS, Chain, Ledger
    from settlement.provision import format_tokens, run_of
    from settlement.rewards import RewardPool
    from settlement.roster import roster_of
    from storage_client import open_store, strict_json, write_atomic

    chain = Chain(rpc_url, key)
    ledger = Ledger(chain, deployment.ledger, from_block=deployment.deployed_block)
    pool = RewardPool(chain, deployment.rewards, ledger, from_block=deployment.deployed_block)
    store = open_store(run_dir)
    run_id = run_of(store, ledger)
    if run_id is None:
        console.print("[bold red]cannot settle[/]: no run on the ledger has its genesis manifest in this store")
        return EXIT_ERROR
    statement = pool.statement(run_id)
    if statement is None:
        console.print(f"[bold red]cannot settle[/]: run 0x{run_id.hex()[:12]}… has no reward pool")
        return EXIT_ERROR
    roster = roster_of(store, ledger.recorded_rounds(run_id))
    voided_why = _voided_why(ledger, run_id)
    claim, reclaim = sends
    if reclaim:
        funder = pool.pool_of(run_id).funder
        senders = (Chain(rpc_url, k) for k in ([key, *DEV_ACCOUNTS] if dev_keys else [key]))
        sender = next((c for c in senders if c.address == funder), None)
        if sender is None:
            console.print(f"[bold red]cannot reclaim[/]: only the pool's funder {funder} can, and the key given "
                          f"is {chain.address}'s")
            return EXIT_ERROR
        amount, _ = RewardPool(sender, deployment.rewards, ledger, from_block=deployment.deployed_block).reclaim(run_id)
        console.print(f"reclaimed {format_tokens(amount)} for the funder {funder}" if amount else
                      "nothing to reclaim: no matured round leaves anything unpaid that was not returned")
        statement = pool.statement(run_id)
        assert statement is not None
    if claim:
        for worker, account in sorted(statement.workers.items()):
            if account.claimable > 0:
                amount, _ = pool.claim(run_id, worker)
                console.print(f"claimed {format_tokens(amount)} for {roster.label(worker)}")
        statement = pool.statement(run_id)
        assert statement is not None
    render_statement(statement, console, roster, voided_why)
    if json_path is not None:
        document = {**statement.to_json(), "roster": roster.to_json()}
        write_atomic(json_path, (strict_json(document, indent=2) + "\n").encode())
    overpaid = [w for w, a in statement.workers.items() if a.overpaid] or statement.paid > statement.funded
    return EXIT_FAILED if overpaid else EXIT_OK


def _prove_on(rpc_url: str, deployment, receipts: Path, key: str, console: Console) -> int:
    """Prove on chain every omission the receipts in ``receipts`` show (one run folder each)."""
    from rich.markup import escape

    from settlement import Chain, Ledger, TxReverted
    from settlement.receipt_court import ReceiptCourt, omissions
    from trainer.worker.receipts import ReceiptBook

    if deployment.receipt_court is None:
        console.print("[bold red]cannot prove[/]: this deployment has no receipt court (deployed before it existed)")
        return EXIT_ERROR
    chain = Chain(rpc_url, key)
    ledger = Ledger(chain, deployment.ledger, from_block=deployment.deployed_block)
    court = ReceiptCourt(chain, deployment.receipt_court, from_block=deployment.deployed_block)
    book, status = ReceiptBook(receipts), EXIT_OK
    if not book.runs():
        console.print(f"[bold red]cannot prove[/]: no receipts in {escape(str(receipts))}")
        return EXIT_ERROR
    for run_id in book.runs():
        run_hex = run_id.hex()
        kept, problems = book.receipts(run_id)
        found, skipped = omissions(ledger, run_id, kept)
        for line in problems + skipped:
            console.print(f"[yellow]no proof[/]: run 0x{run_hex[:12]}…: {escape(line)}")
        for omission in found:
            r, worker = omission.signed.receipt.round, omission.signed.receipt.worker
            if court.is_proven(run_id, r, worker):
                console.print(f"run 0x{run_hex[:12]}… round {r}: the omission of {worker} is already proven")
                continue
            try:
                court.prove(omission)
                console.print(f"[bold]proven[/]: run 0x{run_hex[:12]}… round {r} was recorded without {worker}, "
                              f"whose update and report its coordinator receipted")
            except TxReverted as exc:
                console.print(f"[bold red]refused[/]: round {r}: {escape(str(exc)[:300])}")
                status = EXIT_FAILED
    return status


def _voided_why(ledger: Ledger, run_id: bytes) -> dict[tuple[str, int], str]:
    """Why each voided (worker, round) of the run is not payable: the upheld verdict that voided it."""
    from audit.disputes import CHECK_NAMES
    from settlement.disputes import Disputes

    address = ledger.disputes_address()
    if address is None:
        return {}
    verdicts = Disputes(ledger.chain, address, from_block=ledger.from_block).verdicts(run_id)
    by_round = {(v.round, v.party): CHECK_NAMES.get(v.check, "0x" + v.check.hex()) for v in verdicts}
    why = {}
    for voided in ledger.voided_credits(run_id):
        check = by_round.get((voided.round, voided.worker))
        against = "its contribution" if check else "the round's coordinator"
        check = check or by_round.get((voided.round, ledger.coordinator_of(run_id, voided.round)), "?")
        why[(voided.worker, voided.round)] = f"an upheld verdict against {against} (check {check})"
    return why


def render_statement(statement: Statement, console: Console, roster: Roster,
                     voided_why: dict[tuple[str, int], str] | None = None) -> None:
    """Per worker (id and address): rounds credited, earned, paid, claimable now, still in the
    challenge window; then, loudly, every update recorded without its worker's report, and every
    credit an upheld verdict voided (not payable), with the verdict's check."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from settlement.provision import format_tokens
    from settlement.roster import short_address, unreported_lines

    table = Table(title=f"rewards of run 0x{statement.run_id.hex()[:12]}… (pool {format_tokens(statement.funded)} "
                        f"for {statement.total_rounds} rounds, challenge window {statement.challenge_window} blocks, "
                        f"block {statement.head})", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("worker", "address", "rounds", "earned", "paid", "claimable", "in window"):
        table.add_column(column, justify="left" if column in ("worker", "address") else "right", no_wrap=True)
    for worker, account in sorted(statement.workers.items(), key=lambda item: (roster.id_of(item[0]), item[0])):
        table.add_row(escape(roster.id_of(worker)), short_address(worker), str(len(account.rounds)),
                      format_tokens(account.earned), format_tokens(account.paid), format_tokens(account.claimable),
                      format_tokens(account.pending))
    console.print(table)
    console.print(f"paid {format_tokens(statement.paid)} of {format_tokens(statement.funded)}")
    for line in unreported_lines(roster):
        console.print(f"[bold red]UNREPORTED[/] {escape(line)}")
    for worker, account in sorted(statement.workers.items()):
        for round_ in account.voided:
            why = (voided_why or {}).get((worker, round_), "an upheld verdict")
            console.print(f"[bold red]VOIDED[/] {escape(roster.label(worker))}: round {round_} is not payable: "
                          f"{escape(why)}")
    for worker, account in sorted(statement.workers.items()):
        for problem in account.overpaid:
            console.print(f"[bold red]OVERPAID[/] {roster.label(worker)}: {problem}")
