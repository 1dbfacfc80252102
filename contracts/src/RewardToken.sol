// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {ERC20} from "@openzeppelin/contracts/token/ERC20/ERC20.sol";
import {Ownable} from "@openzeppelin/contracts/access/Ownable.sol";

/**
 * @title RewardToken
 * @notice The ERC-20 a local deployment pays rewards in: its owner mints. A real deployment names an
 * existing token instead.
 */
contract RewardToken is ERC20, Ownable {
    constructor(address owner_) ERC20("DiLoCoX Reward", "DLXR") Ownable(owner_) {}

    /// @notice Mints `amount` to `to`. Only the owner.
    function mint(address to, uint256 amount) external onlyOwner {
        _mint(to, amount);
    }
}
