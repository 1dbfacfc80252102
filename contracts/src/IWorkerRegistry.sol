// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

/**
 * @title IWorkerRegistry
 * @notice Which worker keys may sign round reports (docs/trust.md, "Contracts").
 *
 * The owner allowlists code measurements and names verifier accounts. A verifier checks a
 * worker's attestation evidence off chain and admits the worker's key with the evidence digest.
 * A worker is active while it is admitted, not revoked, and its measurement is still allowed.
 *
 * Every change of state emits an event ({MeasurementSet}, {VerifierSet}, {WorkerAdmitted},
 * {WorkerRevoked}), so the registry's state as of any block can be rebuilt from its logs alone, which
 * is what an auditor does. The ledger ({IContributionLedger}) depends on this interface only: it asks
 * {isActive} once per report.
 */
interface IWorkerRegistry {
    /**
     * @notice What the registry knows about one worker key. Block numbers; `revokedAt == 0` means never.
     * @param measurement The allowlisted code measurement the worker's evidence showed.
     * @param evidenceDigest sha256 of the worker's attestation evidence bytes.
     * @param verifier The verifier that admitted the worker.
     * @param admittedAt The block the worker was admitted in.
     * @param revokedAt The block the worker was revoked in, or 0 if it never was.
     */
    struct Worker {
        bytes32 measurement;
        bytes32 evidenceDigest;
        address verifier;
        uint64 admittedAt;
        uint64 revokedAt;
    }

    /**
     * @dev The caller may not admit or revoke workers: it is not an enabled verifier (nor, for
     * {revokeWorker}, the owner).
     * @param caller The account that sent the call.
     */
    error RegistryNotVerifier(address caller);

    /**
     * @dev A worker cannot be admitted with a measurement that is not on the allowlist.
     * @param measurement The measurement the admission named.
     */
    error RegistryMeasurementNotAllowed(bytes32 measurement);

    /// @dev The zero address cannot be a worker or a verifier.
    error RegistryZeroAddress();

    /**
     * @dev The worker key was admitted before; a key is admitted at most once, so a revoked key is
     * never re-admitted.
     * @param worker The worker's signing address.
     */
    error RegistryAlreadyAdmitted(address worker);

    /**
     * @dev The worker key cannot be revoked: it was never admitted.
     * @param worker The worker's signing address.
     */
    error RegistryNotAdmitted(address worker);

    /**
     * @dev The worker key cannot be revoked again: it is already revoked.
     * @param worker The worker's signing address.
     */
    error RegistryAlreadyRevoked(address worker);

    /**
     * @notice A measurement was allowlisted (`allowed`) or removed from the allowlist.
     * @param measurement The code measurement.
     * @param allowed Whether workers with this measurement may be active from now on.
     */
    event MeasurementSet(bytes32 indexed measurement, bool allowed);

    /**
     * @notice A verifier account was enabled or disabled.
     * @param verifier The verifier account.
     * @param enabled Whether it may admit and revoke workers from now on.
     */
    event VerifierSet(address indexed verifier, bool enabled);

    /**
     * @notice A verifier admitted a worker key.
     * @param worker The worker's signing address.
     * @param measurement The allowlisted measurement its evidence showed.
     * @param evidenceDigest sha256 of its evidence bytes.
     * @param verifier The verifier that checked the evidence and admitted it.
     */
    event WorkerAdmitted(
        address indexed worker, bytes32 indexed measurement, bytes32 evidenceDigest, address indexed verifier
    );

    /**
     * @notice A worker key was revoked for good.
     * @param worker The worker's signing address.
     * @param by The owner or verifier that revoked it.
     */
    event WorkerRevoked(address indexed worker, address indexed by);

    /**
     * @notice Adds a code measurement to the allowlist or removes it. Only the owner. Removing a
     * measurement makes every worker admitted with it inactive. Emits {MeasurementSet}.
     * @param measurement The measurement (see docs/trust.md, "Worker identity").
     * @param allowed Whether workers with this measurement may be active.
     */
    function setMeasurement(bytes32 measurement, bool allowed) external;

    /**
     * @notice Enables or disables a verifier account. Only the owner. Emits {VerifierSet}.
     * @param verifier The account that checks evidence and admits workers; not the zero address
     * ({RegistryZeroAddress}).
     * @param enabled Whether it may admit and revoke workers.
     */
    function setVerifier(address verifier, bool enabled) external;

    /**
     * @notice Admits a worker key whose evidence the caller has verified. Only an enabled verifier
     * ({RegistryNotVerifier}); the measurement must be allowlisted ({RegistryMeasurementNotAllowed});
     * each key once ({RegistryAlreadyAdmitted}). Emits {WorkerAdmitted}.
     * @param worker The worker's signing address, bound into its evidence's REPORTDATA; not zero.
     * @param measurement The allowlisted measurement the evidence shows.
     * @param evidenceDigest sha256 of the evidence bytes, kept in the store as a raw object.
     */
    function admitWorker(address worker, bytes32 measurement, bytes32 evidenceDigest) external;

    /**
     * @notice Revokes a worker key for good, recording the block. Only the owner or an enabled
     * verifier ({RegistryNotVerifier}); the key must be admitted ({RegistryNotAdmitted}) and not yet
     * revoked ({RegistryAlreadyRevoked}). Emits {WorkerRevoked}.
     * @param worker The worker's signing address.
     */
    function revokeWorker(address worker) external;

    /**
     * @notice Whether `worker` may sign reports now: admitted, not revoked, measurement still allowed.
     * @param worker The worker's signing address.
     * @return Whether the worker is active.
     */
    function isActive(address worker) external view returns (bool);

    /**
     * @notice The registry's record of `worker`.
     * @param worker The worker's signing address.
     * @return The record; all zero if the key was never admitted.
     */
    function workerOf(address worker) external view returns (Worker memory);

    /**
     * @notice Whether `measurement` is on the allowlist.
     * @param measurement The measurement.
     * @return Whether workers with it may be active.
     */
    function isMeasurementAllowed(bytes32 measurement) external view returns (bool);

    /**
     * @notice Whether `account` is an enabled verifier.
     * @param account The account.
     * @return Whether it may admit and revoke workers.
     */
    function isVerifier(address account) external view returns (bool);
}
