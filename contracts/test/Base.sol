// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

/// @dev The few Foundry cheatcodes these tests use (forge-std is not installable offline).
interface Vm {
    function prank(address sender) external;
    function startPrank(address sender) external;
    function stopPrank() external;
    function addr(uint256 privateKey) external pure returns (address);
    function sign(uint256 privateKey, bytes32 digest) external pure returns (uint8 v, bytes32 r, bytes32 s);
    function expectRevert(bytes calldata revertData) external;
    function expectEmit(bool checkTopic1, bool checkTopic2, bool checkTopic3, bool checkData, address emitter) external;
    function roll(uint256 blockNumber) external;
    function assume(bool condition) external pure;
    function etch(address target, bytes calldata newRuntimeBytecode) external;
}

/// @dev Cheatcodes and assertions for the test contracts. A failed assertion reverts the test.
abstract contract BaseTest {
    Vm internal constant vm = Vm(address(uint160(uint256(keccak256("hevm cheat code")))));

    /// @dev Order of the secp256k1 group.
    uint256 internal constant SECP256K1_N = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141;

    /**
     * @dev A condition (or a comparison of booleans) did not hold.
     * @param what What was checked.
     */
    error AssertionFailed(string what);

    /**
     * @dev Two numbers differ.
     * @param what What was compared.
     * @param got The value found.
     * @param want The value expected.
     */
    error AssertionFailedUint(string what, uint256 got, uint256 want);

    /**
     * @dev Two words differ.
     * @param what What was compared.
     * @param got The value found.
     * @param want The value expected.
     */
    error AssertionFailedBytes32(string what, bytes32 got, bytes32 want);

    /**
     * @dev Two addresses differ.
     * @param what What was compared.
     * @param got The value found.
     * @param want The value expected.
     */
    error AssertionFailedAddress(string what, address got, address want);

    function assertTrue(bool condition, string memory what) internal pure {
        if (!condition) revert AssertionFailed(what);
    }

    function assertEq(uint256 got, uint256 want, string memory what) internal pure {
        if (got != want) revert AssertionFailedUint(what, got, want);
    }

    function assertEq(bytes32 got, bytes32 want, string memory what) internal pure {
        if (got != want) revert AssertionFailedBytes32(what, got, want);
    }

    function assertEq(address got, address want, string memory what) internal pure {
        if (got != want) revert AssertionFailedAddress(what, got, want);
    }

    function assertEq(bool got, bool want, string memory what) internal pure {
        if (got != want) revert AssertionFailed(what);
    }

    /// @dev Maps `x` into [min, max] (inclusive) without discarding fuzz runs.
    function bound(uint256 x, uint256 min, uint256 max) internal pure returns (uint256) {
        require(min <= max, "bound: min > max");
        uint256 size = max - min;
        if (size == type(uint256).max) return x;
        return min + (x % (size + 1));
    }
}

/**
 * @dev The targeting hooks of forge-std's `StdInvariant`, which forge reads from an invariant test:
 * `targetContracts()` (the contracts whose functions a run calls at random) and `targetSelectors()`
 * (which of their functions). Without them forge would call every contract the test deployed,
 * setUp and views included; with them, a run only drives a handler's actions.
 */
abstract contract InvariantBase is BaseTest {
    /// @dev Functions of one contract that invariant runs may call (forge-std's `FuzzSelector`).
    struct FuzzSelector {
        address addr;
        bytes4[] selectors;
    }

    address[] private _targetedContracts;
    FuzzSelector[] private _targetedSelectors;

    /// @dev Lets invariant runs call `selectors` of `target`, and nothing else of it.
    function targetSelector(address target, bytes4[] memory selectors) internal {
        _targetedContracts.push(target);
        _targetedSelectors.push(FuzzSelector({addr: target, selectors: selectors}));
    }

    /// @dev Read by forge: the contracts invariant runs call.
    function targetContracts() public view returns (address[] memory) {
        return _targetedContracts;
    }

    /// @dev Read by forge: the functions invariant runs call.
    function targetSelectors() public view returns (FuzzSelector[] memory) {
        return _targetedSelectors;
    }
}
