// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {IContributionLedger} from "./IContributionLedger.sol";

/**
 * @title IRewardPool
 * @notice Pays the workers of a run in ERC-20 tokens for the rounds the ledger recorded them in, by
 * pull payment, once each round is past the run's challenge window.
 *
 * A run's coordinator opens its pool once, funding it with `funded` tokens for `totalRounds` rounds.
 * Each recorded round r ≤ totalRounds carries `funded / totalRounds` (rounded down); it is split in
 * proportion to the tokens the ledger credited each reporting worker in r. Every report of a round is
 * credited the same tokens (the run's config fixes them), so each of the round's n reporting workers
 * is owed `(funded / totalRounds) / n`, rounded down. Unreported participants earn nothing; what
 * rounding, unreported updates and rounds never recorded leave in the pool stays there.
 *
 * A claim names rounds and proves, for each, the round's facts against the ledger's commitment
 * ({IContributionLedger-roundCommitment}); the worker must be among the round's credited workers, the
 * round at least the pool's challenge window old, and not claimed before for that worker. The tokens
 * go to the worker's address, whoever sends the claim. However the ledger answers, the pool never pays
 * out of a run more than that run was funded with.
 *
 * The challenge window is the run's `challengeWindow` on the ledger ({IContributionLedger-Run}) as it
 * was when the pool was opened: the pool keeps that snapshot ({challengeWindowOf},
 * {ChallengeWindowSnapshotted}) and decides maturity by it alone, so nothing the ledger answers later
 * can make a round payable sooner (or later) than when the pool was funded.
 *
 * Disputes ({IDisputes}): a credit an upheld verdict voided is never paid ({RewardPoolVoided}); a
 * verdict can only be upheld inside the round's window, before the credit is payable. What a round
 * leaves unpaid goes back to the funder by one rule ({reclaim}): once round r ≤ totalRounds is past the
 * window, the funder may take, once, p − (n − v)·⌊p / n⌋ of it, where p = ⌊funded / totalRounds⌋, n its
 * credited workers and v those voided (p whole for a round credited to nobody or voided whole); the
 * last round also returns funded − totalRounds·p. Per round, claims plus reclaim are at most p, so
 * paid + reclaimed ≤ funded, which the pool also checks on every payment. Rounds never recorded stay in
 * the pool.
 */
interface IRewardPool {
    /**
     * @notice A run's pool: who funded it, with how much, for how many rounds, and what it paid.
     * @param funder The run's coordinator, who opened and funded the pool.
     * @param totalRounds The rounds the funding is for: rounds 1..totalRounds pay.
     * @param funded The tokens the pool was funded with.
     * @param paid The tokens paid out of it so far; never more than `funded`.
     */
    struct Pool {
        address funder;
        uint64 totalRounds;
        uint128 funded;
        uint128 paid;
    }

    /**
     * @notice A round of a claim: its number, its facts as the ledger committed to them, and where the
     * claiming worker is in its `workers`.
     * @param round The round.
     * @param index The claiming worker's position in `facts.workers`.
     * @param facts The round's facts, proven against {IContributionLedger-roundCommitment}.
     */
    struct RoundClaim {
        uint64 round;
        uint256 index;
        IContributionLedger.RoundFacts facts;
    }

    /**
     * @notice A recorded round and its facts as the ledger committed to them (a {reclaim}).
     * @param round The round.
     * @param facts The round's facts, proven against {IContributionLedger-roundCommitment}.
     */
    struct RoundProof {
        uint64 round;
        IContributionLedger.RoundFacts facts;
    }

    /**
     * @dev A run's pool is opened once.
     * @param runId The run's id.
     */
    error RewardPoolExists(bytes32 runId);

    /**
     * @dev The run has no pool to claim from.
     * @param runId The run's id.
     */
    error RewardPoolNotOpened(bytes32 runId);

    /**
     * @dev Only the run's coordinator on the ledger may open its pool.
     * @param caller The account that sent the call.
     */
    error RewardPoolNotCoordinator(address caller);

    /// @dev A pool needs a positive amount and at least one round.
    error RewardPoolEmpty();

    /**
     * @dev The claimed facts do not hash to the ledger's commitment of the round (or the round is not
     * recorded).
     * @param round The round claimed.
     */
    error RewardPoolBadProof(uint64 round);

    /**
     * @dev The round is younger than the pool's challenge window.
     * @param round The round claimed.
     * @param matureAt The first block in which it can be claimed.
     */
    error RewardPoolNotMatured(uint64 round, uint256 matureAt);

    /**
     * @dev The worker is not the round's credited worker at the claim's index.
     * @param round The round claimed.
     * @param worker The worker claimed for.
     */
    error RewardPoolNotContributor(uint64 round, address worker);

    /**
     * @dev The worker's reward for the round was claimed already.
     * @param round The round claimed.
     * @param worker The worker claimed for.
     */
    error RewardPoolAlreadyClaimed(uint64 round, address worker);

    /**
     * @dev Paying would take the run's pool past what it was funded with (only a lying ledger can
     * cause this).
     * @param runId The run's id.
     */
    error RewardPoolExhausted(bytes32 runId);

    /**
     * @dev An upheld verdict voided the worker's credit for the round ({IDisputes-isVoided}).
     * @param round The round claimed.
     * @param worker The worker claimed for.
     */
    error RewardPoolVoided(uint64 round, address worker);

    /**
     * @dev Only the pool's funder may reclaim.
     * @param caller The account that sent the call.
     */
    error RewardPoolNotFunder(address caller);

