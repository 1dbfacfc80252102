// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {Ownable} from "@openzeppelin/contracts/access/Ownable.sol";
import {Ownable2Step} from "@openzeppelin/contracts/access/Ownable2Step.sol";
import {EIP712} from "@openzeppelin/contracts/utils/cryptography/EIP712.sol";
import {ECDSA} from "@openzeppelin/contracts/utils/cryptography/ECDSA.sol";
import {BitMaps} from "@openzeppelin/contracts/utils/structs/BitMaps.sol";
import {IContributionLedger} from "./IContributionLedger.sol";
import {IDisputes} from "./IDisputes.sol";

/**
 * @title Disputes
 * @notice {IDisputes}: verdicts of a run's admitted auditors that void credit on the ledger.
 *
 * The ledger creates its one Disputes in its constructor and accepts {IContributionLedger-voidCredit}
 * from it alone, so no other contract can take credit off a tally. Its owner is the ledger's deployer
 * ({Ownable2Step}: a transfer takes effect when the new owner accepts it). A verdict's window is the run's
 * `challengeWindow` on the ledger, from the block the round was recorded in: round r recorded in
 * block b is disputable in blocks [b, b + w), and the reward pool pays it from block b + w on, so no
 * payment can precede a void of the same credit.
 *
 * Storage per verdict: one slot per voided (run, round) summary ({RoundVoids}) and one bit per voided
 * worker; a claim asks {isVoided}, which reads the summary and, only in a round with a voided worker,
 * the bit.
 */
