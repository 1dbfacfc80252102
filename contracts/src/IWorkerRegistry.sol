// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

/**
 * @title IWorkerRegistry
 * @notice Which worker keys may sign round reports (docs/trust.md, "Contracts").
 *
 * The owner allowlists code measurements and names verifier accounts. A verifier checks a
 * worker's attestation evidence off chain and admits the worker's key with the evidence digest.
 * A worker is active while it is admitted, not revoked, and its measurement is still allowed.
 */
interface IWorkerRegistry {
    /// @notice What the registry knows about one worker key. Block numbers; `revokedAt == 0` means never.
    struct Worker {
        bytes32 measurement;
        bytes32 evidenceDigest;
        address verifier;
        uint64 admittedAt;
        uint64 revokedAt;
    }

    /// @notice The caller is not an enabled verifier (nor, for revocation, the owner).
    error RegistryNotVerifier(address caller);
    /// @notice The measurement is not on the allowlist.
    error RegistryMeasurementNotAllowed(bytes32 measurement);
    /// @notice The zero address cannot be a worker or a verifier.
    error RegistryZeroAddress();
    /// @notice The worker key was admitted before (revoked keys are not re-admitted).
    error RegistryAlreadyAdmitted(address worker);
    /// @notice The worker key was never admitted.
    error RegistryNotAdmitted(address worker);
    /// @notice The worker key is already revoked.
    error RegistryAlreadyRevoked(address worker);

    /// @notice A measurement was allowlisted (`allowed`) or removed from the allowlist.
    event MeasurementSet(bytes32 indexed measurement, bool allowed);
    /// @notice A verifier account was enabled or disabled.
    event VerifierSet(address indexed verifier, bool enabled);
    /// @notice A verifier admitted a worker key.
    event WorkerAdmitted(
        address indexed worker, bytes32 indexed measurement, bytes32 evidenceDigest, address indexed verifier
    );
    /// @notice A worker key was revoked by the owner or a verifier.
    event WorkerRevoked(address indexed worker, address indexed by);

    /// @notice Adds a code measurement to the allowlist (`allowed`) or removes it. Only the owner.
    function setMeasurement(bytes32 measurement, bool allowed) external;

    /// @notice Enables or disables a verifier account. Only the owner.
    function setVerifier(address verifier, bool enabled) external;

    /// @notice Admits a worker key whose evidence the caller has verified. Only an enabled verifier.
    function admitWorker(address worker, bytes32 measurement, bytes32 evidenceDigest) external;

    /// @notice Revokes a worker key for good. Only the owner or an enabled verifier.
    function revokeWorker(address worker) external;

    /// @notice Whether `worker` may sign reports now: admitted, not revoked, measurement still allowed.
    function isActive(address worker) external view returns (bool);

    /// @notice The registry's record of `worker` (all zero if never admitted).
    function workerOf(address worker) external view returns (Worker memory);

    /// @notice Whether `measurement` is on the allowlist.
    function isMeasurementAllowed(bytes32 measurement) external view returns (bool);

    /// @notice Whether `account` is an enabled verifier.
    function isVerifier(address account) external view returns (bool);
}
