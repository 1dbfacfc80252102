// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {IContributionLedger} from "./IContributionLedger.sol";

/**
 * @title IDisputes
 * @notice Verdicts with teeth (docs/trust.md, "Disputes"): within a recorded round's challenge window,
 * k distinct auditors admitted to the run sign one EIP-712 {Verdict} naming the round, a party and the
 * audit check that failed; the verdict is upheld and
 *   - against a worker credited in the round: that worker's credit for the round is voided — the
 *     ledger's tallies ({IContributionLedger-contributionOf}, {IContributionLedger-totalContributionOf})
 *     no longer count it, and the reward pool refuses to pay it;
 *   - against the coordinator that held the round ({IContributionLedger-coordinatorOf}, so a handover
 *     since changes nothing): the whole round is voided — every credit of the round is taken off the
 *     tallies and no one is paid for it (the coordinator vouched for what the round averaged, so no
 *     worker's report in it can be trusted to have been used as signed).
 * A voided share is never paid; the pool returns it to the run's funder ({IRewardPool-reclaim}).
 *
 * Auditors: the owner of this contract — the account that deployed the ledger, the same party that
 * owns the worker registry and decides which code may be a worker and who verifies — checks an
 * auditor's attestation evidence off chain (a key made inside its TEE, or the dev stand-in, bound by
 * REPORTDATA to the audit code's measurement) and admits its key to one run ({admitAuditor}); it
 * also sets the run's threshold k ({setThreshold}). A run's coordinator is a registry verifier (it
 * admits its workers) but has no call here: it can neither keep an auditor out nor add one, and it can
 * never be an auditor of its own run ({DisputesCoordinatorAuditor}). An admitted auditor stays
 * admitted for the run.
 *
 * One verdict per (run, round, party): a repeated one, or one for a round already voided whole, is
 * refused ({DisputesAlreadyVoided}).
 */
interface IDisputes {
    /**
     * @notice What auditors sign: the audit's finding that `party` failed check `check` in `round` of
     * `runId`, having read `evidence`.
     * @param runId The run.
     * @param round The recorded round the finding is about.
     * @param party A worker credited in the round, or the coordinator that held the round (then the
     * round is voided).
     * @param check The failed audit check: keccak256 of its name (e.g. keccak256("replay")).
     * @param evidence The digest of the content-addressed object the check read (its CID's digest).
     */
    struct Verdict {
        bytes32 runId;
        uint64 round;
        address party;
        bytes32 check;
        bytes32 evidence;
    }

    /**
     * @dev No run has this id on the ledger.
     * @param runId The id the call named.
     */
    error DisputesUnknownRun(bytes32 runId);

    /// @dev The zero address cannot be an auditor.
    error DisputesZeroAddress();

    /**
     * @dev The run's coordinator (the party auditors judge) cannot audit its own run.
     * @param auditor The key the admission named.
     */
    error DisputesCoordinatorAuditor(address auditor);

    /**
     * @dev The auditor is admitted to the run already.
     * @param runId The run.
     * @param auditor The auditor's key.
     */
    error DisputesAlreadyAdmitted(bytes32 runId, address auditor);

    /**
     * @dev A threshold must be at least 1 and at most the run's admitted auditors.
     * @param threshold The threshold the call named.
     * @param auditors The run's admitted auditors.
     */
    error DisputesBadThreshold(uint256 threshold, uint256 auditors);

    /**
     * @dev The run has no threshold (no panel) yet.
     * @param runId The run.
     */
    error DisputesNoPanel(bytes32 runId);

    /**
     * @dev The round is not recorded on the ledger.
     * @param round The round.
     */
    error DisputesRoundNotRecorded(uint64 round);

    /**
     * @dev The facts do not hash to the ledger's commitment of the round.
     * @param round The round.
     */
    error DisputesBadProof(uint64 round);

    /**
     * @dev The round's challenge window is over.
     * @param round The round.
     * @param closedAt The first block in which verdicts on it are refused.
     */
    error DisputesWindowClosed(uint64 round, uint256 closedAt);

    /**
     * @dev The verdict's party is neither the run's coordinator nor the round's credited worker at the
     * given index.
     * @param round The round.
     * @param party The party.
     */
    error DisputesNotCredited(uint64 round, address party);

    /**
     * @dev The party's credit in the round (or the whole round) is voided already.
     * @param round The round.
     * @param party The party.
     */
    error DisputesAlreadyVoided(uint64 round, address party);

    /**
     * @dev Fewer signatures than the run's threshold.
     * @param got The signatures given.
     * @param need The run's threshold.
     */
    error DisputesTooFewSignatures(uint256 got, uint256 need);

    /**
     * @dev A signature does not recover (malformed or malleable).
     * @param index The signature's position.
     */
    error DisputesInvalidSignature(uint256 index);

    /**
     * @dev A signature's signer is not an auditor admitted to the run.
     * @param signer The recovered signer.
     */
    error DisputesNotAuditor(address signer);

    /**
     * @dev A signer is not above the previous one: signatures come in strictly ascending signer order,
     * so no auditor counts twice.
     * @param index The signature's position.
     */
    error DisputesDuplicateSigner(uint256 index);

