// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {IERC20} from "@openzeppelin/contracts/token/ERC20/IERC20.sol";
import {IContributionLedger} from "../src/IContributionLedger.sol";
import {IDisputes} from "../src/IDisputes.sol";
import {IRewardPool} from "../src/IRewardPool.sol";
import {RewardPool} from "../src/RewardPool.sol";
import {RewardToken} from "../src/RewardToken.sol";
import {InvariantBase} from "./Base.sol";
import {DisputesBase} from "./DisputesBase.sol";
import {LyingLedger} from "./LyingLedger.sol";

/**
 * @dev TEST ONLY. The actions of the invariant runs, over the test run of {LedgerBase}: record a round
 * of any subset of the workers (sometimes with one worker's report twice, which the ledger must
 * refuse), let blocks pass, claim any credited (worker, round) (sometimes again), and claim from a
 * second pool over a {LyingLedger} that forges each claimer a round of its own, uphold verdicts (1 of
 * 1) against a credited worker or the coordinator of a round (refused once its window is over or
 * repeated), and reclaim a round's unpaid share for the funder. It keeps ghost records of what
 * succeeded; {checkPaid}, {checkCredits} and {checkVoided} compare them with the contracts.
 *
 * A call the contracts must accept reverts the action (the runs fail on revert); one they may refuse
 * is tried and, when refused, leaves the ghosts as they were.
 */
