"""Verdicts with teeth on a real anvil, through the Python clients (nothing mocked): an auditor key made
under the dev attestation provider, bound to the audit code's measurement, admitted by the disputes
contract's owner; its EIP-712 verdict (digest equal to the contract's) voids a worker's credit inside
the window; the pool then refuses that credit while the honest worker is paid in full, and returns what
the round leaves unpaid to the funder; a verdict from an unadmitted key, after the window, or twice is
refused by name. Costs ~3 s of CPU (one anvil, no training).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from attestation import Policy, open_provider
from attestation.dev import DevRoot
from attestation.keys import WorkerKey
from attestation.measurement import audit_code_measurement
from attestation.verdict import Verdict
from audit.auditor import Auditor, admit
from settlement import TxReverted
from settlement.disputes import Disputes
from settlement.provision import fund_pool, mine
from settlement.rewards import RewardPool, RewardToken
from storage_client import CID, Codec, open_store

from .test_settlement import Setup, anvil, h, make_setup, record  # noqa: F401  (anvil: the fixture)

pytestmark = pytest.mark.integration

WINDOW = 30
FUNDED = 1_000_003
ROUNDS = 2


@pytest.fixture
def disputed(anvil, tmp_path: Path) -> tuple[Setup, Disputes, Auditor]:
    s = make_setup(anvil)
    s.ledger.create_run(s.run_id, s.genesis, h("config"), s.run_id, challenge_window=WINDOW)
    fund_pool(s.coordinator, s.deployment, s.run_id, FUNDED, ROUNDS, minter=s.owner)
    root = DevRoot.load_or_create(tmp_path / "dev-root")
    config_cid = str(CID(Codec.JSON, h("config")))
    auditor = Auditor.attest(open_provider("dev", dev_root_dir=tmp_path / "dev-root"), s.run_id, config_cid)
    owner = Disputes(s.owner, s.ledger.disputes_address(), from_block=s.deployment.deployed_block)
    record_cid = admit(owner, open_store(tmp_path / "run"), auditor, config_cid,
                       Policy.development(root.address))
    assert owner.admissions(s.run_id)[0].evidence_digest == record_cid.digest
    assert owner.admissions(s.run_id)[0].measurement == audit_code_measurement(config_cid)
    return s, owner, auditor


def test_a_verdict_voids_a_credit_and_its_pay(disputed: tuple[Setup, Disputes, Auditor]) -> None:
    s, disputes, auditor = disputed
    record(s, 1)
    record(s, 2)
    rounds = s.ledger.recorded_rounds(s.run_id)
    cheat, honest = rounds[0].workers[1], rounds[0].workers[0]
    verdict = Verdict(s.run_id, 1, cheat, "replay", h("update", 1, 1))
    assert disputes.verdict_digest(verdict) == verdict.digest(disputes.domain())
    assert disputes.panel_of(s.run_id) == (1, 1)

    with pytest.raises(TxReverted) as refused:  # an unadmitted key: a worker's, or any other
        disputes.dispute(verdict, rounds[0], [WorkerKey.generate().sign_digest(verdict.digest(disputes.domain()))])
    assert refused.value.error == "DisputesNotAuditor"
    disputes.dispute(verdict, rounds[0], [auditor.sign(verdict, disputes)])
    assert disputes.is_voided(s.run_id, 1, cheat) and not disputes.is_voided(s.run_id, 1, honest)
    with pytest.raises(TxReverted) as refused:
        disputes.dispute(verdict, rounds[0], [auditor.sign(verdict, disputes)])
    assert refused.value.error == "DisputesAlreadyVoided"
    assert s.ledger.contribution_of(s.run_id, cheat).rounds == 1  # round 2 only
    assert [(v.worker, v.round) for v in s.ledger.voided_credits(s.run_id)] == [(cheat, 1)]
    upheld = disputes.verdicts(s.run_id)
    assert [(v.round, v.party, v.signers) for v in upheld] == [(1, cheat, (auditor.address,))]

    mine(s.owner, WINDOW)
    late = Verdict(s.run_id, 2, cheat, "replay", h("update", 2, 1))
    with pytest.raises(TxReverted) as refused:
        disputes.dispute(late, rounds[1], [auditor.sign(late, disputes)])
    assert refused.value.error == "DisputesWindowClosed"

    pool = RewardPool(s.owner, s.deployment.rewards, s.ledger, from_block=s.deployment.deployed_block)
    share = FUNDED // ROUNDS // 2
    statement = pool.statement(s.run_id)
    assert statement.workers[cheat].voided == [1] and statement.workers[cheat].claimable == share
    assert pool.claim(s.run_id, cheat)[0] == share  # round 2 only: round 1 is not claimed
    assert pool.claim(s.run_id, honest)[0] == 2 * share  # paid in full
    funder = RewardPool(s.coordinator, s.deployment.rewards, s.ledger, from_block=s.deployment.deployed_block)
    back, _ = funder.reclaim(s.run_id)
    assert back == FUNDED - 3 * share  # the voided share and every rounding remainder
    statement = pool.statement(s.run_id)
    assert statement.paid + statement.reclaimed == FUNDED == statement.paid + statement.pool_reclaimed
    token = RewardToken(s.owner, s.deployment.token)
    assert token.balance_of(s.deployment.rewards) == 0
