"""settlement pieces that need no running chain: revert decoding, key hiding, transport failures,
deployment files, artifacts and the gas table's format."""

from __future__ import annotations

import copy
import json
import logging
import pickle
import socket
from pathlib import Path

import pytest
from eth_abi import encode
from eth_utils import keccak

from settlement import (
    DEV_ACCOUNTS,
    ArtifactError,
    Chain,
    ChainUnavailable,
    Deployment,
    DeploymentError,
    RevertDecoder,
    load_artifact,
)
from settlement.gas import format_markdown

ABI = [
    {"type": "error", "name": "LedgerWrongParent",
     "inputs": [{"name": "expected", "type": "bytes32"}, {"name": "got", "type": "bytes32"}]},
    {"type": "error", "name": "LedgerWorkerNotActive", "inputs": [{"name": "worker", "type": "address"}]},
    {"type": "error", "name": "LedgerRoundOutOfOrder",
     "inputs": [{"name": "expected", "type": "uint64"}, {"name": "got", "type": "uint64"}]},
    {"type": "error", "name": "NoReports", "inputs": []},
    {"type": "function", "name": "ignored", "inputs": [], "outputs": []},
]


def selector(signature: str) -> bytes:
    return keccak(text=signature)[:4]


def test_revert_decoder_names_errors_and_arguments() -> None:
    decoder = RevertDecoder([ABI, ABI])  # the same error in two ABIs is fine
    a, b = b"\xab" * 32, b"\xcd" * 32
    data = selector("LedgerWrongParent(bytes32,bytes32)") + encode(["bytes32", "bytes32"], [a, b])
    name, fields, text = decoder.decode(data)
    assert (name, fields) == ("LedgerWrongParent", {"expected": a, "got": b})
    assert text == f"LedgerWrongParent(expected=0x{a.hex()}, got=0x{b.hex()})"
    worker = "0x70997970c51812dc3a010c7d01b50e0d17dc79c8"
    text = decoder.decode(selector("LedgerWorkerNotActive(address)") + encode(["address"], [worker]))[2]
    assert text == "LedgerWorkerNotActive(worker=0x70997970C51812dc3A010C7d01b50e0d17dc79C8)"
    assert decoder.decode(selector("LedgerRoundOutOfOrder(uint64,uint64)") + encode(["uint64", "uint64"], [3, 5]))[2] \
        == "LedgerRoundOutOfOrder(expected=3, got=5)"
    assert decoder.decode(selector("NoReports()"))[2] == "NoReports()"
    assert decoder.decode(selector("Error(string)") + encode(["string"], ["nope"]))[2] == 'Error(message="nope")'
    assert decoder.decode(selector("Panic(uint256)") + encode(["uint256"], [0x11]))[2] == "Panic(code=17)"
    assert decoder.decode(b"")[0] is None
    assert decoder.decode(b"\x01\x02\x03\x04\x05")[2] == "unknown error 0x01020304 (revert data 0x0102030405)"
    assert "undecodable" in decoder.decode(selector("LedgerWorkerNotActive(address)") + b"\x01")[2]


def test_chain_never_shows_its_key() -> None:
    key = DEV_ACCOUNTS[3]
    chain = Chain("http://127.0.0.1:9", key)
    assert chain.address == "0x90F79bf6EB2c4f870365E785982E1f101E93b906"
    for text in (repr(chain), str(chain), repr(vars(chain))):
        assert key[2:] not in text and key[2:].upper() not in text
    with pytest.raises(TypeError, match="private key"):
        pickle.dumps(chain)
    with pytest.raises(TypeError, match="private key"):
        copy.deepcopy(chain)
    bad = "0x" + "ff" * 32  # above the curve order
    with pytest.raises(ValueError) as exc:
        Chain("http://127.0.0.1:9", bad)
    assert "ff" * 8 not in str(exc.value) and exc.value.__cause__ is None and exc.value.__context__ is None


def test_unreachable_node_is_retried_then_named(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    chain = Chain(f"http://127.0.0.1:{port}", DEV_ACCOUNTS[0], retries=3, backoff_s=0.001)
    with caplog.at_level(logging.DEBUG, logger="dilocox.settlement"), pytest.raises(ChainUnavailable) as exc:
        _ = chain.chain_id
    assert str(exc.value) == f"chain RPC http://127.0.0.1:{port} is unreachable: connection refused"
    assert exc.value.__cause__ is None
    assert len([r for r in caplog.records if "retry" in r.getMessage()]) == 3
    assert all(r.levelno == logging.DEBUG for r in caplog.records)


def test_deployment_round_trip_and_malformed_files(tmp_path: Path) -> None:
    dep = Deployment(chain_id=31337, registry="0x5fbdb2315678afecb367f032d93f642f64180aa3",
                     ledger="0xe7f1725E7734CE288F8367e1Bb143E90bb3F0512",
                     owner="0xf39Fd6e51aad88F6F4ce6aB8827279cffFb92266", deployed_block=1,
                     token="0x9fE46736679d2D9a65F0992F2272dE9f3c7fa6e0",
                     rewards="0xCf7Ed3AccA5a467e9e704C703E8D87F634fB0Fc9")
    dep.save(tmp_path / "d" / "deployment.json")
    loaded = Deployment.load(tmp_path / "d" / "deployment.json")
    assert loaded.registry == "0x5FbDB2315678afecb367f032d93F642f64180aa3" and loaded.deployed_block == 1
    with pytest.raises(DeploymentError, match="does not exist"):
        Deployment.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps({"chain_id": 1}))
    with pytest.raises(DeploymentError, match="must hold exactly"):
        Deployment.load(tmp_path / "bad.json")
    data = json.loads((tmp_path / "d" / "deployment.json").read_text())
    (tmp_path / "bad.json").write_text(json.dumps({**data, "ledger": "0x1234"}))
    with pytest.raises(DeploymentError, match="malformed"):
        Deployment.load(tmp_path / "bad.json")


def test_missing_artifact_says_how_to_build_it() -> None:
    with pytest.raises(ArtifactError) as exc:
        load_artifact("NoSuchContract")
    assert "contracts/out/NoSuchContract.sol/NoSuchContract.json" in str(exc.value)
    assert "make setup" in str(exc.value)


def test_gas_table_markdown() -> None:
    rows = [{"operation": "createRun", "reports": None, "gas_used": 136682, "gas_per_report": None},
            {"operation": "recordRound", "reports": 1, "gas_used": 89568, "gas_per_report": 89568},
            {"operation": "recordRound", "reports": 4, "gas_used": 154043, "gas_per_report": 38510}]
    assert format_markdown(rows).splitlines() == [
        "| operation | reports | gas used | gas per report | gas per further report |",
        "| --- | ---: | ---: | ---: | ---: |",
        "| createRun |  | 136,682 |  |  |",
        "| recordRound | 1 | 89,568 | 89,568 |  |",
        "| recordRound | 4 | 154,043 | 38,510 | 21,491 |",
    ]