contract PoolHandler is DisputesBase {
    uint128 internal constant FUNDED = 1_000_003; // not a multiple of anything: rounding matters
    uint64 internal constant POOL_ROUNDS = 4; // rounds 5.. are recorded and claimed but pay 0
    uint64 internal constant MAX_ROUNDS = 12;
    uint64 internal constant LIAR_ROUNDS = 3; // the lying ledger's pools pay round 1 only
    bytes32 internal constant OTHER_RUN = keccak256("other run"); // the liar's second run, its tokens
    // in the same pool contract: what a missing funding check would pay from

    RewardToken internal token;
    RewardPool internal pool; // over the real ledger
    LyingLedger internal liar;
    RewardPool internal exposed; // over the liar, with a pool for RUN and one for OTHER_RUN

    /// @dev The facts of each recorded round (index round - 1), as the handler recorded them.
    IContributionLedger.RoundFacts[] internal recorded;
    /// @dev Rounds the handler saw `worker` credited in (each counted once).
    mapping(address worker => uint256) internal creditedRounds;
    /// @dev Successful claims per (pool contract, run, worker, round).
    mapping(RewardPool => mapping(bytes32 runId => mapping(address worker => mapping(uint64 round => uint256))))
        internal claims;
    /// @dev Tokens the successful claims of each (pool contract, run) returned.
    mapping(RewardPool => mapping(bytes32 runId => uint256)) internal claimed;
    /// @dev Rounds a verdict against the coordinator voided whole.
    mapping(uint64 round => bool) internal roundVoided;
    /// @dev Rounds with a worker's report twice that the ledger accepted (must stay 0).
    uint256 internal duplicatesAccepted;
    /// @dev Successful claims of a (pool, worker, round) already paid (must stay 0).
    uint256 internal claimsRepeated;
    /// @dev Credits (worker, round) an upheld verdict voided, and how many each worker lost.
    mapping(address worker => mapping(uint64 round => bool)) internal voided;
    mapping(address worker => uint256) internal voidedRounds;
    /// @dev Successful claims of a voided credit (must stay 0).
    uint256 internal voidedPaid;
    /// @dev Verdicts upheld, and tokens the funder reclaimed from the real ledger's pool.
    uint256 internal verdicts;
    uint256 internal reclaimed;

    /**
     * @dev An action's call was refused although the contracts must accept it.
     * @param what The call.
     */
    error HandlerUnexpectedRefusal(string what);

    constructor() {
        setUp();
        panel(1, 1);
        token = new RewardToken(address(this));
        pool = new RewardPool(ledger, IERC20(address(token)));
        liar = new LyingLedger(registry);
        exposed = new RewardPool(liar, IERC20(address(token)));
        token.mint(COORDINATOR, 3 * uint256(FUNDED));
        vm.startPrank(COORDINATOR);
        token.approve(address(pool), type(uint256).max);
        token.approve(address(exposed), type(uint256).max);
        pool.openPool(RUN, FUNDED, POOL_ROUNDS);
        liar.createRun(RUN, GENESIS, CONFIG, GENESIS_MANIFEST, 0);
        exposed.openPool(RUN, FUNDED, 1);
        liar.createRun(OTHER_RUN, GENESIS, CONFIG, GENESIS_MANIFEST, 0);
        exposed.openPool(OTHER_RUN, FUNDED, 1);
        vm.stopPrank();
    }

    // --- actions ---

    /**
     * @dev Records the next round with the reports of the workers in `mask` (never none), in
     * ascending worker order; with `duplicate`, the report at `which` is listed twice.
     */
    function recordRound(uint256 mask, bool duplicate, uint256 which) external {
        uint64 round = ledger.runOf(RUN).lastRound + 1;
        if (round > MAX_ROUNDS) return;
        (IContributionLedger.WorkerReport[] memory reports, address[] memory workers) =
            subset(bound(mask, 1, 2 ** WORKERS - 1), round);
        if (duplicate) {
            uint256 twice = bound(which, 0, reports.length - 1);
            IContributionLedger.WorkerReport[] memory listed =
                new IContributionLedger.WorkerReport[](reports.length + 1);
            for (uint256 k = 0; k < listed.length; ++k) {
                listed[k] = reports[k <= twice ? k : k - 1]; // reports[twice] at twice and twice + 1
            }
            reports = listed;
        }
        vm.prank(COORDINATOR);
        try ledger.recordRound(header(round), reports, NONE) {
            if (duplicate) ++duplicatesAccepted;
            recorded.push(facts(round, uint64(block.number), workers, 0));
            for (uint256 i = 0; i < workers.length; ++i) {
                ++creditedRounds[workers[i]];
            }
        } catch {
            if (!duplicate) revert HandlerUnexpectedRefusal("recordRound");
        }
    }

    /// @dev Lets up to twice the challenge window pass.
    function advance(uint256 blocks) external {
        vm.roll(block.number + bound(blocks, 0, 2 * WINDOW));
    }

    /**
     * @dev Claims from the real ledger's pool for a credited (worker, round) once it is mature; with
     * `again`, also when it was claimed already (which the pool must refuse).
     */
    function claim(uint256 roundSeed, uint256 indexSeed, bool again) external {
        if (recorded.length == 0) return;
        // forge-lint: disable-next-line(unsafe-typecast) -- at most MAX_ROUNDS
        uint64 round = uint64(bound(roundSeed, 1, recorded.length));
        IContributionLedger.RoundFacts memory f = recorded[round - 1];
        uint256 index = bound(indexSeed, 0, f.workers.length - 1);
        address w = f.workers[index];
        bool paidBefore = pool.isClaimed(RUN, w, round);
        if (paidBefore && !again) return;
        if (block.number < f.recordedAt + WINDOW) vm.roll(f.recordedAt + WINDOW);
        IRewardPool.RoundClaim[] memory c = new IRewardPool.RoundClaim[](1);
        c[0] = IRewardPool.RoundClaim({round: round, index: index, facts: f});
        try pool.claim(RUN, w, c) returns (uint256 amount) {
            if (voided[w][round]) ++voidedPaid;
            _paid(pool, RUN, w, round, amount);
        } catch {
            if (!paidBefore && !voided[w][round]) revert HandlerUnexpectedRefusal("claim");
        }
    }

    /**
     * @dev Upholds a verdict against a credited worker of a recorded round or, with `coordinator`,
     * against the round's coordinator; refused once the round's window is over or the credit (or round)
     * is voided already, and must be accepted otherwise.
     */
    function dispute(uint256 roundSeed, uint256 indexSeed, bool coordinator) external {
        if (recorded.length == 0) return;
        // forge-lint: disable-next-line(unsafe-typecast) -- at most MAX_ROUNDS
        uint64 round = uint64(bound(roundSeed, 1, recorded.length));
        IContributionLedger.RoundFacts memory f = recorded[round - 1];
        uint256 index = bound(indexSeed, 0, f.workers.length - 1);
        address party = coordinator ? COORDINATOR : f.workers[index];
        IDisputes.Verdict memory v = verdict(round, party);
        bytes[] memory sigs = signedBy(1, v);
        bool open = block.number < f.recordedAt + WINDOW;
        bool again = coordinator ? roundVoided[round] : (roundVoided[round] || voided[party][round]);
        try disputes.dispute(v, f, index, sigs) {
            ++verdicts;
            if (coordinator) roundVoided[round] = true;
            for (uint256 i = 0; i < f.workers.length; ++i) {
                if ((coordinator || i == index) && !voided[f.workers[i]][round]) {
                    voided[f.workers[i]][round] = true;
                    ++voidedRounds[f.workers[i]];
                }
            }
        } catch {
            if (open && !again) revert HandlerUnexpectedRefusal("dispute");
        }
    }

    /// @dev The funder reclaims a recorded round's unpaid share once it is mature (sometimes again,
    /// which the pool must refuse).
    function reclaimRound(uint256 roundSeed) external {
        if (recorded.length == 0) return;
        // forge-lint: disable-next-line(unsafe-typecast) -- at most MAX_ROUNDS
        uint64 round = uint64(bound(roundSeed, 1, recorded.length));
        IContributionLedger.RoundFacts memory f = recorded[round - 1];
        if (block.number < f.recordedAt + WINDOW) vm.roll(f.recordedAt + WINDOW);
        bool before = pool.isReclaimed(RUN, round);
        IRewardPool.RoundProof[] memory p = new IRewardPool.RoundProof[](1);
        p[0] = IRewardPool.RoundProof({round: round, facts: f});
        vm.prank(COORDINATOR);
        try pool.reclaim(RUN, p) returns (uint256 amount) {
            reclaimed += amount;
        } catch {
            if (!before) revert HandlerUnexpectedRefusal("reclaim");
        }
    }

    /**
     * @dev Claims from a pool over the lying ledger (of RUN or, with `other`, OTHER_RUN): the liar
     * commits, for whoever claims, a round with that worker alone, so each claimer asks for the whole
     * round; the pool may refuse (exhausted, or paid already) but never pay a run past its funding,
     * though the other run's tokens sit in the same contract.
     */
    function claimFromLiar(uint256 workerSeed, uint256 roundSeed, bool other) external {
        bytes32 runId = other ? OTHER_RUN : RUN;
        address w = worker(bound(workerSeed, 0, WORKERS - 1));
        // forge-lint: disable-next-line(unsafe-typecast) -- bounded to [1, LIAR_ROUNDS]
        uint64 round = uint64(bound(roundSeed, 1, LIAR_ROUNDS));
        IContributionLedger.RoundFacts memory f = facts(round, uint64(block.number), addresses(w), 0);
        liar.forgeCommitment(runId, round, liar.commitmentOf(f));
        IRewardPool.RoundClaim[] memory c = new IRewardPool.RoundClaim[](1);
        c[0] = IRewardPool.RoundClaim({round: round, index: 0, facts: f});
        try exposed.claim(runId, w, c) returns (uint256 amount) {
            _paid(exposed, runId, w, round, amount);
        } catch {}
    }

    // --- checks (views; the invariant test calls them after every action) ---

    /**
     * @dev (a) For each run's pool: paid ≤ funded, paid == what its successful claims returned; for
     * each pool contract: its token balance + what its runs were paid == what they were funded with.
     */
    function checkPaid() external view {
        uint256 owed = _checkRun(pool, RUN, "pool");
        assertEq(pool.reclaimedOf(RUN), reclaimed, "pool: reclaimed");
        assertTrue(pool.poolOf(RUN).paid + reclaimed <= FUNDED, "pool: paid + reclaimed <= funded");
        assertEq(token.balanceOf(address(pool)) + reclaimed, owed, "pool: balance + paid + reclaimed == funded");
        owed = _checkRun(exposed, RUN, "lying ledger's pool") + _checkRun(exposed, OTHER_RUN, "other run's pool");
        assertEq(token.balanceOf(address(exposed)), owed, "lying ledger's pools: balance + paid == funded");
    }

    /**
     * @dev (b) No worker credited twice in a round: the ledger accepted no round listing a worker twice,
     * each worker's run tally counts exactly the rounds it was credited in, each recorded round's
     * commitment is the handler's facts (strictly ascending workers), and no (worker, round) was paid
     * twice by either pool.
     */
    function checkCredits() external view {
        assertEq(duplicatesAccepted, 0, "a round listing a worker twice was recorded");
        assertEq(claimsRepeated, 0, "a worker was paid twice for a round");
        for (uint256 i = 0; i < WORKERS; ++i) {
            IContributionLedger.Contribution memory c = ledger.contributionOf(RUN, worker(i));
            assertEq(c.rounds, creditedRounds[worker(i)] - voidedRounds[worker(i)], "rounds credited, less voided");
            assertEq(c.tokens, uint256(c.rounds) * TOKENS, "tokens credited");
        }
        for (uint64 r = 1; r <= recorded.length; ++r) {
            assertEq(ledger.roundCommitment(RUN, r), keccak256(abi.encode(recorded[r - 1])), "round's facts");
            address[] memory workers = recorded[r - 1].workers;
            for (uint256 i = 0; i < workers.length; ++i) {
                assertEq(pool.isClaimed(RUN, workers[i], r), claims[pool][RUN][workers[i]][r] == 1, "claimed mark");
            }
        }
    }

    /**
     * @dev (c) No payout ever for a voided credit, and the disputes contract says voided exactly for the
     * credits the handler's upheld verdicts voided.
     */
    function checkVoided() external view {
        assertEq(voidedPaid, 0, "a voided credit was paid");
        for (uint64 r = 1; r <= recorded.length; ++r) {
            address[] memory workers = recorded[r - 1].workers;
            for (uint256 i = 0; i < workers.length; ++i) {
                assertEq(disputes.isVoided(RUN, r, workers[i]), voided[workers[i]][r], "voided mark");
                if (voided[workers[i]][r]) assertTrue(!pool.isClaimed(RUN, workers[i], r), "voided, not claimed");
            }
        }
    }

    /// @dev How many rounds the runs recorded and claims paid, so a run that did nothing shows.
    function progress() external view returns (uint256 rounds, uint256 paid) {
        return (recorded.length, claimed[pool][RUN] + claimed[exposed][RUN] + claimed[exposed][OTHER_RUN]);
    }

    /// @dev How many verdicts were upheld and tokens reclaimed, so a run that disputed nothing shows.
    function disputeProgress() external view returns (uint256 upheld, uint256 returned) {
        return (verdicts, reclaimed);
    }

    function _paid(RewardPool p, bytes32 runId, address w, uint64 round, uint256 amount) private {
        if (claims[p][runId][w][round] != 0) ++claimsRepeated;
        ++claims[p][runId][w][round];
        claimed[p][runId] += amount;
    }

    /// @dev Checks one run's pool; returns what it still holds for the run (funded - paid).
    function _checkRun(RewardPool p, bytes32 runId, string memory what) private view returns (uint256) {
        IRewardPool.Pool memory state = p.poolOf(runId);
        assertTrue(state.paid <= state.funded, what);
        assertEq(state.paid, claimed[p][runId], what);
        return state.funded - state.paid;
    }
}

