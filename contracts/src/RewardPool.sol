// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {IERC20} from "@openzeppelin/contracts/token/ERC20/IERC20.sol";
import {SafeERC20} from "@openzeppelin/contracts/token/ERC20/utils/SafeERC20.sol";
import {BitMaps} from "@openzeppelin/contracts/utils/structs/BitMaps.sol";
import {IContributionLedger} from "./IContributionLedger.sol";
import {IRewardPool} from "./IRewardPool.sol";

/**
 * @title RewardPool
 * @notice {IRewardPool} over one ledger and one ERC-20 token.
 *
 * Arithmetic: per round p = ⌊funded / totalRounds⌋, per worker ⌊p / n⌋. Rounds 1..totalRounds each
 * pay at most n·⌊p / n⌋ ≤ p, so a run pays at most totalRounds·p ≤ funded; the pool also checks
 * `paid ≤ funded` on every claim, so a ledger that lies about its rounds cannot make it pay more.
 *
 * Maturity: round r recorded in block b is payable from block b + w, where w is the run's
 * `challengeWindow` as the ledger gave it when the pool was opened, kept in the pool's own slot
 * ({challengeWindowOf}); nothing the ledger answers later moves it.
 */
contract RewardPool is IRewardPool {
    using SafeERC20 for IERC20;
    using BitMaps for BitMaps.BitMap;

    /// @dev A run's pool as stored: {IRewardPool-Pool} with the snapshotted challenge window packed
    /// into the funder's slot (20 + 8 + 4 bytes), so {claim} reads it with the pool at no extra slot.
    struct PoolRecord {
        address funder;
        uint64 totalRounds;
        uint32 challengeWindow;
        uint128 funded;
        uint128 paid;
    }

    /// @notice The ledger whose round commitments claims are proven against.
    IContributionLedger public immutable ledger;
    /// @notice The ERC-20 token pools are funded and paid in.
    IERC20 public immutable token;

    mapping(bytes32 runId => PoolRecord) private _pools;
    /// @dev Set bit `round` of a (run, worker) map: the worker was paid for that round.
    mapping(bytes32 runId => mapping(address worker => BitMaps.BitMap)) private _claimed;

    /**
     * @param ledger_ The ledger whose rounds the pool pays for (any {IContributionLedger}).
     * @param token_ The ERC-20 token pools are funded and paid in.
     */
    constructor(IContributionLedger ledger_, IERC20 token_) {
        ledger = ledger_;
        token = token_;
    }

    /**
     * @inheritdoc IRewardPool
     * @dev Checks (one view of the ledger's run, which gives both the coordinator and the window), the
     * pool's record with the window snapshotted, the events, then the one token transfer.
     */
    function openPool(bytes32 runId, uint128 amount, uint64 totalRounds) external {
        if (_pools[runId].funder != address(0)) revert RewardPoolExists(runId);
        IContributionLedger.Run memory run = ledger.runOf(runId);
        if (run.coordinator != msg.sender) revert RewardPoolNotCoordinator(msg.sender);
        if (amount == 0 || totalRounds == 0) revert RewardPoolEmpty();
        _pools[runId] = PoolRecord({
            funder: msg.sender, totalRounds: totalRounds, challengeWindow: run.challengeWindow, funded: amount, paid: 0
        });
        emit PoolOpened(runId, msg.sender, amount, totalRounds);
        emit ChallengeWindowSnapshotted(runId, run.challengeWindow);
        token.safeTransferFrom(msg.sender, address(this), amount);
    }

    /**
     * @inheritdoc IRewardPool
     * @dev Checks and effects for every round first, then the one token transfer.
     */
    function claim(bytes32 runId, address worker, RoundClaim[] calldata rounds) external returns (uint256 total) {
        PoolRecord storage pool = _pools[runId];
        if (pool.funder == address(0)) revert RewardPoolNotOpened(runId);
        uint256 window = pool.challengeWindow;
        for (uint256 k = 0; k < rounds.length; ++k) {
            total += _claimRound(runId, worker, rounds[k], window, pool.totalRounds, pool.funded);
        }
        uint256 paid = pool.paid + total;
        if (paid > pool.funded) revert RewardPoolExhausted(runId);
        // forge-lint: disable-next-line(unsafe-typecast) -- paid <= pool.funded, a uint128
        pool.paid = uint128(paid);
        if (total > 0) token.safeTransfer(worker, total);
    }

    /// @inheritdoc IRewardPool
    function rewardPerWorker(bytes32 runId, uint64 round, uint256 workers) public view returns (uint256) {
        PoolRecord storage pool = _pools[runId];
        return _share(round, workers, pool.totalRounds, pool.funded);
    }

    /// @inheritdoc IRewardPool
    function isClaimed(bytes32 runId, address worker, uint64 round) external view returns (bool) {
        return _claimed[runId][worker].get(round);
    }

    /// @inheritdoc IRewardPool
    function poolOf(bytes32 runId) external view returns (Pool memory) {
        PoolRecord storage pool = _pools[runId];
        return Pool({funder: pool.funder, totalRounds: pool.totalRounds, funded: pool.funded, paid: pool.paid});
    }

    /// @inheritdoc IRewardPool
    function challengeWindowOf(bytes32 runId) external view returns (uint32) {
        return _pools[runId].challengeWindow;
    }

    function _claimRound(
        bytes32 runId,
        address worker,
        RoundClaim calldata c,
        uint256 window,
        uint64 totalRounds,
        uint128 funded
    ) private returns (uint256 amount) {
        bytes32 committed = ledger.roundCommitment(runId, c.round);
        if (committed == bytes32(0) || keccak256(abi.encode(c.facts)) != committed) revert RewardPoolBadProof(c.round);
        uint256 matureAt = uint256(c.facts.recordedAt) + window;
        if (block.number < matureAt) revert RewardPoolNotMatured(c.round, matureAt);
        if (c.index >= c.facts.workers.length || c.facts.workers[c.index] != worker) {
            revert RewardPoolNotContributor(c.round, worker);
        }
        BitMaps.BitMap storage claimed = _claimed[runId][worker];
        if (claimed.get(c.round)) revert RewardPoolAlreadyClaimed(c.round, worker);
        claimed.set(c.round);
        amount = _share(c.round, c.facts.workers.length, totalRounds, funded);
        emit RewardPaid(runId, worker, c.round, amount);
    }

    function _share(uint64 round, uint256 workers, uint64 totalRounds, uint128 funded) private pure returns (uint256) {
        if (round == 0 || round > totalRounds || workers == 0) return 0;
        return (uint256(funded) / totalRounds) / workers;
    }
}
