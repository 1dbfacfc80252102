// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {IContributionLedger} from "./IContributionLedger.sol";

/**
 * @title IReceiptCourt
 * @notice Where a worker proves, with no auditor, that its run's coordinator left it out of a round it
 * had counted it in (docs/trust.md, "Receipts").
 *
 * The coordinator signs a {Receipt} (EIP-712, in the run's ledger's domain: name "DiLoCoX Contribution
 * Ledger", version "1", the chain, the ledger as verifying contract) when it counts a worker's update
 * into a round (`reportDigest` zero: an update receipt, which the audit reads) and again when it accepts
 * the worker's report of that round (`reportDigest` the report's {IContributionLedger-reportDigest}: a
 * report receipt). A report receipt says "this update counts in this round and I hold this worker's
 * valid report of it", so the recorded round must credit the worker. Anyone may submit a report receipt
 * with the recorded round's {IContributionLedger-RoundFacts}, proven against the ledger's
 * {IContributionLedger-roundCommitment} as a reward claim is: if the worker is not among the round's
 * credited workers (recorded unreported, or left out), the coordinator's fault is recorded for good,
 * once per run, round and worker, and {ReceiptFaultProven} is emitted. An update receipt alone proves
 * nothing on chain (a worker that never reported is rightly uncredited), and is refused by name.
 */
interface IReceiptCourt {
    /// @notice What the run's coordinator signs for each update it counts, and each report it accepts.
    struct Receipt {
        bytes32 runId;
        uint64 round;
        address worker;
        bytes32 updateDigest;
        bytes32 reportDigest;
    }

    /**
     * @dev The receipt is not validly signed by the coordinator that held its round
     * ({IContributionLedger-coordinatorOf}: wrong key, other fields, malformed or malleable
     * signature), or the run does not exist.
     * @param coordinator The round's coordinator as the ledger names it (zero for no run).
     */
    error ReceiptCourtBadSignature(address coordinator);

    /**
     * @dev The receipt acknowledges no report (`reportDigest` zero): it cannot show that the worker
     * was owed a credit.
     */
    error ReceiptCourtNoReport();

    /**
     * @dev The ledger holds no record of the receipt's round.
     * @param runId The receipt's run.
     * @param round The receipt's round.
     */
    error ReceiptCourtRoundNotRecorded(bytes32 runId, uint64 round);

    /**
     * @dev The facts given do not hash to the round's commitment.
     * @param round The receipt's round.
     */
    error ReceiptCourtBadFacts(uint64 round);

    /**
     * @dev The recorded round credits the receipt's worker: no fault.
     * @param round The receipt's round.
     * @param worker The receipt's worker.
     */
    error ReceiptCourtWorkerCredited(uint64 round, address worker);

    /**
     * @dev This fault is already proven.
     * @param runId The receipt's run.
     * @param round The receipt's round.
     * @param worker The receipt's worker.
     */
    error ReceiptCourtAlreadyProven(bytes32 runId, uint64 round, address worker);

    /**
     * @notice The coordinator of `runId` receipted `worker`'s update and report of `round`, and the
     * recorded round does not credit it.
     * @param runId The run.
     * @param round The round.
     * @param worker The wronged worker.
     * @param coordinator The run's coordinator, who signed the receipt.
     * @param updateDigest The receipted update.
     * @param reportDigest The receipted report.
     */
    event ReceiptFaultProven(
        bytes32 indexed runId,
        uint64 indexed round,
        address indexed worker,
        address coordinator,
        bytes32 updateDigest,
        bytes32 reportDigest
    );

    /**
     * @notice Proves that a recorded round leaves out a worker its coordinator receipted. Checks, in
     * order: the round is recorded ({ReceiptCourtRoundNotRecorded}), `facts` hash to its commitment
     * ({ReceiptCourtBadFacts}), `signature` is the run's coordinator's over `receipt`
     * ({ReceiptCourtBadSignature}), the receipt acknowledges a report ({ReceiptCourtNoReport}), the
     * worker is not credited ({ReceiptCourtWorkerCredited}), not proven before
     * ({ReceiptCourtAlreadyProven}). Emits {ReceiptFaultProven}.
     * @param receipt The coordinator's receipt.
     * @param signature Its 65-byte (r, s, v) signature over {receiptDigest}.
     * @param facts The recorded round's facts.
     */
    function proveOmission(
        Receipt calldata receipt,
        bytes calldata signature,
        IContributionLedger.RoundFacts calldata facts
    ) external;

    /**
     * @notice The EIP-712 digest the coordinator signs for `receipt` (the ledger's domain on this chain).
     * @param receipt The receipt.
     * @return The digest, to sign as is.
     */
    function receiptDigest(Receipt calldata receipt) external view returns (bytes32);

    /**
     * @notice Whether the fault of leaving `worker` out of `round` of `runId` is proven.
     * @param runId The run.
     * @param round The round.
     * @param worker The worker.
     * @return True once {proveOmission} succeeded for them.
     */
    function isProven(bytes32 runId, uint64 round, address worker) external view returns (bool);

    /**
     * @notice How many faults are proven against `runId`'s coordinator.
     * @param runId The run.
     * @return The count of {ReceiptFaultProven} events of the run.
     */
    function faultsOf(bytes32 runId) external view returns (uint256);

    /**
     * @notice The EIP-712 type hash of {Receipt}.
     * @return keccak256 of the type string.
     */
    function RECEIPT_TYPEHASH() external view returns (bytes32);

    /**
     * @notice The ledger whose runs and round commitments receipts are proven against.
     * @return The ledger.
     */
    function ledger() external view returns (IContributionLedger);
}
