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
 * round at least `challengeWindow` blocks old, and not claimed before for that worker. The tokens go
 * to the worker's address, whoever sends the claim. However the ledger answers, the pool never pays
 * out of a run more than that run was funded with.
 */
interface IRewardPool {
    /// @notice A run's pool: who funded it, with how much, for how many rounds, and what it paid.
    struct Pool {
        address funder;
        uint64 totalRounds;
        uint128 funded;
        uint128 paid;
    }

    /// @notice A round of a claim: its number, its facts as the ledger committed to them, and where the
    /// claiming worker is in its `workers`.
    struct RoundClaim {
        uint64 round;
        uint256 index;
        IContributionLedger.RoundFacts facts;
    }

    /// @notice The run's pool was opened already.
    error RewardPoolExists(bytes32 runId);
    /// @notice The run has no pool.
    error RewardNoPool(bytes32 runId);
    /// @notice Only the run's coordinator on the ledger may open its pool.
    error RewardNotCoordinator(address caller);
    /// @notice A pool needs a positive amount and at least one round.
    error RewardEmptyPool();
    /// @notice The facts do not hash to the ledger's commitment of the round (or it is not recorded).
    error RewardBadProof(uint64 round);
    /// @notice The round is younger than the run's challenge window: claimable from block `matureAt`.
    error RewardNotMatured(uint64 round, uint256 matureAt);
    /// @notice The worker is not the round's credited worker at the given index.
    error RewardNotContributor(uint64 round, address worker);
    /// @notice The worker's reward for the round was claimed already.
    error RewardAlreadyClaimed(uint64 round, address worker);
    /// @notice Paying would take the run's pool past what it was funded with.
    error RewardPoolExhausted(bytes32 runId);

    /// @notice A run's pool was opened and funded.
    event PoolOpened(bytes32 indexed runId, address indexed funder, uint256 funded, uint64 totalRounds);
    /// @notice A worker was paid for one round.
    event RewardPaid(bytes32 indexed runId, address indexed worker, uint64 indexed round, uint256 amount);

    /**
     * @notice Opens and funds the pool of `runId`, pulling `amount` tokens from the caller (approve
     * first). Only the run's coordinator, once.
     */
    function openPool(bytes32 runId, uint128 amount, uint64 totalRounds) external;

    /// @notice Pays `worker` for each round in `rounds`; returns the amount paid.
    function claim(bytes32 runId, address worker, RoundClaim[] calldata rounds) external returns (uint256);

    /// @notice What one of a round's credited workers is owed for it: 0 past the pool's rounds.
    function rewardPerWorker(bytes32 runId, uint64 round, uint256 workers) external view returns (uint256);

    /// @notice Whether `worker` was paid for `round` of `runId`.
    function isClaimed(bytes32 runId, address worker, uint64 round) external view returns (bool);

    /// @notice The pool of `runId` (funder zero if none).
    function poolOf(bytes32 runId) external view returns (Pool memory);
}
