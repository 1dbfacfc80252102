// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {EIP712} from "@openzeppelin/contracts/utils/cryptography/EIP712.sol";
import {ECDSA} from "@openzeppelin/contracts/utils/cryptography/ECDSA.sol";
import {WorkerRegistry} from "./WorkerRegistry.sol";

/**
 * @title ContributionLedger
 * @notice The chain of checkpoints of each training run, and who contributed to each round
 * (docs/trust.md, "EIP-712 round report" and "Contracts").
 *
 * The account that creates a run is its coordinator. It records rounds in order, each naming the
 * previous round's checkpoint as its parent, with the EIP-712 reports of the workers that took
 * part. Every report must be signed by its worker, whose key must be active in the registry.
 */
contract ContributionLedger is EIP712 {
    /**
     * @notice What a worker signs for one round. Field meanings: docs/trust.md. `bytesSent` and
     * `bytesReceived` are the wire bytes of the worker's pushed update and of the FetchGlobal stream
     * that delivered the global state it started from, as in the manifest's participant entry; they
     * are signed and recorded, not tallied.
     */
    struct RoundReport {
        bytes32 runId;
        uint64 round;
        address worker;
        bytes32 parentCheckpoint;
        bytes32 checkpoint;
        bytes32 updateDigest;
        bytes32 dataDigest;
        int64 trainLossE6;
        int64 evalLossE6;
        uint64 tokens;
        uint32 innerSteps;
        uint64 bytesSent;
        uint64 bytesReceived;
    }

    /// @notice A report with its 65-byte (r, s, v) signature over {reportDigest}.
    struct SignedReport {
        RoundReport report;
        bytes signature;
    }

    /// @notice A run: its coordinator, the last recorded round and where it started.
    struct Run {
        address coordinator;
        uint64 lastRound;
        bytes32 lastCheckpoint;
        bytes32 genesisCheckpoint;
        bytes32 configDigest;
        bytes32 genesisManifest;
    }

    /// @notice A recorded round. `recordedAt` is a block number.
    struct RoundRecord {
        bytes32 checkpoint;
        bytes32 manifestDigest;
        uint64 reportCount;
        uint64 recordedAt;
    }

    /// @notice Tokens and rounds credited to a worker.
    struct Contribution {
        uint64 tokens;
        uint64 rounds;
    }

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

    /// @notice A run with this id exists already.
    error RunExists(bytes32 runId);
    /// @notice No run has this id.
    error UnknownRun(bytes32 runId);
    /// @notice Only the run's coordinator may record its rounds.
    error NotCoordinator(address caller);
    /// @notice Rounds are recorded one after another, starting at 1.
    error RoundOutOfOrder(uint64 expected, uint64 got);
    /// @notice The round's parent is not the previous round's checkpoint (or the genesis checkpoint).
    error WrongParent(bytes32 expected, bytes32 got);
    /// @notice A round needs at least one report.
    error NoReports();
    /// @notice Report `index` names another run, round, parent or checkpoint than the call.
    error ReportMismatch(uint256 index);
    /// @notice Report `index` is not validly signed by its `worker`.
    error InvalidSignature(uint256 index);
    /// @notice The worker is not active in the registry.
    error WorkerNotActive(address worker);
    /// @notice A report with this digest was recorded already.
    error ReportReplayed(bytes32 digest);
    /// @notice The worker has a report in this round already.
    error DuplicateWorker(address worker);

    /// @notice A run was created; `coordinator` may record its rounds.
    event RunCreated(
        bytes32 indexed runId,
        address indexed coordinator,
        bytes32 genesisCheckpoint,
        bytes32 configDigest,
        bytes32 genesisManifest
    );
    /// @notice A worker's report was accepted; `digest` is its EIP-712 digest.
    event ReportAccepted(
        bytes32 indexed runId, uint64 indexed round, address indexed worker, bytes32 digest, uint64 tokens
    );
    /// @notice A round was recorded.
    event RoundRecorded(
        bytes32 indexed runId, uint64 indexed round, bytes32 checkpoint, bytes32 manifestDigest, uint256 reportCount
    );

    /// @param registry_ The registry that says which worker keys are active.
    constructor(WorkerRegistry registry_) EIP712("DiLoCoX Contribution Ledger", "1") {
        _registry = registry_;
    }

    /**
     * @notice Creates a run; the caller becomes its coordinator.
     * @param runId sha256 digest of the run's genesis manifest.
     * @param genesisCheckpoint sha256 of θ⁽⁰⁾'s safetensors bytes: round 1's parent.
     * @param configDigest Digest of the run configuration.
     * @param genesisManifest Digest of the genesis manifest object.
     */
    function createRun(bytes32 runId, bytes32 genesisCheckpoint, bytes32 configDigest, bytes32 genesisManifest)
        external
    {
        Run storage run = _runs[runId];
        if (run.coordinator != address(0)) revert RunExists(runId);

        run.coordinator = msg.sender;
        run.lastCheckpoint = genesisCheckpoint;
        run.genesisCheckpoint = genesisCheckpoint;
        run.configDigest = configDigest;
        run.genesisManifest = genesisManifest;
        emit RunCreated(runId, msg.sender, genesisCheckpoint, configDigest, genesisManifest);
    }

    /**
     * @notice Records the next round of a run with its workers' signed reports. Only the coordinator.
     * @dev The only external call is {WorkerRegistry-isActive}, a view on the immutable registry
     * (a STATICCALL, so it cannot re-enter and change state); the whole call reverts on any refusal.
     * @param runId The run.
     * @param round The run's last round plus one.
     * @param parentCheckpoint The previous round's checkpoint (the genesis checkpoint for round 1).
     * @param checkpoint sha256 of θ⁽ʳ⁾'s safetensors bytes.
     * @param manifestDigest Digest of the round's manifest.
     * @param reports One signed report per participating worker, each for this run, round, parent
     * and checkpoint.
     */
    function recordRound(
        bytes32 runId,
        uint64 round,
        bytes32 parentCheckpoint,
        bytes32 checkpoint,
        bytes32 manifestDigest,
        SignedReport[] calldata reports
    ) external {
        Run storage run = _runs[runId];
        if (run.coordinator == address(0)) revert UnknownRun(runId);
        if (msg.sender != run.coordinator) revert NotCoordinator(msg.sender);
        if (round != run.lastRound + 1) revert RoundOutOfOrder(run.lastRound + 1, round);
        if (parentCheckpoint != run.lastCheckpoint) revert WrongParent(run.lastCheckpoint, parentCheckpoint);
        if (reports.length == 0) revert NoReports();

        run.lastRound = round;
        run.lastCheckpoint = checkpoint;
        _rounds[runId][round] = RoundRecord({
            checkpoint: checkpoint,
            manifestDigest: manifestDigest,
            reportCount: uint64(reports.length),
            recordedAt: uint64(block.number)
        });

        for (uint256 i = 0; i < reports.length; ++i) {
            RoundReport calldata report = reports[i].report;
            if (
                report.runId != runId || report.round != round || report.parentCheckpoint != parentCheckpoint
                    || report.checkpoint != checkpoint
            ) revert ReportMismatch(i);
            _accept(report, reports[i].signature, i);
        }
        emit RoundRecorded(runId, round, checkpoint, manifestDigest, reports.length);
    }

    /**
     * @notice The EIP-712 digest a worker signs for `report` (this ledger's domain and chain).
     * @param report The report.
     */
    function reportDigest(RoundReport calldata report) public view returns (bytes32) {
        // Every field is a static type, so abi.encode lays them out as EIP-712's encodeData does.
        return _hashTypedDataV4(keccak256(abi.encode(ROUND_REPORT_TYPEHASH, report)));
    }

    /**
     * @notice Whether a report with this EIP-712 digest has been recorded.
     * @param digest The report's {reportDigest}.
     */
    function isReportRecorded(bytes32 digest) external view returns (bool) {
        return _recorded[digest];
    }

    /**
     * @notice A run (coordinator zero if it does not exist).
     * @param runId The run.
     */
    function runOf(bytes32 runId) external view returns (Run memory) {
        return _runs[runId];
    }

    /**
     * @notice A recorded round (all zero if not recorded).
     * @param runId The run.
     * @param round The round.
     */
    function roundOf(bytes32 runId, uint64 round) external view returns (RoundRecord memory) {
        return _rounds[runId][round];
    }

    /**
     * @notice Tokens and rounds credited to `worker` in one run.
     * @param runId The run.
     * @param worker The worker's signing address.
     */
    function contributionOf(bytes32 runId, address worker) external view returns (Contribution memory) {
        RunTally storage tally = _tallies[runId][worker];
        return Contribution({tokens: tally.tokens, rounds: tally.rounds});
    }

    /**
     * @notice Tokens and rounds credited to `worker` over all runs.
     * @param worker The worker's signing address.
     */
    function totalContributionOf(address worker) external view returns (Contribution memory) {
        return _totals[worker];
    }

    /// @notice The worker registry this ledger consults.
    function registry() external view returns (WorkerRegistry) {
        return _registry;
    }

    /// @dev Checks one report that matches the round, then credits its worker.
    function _accept(RoundReport calldata report, bytes calldata signature, uint256 index) private {
        bytes32 digest = reportDigest(report);
        (address signer, ECDSA.RecoverError err,) = ECDSA.tryRecoverCalldata(digest, signature);
        if (err != ECDSA.RecoverError.NoError || signer != report.worker) revert InvalidSignature(index);
        if (!_registry.isActive(signer)) revert WorkerNotActive(signer);
        if (_recorded[digest]) revert ReportReplayed(digest);
        RunTally storage tally = _tallies[report.runId][signer];
        if (tally.lastRound == report.round) revert DuplicateWorker(signer);

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
