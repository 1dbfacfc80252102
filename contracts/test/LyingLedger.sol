// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {EIP712} from "@openzeppelin/contracts/utils/cryptography/EIP712.sol";
import {IContributionLedger} from "../src/IContributionLedger.sol";
import {WorkerRegistry} from "../src/WorkerRegistry.sol";

/**
 * @dev TEST ONLY. A ledger that lies: the ABI, events, storage layout and EIP-712 domain of
 * {ContributionLedger}, but `recordRound` skips every report check (signature, active worker,
 * replay, one report per worker) and `forgeTally` rewrites a worker's tally at will.
 *
 * The audit tests put its runtime code at a real ledger's address (`anvil_setCode`); the storage
 * layout matches, so the runs and tallies recorded so far stay readable. The audit must catch
 * whatever this contract lets through, because an auditor cannot trust a ledger's checks, only
 * what it recorded.
 */
contract LyingLedger is IContributionLedger, EIP712 {
    struct RunTally {
        uint64 tokens;
        uint64 rounds;
        uint64 lastRound;
    }

    bytes32 public constant ROUND_REPORT_TYPEHASH = keccak256(
        "RoundReport(bytes32 runId,uint64 round,address worker,bytes32 parentCheckpoint,bytes32 checkpoint,bytes32 updateDigest,bytes32 dataDigest,int64 trainLossE6,int64 evalLossE6,uint64 tokens,uint32 innerSteps,uint64 bytesSent,uint64 bytesReceived)"
    );

    WorkerRegistry private immutable _registry;

    // Same order as ContributionLedger, so the state it wrote stays where this code reads it.
    mapping(bytes32 runId => Run) private _runs;
    mapping(bytes32 runId => mapping(uint64 round => RoundRecord)) private _rounds;
    mapping(bytes32 digest => bool) private _recorded;
    mapping(bytes32 runId => mapping(address worker => RunTally)) private _tallies;
    mapping(address worker => Contribution) private _totals;

    constructor(WorkerRegistry registry_) EIP712("DiLoCoX Contribution Ledger", "1") {
        _registry = registry_;
    }

    function createRun(bytes32 runId, bytes32 genesisCheckpoint, bytes32 configDigest, bytes32 genesisManifest)
        external
    {
        Run storage run = _runs[runId];
        run.coordinator = msg.sender;
        run.lastCheckpoint = genesisCheckpoint;
        run.genesisCheckpoint = genesisCheckpoint;
        run.configDigest = configDigest;
        run.genesisManifest = genesisManifest;
        emit RunCreated(runId, msg.sender, genesisCheckpoint, configDigest, genesisManifest);
    }

    /// @dev No checks at all: whatever the caller says is recorded and tallied.
    function recordRound(
        bytes32 runId,
        uint64 round,
        bytes32 parentCheckpoint,
        bytes32 checkpoint,
        bytes32 manifestDigest,
        SignedReport[] calldata reports,
        bytes32[] calldata unreported
    ) external {
        parentCheckpoint; // accepted as given
        Run storage run = _runs[runId];
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
            _credit(runId, round, reports[i].report);
        }
        for (uint256 j = 0; j < unreported.length; ++j) {
            emit UpdateUnreported(runId, round, unreported[j]);
        }
        emit RoundRecorded(runId, round, checkpoint, manifestDigest, reports.length, unreported.length);
    }

    /// @dev Tallies a report as given (the real ledger checks it first).
    function _credit(bytes32 runId, uint64 round, RoundReport calldata report) private {
        bytes32 digest = reportDigest(report);
        _recorded[digest] = true;
        RunTally storage tally = _tallies[runId][report.worker];
        tally.tokens += report.tokens;
        tally.rounds += 1;
        tally.lastRound = round;
        Contribution storage total = _totals[report.worker];
        total.tokens += report.tokens;
        total.rounds += 1;
        emit ReportAccepted(runId, round, report.worker, digest, report.tokens);
    }

    /// @dev Rewrites a worker's per-run tally (a ledger that miscounts).
    function forgeTally(bytes32 runId, address worker, uint64 tokens, uint64 rounds) external {
        RunTally storage tally = _tallies[runId][worker];
        tally.tokens = tokens;
        tally.rounds = rounds;
    }

    function reportDigest(RoundReport calldata report) public view returns (bytes32) {
        return _hashTypedDataV4(keccak256(abi.encode(ROUND_REPORT_TYPEHASH, report)));
    }

    function isReportRecorded(bytes32 digest) external view returns (bool) {
        return _recorded[digest];
    }

    function runOf(bytes32 runId) external view returns (Run memory) {
        return _runs[runId];
    }

    function roundOf(bytes32 runId, uint64 round) external view returns (RoundRecord memory) {
        return _rounds[runId][round];
    }

    function contributionOf(bytes32 runId, address worker) external view returns (Contribution memory) {
        RunTally storage tally = _tallies[runId][worker];
        return Contribution({tokens: tally.tokens, rounds: tally.rounds});
    }

    function totalContributionOf(address worker) external view returns (Contribution memory) {
        return _totals[worker];
    }

    function registry() external view returns (WorkerRegistry) {
        return _registry;
    }
}
