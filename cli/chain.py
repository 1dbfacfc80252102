"""``dilocox chain|run|pool``: a chain set up for a run by shell commands, no Python.

    dilocox chain up --dir DIR [--port P]      a local anvil kept in DIR, left running (state in DIR/state.json)
    dilocox chain down --dir DIR               stop it; its state is saved, `chain up` restores it
    dilocox chain deploy --rpc URL --key-file F --out deployment.json
                                               the registry, ledger, reward token and pool
    dilocox chain mine --rpc URL BLOCKS        a local chain mines BLOCKS blocks (past a challenge window)
    dilocox run create --rpc URL --key-file F --deployment FILE --config FILE --coordinator ADDRESS
                       [--dev-root-dir DIR]    the run's code measurement allowlisted, its coordinator a verifier
    dilocox run hand-over --rpc URL --key-file F --deployment FILE --run-id HEX --to ADDRESS
                                               the run's creator hands the run to another coordinator
    dilocox pool fund --run DIR --rpc URL --key-file F --amount TOKENS [--rounds N] [--mint-key-file F]
                                               the coordinator opens and funds the run's reward pool

Each does one step of settlement.provision, the same functions ``dilocox demo`` runs. ``chain up``
writes, in DIR: ``rpc-url`` (the chain's URL, for ``$(cat DIR/rpc-url)``), ``anvil.pid``,
``anvil.log``, ``state.json`` (dumped every second and when stopped) and ``dev-account-N.key``:
anvil's well-known dev keys, PUBLIC test keys for this local chain only, which every command refuses
on any other chain. Keys are read from files (``--key-file``), never from the command line, and
never printed.

The run itself is created on the ledger by its coordinator, at genesis (the run's id is the digest
of the genesis manifest, which exists only then), with ``dilocox coordinator --challenge-window``:
that flag is the one place the window is set; ``settle`` and the audit read it back from the ledger.
So ``pool fund`` waits (``--wait``) for the coordinator to have created the run it funds.

Every failure is one line and a non-zero exit: 1 when the chain or a file says no, 2 for arguments
that cannot work.
"""

from __future__ import annotations

import argparse
import inspect
import os
import signal
import time
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from settlement import Chain, Deployment

RPC_URL_FILE, PID_FILE, STATE_FILE, LOG_FILE = "rpc-url", "anvil.pid", "state.json", "anvil.log"
LOCAL_CHAIN_ID = 31337  # anvil's: the only chain the dev keys are accepted on
STOP_GRACE_S = 10.0  # SIGTERM, then this long for anvil to dump its state, then SIGKILL
MAX_MINE = 1_000_000


class ChainCommandError(ValueError):
    """A chain command that cannot do what it was asked (one line, exit 1)."""


# ----------------------------------------------------------------------------- arguments