contract Disputes is IDisputes, EIP712, Ownable2Step {
    using BitMaps for BitMaps.BitMap;

    /// @dev How a round stands (one slot).
    struct RoundVoids {
        bool roundVoided;
        uint64 workersVoided;
    }

    /// @dev A run's panel (one slot).
    struct Panel {
        uint64 auditors;
        uint64 threshold;
    }

    /// @inheritdoc IDisputes
    bytes32 public constant VERDICT_TYPEHASH =
        keccak256("Verdict(bytes32 runId,uint64 round,address party,bytes32 check,bytes32 evidence)");

    IContributionLedger private immutable _ledger;

    mapping(bytes32 runId => Panel) private _panels;
    mapping(bytes32 runId => mapping(address auditor => bool)) private _auditors;
    mapping(bytes32 runId => mapping(uint64 round => RoundVoids)) private _voids;
    /// @dev Set bit `round` of a (run, worker) map: the worker's credit in that round is voided.
    mapping(bytes32 runId => mapping(address worker => BitMaps.BitMap)) private _voided;

    /**
     * @param ledger_ The ledger that created this contract (it does not answer calls yet: its
     * constructor is running).
     * @param initialOwner The account that admits auditors and sets thresholds: the ledger's deployer.
     */
    constructor(IContributionLedger ledger_, address initialOwner) EIP712("DiLoCoX Disputes", "1") Ownable(initialOwner) {
        _ledger = ledger_;
    }

    /// @inheritdoc IDisputes
    function admitAuditor(bytes32 runId, address auditor, bytes32 measurement, bytes32 evidenceDigest)
        external
        onlyOwner
    {
        address coordinator = _ledger.runOf(runId).coordinator;
        if (coordinator == address(0)) revert DisputesUnknownRun(runId);
        if (auditor == address(0)) revert DisputesZeroAddress();
        if (auditor == coordinator) revert DisputesCoordinatorAuditor(auditor);
        if (_auditors[runId][auditor]) revert DisputesAlreadyAdmitted(runId, auditor);

        _auditors[runId][auditor] = true;
        _panels[runId].auditors += 1;
        emit AuditorAdmitted(runId, auditor, measurement, evidenceDigest);
    }

    /// @inheritdoc IDisputes
    function setThreshold(bytes32 runId, uint256 threshold) external onlyOwner {
        Panel storage panel = _panels[runId];
        if (threshold == 0 || threshold > panel.auditors) revert DisputesBadThreshold(threshold, panel.auditors);
        // forge-lint: disable-next-line(unsafe-typecast) -- threshold <= panel.auditors, a uint64
        panel.threshold = uint64(threshold);
        emit ThresholdSet(runId, threshold);
    }

    /**
     * @inheritdoc IDisputes
     * @dev Checks (the round against the ledger, the party, the signatures), effects (the void marks),
     * then the ledger's {IContributionLedger-voidCredit} per voided credit, then the event.
     */
    function dispute(
        Verdict calldata verdict,
        IContributionLedger.RoundFacts calldata facts,
        uint256 index,
        bytes[] calldata signatures
    ) external {
        IContributionLedger.Run memory run = _ledger.runOf(verdict.runId);
        _checkRound(verdict, facts, run.challengeWindow);
        address[] memory signers = _checkSignatures(verdict, signatures);
        RoundVoids storage voids = _voids[verdict.runId][verdict.round];
        if (voids.roundVoided) revert DisputesAlreadyVoided(verdict.round, verdict.party);
        // The coordinator that held the round, which a handover since does not change.
        if (verdict.party == _ledger.coordinatorOf(verdict.runId, verdict.round)) {
            voids.roundVoided = true;
            for (uint256 i = 0; i < facts.workers.length; ++i) {
                BitMaps.BitMap storage marks = _voided[verdict.runId][facts.workers[i]];
                if (!marks.get(verdict.round)) _ledger.voidCredit(verdict.runId, verdict.round, facts.workers[i], facts.tokens);
            }
        } else {
            if (index >= facts.workers.length || facts.workers[index] != verdict.party) {
                revert DisputesNotCredited(verdict.round, verdict.party);
            }
            BitMaps.BitMap storage marks = _voided[verdict.runId][verdict.party];
            if (marks.get(verdict.round)) revert DisputesAlreadyVoided(verdict.round, verdict.party);
            marks.set(verdict.round);
            voids.workersVoided += 1;
            _ledger.voidCredit(verdict.runId, verdict.round, verdict.party, facts.tokens);
        }
        emit VerdictUpheld(verdict.runId, verdict.round, verdict.party, verdict.check, verdict.evidence, signers);
    }

    /// @inheritdoc IDisputes
    function verdictDigest(Verdict calldata verdict) external view returns (bytes32) {
        return _digest(verdict);
    }

    /// @inheritdoc IDisputes
    function isVoided(bytes32 runId, uint64 round, address worker) external view returns (bool) {
        RoundVoids storage voids = _voids[runId][round];
        if (voids.roundVoided) return true;
        return voids.workersVoided != 0 && _voided[runId][worker].get(round);
    }

    /// @inheritdoc IDisputes
    function voidsOf(bytes32 runId, uint64 round) external view returns (bool roundVoided, uint64 workersVoided) {
        RoundVoids storage voids = _voids[runId][round];
        return (voids.roundVoided, voids.workersVoided);
    }

    /// @inheritdoc IDisputes
    function isAuditor(bytes32 runId, address auditor) external view returns (bool) {
        return _auditors[runId][auditor];
    }

    /// @inheritdoc IDisputes
    function panelOf(bytes32 runId) external view returns (uint64 auditors, uint64 threshold) {
        Panel storage panel = _panels[runId];
        return (panel.auditors, panel.threshold);
    }

    /// @inheritdoc IDisputes
    function ledger() external view returns (IContributionLedger) {
        return _ledger;
    }

    /// @dev The verdict's round is recorded, its facts prove, and its window is open.
    function _checkRound(Verdict calldata verdict, IContributionLedger.RoundFacts calldata facts, uint32 window)
        private
        view
    {
        bytes32 committed = _ledger.roundCommitment(verdict.runId, verdict.round);
        if (committed == bytes32(0)) revert DisputesRoundNotRecorded(verdict.round);
        if (keccak256(abi.encode(facts)) != committed) revert DisputesBadProof(verdict.round);
        uint256 closedAt = uint256(facts.recordedAt) + window;
        if (block.number >= closedAt) revert DisputesWindowClosed(verdict.round, closedAt);
    }

    /// @dev At least the run's threshold of signatures, each by an admitted auditor, in strictly
    /// ascending signer order; returns the signers.
    function _checkSignatures(Verdict calldata verdict, bytes[] calldata signatures)
        private
        view
        returns (address[] memory signers)
    {
        uint256 threshold = _panels[verdict.runId].threshold;
        if (threshold == 0) revert DisputesNoPanel(verdict.runId);
        if (signatures.length < threshold) revert DisputesTooFewSignatures(signatures.length, threshold);
        bytes32 digest = _digest(verdict);
        signers = new address[](signatures.length);
        for (uint256 i = 0; i < signatures.length; ++i) {
            (address signer, ECDSA.RecoverError err,) = ECDSA.tryRecoverCalldata(digest, signatures[i]);
            if (err != ECDSA.RecoverError.NoError) revert DisputesInvalidSignature(i);
            if (!_auditors[verdict.runId][signer]) revert DisputesNotAuditor(signer);
            if (i > 0 && signer <= signers[i - 1]) revert DisputesDuplicateSigner(i);
            signers[i] = signer;
        }
    }

    function _digest(Verdict memory verdict) private view returns (bytes32) {
        // Every field is a static type, so abi.encode lays them out as EIP-712's encodeData does.
        return _hashTypedDataV4(keccak256(abi.encode(VERDICT_TYPEHASH, verdict)));
    }
}
