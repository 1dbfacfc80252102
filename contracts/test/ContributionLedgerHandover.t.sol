// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {IContributionLedger} from "../src/IContributionLedger.sol";
import {LedgerBase} from "./LedgerBase.sol";

/// @dev A run's coordinator replaced: by its creator at any time, or by a majority of the last round's
/// workers once the run has stalled; the new one records the next round, and each round keeps the
/// coordinator that held it.
contract ContributionLedgerHandoverTest is LedgerBase {
    address internal constant SUCCESSOR = address(0x5EC0);
    address internal constant OTHER = address(0x07E4);

    function _record(uint64 round, uint256 n, address by) internal {
        IContributionLedger.WorkerReport[] memory reports = batch(n, round);
        vm.prank(by);
        ledger.recordRound(header(round), reports, NONE);
    }

    function _stall() internal {
        vm.roll(block.number + ledger.HANDOVER_STALL_BLOCKS());
    }

    function _vote(uint256 i, address candidate) internal {
        vm.prank(worker(i));
        ledger.voteCoordinator(RUN, candidate);
    }

    function testCreatorIsRecorded() public view {
        assertEq(ledger.creatorOf(RUN), COORDINATOR, "ledger.creatorOf(RUN)");
        assertEq(ledger.coordinatorOf(RUN, 1), COORDINATOR, "ledger.coordinatorOf(RUN");
        assertEq(ledger.creatorOf(keccak256("no such run")), address(0), "ledger.creatorOf(keccak256('no such run'))");
        assertEq(ledger.coordinatorOf(keccak256("no such run"), 1), address(0), "no run, no coordinator");
    }

    function testCreatorHandsOverAndTheSuccessorRecordsTheNextRound() public {
        _record(1, 3, COORDINATOR);
        _record(2, 3, COORDINATOR);
        vm.expectEmit(true, true, true, true, address(ledger));
        emit IContributionLedger.CoordinatorHandedOver(RUN, COORDINATOR, SUCCESSOR, 3, false);
        vm.prank(COORDINATOR);
        ledger.handOver(RUN, SUCCESSOR);

        IContributionLedger.WorkerReport[] memory reports = batch(3, 3);
        vm.prank(COORDINATOR);
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerNotCoordinator.selector, COORDINATOR));
        ledger.recordRound(header(3), reports, NONE);
        _record(3, 3, SUCCESSOR); // the same run id, its parent round 2's checkpoint
        IContributionLedger.Run memory run = ledger.runOf(RUN);
        assertEq(run.coordinator, SUCCESSOR, "run.coordinator");
        assertEq(run.lastRound, 3, "run.lastRound");
        assertEq(run.lastCheckpoint, ckpt(3), "run.lastCheckpoint");
        assertEq(ledger.contributionOf(RUN, worker(0)).rounds, 3, "ledger.contributionOf(RUN");
        assertEq(ledger.coordinatorOf(RUN, 1), COORDINATOR, "ledger.coordinatorOf(RUN");
        assertEq(ledger.coordinatorOf(RUN, 2), COORDINATOR, "ledger.coordinatorOf(RUN");
        assertEq(ledger.coordinatorOf(RUN, 3), SUCCESSOR, "ledger.coordinatorOf(RUN");
        assertEq(ledger.coordinatorOf(RUN, 9), SUCCESSOR, "ledger.coordinatorOf(RUN");
        assertEq(ledger.creatorOf(RUN), COORDINATOR, "ledger.creatorOf(RUN)"); // the creator keeps the right to hand over
    }

    function testCreatorMayHandBackAndTwiceBeforeAnyRound() public {
        _record(1, 2, COORDINATOR);
        vm.startPrank(COORDINATOR);
        ledger.handOver(RUN, SUCCESSOR);
        ledger.handOver(RUN, OTHER); // before SUCCESSOR recorded anything: its tenure goes to OTHER
        vm.stopPrank();
        assertEq(ledger.coordinatorOf(RUN, 1), COORDINATOR, "ledger.coordinatorOf(RUN");
        assertEq(ledger.coordinatorOf(RUN, 2), OTHER, "ledger.coordinatorOf(RUN");
        _record(2, 2, OTHER);
        vm.prank(COORDINATOR);
        ledger.handOver(RUN, COORDINATOR);
        _record(3, 2, COORDINATOR);
        assertEq(ledger.coordinatorOf(RUN, 2), OTHER, "ledger.coordinatorOf(RUN");
        assertEq(ledger.coordinatorOf(RUN, 3), COORDINATOR, "ledger.coordinatorOf(RUN");
    }

    function testOnlyTheCreatorHandsOver() public {
        vm.prank(COORDINATOR);
        ledger.handOver(RUN, SUCCESSOR);
        // Not the coordinator it now has, nor a worker.
        vm.prank(SUCCESSOR);
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerNotCreator.selector, SUCCESSOR));
        ledger.handOver(RUN, OTHER);
        vm.prank(worker(0));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerNotCreator.selector, worker(0)));
        ledger.handOver(RUN, OTHER);
    }

    function testHandOverRefusals() public {
        vm.startPrank(COORDINATOR);
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerBadCoordinator.selector, address(0)));
        ledger.handOver(RUN, address(0));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerBadCoordinator.selector, COORDINATOR));
        ledger.handOver(RUN, COORDINATOR);
        bytes32 unknown = keccak256("no such run");
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerUnknownRun.selector, unknown));
        ledger.handOver(unknown, SUCCESSOR);
        vm.stopPrank();
    }

    function testMajorityOfTheLastRoundVotesInAfterAStall() public {
        _record(1, 5, COORDINATOR);
        _record(2, 3, COORDINATOR); // 3 credited: 2 votes hand the run over
        uint64 stalledFrom = uint64(block.number) + ledger.HANDOVER_STALL_BLOCKS();
        vm.prank(worker(0));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerNotStalled.selector, stalledFrom));
        ledger.voteCoordinator(RUN, SUCCESSOR);
        _stall();

        vm.expectEmit(true, true, true, true, address(ledger));
        emit IContributionLedger.CoordinatorVoted(RUN, worker(0), SUCCESSOR, 1, 2);
        _vote(0, SUCCESSOR);
        assertEq(ledger.runOf(RUN).coordinator, COORDINATOR, "ledger.runOf(RUN).coordinator");
        _vote(1, OTHER); // split votes do not add up
        assertEq(ledger.runOf(RUN).coordinator, COORDINATOR, "ledger.runOf(RUN).coordinator");
        vm.expectEmit(true, true, true, true, address(ledger));
        emit IContributionLedger.CoordinatorVoted(RUN, worker(2), SUCCESSOR, 2, 2);
        vm.expectEmit(true, true, true, true, address(ledger));
        emit IContributionLedger.CoordinatorHandedOver(RUN, COORDINATOR, SUCCESSOR, 3, true);
        _vote(2, SUCCESSOR);
        assertEq(ledger.runOf(RUN).coordinator, SUCCESSOR, "ledger.runOf(RUN).coordinator");
        _record(3, 3, SUCCESSOR);
        assertEq(ledger.coordinatorOf(RUN, 2), COORDINATOR, "ledger.coordinatorOf(RUN");
    }

    function testWhoMayVote() public {
        _record(1, 5, COORDINATOR);
        _record(2, 2, COORDINATOR); // workers 0 and 1 credited in the last round
        _stall();
        // Credited in round 1 only, or never: no vote.
        vm.prank(worker(3));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerNotVoter.selector, worker(3)));
        ledger.voteCoordinator(RUN, SUCCESSOR);
        vm.prank(OTHER);
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerNotVoter.selector, OTHER));
        ledger.voteCoordinator(RUN, SUCCESSOR);
        // Revoked since: no vote.
        registry.revokeWorker(worker(1));
        vm.prank(worker(1));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerNotVoter.selector, worker(1)));
        ledger.voteCoordinator(RUN, SUCCESSOR);
        // Once per stall.
        _vote(0, OTHER);
        vm.prank(worker(0));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerNotVoter.selector, worker(0)));
        ledger.voteCoordinator(RUN, SUCCESSOR);
        // Not for zero or the coordinator it has.
        vm.prank(worker(0));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerBadCoordinator.selector, COORDINATOR));
        ledger.voteCoordinator(RUN, COORDINATOR);
    }

    function testNoVotesBeforeTheFirstRound() public {
        _stall();
        vm.prank(worker(0));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerNotVoter.selector, worker(0)));
        ledger.voteCoordinator(RUN, SUCCESSOR);
    }

    function testARecordedRoundOrAHandoverEndsTheStall() public {
        _record(1, 3, COORDINATOR);
        _stall();
        _vote(0, SUCCESSOR);
        _record(2, 3, COORDINATOR); // the coordinator came back: a new stall must pass
        vm.prank(worker(1));
        vm.expectRevert(
            abi.encodeWithSelector(
                IContributionLedger.LedgerNotStalled.selector, uint64(block.number) + ledger.HANDOVER_STALL_BLOCKS()
            )
        );
        ledger.voteCoordinator(RUN, SUCCESSOR);
        _stall();
        _vote(0, SUCCESSOR); // worker 0's vote of the old stall does not count twice, nor block this one
        assertEq(ledger.runOf(RUN).coordinator, COORDINATOR, "ledger.runOf(RUN).coordinator");
        _vote(1, SUCCESSOR);
        assertEq(ledger.runOf(RUN).coordinator, SUCCESSOR, "ledger.runOf(RUN).coordinator");
        // The voted-in coordinator gets a full window before it can be voted out in turn.
        vm.prank(worker(2));
        vm.expectRevert(
            abi.encodeWithSelector(
                IContributionLedger.LedgerNotStalled.selector, uint64(block.number) + ledger.HANDOVER_STALL_BLOCKS()
            )
        );
        ledger.voteCoordinator(RUN, OTHER);
    }

    /// @dev Whoever holds the run at each round, {coordinatorOf} names the one that recorded it.
    function testFuzzCoordinatorOfNamesTheRecorder(uint8 rounds, uint256 handovers) public {
        rounds = uint8(bound(rounds, 1, 12));
        address[] memory recorder = new address[](uint256(rounds) + 1);
        address current = COORDINATOR;
        for (uint64 r = 1; r <= rounds; ++r) {
            // forge-lint: disable-next-line(incorrect-shift) -- bit r of the handover mask
            if (handovers & (1 << r) != 0) {
                address next = address(uint160(0x1000 + r));
                vm.prank(COORDINATOR);
                ledger.handOver(RUN, next);
                current = next;
            }
            _record(r, 1, current);
            recorder[r] = current;
        }
        for (uint64 r = 1; r <= rounds; ++r) {
            assertEq(ledger.coordinatorOf(RUN, r), recorder[r], "ledger.coordinatorOf(RUN");
        }
        assertEq(ledger.coordinatorOf(RUN, uint64(rounds) + 1), current, "ledger.coordinatorOf(RUN");
    }

    /// @dev Only a strict majority of the last round's credited workers hands the run over.
    function testFuzzMajorityThreshold(uint256 credited, uint256 voters) public {
        credited = bound(credited, 1, WORKERS);
        voters = bound(voters, 1, credited);
        _record(1, credited, COORDINATOR);
        _stall();
        uint256[] memory order = sortedIndices(credited);
        for (uint256 k = 0; k < voters; ++k) {
            if (ledger.runOf(RUN).coordinator == SUCCESSOR) break; // handed over: later votes are refused
            _vote(order[k], SUCCESSOR);
        }
        assertEq(
            ledger.runOf(RUN).coordinator,
            voters * 2 > credited ? SUCCESSOR : COORDINATOR,
            "ledger.runOf(RUN).coordinator"
        );
    }
}
