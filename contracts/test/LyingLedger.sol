// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {EIP712} from "@openzeppelin/contracts/utils/cryptography/EIP712.sol";
import {ContributionLedger} from "../src/ContributionLedger.sol";
import {IContributionLedger} from "../src/IContributionLedger.sol";
import {IWorkerRegistry} from "../src/IWorkerRegistry.sol";

/**
 * @dev TEST ONLY. A ledger that lies: an {IContributionLedger}, so it has the ABI, structs, events and
 * errors of {ContributionLedger}, and it has the real ledger's storage layout (its own `RunTally`) and
 * EIP-712 domain too; but `recordRound` skips every check (caller, order, parent, signature, active
 * worker, report order), and `forgeTally`, `forgeTotal` and `forgeCommitment` rewrite what it answers
 * at will.
 *
 * The audit tests put its runtime code at a real ledger's address (`anvil_setCode`); the storage
 * layout matches (its own slots come after the real ledger's), so the runs and tallies recorded so
 * far stay readable. The audit must catch whatever this contract lets through, because an auditor
 * cannot trust a ledger's checks, only what it recorded; the reward pool must not pay out more than
 * a run was funded with, whatever this contract answers.
 */
contract LyingLedger is IContributionLedger, EIP712 {
    /// @inheritdoc IContributionLedger
    bytes32 public constant ROUND_REPORT_TYPEHASH = keccak256(
        "RoundReport(bytes32 runId,uint64 round,address worker,bytes32 parentCheckpoint,bytes32 checkpoint,bytes32 manifestDigest,bytes32 updateDigest,bytes32 dataDigest,int64 trainLossE6,int64 evalLossE6,uint64 tokens,uint32 innerSteps,uint64 bytesSent,uint64 bytesReceived)"
    );

    IWorkerRegistry private immutable _registry;

    // Same order and types as ContributionLedger (its own RunTally), so the state it wrote stays where
    // this code reads it.
    mapping(bytes32 runId => Run) private _runs;
    mapping(bytes32 runId => mapping(uint64 round => bytes32 commitment)) private _rounds;
    mapping(bytes32 runId => mapping(address worker => ContributionLedger.RunTally)) private _tallies;
    mapping(address worker => bytes32[] runIds) private _runsOf;
    mapping(bytes32 runId => ContributionLedger.Stewardship) private _stewardship;
    mapping(bytes32 runId => ContributionLedger.Tenure[]) private _tenures;
    mapping(bytes32 ballot => mapping(address voter => bool)) private _voted;
    mapping(bytes32 ballot => mapping(address candidate => uint64 votes)) private _votes;
    // Its own, after the real ledger's slots.
    mapping(address worker => Contribution) private _forgedTotals;

    /// @param registry_ The registry it names (and never asks).
    constructor(IWorkerRegistry registry_) EIP712("DiLoCoX Contribution Ledger", "1") {
        _registry = registry_;
    }

    /// @dev Like {ContributionLedger-createRun}, but a run can be created again, by anyone.
    function createRun(
        bytes32 runId,
        bytes32 genesisCheckpoint,
        bytes32 configDigest,
        bytes32 genesisManifest,
        uint32 challengeWindow
    ) external {
        Run storage run = _runs[runId];
        // No LedgerRunExists: an existing run is overwritten.
        run.coordinator = msg.sender;
        run.challengeWindow = challengeWindow;
        run.lastCheckpoint = genesisCheckpoint;
        run.genesisCheckpoint = genesisCheckpoint;
        run.configDigest = configDigest;
        run.genesisManifest = genesisManifest;
        emit RunCreated(runId, msg.sender, genesisCheckpoint, configDigest, genesisManifest, challengeWindow);
    }

    /// @dev No checks at all, not even the caller: whatever it says is recorded and tallied.
    function recordRound(RoundHeader calldata header, WorkerReport[] calldata reports, bytes32[] calldata unreported)
        external
    {
        Run storage run = _runs[header.runId];
        run.lastRound = header.round;
        run.lastCheckpoint = header.checkpoint;
        address[] memory workers = new address[](reports.length);
        for (uint256 i = 0; i < reports.length; ++i) {
            workers[i] = reports[i].worker;
            ContributionLedger.RunTally storage tally = _tallies[header.runId][reports[i].worker];
            if (tally.rounds == 0) _runsOf[reports[i].worker].push(header.runId);
            tally.tokens += header.tokens;
            tally.rounds += 1;
            tally.lastRound = header.round;
        }
        bytes32 commitment = keccak256(
            abi.encode(
                RoundFacts(
                    header.checkpoint,
                    header.manifestDigest,
                    header.tokens,
                    uint64(block.number),
                    uint64(unreported.length),
                    workers
                )
            )
        );
        _rounds[header.runId][header.round] = commitment;
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

    /// @dev Rewrites a worker's per-run tally (a ledger that miscounts).
    function forgeTally(bytes32 runId, address worker, uint64 tokens, uint64 rounds) external {
        ContributionLedger.RunTally storage tally = _tallies[runId][worker];
        tally.tokens = tokens;
        tally.rounds = rounds;
    }

    /// @dev Makes totalContributionOf(worker) answer this (a ledger whose totals drift from its runs).
    function forgeTotal(address worker, uint64 tokens, uint64 rounds) external {
        _forgedTotals[worker] = Contribution(tokens, rounds);
    }

    /// @dev Rewrites a round's commitment (a ledger that answers claims as it likes).
    function forgeCommitment(bytes32 runId, uint64 round, bytes32 commitment) external {
        _rounds[runId][round] = commitment;
    }

    /// @dev Takes credit off like the real ledger, from anyone.
    function voidCredit(bytes32 runId, uint64 round, address worker, uint64 tokens) external {
        ContributionLedger.RunTally storage tally = _tallies[runId][worker];
        tally.tokens -= tokens;
        tally.rounds -= 1;
        emit CreditVoided(runId, round, worker, tokens);
    }

    /// @dev None: a pool over this ledger has no verdicts to ask about.
    function disputes() external pure returns (address) {
        return address(0);
    }

    /// @inheritdoc IContributionLedger
    function reportDigest(RoundReport calldata report) public view returns (bytes32) {
        return _hashTypedDataV4(keccak256(abi.encode(ROUND_REPORT_TYPEHASH, report)));
    }

    /// @inheritdoc IContributionLedger
    function commitmentOf(RoundFacts calldata facts) external pure returns (bytes32) {
        return keccak256(abi.encode(facts));
    }

    /// @inheritdoc IContributionLedger
    uint64 public constant HANDOVER_STALL_BLOCKS = 300;

    /// @dev Like {ContributionLedger-handOver}, but anyone may hand any run to anyone.
    function handOver(bytes32 runId, address newCoordinator) external {
        Run storage run = _runs[runId];
        emit CoordinatorHandedOver(runId, run.coordinator, newCoordinator, run.lastRound + 1, false);
        run.coordinator = newCoordinator;
    }

    /// @dev One vote hands the run over, stalled or not.
    function voteCoordinator(bytes32 runId, address candidate) external {
        Run storage run = _runs[runId];
        emit CoordinatorVoted(runId, msg.sender, candidate, 1, 1);
        emit CoordinatorHandedOver(runId, run.coordinator, candidate, run.lastRound + 1, true);
        run.coordinator = candidate;
    }

    /// @dev What the real ledger wrote, if it wrote it.
    function creatorOf(bytes32 runId) external view returns (address) {
        return _stewardship[runId].creator;
    }

    /// @dev The run's coordinator now, whatever round is asked about.
    function coordinatorOf(bytes32 runId, uint64) external view returns (address) {
        return _runs[runId].coordinator;
    }

    /// @inheritdoc IContributionLedger
    function runOf(bytes32 runId) external view returns (Run memory) {
        return _runs[runId];
    }

    /// @dev What was recorded, or what {forgeCommitment} last wrote.
    function roundCommitment(bytes32 runId, uint64 round) external view returns (bytes32) {
        return _rounds[runId][round];
    }

    /// @dev What was tallied, or what {forgeTally} last wrote.
    function contributionOf(bytes32 runId, address worker) external view returns (Contribution memory) {
        ContributionLedger.RunTally storage tally = _tallies[runId][worker];
        return Contribution({tokens: tally.tokens, rounds: tally.rounds});
    }

    /// @dev The sum over {runsOf} of {contributionOf}, or what {forgeTotal} wrote, if anything.
    function totalContributionOf(address worker) external view returns (Contribution memory total) {
        Contribution memory forged = _forgedTotals[worker];
        if (forged.tokens != 0 || forged.rounds != 0) return forged;
        bytes32[] storage runIds = _runsOf[worker];
        for (uint256 i = 0; i < runIds.length; ++i) {
            total.tokens += _tallies[runIds[i]][worker].tokens;
            total.rounds += _tallies[runIds[i]][worker].rounds;
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
}
