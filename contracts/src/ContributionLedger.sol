// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {EIP712} from "@openzeppelin/contracts/utils/cryptography/EIP712.sol";
import {ECDSA} from "@openzeppelin/contracts/utils/cryptography/ECDSA.sol";
import {Disputes} from "./Disputes.sol";
import {IContributionLedger} from "./IContributionLedger.sol";
import {IWorkerRegistry} from "./IWorkerRegistry.sol";

/**
 * @title ContributionLedger
 * @notice {IContributionLedger}: the checkpoints of each run, credited to the workers whose reports
 * recorded them.
 *
 * The account that creates a run is its coordinator, and stays its creator: it may hand the run to
 * another coordinator, and a majority of the last round's workers may vote one in when the run
 * stalls ({IContributionLedger}, "Handover"). Every report must be signed by its worker,
 * whose key must be active in the registry, which the ledger knows only as an {IWorkerRegistry}.
 * Storage per round: one commitment slot, and one tally slot per reporting worker (its run tally); a
 * worker's total over runs is summed from its run tallies when asked ({totalContributionOf}), so a
 * report costs no second slot.
 *
 * Disputes: the ledger creates its {Disputes} contract in its constructor (owned by the ledger's
 * deployer, who admits auditors) and takes credit off a tally ({voidCredit}) only when that contract
 * asks, so the set of contracts that can change a tally is fixed at deployment (no setter).
 */
