// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {ECDSA} from "@openzeppelin/contracts/utils/cryptography/ECDSA.sol";
import {MessageHashUtils} from "@openzeppelin/contracts/utils/cryptography/MessageHashUtils.sol";
import {IContributionLedger} from "./IContributionLedger.sol";
import {IReceiptCourt} from "./IReceiptCourt.sol";

/**
 * @title ReceiptCourt
 * @notice {IReceiptCourt} over one ledger.
 *
 * A receipt is signed in the ledger's own EIP-712 domain (the run lives there, and the coordinator and
 * its workers already hold that domain), so the court rebuilds the ledger's domain separator: the
 * same name and version as `ContributionLedger`'s constructor, this chain, the ledger's address. The
 * {Receipt} type is not one the ledger verifies, so no receipt can pass for a report or the reverse.
 * Storage: one slot per proven fault, and one counter slot per run.
 */
contract ReceiptCourt is IReceiptCourt {
    /// @inheritdoc IReceiptCourt
    bytes32 public constant RECEIPT_TYPEHASH =
        keccak256("Receipt(bytes32 runId,uint64 round,address worker,bytes32 updateDigest,bytes32 reportDigest)");
    bytes32 private constant _DOMAIN_TYPEHASH =
        keccak256("EIP712Domain(string name,string version,uint256 chainId,address verifyingContract)");
    bytes32 private constant _LEDGER_NAME_HASH = keccak256("DiLoCoX Contribution Ledger");
    bytes32 private constant _LEDGER_VERSION_HASH = keccak256("1");

    /// @inheritdoc IReceiptCourt
    IContributionLedger public immutable ledger;

    mapping(bytes32 runId => mapping(uint64 round => mapping(address worker => bool))) private _proven;
    mapping(bytes32 runId => uint256) private _faults;

    /// @param ledger_ The ledger whose runs' receipts this court judges.
    constructor(IContributionLedger ledger_) {
        ledger = ledger_;
    }

    /**
     * @inheritdoc IReceiptCourt
     * @dev Checks (two views of the ledger: STATICCALLs, which cannot re-enter), then the effects. No
     * interaction follows.
     */
    function proveOmission(
        Receipt calldata receipt,
        bytes calldata signature,
        IContributionLedger.RoundFacts calldata facts
    ) external {
        bytes32 committed = ledger.roundCommitment(receipt.runId, receipt.round);
        if (committed == bytes32(0)) revert ReceiptCourtRoundNotRecorded(receipt.runId, receipt.round);
        if (keccak256(abi.encode(facts)) != committed) revert ReceiptCourtBadFacts(receipt.round);
        // The coordinator that held the round (its run may have changed hands since).
        address coordinator = ledger.coordinatorOf(receipt.runId, receipt.round);
        (address signer, ECDSA.RecoverError err,) = ECDSA.tryRecoverCalldata(_digest(receipt), signature);
        if (err != ECDSA.RecoverError.NoError || signer != coordinator) revert ReceiptCourtBadSignature(coordinator);
        if (receipt.reportDigest == bytes32(0)) revert ReceiptCourtNoReport();
        if (_credits(facts.workers, receipt.worker)) revert ReceiptCourtWorkerCredited(receipt.round, receipt.worker);
        mapping(address => bool) storage proven = _proven[receipt.runId][receipt.round];
        if (proven[receipt.worker]) revert ReceiptCourtAlreadyProven(receipt.runId, receipt.round, receipt.worker);

        proven[receipt.worker] = true;
        _faults[receipt.runId] += 1;
        emit ReceiptFaultProven(
            receipt.runId, receipt.round, receipt.worker, coordinator, receipt.updateDigest, receipt.reportDigest
        );
    }

    /// @inheritdoc IReceiptCourt
    function receiptDigest(Receipt calldata receipt) external view returns (bytes32) {
        return _digest(receipt);
    }

    /// @inheritdoc IReceiptCourt
    function isProven(bytes32 runId, uint64 round, address worker) external view returns (bool) {
        return _proven[runId][round][worker];
    }

    /// @inheritdoc IReceiptCourt
    function faultsOf(bytes32 runId) external view returns (uint256) {
        return _faults[runId];
    }

    function _digest(Receipt calldata receipt) private view returns (bytes32) {
        bytes32 domainSeparator = keccak256(
            abi.encode(_DOMAIN_TYPEHASH, _LEDGER_NAME_HASH, _LEDGER_VERSION_HASH, block.chainid, address(ledger))
        );
        return MessageHashUtils.toTypedDataHash(domainSeparator, keccak256(abi.encode(RECEIPT_TYPEHASH, receipt)));
    }

    /// @dev Whether `worker` is in `workers`, which the ledger keeps in strictly ascending order: a
    /// binary search, so a proof costs O(log n) reads of calldata.
    function _credits(address[] calldata workers, address worker) private pure returns (bool) {
        uint256 low = 0;
        uint256 high = workers.length;
        while (low < high) {
            uint256 mid = (low + high) / 2;
            address at = workers[mid];
            if (at == worker) return true;
            if (at < worker) low = mid + 1;
            else high = mid;
        }
        return false;
    }
}
