// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {IContributionLedger} from "../src/IContributionLedger.sol";
import {IReceiptCourt} from "../src/IReceiptCourt.sol";
import {ReceiptCourt} from "../src/ReceiptCourt.sol";
import {LedgerBase} from "./LedgerBase.sol";

/// @dev A run whose coordinator has a key (it signs receipts), recorded rounds, and a court over the ledger.
contract ReceiptCourtTest is LedgerBase {
    ReceiptCourt internal court;

    uint256 internal constant COORD_KEY = 0xC00D;
    bytes32 internal constant SIGNED_RUN = keccak256("run with a signing coordinator");

    function setUp() public override {
        super.setUp();
        court = new ReceiptCourt(ledger);
        vm.prank(vm.addr(COORD_KEY));
        ledger.createRun(SIGNED_RUN, GENESIS, CONFIG, GENESIS_MANIFEST, WINDOW);
    }

    function _header(uint64 round) internal pure returns (IContributionLedger.RoundHeader memory h) {
        h = header(round);
        h.runId = SIGNED_RUN;
    }

    /// @dev Records `round` of the signed run at block `at` crediting the workers in `mask` (bit i: worker
    /// i), the others of 0..WORKERS-1 unreported; returns the round's facts.
    function _record(uint64 round, uint256 mask, uint64 at) internal returns (IContributionLedger.RoundFacts memory) {
        vm.roll(at);
        IContributionLedger.RoundHeader memory h = _header(round);
        uint256 n;
        for (uint256 x = mask; x != 0; x >>= 1) {
            n += x & 1;
        }
        IContributionLedger.WorkerReport[] memory reports = new IContributionLedger.WorkerReport[](n);
        address[] memory workers = new address[](n);
        bytes32[] memory unreported = new bytes32[](WORKERS - n);
        uint256 k;
        uint256 u;
        for (uint256 j = 0; j < WORKERS; ++j) {
            uint256 i = byAddress[j];
            // forge-lint: disable-next-line(incorrect-shift) -- bit i of the mask
            if (mask & (1 << i) != 0) {
                reports[k] = signWith(key(i), report(i, h));
                workers[k++] = worker(i);
            } else {
                unreported[u++] = ghost(i, round);
            }
        }
        _sortAscending(unreported);
        vm.prank(vm.addr(COORD_KEY));
        ledger.recordRound(h, reports, unreported);
        // forge-lint: disable-next-line(unsafe-typecast) -- at most WORKERS
        return facts(round, at, workers, uint64(WORKERS - n));
    }

    function _sortAscending(bytes32[] memory a) internal pure {
        for (uint256 i = 1; i < a.length; ++i) {
            for (uint256 j = i; j > 0 && a[j - 1] > a[j]; --j) {
                (a[j - 1], a[j]) = (a[j], a[j - 1]);
            }
        }
    }

    /// @dev The report receipt of worker i's update and report of `round` in the signed run.
    function _receipt(uint256 i, uint64 round) internal view returns (IReceiptCourt.Receipt memory) {
        IContributionLedger.RoundReport memory r = report(i, _header(round));
        return IReceiptCourt.Receipt({
            runId: SIGNED_RUN,
            round: round,
            worker: r.worker,
            updateDigest: r.updateDigest,
            reportDigest: ledger.reportDigest(r)
        });
    }

    function _sign(uint256 pk, IReceiptCourt.Receipt memory receipt) internal view returns (bytes memory) {
        (uint8 v, bytes32 r, bytes32 s) = vm.sign(pk, court.receiptDigest(receipt));
        return abi.encodePacked(r, s, v);
    }

    // --- the fault ---

    function testUnreportedWorkerProvesTheOmission() public {
        IContributionLedger.RoundFacts memory f = _record(1, 0x1E, 100); // worker 0 recorded unreported
        IReceiptCourt.Receipt memory receipt = _receipt(0, 1);
        bytes memory signature = _sign(COORD_KEY, receipt);
        vm.expectEmit(true, true, true, true, address(court));
        emit IReceiptCourt.ReceiptFaultProven(
            SIGNED_RUN, 1, worker(0), vm.addr(COORD_KEY), receipt.updateDigest, receipt.reportDigest
        );
        vm.prank(address(0xBEEF)); // anyone may submit it
        court.proveOmission(receipt, signature, f);
        assertTrue(court.isProven(SIGNED_RUN, 1, worker(0)), "proven");
        assertEq(court.faultsOf(SIGNED_RUN), 1, "one fault");
        assertTrue(!court.isProven(SIGNED_RUN, 1, worker(1)), "only that worker");
    }

    function testRoundOfNobodyStillOmits() public {
        IContributionLedger.RoundFacts memory f = _record(1, 0, 100); // every participant unreported
        IReceiptCourt.Receipt memory receipt = _receipt(3, 1);
        court.proveOmission(receipt, _sign(COORD_KEY, receipt), f);
        assertTrue(court.isProven(SIGNED_RUN, 1, worker(3)), "proven");
    }

    function testReceiptsAreJudgedAgainstTheCoordinatorThatHeldTheRound() public {
        IContributionLedger.RoundFacts memory f = _record(1, 0x1C, 100); // workers 0 and 1 unreported
        uint256 successorKey = 0x5EC0;
        vm.prank(vm.addr(COORD_KEY)); // the run's creator
        ledger.handOver(SIGNED_RUN, vm.addr(successorKey));
        // The first coordinator's receipt of round 1 still proves its omission after it left.
        IReceiptCourt.Receipt memory receipt = _receipt(0, 1);
        court.proveOmission(receipt, _sign(COORD_KEY, receipt), f);
        assertTrue(court.isProven(SIGNED_RUN, 1, worker(0)), "proven against the round's coordinator");
        // The successor's signature on a round it did not hold proves nothing.
        IReceiptCourt.Receipt memory other = _receipt(1, 1);
        bytes memory bySuccessor = _sign(successorKey, other);
        vm.expectRevert(abi.encodeWithSelector(IReceiptCourt.ReceiptCourtBadSignature.selector, vm.addr(COORD_KEY)));
        court.proveOmission(other, bySuccessor, f);
    }

    // --- refusals, by name ---

    function testCreditedWorkerProvesNothing() public {
        IContributionLedger.RoundFacts memory f = _record(1, 0x1F, 100);
        for (uint256 i = 0; i < WORKERS; ++i) {
            IReceiptCourt.Receipt memory receipt = _receipt(i, 1);
            bytes memory signature = _sign(COORD_KEY, receipt);
            vm.expectRevert(abi.encodeWithSelector(IReceiptCourt.ReceiptCourtWorkerCredited.selector, 1, worker(i)));
            court.proveOmission(receipt, signature, f);
        }
    }

    function testTwiceRefused() public {
        IContributionLedger.RoundFacts memory f = _record(1, 0x1E, 100);
        IReceiptCourt.Receipt memory receipt = _receipt(0, 1);
        bytes memory signature = _sign(COORD_KEY, receipt);
        court.proveOmission(receipt, signature, f);
        vm.expectRevert(
            abi.encodeWithSelector(IReceiptCourt.ReceiptCourtAlreadyProven.selector, SIGNED_RUN, 1, worker(0))
        );
        court.proveOmission(receipt, signature, f);
        assertEq(court.faultsOf(SIGNED_RUN), 1, "still one");
    }

    function testReceiptNotSignedByTheCoordinator() public {
        IContributionLedger.RoundFacts memory f = _record(1, 0x1E, 100);
        IReceiptCourt.Receipt memory receipt = _receipt(0, 1);
        bytes memory byWorker = _sign(key(0), receipt); // the worker forging its own receipt
        vm.expectRevert(abi.encodeWithSelector(IReceiptCourt.ReceiptCourtBadSignature.selector, vm.addr(COORD_KEY)));
        court.proveOmission(receipt, byWorker, f);
        bytes memory signature = _sign(COORD_KEY, receipt);
        receipt.updateDigest = keccak256("another update"); // a field changed after signing
        vm.expectRevert(abi.encodeWithSelector(IReceiptCourt.ReceiptCourtBadSignature.selector, vm.addr(COORD_KEY)));
        court.proveOmission(receipt, signature, f);
        IReceiptCourt.Receipt memory untouched = _receipt(0, 1); // (an external call: before expectRevert)
        vm.expectRevert(abi.encodeWithSelector(IReceiptCourt.ReceiptCourtBadSignature.selector, vm.addr(COORD_KEY)));
        court.proveOmission(untouched, hex"00", f); // malformed
    }

    function testReceiptOfAnotherRunsCoordinatorRefused() public {
        // RUN's coordinator (0xC0C0) did not sign; the signed run's coordinator's receipt names RUN.
        vm.roll(50);
        record(1, batch(1, 1));
        IReceiptCourt.Receipt memory receipt = _receipt(4, 1);
        receipt.runId = RUN;
        bytes memory signature = _sign(COORD_KEY, receipt);
        vm.expectRevert(abi.encodeWithSelector(IReceiptCourt.ReceiptCourtBadSignature.selector, COORDINATOR));
        court.proveOmission(receipt, signature, facts(1, 50, batchWorkers(1), 0));
    }

    function testUpdateReceiptAloneProvesNothing() public {
        IContributionLedger.RoundFacts memory f = _record(1, 0x1E, 100);
        IReceiptCourt.Receipt memory receipt = _receipt(0, 1);
        receipt.reportDigest = bytes32(0); // the receipt of the push: the worker may never have reported
        bytes memory signature = _sign(COORD_KEY, receipt);
        vm.expectRevert(abi.encodeWithSelector(IReceiptCourt.ReceiptCourtNoReport.selector));
        court.proveOmission(receipt, signature, f);
    }

    function testRoundNotRecorded() public {
        IContributionLedger.RoundFacts memory f = _record(1, 0x1E, 100);
        IReceiptCourt.Receipt memory receipt = _receipt(0, 2);
        bytes memory signature = _sign(COORD_KEY, receipt);
        vm.expectRevert(
            abi.encodeWithSelector(IReceiptCourt.ReceiptCourtRoundNotRecorded.selector, SIGNED_RUN, uint64(2))
        );
        court.proveOmission(receipt, signature, f);
    }

    function testFactsNotMatchingTheCommitment() public {
        IContributionLedger.RoundFacts memory f = _record(1, 0x1E, 100);
        IReceiptCourt.Receipt memory receipt = _receipt(0, 1);
        bytes memory signature = _sign(COORD_KEY, receipt);
        f.workers = new address[](0); // a round made to look as if it credited nobody
        f.unreportedCount = uint64(WORKERS);
        vm.expectRevert(abi.encodeWithSelector(IReceiptCourt.ReceiptCourtBadFacts.selector, uint64(1)));
        court.proveOmission(receipt, signature, f);
    }

    function testDigestIsTheLedgerDomainsTypedData() public view {
        IReceiptCourt.Receipt memory receipt = _receipt(0, 1);
        bytes32 domain = keccak256(
            abi.encode(
                keccak256("EIP712Domain(string name,string version,uint256 chainId,address verifyingContract)"),
                keccak256("DiLoCoX Contribution Ledger"),
                keccak256("1"),
                block.chainid,
                address(ledger)
            )
        );
        bytes32 want =
            keccak256(abi.encodePacked(hex"1901", domain, keccak256(abi.encode(court.RECEIPT_TYPEHASH(), receipt))));
        assertEq(court.receiptDigest(receipt), want, "EIP-712 digest");
        assertEq(address(court.ledger()), address(ledger), "ledger");
    }

    // --- fuzz ---

    /// @dev Whatever subset the round credits, exactly the receipted workers it leaves out can prove a fault,
    /// each once; the credited ones never.
    function testFuzzOnlyTheOmittedProve(uint256 mask, uint256 who) public {
        mask = bound(mask, 0, (1 << WORKERS) - 1);
        uint256 i = bound(who, 0, WORKERS - 1);
        IContributionLedger.RoundFacts memory f = _record(1, mask, 100);
        IReceiptCourt.Receipt memory receipt = _receipt(i, 1);
        bytes memory signature = _sign(COORD_KEY, receipt);
        // forge-lint: disable-next-line(incorrect-shift) -- bit i of the mask
        if (mask & (1 << i) != 0) {
            vm.expectRevert(abi.encodeWithSelector(IReceiptCourt.ReceiptCourtWorkerCredited.selector, 1, worker(i)));
            court.proveOmission(receipt, signature, f);
            assertEq(court.faultsOf(SIGNED_RUN), 0, "no fault");
        } else {
            court.proveOmission(receipt, signature, f);
            assertTrue(court.isProven(SIGNED_RUN, 1, worker(i)), "proven");
            assertEq(court.faultsOf(SIGNED_RUN), 1, "one fault");
        }
    }

    /// @dev A signature by any key but the coordinator's is refused.
    function testFuzzOnlyTheCoordinatorsKey(uint256 pk) public {
        pk = bound(pk, 1, SECP256K1_N - 1);
        vm.assume(pk != COORD_KEY);
        IContributionLedger.RoundFacts memory f = _record(1, 0x1E, 100);
        IReceiptCourt.Receipt memory receipt = _receipt(0, 1);
        bytes memory signature = _sign(pk, receipt);
        vm.expectRevert(abi.encodeWithSelector(IReceiptCourt.ReceiptCourtBadSignature.selector, vm.addr(COORD_KEY)));
        court.proveOmission(receipt, signature, f);
    }
}
