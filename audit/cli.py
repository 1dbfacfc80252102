"""``dilocox audit --run DIR``: audit a run directory's store against its ledger.

Reads ``DIR/store`` and ``DIR/chain/deployment.json`` and nothing else of the run directory (not
HEAD, not rounds.jsonl, not the outbox). Workers are named by their ids beside their addresses, as
their signed reports and the store's manifests bind them (settlement.roster), and every update a
round counted without its worker's report is said loudly (UNREPORTED), with the worker's id.
Without ``--rpc`` it starts a local anvil from a *copy* of ``DIR/chain/state.json`` (so the run
directory is left untouched), audits, and stops it. With
``--allow-dev`` the development root in ``DIR/dev-root/dev-root.address`` (and any ``--dev-root``)
is trusted, and dev evidence is accepted, loudly, as proving nothing. TDX evidence is verified with
dcap-qvl against the collateral named by ``--dcap-collateral FILE`` or fetched from ``--pccs-url
URL``; without either it is refused. Only TCB status UpToDate is accepted unless
``--allow-tcb-status`` names others. ``--dispute`` turns the failures that name one round and one
party into EIP-712 verdicts (audit.disputes), attests a fresh auditor key (``--auditor-attestation``,
dev by default with DIR/dev-root), has the disputes contract's owner (``--owner-key-file``; on the
run's own local chain, the dev deployer account) verify and admit it, and submits them, printing each
one's outcome; without ``--rpc`` it then runs on the run's chain state itself, not a copy, so the
verdicts stay recorded. ``--auditor-dir ADIR`` signs with a persistent auditor instead (attested into
ADIR on its first audit, admitted by the owner separately: ``dilocox settle admit-auditor``), and
``--sign-only --verdicts-out FILE`` writes its signed verdicts to FILE instead of sending them, for
``dilocox settle dispute --verdicts F1 F2 …`` to send k auditors' signatures at once (audit.verdict_file). Every audit shows the run's upheld verdicts. ``--json FILE`` also writes the result as JSON to FILE;
``--json`` alone writes it to stdout, and the tables and messages go to stderr, so that stdout is
one JSON document.

Exit status: 0 when every check passed, 1 when any failed, 2 when the audit could not run (no
deployment file, no chain). SIGTERM (143), SIGHUP (129) or Ctrl-C (130) stop it in order: the local
anvil is stopped and the temporary copy of the state removed (settlement.anvil). The rounds checked,
the replay and the re-scoring show their progress on stderr (trainer.progress).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .result import AuditResult

if TYPE_CHECKING:  # the heavy imports (torch, web3) wait until an audit actually runs
    from rich.console import Console

    from attestation import DcapSettings, Policy
    from attestation.receipt import SignedReceipt
    from settlement import Deployment
    from storage_client import Store

    from .disputes import DisputeOptions

EXIT_OK, EXIT_FAILED, EXIT_ERROR = 0, 1, 2
JSON_STDOUT = "-"  # ``--json`` without a FILE: the result goes to stdout, alone


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", metavar="DIR", help="run directory (its store/ and chain/); or --store URL")
    parser.add_argument("--store", action="append", default=[], metavar="URL",
                        help="instead of --run: an IPFS trustless gateway serving the run's store (dilocox store "
                             "serve; repeatable: tried in order, a mirror first); needs --rpc and --deployment")
    parser.add_argument("--deployment", metavar="FILE",
                        help="with --store: the contracts' deployment JSON (a run directory's chain/deployment.json)")
    parser.add_argument("--store-ca", metavar="FILE",
                        help="with --store https://...: the CA certificate (the run's coordinator certificate) "
                             "to trust instead of the system's")
    parser.add_argument("--rpc", metavar="URL",
                        help="chain RPC; default: a local anvil started from DIR/chain/state.json")
    parser.add_argument("--json", nargs="?", const=JSON_STDOUT, metavar="FILE",
                        help="also write the result as JSON to FILE; --json alone (or --json -) writes it to stdout "
                             "and the tables to stderr")
    parser.add_argument("--allow-dev", action="store_true",
                        help="accept dev attestation evidence, which PROVES NOTHING (trusting DIR/dev-root)")
    parser.add_argument("--dev-root", action="append", default=[], metavar="ADDRESS",
                        help="another trusted dev root address (with --allow-dev; repeatable)")
    add_dcap_arguments(parser)
    parser.add_argument("--no-rederive", action="store_true",
                        help="skip recomputing each round's checkpoint from the stored updates")
    parser.add_argument("--max-unrecorded", type=int, default=0, metavar="N",
                        help="rounds the store's lineage may go past the ledger's last round (default 0: a "
                             "finished run must be recorded to its end)")
    parser.add_argument("--replay", type=int, default=0, metavar="K",
                        help="re-run K sampled (round, worker) contributions from their parent checkpoint, shard "
                             "and committed state, compare with the stored updates, and re-score their rounds")
    parser.add_argument("--replay-seed", type=int, default=None, metavar="N",
                        help="seed of the replay's sample (default: random; the audit prints the one it drew)")
    parser.add_argument("--dispute", action="store_true",
                        help="submit the failures that name a round and a party as verdicts signed by an attested "
                             "auditor key, within each round's challenge window")
    parser.add_argument("--owner-key-file", metavar="FILE",
                        help="with --dispute: the chain key of the disputes contract's owner, which admits the "
                             "auditor (default without --rpc: the local chain's dev deployer account)")
    parser.add_argument("--auditor-attestation", choices=("dev", "tdx"), default="dev",
                        help="with --dispute: the auditor key's attestation provider (default dev, PROVES NOTHING)")
    parser.add_argument("--auditor-dev-root-dir", metavar="DIR",
                        help="with --dispute and dev attestation: the dev root's directory (default DIR/dev-root)")
    parser.add_argument("--auditor-dir", metavar="ADIR",
                        help="with --dispute: sign with the persistent auditor kept in ADIR (attested there on its "
                             "first audit; admitted once by the owner: dilocox settle admit-auditor), not a fresh one")
    parser.add_argument("--sign-only", action="store_true",
                        help="with --dispute --auditor-dir: write the signed verdicts to --verdicts-out, send nothing")
    parser.add_argument("--verdicts-out", metavar="FILE",
                        help="with --sign-only: the verdicts file to write (for dilocox settle dispute --verdicts)")
    parser.add_argument("--receipts", action="append", default=[], metavar="RDIR",
                        help="a worker's receipts folder (dilocox worker --receipts; repeatable): an update its "
                             "coordinator receipted and did not use fails that round, and excuses the worker's "
                             "later replay mismatches (audit.receipts)")
    parser.add_argument("--reveal", action="append", default=[], metavar="SRC",
                        help="where to ask for the committed inner states a replay needs, in a run whose workers "
                             "reveal them on challenge: a worker's gateway or a mirror (http[s] URL) or a retention "
                             "folder on this machine (dilocox worker --retain); repeatable, asked in order (default "
                             "with --run: DIR/retained/*, the folders of workers that ran beside it)")
    parser.add_argument("--reveal-ca", metavar="FILE", help="the CA certificate to trust for https --reveal sources")
    parser.add_argument("--run-id", metavar="HEX",
                        help="the run to audit (0x + 64 hex); default: the ledger's run whose genesis is in the store")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    run_id = None
    if args.run_id:
        text = args.run_id.removeprefix("0x")
        try:
            run_id = bytes.fromhex(text)
        except ValueError:
            run_id = b""
        if len(run_id) != 32:
            Console(stderr=True).print(f"[red]--run-id must be 0x followed by 64 hex digits, got {args.run_id!r}[/]")
            return EXIT_ERROR
    if not 0 <= args.replay <= 1_000_000 or (args.replay_seed is not None and not 0 <= args.replay_seed < 2**63):
        Console(stderr=True).print("[red]--replay must be in [0, 1000000] and --replay-seed in [0, 2^63)[/]")
        return EXIT_ERROR
    if not 0 <= args.max_unrecorded <= 1_000_000:
        Console(stderr=True).print(f"[red]--max-unrecorded {args.max_unrecorded} is out of range: must be in "
                                   f"[0, 1000000][/]")
        return EXIT_ERROR
    try:
        dcap = dcap_settings(args.dcap_collateral, args.pccs_url, args.allow_tcb_status)
    except ValueError as exc:
        from rich.markup import escape

        Console(stderr=True).print(f"[red]bad DCAP options: {escape(str(exc))}[/]")
        return EXIT_ERROR
    try:
        dispute = dispute_options(args)
    except ValueError as exc:
        from rich.markup import escape

        Console(stderr=True).print(f"[red]{escape(str(exc))}[/]")
        return EXIT_ERROR
    if bool(args.run) == bool(args.store):
        Console(stderr=True).print("[red]give --run DIR, or --store URL with --rpc and --deployment[/]")
        return EXIT_ERROR
    if args.store:
        return audit_remote_store(args, run_id, dcap, dispute)
    return audit_run_dir(Path(args.run), rpc_url=args.rpc, allow_dev=args.allow_dev, rederive=not args.no_rederive,
                         json_path=Path(args.json) if args.json else None, run_id=run_id,
                         dev_roots=tuple(args.dev_root), dcap=dcap, max_unrecorded=args.max_unrecorded,
                         replay=(args.replay, args.replay_seed), dispute=dispute,
                         receipts=tuple(Path(d) for d in args.receipts), reveal=tuple(args.reveal),
                         reveal_ca=args.reveal_ca)


def dispute_options(args: argparse.Namespace) -> DisputeOptions | None:
    """``--dispute``'s options, or None without it (ValueError naming a bad key file or combination)."""
    if (args.sign_only or args.verdicts_out or args.auditor_dir) and not args.dispute:
        raise ValueError("--auditor-dir, --sign-only and --verdicts-out go with --dispute")
    if not args.dispute:
        return None
    if args.sign_only != bool(args.verdicts_out) or (args.sign_only and not args.auditor_dir):
        raise ValueError("--sign-only needs --verdicts-out FILE and --auditor-dir ADIR (and --verdicts-out needs "
                         "--sign-only)")
    from settlement import DEV_ACCOUNTS
    from settlement.provision import read_key_file

    from .disputes import DisputeOptions

    dev_root_dir = args.auditor_dev_root_dir or str(Path(args.run or ".") / "dev-root")
    if args.owner_key_file:
        owner_key = read_key_file(Path(args.owner_key_file), "--owner-key-file")
    elif args.sign_only:
        owner_key = None  # nothing is sent
    elif args.rpc is None:
        owner_key = bytes.fromhex(DEV_ACCOUNTS[0].removeprefix("0x"))
    else:
        raise ValueError("--dispute on --rpc needs --owner-key-file (the chain key that sends; the disputes "
                         "contract owner's, which admits a fresh auditor)")
    if not args.auditor_dev_root_dir and not args.run and args.auditor_attestation == "dev":
        raise ValueError("--dispute with --store and dev attestation needs --auditor-dev-root-dir DIR")
    return DisputeOptions(owner_key, args.auditor_attestation, dev_root_dir, args.auditor_dir, args.verdicts_out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dilocox audit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_dcap_arguments(parser: argparse.ArgumentParser) -> None:
    """How TDX quotes are verified: the options of both the coordinator and the audit."""
    parser.add_argument("--dcap-collateral", metavar="FILE",
                        help="Intel collateral (dcap-qvl QuoteCollateralV3 JSON) to verify TDX quotes with")
    parser.add_argument("--pccs-url", metavar="URL",
                        help="fetch Intel collateral for each TDX quote from this PCCS instead")
    parser.add_argument("--allow-tcb-status", action="append", default=[], metavar="STATUS",
                        help="accept this dcap-qvl TCB status besides UpToDate (e.g. SWHardeningNeeded; repeatable)")


def dcap_settings(collateral_file: str | None, pccs_url: str | None,
                  extra_tcb_statuses: list[str] | tuple[str, ...] = ()) -> DcapSettings:
    """DcapSettings from the command-line options (ValueError when they are inconsistent)."""
    from attestation import DcapSettings

    return DcapSettings(collateral_file=Path(collateral_file) if collateral_file else None,
                        pccs_url=pccs_url or None,
                        allowed_tcb_statuses=frozenset({"UpToDate", *extra_tcb_statuses}))


def policy_for(run_dir: Path | None, allow_dev: bool, dev_roots: tuple[str, ...] = (),
               dcap: DcapSettings | None = None) -> tuple[Policy, list[str]]:
    """The auditor's policy, and notes on how it was chosen."""
    from attestation import DcapSettings, Policy, checksum_address
    from attestation.dev import ROOT_ADDRESS_FILE

    dcap = dcap or DcapSettings()
    if not allow_dev:
        return Policy(dcap=dcap), []
    notes: list[str] = []
    roots = [checksum_address(a) for a in dev_roots]
    if run_dir is None:  # no run directory (an audit of a remote store): the --dev-root roots only
        return Policy.development(*roots, dcap=dcap), notes
    address_file = run_dir / "dev-root" / ROOT_ADDRESS_FILE
    try:
        roots.append(checksum_address(address_file.read_text().strip()))
    except FileNotFoundError:
        notes.append(f"--allow-dev: {address_file} does not exist, so no dev root is trusted from the run directory")
    except ValueError as exc:
        notes.append(f"--allow-dev: {address_file} holds no address ({exc})")
    return Policy.development(*roots, dcap=dcap), notes


def audit_run_dir(run_dir: Path, *, rpc_url: str | None = None, allow_dev: bool = False, rederive: bool = True,
                  json_path: Path | None = None, run_id: bytes | None = None, dev_roots: tuple[str, ...] = (),
                  console: Console | None = None, dcap: DcapSettings | None = None, max_unrecorded: int = 0,
                  replay: tuple[int, int | None] = (0, None), dispute: DisputeOptions | None = None,
                  receipts: tuple[Path, ...] = (), reveal: tuple[str, ...] = (), reveal_ca: str | None = None) -> int:
    """Audit ``run_dir`` and print the table and verdict; returns the exit status. ``replay``: how
    many contributions to replay, and the sample's seed (None: random); ``receipts``: workers' receipt
    folders (audit.receipts); ``reveal``: where committed states are asked for (audit.reveal; none
    given: the retention folders of the workers that ran beside ``run_dir``). ``json_path`` ``-`` writes
    the JSON result to stdout, and then everything else goes to stderr (unless ``console`` says
    otherwise), so that stdout is one JSON document. ``dispute``: submit verdicts (``--dispute``)."""
    from rich.console import Console
    from rich.markup import escape

    from settlement import Anvil, Deployment, DeploymentError
    from storage_client import RUN_STORE_DIR, open_store

    to_stdout = json_path is not None and str(json_path) == JSON_STDOUT
    console = console or Console(stderr=to_stdout)
    run_dir = Path(run_dir)
    try:
        deployment = Deployment.load(run_dir / "chain" / "deployment.json")
    except DeploymentError as exc:
        console.print(f"[bold red]cannot audit[/]: {escape(str(exc))}")
        return EXIT_ERROR
    if not (run_dir / RUN_STORE_DIR).is_dir():
        console.print(f"[bold red]cannot audit[/]: {run_dir / RUN_STORE_DIR} is not a directory")
        return EXIT_ERROR
    try:
        policy, notes = policy_for(run_dir, allow_dev, dev_roots, dcap)
    except ValueError as exc:
        console.print(f"[bold red]cannot audit[/]: bad dev root address: {escape(str(exc))}")
        return EXIT_ERROR
    for note in notes:
        console.print(f"[yellow]{escape(note)}[/]")
    if policy.dcap.source is None:
        console.print("[yellow]no --dcap-collateral or --pccs-url: TDX evidence cannot be verified and is refused[/]")

    held = _receipts(receipts, console)
    store = open_store(run_dir)
    from .reveal import local_sources

    sources = _reveal_sources(reveal or tuple(local_sources(run_dir)), reveal_ca, console) if replay[0] else ()
    if sources is None:
        return EXIT_ERROR
    audit = (store, deployment, run_id, policy, rederive, max_unrecorded, replay, dispute, held, sources)
    state = run_dir / "chain" / "state.json"
    if rpc_url is None and not state.is_file():
        console.print(f"[bold red]cannot audit[/]: no --rpc given and no chain state at {state}")
        return EXIT_ERROR

    def on_restored_chain() -> AuditResult:
        with tempfile.TemporaryDirectory(prefix="dilocox-audit-") as tmp:
            # anvil re-dumps its state file: keep the run's own intact, unless verdicts must stay on it
            keep = dispute is not None and dispute.verdicts_out is None
            copy = state if keep else Path(tmp) / "state.json"
            if not keep:
                shutil.copyfile(state, copy)
            with Anvil(state_file=copy, chain_id=deployment.chain_id) as anvil:
                console.print(f"local chain {anvil.rpc_url} restored from {state}")
                return _audit_on(anvil.rpc_url, *audit)

    result = _guarded(console, (lambda: _audit_on(rpc_url, *audit)) if rpc_url is not None else on_restored_chain)
    return EXIT_ERROR if result is None else finish(result, console, json_path)


def _guarded(console: Console, audit: Callable[[], AuditResult]) -> AuditResult | None:
    """``audit()``, or None after one line saying why it could not run: the chain, its local anvil
    or the store (an object the run needs is nowhere to be had) failed, or the auditor of ``--dispute``
    could not attest or be admitted."""
    from rich.markup import escape

    from attestation import AttestationError, PolicyViolation
    from settlement import AnvilError, ChainError
    from storage_client import StoreError

    try:
        return audit()
    except (ChainError, AnvilError, StoreError) as exc:  # StoreError before ValueError: it is one
        console.print(f"[bold red]cannot audit[/]: {escape(str(exc)[:1000])}")
    except (AttestationError, PolicyViolation, ValueError) as exc:
        console.print(f"[bold red]cannot dispute[/]: the auditor cannot attest or be admitted: {escape(str(exc))}")
    return None


def finish(result: AuditResult, console: Console, json_path: Path | None) -> int:
    """Print the audit's tables and verdict, write its JSON where asked; the exit status."""
    from storage_client import strict_json, write_atomic

    render(result, console)
    if json_path is not None:
        document = strict_json(result.to_json(), indent=2) + "\n"
        if str(json_path) == JSON_STDOUT:
            sys.stdout.write(document)
            sys.stdout.flush()
        else:
            write_atomic(json_path, document.encode())
            console.print(f"result written to {json_path}")
    return EXIT_OK if result.ok else EXIT_FAILED


def audit_remote_store(args: argparse.Namespace, run_id: bytes | None, dcap: DcapSettings,
                       dispute: DisputeOptions | None) -> int:
    """``--store URL``: audit from the chain at ``--rpc`` and the run's store fetched by CID from
    gateways (storage_client.remote), with no run directory; every block is verified as it arrives."""
    from rich.console import Console
    from rich.markup import escape

    from settlement import Deployment, DeploymentError
    from storage_client import StoreError
    from storage_client.remote import RemoteStore

    json_path = Path(args.json) if args.json else None
    console = Console(stderr=json_path is not None and str(json_path) == JSON_STDOUT)
    if not args.rpc or not args.deployment:
        console.print("[bold red]cannot audit[/]: --store needs --rpc URL and --deployment FILE")
        return EXIT_ERROR
    try:
        deployment = Deployment.load(Path(args.deployment))
        store = RemoteStore(args.store, ca_file=args.store_ca)
        policy, notes = policy_for(None, args.allow_dev, tuple(args.dev_root), dcap)
    except (DeploymentError, StoreError, OSError, ValueError) as exc:
        console.print(f"[bold red]cannot audit[/]: {escape(str(exc)[:400])}")
        return EXIT_ERROR
    for note in notes:
        console.print(f"[yellow]{escape(note)}[/]")
    console.print(f"[yellow]store {escape(store.location)}: a gateway cannot be listed, so rounds stored past "
                  f"the ledger's last one are not searched for[/]")
    held = _receipts(tuple(map(Path, args.receipts)), console)
    sources = _reveal_sources(tuple(args.reveal), args.reveal_ca, console) if args.replay else ()
    if sources is None:
        return EXIT_ERROR
    result = _guarded(console, lambda: _audit_on(args.rpc, store, deployment, run_id, policy, not args.no_rederive,
                                                 args.max_unrecorded, (args.replay, args.replay_seed), dispute, held,
                                                 sources))
    return EXIT_ERROR if result is None else finish(result, console, json_path)


def _reveal_sources(sources: tuple[str, ...], ca_file: str | None,
                    console: Console) -> tuple[tuple[str, Store], ...] | None:
    """The reveal sources opened, in order (audit.reveal), each said on one line; None after one line
    naming a source that is neither a URL nor a store folder."""
    from rich.markup import escape

    from .reveal import RevealSourceError, open_source

    opened = []
    for source in sources:
        try:
            opened.append((source[:200], open_source(source, ca_file)))
        except (RevealSourceError, ValueError, OSError) as exc:  # StoreError: a URL that is not one
            console.print(f"[bold red]cannot audit[/]: --reveal: {escape(str(exc)[:300])}")
            return None
    if opened:
        console.print(f"committed inner states are asked of: {escape(', '.join(label for label, _ in opened))}")
    return tuple(opened)


def _receipts(folders: tuple[Path, ...], console: Console) -> tuple[SignedReceipt, ...]:
    """Every receipt kept in ``folders`` (trainer.worker.receipts), each file that is not one said."""
    from rich.markup import escape

    from trainer.worker.receipts import ReceiptBook

    held: list[SignedReceipt] = []
    for folder in folders:
        book = ReceiptBook(folder)
        if not book.runs():
            console.print(f"[yellow]--receipts {escape(str(folder))}: no receipts there[/]")
        for run in book.runs():
            kept, problems = book.receipts(run)
            held.extend(kept)
            for problem in problems:
                console.print(f"[yellow]--receipts: {escape(problem)}[/]")
    return tuple(held)


def _audit_on(rpc_url: str, store: Store, deployment: Deployment, run_id: bytes | None, policy: Policy,
              rederive: bool, max_unrecorded: int = 0, replay: tuple[int, int | None] = (0, None),
              dispute: DisputeOptions | None = None, receipts: tuple[SignedReceipt, ...] = (),
              reveal: tuple[tuple[str, Store], ...] = ()) -> AuditResult:
    from settlement import Chain, ChainError, Ledger, Registry
    from settlement.receipt_court import ReceiptCourt
    from settlement.rewards import RewardPool

    from .core import run_audit

    # A throwaway key: Chain needs an account, and the audit never sends a transaction.
    chain = Chain(rpc_url, os.urandom(32))
    if chain.chain_id != deployment.chain_id:
        raise ChainError(f"{rpc_url} is chain {chain.chain_id}, but the deployment is on chain {deployment.chain_id}")
    ledger = Ledger(chain, deployment.ledger, from_block=deployment.deployed_block)
    registry = Registry(chain, deployment.registry, from_block=deployment.deployed_block)
    rewards = RewardPool(chain, deployment.rewards, ledger, from_block=deployment.deployed_block)
    court = None if deployment.receipt_court is None else ReceiptCourt(chain, deployment.receipt_court,
                                                                         from_block=deployment.deployed_block)
    result = run_audit(store, ledger, registry, run_id=run_id, policy=policy, rederive=rederive,
                       max_unrecorded=max_unrecorded, replay=replay[0], replay_seed=replay[1], rewards=rewards,
                       court=court, receipts=receipts, reveal=reveal)
    if dispute is not None:
        from .disputes import dispute_findings

        result.disputes.extend(dispute_findings(result, rpc_url, deployment, store, policy, dispute))
    return result


def _short(text: str | None, head: int = 10, tail: int = 6) -> str:
    if not text:
        return "—"
    return text if len(text) <= head + tail + 1 else f"{text[:head]}…{text[len(text) - tail:]}"


def render(result: AuditResult, console: Console) -> None:
    """The per-round table, failures, warnings and the verdict."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from storage_client import hex_or_none

    table = Table(title=f"lineage audit of run {_short(hex_or_none(result.run_id), 12, 8)}", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    unreported = any(row.unreported for row in result.rounds)  # a column only when some round has them
    columns = [("round", "right"), ("manifest", "left"), ("checkpoint", "left"), ("workers", "right"),
               ("reports", "right"), *([("unreported", "right")] if unreported else []), ("eval loss", "right"),
               ("status", "left")]
    for column, justify in columns:
        table.add_column(column, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for row in result.rounds:
        status = "[green]ok[/]" if row.status == "ok" else "[bold red]FAIL[/]"
        table.add_row(
            str(row.round), "—" if not row.manifest else "…" + row.manifest[-12:], _short(row.checkpoint, 12, 0),
            "—" if row.participants is None else str(row.participants), str(row.reports),
            *([str(row.unreported)] if unreported else []),
            "—" if row.eval_loss is None else f"{row.eval_loss:.4f}", status,
        )
    console.print(table)
    if result.replay is not None:
        render_replay(result.replay, console)
    if result.tallies:
        render_tallies(result, console)
    if result.disputes:
        render_disputes(result, console)
    if result.roster is not None:
        from settlement.roster import unreported_lines

        for line in unreported_lines(result.roster):
            console.print(f"[bold red]UNREPORTED[/] {escape(line)}")
    for warning in result.warnings:
        console.print(f"[bold yellow]warning[/]: {escape(warning)}")
    for failure in result.failures:
        console.print(f"[bold red]FAIL[/] {escape(str(failure))}")
    recorded = sum(1 for r in result.rounds if r.round > 0)
    how = "re-derived from the stored updates" if result.rederived else "not re-derived (--no-rederive)"
    if result.ok:
        console.print(f"[bold green]AUDIT PASSED[/]: genesis and {recorded} recorded round(s) verified from the "
                      f"ledger and the store; checkpoints {how}")
    else:
        console.print(f"[bold red]AUDIT FAILED[/]: {len(result.failures)} check(s) failed over genesis and "
                      f"{recorded} recorded round(s)")


def render_tallies(result: AuditResult, console: Console) -> None:
    """Each worker's tally in the run and over all runs, and, with a reward pool, its payout."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from settlement.roster import Roster, short_address

    accounts = {} if result.rewards is None else result.rewards.workers
    roster = result.roster or Roster()
    table = Table(title="contributions and rewards", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("worker", "address", "rounds", "tokens", "all runs", *(("earned", "paid") if result.rewards else ())):
        table.add_column(column, justify="left" if column in ("worker", "address") else "right", no_wrap=True)
    for worker, tally in sorted(result.tallies.items(), key=lambda item: (roster.id_of(item[0]), item[0])):
        account = accounts.get(worker)
        money = (f"{account.earned / 1e18:,.2f}", f"{account.paid / 1e18:,.2f}") if account else ("—", "—")
        table.add_row(escape(roster.id_of(worker)), short_address(worker), str(tally["rounds"]),
                      f"{tally['tokens']:,}", f"{tally.get('total_tokens', 0):,}", *(money if result.rewards else ()))
    console.print(table)


def render_disputes(result: AuditResult, console: Console) -> None:
    """Each verdict of the run, upheld on chain or submitted by this audit, and its outcome."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="disputes", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("round", "party", "check", "evidence", "signers", "outcome"):
        table.add_column(column, no_wrap=column not in ("outcome", "signers"))
    for row in result.disputes:
        verdict = row.verdict
        outcome = "[bold green]upheld[/]" if row.outcome == "upheld" else f"[yellow]{escape(row.outcome)}[/]"
        table.add_row(str(verdict.round), f"{escape(row.party_id)} ({_short(verdict.party)})",
                      escape(verdict.check_name), _short("0x" + verdict.evidence.hex()),
                      ", ".join(_short(s) for s in row.signers) or "—", outcome)
    console.print(table)


def render_replay(outcome, console: Console) -> None:  # audit.replay.ReplayOutcome
    """The replayed contributions (sampled ones first marked *), the re-scores, and the cost."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"replay (seed {outcome.seed})", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("round", "worker", "sampled", "distance", "tolerance", "status", "kernels"):
        table.add_column(column, no_wrap=True)
    shown = [row for row in outcome.rows if row.status != "not replayed"]
    for row in shown:
        status = {"ok": "[green]ok[/]", "MISMATCH": "[bold red]MISMATCH[/]", "unrevealed": "[bold red]UNREVEALED[/]",
                  "inconclusive": "[yellow]inconclusive[/]"}.get(row.status, row.status)
        table.add_row(str(row.round), escape(row.worker), "*" if row.sampled else "",
                      "—" if row.distance is None else f"{row.distance:.2e}",
                      "—" if row.tolerance is None else f"{row.tolerance:.2g}", status, escape(row.kernels))
    console.print(table)
    skipped = outcome.not_replayed_line()
    if skipped is not None:
        console.print(f"[bold yellow]{escape(skipped)}[/]")
    reveal = outcome.reveal
    if reveal is not None and (reveal.revealed or reveal.missing):
        console.print(f"challenged {len(reveal.revealed) + len(reveal.missing)} committed inner state(s): "
                      f"{len(reveal.revealed)} revealed ({reveal.bytes / 1e6:.2f} MB in {reveal.seconds:.1f}s)"
                      + (f", [bold red]{len(reveal.missing)} not revealed[/]" if reveal.missing else ""))
    for score in outcome.rescored:
        mark = "[green]ok[/]" if score.ok else "[bold red]differs[/]"
        console.print(f"re-scored round {score.round}: held-out loss {score.recomputed:.6f}, reported "
                      f"{score.reported:.6f} {mark}")
    if outcome.checked_steps:
        console.print(f"replayed {outcome.steps} inner steps in {outcome.seconds:.1f}s to check "
                      f"{outcome.checked_steps} sampled steps ({outcome.seconds / max(outcome.steps, 1):.3f}s a step)")


if __name__ == "__main__":
    raise SystemExit(main())
