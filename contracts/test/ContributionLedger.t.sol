// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {ContributionLedger} from "../src/ContributionLedger.sol";
import {IContributionLedger} from "../src/IContributionLedger.sol";
import {LedgerBase} from "./LedgerBase.sol";

contract ContributionLedgerTest is LedgerBase {
    // --- EIP-712 encoding, checked against an independent encoding ---

    function testTypehash() public view {
        assertEq(
            ledger.ROUND_REPORT_TYPEHASH(),
            keccak256(
                "RoundReport(bytes32 runId,uint64 round,address worker,bytes32 parentCheckpoint,bytes32 checkpoint,bytes32 manifestDigest,bytes32 updateDigest,bytes32 dataDigest,int64 trainLossE6,int64 evalLossE6,uint64 tokens,uint32 innerSteps,uint64 bytesSent,uint64 bytesReceived)"
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
        IContributionLedger.RoundReport memory r = report(2, header(7));
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
        emit IContributionLedger.RunCreated(id, coordinator, GENESIS, CONFIG, GENESIS_MANIFEST, 7);
        vm.prank(coordinator);
        ledger.createRun(id, GENESIS, CONFIG, GENESIS_MANIFEST, 7);

        IContributionLedger.Run memory run = ledger.runOf(id);
        assertEq(run.coordinator, coordinator, "coordinator");
        assertEq(run.lastRound, 0, "lastRound");
        assertEq(run.challengeWindow, 7, "challengeWindow");
        assertEq(run.lastCheckpoint, GENESIS, "lastCheckpoint");
        assertEq(run.genesisCheckpoint, GENESIS, "genesisCheckpoint");
        assertEq(run.configDigest, CONFIG, "configDigest");
        assertEq(run.genesisManifest, GENESIS_MANIFEST, "genesisManifest");
    }

    function testCreateRunExists() public {
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerRunExists.selector, RUN));
        vm.prank(address(0xC2));
        ledger.createRun(RUN, keccak256("other"), CONFIG, GENESIS_MANIFEST, 0);
    }

    function testUnknownRunIsEmpty() public view {
        assertEq(ledger.runOf(keccak256("nope")).coordinator, address(0), "no coordinator");
        assertEq(ledger.roundCommitment(RUN, 1), bytes32(0), "round 1 not recorded");
    }

    // --- happy paths ---

    function testRecordRoundOneReport() public {
        IContributionLedger.WorkerReport[] memory s = one(signed(0, 1));
        vm.roll(100);
        bytes32 commitment = ledger.commitmentOf(facts(1, 100, addresses(worker(0)), 0));
        vm.expectEmit(true, true, false, true, address(ledger));
        emit IContributionLedger.RoundRecorded(
            RUN, 1, ckpt(1), manifest(1), TOKENS, addresses(worker(0)), 0, commitment
        );
        record(1, s);

        assertEq(ledger.roundCommitment(RUN, 1), commitment, "commitment");
        IContributionLedger.Run memory run = ledger.runOf(RUN);
        assertEq(run.lastRound, 1, "lastRound");
        assertEq(run.lastCheckpoint, ckpt(1), "lastCheckpoint");
        assertEq(run.genesisCheckpoint, GENESIS, "genesis kept");

        assertEq(ledger.contributionOf(RUN, worker(0)).tokens, TOKENS, "run tokens");
        assertEq(ledger.contributionOf(RUN, worker(0)).rounds, 1, "run rounds");
        assertEq(ledger.totalContributionOf(worker(0)).tokens, TOKENS, "total tokens");
        assertEq(ledger.totalContributionOf(worker(0)).rounds, 1, "total rounds");
        assertEq(ledger.runsOf(worker(0)).length, 1, "one run");
        assertEq(ledger.contributionOf(RUN, worker(1)).rounds, 0, "others untouched");
    }

    function testCommitmentBindsEveryFact() public {
        vm.roll(42);
        bytes32[] memory u = new bytes32[](1);
        u[0] = ghost(4, 1);
        recordWith(header(1), batch(2, 1), u);
        bytes32 stored = ledger.roundCommitment(RUN, 1);
        IContributionLedger.RoundFacts memory f = facts(1, 42, batchWorkers(2), 1);
        assertEq(ledger.commitmentOf(f), stored, "the facts as recorded");
        f.recordedAt = 43;
        assertTrue(ledger.commitmentOf(f) != stored, "another block");
        f = facts(1, 42, batchWorkers(2), 0);
        assertTrue(ledger.commitmentOf(f) != stored, "another unreported count");
        f = facts(1, 42, addresses(batchWorkers(2)[0]), 1);
        assertTrue(ledger.commitmentOf(f) != stored, "another worker list");
        f = facts(1, 42, batchWorkers(2), 1);
        f.tokens = TOKENS + 1;
        assertTrue(ledger.commitmentOf(f) != stored, "other tokens");
    }

    function testRecordSeveralRoundsWithSeveralReports() public {
        for (uint64 round = 1; round <= 3; ++round) {
            vm.roll(10 * round);
            record(round, batch(WORKERS, round));
            assertEq(
                ledger.roundCommitment(RUN, round),
                ledger.commitmentOf(facts(round, 10 * round, batchWorkers(WORKERS), 0)),
                "commitment"
            );
        }
        assertEq(ledger.runOf(RUN).lastRound, 3, "lastRound");
        assertEq(ledger.runOf(RUN).lastCheckpoint, ckpt(3), "lastCheckpoint");
        for (uint256 i = 0; i < WORKERS; ++i) {
            IContributionLedger.Contribution memory c = ledger.contributionOf(RUN, worker(i));
            assertEq(c.tokens, 3 * TOKENS, "run tokens");
            assertEq(c.rounds, 3, "run rounds");
            IContributionLedger.Contribution memory t = ledger.totalContributionOf(worker(i));
            assertEq(t.tokens, c.tokens, "total tokens = run tokens with one run");
            assertEq(t.rounds, 3, "total rounds");
            assertEq(ledger.runsOf(worker(i)).length, 1, "the run listed once");
        }
    }

    function testWorkersMayJoinAndLeave() public {
        record(1, pair(signed(0, 1), signed(1, 1)));
        record(2, one(signed(1, 2)));
        record(3, pair(signed(2, 3), signed(0, 3)));
        assertEq(ledger.contributionOf(RUN, worker(0)).rounds, 2, "w0 rounds");
        assertEq(ledger.contributionOf(RUN, worker(1)).rounds, 2, "w1 rounds");
        assertEq(ledger.contributionOf(RUN, worker(2)).rounds, 1, "w2 rounds");
        assertEq(ledger.contributionOf(RUN, worker(2)).tokens, TOKENS, "w2 tokens");
    }

    function testTotalsAcrossRuns() public {
        bytes32 run2 = keccak256("run 2");
        address coordinator2 = address(0xC2);
        vm.prank(coordinator2);
        ledger.createRun(run2, GENESIS, CONFIG, GENESIS_MANIFEST, 0);

        record(1, one(signed(0, 1)));

        IContributionLedger.RoundHeader memory h = header(1);
        h.runId = run2;
        h.tokens = 300;
        IContributionLedger.WorkerReport[] memory s = one(signWith(key(0), report(0, h)));
        vm.prank(coordinator2);
        ledger.recordRound(h, s, NONE);

        assertEq(ledger.contributionOf(RUN, worker(0)).tokens, TOKENS, "run 1");
        assertEq(ledger.contributionOf(run2, worker(0)).tokens, 300, "run 2");
        assertEq(ledger.totalContributionOf(worker(0)).tokens, TOKENS + 300, "total tokens");
        assertEq(ledger.totalContributionOf(worker(0)).rounds, 2, "total rounds");
        bytes32[] memory runs = ledger.runsOf(worker(0));
        assertEq(runs.length, 2, "two runs");
        assertEq(runs[0], RUN, "first run first");
        assertEq(runs[1], run2, "second run second");
    }

    // --- refusals: the call ---

    function testUnknownRun() public {
        IContributionLedger.RoundHeader memory h = header(1);
        h.runId = keccak256("nope");
        IContributionLedger.WorkerReport[] memory s = one(signed(0, 1));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerUnknownRun.selector, h.runId));
        recordWith(h, s, NONE);
    }

    function testNotCoordinator() public {
        IContributionLedger.WorkerReport[] memory s = one(signed(0, 1));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerNotCoordinator.selector, worker(0)));
        vm.prank(worker(0));
        ledger.recordRound(header(1), s, NONE);
    }

    function testRoundZeroOutOfOrder() public {
        IContributionLedger.RoundHeader memory h = header(1);
        h.round = 0;
        IContributionLedger.WorkerReport[] memory s = one(signed(0, 1));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerRoundOutOfOrder.selector, 1, 0));
        recordWith(h, s, NONE);
    }

    function testRoundSkippedOutOfOrder() public {
        IContributionLedger.WorkerReport[] memory s = one(signed(0, 2));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerRoundOutOfOrder.selector, 1, 2));
        record(2, s);
    }

    function testRoundRepeatedOutOfOrder() public {
        record(1, one(signed(0, 1)));
        IContributionLedger.WorkerReport[] memory s = one(signed(1, 1));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerRoundOutOfOrder.selector, 2, 1));
        record(1, s);
    }

    function testWrongParentAtRoundOne() public {
        IContributionLedger.RoundHeader memory h = header(1);
        h.parentCheckpoint = keccak256("not genesis");
        IContributionLedger.WorkerReport[] memory s = one(signWith(key(0), report(0, h)));
        vm.expectRevert(
            abi.encodeWithSelector(IContributionLedger.LedgerWrongParent.selector, GENESIS, h.parentCheckpoint)
        );
        recordWith(h, s, NONE);
    }

    function testWrongParentLater() public {
        record(1, one(signed(0, 1)));
        IContributionLedger.RoundHeader memory h = header(2);
        h.parentCheckpoint = GENESIS;
        IContributionLedger.WorkerReport[] memory s = one(signWith(key(0), report(0, h)));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerWrongParent.selector, ckpt(1), GENESIS));
        recordWith(h, s, NONE);
    }

    function testNoParticipants() public {
        IContributionLedger.WorkerReport[] memory s = new IContributionLedger.WorkerReport[](0);
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerNoParticipants.selector));
        record(1, s);
    }

    // --- rounds with unreported participants ---

    function testRoundNobodyReportedIsRecordedAndCreditsNobody() public {
        bytes32[] memory u = new bytes32[](2);
        (u[0], u[1]) = ghost(0, 1) < ghost(1, 1) ? (ghost(0, 1), ghost(1, 1)) : (ghost(1, 1), ghost(0, 1));
        vm.roll(50);
        address[] memory nobody = new address[](0);
        bytes32 commitment = ledger.commitmentOf(facts(1, 50, nobody, 2));
        vm.expectEmit(true, true, false, true, address(ledger));
        emit IContributionLedger.UpdateUnreported(RUN, 1, u[0]);
        vm.expectEmit(true, true, false, true, address(ledger));
        emit IContributionLedger.UpdateUnreported(RUN, 1, u[1]);
        vm.expectEmit(true, true, false, true, address(ledger));
        emit IContributionLedger.RoundRecorded(RUN, 1, ckpt(1), manifest(1), TOKENS, nobody, 2, commitment);
        recordWith(header(1), new IContributionLedger.WorkerReport[](0), u);

        assertEq(ledger.roundCommitment(RUN, 1), commitment, "commitment");
        assertEq(ledger.runOf(RUN).lastRound, 1, "lastRound moves on");
        for (uint256 i = 0; i < WORKERS; ++i) {
            assertEq(ledger.contributionOf(RUN, worker(i)).rounds, 0, "nobody credited");
        }
        // the next round is not blocked, and is credited as usual
        record(2, one(signed(0, 2)));
        assertEq(ledger.runOf(RUN).lastRound, 2, "round 2 recorded");
        assertEq(ledger.contributionOf(RUN, worker(0)).tokens, TOKENS, "round 2 credited");
    }

    function testReportsBesideAnUnreportedUpdate() public {
        bytes32[] memory u = new bytes32[](1);
        u[0] = ghost(3, 1);
        recordWith(header(1), batch(2, 1), u);
        assertEq(ledger.contributionOf(RUN, worker(1)).tokens, TOKENS, "reporters credited");
        assertEq(ledger.contributionOf(RUN, worker(3)).rounds, 0, "the unreported participant is not");
    }

    function _expectBadUnreported(bytes32[] memory u, uint256 index, IContributionLedger.WorkerReport[] memory s)
        internal
    {
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerBadUnreported.selector, index));
        recordWith(header(1), s, u);
    }

    function testUnreportedZeroRefused() public {
        bytes32[] memory u = new bytes32[](1);
        _expectBadUnreported(u, 0, new IContributionLedger.WorkerReport[](0));
    }

    function testUnreportedRepeatedOrUnsortedRefused() public {
        bytes32[] memory u = new bytes32[](2);
        (u[0], u[1]) = (bytes32(uint256(7)), bytes32(uint256(7)));
        _expectBadUnreported(u, 1, new IContributionLedger.WorkerReport[](0));
        (u[0], u[1]) = (bytes32(uint256(8)), bytes32(uint256(7)));
        _expectBadUnreported(u, 1, new IContributionLedger.WorkerReport[](0));
    }

    function testUnreportedThatIsAReportedUpdateRefused() public {
        IContributionLedger.WorkerReport[] memory s = one(signed(0, 1));
        bytes32[] memory u = new bytes32[](1);
        u[0] = s[0].updateDigest;
        _expectBadUnreported(u, 0, s);
    }

    // --- refusals: a report signed for another round, run, parent, checkpoint or manifest ---

    function _expectSignedForAnother(IContributionLedger.RoundHeader memory other) internal {
        // worker i signed its report under `other`; the call records round 1's header
        uint256 i = byAddress[1];
        IContributionLedger.WorkerReport memory bad = signWith(key(i), report(i, other));
        IContributionLedger.WorkerReport[] memory s = two(signed(byAddress[0], 1), bad);
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerInvalidSignature.selector, 1));
        record(1, s);
    }

    function testReportForAnotherRunRefused() public {
        IContributionLedger.RoundHeader memory h = header(1);
        h.runId = keccak256("other run");
        _expectSignedForAnother(h);
    }

    function testReportForAnotherRoundRefused() public {
        _expectSignedForAnother(header(2));
    }

    function testReportForAnotherParentRefused() public {
        IContributionLedger.RoundHeader memory h = header(1);
        h.parentCheckpoint = keccak256("other parent");
        _expectSignedForAnother(h);
    }

    function testReportForAnotherCheckpointRefused() public {
        IContributionLedger.RoundHeader memory h = header(1);
        h.checkpoint = keccak256("other checkpoint");
        _expectSignedForAnother(h);
    }

    function testReportForAnotherManifestRefused() public {
        IContributionLedger.RoundHeader memory h = header(1);
        h.manifestDigest = keccak256("a manifest with other traffic");
        _expectSignedForAnother(h);
    }

    function testReportWithOtherTokensRefused() public {
        IContributionLedger.RoundHeader memory h = header(1);
        h.tokens = TOKENS * 1_000_000;
        _expectSignedForAnother(h);
    }

    function testReportOfAnEarlierRoundCannotBeRecordedAgain() public {
        IContributionLedger.WorkerReport memory first = signed(0, 1);
        record(1, one(first));
        // the same signed part, offered for round 2: the signature is over round 1
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerInvalidSignature.selector, 0));
        record(2, one(first));
        assertEq(ledger.contributionOf(RUN, worker(0)).rounds, 1, "credited once");
    }

    // --- refusals: signatures ---

    function _expectInvalidSignature(uint256 index, IContributionLedger.WorkerReport[] memory s) internal {
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerInvalidSignature.selector, index));
        record(1, s);
    }

    function testSignedByAnotherKey() public {
        // worker 1 (also active) signs a report that names worker 0
        _expectInvalidSignature(0, one(signWith(key(1), report(0, header(1)))));
    }

    function testMalleableHighSRefused() public {
        uint256 i = byAddress[1];
        IContributionLedger.RoundReport memory r = report(i, header(1));
        bytes32 digest = ledger.reportDigest(r);
        (uint8 v, bytes32 rr, bytes32 s) = vm.sign(key(i), digest);
        bytes32 highS = bytes32(SECP256K1_N - uint256(s));
        uint8 otherV = v == 27 ? 28 : 27;
        // The twin is a valid signature for the bare precompile ...
        assertEq(ecrecover(digest, otherV, rr, highS), worker(i), "ecrecover accepts the twin");
        // ... and the ledger refuses it.
        _expectInvalidSignature(1, two(signed(byAddress[0], 1), part(r, abi.encodePacked(rr, highS, otherV))));
    }

    function testShortSignatureRefused() public {
        IContributionLedger.WorkerReport memory s = signed(0, 1);
        (bytes32 rr, bytes32 ss) = abi.decode(s.signature, (bytes32, bytes32));
        s.signature = abi.encodePacked(rr, ss); // 64 bytes (ERC-2098 form is not accepted)
        _expectInvalidSignature(0, one(s));
    }

    function testEmptySignatureRefused() public {
        IContributionLedger.WorkerReport memory s = signed(0, 1);
        s.signature = "";
        _expectInvalidSignature(0, one(s));
    }

    function testBadVRefused() public {
        IContributionLedger.WorkerReport memory s = signed(0, 1);
        s.signature[64] = bytes1(uint8(29));
        _expectInvalidSignature(0, one(s));
    }

    function testSignatureForAnotherLedgerRefused() public {
        ContributionLedger other = new ContributionLedger(registry);
        IContributionLedger.RoundReport memory r = report(0, header(1));
        (uint8 v, bytes32 rr, bytes32 s) = vm.sign(key(0), other.reportDigest(r));
        _expectInvalidSignature(0, one(part(r, abi.encodePacked(rr, s, v))));
    }

    // --- refusals: workers and their order ---

    function testNeverAdmittedWorkerRefused() public {
        uint256 pk = 0xBAD;
        IContributionLedger.RoundReport memory r = report(0, header(1));
        r.worker = vm.addr(pk);
        IContributionLedger.WorkerReport[] memory s = one(signWith(pk, r));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerWorkerNotActive.selector, vm.addr(pk)));
        record(1, s);
    }

    function testRevokedWorkerRefusedAfterRevocation() public {
        record(1, pair(signed(0, 1), signed(1, 1)));
        vm.prank(VERIFIER);
        registry.revokeWorker(worker(1));
        IContributionLedger.WorkerReport[] memory s = pair(signed(0, 2), signed(1, 2));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerWorkerNotActive.selector, worker(1)));
        record(2, s);
        // without the revoked worker the round goes through
        record(2, one(signed(0, 2)));
        assertEq(ledger.contributionOf(RUN, worker(1)).rounds, 1, "revoked worker keeps its past credit");
    }

    function testDisallowedMeasurementRefused() public {
        registry.setMeasurement(MEASUREMENT, false);
        assertEq(registry.isActive(worker(0)), false, "inactive");
        IContributionLedger.WorkerReport[] memory s = one(signed(0, 1));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerWorkerNotActive.selector, worker(0)));
        record(1, s);
    }

    function testSameReportTwiceInOneCallRefused() public {
        IContributionLedger.WorkerReport memory s = signed(0, 1);
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerReportsNotSorted.selector, 1));
        record(1, two(s, s));
    }

    function testTwoReportsOfOneWorkerRefused() public {
        IContributionLedger.RoundReport memory r = report(0, header(1));
        r.updateDigest = keccak256("a second update");
        IContributionLedger.WorkerReport[] memory s = two(signed(0, 1), signWith(key(0), r));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerReportsNotSorted.selector, 1));
        record(1, s);
    }

    function testUnsortedReportsRefused() public {
        IContributionLedger.WorkerReport[] memory s = pair(signed(0, 1), signed(1, 1));
        (s[0], s[1]) = (s[1], s[0]);
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerReportsNotSorted.selector, 1));
        record(1, s);
    }

    function testRefusedRoundChangesNothing() public {
        IContributionLedger.WorkerReport[] memory s =
            two(signed(byAddress[0], 1), signWith(key(byAddress[0]), report(byAddress[1], header(1))));
        vm.expectRevert(abi.encodeWithSelector(IContributionLedger.LedgerInvalidSignature.selector, 1));
        record(1, s);
        assertEq(ledger.runOf(RUN).lastRound, 0, "lastRound");
        assertEq(ledger.roundCommitment(RUN, 1), bytes32(0), "round");
        assertEq(ledger.contributionOf(RUN, worker(byAddress[0])).rounds, 0, "tally");
        assertEq(ledger.runsOf(worker(byAddress[0])).length, 0, "runs");
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
                        "RoundReport(bytes32 runId,uint64 round,address worker,bytes32 parentCheckpoint,bytes32 checkpoint,bytes32 manifestDigest,bytes32 updateDigest,bytes32 dataDigest,int64 trainLossE6,int64 evalLossE6,uint64 tokens,uint32 innerSteps,uint64 bytesSent,uint64 bytesReceived)"
                    ),
                    r.runId,
                    r.round,
                    r.worker,
                    r.parentCheckpoint,
                    r.checkpoint,
                    r.manifestDigest
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
