// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {Ownable} from "@openzeppelin/contracts/access/Ownable.sol";
import {Ownable2Step} from "@openzeppelin/contracts/access/Ownable2Step.sol";
import {IWorkerRegistry} from "../src/IWorkerRegistry.sol";
import {WorkerRegistry} from "../src/WorkerRegistry.sol";
import {BaseTest} from "./Base.sol";

contract WorkerRegistryTest is BaseTest {
    WorkerRegistry internal registry;

    address internal constant OWNER = address(0x0A11);
    address internal constant VERIFIER = address(0x7E41);
    address internal constant WORKER = address(0xB0B);
    address internal constant STRANGER = address(0x5742);
    bytes32 internal constant MEASUREMENT = keccak256("measurement");
    bytes32 internal constant EVIDENCE = keccak256("evidence");

    function setUp() public {
        registry = new WorkerRegistry(OWNER);
        vm.startPrank(OWNER);
        registry.setMeasurement(MEASUREMENT, true);
        registry.setVerifier(VERIFIER, true);
        vm.stopPrank();
    }

    function _admit(address worker) internal {
        vm.prank(VERIFIER);
        registry.admitWorker(worker, MEASUREMENT, EVIDENCE);
    }

    // --- owner functions ---

    function testOwner() public view {
        assertEq(registry.owner(), OWNER, "owner");
    }

    /// @dev Ownable2Step: the owner only names a successor; ownership moves when the successor accepts.
    function testOwnershipMovesOnlyWhenAccepted() public {
        vm.expectEmit(true, true, false, true, address(registry));
        emit Ownable2Step.OwnershipTransferStarted(OWNER, STRANGER);
        vm.prank(OWNER);
        registry.transferOwnership(STRANGER);
        assertEq(registry.owner(), OWNER, "still the owner until accepted");
        assertEq(registry.pendingOwner(), STRANGER, "pending");
        vm.expectRevert(abi.encodeWithSelector(Ownable.OwnableUnauthorizedAccount.selector, STRANGER));
        vm.prank(STRANGER);
        registry.setVerifier(STRANGER, true);

        vm.expectRevert(abi.encodeWithSelector(Ownable.OwnableUnauthorizedAccount.selector, VERIFIER));
        vm.prank(VERIFIER);
        registry.acceptOwnership();

        vm.expectEmit(true, true, false, true, address(registry));
        emit Ownable.OwnershipTransferred(OWNER, STRANGER);
        vm.prank(STRANGER);
        registry.acceptOwnership();
        assertEq(registry.owner(), STRANGER, "new owner");
        assertEq(registry.pendingOwner(), address(0), "nothing pending");
        vm.expectRevert(abi.encodeWithSelector(Ownable.OwnableUnauthorizedAccount.selector, OWNER));
        vm.prank(OWNER);
        registry.setMeasurement(MEASUREMENT, false);
        vm.prank(STRANGER);
        registry.setMeasurement(MEASUREMENT, false);
        assertEq(registry.isMeasurementAllowed(MEASUREMENT), false, "the new owner manages the allowlist");
    }

    function testFuzzOnlyTheOwnerNamesASuccessor(address caller) public {
        vm.assume(caller != OWNER);
        vm.expectRevert(abi.encodeWithSelector(Ownable.OwnableUnauthorizedAccount.selector, caller));
        vm.prank(caller);
        registry.transferOwnership(caller);
        assertEq(registry.pendingOwner(), address(0), "nothing pending");
    }

    function testSetMeasurementEmitsAndToggles() public {
        bytes32 m = keccak256("other");
        assertEq(registry.isMeasurementAllowed(m), false, "not allowed yet");
        vm.expectEmit(true, false, false, true, address(registry));
        emit IWorkerRegistry.MeasurementSet(m, true);
        vm.prank(OWNER);
        registry.setMeasurement(m, true);
        assertEq(registry.isMeasurementAllowed(m), true, "allowed");

        vm.expectEmit(true, false, false, true, address(registry));
        emit IWorkerRegistry.MeasurementSet(m, false);
        vm.prank(OWNER);
        registry.setMeasurement(m, false);
        assertEq(registry.isMeasurementAllowed(m), false, "disallowed");
    }

    function testSetVerifierEmitsAndToggles() public {
        vm.expectEmit(true, false, false, true, address(registry));
        emit IWorkerRegistry.VerifierSet(STRANGER, true);
        vm.prank(OWNER);
        registry.setVerifier(STRANGER, true);
        assertEq(registry.isVerifier(STRANGER), true, "enabled");

        vm.expectEmit(true, false, false, true, address(registry));
        emit IWorkerRegistry.VerifierSet(STRANGER, false);
        vm.prank(OWNER);
        registry.setVerifier(STRANGER, false);
        assertEq(registry.isVerifier(STRANGER), false, "disabled");
    }

    function testSetMeasurementOnlyOwner() public {
        vm.expectRevert(abi.encodeWithSelector(Ownable.OwnableUnauthorizedAccount.selector, VERIFIER));
        vm.prank(VERIFIER);
        registry.setMeasurement(MEASUREMENT, false);
    }

    function testSetVerifierOnlyOwner() public {
        vm.expectRevert(abi.encodeWithSelector(Ownable.OwnableUnauthorizedAccount.selector, STRANGER));
        vm.prank(STRANGER);
        registry.setVerifier(STRANGER, true);
    }

    function testSetVerifierZeroAddress() public {
        vm.expectRevert(abi.encodeWithSelector(IWorkerRegistry.RegistryZeroAddress.selector));
        vm.prank(OWNER);
        registry.setVerifier(address(0), true);
    }

    function testFuzzOwnerFunctionsRefuseOthers(address caller, bytes32 m) public {
        vm.assume(caller != OWNER);
        vm.expectRevert(abi.encodeWithSelector(Ownable.OwnableUnauthorizedAccount.selector, caller));
        vm.prank(caller);
        registry.setMeasurement(m, true);
        vm.expectRevert(abi.encodeWithSelector(Ownable.OwnableUnauthorizedAccount.selector, caller));
        vm.prank(caller);
        registry.setVerifier(caller, true);
    }

    // --- admission ---

    function testAdmitWorker() public {
        vm.roll(42);
        vm.expectEmit(true, true, true, true, address(registry));
        emit IWorkerRegistry.WorkerAdmitted(WORKER, MEASUREMENT, EVIDENCE, VERIFIER);
        _admit(WORKER);

        IWorkerRegistry.Worker memory w = registry.workerOf(WORKER);
        assertEq(w.measurement, MEASUREMENT, "measurement");
        assertEq(w.evidenceDigest, EVIDENCE, "evidence");
        assertEq(w.verifier, VERIFIER, "verifier");
        assertEq(w.admittedAt, 42, "admittedAt");
        assertEq(w.revokedAt, 0, "revokedAt");
        assertEq(registry.isActive(WORKER), true, "active");
    }

    /// @dev Admission is the measurement number in the worker's slot, not its block: a key admitted in
    /// block 0 (only a test can send from there) is admitted for every function.
    function testAdmittedInBlockZero() public {
        vm.roll(0);
        _admit(WORKER);
        assertEq(registry.workerOf(WORKER).admittedAt, 0, "admittedAt");
        assertEq(registry.workerOf(WORKER).verifier, VERIFIER, "record");
        assertEq(registry.isActive(WORKER), true, "active");
        vm.expectRevert(abi.encodeWithSelector(IWorkerRegistry.RegistryAlreadyAdmitted.selector, WORKER));
        vm.prank(VERIFIER);
        registry.admitWorker(WORKER, MEASUREMENT, EVIDENCE);
        vm.roll(1); // revokedAt == 0 means "never": a revocation is in a block of a transaction, >= 1
        vm.prank(OWNER);
        registry.revokeWorker(WORKER);
        assertEq(registry.isActive(WORKER), false, "revoked");
    }

    function testUnknownWorkerInactive() public view {
        assertEq(registry.isActive(WORKER), false, "inactive");
        IWorkerRegistry.Worker memory w = registry.workerOf(WORKER);
        assertEq(w.verifier, address(0), "empty record");
    }

    function testAdmitNotVerifier() public {
        vm.expectRevert(abi.encodeWithSelector(IWorkerRegistry.RegistryNotVerifier.selector, STRANGER));
        vm.prank(STRANGER);
        registry.admitWorker(WORKER, MEASUREMENT, EVIDENCE);
    }

    function testAdmitByOwnerRefused() public {
        vm.expectRevert(abi.encodeWithSelector(IWorkerRegistry.RegistryNotVerifier.selector, OWNER));
        vm.prank(OWNER);
        registry.admitWorker(WORKER, MEASUREMENT, EVIDENCE);
    }

    function testAdmitByDisabledVerifierRefused() public {
        vm.prank(OWNER);
        registry.setVerifier(VERIFIER, false);
        vm.expectRevert(abi.encodeWithSelector(IWorkerRegistry.RegistryNotVerifier.selector, VERIFIER));
        vm.prank(VERIFIER);
        registry.admitWorker(WORKER, MEASUREMENT, EVIDENCE);
    }

    function testAdmitMeasurementNotAllowed() public {
        bytes32 m = keccak256("unknown build");
        vm.expectRevert(abi.encodeWithSelector(IWorkerRegistry.RegistryMeasurementNotAllowed.selector, m));
        vm.prank(VERIFIER);
        registry.admitWorker(WORKER, m, EVIDENCE);
    }

    function testAdmitZeroAddress() public {
        vm.expectRevert(abi.encodeWithSelector(IWorkerRegistry.RegistryZeroAddress.selector));
        vm.prank(VERIFIER);
        registry.admitWorker(address(0), MEASUREMENT, EVIDENCE);
    }

    function testAdmitTwiceRefused() public {
        _admit(WORKER);
        vm.expectRevert(abi.encodeWithSelector(IWorkerRegistry.RegistryAlreadyAdmitted.selector, WORKER));
        vm.prank(VERIFIER);
        registry.admitWorker(WORKER, MEASUREMENT, keccak256("new evidence"));
    }

    function testRevokedWorkerCannotBeReadmitted() public {
        _admit(WORKER);
        vm.prank(OWNER);
        registry.revokeWorker(WORKER);
        vm.expectRevert(abi.encodeWithSelector(IWorkerRegistry.RegistryAlreadyAdmitted.selector, WORKER));
        vm.prank(VERIFIER);
        registry.admitWorker(WORKER, MEASUREMENT, EVIDENCE);
    }

    function testFuzzAdmitRefusesNonVerifiers(address caller, address worker) public {
        vm.assume(caller != VERIFIER);
        vm.expectRevert(abi.encodeWithSelector(IWorkerRegistry.RegistryNotVerifier.selector, caller));
        vm.prank(caller);
        registry.admitWorker(worker, MEASUREMENT, EVIDENCE);
    }

    // --- revocation ---

    function testRevokeByVerifier() public {
        _admit(WORKER);
        vm.roll(77);
        vm.expectEmit(true, true, false, true, address(registry));
        emit IWorkerRegistry.WorkerRevoked(WORKER, VERIFIER);
        vm.prank(VERIFIER);
        registry.revokeWorker(WORKER);
        assertEq(registry.workerOf(WORKER).revokedAt, 77, "revokedAt");
        assertEq(registry.isActive(WORKER), false, "inactive");
    }

    function testRevokeByOwner() public {
        _admit(WORKER);
        vm.expectEmit(true, true, false, true, address(registry));
        emit IWorkerRegistry.WorkerRevoked(WORKER, OWNER);
        vm.prank(OWNER);
        registry.revokeWorker(WORKER);
        assertEq(registry.isActive(WORKER), false, "inactive");
    }

    function testRevokeByOtherRefused() public {
        _admit(WORKER);
        vm.expectRevert(abi.encodeWithSelector(IWorkerRegistry.RegistryNotVerifier.selector, STRANGER));
        vm.prank(STRANGER);
        registry.revokeWorker(WORKER);
        assertEq(registry.isActive(WORKER), true, "still active");
    }

    function testRevokeNotAdmitted() public {
        vm.expectRevert(abi.encodeWithSelector(IWorkerRegistry.RegistryNotAdmitted.selector, WORKER));
        vm.prank(OWNER);
        registry.revokeWorker(WORKER);
    }

    function testRevokeTwice() public {
        _admit(WORKER);
        vm.prank(VERIFIER);
        registry.revokeWorker(WORKER);
        vm.expectRevert(abi.encodeWithSelector(IWorkerRegistry.RegistryAlreadyRevoked.selector, WORKER));
        vm.prank(OWNER);
        registry.revokeWorker(WORKER);
    }

    // --- measurement allowlist drives activity ---

    function testDisallowedMeasurementMakesWorkerInactive() public {
        _admit(WORKER);
        vm.prank(OWNER);
        registry.setMeasurement(MEASUREMENT, false);
        assertEq(registry.isActive(WORKER), false, "inactive while disallowed");
        vm.prank(OWNER);
        registry.setMeasurement(MEASUREMENT, true);
        assertEq(registry.isActive(WORKER), true, "active again once re-allowed");
    }

    function testDisabledVerifierKeepsItsWorkersActive() public {
        _admit(WORKER);
        vm.prank(OWNER);
        registry.setVerifier(VERIFIER, false);
        assertEq(registry.isActive(WORKER), true, "spec: admitted, not revoked, measurement allowed");
    }
}
