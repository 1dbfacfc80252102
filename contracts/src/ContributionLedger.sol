// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {EIP712} from "@openzeppelin/contracts/utils/cryptography/EIP712.sol";
import {ECDSA} from "@openzeppelin/contracts/utils/cryptography/ECDSA.sol";
import {IContributionLedger} from "./IContributionLedger.sol";
import {WorkerRegistry} from "./WorkerRegistry.sol";

/**
 * @title ContributionLedger
 * @notice {IContributionLedger}: the checkpoints of each run, credited to the workers whose reports
 * recorded them.
 *
 * The account that creates a run is its coordinator. Every report must be signed by its worker,
 * whose key must be active in the registry, at most once per worker and round and once ever.
 */
contract ContributionLedger is IContributionLedger, EIP712 {
    /// @dev A per-run tally; `lastRound` (same storage slot) catches a second report in one round.
    struct RunTally {
        uint64 tokens;
        uint64 rounds;
        uint64 lastRound;
    }

    /// @notice The EIP-712 type hash of {RoundReport}.
    bytes32 public constant ROUND_REPORT_TYPEHASH = keccak256(
        "RoundReport(bytes32 runId,uint64 round,address worker,bytes32 parentCheckpoint,bytes32 checkpoint,bytes32 updateDigest,bytes32 dataDigest,int64 trainLossE6,int64 evalLossE6,uint64 tokens,uint32 innerSteps,uint64 bytesSent,uint64 bytesReceived)"
    );

    WorkerRegistry private immutable _registry;

    mapping(bytes32 runId => Run) private _runs;
    mapping(bytes32 runId => mapping(uint64 round => RoundRecord)) private _rounds;
    mapping(bytes32 digest => bool) private _recorded;
    mapping(bytes32 runId => mapping(address worker => RunTally)) private _tallies;
    mapping(address worker => Contribution) private _totals;

    /// @param registry_ The registry that says which worker keys are active.
    constructor(WorkerRegistry registry_) EIP712("DiLoCoX Contribution Ledger", "1") {
        _registry = registry_;
    }

    /// @inheritdoc IContributionLedger
    function createRun(bytes32 runId, bytes32 genesisCheckpoint, bytes32 configDigest, bytes32 genesisManifest)
        external
    {
        Run storage run = _runs[runId];
        if (run.coordinator != address(0)) revert LedgerRunExists(runId);

        run.coordinator = msg.sender;
        run.lastCheckpoint = genesisCheckpoint;
        run.genesisCheckpoint = genesisCheckpoint;
        run.configDigest = configDigest;
        run.genesisManifest = genesisManifest;
        emit RunCreated(runId, msg.sender, genesisCheckpoint, configDigest, genesisManifest);
    }

    /**
     * @inheritdoc IContributionLedger
     * @dev Checks, then effects, then the only external call: {WorkerRegistry-isActive}, a view on the
     * immutable registry (a STATICCALL, so it cannot re-enter and change state); the whole call
     * reverts on any refusal.
     */
    function recordRound(
        bytes32 runId,
        uint64 round,
        bytes32 parentCheckpoint,
        bytes32 checkpoint,
        bytes32 manifestDigest,
        SignedReport[] calldata reports,
        bytes32[] calldata unreported
    ) external {
        Run storage run = _runs[runId];
        if (run.coordinator == address(0)) revert LedgerUnknownRun(runId);
        if (msg.sender != run.coordinator) revert LedgerNotCoordinator(msg.sender);
        if (round != run.lastRound + 1) revert LedgerRoundOutOfOrder(run.lastRound + 1, round);
        if (parentCheckpoint != run.lastCheckpoint) revert LedgerWrongParent(run.lastCheckpoint, parentCheckpoint);
        if (reports.length + unreported.length == 0) revert LedgerNoParticipants();
        _checkUnreported(reports, unreported);

        run.lastRound = round;
        run.lastCheckpoint = checkpoint;
        _rounds[runId][round] = RoundRecord({
            checkpoint: checkpoint,
            manifestDigest: manifestDigest,
            reportCount: uint64(reports.length),
            recordedAt: uint64(block.number),
            unreportedCount: uint64(unreported.length)
        });

        for (uint256 i = 0; i < reports.length; ++i) {
            RoundReport calldata report = reports[i].report;
            if (
                report.runId != runId || report.round != round || report.parentCheckpoint != parentCheckpoint
                    || report.checkpoint != checkpoint
            ) revert LedgerReportMismatch(i);
            _accept(report, reports[i].signature, i);
        }
        for (uint256 j = 0; j < unreported.length; ++j) {
            emit UpdateUnreported(runId, round, unreported[j]);
        }
        emit RoundRecorded(runId, round, checkpoint, manifestDigest, reports.length, unreported.length);
    }

    /// @inheritdoc IContributionLedger
    function reportDigest(RoundReport calldata report) public view returns (bytes32) {
        // Every field is a static type, so abi.encode lays them out as EIP-712's encodeData does.
        return _hashTypedDataV4(keccak256(abi.encode(ROUND_REPORT_TYPEHASH, report)));
    }

    /// @inheritdoc IContributionLedger
    function isReportRecorded(bytes32 digest) external view returns (bool) {
        return _recorded[digest];
    }

    /// @inheritdoc IContributionLedger
    function runOf(bytes32 runId) external view returns (Run memory) {
        return _runs[runId];
    }

    /// @inheritdoc IContributionLedger
    function roundOf(bytes32 runId, uint64 round) external view returns (RoundRecord memory) {
        return _rounds[runId][round];
    }

    /// @inheritdoc IContributionLedger
    function contributionOf(bytes32 runId, address worker) external view returns (Contribution memory) {
        RunTally storage tally = _tallies[runId][worker];
        return Contribution({tokens: tally.tokens, rounds: tally.rounds});
    }

    /// @inheritdoc IContributionLedger
    function totalContributionOf(address worker) external view returns (Contribution memory) {
        return _totals[worker];
    }

    /// @notice The worker registry this ledger consults.
    function registry() external view returns (WorkerRegistry) {
        return _registry;
    }

    /**
     * @dev Unreported updates are nonzero, strictly ascending (so none repeats) and none is the update
     * of one of the reports: each participant is accounted for once, by a report or on the
     * coordinator's word.
     */
    function _checkUnreported(SignedReport[] calldata reports, bytes32[] calldata unreported) private pure {
        for (uint256 j = 0; j < unreported.length; ++j) {
            if (unreported[j] == bytes32(0) || (j > 0 && unreported[j] <= unreported[j - 1])) {
                revert LedgerBadUnreported(j);
            }
            for (uint256 i = 0; i < reports.length; ++i) {
                if (reports[i].report.updateDigest == unreported[j]) revert LedgerBadUnreported(j);
            }
        }
    }

    /// @dev Checks one report that matches the round, then credits its worker.
    function _accept(RoundReport calldata report, bytes calldata signature, uint256 index) private {
        bytes32 digest = reportDigest(report);
        (address signer, ECDSA.RecoverError err,) = ECDSA.tryRecoverCalldata(digest, signature);
        if (err != ECDSA.RecoverError.NoError || signer != report.worker) revert LedgerInvalidSignature(index);
        if (!_registry.isActive(signer)) revert LedgerWorkerNotActive(signer);
        if (_recorded[digest]) revert LedgerReportReplayed(digest);
        RunTally storage tally = _tallies[report.runId][signer];
        if (tally.lastRound == report.round) revert LedgerDuplicateWorker(signer);

        _recorded[digest] = true;
        tally.tokens += report.tokens;
        tally.rounds += 1;
        tally.lastRound = report.round;
        Contribution storage total = _totals[signer];
        total.tokens += report.tokens;
        total.rounds += 1;
        emit ReportAccepted(report.runId, report.round, signer, digest, report.tokens);
    }
}
