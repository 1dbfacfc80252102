// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {Ownable} from "@openzeppelin/contracts/access/Ownable.sol";
import {IWorkerRegistry} from "./IWorkerRegistry.sol";

/**
 * @title WorkerRegistry
 * @notice Which worker keys may sign round reports (docs/trust.md, "Contracts").
 *
 * The owner allowlists code measurements and names verifier accounts. A verifier checks a
 * worker's attestation evidence off chain and admits the worker's key with the evidence digest.
 * A worker is active while it is admitted, not revoked, and its measurement is still allowed.
 */
contract WorkerRegistry is IWorkerRegistry, Ownable {
    mapping(bytes32 measurement => bool) private _allowedMeasurements;
    mapping(address verifier => bool) private _verifiers;
    mapping(address worker => Worker) private _workers;

    /// @param initialOwner The account that manages measurements and verifiers.
    constructor(address initialOwner) Ownable(initialOwner) {}

    /**
     * @notice Adds a code measurement to the allowlist or removes it. Removing a measurement makes
     * every worker admitted with it inactive.
     * @param measurement The measurement (see docs/trust.md, "Worker identity").
     * @param allowed Whether workers with this measurement may be active.
     */
    function setMeasurement(bytes32 measurement, bool allowed) external onlyOwner {
        _allowedMeasurements[measurement] = allowed;
        emit MeasurementSet(measurement, allowed);
    }

    /**
     * @notice Enables or disables a verifier account.
     * @param verifier The account that checks evidence and admits workers.
     * @param enabled Whether it may admit and revoke workers.
     */
    function setVerifier(address verifier, bool enabled) external onlyOwner {
        if (verifier == address(0)) revert RegistryZeroAddress();
        _verifiers[verifier] = enabled;
        emit VerifierSet(verifier, enabled);
    }

    /**
     * @notice Admits a worker key whose evidence the caller has verified. Only an enabled verifier.
     * @param worker The worker's signing address, bound into its evidence's REPORTDATA.
     * @param measurement The allowlisted measurement the evidence shows.
     * @param evidenceDigest sha256 of the evidence bytes, kept in the store as a raw object.
     */
    function admitWorker(address worker, bytes32 measurement, bytes32 evidenceDigest) external {
        if (!_verifiers[msg.sender]) revert RegistryNotVerifier(msg.sender);
        if (!_allowedMeasurements[measurement]) revert RegistryMeasurementNotAllowed(measurement);
        if (worker == address(0)) revert RegistryZeroAddress();
        if (_isAdmitted(_workers[worker])) revert RegistryAlreadyAdmitted(worker);

        _workers[worker] = Worker({
            measurement: measurement,
            evidenceDigest: evidenceDigest,
            verifier: msg.sender,
            admittedAt: uint64(block.number),
            revokedAt: 0
        });
        emit WorkerAdmitted(worker, measurement, evidenceDigest, msg.sender);
    }

    /**
     * @notice Revokes a worker key for good, recording the block. Only the owner or an enabled verifier.
     * @param worker The worker's signing address.
     */
    function revokeWorker(address worker) external {
        if (msg.sender != owner() && !_verifiers[msg.sender]) revert RegistryNotVerifier(msg.sender);
        Worker storage w = _workers[worker];
        if (!_isAdmitted(w)) revert RegistryNotAdmitted(worker);
        if (w.revokedAt != 0) revert RegistryAlreadyRevoked(worker);

        w.revokedAt = uint64(block.number);
        emit WorkerRevoked(worker, msg.sender);
    }

    /**
     * @notice Whether `worker` may sign reports now: admitted, not revoked, measurement still allowed.
     * @param worker The worker's signing address.
     */
    function isActive(address worker) external view returns (bool) {
        Worker storage w = _workers[worker];
        return _isAdmitted(w) && w.revokedAt == 0 && _allowedMeasurements[w.measurement];
    }

    /**
     * @notice The registry's record of `worker` (all zero if never admitted).
     * @param worker The worker's signing address.
     */
    function workerOf(address worker) external view returns (Worker memory) {
        return _workers[worker];
    }

    /**
     * @notice Whether `measurement` is on the allowlist.
     * @param measurement The measurement.
     */
    function isMeasurementAllowed(bytes32 measurement) external view returns (bool) {
        return _allowedMeasurements[measurement];
    }

    /**
     * @notice Whether `account` is an enabled verifier.
     * @param account The account.
     */
    function isVerifier(address account) external view returns (bool) {
        return _verifiers[account];
    }

    /// @dev Admission always records the (nonzero) verifier, so it marks an admitted key.
    function _isAdmitted(Worker storage w) private view returns (bool) {
        return w.verifier != address(0);
    }
}
