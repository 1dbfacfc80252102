// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {ContributionLedger} from "../src/ContributionLedger.sol";
import {IContributionLedger} from "../src/IContributionLedger.sol";
import {LedgerBase} from "./LedgerBase.sol";

contract ContributionLedgerFuzzTest is LedgerBase {
    function _recordRounds(uint64 n) internal {
        for (uint64 round = 1; round <= n; ++round) {
            record(round, one(signed(0, round, 1)));
        }
    }

    function testFuzzRoundOutOfOrder(uint8 recorded, uint64 round) public {
        uint64 done = uint64(bound(recorded, 0, 3));
        vm.assume(round != done + 1);
        _recordRounds(done);
        IContributionLedger.SignedReport[] memory s = one(signed(0, done + 1, 1));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerRoundOutOfOrder.selector, done + 1, round));
        vm.prank(COORDINATOR);
        ledger.recordRound(RUN, round, ckpt(done), ckpt(done + 1), manifest(done + 1), s, NONE);
    }

    function testFuzzWrongParent(bytes32 parent) public {
        vm.assume(parent != GENESIS);
        IContributionLedger.SignedReport[] memory s = one(signed(0, 1, 1));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerWrongParent.selector, GENESIS, parent));
        vm.prank(COORDINATOR);
        ledger.recordRound(RUN, 1, parent, ckpt(1), manifest(1), s, NONE);
    }

    function testFuzzNotCoordinator(address caller) public {
        vm.assume(caller != COORDINATOR);
        IContributionLedger.SignedReport[] memory s = one(signed(0, 1, 1));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerNotCoordinator.selector, caller));
        vm.prank(caller);
        ledger.recordRound(RUN, 1, GENESIS, ckpt(1), manifest(1), s, NONE);
    }

    function testFuzzUnadmittedSignerRefused(uint256 pk) public {
        pk = bound(pk, 1, SECP256K1_N - 1);
        address signer = vm.addr(pk);
        for (uint256 i = 0; i < WORKERS; ++i) {
            vm.assume(signer != worker(i));
        }
        IContributionLedger.RoundReport memory r = report(0, 1, 1);
        r.worker = signer;
        IContributionLedger.SignedReport[] memory s = one(signWith(pk, r));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerWorkerNotActive.selector, signer));
        record(1, s);
    }

    /// @dev Changing any signed field after signing breaks the signature.
    function testFuzzTamperedReportRefused(uint8 field, uint256 delta) public {
        IContributionLedger.SignedReport memory s = signed(0, 1, 1000);
        IContributionLedger.RoundReport memory r = s.report; // same memory: edits land in s
        uint8 which = uint8(bound(field, 0, 9));
        bytes32 d = bytes32(bound(delta, 1, type(uint256).max));
        uint64 d64 = uint64(bound(delta, 1, type(uint64).max));
        if (which == 0) r.updateDigest ^= d;
        else if (which == 1) r.dataDigest ^= d;
        // forge-lint: disable-next-line(unsafe-typecast) -- any nonzero bit pattern will do
        else if (which == 2) r.trainLossE6 ^= int64(d64);
        // forge-lint: disable-next-line(unsafe-typecast)
        else if (which == 3) r.evalLossE6 ^= int64(d64);
        else if (which == 4) r.tokens ^= d64;
        else if (which == 5) r.innerSteps ^= uint32(bound(delta, 1, type(uint32).max));
        else if (which == 6) r.bytesSent ^= d64;
        else if (which == 7) r.bytesReceived ^= d64;
        else if (which == 8) r.worker = address(uint160(r.worker) ^ uint160(bound(delta, 1, type(uint160).max)));
        else r.checkpoint ^= d; // the call names the tampered checkpoint too, so only the signature fails

        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerInvalidSignature.selector, 0));
        vm.prank(COORDINATOR);
        ledger.recordRound(RUN, 1, GENESIS, r.checkpoint, manifest(1), one(s), NONE);
    }

    function testFuzzRandomSignatureRefused(bytes32 r, bytes32 s, uint8 v) public {
        IContributionLedger.SignedReport memory sr = signed(0, 1, 1);
        sr.signature = abi.encodePacked(r, s, v);
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerInvalidSignature.selector, 0));
        record(1, one(sr));
    }

    /// @dev Per-run and global tallies are the sums of the accepted reports.
    function testFuzzTalliesSum(uint64[6] memory tokens0, uint64[6] memory tokens1, uint8 rounds, uint8 skipMask)
        public
    {
        uint64 n = uint64(bound(rounds, 1, 6));
        uint256 sum0;
        uint256 sum1;
        uint256 rounds1;
        for (uint64 round = 1; round <= n; ++round) {
            uint64 t0 = uint64(bound(tokens0[round - 1], 0, type(uint32).max));
            uint64 t1 = uint64(bound(tokens1[round - 1], 0, type(uint32).max));
            bool skip1 = (skipMask >> (round - 1)) & 1 == 1; // worker 1 sits some rounds out
            if (skip1) {
                record(round, one(signed(0, round, t0)));
            } else {
                record(round, two(signed(1, round, t1), signed(0, round, t0)));
                sum1 += t1;
                rounds1 += 1;
            }
            sum0 += t0;
        }
        assertEq(ledger.contributionOf(RUN, worker(0)).tokens, sum0, "w0 tokens");
        assertEq(ledger.contributionOf(RUN, worker(0)).rounds, n, "w0 rounds");
        assertEq(ledger.contributionOf(RUN, worker(1)).tokens, sum1, "w1 tokens");
        assertEq(ledger.contributionOf(RUN, worker(1)).rounds, rounds1, "w1 rounds");
        assertEq(ledger.totalContributionOf(worker(0)).tokens, sum0, "w0 total");
        assertEq(ledger.totalContributionOf(worker(1)).tokens, sum1, "w1 total");
        assertEq(ledger.runOf(RUN).lastRound, n, "lastRound");
        assertEq(ledger.runOf(RUN).lastCheckpoint, ckpt(n), "lastCheckpoint");
    }

    /// @dev A second run adds to the global tally and leaves the first run's tally alone.
    function testFuzzTotalsAcrossRuns(uint32 a, uint32 b) public {
        bytes32 run2 = keccak256("run 2");
        vm.prank(COORDINATOR);
        ledger.createRun(run2, GENESIS, CONFIG, GENESIS_MANIFEST);
        record(1, one(signed(2, 1, a)));
        IContributionLedger.RoundReport memory r = report(2, 1, b);
        r.runId = run2;
        IContributionLedger.SignedReport[] memory s = one(signWith(key(2), r));
        vm.prank(COORDINATOR);
        ledger.recordRound(run2, 1, GENESIS, ckpt(1), manifest(1), s, NONE);
        assertEq(ledger.contributionOf(RUN, worker(2)).tokens, a, "run 1");
        assertEq(ledger.contributionOf(run2, worker(2)).tokens, b, "run 2");
        assertEq(ledger.totalContributionOf(worker(2)).tokens, uint256(a) + b, "total");
        assertEq(ledger.totalContributionOf(worker(2)).rounds, 2, "total rounds");
    }

    /// @dev Any list of unreported updates is taken exactly when it is nonzero and strictly ascending,
    /// and then credits nobody while the round is recorded.
    function testFuzzUnreportedList(bytes32 a, bytes32 b, bytes32 c) public {
        bytes32[] memory u = new bytes32[](3);
        (u[0], u[1], u[2]) = (a, b, c);
        uint256 bad = type(uint256).max;
        for (uint256 j = 0; j < 3 && bad == type(uint256).max; ++j) {
            if (u[j] == bytes32(0) || (j > 0 && u[j] <= u[j - 1])) bad = j;
        }
        if (bad != type(uint256).max) {
            vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerBadUnreported.selector, bad));
        }
        recordWith(1, new IContributionLedger.SignedReport[](0), u);
        if (bad == type(uint256).max) {
            assertEq(ledger.runOf(RUN).lastRound, 1, "recorded");
            assertEq(ledger.roundOf(RUN, 1).unreportedCount, 3, "unreportedCount");
            assertEq(ledger.contributionOf(RUN, worker(0)).rounds, 0, "nobody credited");
        }
    }

    /// @dev Sorted random digests accepted; three of them let the run go on to a credited round.
    function testFuzzSortedUnreportedNeverBlocksTheNextRound(uint256 seed) public {
        bytes32[] memory u = new bytes32[](3);
        uint256 x = bound(seed, 1, type(uint256).max / 4);
        (u[0], u[1], u[2]) = (bytes32(x), bytes32(x + 1), bytes32(x + x + 2));
        recordWith(1, new IContributionLedger.SignedReport[](0), u);
        record(2, one(signed(1, 2, 5)));
        assertEq(ledger.contributionOf(RUN, worker(1)).tokens, 5, "credited after an unreported round");
    }
}
