// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {IERC20} from "@openzeppelin/contracts/token/ERC20/IERC20.sol";
import {SafeERC20} from "@openzeppelin/contracts/token/ERC20/utils/SafeERC20.sol";
import {BitMaps} from "@openzeppelin/contracts/utils/structs/BitMaps.sol";
import {IContributionLedger} from "./IContributionLedger.sol";
import {IDisputes} from "./IDisputes.sol";
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
 *
 * Disputes: the ledger's {IContributionLedger-disputes} as it was when the pool was deployed is asked
 * whether a claimed credit is voided (zero: a ledger without disputes, nothing voided). Reclaim per
 * round: p − (n − v)·⌊p / n⌋ (p for n = 0 or a round voided whole), plus funded − totalRounds·p for the
 * last round; the pool checks paid + reclaimed ≤ funded on every claim and reclaim.
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

    /// @dev The ledger's disputes contract, asked whether a credit is voided; zero if it has none.
    IDisputes private immutable _disputes;

    mapping(bytes32 runId => PoolRecord) private _pools;
    /// @dev Set bit `round` of a (run, worker) map: the worker was paid for that round.
    mapping(bytes32 runId => mapping(address worker => BitMaps.BitMap)) private _claimed;
    /// @dev Tokens the funder of a run reclaimed, and (bit `round`) the rounds it reclaimed.
    mapping(bytes32 runId => uint256) private _reclaimed;
    mapping(bytes32 runId => BitMaps.BitMap) private _reclaimedRounds;

    /**
     * @param ledger_ The ledger whose rounds the pool pays for (any {IContributionLedger}).
     * @param token_ The ERC-20 token pools are funded and paid in.
     */
    constructor(IContributionLedger ledger_, IERC20 token_) {
        ledger = ledger_;
        token = token_;
        _disputes = IDisputes(ledger_.disputes());
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
        if (paid + _reclaimed[runId] > pool.funded) revert RewardPoolExhausted(runId);
        // forge-lint: disable-next-line(unsafe-typecast) -- paid <= pool.funded, a uint128
        pool.paid = uint128(paid);
        if (total > 0) token.safeTransfer(worker, total);
    }

    /**
     * @inheritdoc IRewardPool
     * @dev Checks and effects for every round first, then the one token transfer.
     */
    function reclaim(bytes32 runId, RoundProof[] calldata rounds) external returns (uint256 total) {
        PoolRecord storage pool = _pools[runId];
        if (pool.funder == address(0)) revert RewardPoolNotOpened(runId);
        if (msg.sender != pool.funder) revert RewardPoolNotFunder(msg.sender);
        for (uint256 k = 0; k < rounds.length; ++k) {
            total += _reclaimRound(runId, rounds[k], pool.challengeWindow, pool.totalRounds, pool.funded);
        }
        uint256 reclaimed = _reclaimed[runId] + total;
        if (pool.paid + reclaimed > pool.funded) revert RewardPoolExhausted(runId);
        _reclaimed[runId] = reclaimed;
        if (total > 0) token.safeTransfer(msg.sender, total);
    }

    /// @inheritdoc IRewardPool
    function reclaimedOf(bytes32 runId) external view returns (uint256) {
        return _reclaimed[runId];
    }

    /// @inheritdoc IRewardPool
    function isReclaimed(bytes32 runId, uint64 round) external view returns (bool) {
        return _reclaimedRounds[runId].get(round);
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
        _prove(runId, c.round, c.facts, window);
        if (c.index >= c.facts.workers.length || c.facts.workers[c.index] != worker) {
            revert RewardPoolNotContributor(c.round, worker);
        }
        if (address(_disputes) != address(0) && _disputes.isVoided(runId, c.round, worker)) {
            revert RewardPoolVoided(c.round, worker);
        }
        BitMaps.BitMap storage claimed = _claimed[runId][worker];
        if (claimed.get(c.round)) revert RewardPoolAlreadyClaimed(c.round, worker);
        claimed.set(c.round);
        amount = _share(c.round, c.facts.workers.length, totalRounds, funded);
        emit RewardPaid(runId, worker, c.round, amount);
    }

    /// @dev Proves one round, past the window and not reclaimed before; marks it and returns its unpaid
    /// share.
    function _reclaimRound(bytes32 runId, RoundProof calldata r, uint256 window, uint64 totalRounds, uint128 funded)
        private
        returns (uint256 amount)
    {
        _prove(runId, r.round, r.facts, window);
        BitMaps.BitMap storage reclaimedRounds = _reclaimedRounds[runId];
        if (reclaimedRounds.get(r.round)) revert RewardPoolAlreadyReclaimed(r.round);
        reclaimedRounds.set(r.round);
        if (r.round == 0 || r.round > totalRounds) return 0;
        uint256 share = uint256(funded) / totalRounds;
        uint256 n = r.facts.workers.length;
        bool roundVoided = false;
        uint256 workersVoided = 0;
        if (address(_disputes) != address(0)) (roundVoided, workersVoided) = _disputes.voidsOf(runId, r.round);
        amount = (n == 0 || roundVoided) ? share : share - (n - workersVoided) * (share / n);
        if (r.round == totalRounds) amount += uint256(funded) - uint256(totalRounds) * share;
        emit RoundReclaimed(runId, r.round, amount);
    }

    /// @dev The facts hash to the ledger's commitment of the round, and the round is past the window.
    function _prove(bytes32 runId, uint64 round, IContributionLedger.RoundFacts calldata facts, uint256 window)
        private
        view
    {
        bytes32 committed = ledger.roundCommitment(runId, round);
        if (committed == bytes32(0) || keccak256(abi.encode(facts)) != committed) revert RewardPoolBadProof(round);
        uint256 matureAt = uint256(facts.recordedAt) + window;
        if (block.number < matureAt) revert RewardPoolNotMatured(round, matureAt);
    }

    function _share(uint64 round, uint256 workers, uint64 totalRounds, uint128 funded) private pure returns (uint256) {
        if (round == 0 || round > totalRounds || workers == 0) return 0;
        return (uint256(funded) / totalRounds) / workers;
    }
}
