// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {ContributionLedger} from "../src/ContributionLedger.sol";
import {IContributionLedger} from "../src/IContributionLedger.sol";
import {WorkerRegistry} from "../src/WorkerRegistry.sol";
import {LedgerBase} from "./LedgerBase.sol";

contract ContributionLedgerTest is LedgerBase {
    // --- EIP-712 encoding, checked against an independent encoding ---

    function testTypehash() public view {
        assertEq(
            ledger.ROUND_REPORT_TYPEHASH(),
            keccak256(
                "RoundReport(bytes32 runId,uint64 round,address worker,bytes32 parentCheckpoint,bytes32 checkpoint,bytes32 updateDigest,bytes32 dataDigest,int64 trainLossE6,int64 evalLossE6,uint64 tokens,uint32 innerSteps,uint64 bytesSent,uint64 bytesReceived)"
            ),
            "typehash"
        );
    }

    function testEip712Domain() public view {
        (, string memory name, string memory version, uint256 chainId, address verifyingContract,,) =
            ledger.eip712Domain();
        assertEq(keccak256(bytes(name)), keccak256("DiLoCoX Contribution Ledger"), "name");
        assertEq(keccak256(bytes(version)), keccak256("1"), "version");
        assertEq(chainId, block.chainid, "chainId");
        assertEq(verifyingContract, address(ledger), "verifyingContract");
    }

    function testDigestMatchesIndependentEncoding() public view {
        IContributionLedger.RoundReport memory r = report(2, 7, 123_456);
        r.trainLossE6 = -5; // negative ints are sign-extended in EIP-712
        assertEq(ledger.reportDigest(r), independentDigest(address(ledger), r), "digest");
    }

    function testFuzzDigestMatchesIndependentEncoding(IContributionLedger.RoundReport memory r) public view {
        assertEq(ledger.reportDigest(r), independentDigest(address(ledger), r), "digest");
    }

    function testRegistry() public view {
        assertEq(address(ledger.registry()), address(registry), "registry");
    }

    // --- runs ---

    function testCreateRun() public {
        bytes32 id = keccak256("run 2");
        address coordinator = address(0xC2);
        vm.expectEmit(true, true, false, true, address(ledger));
        emit IContributionLedger.RunCreated(id, coordinator, GENESIS, CONFIG, GENESIS_MANIFEST);
        vm.prank(coordinator);
        ledger.createRun(id, GENESIS, CONFIG, GENESIS_MANIFEST);

        IContributionLedger.Run memory run = ledger.runOf(id);
        assertEq(run.coordinator, coordinator, "coordinator");
        assertEq(run.lastRound, 0, "lastRound");
        assertEq(run.lastCheckpoint, GENESIS, "lastCheckpoint");
        assertEq(run.genesisCheckpoint, GENESIS, "genesisCheckpoint");
        assertEq(run.configDigest, CONFIG, "configDigest");
        assertEq(run.genesisManifest, GENESIS_MANIFEST, "genesisManifest");
    }

    function testCreateRunExists() public {
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerRunExists.selector, RUN));
        vm.prank(address(0xC2));
        ledger.createRun(RUN, keccak256("other"), CONFIG, GENESIS_MANIFEST);
    }

    function testUnknownRunIsEmpty() public view {
        assertEq(ledger.runOf(keccak256("nope")).coordinator, address(0), "no coordinator");
        assertEq(ledger.roundOf(RUN, 1).recordedAt, 0, "round 1 not recorded");
    }

    // --- happy paths ---

    function testRecordRoundOneReport() public {
        IContributionLedger.SignedReport memory s = signed(0, 1, 4096);
        bytes32 digest = ledger.reportDigest(s.report);
        vm.roll(100);

        vm.expectEmit(true, true, true, true, address(ledger));
        emit IContributionLedger.ReportAccepted(RUN, 1, worker(0), digest, 4096);
        vm.expectEmit(true, true, false, true, address(ledger));
        emit IContributionLedger.RoundRecorded(RUN, 1, ckpt(1), manifest(1), 1, 0);
        record(1, one(s));

        IContributionLedger.RoundRecord memory rec = ledger.roundOf(RUN, 1);
        assertEq(rec.checkpoint, ckpt(1), "checkpoint");
        assertEq(rec.manifestDigest, manifest(1), "manifest");
        assertEq(rec.reportCount, 1, "reportCount");
        assertEq(rec.recordedAt, 100, "recordedAt");

        IContributionLedger.Run memory run = ledger.runOf(RUN);
        assertEq(run.lastRound, 1, "lastRound");
        assertEq(run.lastCheckpoint, ckpt(1), "lastCheckpoint");
        assertEq(run.genesisCheckpoint, GENESIS, "genesis kept");

        assertEq(ledger.contributionOf(RUN, worker(0)).tokens, 4096, "run tokens");
        assertEq(ledger.contributionOf(RUN, worker(0)).rounds, 1, "run rounds");
        assertEq(ledger.totalContributionOf(worker(0)).tokens, 4096, "total tokens");
        assertEq(ledger.totalContributionOf(worker(0)).rounds, 1, "total rounds");
        assertEq(ledger.isReportRecorded(digest), true, "digest recorded");
        assertEq(ledger.contributionOf(RUN, worker(1)).rounds, 0, "others untouched");
    }

    function testRecordRoundTwoReports() public {
        IContributionLedger.SignedReport[] memory s = signedBatch(2, 1);
        bytes32 d0 = ledger.reportDigest(s[0].report);
        bytes32 d1 = ledger.reportDigest(s[1].report);

        vm.expectEmit(true, true, true, true, address(ledger));
        emit IContributionLedger.ReportAccepted(RUN, 1, worker(0), d0, 1000);
        vm.expectEmit(true, true, true, true, address(ledger));
        emit IContributionLedger.ReportAccepted(RUN, 1, worker(1), d1, 2000);
        vm.expectEmit(true, true, false, true, address(ledger));
        emit IContributionLedger.RoundRecorded(RUN, 1, ckpt(1), manifest(1), 2, 0);
        record(1, s);

        assertEq(ledger.roundOf(RUN, 1).reportCount, 2, "reportCount");
        assertEq(ledger.contributionOf(RUN, worker(0)).tokens, 1000, "w0");
        assertEq(ledger.contributionOf(RUN, worker(1)).tokens, 2000, "w1");
    }

    function testRecordSeveralRoundsWithSeveralReports() public {
        for (uint64 round = 1; round <= 3; ++round) {
            vm.roll(10 * round);
            record(round, signedBatch(WORKERS, round));
            IContributionLedger.RoundRecord memory rec = ledger.roundOf(RUN, round);
            assertEq(rec.reportCount, WORKERS, "reportCount");
            assertEq(rec.recordedAt, 10 * round, "recordedAt");
            assertEq(rec.checkpoint, ckpt(round), "checkpoint");
        }
        assertEq(ledger.runOf(RUN).lastRound, 3, "lastRound");
        assertEq(ledger.runOf(RUN).lastCheckpoint, ckpt(3), "lastCheckpoint");
        for (uint256 i = 0; i < WORKERS; ++i) {
            IContributionLedger.Contribution memory c = ledger.contributionOf(RUN, worker(i));
            assertEq(c.tokens, 3 * 1000 * (i + 1), "run tokens");
            assertEq(c.rounds, 3, "run rounds");
            IContributionLedger.Contribution memory t = ledger.totalContributionOf(worker(i));
            assertEq(t.tokens, c.tokens, "total tokens = run tokens with one run");
            assertEq(t.rounds, 3, "total rounds");
        }
    }

    function testWorkersMayJoinAndLeave() public {
        record(1, two(signed(0, 1, 10), signed(1, 1, 20)));
        record(2, one(signed(1, 2, 30)));
        record(3, two(signed(2, 3, 40), signed(0, 3, 50)));
        assertEq(ledger.contributionOf(RUN, worker(0)).tokens, 60, "w0 tokens");
        assertEq(ledger.contributionOf(RUN, worker(0)).rounds, 2, "w0 rounds");
        assertEq(ledger.contributionOf(RUN, worker(1)).tokens, 50, "w1 tokens");
        assertEq(ledger.contributionOf(RUN, worker(1)).rounds, 2, "w1 rounds");
        assertEq(ledger.contributionOf(RUN, worker(2)).tokens, 40, "w2 tokens");
        assertEq(ledger.contributionOf(RUN, worker(2)).rounds, 1, "w2 rounds");
    }

    function testTotalsAcrossRuns() public {
        bytes32 run2 = keccak256("run 2");
        address coordinator2 = address(0xC2);
        vm.prank(coordinator2);
        ledger.createRun(run2, GENESIS, CONFIG, GENESIS_MANIFEST);

        record(1, one(signed(0, 1, 700)));

        IContributionLedger.RoundReport memory r = report(0, 1, 300);
        r.runId = run2;
        IContributionLedger.SignedReport[] memory s = one(signWith(key(0), r));
        vm.prank(coordinator2);
        ledger.recordRound(run2, 1, GENESIS, ckpt(1), manifest(1), s, NONE);

        assertEq(ledger.contributionOf(RUN, worker(0)).tokens, 700, "run 1");
        assertEq(ledger.contributionOf(run2, worker(0)).tokens, 300, "run 2");
        assertEq(ledger.totalContributionOf(worker(0)).tokens, 1000, "total tokens");
        assertEq(ledger.totalContributionOf(worker(0)).rounds, 2, "total rounds");
        assertEq(ledger.runOf(RUN).lastRound, 1, "run 1 at round 1");
        assertEq(ledger.runOf(run2).lastRound, 1, "run 2 at round 1");
    }

    // --- refusals: the call ---

    function testUnknownRun() public {
        bytes32 id = keccak256("nope");
        IContributionLedger.SignedReport[] memory s = one(signed(0, 1, 1));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerUnknownRun.selector, id));
        vm.prank(COORDINATOR);
        ledger.recordRound(id, 1, GENESIS, ckpt(1), manifest(1), s, NONE);
    }

    function testNotCoordinator() public {
        IContributionLedger.SignedReport[] memory s = one(signed(0, 1, 1));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerNotCoordinator.selector, worker(0)));
        vm.prank(worker(0));
        ledger.recordRound(RUN, 1, GENESIS, ckpt(1), manifest(1), s, NONE);
    }

    function testRoundZeroOutOfOrder() public {
        IContributionLedger.SignedReport[] memory s = one(signed(0, 1, 1));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerRoundOutOfOrder.selector, 1, 0));
        vm.prank(COORDINATOR);
        ledger.recordRound(RUN, 0, GENESIS, ckpt(1), manifest(1), s, NONE);
    }

    function testRoundSkippedOutOfOrder() public {
        IContributionLedger.SignedReport[] memory s = one(signed(0, 2, 1));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerRoundOutOfOrder.selector, 1, 2));
        record(2, s);
    }

    function testRoundRepeatedOutOfOrder() public {
        record(1, one(signed(0, 1, 1)));
        IContributionLedger.SignedReport[] memory s = one(signed(1, 1, 1));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerRoundOutOfOrder.selector, 2, 1));
        record(1, s);
    }

    function testWrongParentAtRoundOne() public {
        bytes32 parent = keccak256("not genesis");
        IContributionLedger.SignedReport[] memory s = one(signed(0, 1, 1));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerWrongParent.selector, GENESIS, parent));
        vm.prank(COORDINATOR);
        ledger.recordRound(RUN, 1, parent, ckpt(1), manifest(1), s, NONE);
    }

    function testWrongParentLater() public {
        record(1, one(signed(0, 1, 1)));
        IContributionLedger.SignedReport[] memory s = one(signed(0, 2, 1));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerWrongParent.selector, ckpt(1), GENESIS));
        vm.prank(COORDINATOR);
        ledger.recordRound(RUN, 2, GENESIS, ckpt(2), manifest(2), s, NONE);
    }

    function testNoParticipants() public {
        IContributionLedger.SignedReport[] memory s = new IContributionLedger.SignedReport[](0);
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerNoParticipants.selector));
        record(1, s);
    }

    // --- rounds with unreported participants ---

    function testRoundNobodyReportedIsRecordedAndCreditsNobody() public {
        bytes32[] memory u = new bytes32[](2);
        (u[0], u[1]) = ghost(0, 1) < ghost(1, 1) ? (ghost(0, 1), ghost(1, 1)) : (ghost(1, 1), ghost(0, 1));
        vm.roll(50);
        vm.expectEmit(true, true, false, true, address(ledger));
        emit IContributionLedger.UpdateUnreported(RUN, 1, u[0]);
        vm.expectEmit(true, true, false, true, address(ledger));
        emit IContributionLedger.UpdateUnreported(RUN, 1, u[1]);
        vm.expectEmit(true, true, false, true, address(ledger));
        emit IContributionLedger.RoundRecorded(RUN, 1, ckpt(1), manifest(1), 0, 2);
        recordWith(1, new IContributionLedger.SignedReport[](0), u);

        IContributionLedger.RoundRecord memory rec = ledger.roundOf(RUN, 1);
        assertEq(rec.reportCount, 0, "reportCount");
        assertEq(rec.unreportedCount, 2, "unreportedCount");
        assertEq(rec.recordedAt, 50, "recordedAt");
        assertEq(ledger.runOf(RUN).lastRound, 1, "lastRound moves on");
        for (uint256 i = 0; i < WORKERS; ++i) {
            assertEq(ledger.contributionOf(RUN, worker(i)).rounds, 0, "nobody credited");
        }
        // the next round is not blocked, and is credited as usual
        record(2, one(signed(0, 2, 77)));
        assertEq(ledger.runOf(RUN).lastRound, 2, "round 2 recorded");
        assertEq(ledger.contributionOf(RUN, worker(0)).tokens, 77, "round 2 credited");
    }

    function testReportsBesideAnUnreportedUpdate() public {
        bytes32[] memory u = new bytes32[](1);
        u[0] = ghost(3, 1);
        vm.expectEmit(true, true, false, true, address(ledger));
        emit IContributionLedger.RoundRecorded(RUN, 1, ckpt(1), manifest(1), 2, 1);
        recordWith(1, signedBatch(2, 1), u);
        assertEq(ledger.roundOf(RUN, 1).unreportedCount, 1, "unreportedCount");
        assertEq(ledger.contributionOf(RUN, worker(1)).tokens, 2000, "reporters credited");
    }

    function _expectBadUnreported(bytes32[] memory u, uint256 index, IContributionLedger.SignedReport[] memory s)
        internal
    {
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerBadUnreported.selector, index));
        recordWith(1, s, u);
    }

    function testUnreportedZeroRefused() public {
        bytes32[] memory u = new bytes32[](1);
        _expectBadUnreported(u, 0, new IContributionLedger.SignedReport[](0));
    }

    function testUnreportedRepeatedOrUnsortedRefused() public {
        bytes32[] memory u = new bytes32[](2);
        (u[0], u[1]) = (bytes32(uint256(7)), bytes32(uint256(7)));
        _expectBadUnreported(u, 1, new IContributionLedger.SignedReport[](0));
        (u[0], u[1]) = (bytes32(uint256(8)), bytes32(uint256(7)));
        _expectBadUnreported(u, 1, new IContributionLedger.SignedReport[](0));
    }

    function testUnreportedThatIsAReportedUpdateRefused() public {
        IContributionLedger.SignedReport[] memory s = one(signed(0, 1, 1));
        bytes32[] memory u = new bytes32[](1);
        u[0] = s[0].report.updateDigest;
        _expectBadUnreported(u, 0, s);
    }

    // --- refusals: a report that does not match the round ---

    function _expectMismatchAtIndexOne(IContributionLedger.RoundReport memory bad) internal {
        IContributionLedger.SignedReport[] memory s = two(signed(0, 1, 1), signWith(key(1), bad));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerReportMismatch.selector, 1));
        record(1, s);
    }

    function testReportMismatchRunId() public {
        IContributionLedger.RoundReport memory r = report(1, 1, 1);
        r.runId = keccak256("other run");
        _expectMismatchAtIndexOne(r);
    }

    function testReportMismatchRound() public {
        IContributionLedger.RoundReport memory r = report(1, 1, 1);
        r.round = 2;
        _expectMismatchAtIndexOne(r);
    }

    function testReportMismatchParent() public {
        IContributionLedger.RoundReport memory r = report(1, 1, 1);
        r.parentCheckpoint = keccak256("other parent");
        _expectMismatchAtIndexOne(r);
    }

    function testReportMismatchCheckpoint() public {
        IContributionLedger.RoundReport memory r = report(1, 1, 1);
        r.checkpoint = keccak256("other checkpoint");
        _expectMismatchAtIndexOne(r);
    }

    // --- refusals: signatures ---

    function _expectInvalidSignature(uint256 index, IContributionLedger.SignedReport[] memory s) internal {
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerInvalidSignature.selector, index));
        record(1, s);
    }

    function testSignedByAnotherKey() public {
        // worker 1 (also active) signs a report that names worker 0
        _expectInvalidSignature(0, one(signWith(key(1), report(0, 1, 1))));
    }

    function testMalleableHighSRefused() public {
        IContributionLedger.RoundReport memory r = report(1, 1, 1);
        bytes32 digest = ledger.reportDigest(r);
        (uint8 v, bytes32 rr, bytes32 s) = vm.sign(key(1), digest);
        bytes32 highS = bytes32(SECP256K1_N - uint256(s));
        uint8 otherV = v == 27 ? 28 : 27;
        // The twin is a valid signature for the bare precompile ...
        assertEq(ecrecover(digest, otherV, rr, highS), worker(1), "ecrecover accepts the twin");
        // ... and the ledger refuses it.
        IContributionLedger.SignedReport memory twin =
            IContributionLedger.SignedReport({report: r, signature: abi.encodePacked(rr, highS, otherV)});
        _expectInvalidSignature(1, two(signed(0, 1, 1), twin));
    }

    function testShortSignatureRefused() public {
        IContributionLedger.SignedReport memory s = signed(0, 1, 1);
        (bytes32 rr, bytes32 ss) = abi.decode(s.signature, (bytes32, bytes32));
        s.signature = abi.encodePacked(rr, ss); // 64 bytes (ERC-2098 form is not accepted)
        _expectInvalidSignature(0, one(s));
    }

    function testEmptySignatureRefused() public {
        IContributionLedger.SignedReport memory s = signed(0, 1, 1);
        s.signature = "";
        _expectInvalidSignature(0, one(s));
    }

    function testBadVRefused() public {
        IContributionLedger.SignedReport memory s = signed(0, 1, 1);
        s.signature[64] = bytes1(uint8(29));
        _expectInvalidSignature(0, one(s));
    }

    function testSignatureForAnotherLedgerRefused() public {
        ContributionLedger other = new ContributionLedger(registry);
        IContributionLedger.RoundReport memory r = report(0, 1, 1);
        (uint8 v, bytes32 rr, bytes32 s) = vm.sign(key(0), other.reportDigest(r));
        _expectInvalidSignature(
            0, one(IContributionLedger.SignedReport({report: r, signature: abi.encodePacked(rr, s, v)}))
        );
    }

    // --- refusals: workers ---

    function testNeverAdmittedWorkerRefused() public {
        uint256 pk = 0xBAD;
        IContributionLedger.RoundReport memory r = report(0, 1, 1);
        r.worker = vm.addr(pk);
        IContributionLedger.SignedReport[] memory s = one(signWith(pk, r));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerWorkerNotActive.selector, vm.addr(pk)));
        record(1, s);
    }

    function testRevokedWorkerRefusedAfterRevocation() public {
        record(1, two(signed(0, 1, 1), signed(1, 1, 1)));
        vm.prank(VERIFIER);
        registry.revokeWorker(worker(1));
        IContributionLedger.SignedReport[] memory s = two(signed(0, 2, 1), signed(1, 2, 1));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerWorkerNotActive.selector, worker(1)));
        record(2, s);
        // without the revoked worker the round goes through
        record(2, one(signed(0, 2, 1)));
        assertEq(ledger.contributionOf(RUN, worker(1)).rounds, 1, "revoked worker keeps its past credit");
    }

    function testDisallowedMeasurementRefused() public {
        registry.setMeasurement(MEASUREMENT, false);
        assertEq(registry.isActive(worker(0)), false, "inactive");
        IContributionLedger.SignedReport[] memory s = one(signed(0, 1, 1));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerWorkerNotActive.selector, worker(0)));
        record(1, s);
    }

    function testReportReplayedInOneCall() public {
        IContributionLedger.SignedReport memory s = signed(0, 1, 1);
        bytes32 digest = ledger.reportDigest(s.report);
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerReportReplayed.selector, digest));
        record(1, two(s, s));
    }

    function testDuplicateWorker() public {
        IContributionLedger.SignedReport memory a = signed(0, 1, 1);
        IContributionLedger.RoundReport memory r = report(0, 1, 1);
        r.updateDigest = keccak256("a second update");
        IContributionLedger.SignedReport[] memory s = two(a, signWith(key(0), r));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerDuplicateWorker.selector, worker(0)));
        record(1, s);
    }

    function testRefusedRoundChangesNothing() public {
        IContributionLedger.SignedReport[] memory s = two(signed(0, 1, 1), signWith(key(0), report(1, 1, 1)));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerInvalidSignature.selector, 1));
        record(1, s);
        assertEq(ledger.runOf(RUN).lastRound, 0, "lastRound");
        assertEq(ledger.roundOf(RUN, 1).recordedAt, 0, "round");
        assertEq(ledger.contributionOf(RUN, worker(0)).rounds, 0, "tally");
        assertEq(ledger.isReportRecorded(ledger.reportDigest(s[0].report)), false, "digest");
    }

    // --- helpers ---

    /// @dev EIP-712 digest built field by field, without the ledger's code.
    function independentDigest(address verifyingContract, IContributionLedger.RoundReport memory r)
        internal
        view
        returns (bytes32)
    {
        bytes32 domainSeparator = keccak256(
            abi.encode(
                keccak256("EIP712Domain(string name,string version,uint256 chainId,address verifyingContract)"),
                keccak256("DiLoCoX Contribution Ledger"),
                keccak256("1"),
                block.chainid,
                verifyingContract
            )
        );
        bytes32 structHash = keccak256(
            bytes.concat(
                abi.encode(
                    keccak256(
                        "RoundReport(bytes32 runId,uint64 round,address worker,bytes32 parentCheckpoint,bytes32 checkpoint,bytes32 updateDigest,bytes32 dataDigest,int64 trainLossE6,int64 evalLossE6,uint64 tokens,uint32 innerSteps,uint64 bytesSent,uint64 bytesReceived)"
                    ),
                    r.runId,
                    r.round,
                    r.worker,
                    r.parentCheckpoint,
                    r.checkpoint
                ),
                abi.encode(
                    r.updateDigest,
                    r.dataDigest,
                    int256(r.trainLossE6),
                    int256(r.evalLossE6),
                    uint256(r.tokens),
                    uint256(r.innerSteps),
                    uint256(r.bytesSent),
                    uint256(r.bytesReceived)
                )
            )
        );
        return keccak256(abi.encodePacked("\x19\x01", domainSeparator, structHash));
    }
}
