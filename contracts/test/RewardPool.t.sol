// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {IERC20} from "@openzeppelin/contracts/token/ERC20/IERC20.sol";
import {IContributionLedger} from "../src/IContributionLedger.sol";
import {IRewardPool} from "../src/IRewardPool.sol";
import {RewardPool} from "../src/RewardPool.sol";
import {RewardToken} from "../src/RewardToken.sol";
import {LedgerBase} from "./LedgerBase.sol";
import {LyingLedger} from "./LyingLedger.sol";

contract RewardPoolTest is LedgerBase {
    RewardToken internal token;
    RewardPool internal pool;

    uint128 internal constant FUNDED = 1_000_003; // not a multiple of anything: rounding matters
    uint64 internal constant ROUNDS = 4;

    function setUp() public override {
        super.setUp();
        token = new RewardToken(address(this));
        pool = new RewardPool(ledger, IERC20(address(token)));
        token.mint(COORDINATOR, 10 * uint256(FUNDED));
        vm.prank(COORDINATOR);
        token.approve(address(pool), type(uint256).max);
    }

    function _open() internal {
        vm.prank(COORDINATOR);
        pool.openPool(RUN, FUNDED, ROUNDS);
    }

    /// @dev Records `round` with workers 0..n-1 at block `at`; returns the round's facts.
    function _round(uint64 round, uint256 n, uint64 at) internal returns (IContributionLedger.RoundFacts memory) {
        vm.roll(at);
        record(round, batch(n, round));
        return facts(round, at, batchWorkers(n), 0);
    }

    function _claimOf(uint64 round, uint256 index, IContributionLedger.RoundFacts memory f)
        internal
        pure
        returns (IRewardPool.RoundClaim[] memory c)
    {
        c = new IRewardPool.RoundClaim[](1);
        c[0] = IRewardPool.RoundClaim({round: round, index: index, facts: f});
    }

    // --- opening ---

    function testOpenPool() public {
        vm.expectEmit(true, true, false, true, address(pool));
        emit IRewardPool.PoolOpened(RUN, COORDINATOR, FUNDED, ROUNDS);
        _open();
        assertEq(token.balanceOf(address(pool)), FUNDED, "funded");
        IRewardPool.Pool memory p = pool.poolOf(RUN);
        assertEq(p.funder, COORDINATOR, "funder");
        assertEq(p.totalRounds, ROUNDS, "rounds");
        assertEq(p.funded, FUNDED, "amount");
        assertEq(p.paid, 0, "paid");
    }

    function testOpenSnapshotsTheChallengeWindow() public {
        assertEq(pool.challengeWindowOf(RUN), 0, "no pool, no window");
        vm.expectEmit(true, false, false, true, address(pool));
        emit IRewardPool.ChallengeWindowSnapshotted(RUN, WINDOW);
        _open();
        assertEq(pool.challengeWindowOf(RUN), WINDOW, "the run's window when opened");
    }

    /// @dev A ledger that shortens the run's window after the pool was opened cannot make a round
    /// payable sooner: maturity is decided by the snapshot.
    function testLaterWindowOfTheLedgerIgnored() public {
        LyingLedger liar = new LyingLedger(registry);
        RewardPool exposed = new RewardPool(liar, IERC20(address(token)));
        vm.startPrank(COORDINATOR);
        liar.createRun(RUN, GENESIS, CONFIG, GENESIS_MANIFEST, WINDOW);
        token.approve(address(exposed), type(uint256).max);
        exposed.openPool(RUN, FUNDED, ROUNDS);
        liar.createRun(RUN, GENESIS, CONFIG, GENESIS_MANIFEST, 0); // the ledger now says: no window
        vm.stopPrank();
        assertEq(liar.runOf(RUN).challengeWindow, 0, "the ledger's answer changed");
        assertEq(exposed.challengeWindowOf(RUN), WINDOW, "the snapshot did not");

        IContributionLedger.RoundFacts memory f = facts(1, 100, addresses(worker(0)), 0);
        liar.forgeCommitment(RUN, 1, liar.commitmentOf(f));
        vm.roll(100 + WINDOW - 1);
        IRewardPool.RoundClaim[] memory c = _claimOf(1, 0, f);
        vm.expectRevert(abi.encodeWithSelector(IRewardPool.RewardPoolNotMatured.selector, 1, 100 + WINDOW));
        exposed.claim(RUN, worker(0), c);
        vm.roll(100 + WINDOW);
        assertEq(exposed.claim(RUN, worker(0), c), uint256(FUNDED) / ROUNDS, "payable at the snapshot's block");
    }

    function testOnlyTheCoordinatorOpens() public {
        vm.expectRevert(abi.encodeWithSelector(IRewardPool.RewardPoolNotCoordinator.selector, worker(0)));
        vm.prank(worker(0));
        pool.openPool(RUN, FUNDED, ROUNDS);
    }

    function testOpenOnce() public {
        _open();
        vm.expectRevert(abi.encodeWithSelector(IRewardPool.RewardPoolExists.selector, RUN));
        vm.prank(COORDINATOR);
        pool.openPool(RUN, FUNDED, ROUNDS);
    }

    function testEmptyPoolRefused() public {
        vm.expectRevert(abi.encodeWithSelector(IRewardPool.RewardPoolEmpty.selector));
        vm.prank(COORDINATOR);
        pool.openPool(RUN, 0, ROUNDS);
        vm.expectRevert(abi.encodeWithSelector(IRewardPool.RewardPoolEmpty.selector));
        vm.prank(COORDINATOR);
        pool.openPool(RUN, FUNDED, 0);
    }

    // --- claims ---

    function testClaimAfterTheWindowPaysTheWorker() public {
        _open();
        IContributionLedger.RoundFacts memory f = _round(1, 3, 100);
        uint256 share = (uint256(FUNDED) / ROUNDS) / 3;
        assertEq(pool.rewardPerWorker(RUN, 1, 3), share, "share");
        vm.roll(100 + WINDOW);
        address w = f.workers[2];
        vm.expectEmit(true, true, true, true, address(pool));
        emit IRewardPool.RewardPaid(RUN, w, 1, share);
        vm.prank(address(0xBEEF)); // anyone may send it; the worker is paid
        uint256 paid = pool.claim(RUN, w, _claimOf(1, 2, f));
        assertEq(paid, share, "returned");
        assertEq(token.balanceOf(w), share, "paid to the worker");
        assertEq(token.balanceOf(address(0xBEEF)), 0, "not to the sender");
        assertEq(pool.isClaimed(RUN, w, 1), true, "claimed");
        assertEq(pool.poolOf(RUN).paid, share, "pool paid");
    }

    function testClaimInsideTheWindowRefused() public {
        _open();
        IContributionLedger.RoundFacts memory f = _round(1, 2, 100);
        vm.roll(100 + WINDOW - 1);
        IRewardPool.RoundClaim[] memory c = _claimOf(1, 0, f);
        vm.expectRevert(abi.encodeWithSelector(IRewardPool.RewardPoolNotMatured.selector, 1, 100 + WINDOW));
        pool.claim(RUN, f.workers[0], c);
    }

    function testDoubleClaimRefused() public {
        _open();
        IContributionLedger.RoundFacts memory f = _round(1, 2, 100);
        vm.roll(200);
        pool.claim(RUN, f.workers[0], _claimOf(1, 0, f));
        IRewardPool.RoundClaim[] memory c = _claimOf(1, 0, f);
        vm.expectRevert(abi.encodeWithSelector(IRewardPool.RewardPoolAlreadyClaimed.selector, 1, f.workers[0]));
        pool.claim(RUN, f.workers[0], c);
    }

    function testUnrecordedRoundRefused() public {
        _open();
        IContributionLedger.RoundFacts memory f = facts(1, 100, batchWorkers(2), 0);
        vm.roll(200);
        IRewardPool.RoundClaim[] memory c = _claimOf(1, 0, f);
        vm.expectRevert(abi.encodeWithSelector(IRewardPool.RewardPoolBadProof.selector, 1));
        pool.claim(RUN, f.workers[0], c);
    }

    function testForgedFactsRefused() public {
        _open();
        IContributionLedger.RoundFacts memory f = _round(1, 3, 100);
        vm.roll(200);
        // claiming to be the round's only worker, for the whole round's share
        IContributionLedger.RoundFacts memory forged = facts(1, 100, addresses(f.workers[0]), 0);
        IRewardPool.RoundClaim[] memory c = _claimOf(1, 0, forged);
        vm.expectRevert(abi.encodeWithSelector(IRewardPool.RewardPoolBadProof.selector, 1));
        pool.claim(RUN, f.workers[0], c);
        // or an earlier block, to dodge the window
        forged = facts(1, 1, f.workers, 0);
        c = _claimOf(1, 0, forged);
        vm.expectRevert(abi.encodeWithSelector(IRewardPool.RewardPoolBadProof.selector, 1));
        pool.claim(RUN, f.workers[0], c);
    }

    function testNonContributorRefused() public {
        _open();
        IContributionLedger.RoundFacts memory f = _round(1, 2, 100);
        vm.roll(200);
        IRewardPool.RoundClaim[] memory c = _claimOf(1, 0, f);
        vm.expectRevert(abi.encodeWithSelector(IRewardPool.RewardPoolNotContributor.selector, 1, worker(4)));
        pool.claim(RUN, worker(4), c);
        c = _claimOf(1, 7, f);
        vm.expectRevert(abi.encodeWithSelector(IRewardPool.RewardPoolNotContributor.selector, 1, f.workers[0]));
        pool.claim(RUN, f.workers[0], c);
    }

    function testNoPoolRefused() public {
        IContributionLedger.RoundFacts memory f = _round(1, 1, 100);
        IRewardPool.RoundClaim[] memory c = _claimOf(1, 0, f);
        vm.expectRevert(abi.encodeWithSelector(IRewardPool.RewardPoolNotOpened.selector, RUN));
        pool.claim(RUN, f.workers[0], c);
    }

    function testRoundsPastThePoolPayNothing() public {
        vm.prank(COORDINATOR);
        pool.openPool(RUN, FUNDED, 1);
        _round(1, 1, 10);
        IContributionLedger.RoundFacts memory f = _round(2, 1, 20);
        vm.roll(100);
        assertEq(pool.claim(RUN, f.workers[0], _claimOf(2, 0, f)), 0, "round 2 of a 1-round pool");
    }

    function testClaimSeveralRoundsAtOnce() public {
        _open();
        IRewardPool.RoundClaim[] memory c = new IRewardPool.RoundClaim[](3);
        uint256 want;
        for (uint64 round = 1; round <= 3; ++round) {
            uint256 n = round; // 1, 2, 3 workers
            IContributionLedger.RoundFacts memory f = _round(round, n, 10 * round);
            uint256 index;
            while (f.workers[index] != worker(0)) ++index;
            c[round - 1] = IRewardPool.RoundClaim({round: round, index: index, facts: f});
            want += (uint256(FUNDED) / ROUNDS) / n;
        }
        vm.roll(100);
        assertEq(pool.claim(RUN, worker(0), c), want, "sum of the rounds");
        assertEq(token.balanceOf(worker(0)), want, "paid once");
    }

    /// @dev Whatever the funding, number of rounds and participation, every payout is
    /// ⌊⌊funded / totalRounds⌋ / n⌋ and the pool never pays out more than it was funded with.
    function testFuzzProRataNeverOverpays(uint128 funded, uint8 totalRounds, uint8 recorded, uint256 masks) public {
        funded = uint128(bound(funded, 1, type(uint128).max / 2));
        uint64 total = uint64(bound(totalRounds, 1, 6));
        uint64 n = uint64(bound(recorded, 1, 8)); // may record more rounds than the pool pays for
        token.mint(COORDINATOR, funded);
        vm.prank(COORDINATOR);
        pool.openPool(RUN, funded, total);

        IContributionLedger.RoundFacts[] memory all = new IContributionLedger.RoundFacts[](n);
        for (uint64 round = 1; round <= n; ++round) {
            uint256 mask = (masks >> (5 * (round - 1))) & 0x1f;
            if (mask == 0) mask = 1;
            (IContributionLedger.WorkerReport[] memory s, address[] memory w) = subset(mask, round);
            vm.roll(round);
            record(round, s);
            all[round - 1] = facts(round, round, w, 0);
        }
        vm.roll(1000);
        uint256 paid;
        for (uint64 round = 1; round <= n; ++round) {
            IContributionLedger.RoundFacts memory f = all[round - 1];
            for (uint256 i = 0; i < f.workers.length; ++i) {
                uint256 got = pool.claim(RUN, f.workers[i], _claimOf(round, i, f));
                uint256 want = round <= total ? (uint256(funded) / total) / f.workers.length : 0;
                assertEq(got, want, "payout");
                paid += got;
            }
        }
        assertTrue(paid <= funded, "never more than funded");
        assertEq(pool.poolOf(RUN).paid, paid, "pool's record");
        assertEq(token.balanceOf(address(pool)), funded - paid, "the rest stays");
    }

    /// @dev A ledger that answers each claimer with a round of its own (so each takes the whole round)
    /// cannot make the pool pay past the run's funding.
    function testLyingLedgerCannotOverpay() public {
        LyingLedger liar = new LyingLedger(registry);
        RewardPool exposed = new RewardPool(liar, IERC20(address(token)));
        vm.prank(COORDINATOR);
        liar.createRun(RUN, GENESIS, CONFIG, GENESIS_MANIFEST, 0);
        vm.prank(COORDINATOR);
        token.approve(address(exposed), type(uint256).max);
        vm.prank(COORDINATOR);
        exposed.openPool(RUN, 100, 1);
        vm.roll(50);
        IContributionLedger.RoundFacts memory a = facts(1, 1, addresses(worker(0)), 0);
        liar.forgeCommitment(RUN, 1, liar.commitmentOf(a));
        assertEq(exposed.claim(RUN, worker(0), _claimOf(1, 0, a)), 100, "the whole round to w0");
        IContributionLedger.RoundFacts memory b = facts(1, 1, addresses(worker(1)), 0);
        liar.forgeCommitment(RUN, 1, liar.commitmentOf(b));
        IRewardPool.RoundClaim[] memory c = _claimOf(1, 0, b);
        vm.expectRevert(abi.encodeWithSelector(IRewardPool.RewardPoolExhausted.selector, RUN));
        exposed.claim(RUN, worker(1), c);
        assertEq(token.balanceOf(address(exposed)), 0, "paid exactly the funding");
    }
}
