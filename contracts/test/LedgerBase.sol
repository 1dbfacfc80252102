// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {ContributionLedger} from "../src/ContributionLedger.sol";
import {IContributionLedger} from "../src/IContributionLedger.sol";
import {WorkerRegistry} from "../src/WorkerRegistry.sol";
import {BaseTest} from "./Base.sol";

/// @dev A registry with admitted workers, a ledger, one created run, and report builders.
abstract contract LedgerBase is BaseTest {
    WorkerRegistry internal registry;
    ContributionLedger internal ledger;

    address internal constant VERIFIER = address(0x7E41);
    address internal constant COORDINATOR = address(0xC0C0);
    bytes32 internal constant MEASUREMENT = keccak256("measurement");
    bytes32 internal constant RUN = keccak256("run");
    bytes32 internal constant GENESIS = keccak256("genesis checkpoint");
    bytes32 internal constant CONFIG = keccak256("config");
    bytes32 internal constant GENESIS_MANIFEST = keccak256("genesis manifest");

    uint256 internal constant WORKERS = 5;

    /// @dev No unreported updates (an empty storage array, passed as empty calldata).
    bytes32[] internal NONE;
    uint256 internal constant FIRST_KEY = 0xA11CE;

    function setUp() public virtual {
        registry = new WorkerRegistry(address(this));
        registry.setMeasurement(MEASUREMENT, true);
        registry.setVerifier(VERIFIER, true);
        for (uint256 i = 0; i < WORKERS; ++i) {
            vm.prank(VERIFIER);
            registry.admitWorker(vm.addr(key(i)), MEASUREMENT, keccak256(abi.encode("evidence", i)));
        }
        ledger = new ContributionLedger(registry);
        vm.prank(COORDINATOR);
        ledger.createRun(RUN, GENESIS, CONFIG, GENESIS_MANIFEST);
    }

    function key(uint256 i) internal pure returns (uint256) {
        return FIRST_KEY + i;
    }

    function worker(uint256 i) internal pure returns (address) {
        return vm.addr(key(i));
    }

    /// @dev The checkpoint of `round` in the test run (round 0 is genesis).
    function ckpt(uint64 round) internal pure returns (bytes32) {
        return round == 0 ? GENESIS : keccak256(abi.encode("checkpoint", round));
    }

    function manifest(uint64 round) internal pure returns (bytes32) {
        return keccak256(abi.encode("manifest", round));
    }

    /// @dev Worker i's report for `round` of the test run, on the canonical checkpoint chain.
    function report(uint256 i, uint64 round, uint64 tokens)
        internal
        pure
        returns (IContributionLedger.RoundReport memory r)
    {
        // forge-lint: disable-next-item(unsafe-typecast) -- i is a small worker index
        r = IContributionLedger.RoundReport({
            runId: RUN,
            round: round,
            worker: worker(i),
            parentCheckpoint: ckpt(round - 1),
            checkpoint: ckpt(round),
            updateDigest: keccak256(abi.encode("update", i, round)),
            dataDigest: keccak256(abi.encode("data", i, round)),
            trainLossE6: 3_250_000 - int64(int256(i)),
            evalLossE6: 3_100_000,
            tokens: tokens,
            innerSteps: 50,
            bytesSent: 1_000_000 + uint64(i),
            bytesReceived: 2_000_000 + uint64(i)
        });
    }

    /// @dev Signs with `pk` through the ledger's own digest (an external call: do it before expectRevert).
    function signWith(uint256 pk, IContributionLedger.RoundReport memory r)
        internal
        view
        returns (IContributionLedger.SignedReport memory)
    {
        (uint8 v, bytes32 rr, bytes32 s) = vm.sign(pk, ledger.reportDigest(r));
        return IContributionLedger.SignedReport({report: r, signature: abi.encodePacked(rr, s, v)});
    }

    function signed(uint256 i, uint64 round, uint64 tokens)
        internal
        view
        returns (IContributionLedger.SignedReport memory)
    {
        return signWith(key(i), report(i, round, tokens));
    }

    /// @dev Signed reports of workers 0..n-1 for `round`; worker i reports 1000 * (i + 1) tokens.
    function signedBatch(uint256 n, uint64 round) internal view returns (IContributionLedger.SignedReport[] memory s) {
        s = new IContributionLedger.SignedReport[](n);
        for (uint256 i = 0; i < n; ++i) {
            s[i] = signed(i, round, uint64(1000 * (i + 1)));
        }
    }

    function one(IContributionLedger.SignedReport memory s)
        internal
        pure
        returns (IContributionLedger.SignedReport[] memory a)
    {
        a = new IContributionLedger.SignedReport[](1);
        a[0] = s;
    }

    function two(IContributionLedger.SignedReport memory s0, IContributionLedger.SignedReport memory s1)
        internal
        pure
        returns (IContributionLedger.SignedReport[] memory a)
    {
        a = new IContributionLedger.SignedReport[](2);
        a[0] = s0;
        a[1] = s1;
    }

    /// @dev Records `round` of the test run as the coordinator.
    function record(uint64 round, IContributionLedger.SignedReport[] memory reports) internal {
        recordWith(round, reports, NONE);
    }

    /// @dev Records `round` with `unreported` update digests beside the reports.
    function recordWith(uint64 round, IContributionLedger.SignedReport[] memory reports, bytes32[] memory unreported)
        internal
    {
        vm.prank(COORDINATOR);
        ledger.recordRound(RUN, round, ckpt(round - 1), ckpt(round), manifest(round), reports, unreported);
    }

    /// @dev The update digest of an unreported participant `i` of `round` (never a report's).
    function ghost(uint256 i, uint64 round) internal pure returns (bytes32) {
        return keccak256(abi.encode("unreported update", i, round));
    }
}
