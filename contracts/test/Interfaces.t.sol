// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {IERC20} from "@openzeppelin/contracts/token/ERC20/IERC20.sol";
import {ContributionLedger} from "../src/ContributionLedger.sol";
import {IContributionLedger} from "../src/IContributionLedger.sol";
import {IRewardPool} from "../src/IRewardPool.sol";
import {IWorkerRegistry} from "../src/IWorkerRegistry.sol";
import {RewardPool} from "../src/RewardPool.sol";
import {RewardToken} from "../src/RewardToken.sol";
import {LedgerBase} from "./LedgerBase.sol";
import {LyingLedger} from "./LyingLedger.sol";

/// @dev TEST ONLY. An {IWorkerRegistry} that is not {WorkerRegistry}: anyone admits and revokes, every
/// measurement is allowed, and only admission and revocation are kept.
contract StubRegistry is IWorkerRegistry {
    mapping(address worker => bool) private _active;

    function setMeasurement(bytes32 measurement, bool allowed) external {
        emit MeasurementSet(measurement, allowed);
    }

    function setVerifier(address verifier, bool enabled) external {
        emit VerifierSet(verifier, enabled);
    }

    function admitWorker(address worker, bytes32 measurement, bytes32 evidenceDigest) external {
        _active[worker] = true;
        emit WorkerAdmitted(worker, measurement, evidenceDigest, msg.sender);
    }

    function revokeWorker(address worker) external {
        _active[worker] = false;
        emit WorkerRevoked(worker, msg.sender);
    }

    function isActive(address worker) external view returns (bool) {
        return _active[worker];
    }

    function workerOf(address) external pure returns (Worker memory w) {}

    function isMeasurementAllowed(bytes32) external pure returns (bool) {
        return true;
    }

    function isVerifier(address) external pure returns (bool) {
        return true;
    }
}