/**
 * @dev Invariants of the reward pool and the ledger under random sequences of {PoolHandler} actions:
 * (a) a pool never pays more than it was funded with, and its token balance plus what it paid (and
 * returned to the funder) is what it was funded with, even over a lying ledger; (b) no worker is
 * credited twice in a round, by the ledger or by a pool's payments, and a voided credit leaves the
 * tallies; (c) no payout ever for a voided credit.
 */
contract RewardPoolInvariantTest is InvariantBase {
    PoolHandler internal handler;

    function setUp() public {
        handler = new PoolHandler();
        bytes4[] memory actions = new bytes4[](6);
        actions[0] = PoolHandler.recordRound.selector;
        actions[1] = PoolHandler.advance.selector;
        actions[2] = PoolHandler.claim.selector;
        actions[3] = PoolHandler.claimFromLiar.selector;
        actions[4] = PoolHandler.dispute.selector;
        actions[5] = PoolHandler.reclaimRound.selector;
        targetSelector(address(handler), actions);
    }

    function invariantPaidNeverExceedsFunded() public view {
        handler.checkPaid();
    }

    function invariantNoWorkerCreditedTwiceInARound() public view {
        handler.checkCredits();
    }

    function invariantNoPayoutForAVoidedCredit() public view {
        handler.checkVoided();
    }

    /// @dev The actions do what the runs rely on: record, pay, and refuse a duplicate and a second claim.
    function testHandlerActions() public {
        // seeds go through bound(x, min, max) = min + x % (max - min + 1)
        handler.recordRound(30, false, 0); // mask 31: all five workers
        handler.recordRound(4, true, 1); // mask 5, a report twice: refused, not recorded
        handler.recordRound(5, false, 0); // mask 6: two workers
        handler.claim(0, 0, false); // round 1, rolled to maturity
        handler.claim(0, 0, true); // again: refused
        handler.claimFromLiar(0, 0, false); // round 1, the whole funding
        handler.claimFromLiar(1, 0, false); // the run's pool is exhausted: refused
        (uint256 rounds, uint256 paid) = handler.progress();
        assertEq(rounds, 2, "rounds recorded");
        assertEq(paid, (uint256(1_000_003) / 4) / 5 + 1_000_003, "paid");
        handler.checkPaid();
        handler.checkCredits();
    }

    /// @dev The dispute actions do what the runs rely on: uphold inside the window, refuse a repeat and
    /// a late verdict, refuse the voided credit's claim, and return the unpaid share to the funder.
    function testHandlerDisputeActions() public {
        handler.recordRound(2, false, 0); // mask 3: two workers, round 1
        handler.dispute(0, 1, false); // the second worker of round 1, inside the window
        handler.dispute(0, 1, false); // again: refused
        handler.claim(0, 1, false); // its claim: refused
        handler.claim(0, 0, false); // the other worker: paid (rolled to maturity)
        handler.dispute(0, 0, true); // the window is over: refused
        handler.reclaimRound(0); // the voided share and rounding back to the funder
        handler.reclaimRound(0); // again: refused
        (uint256 upheld, uint256 returned) = handler.disputeProgress();
        uint256 p = uint256(1_000_003) / 4;
        assertEq(upheld, 1, "verdicts upheld");
        assertEq(returned, p - p / 2, "reclaimed");
        handler.checkPaid();
        handler.checkCredits();
        handler.checkVoided();
    }
}
