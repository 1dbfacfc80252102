"""The compiled contracts: ABI and creation bytecode read from forge's ``contracts/out``.

The Python client never carries its own copy of an ABI: it reads what ``forge build`` produced from
``contracts/src``, so the client and the deployed code cannot drift apart silently. The artifacts
are build outputs (not committed); ``make setup`` builds them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["CONTRACTS_DIR", "Artifact", "ArtifactError", "ledger_artifact", "load_artifact", "registry_artifact"]

#: The Foundry project of this repository.
CONTRACTS_DIR = Path(__file__).resolve().parent.parent / "contracts"

REGISTRY = "WorkerRegistry"
LEDGER = "ContributionLedger"


class ArtifactError(FileNotFoundError):
    """A compiled contract artifact is missing or unreadable."""


@dataclass(frozen=True)
class Artifact:
    """One compiled contract.

    @param name the contract name
    @param abi its JSON ABI (functions, events, errors)
    @param bytecode its creation bytecode as 0x-hex (constructor arguments are appended at deploy)
    """

    name: str
    abi: list[dict[str, Any]]
    bytecode: str


def _artifact_path(name: str) -> Path:
    return CONTRACTS_DIR / "out" / f"{name}.sol" / f"{name}.json"


@cache
def load_artifact(name: str) -> Artifact:
    """Read ``contracts/out/<name>.sol/<name>.json``.

    @param name a contract of ``contracts/src`` (``WorkerRegistry`` or ``ContributionLedger``)
    @raise ArtifactError naming the path when it is missing or malformed
    """
    path = _artifact_path(name)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"contract artifact {path} is missing; run `make setup` (it runs "
                            f"`forge build` in contracts/)") from None
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"contract artifact {path} is unreadable ({exc}); rebuild it with "
                            f"`make setup`") from exc
    try:
        abi = data["abi"]
        bytecode = data["bytecode"]["object"]
    except (KeyError, TypeError):
        raise ArtifactError(f"contract artifact {path} has no abi or bytecode.object; rebuild it with "
                            f"`make setup`") from None
    if not isinstance(abi, list) or not isinstance(bytecode, str) or len(bytecode) <= 2:
        raise ArtifactError(f"contract artifact {path} has an empty abi or bytecode; rebuild it with `make setup`")
    if not bytecode.startswith("0x"):
        bytecode = "0x" + bytecode
    return Artifact(name=name, abi=abi, bytecode=bytecode)


def registry_artifact() -> Artifact:
    """``WorkerRegistry``: constructor ``(address initialOwner)``."""
    return load_artifact(REGISTRY)


def ledger_artifact() -> Artifact:
    """``ContributionLedger``: constructor ``(address registry)``."""
    return load_artifact(LEDGER)