/// @dev The contracts are usable through their interfaces alone, and {LyingLedger} is an
/// {IContributionLedger} that reads the real ledger's storage as its own.
contract InterfacesTest is LedgerBase {
    // --- ContributionLedger through IContributionLedger ---

    function testLedgerIsUsableThroughItsInterface() public {
        IContributionLedger l = ledger; // compiles only because ContributionLedger is IContributionLedger
        assertEq(address(l.registry()), address(registry), "registry");
        assertEq(l.ROUND_REPORT_TYPEHASH(), ledger.ROUND_REPORT_TYPEHASH(), "typehash");

        IContributionLedger.WorkerReport[] memory s = batch(2, 1);
        vm.roll(7);
        vm.prank(COORDINATOR);
        l.recordRound(header(1), s, NONE);
        assertEq(l.roundCommitment(RUN, 1), l.commitmentOf(facts(1, 7, batchWorkers(2), 0)), "commitment");
        assertEq(l.runOf(RUN).lastRound, 1, "lastRound");
        assertEq(l.contributionOf(RUN, worker(0)).tokens, TOKENS, "run tokens");
        assertEq(l.totalContributionOf(worker(1)).rounds, 1, "total rounds");
        assertEq(l.runsOf(worker(0))[0], RUN, "runs");

        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerRoundOutOfOrder.selector, 2, 1));
        vm.prank(COORDINATOR);
        l.recordRound(header(1), s, NONE);
    }

    // --- WorkerRegistry through IWorkerRegistry ---

    function testRegistryIsUsableThroughItsInterface() public {
        IWorkerRegistry r = registry; // compiles only because WorkerRegistry is IWorkerRegistry
        address w = address(0xB0B);
        vm.prank(VERIFIER);
        r.admitWorker(w, MEASUREMENT, keccak256("evidence"));
        assertTrue(r.isActive(w), "active");
        assertEq(r.workerOf(w).verifier, VERIFIER, "verifier");
        assertTrue(r.isMeasurementAllowed(MEASUREMENT), "measurement");
        assertTrue(r.isVerifier(VERIFIER), "verifier enabled");

        vm.prank(VERIFIER);
        r.revokeWorker(w);
        assertTrue(!r.isActive(w), "revoked");
        vm.expectRevert(abi.encodeWithSelector(IWorkerRegistry.RegistryAlreadyRevoked.selector, w));
        vm.prank(VERIFIER);
        r.revokeWorker(w);
    }

    /// @dev The ledger knows the registry only as an {IWorkerRegistry}: any implementation will do.
    function testLedgerConsultsAnyWorkerRegistry() public {
        StubRegistry stub = new StubRegistry();
        ledger = new ContributionLedger(stub);
        assertEq(address(ledger.registry()), address(stub), "registry");
        vm.prank(COORDINATOR);
        ledger.createRun(RUN, GENESIS, CONFIG, GENESIS_MANIFEST, WINDOW);

        IContributionLedger.WorkerReport[] memory s = one(signed(0, 1));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerWorkerNotActive.selector, worker(0)));
        record(1, s);

        stub.admitWorker(worker(0), MEASUREMENT, bytes32(0));
        record(1, s);
        assertEq(ledger.contributionOf(RUN, worker(0)).rounds, 1, "credited");

        stub.revokeWorker(worker(0));
        s = one(signed(0, 2));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerWorkerNotActive.selector, worker(0)));
        record(2, s);
    }

    // --- RewardPool through IRewardPool, over any IContributionLedger ---

    function testRewardPoolIsUsableThroughItsInterface() public {
        RewardToken token = new RewardToken(address(this));
        RewardPool concrete = new RewardPool(ledger, IERC20(address(token)));
        IRewardPool p = concrete; // compiles only because RewardPool is IRewardPool
        assertEq(address(concrete.ledger()), address(ledger), "ledger");
        token.mint(COORDINATOR, 100);
        vm.prank(COORDINATOR);
        token.approve(address(p), 100);
        vm.prank(COORDINATOR);
        p.openPool(RUN, 100, 2);
        assertEq(p.poolOf(RUN).funded, 100, "funded");
        assertEq(p.rewardPerWorker(RUN, 1, 2), 25, "per worker");
        assertTrue(!p.isClaimed(RUN, worker(0), 1), "not claimed");
    }

    // --- LyingLedger is an IContributionLedger ---

    /// @dev For honest input the liar answers what the real ledger answers, through the same interface.
    function testLyingLedgerAnswersLikeTheLedgerForHonestInput() public {
        IContributionLedger liar = new LyingLedger(registry); // compiles only as an IContributionLedger
        IContributionLedger real = ledger;
        assertEq(liar.ROUND_REPORT_TYPEHASH(), real.ROUND_REPORT_TYPEHASH(), "typehash");
        assertEq(address(liar.registry()), address(real.registry()), "registry");
        vm.prank(COORDINATOR);
        liar.createRun(RUN, GENESIS, CONFIG, GENESIS_MANIFEST, WINDOW);

        bytes32[] memory u = new bytes32[](1);
        u[0] = ghost(4, 1);
        IContributionLedger.WorkerReport[] memory s = batch(3, 1);
        vm.roll(9);
        recordWith(header(1), s, u);
        vm.expectEmit(true, true, false, true, address(liar));
        emit IContributionLedger.RoundRecorded(
            RUN, 1, ckpt(1), manifest(1), TOKENS, batchWorkers(3), 1, real.roundCommitment(RUN, 1)
        );
        vm.prank(COORDINATOR);
        liar.recordRound(header(1), s, u);

        assertEq(liar.roundCommitment(RUN, 1), real.roundCommitment(RUN, 1), "commitment");
        assertEq(keccak256(abi.encode(liar.runOf(RUN))), keccak256(abi.encode(real.runOf(RUN))), "run");
        for (uint256 i = 0; i < 3; ++i) {
            assertEq(
                keccak256(abi.encode(liar.contributionOf(RUN, worker(i)))),
                keccak256(abi.encode(real.contributionOf(RUN, worker(i)))),
                "run tally"
            );
            assertEq(
                keccak256(abi.encode(liar.totalContributionOf(worker(i)))),
                keccak256(abi.encode(real.totalContributionOf(worker(i)))),
                "total"
            );
            assertEq(
                keccak256(abi.encode(liar.runsOf(worker(i)))), keccak256(abi.encode(real.runsOf(worker(i)))), "runs"
            );
        }
    }

    /// @dev What the audit tests do with `anvil_setCode`: the liar's code at the real ledger's address
    /// reads the state the real ledger wrote (same storage layout) and signs in the same domain.
    function testLyingLedgerCodeReadsTheLedgersState() public {
        bytes32[] memory u = new bytes32[](1);
        u[0] = ghost(4, 2);
        vm.roll(3);
        record(1, batch(2, 1));
        vm.roll(4);
        recordWith(header(2), batch(3, 2), u);
        IContributionLedger l = ledger;
        bytes32 run = keccak256(abi.encode(l.runOf(RUN)));
        bytes32 round1 = l.roundCommitment(RUN, 1);
        bytes32 round2 = l.roundCommitment(RUN, 2);
        bytes32 digest = l.reportDigest(report(0, header(3)));
        bytes32[3] memory tallies;
        bytes32[3] memory totals;
        bytes32[3] memory runs;
        for (uint256 i = 0; i < 3; ++i) {
            tallies[i] = keccak256(abi.encode(l.contributionOf(RUN, worker(i))));
            totals[i] = keccak256(abi.encode(l.totalContributionOf(worker(i))));
            runs[i] = keccak256(abi.encode(l.runsOf(worker(i))));
        }

        vm.etch(address(ledger), address(new LyingLedger(registry)).code);
        assertEq(keccak256(abi.encode(l.runOf(RUN))), run, "run");
        assertEq(l.roundCommitment(RUN, 1), round1, "round 1");
        assertEq(l.roundCommitment(RUN, 2), round2, "round 2");
        assertEq(l.reportDigest(report(0, header(3))), digest, "same EIP-712 domain");
        assertEq(address(l.registry()), address(registry), "registry");
        for (uint256 i = 0; i < 3; ++i) {
            assertEq(keccak256(abi.encode(l.contributionOf(RUN, worker(i)))), tallies[i], "run tally");
            assertEq(keccak256(abi.encode(l.totalContributionOf(worker(i)))), totals[i], "total");
            assertEq(keccak256(abi.encode(l.runsOf(worker(i)))), runs[i], "runs");
        }

        // ... and lies in place.
        LyingLedger(address(ledger)).forgeCommitment(RUN, 1, keccak256("forged"));
        assertEq(l.roundCommitment(RUN, 1), keccak256("forged"), "forged commitment");
        LyingLedger(address(ledger)).forgeTally(RUN, worker(0), 1, 1);
        assertEq(l.contributionOf(RUN, worker(0)).tokens, 1, "forged tally");
        l.recordRound(header(9), noReports(), NONE); // no caller, order or participant check
        assertEq(l.runOf(RUN).lastRound, 9, "recorded out of order");
    }

    function noReports() internal pure returns (IContributionLedger.WorkerReport[] memory) {
        return new IContributionLedger.WorkerReport[](0);
    }
}
