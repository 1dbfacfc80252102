// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {Ownable} from "@openzeppelin/contracts/access/Ownable.sol";
import {IERC20} from "@openzeppelin/contracts/token/ERC20/IERC20.sol";
import {IContributionLedger} from "../src/IContributionLedger.sol";
import {IDisputes} from "../src/IDisputes.sol";
import {IRewardPool} from "../src/IRewardPool.sol";
import {RewardPool} from "../src/RewardPool.sol";
import {RewardToken} from "../src/RewardToken.sol";
import {DisputesBase} from "./DisputesBase.sol";

/// @dev Auditor admission, verdicts (upheld and refused), their effect on the ledger's tallies and the
/// pool's claims, and the funder's reclaim of unpaid shares.
contract DisputesTest is DisputesBase {
    RewardToken internal token;
    RewardPool internal pool;

    uint128 internal constant FUNDED = 1_000_003; // not a multiple of anything: rounding matters
    uint64 internal constant ROUNDS = 4;

    function setUp() public override {
        super.setUp();
        token = new RewardToken(address(this));
        pool = new RewardPool(ledger, IERC20(address(token)));
        token.mint(COORDINATOR, uint256(FUNDED));
        vm.startPrank(COORDINATOR);
        token.approve(address(pool), type(uint256).max);
        pool.openPool(RUN, FUNDED, ROUNDS);
        vm.stopPrank();
    }

    /// @dev Records `round` with workers 0..n-1 at block `at`; returns its facts.
    function _round(uint64 round, uint256 n, uint64 at) internal returns (IContributionLedger.RoundFacts memory) {
        vm.roll(at);
        record(round, batch(n, round));
        return facts(round, at, batchWorkers(n), 0);
    }

    function _claim(address w, uint64 round, uint256 index, IContributionLedger.RoundFacts memory f)
        internal
        returns (uint256)
    {
        IRewardPool.RoundClaim[] memory c = new IRewardPool.RoundClaim[](1);
        c[0] = IRewardPool.RoundClaim({round: round, index: index, facts: f});
        return pool.claim(RUN, w, c);
    }

    function _proofs(uint64 round, IContributionLedger.RoundFacts memory f)
        internal
        pure
        returns (IRewardPool.RoundProof[] memory p)
    {
        p = new IRewardPool.RoundProof[](1);
        p[0] = IRewardPool.RoundProof({round: round, facts: f});
    }

    // --- admission ---

    function testAdmissionByTheOwner() public {
        vm.expectEmit(true, true, false, true, address(disputes));
        emit IDisputes.AuditorAdmitted(RUN, auditor(0), AUDIT_MEASUREMENT, bytes32(uint256(7)));
        disputes.admitAuditor(RUN, auditor(0), AUDIT_MEASUREMENT, bytes32(uint256(7)));
        assertTrue(disputes.isAuditor(RUN, auditor(0)), "admitted");
        assertTrue(!disputes.isAuditor(keccak256("other run"), auditor(0)), "to this run only");
        (uint64 n, uint64 k) = disputes.panelOf(RUN);
        assertEq(n, 1, "auditors");
        assertEq(k, 0, "no threshold yet");
        assertEq(address(disputes.ledger()), address(ledger), "ledger");
        assertEq(disputes.owner(), address(this), "owned by the ledger's deployer");
    }

    function testAdmissionRefusals() public {
        vm.expectRevert(abi.encodeWithSelector(Ownable.OwnableUnauthorizedAccount.selector, COORDINATOR));
        vm.prank(COORDINATOR); // the judged party cannot pick its judges
        disputes.admitAuditor(RUN, auditor(0), AUDIT_MEASUREMENT, 0);
        vm.expectRevert(abi.encodeWithSelector(Ownable.OwnableUnauthorizedAccount.selector, VERIFIER));
        vm.prank(VERIFIER); // nor can a registry verifier (a coordinator is one)
        disputes.admitAuditor(RUN, auditor(0), AUDIT_MEASUREMENT, 0);
        bytes32 other = keccak256("no such run");
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesUnknownRun.selector, other));
        disputes.admitAuditor(other, auditor(0), AUDIT_MEASUREMENT, 0);
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesZeroAddress.selector));
        disputes.admitAuditor(RUN, address(0), AUDIT_MEASUREMENT, 0);
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesCoordinatorAuditor.selector, COORDINATOR));
        disputes.admitAuditor(RUN, COORDINATOR, AUDIT_MEASUREMENT, 0);
        disputes.admitAuditor(RUN, auditor(0), AUDIT_MEASUREMENT, 0);
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesAlreadyAdmitted.selector, RUN, auditor(0)));
        disputes.admitAuditor(RUN, auditor(0), AUDIT_MEASUREMENT, 0);
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesBadThreshold.selector, 0, 1));
        disputes.setThreshold(RUN, 0);
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesBadThreshold.selector, 2, 1));
        disputes.setThreshold(RUN, 2);
        vm.expectRevert(abi.encodeWithSelector(Ownable.OwnableUnauthorizedAccount.selector, COORDINATOR));
        vm.prank(COORDINATOR);
        disputes.setThreshold(RUN, 1);
    }

    // --- verdicts against a worker ---

    function testVerdictVoidsTheWorkersCreditAndItsPay() public {
        panel(1, 1);
        IContributionLedger.RoundFacts memory f = _round(1, 2, 100);
        address cheat = f.workers[1];
        address honest = f.workers[0];
        IDisputes.Verdict memory v = verdict(1, cheat);
        address[] memory signers = addresses(auditor(0));
        vm.expectEmit(true, true, true, true, address(ledger));
        emit IContributionLedger.CreditVoided(RUN, 1, cheat, TOKENS);
        vm.expectEmit(true, true, true, true, address(disputes));
        emit IDisputes.VerdictUpheld(RUN, 1, cheat, CHECK, EVIDENCE, signers);
        vm.roll(100 + WINDOW - 1); // the window's last block
        vm.prank(address(0xBEEF)); // anyone may submit it
        disputes.dispute(v, f, 1, signedBy(1, v));

        assertTrue(disputes.isVoided(RUN, 1, cheat), "voided");
        assertTrue(!disputes.isVoided(RUN, 1, honest), "the honest worker's credit stands");
        assertEq(ledger.contributionOf(RUN, cheat).rounds, 0, "run tally");
        assertEq(ledger.contributionOf(RUN, cheat).tokens, 0, "run tally tokens");
        assertEq(ledger.totalContributionOf(cheat).tokens, 0, "total");
        assertEq(ledger.contributionOf(RUN, honest).tokens, TOKENS, "honest tally");

        vm.roll(100 + WINDOW);
        uint256 share = (uint256(FUNDED) / ROUNDS) / 2;
        assertEq(_claim(honest, 1, 0, f), share, "honest worker paid in full");
        IRewardPool.RoundClaim[] memory c = new IRewardPool.RoundClaim[](1);
        c[0] = IRewardPool.RoundClaim({round: 1, index: 1, facts: f});
        vm.expectRevert(abi.encodeWithSelector(IRewardPool.RewardPoolVoided.selector, 1, cheat));
        pool.claim(RUN, cheat, c);

        // the cheat is credited again in a later round: its run is listed once, its tallies count that round
        _round(2, 2, 200);
        assertEq(ledger.runsOf(cheat).length, 1, "run listed once");
        assertEq(ledger.totalContributionOf(cheat).rounds, 1, "later round counted");
    }

    /// @dev Round 1 recorded at block 100 with two workers, and a verdict against the second.
    function _refusable() internal returns (IContributionLedger.RoundFacts memory f, IDisputes.Verdict memory v) {
        f = _round(1, 2, 100);
        v = verdict(1, f.workers[1]);
    }

    function testVerdictWithoutAPanelRefused() public {
        (IContributionLedger.RoundFacts memory f, IDisputes.Verdict memory v) = _refusable();
        bytes[] memory sigs = signedBy(1, v);
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesNoPanel.selector, RUN));
        disputes.dispute(v, f, 1, sigs);
    }

    function testVerdictOnAnUnprovenRoundRefused() public {
        panel(1, 1);
        (IContributionLedger.RoundFacts memory f, IDisputes.Verdict memory v) = _refusable();
        IDisputes.Verdict memory unrecorded = verdict(2, f.workers[1]);
        bytes[] memory sigs = signedBy(1, unrecorded);
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesRoundNotRecorded.selector, 2));
        disputes.dispute(unrecorded, f, 1, sigs);
        IContributionLedger.RoundFacts memory forged = facts(1, 100, addresses(f.workers[1]), 0);
        sigs = signedBy(1, v);
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesBadProof.selector, 1));
        disputes.dispute(v, forged, 0, sigs);
    }

    function testVerdictOnAWorkerNotCreditedRefused() public {
        panel(1, 1);
        (IContributionLedger.RoundFacts memory f, IDisputes.Verdict memory v) = _refusable();
        bytes[] memory sigs = signedBy(1, v);
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesNotCredited.selector, 1, f.workers[1]));
        disputes.dispute(v, f, 0, sigs);
        IDisputes.Verdict memory outsider = verdict(1, worker(4));
        sigs = signedBy(1, outsider);
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesNotCredited.selector, 1, worker(4)));
        disputes.dispute(outsider, f, 0, sigs);
    }

    function testVerdictWithBadSignaturesRefused() public {
        panel(1, 1);
        (IContributionLedger.RoundFacts memory f, IDisputes.Verdict memory v) = _refusable();
        bytes[] memory sigs = new bytes[](0);
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesTooFewSignatures.selector, 0, 1));
        disputes.dispute(v, f, 1, sigs);
        sigs = new bytes[](1);
        sigs[0] = signVerdict(0xBAD, v); // an unadmitted key
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesNotAuditor.selector, vm.addr(0xBAD)));
        disputes.dispute(v, f, 1, sigs);
        sigs[0] = signVerdict(key(0), v); // an admitted worker is not an auditor
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesNotAuditor.selector, worker(0)));
        disputes.dispute(v, f, 1, sigs);
        sigs[0] = hex"01";
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesInvalidSignature.selector, 0));
        disputes.dispute(v, f, 1, sigs);
        sigs = new bytes[](2);
        sigs[0] = signVerdict(auditorKey(0), v);
        sigs[1] = sigs[0];
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesDuplicateSigner.selector, 1));
        disputes.dispute(v, f, 1, sigs);
    }

    function testVerdictAfterTheWindowOrRepeatedRefused() public {
        panel(1, 1);
        (IContributionLedger.RoundFacts memory f, IDisputes.Verdict memory v) = _refusable();
        bytes[] memory sigs = signedBy(1, v);
        vm.roll(100 + WINDOW);
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesWindowClosed.selector, 1, 100 + WINDOW));
        disputes.dispute(v, f, 1, sigs);
        vm.roll(100);
        disputes.dispute(v, f, 1, sigs);
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesAlreadyVoided.selector, 1, f.workers[1]));
        disputes.dispute(v, f, 1, sigs);
        v.check = keccak256("rederive"); // the same party and round for another check: still once
        sigs = signedBy(1, v);
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesAlreadyVoided.selector, 1, f.workers[1]));
        disputes.dispute(v, f, 1, sigs);
    }

    function testOnlyTheDisputesContractVoidsCredit() public {
        _round(1, 1, 100);
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerNotDisputes.selector, COORDINATOR));
        vm.prank(COORDINATOR);
        ledger.voidCredit(RUN, 1, worker(0), TOKENS);
    }

    function testTwoOfThree() public {
        panel(3, 2);
        IContributionLedger.RoundFacts memory f = _round(1, 2, 100);
        IDisputes.Verdict memory v = verdict(1, f.workers[0]);
        bytes[] memory one_ = signedBy(4, v);
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesTooFewSignatures.selector, 1, 2));
        disputes.dispute(v, f, 0, one_);
        bytes[] memory reversed = signedBy(5, v);
        (reversed[0], reversed[1]) = (reversed[1], reversed[0]);
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesDuplicateSigner.selector, 1));
        disputes.dispute(v, f, 0, reversed);
        disputes.dispute(v, f, 0, signedBy(6, v));
        assertTrue(disputes.isVoided(RUN, 1, f.workers[0]), "voided by two of three");
        (bool whole, uint64 workers) = disputes.voidsOf(RUN, 1);
        assertTrue(!whole, "not the round");
        assertEq(workers, 1, "one worker");
    }

    // --- verdicts against the coordinator ---

    function testVerdictAgainstTheCoordinatorVoidsTheRound() public {
        panel(1, 1);
        IContributionLedger.RoundFacts memory f = _round(1, 3, 100);
        IDisputes.Verdict memory first = verdict(1, f.workers[2]);
        disputes.dispute(first, f, 2, signedBy(1, first)); // one worker voided before the round
        IDisputes.Verdict memory v = verdict(1, COORDINATOR);
        bytes[] memory sigs = signedBy(1, v);
        disputes.dispute(v, f, 0, sigs);
        for (uint256 i = 0; i < 3; ++i) {
            assertTrue(disputes.isVoided(RUN, 1, f.workers[i]), "every credit voided");
            assertEq(ledger.contributionOf(RUN, f.workers[i]).rounds, 0, "taken off once");
        }
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesAlreadyVoided.selector, 1, COORDINATOR));
        disputes.dispute(v, f, 0, sigs);
        vm.roll(100 + WINDOW);
        IRewardPool.RoundClaim[] memory c = new IRewardPool.RoundClaim[](1);
        c[0] = IRewardPool.RoundClaim({round: 1, index: 0, facts: f});
        vm.expectRevert(abi.encodeWithSelector(IRewardPool.RewardPoolVoided.selector, 1, f.workers[0]));
        pool.claim(RUN, f.workers[0], c);
        vm.prank(COORDINATOR);
        assertEq(pool.reclaim(RUN, _proofs(1, f)), uint256(FUNDED) / ROUNDS, "the whole round back to the funder");
    }

    function testVerdictAgainstTheCoordinatorThatHeldTheRoundAfterAHandover() public {
        panel(1, 1);
        IContributionLedger.RoundFacts memory f = _round(1, 2, 100);
        address successor = address(0x5EC0);
        vm.prank(COORDINATOR);
        ledger.handOver(RUN, successor);
        // Round 1 was COORDINATOR's: a verdict against the successor names a party not in it.
        IDisputes.Verdict memory wrong = verdict(1, successor);
        bytes[] memory wrongSigs = signedBy(1, wrong);
        vm.expectRevert(abi.encodeWithSelector(IDisputes.DisputesNotCredited.selector, 1, successor));
        disputes.dispute(wrong, f, 0, wrongSigs);
        IDisputes.Verdict memory v = verdict(1, COORDINATOR);
        disputes.dispute(v, f, 0, signedBy(1, v));
        assertTrue(disputes.isVoided(RUN, 1, f.workers[0]), "the round is voided though its coordinator left");
    }

    // --- reclaim ---

    function testReclaimReturnsWhatARoundLeavesUnpaid() public {
        panel(1, 1);
        uint256 p = uint256(FUNDED) / ROUNDS;
        IContributionLedger.RoundFacts memory f1 = _round(1, 3, 100);
        IDisputes.Verdict memory v = verdict(1, f1.workers[1]);
        disputes.dispute(v, f1, 1, signedBy(1, v));
        vm.roll(101);
        bytes32[] memory ghosts = new bytes32[](1);
        ghosts[0] = ghost(0, 2);
        recordWith(header(2), new IContributionLedger.WorkerReport[](0), ghosts); // credited to nobody
        IContributionLedger.RoundFacts memory f2 = facts(2, 101, new address[](0), 1);

        IRewardPool.RoundProof[] memory early = _proofs(2, f2);
        vm.expectRevert(abi.encodeWithSelector(IRewardPool.RewardPoolNotMatured.selector, 2, 101 + WINDOW));
        vm.prank(COORDINATOR);
        pool.reclaim(RUN, early);
        vm.roll(200);
        vm.expectRevert(abi.encodeWithSelector(IRewardPool.RewardPoolNotFunder.selector, address(this)));
        pool.reclaim(RUN, early);

        IRewardPool.RoundProof[] memory both = new IRewardPool.RoundProof[](2);
        both[0] = IRewardPool.RoundProof({round: 1, facts: f1});
        both[1] = IRewardPool.RoundProof({round: 2, facts: f2});
        vm.expectEmit(true, true, false, true, address(pool));
        emit IRewardPool.RoundReclaimed(RUN, 1, p - 2 * (p / 3));
        vm.prank(COORDINATOR);
        uint256 back = pool.reclaim(RUN, both);
        assertEq(back, p - 2 * (p / 3) + p, "round 1's voided share and remainder, round 2 whole");
        assertEq(token.balanceOf(COORDINATOR), back, "to the funder");
        assertEq(pool.reclaimedOf(RUN), back, "reclaimed");
        assertTrue(pool.isReclaimed(RUN, 1), "marked");
        vm.expectRevert(abi.encodeWithSelector(IRewardPool.RewardPoolAlreadyReclaimed.selector, 2));
        vm.prank(COORDINATOR);
        pool.reclaim(RUN, early);

        _claim(f1.workers[0], 1, 0, f1);
        _claim(f1.workers[2], 1, 2, f1);
        assertEq(pool.poolOf(RUN).paid + pool.reclaimedOf(RUN), 2 * p, "two rounds accounted for whole");
    }

    /// @dev Any subset of a round's workers voided, any claims, the reclaim: the round pays out exactly its
    /// share (plus the funding's remainder for the last round), never a voided credit.
    function testFuzzRoundAccountsForItsShare(uint256 credited, uint256 voidMask, uint256 claimMask, bool last)
        public
    {
        panel(1, 1);
        uint256 n = bound(credited, 0, WORKERS);
        uint64 round = last ? ROUNDS : 1;
        if (last) {
            for (uint64 r = 1; r < ROUNDS; ++r) {
                _round(r, 1, 10 * r);
            }
        }
        IContributionLedger.RoundFacts memory f;
        if (n == 0) {
            bytes32[] memory ghosts = new bytes32[](1);
            ghosts[0] = ghost(0, round);
            vm.roll(100);
            recordWith(header(round), new IContributionLedger.WorkerReport[](0), ghosts);
            f = facts(round, 100, new address[](0), 1);
        } else {
            f = _round(round, n, 100);
        }
        for (uint256 i = 0; i < n; ++i) {
            // forge-lint: disable-next-line(incorrect-shift) -- bit i of the mask
            if (voidMask & (1 << i) != 0) {
                IDisputes.Verdict memory v = verdict(round, f.workers[i]);
                disputes.dispute(v, f, i, signedBy(1, v));
            }
        }
        uint256 paidBefore = pool.poolOf(RUN).paid;
        vm.roll(100 + WINDOW);
        for (uint256 i = 0; i < n; ++i) {
            // forge-lint: disable-next-line(incorrect-shift) -- bit i of the mask
            if (claimMask & (1 << i) == 0) continue;
            IRewardPool.RoundClaim[] memory c = new IRewardPool.RoundClaim[](1);
            c[0] = IRewardPool.RoundClaim({round: round, index: i, facts: f});
            // forge-lint: disable-next-line(incorrect-shift) -- bit i of the mask
            if (voidMask & (1 << i) != 0) {
                vm.expectRevert(abi.encodeWithSelector(IRewardPool.RewardPoolVoided.selector, round, f.workers[i]));
            }
            pool.claim(RUN, f.workers[i], c);
        }
        vm.prank(COORDINATOR);
        pool.reclaim(RUN, _proofs(round, f));
        for (uint256 i = 0; i < n; ++i) {
            // forge-lint: disable-next-line(incorrect-shift) -- bit i of the mask
            if (claimMask & (1 << i) == 0 && voidMask & (1 << i) == 0) _claim(f.workers[i], round, i, f);
        }
        uint256 share = uint256(FUNDED) / ROUNDS + (last ? uint256(FUNDED) % ROUNDS : 0);
        assertEq(pool.poolOf(RUN).paid - paidBefore + pool.reclaimedOf(RUN), share, "the round's share, exactly");
        assertTrue(pool.poolOf(RUN).paid + pool.reclaimedOf(RUN) <= FUNDED, "paid + reclaimed <= funded");
    }
}