    /**
     * @dev The round's unpaid share was reclaimed already.
     * @param round The round.
     */
    error RewardPoolAlreadyReclaimed(uint64 round);

    /**
     * @notice A run's pool was opened and funded.
     * @param runId The run's id.
     * @param funder The run's coordinator, whose tokens fund the pool.
     * @param funded The tokens pulled into the pool.
     * @param totalRounds The rounds the funding is for.
     */
    event PoolOpened(bytes32 indexed runId, address indexed funder, uint256 funded, uint64 totalRounds);

    /**
     * @notice The pool of a run, as it was opened, fixed the challenge window its claims wait for.
     * @param runId The run's id.
     * @param challengeWindow Blocks a recorded round waits before it can be claimed: the run's
     * `challengeWindow` on the ledger when the pool was opened.
     */
    event ChallengeWindowSnapshotted(bytes32 indexed runId, uint32 challengeWindow);

    /**
     * @notice A worker was paid for one round (and the round is marked claimed for it).
     * @param runId The run's id.
     * @param worker The worker paid; the tokens went to this address.
     * @param round The round paid for.
     * @param amount The tokens paid: {rewardPerWorker} of the round, 0 past the pool's rounds.
     */
    event RewardPaid(bytes32 indexed runId, address indexed worker, uint64 indexed round, uint256 amount);

    /**
     * @notice The funder took back what a round leaves unpaid (and, for the last round, the rounding
     * remainder of the funding).
     * @param runId The run's id.
     * @param round The round.
     * @param amount The tokens returned to the funder.
     */
    event RoundReclaimed(bytes32 indexed runId, uint64 indexed round, uint256 amount);

    /**
     * @notice Opens and funds the pool of `runId`, pulling `amount` tokens from the caller (approve
     * first), and snapshots the run's challenge window from the ledger. Only the run's coordinator on
     * the ledger ({RewardPoolNotCoordinator}), once ({RewardPoolExists}). Emits {PoolOpened} and
     * {ChallengeWindowSnapshotted}.
     * @param runId The run's id.
     * @param amount The tokens to fund the pool with; positive ({RewardPoolEmpty}).
     * @param totalRounds The rounds the funding is for; positive ({RewardPoolEmpty}).
     */
    function openPool(bytes32 runId, uint128 amount, uint64 totalRounds) external;

    /**
     * @notice Pays `worker` for each round in `rounds`, in one transfer to `worker`, whoever sends the
     * call. Emits {RewardPaid} per round. Refused, as a whole, for a run with no pool
     * ({RewardPoolNotOpened}), a round whose facts do not prove ({RewardPoolBadProof}), that is not yet mature
     * ({RewardPoolNotMatured}), that `worker` is not credited in at the given index
     * ({RewardPoolNotContributor}), whose credit a verdict voided ({RewardPoolVoided}), or was paid for
     * already ({RewardPoolAlreadyClaimed}), or a payment taking paid + reclaimed past the run's funding
     * ({RewardPoolExhausted}).
     * @param runId The run's id.
     * @param worker The worker to pay.
     * @param rounds The rounds claimed, each with its proof.
     * @return The tokens paid.
     */
    function claim(bytes32 runId, address worker, RoundClaim[] calldata rounds) external returns (uint256);

    /**
     * @notice Returns to the funder what each of `rounds` leaves unpaid, by the rule above, in one
     * transfer. Only the funder ({RewardPoolNotFunder}) of an opened pool ({RewardPoolNotOpened}); each
     * round's facts must prove ({RewardPoolBadProof}), the round be past the window
     * ({RewardPoolNotMatured}) and not reclaimed before ({RewardPoolAlreadyReclaimed}); paid + reclaimed
     * never past the funding ({RewardPoolExhausted}). Emits {RoundReclaimed} per round.
     * @param runId The run's id.
     * @param rounds The rounds, each with its facts.
     * @return The tokens returned.
     */
    function reclaim(bytes32 runId, RoundProof[] calldata rounds) external returns (uint256);

    /**
     * @notice What the funder of a run's pool took back so far ({reclaim}).
     * @param runId The run's id.
     * @return The tokens reclaimed.
     */
    function reclaimedOf(bytes32 runId) external view returns (uint256);

    /**
     * @notice Whether round `round` of `runId` was reclaimed.
     * @param runId The run's id.
     * @param round The round.
     * @return Whether {reclaim} took its unpaid share.
     */
    function isReclaimed(bytes32 runId, uint64 round) external view returns (bool);

    /**
     * @notice What one of a round's credited workers is owed for it.
     * @param runId The run's id.
     * @param round The round.
     * @param workers How many workers the round credited.
     * @return ⌊⌊funded / totalRounds⌋ / workers⌋; 0 for round 0, past the pool's rounds, or without a
     * pool.
     */
    function rewardPerWorker(bytes32 runId, uint64 round, uint256 workers) external view returns (uint256);

    /**
     * @notice Whether `worker` was paid for `round` of `runId`.
     * @param runId The run's id.
     * @param worker The worker.
     * @param round The round.
     * @return Whether the round was claimed for the worker.
     */
    function isClaimed(bytes32 runId, address worker, uint64 round) external view returns (bool);

    /**
     * @notice The pool of a run.
     * @param runId The run's id.
     * @return The pool; funder zero if none.
     */
    function poolOf(bytes32 runId) external view returns (Pool memory);

    /**
     * @notice The challenge window the pool of a run decides maturity by.
     * @param runId The run's id.
     * @return Blocks a recorded round waits before it can be claimed, snapshotted when the pool was
     * opened; 0 without a pool.
     */
    function challengeWindowOf(bytes32 runId) external view returns (uint32);
}
