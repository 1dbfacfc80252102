// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {IWorkerRegistry} from "./IWorkerRegistry.sol";

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
 *
 * Handover (docs/trust.md, "A run that outlives its coordinator"): a run outlives its coordinator.
 * The account that created the run (its creator, the first coordinator) may hand the run to another
 * coordinator at any time ({handOver}); and when the coordinator has recorded nothing for
 * {HANDOVER_STALL_BLOCKS} blocks, a strict majority of the workers credited in the run's last
 * recorded round (each still active in the registry) may vote one in ({voteCoordinator}). Either way
 * the new coordinator records the next round under the same run id, its parent the last recorded
 * checkpoint as always; {coordinatorOf} names who holds (held) each round, which is what receipts and
 * verdicts about that round are judged against.
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

    /**
     * @dev A run cannot be created twice.
     * @param runId The run's id.
     */
    error LedgerRunExists(bytes32 runId);

    /**
     * @dev No run has this id.
     * @param runId The id a call named.
     */
    error LedgerUnknownRun(bytes32 runId);

    /**
     * @dev Only the run's coordinator may record its rounds.
     * @param caller The account that sent the call.
     */
    error LedgerNotCoordinator(address caller);

    /**
     * @dev Rounds are recorded one after another, starting at 1.
     * @param expected The run's last recorded round plus one.
     * @param got The round the call named.
     */
    error LedgerRoundOutOfOrder(uint64 expected, uint64 got);

    /**
     * @dev The round's parent is not the previous round's checkpoint (or, for round 1, the genesis
     * checkpoint).
     * @param expected The run's last recorded checkpoint.
     * @param got The parent the call named.
     */
    error LedgerWrongParent(bytes32 expected, bytes32 got);

    /// @dev A round needs at least one participant: a report or an unreported update.
    error LedgerNoParticipants();

    /**
     * @dev A report is not validly signed by its `worker` (wrong key, wrong fields, malformed or
     * malleable signature).
     * @param index The report's position in the call's `reports`.
     */
    error LedgerInvalidSignature(uint256 index);

    /**
     * @dev A report's worker is not active in the registry ({IWorkerRegistry-isActive}).
     * @param worker The worker's signing address.
     */
    error LedgerWorkerNotActive(address worker);

    /**
     * @dev A report's worker is not above the previous report's: reports are in strictly ascending
     * worker order, so no worker reports twice in a round.
     * @param index The report's position in the call's `reports`.
     */
    error LedgerReportsNotSorted(uint256 index);

    /**
     * @dev An unreported update is zero, out of strictly ascending order (so repeated), or the update
     * of one of the call's reports.
     * @param index The update's position in the call's `unreported`.
     */
    error LedgerBadUnreported(uint256 index);

    /**
     * @dev Only the run's creator may hand it to another coordinator ({handOver}).
     * @param caller The account that sent the call.
     */
    error LedgerNotCreator(address caller);

    /**
     * @dev A run cannot be handed to the zero address, nor to the coordinator it already has.
     * @param coordinator The coordinator the call named.
     */
    error LedgerBadCoordinator(address coordinator);

    /**
     * @dev Workers may vote in a coordinator only once the run has recorded nothing (no round, no
     * handover) for {HANDOVER_STALL_BLOCKS} blocks.
     * @param stalledFrom The first block in which a vote counts.
     */
    error LedgerNotStalled(uint64 stalledFrom);

    /**
     * @dev Only a worker credited in the run's last recorded round, and still active in the registry,
     * may vote; each once per stall (a recorded round or a handover starts a new one).
     * @param caller The account that sent the call.
     */
    error LedgerNotVoter(address caller);

    /**
     * @dev Only the ledger's {disputes} contract may void credit.
     * @param caller The account that sent the call.
     */
    error LedgerNotDisputes(address caller);

    /**
     * @notice A run was created; `coordinator` may record its rounds.
     * @param runId The run's id: sha256 digest of its genesis manifest.
     * @param coordinator The account that created it and records its rounds.
     * @param genesisCheckpoint sha256 of θ⁽⁰⁾'s safetensors bytes: round 1's parent.
     * @param configDigest Digest of the run configuration.
     * @param genesisManifest Digest of the genesis manifest object.
     * @param challengeWindow Blocks a recorded round waits before rewards for it can be claimed.
     */
    event RunCreated(
        bytes32 indexed runId,
        address indexed coordinator,
        bytes32 genesisCheckpoint,
        bytes32 configDigest,
        bytes32 genesisManifest,
        uint32 challengeWindow
    );

    /**
     * @notice The run has a new coordinator: `next` records its rounds from `fromRound` on, and
     * {coordinatorOf} names `previous` for the rounds before.
     * @param runId The run.
     * @param previous The coordinator it had.
     * @param next The coordinator it has now.
     * @param fromRound The first round `next` records (the last recorded round plus one).
     * @param byVote True when the run's workers voted `next` in, false when its creator handed it over.
     */
    event CoordinatorHandedOver(
        bytes32 indexed runId, address indexed previous, address indexed next, uint64 fromRound, bool byVote
    );

    /**
     * @notice A worker of a stalled run voted for a new coordinator.
     * @param runId The run.
     * @param voter The worker.
     * @param candidate The coordinator it voted for.
     * @param votes The candidate's votes in this stall, this one included.
     * @param needed The votes that hand the run over: a strict majority of the last round's credited workers.
     */
    event CoordinatorVoted(
        bytes32 indexed runId, address indexed voter, address indexed candidate, uint64 votes, uint64 needed
    );

    /**
     * @notice A participant's update was recorded without a worker's report, on the coordinator's word.
     * @param runId The run.
     * @param round The round the update was recorded in.
     * @param updateDigest The update's digest.
     */
    event UpdateUnreported(bytes32 indexed runId, uint64 indexed round, bytes32 updateDigest);

    /**
     * @notice A round was recorded: each of `workers` (ascending) reported and was credited `tokens`;
     * `commitment` is {roundCommitment} of its {RoundFacts} (recordedAt: this block).
     * @param runId The run.
     * @param round The round, the run's last one from now on.
     * @param checkpoint The round's checkpoint, the next round's parent.
     * @param manifestDigest The round's manifest.
     * @param tokens The tokens credited to each reporting worker.
     * @param workers The reporting workers, in ascending order.
     * @param unreportedCount How many participants were recorded unreported ({UpdateUnreported}).
     * @param commitment The round's commitment.
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
     * @notice An upheld verdict ({IDisputes}) took a worker's credit for one round off its tallies.
     * @param runId The run.
     * @param round The round whose credit was voided.
     * @param worker The worker.
     * @param tokens The tokens taken off its tallies (the round's `tokens`).
     */
    event CreditVoided(bytes32 indexed runId, uint64 indexed round, address indexed worker, uint64 tokens);

    /**
     * @notice Creates a run; the caller becomes its coordinator and its creator ({handOver}). Each id once ({LedgerRunExists}).
     * Emits {RunCreated}.
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
     * @notice Records the next round of a run. Only the run's coordinator now ({LedgerNotCoordinator}) of
     * an existing run ({LedgerUnknownRun}). Every report must be signed by its worker
     * ({LedgerInvalidSignature}), active in the registry ({LedgerWorkerNotActive}). Credits each
     * reporting worker, stores the round's commitment, and emits {UpdateUnreported} per unreported
     * update, then {RoundRecorded}; any refusal reverts the whole call.
     * @param header The round: the run's last round plus one ({LedgerRoundOutOfOrder}), the previous
     * round's checkpoint as parent (the genesis checkpoint for round 1; {LedgerWrongParent}), and what
     * every report of it shares.
     * @param reports One signed report per reporting participant, in strictly ascending worker order
     * ({LedgerReportsNotSorted}); each worker is credited `header.tokens`.
     * @param unreported The update digests of the participants without a report, nonzero, strictly
     * ascending and none a report's ({LedgerBadUnreported}); nobody is credited for them. `reports`
     * and `unreported` are not both empty ({LedgerNoParticipants}).
     */
    function recordRound(RoundHeader calldata header, WorkerReport[] calldata reports, bytes32[] calldata unreported)
        external;

    /**
     * @notice Hands the run to `newCoordinator`, who records its rounds from the next one on. Only
     * the run's creator ({LedgerNotCreator}), at any time; not to zero or to the current coordinator
     * ({LedgerBadCoordinator}). Starts a new stall: votes cast before it no longer count. Emits
     * {CoordinatorHandedOver}.
     * @param runId The run ({LedgerUnknownRun}).
     * @param newCoordinator The account that records the run's rounds from now on.
     */
    function handOver(bytes32 runId, address newCoordinator) external;

    /**
     * @notice One worker's vote for `candidate` as the coordinator of a stalled run: once the run has
     * recorded nothing for {HANDOVER_STALL_BLOCKS} blocks ({LedgerNotStalled}), each worker credited
     * in its last recorded round and still active in the registry votes once ({LedgerNotVoter}).
     * The vote that gives `candidate` a strict majority of that round's credited workers hands the
     * run over to it, as {handOver} would. Emits {CoordinatorVoted}, then {CoordinatorHandedOver}
     * when the run changes hands.
     * @param runId The run ({LedgerUnknownRun}).
     * @param candidate The coordinator voted for; not zero nor the current one ({LedgerBadCoordinator}).
     */
    function voteCoordinator(bytes32 runId, address candidate) external;

    /**
     * @notice Blocks a run must have recorded nothing for before its workers may vote in a new
     * coordinator ({voteCoordinator}): about an hour at 12-second blocks.
     * @return The number of blocks.
     */
    function HANDOVER_STALL_BLOCKS() external view returns (uint64);

    /**
     * @notice The account that created a run: it may hand the run over ({handOver}).
     * @param runId The run's id.
     * @return The creator; zero if the run does not exist.
     */
    function creatorOf(bytes32 runId) external view returns (address);

    /**
     * @notice The coordinator that holds `round` of a run: the one that recorded it, or for a round not
     * recorded yet, the run's coordinator now. Receipts and verdicts about a round are judged against it.
     * @param runId The run's id.
     * @param round The round.
     * @return The coordinator; zero if the run does not exist.
     */
    function coordinatorOf(bytes32 runId, uint64 round) external view returns (address);

    /**
     * @notice Takes one round's credit of `worker` off its run tally (and so off its total): `tokens`
     * and one round. Only the ledger's {disputes} contract ({LedgerNotDisputes}), which calls it for an
     * upheld verdict after proving the round's facts, so `worker` was credited `tokens` in `round`.
     * Emits {CreditVoided}. The round's commitment is unchanged: claims still prove against it, and
     * the pool asks the disputes contract whether a credit is voided.
     * @param runId The run.
     * @param round The round.
     * @param worker The worker credited in it.
     * @param tokens The round's `tokens`.
     */
    function voidCredit(bytes32 runId, uint64 round, address worker, uint64 tokens) external;

    /**
     * @notice The disputes contract ({IDisputes}) this ledger created and accepts {voidCredit} from.
     * @return Its address; zero for a ledger without disputes.
     */
    function disputes() external view returns (address);

    /**
     * @notice The EIP-712 digest a worker signs for `report` (this ledger's domain and chain).
     * @param report The whole report.
     * @return The digest, to sign as is (no further prefix).
     */
    function reportDigest(RoundReport calldata report) external view returns (bytes32);

    /**
     * @notice The commitment a recorded round is kept as: keccak256 of the ABI encoding of `facts`.
     * @param facts A round's facts.
     * @return The commitment they hash to.
     */
    function commitmentOf(RoundFacts calldata facts) external pure returns (bytes32);

    /**
     * @notice The EIP-712 type hash of {RoundReport}.
     * @return keccak256 of the type string.
     */
    function ROUND_REPORT_TYPEHASH() external view returns (bytes32);

    /**
     * @notice The worker registry this ledger asks whether a report's worker is active.
     * @return The registry.
     */
    function registry() external view returns (IWorkerRegistry);

    /**
     * @notice A run.
     * @param runId The run's id.
     * @return The run; coordinator zero if it does not exist.
     */
    function runOf(bytes32 runId) external view returns (Run memory);

    /**
     * @notice The commitment of a recorded round.
     * @param runId The run's id.
     * @param round The round.
     * @return The commitment of its {RoundFacts}; zero if not recorded.
     */
    function roundCommitment(bytes32 runId, uint64 round) external view returns (bytes32);

    /**
     * @notice Tokens and rounds credited to `worker` in one run.
     * @param runId The run's id.
     * @param worker The worker's signing address.
     * @return The worker's contribution to the run.
     */
    function contributionOf(bytes32 runId, address worker) external view returns (Contribution memory);

    /**
     * @notice Tokens and rounds credited to `worker` over all runs.
     * @param worker The worker's signing address.
     * @return The sum of its contributions over {runsOf}.
     */
    function totalContributionOf(address worker) external view returns (Contribution memory);

    /**
     * @notice The runs `worker` has been credited in.
     * @param worker The worker's signing address.
     * @return The runs' ids, in the order of the worker's first credit in each.
     */
    function runsOf(address worker) external view returns (bytes32[] memory);
}
