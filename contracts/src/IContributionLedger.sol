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
 *
 * What a worker signs is the whole {RoundReport}. What the round's reports share (run, round,
 * parent, checkpoint, manifest, held-out loss, tokens and steps, which the run's config fixes) is
 * sent once per call as a {RoundHeader}; each report adds only its worker's own fields
 * ({WorkerReport}). A report can only be recorded in its own round's call, rounds only move
 * forward, and a call's reports are in strictly ascending worker order, so no report is ever
 * recorded twice and no worker is credited twice for a round, without a storage slot per report.
 * A recorded round is kept as one 32-byte commitment to its {RoundFacts}: what a reward claim
 * ({IRewardPool}) or an auditor proves against.
 */
interface IContributionLedger {
    /**
     * @notice What a worker signs for one round. Field meanings: docs/trust.md. `manifestDigest` is
     * the round's manifest, so no field of the manifest (per-worker traffic, byte counts) can change
     * without breaking every report's signature. `bytesSent` and `bytesReceived` are the wire bytes
     * of the worker's pushed update and of the FetchGlobal stream it started from.
     */
    struct RoundReport {
        bytes32 runId;
        uint64 round;
        address worker;
        bytes32 parentCheckpoint;
        bytes32 checkpoint;
        bytes32 manifestDigest;
        bytes32 updateDigest;
        bytes32 dataDigest;
        int64 trainLossE6;
        int64 evalLossE6;
        uint64 tokens;
        uint32 innerSteps;
        uint64 bytesSent;
        uint64 bytesReceived;
    }

    /// @notice The fields every report of a round shares, sent once per recording call.
    struct RoundHeader {
        bytes32 runId;
        uint64 round;
        bytes32 parentCheckpoint;
        bytes32 checkpoint;
        bytes32 manifestDigest;
        int64 evalLossE6;
        uint64 tokens;
        uint32 innerSteps;
    }

    /// @notice One worker's own fields of its {RoundReport}, with its 65-byte (r, s, v) signature over
    /// the whole report ({reportDigest}).
    struct WorkerReport {
        address worker;
        bytes32 updateDigest;
        bytes32 dataDigest;
        int64 trainLossE6;
        uint64 bytesSent;
        uint64 bytesReceived;
        bytes signature;
    }

    /// @notice A run: its coordinator, the last recorded round, where it started, and how many blocks a
    /// recorded round waits before rewards for it can be claimed.
    struct Run {
        address coordinator;
        uint64 lastRound;
        uint32 challengeWindow;
        bytes32 lastCheckpoint;
        bytes32 genesisCheckpoint;
        bytes32 configDigest;
        bytes32 genesisManifest;
    }

    /**
     * @notice What a recorded round's commitment ({roundCommitment}) binds: its checkpoint and manifest,
     * the tokens credited to each reporting worker, the block it was recorded in, how many of its
     * participants were recorded unreported, and the credited workers in ascending order.
     */
    struct RoundFacts {
        bytes32 checkpoint;
        bytes32 manifestDigest;
        uint64 tokens;
        uint64 recordedAt;
        uint64 unreportedCount;
        address[] workers;
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
    /// @notice Report `index` is not validly signed by its `worker`.
    error LedgerInvalidSignature(uint256 index);
    /// @notice The worker is not active in the registry.
    error LedgerWorkerNotActive(address worker);
    /// @notice Report `index`'s worker is not above the previous report's: reports are in strictly
    /// ascending worker order, so no worker reports twice in a round.
    error LedgerReportsNotSorted(uint256 index);
    /// @notice Unreported update `index` is zero, out of strictly ascending order (so repeated), or
    /// the update of one of the call's reports.
    error LedgerBadUnreported(uint256 index);

    /// @notice A run was created; `coordinator` may record its rounds.
    event RunCreated(
        bytes32 indexed runId,
        address indexed coordinator,
        bytes32 genesisCheckpoint,
        bytes32 configDigest,
        bytes32 genesisManifest,
        uint32 challengeWindow
    );
    /// @notice A participant's update was recorded without a worker's report, on the coordinator's word.
    event UpdateUnreported(bytes32 indexed runId, uint64 indexed round, bytes32 updateDigest);
    /**
     * @notice A round was recorded: each of `workers` (ascending) reported and was credited `tokens`;
     * `commitment` is {roundCommitment} of its {RoundFacts} (recordedAt: this block).
     */
    event RoundRecorded(
        bytes32 indexed runId,
        uint64 indexed round,
        bytes32 checkpoint,
        bytes32 manifestDigest,
        uint64 tokens,
        address[] workers,
        uint256 unreportedCount,
        bytes32 commitment
    );

    /**
     * @notice Creates a run; the caller becomes its coordinator.
     * @param runId sha256 digest of the run's genesis manifest.
     * @param genesisCheckpoint sha256 of θ⁽⁰⁾'s safetensors bytes: round 1's parent.
     * @param configDigest Digest of the run configuration.
     * @param genesisManifest Digest of the genesis manifest object.
     * @param challengeWindow Blocks a recorded round waits before rewards for it can be claimed.
     */
    function createRun(
        bytes32 runId,
        bytes32 genesisCheckpoint,
        bytes32 configDigest,
        bytes32 genesisManifest,
        uint32 challengeWindow
    ) external;

    /**
     * @notice Records the next round of a run. Only the run's coordinator.
     * @param header The round: the run's last round plus one, the previous round's checkpoint as
     * parent (the genesis checkpoint for round 1), and what every report of it shares.
     * @param reports One signed report per reporting participant, in strictly ascending worker order;
     * each worker is credited `header.tokens`.
     * @param unreported The update digests of the participants without a report, strictly ascending;
     * nobody is credited for them.
     */
    function recordRound(RoundHeader calldata header, WorkerReport[] calldata reports, bytes32[] calldata unreported)
        external;

    /// @notice The EIP-712 digest a worker signs for `report` (this ledger's domain and chain).
    function reportDigest(RoundReport calldata report) external view returns (bytes32);

    /// @notice The commitment a recorded round is kept as: keccak256 of the ABI encoding of `facts`.
    function commitmentOf(RoundFacts calldata facts) external pure returns (bytes32);

    /// @notice A run (coordinator zero if it does not exist).
    function runOf(bytes32 runId) external view returns (Run memory);

    /// @notice The commitment of a recorded round (zero if not recorded).
    function roundCommitment(bytes32 runId, uint64 round) external view returns (bytes32);

    /// @notice Tokens and rounds credited to `worker` in one run.
    function contributionOf(bytes32 runId, address worker) external view returns (Contribution memory);

    /// @notice Tokens and rounds credited to `worker` over all runs.
    function totalContributionOf(address worker) external view returns (Contribution memory);

    /// @notice The runs `worker` has been credited in, in the order of its first credit in each.
    function runsOf(address worker) external view returns (bytes32[] memory);
}
