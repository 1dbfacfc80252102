// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {ERC20} from "@openzeppelin/contracts/token/ERC20/ERC20.sol";
import {Ownable} from "@openzeppelin/contracts/access/Ownable.sol";
import {Ownable2Step} from "@openzeppelin/contracts/access/Ownable2Step.sol";

/**
 * @title RewardToken
 * @notice The ERC-20 a local deployment pays rewards in: its owner mints. A real deployment names an
 * existing token instead. The owner is {Ownable2Step}, as the registry's: a transfer takes effect when
 * the new owner accepts it.
 */
contract RewardToken is ERC20, Ownable2Step {
    /// @param owner_ The account that may mint.
    constructor(address owner_) ERC20("DiLoCoX Reward", "DLXR") Ownable(owner_) {}

    /**
     * @notice Mints `amount` to `to`. Only the owner. Emits {IERC20-Transfer} from the zero address.
     * @param to The account credited.
     * @param amount The tokens minted, in the smallest unit.
     */
    function mint(address to, uint256 amount) external onlyOwner {
        _mint(to, amount);
    }
}
