// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {IContributionLedger} from "../src/IContributionLedger.sol";
import {LedgerBase} from "./LedgerBase.sol";

contract ContributionLedgerFuzzTest is LedgerBase {
    function _recordRounds(uint64 n) internal {
        for (uint64 round = 1; round <= n; ++round) {
            record(round, one(signed(0, round)));
        }
    }

    function testFuzzRoundOutOfOrder(uint8 recorded, uint64 round) public {
        uint64 done = uint64(bound(recorded, 0, 3));
        vm.assume(round != done + 1);
        _recordRounds(done);
        IContributionLedger.RoundHeader memory h = header(done + 1);
        h.round = round;
        IContributionLedger.WorkerReport[] memory s = one(signWith(key(0), report(0, h)));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerRoundOutOfOrder.selector, done + 1, round));
        recordWith(h, s, NONE);
    }

    function testFuzzWrongParent(bytes32 parent) public {
        vm.assume(parent != GENESIS);
        IContributionLedger.RoundHeader memory h = header(1);
        h.parentCheckpoint = parent;
        IContributionLedger.WorkerReport[] memory s = one(signWith(key(0), report(0, h)));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerWrongParent.selector, GENESIS, parent));
        recordWith(h, s, NONE);
    }

    function testFuzzNotCoordinator(address caller) public {
        vm.assume(caller != COORDINATOR);
        IContributionLedger.WorkerReport[] memory s = one(signed(0, 1));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerNotCoordinator.selector, caller));
        vm.prank(caller);
        ledger.recordRound(header(1), s, NONE);
    }

    function testFuzzUnadmittedSignerRefused(uint256 pk) public {
        pk = bound(pk, 1, SECP256K1_N - 1);
        address signer = vm.addr(pk);
        for (uint256 i = 0; i < WORKERS; ++i) {
            vm.assume(signer != worker(i));
        }
        IContributionLedger.RoundReport memory r = report(0, header(1));
        r.worker = signer;
        IContributionLedger.WorkerReport[] memory s = one(signWith(pk, r));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerWorkerNotActive.selector, signer));
        record(1, s);
    }

    /// @dev Changing any signed field after signing, in the worker's part or in the round's header,
    /// breaks the signature.
    function testFuzzTamperedReportRefused(uint8 field, uint256 delta) public {
        IContributionLedger.RoundHeader memory h = header(1);
        IContributionLedger.WorkerReport memory w = signed(0, 1);
        uint8 which = uint8(bound(field, 0, 11));
        bytes32 d = bytes32(bound(delta, 1, type(uint256).max));
        uint64 d64 = uint64(bound(delta, 1, type(uint64).max));
        if (which == 0) w.updateDigest ^= d;
        else if (which == 1) w.dataDigest ^= d;
        // forge-lint: disable-next-line(unsafe-typecast) -- any nonzero bit pattern will do
        else if (which == 2) w.trainLossE6 ^= int64(d64);
        else if (which == 3) w.bytesSent ^= d64;
        else if (which == 4) w.bytesReceived ^= d64;
        // forge-lint: disable-next-line(unsafe-typecast)
        else if (which == 5) h.evalLossE6 ^= int64(d64);
        else if (which == 6) h.tokens ^= d64;
        else if (which == 7) h.innerSteps ^= uint32(bound(delta, 1, type(uint32).max));
        else if (which == 8) h.manifestDigest ^= d;
        else if (which == 9) h.checkpoint ^= d; // the round's checkpoint as called: only the signature fails
        else if (which == 10) w.worker = address(uint160(w.worker) ^ uint160(bound(delta, 1, type(uint160).max)));
        else h.manifestDigest = bytes32(0);
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerInvalidSignature.selector, 0));
        recordWith(h, one(w), NONE);
    }

    function testFuzzRandomSignatureRefused(bytes32 r, bytes32 s, uint8 v) public {
        IContributionLedger.WorkerReport memory w = signed(0, 1);
        w.signature = abi.encodePacked(r, s, v);
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerInvalidSignature.selector, 0));
        record(1, one(w));
    }

    /// @dev Per-run and global tallies are the sums of the accepted reports: each round credits its
    /// header's tokens to each of its reporting workers.
    function testFuzzTalliesSum(uint64[6] memory tokens, uint8 rounds, uint8 skipMask) public {
        uint64 n = uint64(bound(rounds, 1, 6));
        uint256 sum0;
        uint256 sum1;
        uint256 rounds1;
        for (uint64 round = 1; round <= n; ++round) {
            IContributionLedger.RoundHeader memory h = header(round);
            h.tokens = uint64(bound(tokens[round - 1], 0, type(uint32).max));
            bool skip1 = (skipMask >> (round - 1)) & 1 == 1; // worker 1 sits some rounds out
            IContributionLedger.WorkerReport memory w0 = signWith(key(0), report(0, h));
            if (skip1) {
                recordWith(h, one(w0), NONE);
            } else {
                recordWith(h, pair(signWith(key(1), report(1, h)), w0), NONE);
                sum1 += h.tokens;
                rounds1 += 1;
            }
            sum0 += h.tokens;
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
        ledger.createRun(run2, GENESIS, CONFIG, GENESIS_MANIFEST, 0);
        IContributionLedger.RoundHeader memory h = header(1);
        h.tokens = a;
        recordWith(h, one(signWith(key(2), report(2, h))), NONE);
        h.runId = run2;
        h.tokens = b;
        recordWith(h, one(signWith(key(2), report(2, h))), NONE);
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
        vm.roll(9);
        recordWith(header(1), new IContributionLedger.WorkerReport[](0), u);
        if (bad == type(uint256).max) {
            assertEq(ledger.runOf(RUN).lastRound, 1, "recorded");
            assertEq(
                ledger.roundCommitment(RUN, 1),
                ledger.commitmentOf(facts(1, 9, new address[](0), 3)),
                "three unreported in the commitment"
            );
            assertEq(ledger.contributionOf(RUN, worker(0)).rounds, 0, "nobody credited");
        }
    }

    /// @dev Sorted random digests accepted; three of them let the run go on to a credited round.
    function testFuzzSortedUnreportedNeverBlocksTheNextRound(uint256 seed) public {
        bytes32[] memory u = new bytes32[](3);
        uint256 x = bound(seed, 1, type(uint256).max / 4);
        (u[0], u[1], u[2]) = (bytes32(x), bytes32(x + 1), bytes32(x + x + 2));
        recordWith(header(1), new IContributionLedger.WorkerReport[](0), u);
        record(2, one(signed(1, 2)));
        assertEq(ledger.contributionOf(RUN, worker(1)).tokens, TOKENS, "credited after an unreported round");
    }

    /// @dev Any subset of workers, listed in any order: taken exactly when strictly ascending.
    function testFuzzReportOrder(uint256 seed) public {
        uint256 n = bound(seed, 2, WORKERS);
        uint256[] memory order = new uint256[](n);
        for (uint256 k = 0; k < n; ++k) {
            order[k] = (seed >> (8 * k)) % WORKERS;
        }
        IContributionLedger.WorkerReport[] memory s = new IContributionLedger.WorkerReport[](n);
        uint256 bad = type(uint256).max;
        for (uint256 k = 0; k < n; ++k) {
            s[k] = signed(order[k], 1);
            if (bad == type(uint256).max && k > 0 && s[k].worker <= s[k - 1].worker) bad = k;
        }
        if (bad != type(uint256).max) {
            vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerReportsNotSorted.selector, bad));
        }
        record(1, s);
        if (bad == type(uint256).max) {
            for (uint256 k = 0; k < n; ++k) {
                assertEq(ledger.contributionOf(RUN, s[k].worker).rounds, 1, "each credited once");
            }
        }
    }
}