    /**
     * @notice An auditor key was admitted to a run.
     * @param runId The run.
     * @param auditor The auditor's signing address, bound into its evidence's REPORTDATA.
     * @param measurement The audit code's measurement its evidence showed.
     * @param evidenceDigest sha256 of its evidence bytes.
     */
    event AuditorAdmitted(bytes32 indexed runId, address indexed auditor, bytes32 measurement, bytes32 evidenceDigest);

    /**
     * @notice A run's threshold was set.
     * @param runId The run.
     * @param threshold Distinct admitted auditors a verdict needs.
     */
    event ThresholdSet(bytes32 indexed runId, uint256 threshold);

    /**
     * @notice A verdict was upheld: `party`'s credit in the round (or, for the coordinator, the round)
     * is voided.
     * @param runId The run.
     * @param round The round.
     * @param party The party judged.
     * @param check The failed check's id.
     * @param evidence The evidence's digest.
     * @param signers The auditors that signed it, ascending.
     */
    event VerdictUpheld(
        bytes32 indexed runId, uint64 indexed round, address indexed party, bytes32 check, bytes32 evidence,
        address[] signers
    );

    /**
     * @notice Admits `auditor` to `runId`, after the caller checked its evidence off chain. Only the
     * owner (OpenZeppelin's OwnableUnauthorizedAccount); an existing run ({DisputesUnknownRun}); not
     * zero ({DisputesZeroAddress}), not
     * the run's coordinator ({DisputesCoordinatorAuditor}), once ({DisputesAlreadyAdmitted}). Emits
     * {AuditorAdmitted}.
     * @param runId The run.
     * @param auditor The auditor's signing address.
     * @param measurement The audit code's measurement its evidence shows.
     * @param evidenceDigest sha256 of its evidence bytes (kept in the store as a raw object).
     */
    function admitAuditor(bytes32 runId, address auditor, bytes32 measurement, bytes32 evidenceDigest) external;

    /**
     * @notice Sets the run's threshold: how many distinct admitted auditors a verdict needs. Only the
     * owner; 1 ≤ threshold ≤ admitted auditors
     * ({DisputesBadThreshold}). Emits {ThresholdSet}.
     * @param runId The run.
     * @param threshold k.
     */
    function setThreshold(bytes32 runId, uint256 threshold) external;

    /**
     * @notice Upholds `verdict`, signed by at least the run's threshold of its admitted auditors, whoever
     * sends it. Refused for: no panel ({DisputesNoPanel}); a round not recorded
     * ({DisputesRoundNotRecorded}); facts that do not prove ({DisputesBadProof}); the window over
     * ({DisputesWindowClosed}); a party neither the coordinator nor credited at `index`
     * ({DisputesNotCredited}); a party (or round) voided already ({DisputesAlreadyVoided}); too few
     * signatures ({DisputesTooFewSignatures}); a bad signature ({DisputesInvalidSignature}); a signer not
     * admitted ({DisputesNotAuditor}); signers not strictly ascending ({DisputesDuplicateSigner}).
     * Voids the credit(s) on the ledger ({IContributionLedger-voidCredit}), emits {VerdictUpheld}.
     * @param verdict The verdict.
     * @param facts The round's facts, proven against {IContributionLedger-roundCommitment}.
     * @param index The party's position in `facts.workers` (ignored for the coordinator).
     * @param signatures 65-byte (r, s, v) signatures over {verdictDigest}, in ascending signer order.
     */
    function dispute(
        Verdict calldata verdict,
        IContributionLedger.RoundFacts calldata facts,
        uint256 index,
        bytes[] calldata signatures
    ) external;

    /**
     * @notice The EIP-712 digest an auditor signs for `verdict` (domain "DiLoCoX Disputes", "1", this
     * contract, this chain).
     * @param verdict The verdict.
     * @return The digest, to sign as is.
     */
    function verdictDigest(Verdict calldata verdict) external view returns (bytes32);

    /**
     * @notice The EIP-712 type hash of {Verdict}.
     * @return keccak256 of the type string.
     */
    function VERDICT_TYPEHASH() external view returns (bytes32);

    /**
     * @notice Whether `worker`'s credit in `round` is voided (by a verdict against it or against the
     * coordinator).
     * @param runId The run.
     * @param round The round.
     * @param worker The worker.
     * @return Whether the pool must refuse to pay it.
     */
    function isVoided(bytes32 runId, uint64 round, address worker) external view returns (bool);

    /**
     * @notice How a round stands after its verdicts.
     * @param runId The run.
     * @param round The round.
     * @return roundVoided Whether a verdict against the coordinator voided it whole.
     * @return workersVoided How many of its credited workers were voided by verdicts against them.
     */
    function voidsOf(bytes32 runId, uint64 round) external view returns (bool roundVoided, uint64 workersVoided);

    /**
     * @notice Whether `auditor` is admitted to `runId`.
     * @param runId The run.
     * @param auditor The key.
     * @return Whether its signatures count.
     */
    function isAuditor(bytes32 runId, address auditor) external view returns (bool);

    /**
     * @notice A run's panel.
     * @param runId The run.
     * @return auditors How many auditors are admitted to it.
     * @return threshold How many of them a verdict needs; 0 before {setThreshold}.
     */
    function panelOf(bytes32 runId) external view returns (uint64 auditors, uint64 threshold);

    /**
     * @notice The ledger whose rounds verdicts void credit in.
     * @return The ledger.
     */
    function ledger() external view returns (IContributionLedger);
}
