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
    uint64 internal constant TOKENS = 51_200; // what the run's config credits each report
    uint32 internal constant STEPS = 50;
    uint32 internal constant WINDOW = 10; // the run's challenge window, in blocks

    uint256 internal constant WORKERS = 5;

    /// @dev No unreported updates (an empty storage array, passed as empty calldata).
    bytes32[] internal NONE;
    uint256 internal constant FIRST_KEY = 0xA11CE;
    /// @dev Worker indices in ascending address order: the order a recording call lists reports in.
    uint256[] internal byAddress;

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
        ledger.createRun(RUN, GENESIS, CONFIG, GENESIS_MANIFEST, WINDOW);
        byAddress = sortedIndices(WORKERS);
    }

    function key(uint256 i) internal pure returns (uint256) {
        return FIRST_KEY + i;
    }

    function worker(uint256 i) internal pure returns (address) {
        return vm.addr(key(i));
    }

    /// @dev Indices 0..n-1 in ascending order of their worker's address.
    function sortedIndices(uint256 n) internal pure returns (uint256[] memory out) {
        out = new uint256[](n);
        for (uint256 i = 0; i < n; ++i) {
            uint256 j = i;
            while (j > 0 && worker(out[j - 1]) > worker(i)) {
                out[j] = out[j - 1];
                --j;
            }
            out[j] = i;
        }
    }

    /// @dev The checkpoint of `round` in the test run (round 0 is genesis).
    function ckpt(uint64 round) internal pure returns (bytes32) {
        return round == 0 ? GENESIS : keccak256(abi.encode("checkpoint", round));
    }

    function manifest(uint64 round) internal pure returns (bytes32) {
        return keccak256(abi.encode("manifest", round));
    }

    /// @dev What the reports of `round` of the test run share, on the canonical checkpoint chain.
    function header(uint64 round) internal pure returns (IContributionLedger.RoundHeader memory) {
        return IContributionLedger.RoundHeader({
            runId: RUN,
            round: round,
            parentCheckpoint: ckpt(round - 1),
            checkpoint: ckpt(round),
            manifestDigest: manifest(round),
            evalLossE6: 3_100_000,
            tokens: TOKENS,
            innerSteps: STEPS
        });
    }

    /// @dev Worker i's full report under `h`: what it signs.
    function report(uint256 i, IContributionLedger.RoundHeader memory h)
        internal
        pure
        returns (IContributionLedger.RoundReport memory)
    {
        // forge-lint: disable-next-item(unsafe-typecast) -- i is a small worker index
        return IContributionLedger.RoundReport({
            runId: h.runId,
            round: h.round,
            worker: worker(i),
            parentCheckpoint: h.parentCheckpoint,
            checkpoint: h.checkpoint,
            manifestDigest: h.manifestDigest,
            updateDigest: keccak256(abi.encode("update", i, h.round)),
            dataDigest: keccak256(abi.encode("data", i)),
            trainLossE6: 3_250_000 - int64(int256(i)),
            evalLossE6: h.evalLossE6,
            tokens: h.tokens,
            innerSteps: h.innerSteps,
            bytesSent: 1_000_000 + uint64(i),
            bytesReceived: 2_000_000 + uint64(i)
        });
    }

    /// @dev The worker's part of `r` with `signature`.
    function part(IContributionLedger.RoundReport memory r, bytes memory signature)
        internal
        pure
        returns (IContributionLedger.WorkerReport memory)
    {
        return IContributionLedger.WorkerReport({
            worker: r.worker,
            updateDigest: r.updateDigest,
            dataDigest: r.dataDigest,
            trainLossE6: r.trainLossE6,
            bytesSent: r.bytesSent,
            bytesReceived: r.bytesReceived,
            signature: signature
        });
    }

    /// @dev Signs `r` with `pk` through the ledger's own digest (an external call: do it before
    /// expectRevert) and returns its worker part.
    function signWith(uint256 pk, IContributionLedger.RoundReport memory r)
        internal
        view
        returns (IContributionLedger.WorkerReport memory)
    {
        (uint8 v, bytes32 rr, bytes32 s) = vm.sign(pk, ledger.reportDigest(r));
        return part(r, abi.encodePacked(rr, s, v));
    }

    function signed(uint256 i, uint64 round) internal view returns (IContributionLedger.WorkerReport memory) {
        return signWith(key(i), report(i, header(round)));
    }

    /// @dev Signed reports of workers 0..n-1 for `round`, in the order a recording call lists them.
    function batch(uint256 n, uint64 round) internal view returns (IContributionLedger.WorkerReport[] memory s) {
        uint256[] memory order = sortedIndices(n);
        s = new IContributionLedger.WorkerReport[](n);
        for (uint256 k = 0; k < n; ++k) {
            s[k] = signed(order[k], round);
        }
    }

    /**
     * @dev Signed reports for `round` of the workers whose bit is set in `mask` (bit i: worker i), in
     * the order a recording call lists them, and those workers in the same order.
     */
    function subset(uint256 mask, uint64 round)
        internal
        view
        returns (IContributionLedger.WorkerReport[] memory reports, address[] memory workers)
    {
        uint256 n;
        for (uint256 x = mask; x != 0; x >>= 1) {
            n += x & 1;
        }
        reports = new IContributionLedger.WorkerReport[](n);
        workers = new address[](n);
        uint256 k;
        for (uint256 j = 0; j < WORKERS; ++j) {
            // forge-lint: disable-next-line(incorrect-shift) -- bit byAddress[j] of the mask
            if (mask & (1 << byAddress[j]) != 0) {
                reports[k] = signed(byAddress[j], round);
                workers[k++] = worker(byAddress[j]);
            }
        }
    }

    /// @dev The workers of `batch(n, ...)`, in the same order.
    function batchWorkers(uint256 n) internal pure returns (address[] memory w) {
        uint256[] memory order = sortedIndices(n);
        w = new address[](n);
        for (uint256 k = 0; k < n; ++k) {
            w[k] = worker(order[k]);
        }
    }

    function one(IContributionLedger.WorkerReport memory s)
        internal
        pure
        returns (IContributionLedger.WorkerReport[] memory a)
    {
        a = new IContributionLedger.WorkerReport[](1);
        a[0] = s;
    }

    /// @dev Two reports in the order given (tests of ordering need them unsorted).
    function two(IContributionLedger.WorkerReport memory s0, IContributionLedger.WorkerReport memory s1)
        internal
        pure
        returns (IContributionLedger.WorkerReport[] memory a)
    {
        a = new IContributionLedger.WorkerReport[](2);
        a[0] = s0;
        a[1] = s1;
    }

    /// @dev Two reports in ascending worker order.
    function pair(IContributionLedger.WorkerReport memory s0, IContributionLedger.WorkerReport memory s1)
        internal
        pure
        returns (IContributionLedger.WorkerReport[] memory)
    {
        return s0.worker < s1.worker ? two(s0, s1) : two(s1, s0);
    }

    /// @dev Records `round` of the test run as the coordinator.
    function record(uint64 round, IContributionLedger.WorkerReport[] memory reports) internal {
        recordWith(header(round), reports, NONE);
    }

    function recordWith(
        IContributionLedger.RoundHeader memory h,
        IContributionLedger.WorkerReport[] memory reports,
        bytes32[] memory unreported
    ) internal {
        vm.prank(COORDINATOR);
        ledger.recordRound(h, reports, unreported);
    }

    /// @dev The facts of `round` of the test run as recorded at block `recordedAt`.
    function facts(uint64 round, uint64 recordedAt, address[] memory workers, uint64 unreportedCount)
        internal
        pure
        returns (IContributionLedger.RoundFacts memory)
    {
        return IContributionLedger.RoundFacts({
            checkpoint: ckpt(round),
            manifestDigest: manifest(round),
            tokens: TOKENS,
            recordedAt: recordedAt,
            unreportedCount: unreportedCount,
            workers: workers
        });
    }

    function addresses(address a) internal pure returns (address[] memory w) {
        w = new address[](1);
        w[0] = a;
    }

    /// @dev The update digest of an unreported participant `i` of `round` (never a report's).
    function ghost(uint256 i, uint64 round) internal pure returns (bytes32) {
        return keccak256(abi.encode("unreported update", i, round));
    }
}
