// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {Disputes} from "../src/Disputes.sol";
import {IDisputes} from "../src/IDisputes.sol";
import {LedgerBase} from "./LedgerBase.sol";

/// @dev {LedgerBase} with the ledger's disputes contract (owned by this test, the ledger's deployer) and
/// verdict builders signed by auditor keys.
abstract contract DisputesBase is LedgerBase {
    Disputes internal disputes;

    bytes32 internal constant AUDIT_MEASUREMENT = keccak256("audit measurement");
    bytes32 internal constant CHECK = keccak256("replay");
    bytes32 internal constant EVIDENCE = keccak256("evidence object");
    uint256 internal constant FIRST_AUDITOR_KEY = 0xA0D17;

    function setUp() public virtual override {
        super.setUp();
        disputes = Disputes(ledger.disputes());
    }

    function auditorKey(uint256 i) internal pure returns (uint256) {
        return FIRST_AUDITOR_KEY + i;
    }

    function auditor(uint256 i) internal pure returns (address) {
        return vm.addr(auditorKey(i));
    }

    /// @dev Admits auditors 0..n-1 to the test run and sets its threshold to k, as the owner.
    function panel(uint256 n, uint256 k) internal {
        for (uint256 i = 0; i < n; ++i) {
            disputes.admitAuditor(RUN, auditor(i), AUDIT_MEASUREMENT, keccak256(abi.encode("audit evidence", i)));
        }
        disputes.setThreshold(RUN, k);
    }

    function verdict(uint64 round, address party) internal pure returns (IDisputes.Verdict memory) {
        return IDisputes.Verdict({runId: RUN, round: round, party: party, check: CHECK, evidence: EVIDENCE});
    }

    function signVerdict(uint256 pk, IDisputes.Verdict memory v) internal view returns (bytes memory) {
        (uint8 sv, bytes32 r, bytes32 s) = vm.sign(pk, disputes.verdictDigest(v));
        return abi.encodePacked(r, s, sv);
    }

    /// @dev Signatures of `v` by the auditors whose bit is set in `mask`, in ascending signer order.
    function signedBy(uint256 mask, IDisputes.Verdict memory v) internal view returns (bytes[] memory sigs) {
        uint256 n;
        for (uint256 x = mask; x != 0; x >>= 1) {
            n += x & 1;
        }
        uint256[] memory keys = new uint256[](n);
        uint256 k;
        for (uint256 i = 0; i < 256 && k < n; ++i) {
            // forge-lint: disable-next-line(incorrect-shift) -- bit i of the mask
            if (mask & (1 << i) != 0) {
                uint256 j = k++;
                while (j > 0 && vm.addr(keys[j - 1]) > auditor(i)) {
                    keys[j] = keys[j - 1];
                    --j;
                }
                keys[j] = auditorKey(i);
            }
        }
        sigs = new bytes[](n);
        for (uint256 i = 0; i < n; ++i) {
            sigs[i] = signVerdict(keys[i], v);
        }
    }
}