def _formatter(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter


def _doc(command: Callable[[argparse.Namespace], int]) -> str:
    """A command's docstring as its --help description."""
    return inspect.cleandoc(command.__doc__ or "")


def _described(p: argparse.ArgumentParser) -> None:
    """``dilocox chain|run|pool --help``: this module's docstring."""
    p.description = __doc__
    _formatter(p)


def _rpc_key(p: argparse.ArgumentParser, key_help: str) -> None:
    p.add_argument("--rpc", required=True, metavar="URL",
                   help="the chain's JSON-RPC URL (chain up writes it to DIR/rpc-url)")
    p.add_argument("--key-file", required=True, metavar="FILE", help=key_help + "; read from the file, never printed")


def chain_arguments(p: argparse.ArgumentParser) -> None:
    _described(p)
    sub = p.add_subparsers(dest="action", required=True, metavar="{up,down,deploy,mine}")
    up = sub.add_parser("up", help="start a local anvil kept in DIR, left running", description=_doc(cmd_up))
    up.add_argument("--dir", required=True, metavar="DIR",
                    help="where the chain's state, URL, pid, log and dev keys live")
    up.add_argument("--port", type=int, default=0, help="RPC port on 127.0.0.1 (default 0: a free one)")
    down = sub.add_parser("down", help="stop the local anvil of DIR (its state saved)", description=_doc(cmd_down))
    down.add_argument("--dir", required=True, metavar="DIR", help="the directory given to chain up")
    deploy = sub.add_parser("deploy", help="deploy the registry, ledger, reward token and pool",
                            description=_doc(cmd_deploy))
    _rpc_key(deploy, "the deploying account's key (it owns the registry and the token)")
    deploy.add_argument("--out", required=True, metavar="FILE", help="the deployment file to write (not overwritten)")
    mine = sub.add_parser("mine", help="mine blocks on a local anvil", description=_doc(cmd_mine))
    mine.add_argument("--rpc", required=True, metavar="URL", help="the local chain's JSON-RPC URL")
    mine.add_argument("blocks", type=int, help="how many blocks to mine")
    for parser in (up, down, deploy, mine):
        _formatter(parser)


def run_arguments(p: argparse.ArgumentParser) -> None:
    _described(p)
    sub = p.add_subparsers(dest="action", required=True, metavar="{create,hand-over}")
    create = sub.add_parser("create", help="allow a run configuration on the registry, its coordinator a verifier",
                            description=_doc(cmd_create))
    _formatter(create)
    _rpc_key(create, "the registry owner's key (the account that deployed)")
    create.add_argument("--deployment", required=True, metavar="FILE", help="the deployment file of chain deploy")
    create.add_argument("--config", required=True, metavar="FILE",
                        help="the run configuration (dilocox config), as the coordinator will be given it")
    create.add_argument("--coordinator", required=True, metavar="ADDRESS",
                        help="the coordinator's chain address (of its --chain-key-file): it admits workers")
    create.add_argument("--dev-root-dir", metavar="DIR",
                        help="also create the dev attestation root there (PROVES NOTHING: local development "
                             "only); its address is in DIR/dev-root.address, for the coordinator's --dev-root")
    hand = sub.add_parser("hand-over", help="the run's creator hands the run to another coordinator",
                          description=_doc(cmd_hand_over))
    _formatter(hand)
    _rpc_key(hand, "the run's creator's key (the account of its first coordinator's --chain-key-file)")
    hand.add_argument("--deployment", required=True, metavar="FILE", help="the deployment file of chain deploy")
    hand.add_argument("--run-id", required=True, metavar="HEX", help="the run (0x + 64 hex)")
    hand.add_argument("--to", required=True, metavar="ADDRESS",
                      help="the new coordinator's chain address (of its --chain-key-file)")


def pool_arguments(p: argparse.ArgumentParser) -> None:
    _described(p)
    sub = p.add_subparsers(dest="action", required=True, metavar="{fund}")
    fund = sub.add_parser("fund", help="open and fund the reward pool of a run", description=_doc(cmd_fund))
    _formatter(fund)
    fund.add_argument("--run", required=True, metavar="DIR",
                      help="the run directory (its store/ and chain/deployment.json)")
    _rpc_key(fund, "the run's coordinator's key (only it may open the pool)")
    fund.add_argument("--amount", required=True, metavar="TOKENS", help="reward tokens, e.g. 1000 or 12.5")
    fund.add_argument("--rounds", type=int, metavar="N", help="rounds the pool pays for (default: the run's)")
    fund.add_argument("--mint-key-file", metavar="FILE",
                      help="the token owner's key: mint --amount to the coordinator first (the local RewardToken)")
    fund.add_argument("--wait", type=float, default=120.0, metavar="SECONDS",
                      help="how long to wait for the coordinator to create the run on the ledger (default 120)")


# ----------------------------------------------------------------------------- shared steps


def _account(rpc_url: str, key_file: str, flag: str = "--key-file") -> Chain:
    """The account of ``key_file`` on the chain at ``rpc_url``; anvil's public dev keys only on a
    local chain (anything they hold elsewhere is anyone's)."""
    from settlement import DEV_ACCOUNTS, Chain
    from settlement.provision import read_key_file

    key = read_key_file(Path(key_file), flag)
    chain = Chain(rpc_url, key, retries=2)
    if "0x" + key.hex() in DEV_ACCOUNTS and chain.chain_id != LOCAL_CHAIN_ID:
        raise ChainCommandError(f"{flag} {key_file} holds one of anvil's PUBLIC dev keys, but {rpc_url} is chain "
                                f"{chain.chain_id}, not a local anvil ({LOCAL_CHAIN_ID}): refused")
    return chain


def _deployment(path: Path, chain: Chain) -> Deployment:
    """The deployment file at ``path``, refused unless its contracts are on ``chain`` (a chain restarted
    without its state, or another chain, has none there)."""
    from settlement import Deployment

    deployment = Deployment.load(path)
    if chain.chain_id != deployment.chain_id:
        raise ChainCommandError(f"{path} is a deployment on chain {deployment.chain_id}, but {chain.rpc_url} is "
                                f"chain {chain.chain_id}")
    code = chain.read(lambda: chain.w3.eth.get_code(deployment.registry), "eth_getCode")
    if not code:
        raise ChainCommandError(f"{chain.rpc_url} has no contract at the registry address of {path} "
                                f"({deployment.registry}): not the chain it was deployed on, or restarted without "
                                f"its state")
    return deployment


def _token_amount(text: str) -> int:
    """``--amount`` in the token's smallest unit: a positive decimal with at most 18 places."""
    from settlement.provision import TOKEN_UNIT

    try:
        if len(text) > 80:
            raise InvalidOperation
        value = Decimal(text.strip()) * TOKEN_UNIT
    except ArithmeticError:  # decimal's InvalidOperation and Overflow
        raise ChainCommandError(f"--amount {text[:40]!r} is not a number of tokens") from None
    if not value.is_finite() or value <= 0 or value != value.to_integral_value() or value >= 2**128:
        raise ChainCommandError(f"--amount {text[:40]!r} must be a positive number of tokens, at most 18 decimals, "
                                f"below 2^128 units")
    return int(value)


# ----------------------------------------------------------------------------- chain up / down


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie left for a parent to reap is not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")


def _running_anvil(directory: Path) -> int | None:
    """The pid of the anvil of ``directory`` when it is still running (its pid file, and a live
    process whose command line names this directory's state file); None otherwise."""
    try:
        pid = int((directory / PID_FILE).read_text()[:20])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    state = str((directory / STATE_FILE).resolve()).encode()
    return pid if _pid_alive(pid) and b"anvil" in cmdline and state in cmdline.split(b"\0") else None


def running_chain(directory: Path) -> str | None:
    """The RPC URL of the chain `dilocox chain up` keeps in ``directory``, while it runs."""
    if _running_anvil(directory) is None:
        return None
    try:
        return (directory / RPC_URL_FILE).read_text()[:100].strip() or None
    except OSError:
        return None


def cmd_up(args: argparse.Namespace) -> int:
    """Start a local anvil whose state is kept in DIR/state.json (restored when it exists), in its own
    session, left running: its URL goes to DIR/rpc-url, its pid to DIR/anvil.pid, its log to
    DIR/anvil.log, and anvil's dev keys (PUBLIC test keys, refused on any other chain) to
    DIR/dev-account-N.key. Prints the URL and the dev accounts' addresses. Refused while the chain
    of DIR is up; `dilocox chain down --dir DIR` stops it."""
    from eth_account import Account

    from settlement import DEV_ACCOUNTS, Anvil
    from settlement.provision import write_dev_keys
    from storage_client import write_atomic

    directory = Path(args.dir)
    running = _running_anvil(directory)
    if running is not None:
        raise ChainCommandError(f"a chain is already up in {directory}: {running_chain(directory)} (pid {running}); "
                                f"`dilocox chain down --dir {directory}` stops it")
    directory.mkdir(parents=True, exist_ok=True)
    restored = (directory / STATE_FILE).is_file()
    anvil = Anvil(state_file=(directory / STATE_FILE).resolve(), port=args.port, chain_id=LOCAL_CHAIN_ID,
                  log_file=directory / LOG_FILE, detached=True)
    anvil.start()
    pid = anvil.detach()
    write_atomic(directory / PID_FILE, f"{pid}\n".encode())
    write_atomic(directory / RPC_URL_FILE, f"{anvil.rpc_url}\n".encode())
    keys = write_dev_keys(directory)
    print(f"local chain {anvil.rpc_url} (chain id {LOCAL_CHAIN_ID}, pid {pid}), "
          f"{'restored from' if restored else 'state kept in'} {directory / STATE_FILE}")
    print(f"dev accounts: anvil's PUBLIC test keys, for this local chain only, in {directory}/dev-account-N.key")
    for i, (key, path) in enumerate(zip(DEV_ACCOUNTS, keys, strict=True)):
        print(f"  {i}  {Account.from_key(key).address}  {path.name}")
    return 0


def _stop(pid: int) -> None:
    """SIGTERM (anvil dumps its state), wait for it, SIGKILL after STOP_GRACE_S."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while _pid_alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise ChainCommandError(f"anvil (pid {pid}) did not stop within {STOP_GRACE_S:g}s of SIGTERM and was "
                                    f"killed; its state is as last dumped (at most about a second old)")
        time.sleep(0.05)


def cmd_down(args: argparse.Namespace) -> int:
    """Stop the local anvil that `dilocox chain up --dir DIR` started, with SIGTERM, so that it saves
    its state to DIR/state.json (`dilocox chain up --dir DIR` starts the same chain again). When no
    chain of DIR is up, says so and succeeds."""
    directory = Path(args.dir)
    pid = _running_anvil(directory)
    if pid is None:
        for name in (PID_FILE, RPC_URL_FILE):
            (directory / name).unlink(missing_ok=True)
        print(f"no chain is up in {directory}; nothing to stop")
        return 0
    try:
        _stop(pid)
    finally:
        for name in (PID_FILE, RPC_URL_FILE):
            (directory / name).unlink(missing_ok=True)
    print(f"chain stopped (pid {pid}); state saved in {directory / STATE_FILE}")
    return 0


# ----------------------------------------------------------------------------- deploy / mine


def cmd_deploy(args: argparse.Namespace) -> int:
    """Deploy the WorkerRegistry (owned by the --key-file account), the ContributionLedger bound to
    it, the RewardToken (the same account mints it) and the RewardPool, and write their addresses to
    --out (refused when it exists: runs may be bound to that deployment)."""
    from settlement.provision import deploy_to

    out = Path(args.out)
    if out.exists():
        raise ChainCommandError(f"--out {out} exists: a deployment is already there (remove it to deploy anew)")
    owner = _account(args.rpc, args.key_file)
    deployment = deploy_to(owner, out)
    print(f"deployed on chain {deployment.chain_id} in block {deployment.deployed_block} by {deployment.owner}: "
          f"registry {deployment.registry}, ledger {deployment.ledger}, token {deployment.token}, "
          f"reward pool {deployment.rewards}, receipt court {deployment.receipt_court}; written to {out}")
    return 0


def cmd_mine(args: argparse.Namespace) -> int:
    """Mine BLOCKS empty blocks on a local anvil: a recorded round's rewards can be claimed once it is
    the run's challenge window of blocks old."""
    from settlement import Chain
    from settlement.provision import mine

    if not 1 <= args.blocks <= MAX_MINE:
        raise ChainCommandError(f"BLOCKS {args.blocks} is out of range: must be in [1, {MAX_MINE}]")
    chain = Chain(args.rpc, os.urandom(32), retries=2)  # a throwaway account: mining sends no transaction
    head = mine(chain, args.blocks)
    print(f"mined {args.blocks} block(s); the head is block {head}")
    return 0


# ----------------------------------------------------------------------------- run create / pool fund


def cmd_create(args: argparse.Namespace) -> int:
    """Allow a run on the registry: allowlist the code measurement of the run configuration (its CID
    with the corpus pinned, exactly as the coordinator pins it at genesis; every worker must attest to
    it) and make the coordinator's address a verifier (it admits workers). With --dev-root-dir, also
    create the dev attestation root, which PROVES NOTHING (local development only). The run itself is
    created on the ledger by the coordinator at genesis, with its --challenge-window."""
    from attestation import checksum_address
    from settlement import Registry
    from settlement.provision import allow_run
    from trainer.config import RunConfig
    from trainer.data.dataset import pin_dataset

    try:
        coordinator = checksum_address(args.coordinator)
    except ValueError:
        raise ChainCommandError(f"--coordinator {args.coordinator[:60]!r} is not a chain address "
                                f"(0x + 40 hex)") from None
    config, _ = pin_dataset(RunConfig.load(args.config))
    owner = _account(args.rpc, args.key_file)
    deployment = _deployment(Path(args.deployment), owner)
    registry_owner = Registry(owner, deployment.registry).owner()
    if registry_owner != owner.address:
        raise ChainCommandError(f"--key-file {args.key_file} is account {owner.address}, but the registry's owner "
                                f"is {registry_owner}: only the owner allows runs")
    measurement = allow_run(owner, deployment, str(config.cid), coordinator)
    print(f"run {config.run_id!r}: configuration {config.cid}, code measurement 0x{measurement.hex()} allowlisted; "
          f"coordinator {coordinator} is a verifier")
    if args.dev_root_dir:
        from attestation import DEV_WARNING, DevRoot

        root = DevRoot.load_or_create(Path(args.dev_root_dir))
        print(f"dev attestation root {root.address} in {args.dev_root_dir}: {DEV_WARNING}")
    return 0


def cmd_hand_over(args: argparse.Namespace) -> int:
    """Hand a run to another coordinator (ContributionLedger.handOver): sent by the run's creator,
    the account of its first coordinator. The new coordinator records the run's next round, under the
    same run id, once it is started with `dilocox coordinator --take-over RUN_ID` on a run directory
    filled by `dilocox mirror`; the registry's owner makes it a verifier first (`run create
    --coordinator ADDRESS`), so that it admits workers."""
    from attestation import checksum_address
    from settlement import Ledger
    from storage_client import unhex32

    try:
        successor = checksum_address(args.to)
    except ValueError:
        raise ChainCommandError(f"--to {args.to[:60]!r} is not a chain address (0x + 40 hex)") from None
    try:
        run_id = unhex32(args.run_id, "--run-id")
    except ValueError as exc:
        raise ChainCommandError(str(exc)) from None
    creator = _account(args.rpc, args.key_file)
    deployment = _deployment(Path(args.deployment), creator)
    ledger = Ledger(creator, deployment.ledger, from_block=deployment.deployed_block)
    run = ledger.run_of(run_id)
    if run is None:
        raise ChainCommandError(f"the ledger {deployment.ledger} records no run {args.run_id[:80]}")
    if ledger.creator_of(run_id) != creator.address:
        raise ChainCommandError(f"--key-file {args.key_file} is account {creator.address}, but run "
                                f"0x{run_id.hex()[:12]}… was created by {ledger.creator_of(run_id)}: only its "
                                f"creator hands it over")
    receipt = ledger.hand_over(run_id, successor)
    print(f"run 0x{run_id.hex()[:12]}…: handed from {run.coordinator} to {successor} in block "
          f"{receipt['blockNumber']}; it records the run from round {run.last_round + 1} on")
    return 0


def cmd_fund(args: argparse.Namespace) -> int:
    """Open and fund the reward pool of the run in --run DIR: --amount tokens for its first --rounds
    rounds (default: all of them), each round's share split among the workers that reported it. Sent
    by the run's coordinator (--key-file); with --mint-key-file the token's owner first mints the
    amount to it (the local RewardToken). Waits up to --wait seconds for the coordinator to create
    the run on the ledger."""
    from settlement import Ledger
    from settlement.provision import await_run, format_tokens, fund_pool
    from settlement.rewards import RewardPool
    from storage_client import CID, Codec, Manifest, open_store
    from trainer.config import RunConfig

    amount = _token_amount(args.amount)
    if args.rounds is not None and not 1 <= args.rounds < 2**64:
        raise ChainCommandError(f"--rounds {args.rounds} is out of range: must be in [1, 2^64)")
    if not 0 <= args.wait <= 86_400:
        raise ChainCommandError(f"--wait {args.wait} is out of range: must be in [0, 86400] seconds")
    run_dir = Path(args.run)
    funder = _account(args.rpc, args.key_file)
    deployment = _deployment(run_dir / "chain" / "deployment.json", funder)
    minter = _account(args.rpc, args.mint_key_file, "--mint-key-file") if args.mint_key_file else None
    store = open_store(run_dir)
    ledger = Ledger(funder, deployment.ledger, from_block=deployment.deployed_block)
    run_id = await_run(store, ledger, args.wait)
    run = ledger.run_of(run_id)
    assert run is not None
    if run.coordinator != funder.address:
        raise ChainCommandError(f"--key-file {args.key_file} is account {funder.address}, but the run's coordinator "
                                f"is {run.coordinator}: only it may open the pool")
    pool = RewardPool(funder, deployment.rewards, ledger)
    if (opened := pool.pool_of(run_id)) is not None:
        raise ChainCommandError(f"run 0x{run_id.hex()[:12]}… already has a pool of {format_tokens(opened.funded)} "
                                f"tokens for {opened.total_rounds} rounds")
    rounds = args.rounds
    if rounds is None:
        genesis = Manifest.load(store, CID(Codec.JSON, run.genesis_manifest))
        rounds = RunConfig.from_json(store.get_json(genesis.config)).rounds.rounds
    fund_pool(funder, deployment, run_id, amount, rounds, minter)
    print(f"reward pool of run 0x{run_id.hex()[:12]}… opened with {format_tokens(amount)} tokens for {rounds} rounds "
          f"({format_tokens(amount // rounds)} a round, split among the workers that report it); claims mature "
          f"{run.challenge_window} blocks after a round is recorded")
    return 0


ACTIONS: dict[str, Callable[[argparse.Namespace], int]] = {
    "up": cmd_up, "down": cmd_down, "deploy": cmd_deploy, "mine": cmd_mine, "create": cmd_create,
    "hand-over": cmd_hand_over, "fund": cmd_fund,
}


def run(args: argparse.Namespace) -> int:
    return ACTIONS[args.action](args)