contract ContributionLedger is IContributionLedger, EIP712 {
    /// @dev A worker's tally in one run (one slot).
    struct RunTally {
        uint64 tokens;
        uint64 rounds;
        uint64 lastRound;
    }

    /// @inheritdoc IContributionLedger
    bytes32 public constant ROUND_REPORT_TYPEHASH = keccak256(
        "RoundReport(bytes32 runId,uint64 round,address worker,bytes32 parentCheckpoint,bytes32 checkpoint,bytes32 manifestDigest,bytes32 updateDigest,bytes32 dataDigest,int64 trainLossE6,int64 evalLossE6,uint64 tokens,uint32 innerSteps,uint64 bytesSent,uint64 bytesReceived)"
    );

    /**
     * @dev Who may hand a run over and when its workers may vote, in one slot that every recorded round
     * rewrites: `lastActivity` is the block of the run's last round, handover or creation;
     * `lastRoundWorkers` the workers credited in its last recorded round (the electorate).
     */
    struct Stewardship {
        address creator;
        uint64 lastActivity;
        uint32 lastRoundWorkers;
    }

    /// @dev One coordinator's tenure: it holds the rounds from `fromRound` until the next tenure's.
    struct Tenure {
        uint64 fromRound;
        address coordinator;
    }

    /// @inheritdoc IContributionLedger
    uint64 public constant HANDOVER_STALL_BLOCKS = 300;

    IWorkerRegistry private immutable _registry;
    address private immutable _disputes;

    mapping(bytes32 runId => Run) private _runs;
    mapping(bytes32 runId => mapping(uint64 round => bytes32 commitment)) private _rounds;
    mapping(bytes32 runId => mapping(address worker => RunTally)) private _tallies;
    mapping(address worker => bytes32[] runIds) private _runsOf;
    // After the slots above, which {LyingLedger} mirrors in this order.
    mapping(bytes32 runId => Stewardship) private _stewardship;
    mapping(bytes32 runId => Tenure[]) private _tenures;
    // A stall's ballot (runId, last round, last activity): who voted, and each candidate's votes.
    mapping(bytes32 ballot => mapping(address voter => bool)) private _voted;
    mapping(bytes32 ballot => mapping(address candidate => uint64 votes)) private _votes;

    /// @param registry_ The registry that says which worker keys are active.
    constructor(IWorkerRegistry registry_) EIP712("DiLoCoX Contribution Ledger", "1") {
        _registry = registry_;
        _disputes = address(new Disputes(this, msg.sender));
    }

    /// @inheritdoc IContributionLedger
    function createRun(
        bytes32 runId,
        bytes32 genesisCheckpoint,
        bytes32 configDigest,
        bytes32 genesisManifest,
        uint32 challengeWindow
    ) external {
        Run storage run = _runs[runId];
        if (run.coordinator != address(0)) revert LedgerRunExists(runId);

        run.coordinator = msg.sender;
        run.challengeWindow = challengeWindow;
        run.lastCheckpoint = genesisCheckpoint;
        run.genesisCheckpoint = genesisCheckpoint;
        run.configDigest = configDigest;
        run.genesisManifest = genesisManifest;
        _stewardship[runId] =
            Stewardship({creator: msg.sender, lastActivity: uint64(block.number), lastRoundWorkers: 0});
        _tenures[runId].push(Tenure({fromRound: 1, coordinator: msg.sender}));
        emit RunCreated(runId, msg.sender, genesisCheckpoint, configDigest, genesisManifest, challengeWindow);
    }

    /**
     * @inheritdoc IContributionLedger
     * @dev Checks, then effects, then the only external call: {IWorkerRegistry-isActive}, a view on the
     * immutable registry (a STATICCALL, so it cannot re-enter and change state); the whole call
     * reverts on any refusal.
     */
    function recordRound(RoundHeader calldata header, WorkerReport[] calldata reports, bytes32[] calldata unreported)
        external
    {
        Run storage run = _runs[header.runId];
        if (run.coordinator == address(0)) revert LedgerUnknownRun(header.runId);
        if (msg.sender != run.coordinator) revert LedgerNotCoordinator(msg.sender);
        if (header.round != run.lastRound + 1) revert LedgerRoundOutOfOrder(run.lastRound + 1, header.round);
        if (header.parentCheckpoint != run.lastCheckpoint) {
            revert LedgerWrongParent(run.lastCheckpoint, header.parentCheckpoint);
        }
        if (reports.length + unreported.length == 0) revert LedgerNoParticipants();
        _checkUnreported(reports, unreported);

        run.lastRound = header.round;
        run.lastCheckpoint = header.checkpoint;
        address[] memory workers = new address[](reports.length);
        for (uint256 i = 0; i < reports.length; ++i) {
            workers[i] = _credit(header, reports[i], i, i == 0 ? address(0) : workers[i - 1]);
        }
        bytes32 commitment = keccak256(
            abi.encode(
                RoundFacts({
                    checkpoint: header.checkpoint,
                    manifestDigest: header.manifestDigest,
                    tokens: header.tokens,
                    recordedAt: uint64(block.number),
                    unreportedCount: uint64(unreported.length),
                    workers: workers
                })
            )
        );
        _rounds[header.runId][header.round] = commitment;
        Stewardship storage stewardship = _stewardship[header.runId];
        stewardship.lastActivity = uint64(block.number);
        // forge-lint: disable-next-line(unsafe-typecast) -- one report per active worker: far below 2^32
        stewardship.lastRoundWorkers = uint32(reports.length);
        for (uint256 j = 0; j < unreported.length; ++j) {
            emit UpdateUnreported(header.runId, header.round, unreported[j]);
        }
        emit RoundRecorded(
            header.runId,
            header.round,
            header.checkpoint,
            header.manifestDigest,
            header.tokens,
            workers,
            unreported.length,
            commitment
        );
    }

    /// @inheritdoc IContributionLedger
    function handOver(bytes32 runId, address newCoordinator) external {
        Run storage run = _runs[runId];
        if (run.coordinator == address(0)) revert LedgerUnknownRun(runId);
        if (msg.sender != _stewardship[runId].creator) revert LedgerNotCreator(msg.sender);
        _handOver(runId, run, newCoordinator, false);
    }

    /// @inheritdoc IContributionLedger
    function voteCoordinator(bytes32 runId, address candidate) external {
        Run storage run = _runs[runId];
        if (run.coordinator == address(0)) revert LedgerUnknownRun(runId);
        if (candidate == address(0) || candidate == run.coordinator) revert LedgerBadCoordinator(candidate);
        Stewardship storage stewardship = _stewardship[runId];
        uint64 from = stewardship.lastActivity + HANDOVER_STALL_BLOCKS;
        if (block.number < from) revert LedgerNotStalled(from);
        // The stall's ballot: a recorded round or a handover moves lastActivity, and so opens a new one.
        bytes32 ballot = keccak256(abi.encode(runId, run.lastRound, stewardship.lastActivity));
        // Credited in the last recorded round (so round 0 has no voters), active, and not voted yet.
        if (
            run.lastRound == 0 || _tallies[runId][msg.sender].lastRound != run.lastRound
                || !_registry.isActive(msg.sender) || _voted[ballot][msg.sender]
        ) revert LedgerNotVoter(msg.sender);

        _voted[ballot][msg.sender] = true;
        uint64 votes = _votes[ballot][candidate] + 1;
        _votes[ballot][candidate] = votes;
        uint64 needed = uint64(stewardship.lastRoundWorkers) / 2 + 1;
        emit CoordinatorVoted(runId, msg.sender, candidate, votes, needed);
        if (votes >= needed) _handOver(runId, run, candidate, true);
    }

    /// @inheritdoc IContributionLedger
    function creatorOf(bytes32 runId) external view returns (address) {
        return _stewardship[runId].creator;
    }

    /// @inheritdoc IContributionLedger
    function coordinatorOf(bytes32 runId, uint64 round) external view returns (address) {
        Tenure[] storage tenures = _tenures[runId];
        // Newest first: a run changes hands rarely, and the rounds asked about are mostly recent.
        for (uint256 i = tenures.length; i > 0; --i) {
            if (tenures[i - 1].fromRound <= round || i == 1) return tenures[i - 1].coordinator;
        }
        return address(0);
    }

    /// @inheritdoc IContributionLedger
    function voidCredit(bytes32 runId, uint64 round, address worker, uint64 tokens) external {
        if (msg.sender != _disputes) revert LedgerNotDisputes(msg.sender);
        RunTally storage tally = _tallies[runId][worker];
        tally.tokens -= tokens;
        tally.rounds -= 1;
        emit CreditVoided(runId, round, worker, tokens);
    }

    /// @inheritdoc IContributionLedger
    function disputes() external view returns (address) {
        return _disputes;
    }

    /// @inheritdoc IContributionLedger
    function reportDigest(RoundReport calldata report) external view returns (bytes32) {
        return _digest(report);
    }

    /// @inheritdoc IContributionLedger
    function commitmentOf(RoundFacts calldata facts) external pure returns (bytes32) {
        return keccak256(abi.encode(facts));
    }

    /// @inheritdoc IContributionLedger
    function runOf(bytes32 runId) external view returns (Run memory) {
        return _runs[runId];
    }

    /// @inheritdoc IContributionLedger
    function roundCommitment(bytes32 runId, uint64 round) external view returns (bytes32) {
        return _rounds[runId][round];
    }

    /// @inheritdoc IContributionLedger
    function contributionOf(bytes32 runId, address worker) external view returns (Contribution memory) {
        RunTally storage tally = _tallies[runId][worker];
        return Contribution({tokens: tally.tokens, rounds: tally.rounds});
    }

    /// @inheritdoc IContributionLedger
    function totalContributionOf(address worker) external view returns (Contribution memory total) {
        bytes32[] storage runIds = _runsOf[worker];
        for (uint256 i = 0; i < runIds.length; ++i) {
            RunTally storage tally = _tallies[runIds[i]][worker];
            total.tokens += tally.tokens;
            total.rounds += tally.rounds;
        }
    }

    /// @inheritdoc IContributionLedger
    function runsOf(address worker) external view returns (bytes32[] memory) {
        return _runsOf[worker];
    }

    /// @inheritdoc IContributionLedger
    function registry() external view returns (IWorkerRegistry) {
        return _registry;
    }

    /**
     * @dev Makes `next` the run's coordinator from its next round on: a new tenure (or, when the
     * current one has recorded nothing yet, that tenure given to `next`), and a fresh stall window.
     */
    function _handOver(bytes32 runId, Run storage run, address next, bool byVote) private {
        if (next == address(0) || next == run.coordinator) revert LedgerBadCoordinator(next);
        address previous = run.coordinator;
        uint64 fromRound = run.lastRound + 1;
        run.coordinator = next;
        Tenure[] storage tenures = _tenures[runId];
        if (tenures[tenures.length - 1].fromRound == fromRound) tenures[tenures.length - 1].coordinator = next;
        else tenures.push(Tenure({fromRound: fromRound, coordinator: next}));
        _stewardship[runId].lastActivity = uint64(block.number);
        emit CoordinatorHandedOver(runId, previous, next, fromRound, byVote);
    }

    /**
     * @dev Unreported updates are nonzero, strictly ascending (so none repeats) and none is the update
     * of one of the reports: each participant is accounted for once, by a report or on the
     * coordinator's word.
     */
    function _checkUnreported(WorkerReport[] calldata reports, bytes32[] calldata unreported) private pure {
        for (uint256 j = 0; j < unreported.length; ++j) {
            if (unreported[j] == bytes32(0) || (j > 0 && unreported[j] <= unreported[j - 1])) {
                revert LedgerBadUnreported(j);
            }
            for (uint256 i = 0; i < reports.length; ++i) {
                if (reports[i].updateDigest == unreported[j]) revert LedgerBadUnreported(j);
            }
        }
    }

    /// @dev Checks report `index` (above `previous` in worker order, signed by its active worker), then
    /// credits its worker; returns the worker.
    function _credit(RoundHeader calldata header, WorkerReport calldata report, uint256 index, address previous)
        private
        returns (address)
    {
        if (report.worker <= previous) revert LedgerReportsNotSorted(index);
        bytes32 digest = _digest(
            RoundReport({
                runId: header.runId,
                round: header.round,
                worker: report.worker,
                parentCheckpoint: header.parentCheckpoint,
                checkpoint: header.checkpoint,
                manifestDigest: header.manifestDigest,
                updateDigest: report.updateDigest,
                dataDigest: report.dataDigest,
                trainLossE6: report.trainLossE6,
                evalLossE6: header.evalLossE6,
                tokens: header.tokens,
                innerSteps: header.innerSteps,
                bytesSent: report.bytesSent,
                bytesReceived: report.bytesReceived
            })
        );
        (address signer, ECDSA.RecoverError err,) = ECDSA.tryRecoverCalldata(digest, report.signature);
        if (err != ECDSA.RecoverError.NoError || signer != report.worker) revert LedgerInvalidSignature(index);
        if (!_registry.isActive(signer)) revert LedgerWorkerNotActive(signer);

        RunTally storage tally = _tallies[header.runId][signer];
        // lastRound, not rounds: a voided credit ({voidCredit}) can take rounds back to 0, and the run
        // must not be listed twice.
        if (tally.lastRound == 0) _runsOf[signer].push(header.runId);
        tally.tokens += header.tokens;
        tally.rounds += 1;
        tally.lastRound = header.round;
        return signer;
    }

    function _digest(RoundReport memory report) private view returns (bytes32) {
        // Every field is a static type, so abi.encode lays them out as EIP-712's encodeData does.
        return _hashTypedDataV4(keccak256(abi.encode(ROUND_REPORT_TYPEHASH, report)));
    }
}
