// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

/**
 * @title IContributionLedger
 * @notice The chain of checkpoints of each training run and who contributed to each round
 * (docs/trust.md, "EIP-712 round report" and "Contracts").
 *
 * A run's coordinator records rounds strictly in order, each naming the previous round's checkpoint
 * as its parent. Every participant of a round is accounted for in the recording call: either by its
 * worker's EIP-712 report (the worker is credited), or by its update digest in the coordinator's
 * `unreported` list (nobody is credited; the coordinator alone vouches for that update, and an
 * auditor sees it). A round no worker reported is still recorded that way, so later rounds are
 * never blocked behind it.
 */
interface IContributionLedger {
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

    /**
     * @notice A recorded round. `recordedAt` is a block number; `unreportedCount` is how many of its
     * participants no worker signed for (the coordinator's `unreported` list).
     */
    struct RoundRecord {
        bytes32 checkpoint;
        bytes32 manifestDigest;
        uint64 reportCount;
        uint64 recordedAt;
        uint64 unreportedCount;
    }

    /// @notice Tokens and rounds credited to a worker.
    struct Contribution {
        uint64 tokens;
        uint64 rounds;
    }

    /// @notice A run with this id exists already.
    error LedgerRunExists(bytes32 runId);
    /// @notice No run has this id.
    error LedgerUnknownRun(bytes32 runId);
    /// @notice Only the run's coordinator may record its rounds.
    error LedgerNotCoordinator(address caller);
    /// @notice Rounds are recorded one after another, starting at 1.
    error LedgerRoundOutOfOrder(uint64 expected, uint64 got);
    /// @notice The round's parent is not the previous round's checkpoint (or the genesis checkpoint).
    error LedgerWrongParent(bytes32 expected, bytes32 got);
    /// @notice A round needs at least one participant: a report or an unreported update.
    error LedgerNoParticipants();
    /// @notice Report `index` names another run, round, parent or checkpoint than the call.
    error LedgerReportMismatch(uint256 index);
    /// @notice Report `index` is not validly signed by its `worker`.
    error LedgerInvalidSignature(uint256 index);
    /// @notice The worker is not active in the registry.
    error LedgerWorkerNotActive(address worker);
    /// @notice A report with this digest was recorded already.
    error LedgerReportReplayed(bytes32 digest);
    /// @notice The worker has a report in this round already.
    error LedgerDuplicateWorker(address worker);
    /// @notice Unreported update `index` is zero, out of strictly ascending order (so repeated), or
    /// the update of one of the call's reports.
    error LedgerBadUnreported(uint256 index);

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
    /// @notice A participant's update was recorded without a worker's report, on the coordinator's word.
    event UpdateUnreported(bytes32 indexed runId, uint64 indexed round, bytes32 updateDigest);
    /// @notice A round was recorded.
    event RoundRecorded(
        bytes32 indexed runId,
        uint64 indexed round,
        bytes32 checkpoint,
        bytes32 manifestDigest,
        uint256 reportCount,
        uint256 unreportedCount
    );

    /**
     * @notice Creates a run; the caller becomes its coordinator.
     * @param runId sha256 digest of the run's genesis manifest.
     * @param genesisCheckpoint sha256 of θ⁽⁰⁾'s safetensors bytes: round 1's parent.
     * @param configDigest Digest of the run configuration.
     * @param genesisManifest Digest of the genesis manifest object.
     */
    function createRun(bytes32 runId, bytes32 genesisCheckpoint, bytes32 configDigest, bytes32 genesisManifest) external;

    /**
     * @notice Records the next round of a run. Only the run's coordinator.
     * @param runId The run.
     * @param round The run's last round plus one.
     * @param parentCheckpoint The previous round's checkpoint (the genesis checkpoint for round 1).
     * @param checkpoint sha256 of θ⁽ʳ⁾'s safetensors bytes.
     * @param manifestDigest Digest of the round's manifest.
     * @param reports One signed report per reporting participant, each for this run, round, parent and
     * checkpoint; its worker is credited.
     * @param unreported The update digests of the participants without a report, strictly ascending;
     * nobody is credited for them.
     */
    function recordRound(
        bytes32 runId,
        uint64 round,
        bytes32 parentCheckpoint,
        bytes32 checkpoint,
        bytes32 manifestDigest,
        SignedReport[] calldata reports,
        bytes32[] calldata unreported
    ) external;

    /// @notice The EIP-712 digest a worker signs for `report` (this ledger's domain and chain).
    function reportDigest(RoundReport calldata report) external view returns (bytes32);

    /// @notice Whether a report with this EIP-712 digest has been recorded.
    function isReportRecorded(bytes32 digest) external view returns (bool);

    /// @notice A run (coordinator zero if it does not exist).
    function runOf(bytes32 runId) external view returns (Run memory);

    /// @notice A recorded round (all zero if not recorded).
    function roundOf(bytes32 runId, uint64 round) external view returns (RoundRecord memory);

    /// @notice Tokens and rounds credited to `worker` in one run.
    function contributionOf(bytes32 runId, address worker) external view returns (Contribution memory);

    /// @notice Tokens and rounds credited to `worker` over all runs.
    function totalContributionOf(address worker) external view returns (Contribution memory);
}
