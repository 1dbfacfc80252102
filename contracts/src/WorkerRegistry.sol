// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {Ownable} from "@openzeppelin/contracts/access/Ownable.sol";
import {Ownable2Step} from "@openzeppelin/contracts/access/Ownable2Step.sol";
import {IWorkerRegistry} from "./IWorkerRegistry.sol";

/**
 * @title WorkerRegistry
 * @notice {IWorkerRegistry}: which worker keys may sign round reports (docs/trust.md, "Contracts").
 *
 * The owner allowlists code measurements and names verifier accounts. A verifier checks a
 * worker's attestation evidence off chain and admits the worker's key with the evidence digest.
 * A worker is active while it is admitted, not revoked, and its measurement is still allowed.
 *
 * The owner is {Ownable2Step}: a transfer takes effect only when the new owner accepts it
 * ({Ownable2Step-acceptOwnership}), so a mistyped address cannot take the allowlist out of reach.
 *
 * Storage is laid out for {isActive}, which the ledger asks once per report: a worker's admission
 * and revocation blocks and its measurement's number share one slot, and a measurement's allowance
 * is kept by number (warm after the first report of a round, since workers share measurements). So
 * {isActive} reads one cold slot per worker; the evidence digest and verifier live apart.
 */
contract WorkerRegistry is IWorkerRegistry, Ownable2Step {
    /**
     * @dev What {isActive} reads, in one slot. `measurementId` numbers measurements from 1, and
     * admission is the only write that sets it, so `measurementId != 0` is what "admitted" means
     * ({_isAdmitted}): the one test every function uses. `admittedAt` is a record, never a test;
     * `revokedAt != 0` is "revoked" (a transaction's block number is at least 1).
     */
    struct Status {
        uint64 admittedAt;
        uint64 revokedAt;
        uint64 measurementId;
    }

    mapping(bytes32 measurement => uint64 id) private _measurementIds;
    bytes32[] private _measurements; // _measurements[id - 1]
    mapping(uint64 id => bool) private _allowed;
    mapping(address verifier => bool) private _verifiers;
    mapping(address worker => Status) private _status;
    mapping(address worker => bytes32) private _evidence;
    mapping(address worker => address) private _admittedBy; // a record, read by {workerOf} only

    /// @param initialOwner The account that manages measurements and verifiers.
    constructor(address initialOwner) Ownable(initialOwner) {}

    /// @inheritdoc IWorkerRegistry
    function setMeasurement(bytes32 measurement, bool allowed) external onlyOwner {
        uint64 id = _measurementIds[measurement];
        if (id == 0) {
            _measurements.push(measurement);
            id = uint64(_measurements.length);
            _measurementIds[measurement] = id;
        }
        _allowed[id] = allowed;
        emit MeasurementSet(measurement, allowed);
    }

    /// @inheritdoc IWorkerRegistry
    function setVerifier(address verifier, bool enabled) external onlyOwner {
        if (verifier == address(0)) revert RegistryZeroAddress();
        _verifiers[verifier] = enabled;
        emit VerifierSet(verifier, enabled);
    }

    /// @inheritdoc IWorkerRegistry
    function admitWorker(address worker, bytes32 measurement, bytes32 evidenceDigest) external {
        if (!_verifiers[msg.sender]) revert RegistryNotVerifier(msg.sender);
        uint64 id = _measurementIds[measurement];
        if (!_allowed[id]) revert RegistryMeasurementNotAllowed(measurement);
        if (worker == address(0)) revert RegistryZeroAddress();
        if (_isAdmitted(_status[worker].measurementId)) revert RegistryAlreadyAdmitted(worker);

        _status[worker] = Status({admittedAt: uint64(block.number), revokedAt: 0, measurementId: id});
        _evidence[worker] = evidenceDigest;
        _admittedBy[worker] = msg.sender;
        emit WorkerAdmitted(worker, measurement, evidenceDigest, msg.sender);
    }

    /// @inheritdoc IWorkerRegistry
    function revokeWorker(address worker) external {
        if (msg.sender != owner() && !_verifiers[msg.sender]) revert RegistryNotVerifier(msg.sender);
        Status storage status = _status[worker];
        if (!_isAdmitted(status.measurementId)) revert RegistryNotAdmitted(worker);
        if (status.revokedAt != 0) revert RegistryAlreadyRevoked(worker);

        status.revokedAt = uint64(block.number);
        emit WorkerRevoked(worker, msg.sender);
    }

    /// @inheritdoc IWorkerRegistry
    function isActive(address worker) external view returns (bool) {
        Status memory status = _status[worker];
        return _isAdmitted(status.measurementId) && status.revokedAt == 0 && _allowed[status.measurementId];
    }

    /// @inheritdoc IWorkerRegistry
    function workerOf(address worker) external view returns (Worker memory) {
        Status memory status = _status[worker];
        if (!_isAdmitted(status.measurementId)) return Worker(bytes32(0), bytes32(0), address(0), 0, 0);
        return Worker({
            measurement: _measurements[status.measurementId - 1],
            evidenceDigest: _evidence[worker],
            verifier: _admittedBy[worker],
            admittedAt: status.admittedAt,
            revokedAt: status.revokedAt
        });
    }

    /// @inheritdoc IWorkerRegistry
    function isMeasurementAllowed(bytes32 measurement) external view returns (bool) {
        return _allowed[_measurementIds[measurement]];
    }

    /// @inheritdoc IWorkerRegistry
    function isVerifier(address account) external view returns (bool) {
        return _verifiers[account];
    }

    /// @dev Whether a key whose {Status} holds `measurementId` was ever admitted (revoked or not).
    function _isAdmitted(uint64 measurementId) private pure returns (bool) {
        return measurementId != 0;
    }
}
