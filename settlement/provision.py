"""Setting a chain up for a run: the steps ``dilocox demo`` takes and ``dilocox chain|run|pool`` expose.

One implementation, so that the demo, the tests and a person at a shell do exactly the same:

  deploy_to      the registry, ledger, reward token and pool deployed by the owner, the deployment file
                 written (settlement.ledger.deploy)
  allow_run      the registry's owner allowlists the code measurement of a run configuration
                 (attestation.code_measurement of its CID, what every worker must attest to) and makes
                 the run's coordinator account a verifier (it admits workers)
  await_run      the run a run directory's store holds, once its coordinator has created it on the ledger
  fund_pool      the run's coordinator opens and funds its reward pool (the token's owner mints the
                 tokens first on a local chain)
  mine           a local chain (anvil) mines blocks: past a challenge window, so claims mature
  read_key_file  an account's key from a file (64 hex digits), refused by name, never echoed
  write_dev_keys anvil's public dev keys as key files (local chains only)

What stays with the coordinator: creating the run on the ledger (``createRun``), with its
``--challenge-window``. The run's id is the digest of its genesis manifest, which exists only once
the coordinator has built θ⁽⁰⁾, so the window is given once, to the coordinator, and read back
from the ledger (``RunRecord.challenge_window``) by everything else.
"""

from __future__ import annotations

import time
from pathlib import Path

from attestation import code_measurement
from storage_client import CID, Codec, Store, write_atomic

from .anvil import DEV_ACCOUNTS
from .chain import Chain, ChainError
from .ledger import Deployment, Ledger, Registry, deploy
from .rewards import RewardPool, RewardToken

__all__ = ["TOKEN_UNIT", "KeyFileError", "allow_run", "await_run", "deploy_to", "dev_key_file", "format_tokens",
           "fund_pool", "mine", "read_key_file", "run_of", "write_dev_keys"]

TOKEN_UNIT = 10**18  # the reward token's 18 decimals: 1 token in its smallest unit


def format_tokens(amount: int) -> str:
    """A token amount in its smallest unit, readably: ``1,000.00``."""
    return f"{amount / TOKEN_UNIT:,.2f}"
_MAX_KEY_FILE_BYTES = 1024  # a key file is 64 hex digits and some whitespace; more is not a key file


class KeyFileError(ValueError):
    """A key file that is missing, too large or holds no key (its content is never shown)."""


def read_key_file(path: Path, flag: str = "--key-file") -> bytes:
    """The 32-byte account key in ``path``: 64 hex digits, optionally 0x-prefixed, with whitespace
    around them. The refusal names the file and ``flag``, never what the file holds."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_KEY_FILE_BYTES + 1)
    except FileNotFoundError:
        raise KeyFileError(f"{flag} {path}: no such file") from None
    except OSError as exc:
        raise KeyFileError(f"{flag} {path}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    text = raw.decode("ascii", errors="replace").strip().removeprefix("0x")
    if len(raw) > _MAX_KEY_FILE_BYTES or len(text) != 64 or not all(c in "0123456789abcdefABCDEF" for c in text):
        raise KeyFileError(f"{flag} {path}: not a chain private key (expected 64 hex digits, optionally "
                           f"0x-prefixed)")
    return bytes.fromhex(text)


def dev_key_file(directory: Path, index: int) -> Path:
    """Where ``write_dev_keys`` keeps dev account ``index``'s key."""
    return Path(directory) / f"dev-account-{index}.key"


def write_dev_keys(directory: Path) -> list[Path]:
    """Write anvil's dev account keys (settlement.anvil.DEV_ACCOUNTS: PUBLIC test keys, for a local
    chain only) as key files (mode 0600) in ``directory``; returns their paths, by account index."""
    paths = [dev_key_file(directory, i) for i in range(len(DEV_ACCOUNTS))]
    for path, key in zip(paths, DEV_ACCOUNTS, strict=True):
        write_atomic(path, key.encode() + b"\n", mode=0o600)
    return paths


def deploy_to(owner: Chain, out: Path) -> Deployment:
    """Deploy every contract with ``owner`` as the registry's and the token's owner; write ``out``."""
    deployment = deploy(owner)
    deployment.save(out)
    return deployment


def allow_run(owner: Chain, deployment: Deployment, config_cid: str, coordinator: str) -> bytes:
    """Allowlist the code measurement of the configuration ``config_cid`` and make ``coordinator`` a
    verifier; returns the measurement. Each write is skipped when the registry already says so."""
    registry = Registry(owner, deployment.registry)
    measurement = code_measurement(config_cid)
    if not registry.is_verifier(coordinator):
        registry.set_verifier(coordinator)
    if not registry.is_measurement_allowed(measurement):
        registry.set_measurement(measurement)
    return measurement


def run_of(store: Store, ledger: Ledger) -> bytes | None:
    """The ledger's run whose genesis manifest is in ``store`` (the newest, should there be several)."""
    found = None
    for created in ledger.runs_created():
        if CID(Codec.JSON, created.genesis_manifest) in store:
            found = created.run_id
    return found


def await_run(store: Store, ledger: Ledger, timeout_s: float, poll_s: float = 0.5) -> bytes:
    """The run of ``store`` on the ledger, waiting up to ``timeout_s`` for its coordinator to create it.

    @raise ChainError when no run whose genesis is in the store appears in time
    """
    deadline = time.monotonic() + timeout_s
    while True:
        run_id = run_of(store, ledger)
        if run_id is not None:
            return run_id
        if time.monotonic() >= deadline:
            raise ChainError(f"no run on the ledger {ledger.address} has its genesis manifest in {store.location} "
                             f"after {timeout_s:g}s: is its coordinator started with --ledger on this chain?")
        time.sleep(poll_s)


def fund_pool(funder: Chain, deployment: Deployment, run_id: bytes, amount: int, rounds: int,
              minter: Chain | None = None) -> None:
    """Open the run's reward pool with ``amount`` (smallest units) for its first ``rounds`` rounds.

    ``funder`` must be the run's coordinator (the pool refuses anyone else); ``minter``, the token's
    owner on a local chain, first mints ``amount`` to the funder."""
    if minter is not None:
        RewardToken(minter, deployment.token).mint(funder.address, amount)
    RewardToken(funder, deployment.token).approve(deployment.rewards, amount)
    ledger = Ledger(funder, deployment.ledger, from_block=deployment.deployed_block)
    RewardPool(funder, deployment.rewards, ledger).open_pool(run_id, amount, rounds)


def mine(chain: Chain, blocks: int) -> int:
    """Mine ``blocks`` empty blocks on a local anvil (``anvil_mine``); returns the new head.

    @raise ChainError when the node does not mine on request (it is not an anvil)"""
    answer = chain.read(lambda: chain.w3.provider.make_request("anvil_mine", [hex(blocks)]), "anvil_mine")
    if isinstance(answer, dict) and answer.get("error"):
        raise ChainError(f"{chain.rpc_url} does not mine on request (anvil_mine): it is not a local anvil")
    return int(chain.read(lambda: chain.w3.eth.block_number, "eth_blockNumber"))
