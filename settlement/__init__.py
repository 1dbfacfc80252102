"""settlement: the Python client of the trust path's contracts (docs/trust.md, contracts/).

    anvil      Anvil: a local development chain (the pinned binary, 127.0.0.1 only); DEV_ACCOUNTS
    artifacts  the compiled ABIs and bytecode from contracts/out
    chain      Chain: one account on one chain; locally signed transactions, retries, decoded reverts
               (ChainError, ChainUnavailable, TxReverted)
    ledger     deploy / Deployment, Registry (WorkerRegistry), Ledger (ContributionLedger)
    records    what the clients read from the chain, as typed records (RunRecord, RoundRecord, ...)
    rewards    RewardPool / RewardToken: a run's reward pool, its statement and claims
    outbox     Outbox: ledger writes kept on disk until the chain confirms them (idempotent flush)
    gas        gas_table / format_markdown: what each ledger write costs
    receipt_court  ReceiptCourt: a worker proves its coordinator's receipted omission (omissions, faults)
    takeover   take_over: a run directory filled by a mirror made to resume a run handed to this account
"""

from .anvil import DEV_ACCOUNTS, Anvil, AnvilError, anvil_binary
from .artifacts import Artifact, ArtifactError, ledger_artifact, load_artifact, registry_artifact
from .chain import Chain, ChainError, ChainUnavailable, RevertDecoder, TxReverted
from .ledger import Deployment, DeploymentError, Ledger, Registry, deploy
from .outbox import Outbox, OutboxError, RecordConflict

__all__ = [
    "DEV_ACCOUNTS",
    "Anvil",
    "AnvilError",
    "Artifact",
    "ArtifactError",
    "Chain",
    "ChainError",
    "ChainUnavailable",
    "Deployment",
    "DeploymentError",
    "Ledger",
    "Outbox",
    "OutboxError",
    "RecordConflict",
    "Registry",
    "RevertDecoder",
    "TxReverted",
    "anvil_binary",
    "deploy",
    "ledger_artifact",
    "load_artifact",
    "registry_artifact",
]
