"""One account on one EVM chain: signed transactions, views, and errors a person can read.

Every write the platform makes (admitting a worker, recording a round) goes through ``Chain``:
the transaction is built, its gas estimated, signed locally with the account's key and sent raw,
so the node never holds the key. Three things make failures legible:

* a revert, whether found while estimating gas or in a mined receipt, becomes ``TxReverted`` whose
  message is the contract's custom error with its arguments, e.g.
  ``LedgerWrongParent(expected=0xab…, got=0xcd…)``, decoded from the 4-byte selectors of every error in
  the registry's and the ledger's ABIs (OpenZeppelin's included) plus ``Error(string)`` and
  ``Panic(uint256)``;
* transient transport failures (refused or reset connections, timeouts, 5xx answers) are retried
  with exponential backoff, then reported once as ``ChainUnavailable`` naming the RPC URL;
* the private key never appears in a log line, an exception message or a repr.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, NamedTuple, TypeVar

import requests
from eth_abi import decode as abi_decode
from eth_account import Account
from eth_utils import keccak, to_checksum_address
from web3 import HTTPProvider, Web3
from web3.exceptions import ContractLogicError, TransactionNotFound, Web3RPCError

from storage_client import DilocoxError

from .artifacts import ArtifactError, ledger_artifact, load_artifact, registry_artifact

__all__ = ["Chain", "ChainError", "ChainUnavailable", "RevertDecoder", "TxReverted"]

log = logging.getLogger("dilocox.settlement")

T = TypeVar("T")

# Failures of the transport, not of the request: worth another try after a pause.
_TRANSIENT: tuple[type[BaseException], ...] = (
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    requests.exceptions.ChunkedEncodingError,
    ConnectionError,
    TimeoutError,
)

_MAX_BACKOFF_S = 5.0


class Deployed(NamedTuple):
    address: str
    block: int
    gas_used: int


class ChainError(DilocoxError):
    """Something on the chain side failed: a revert, an unreachable node, a conflicting record."""


class ChainUnavailable(ChainError):
    """The node did not answer, even after retries.

    @param rpc_url the endpoint that was tried
    @param reason a short cause, e.g. ``connection refused``
    """

    def __init__(self, rpc_url: str, reason: str) -> None:
        super().__init__(f"chain RPC {rpc_url} is unreachable: {reason}")
        self.rpc_url = rpc_url
        self.reason = reason


class TxReverted(ChainError):
    """A transaction or call was refused by a contract. ``str()`` is the decoded error.

    @param message the decoded error with its arguments, e.g. ``LedgerWorkerNotActive(worker=0x…)``
    @param error the error's name (``LedgerWorkerNotActive``), or None when the revert carried no data
    @param fields the error's arguments by name, as decoded
    @param function the contract function that was called
    @param tx_hash the mined transaction, when the revert happened on chain rather than at estimation
    """

    def __init__(self, message: str, *, error: str | None = None, fields: dict[str, Any] | None = None,
                 function: str | None = None, tx_hash: str | None = None) -> None:
        super().__init__(message)
        self.error = error
        self.fields = dict(fields or {})
        self.function = function
        self.tx_hash = tx_hash


def _canonical_type(param: dict[str, Any]) -> str:
    """The ABI type as it appears in a signature (tuples spelled out)."""
    kind = param["type"]
    if kind.startswith("tuple"):
        inner = ",".join(_canonical_type(c) for c in param.get("components", []))
        return f"({inner}){kind[len('tuple'):]}"
    return kind


def _format_value(kind: str, value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return "0x" + bytes(value).hex()
    if kind == "address":
        return to_checksum_address(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_format_value("", v) for v in value) + "]"
    return str(value)


class RevertDecoder:
    """Turns revert data into ``Name(arg=value, ...)`` using the errors declared in some ABIs.

    @param abis contract ABIs whose ``error`` entries are known (duplicates are harmless)
    """

    _BUILTIN: ClassVar[list[dict[str, Any]]] = [
        {"type": "error", "name": "Error", "inputs": [{"name": "message", "type": "string"}]},
        {"type": "error", "name": "Panic", "inputs": [{"name": "code", "type": "uint256"}]},
    ]

    def __init__(self, abis: Iterable[list[dict[str, Any]]]) -> None:
        self._errors: dict[bytes, dict[str, Any]] = {}
        for abi in [self._BUILTIN, *abis]:
            for entry in abi:
                if entry.get("type") != "error":
                    continue
                signature = f"{entry['name']}({','.join(_canonical_type(p) for p in entry.get('inputs', []))})"
                self._errors[keccak(text=signature)[:4]] = entry

    def decode(self, data: bytes) -> tuple[str | None, dict[str, Any], str]:
        """Decode revert data.

        @param data the revert data (selector and ABI-encoded arguments); may be empty
        @return (error name or None, arguments by name, readable text)
        """
        if not data:
            return None, {}, "reverted without a reason"
        entry = self._errors.get(data[:4])
        if entry is None:
            return None, {}, f"unknown error 0x{data[:4].hex()} (revert data 0x{data.hex()})"
        inputs = entry.get("inputs", [])
        try:
            values = abi_decode([_canonical_type(p) for p in inputs], data[4:])
        except Exception:  # malformed arguments: show the raw bytes rather than fail
            return entry["name"], {}, f"{entry['name']}(<undecodable 0x{data[4:].hex()}>)"
        fields = {(p.get("name") or f"arg{i}"): v for i, (p, v) in enumerate(zip(inputs, values, strict=True))}
        text = ", ".join(f"{name}={_format_value(p['type'], v)}"
                         for (name, v), p in zip(fields.items(), inputs, strict=True))
        return entry["name"], fields, f"{entry['name']}({text})"


_default_decoder: RevertDecoder | None = None


def _decoder() -> RevertDecoder:
    """The decoder for this repository's contracts (raw hex only, if the artifacts are missing)."""
    global _default_decoder
    if _default_decoder is None:
        try:
            abis = [registry_artifact().abi, ledger_artifact().abi, load_artifact("RewardPool").abi,
                    load_artifact("Disputes").abi, load_artifact("ReceiptCourt").abi]
        except ArtifactError as exc:
            log.warning("revert reasons will not be decoded: %s", exc)
            abis = []
        _default_decoder = RevertDecoder(abis)
    return _default_decoder


def _revert_data(exc: BaseException) -> bytes | None:
    """The revert data a web3 exception carries, if any."""
    data = getattr(exc, "data", None)
    if isinstance(data, dict):
        data = data.get("data")
    if isinstance(data, (bytes, bytearray)):
        return bytes(data)
    if isinstance(data, str) and data.startswith("0x"):
        try:
            return bytes.fromhex(data[2:])
        except ValueError:
            return None
    return None


def _transport_reason(exc: BaseException, timeout_s: float) -> str:
    """A short cause for a transport failure (never the whole urllib3 chain)."""
    text = " ".join(str(e) for e in _causes(exc))
    lowered = text.lower()
    if "connection refused" in lowered:
        return "connection refused"
    if "reset by peer" in lowered or "connectionreset" in lowered:
        return "connection reset"
    if any(isinstance(e, (requests.exceptions.Timeout, TimeoutError)) for e in _causes(exc)) or "timed out" in lowered:
        return f"no answer within {timeout_s:g}s"
    if "name or service not known" in lowered or "nodename nor servname" in lowered:
        return "host name not found"
    if "remotedisconnected" in lowered or "remote end closed" in lowered:
        return "connection closed by the server"
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first[:200]}"


def _causes(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 10:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, _TRANSIENT):
        return True
    if isinstance(exc, requests.exceptions.HTTPError):
        response = exc.response
        return response is not None and response.status_code >= 500
    return False


def _fn_label(contract_fn: Any) -> str:
    return str(getattr(contract_fn, "fn_name", None) or "constructor")


class Chain:
    """One account on one chain, reached over HTTP JSON-RPC.

    @param rpc_url the node's endpoint
    @param private_key the account's secp256k1 key (32 bytes, or 0x-hex); kept only in memory and
        never shown
    @param timeout_s the HTTP timeout of one request, and how long to wait for a receipt
    @param retries how many times a transport failure is retried (backoff doubling from
        ``backoff_s``, capped at 5 s) before ``ChainUnavailable``
    @param backoff_s the first pause between tries
    """

    def __init__(self, rpc_url: str, private_key: bytes | str, *, timeout_s: float = 30.0, retries: int = 5,
                 backoff_s: float = 0.1) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        account = None
        try:
            account = Account.from_key(private_key)
        except Exception:  # raised below, outside this block, so the original error is not even chained
            pass
        if account is None:
            # Never chain or echo the underlying error: its text can contain the key.
            raise ValueError("the private key is not a valid secp256k1 key (32 bytes or 0x-hex)")
        self._account = account
        self.rpc_url = rpc_url
        self.address: str = account.address
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.w3 = Web3(HTTPProvider(rpc_url, request_kwargs={"timeout": timeout_s},
                                    exception_retry_configuration=None))
        self._chain_id: int | None = None
        self._tx_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Chain(rpc_url={self.rpc_url!r}, address={self.address})"

    def __getstate__(self) -> Any:
        raise TypeError("a Chain holds a private key and cannot be pickled or copied")

    @property
    def chain_id(self) -> int:
        """The chain id the node reports (asked once, then cached)."""
        if self._chain_id is None:
            self._chain_id = int(self.read(lambda: self.w3.eth.chain_id, "eth_chainId"))
        return self._chain_id

    def contract(self, address: str, abi: list[dict[str, Any]]) -> Any:
        """A web3 contract object at ``address`` with ``abi``."""
        return self.w3.eth.contract(address=to_checksum_address(address), abi=abi)

    # -- reads ---------------------------------------------------------------------------------------

    def read(self, fn: Callable[[], T], what: str = "RPC request") -> T:
        """Run a read-only RPC operation, retrying transport failures.

        @param fn the operation (any web3 call: a view, get_logs, get_transaction ...)
        @param what a short label for debug logs
        @raise ChainUnavailable when the node does not answer after ``retries`` retries
        """
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except Exception as exc:
                if not _is_transient(exc):
                    raise
                reason = _transport_reason(exc, self.timeout_s)
                if attempt == self.retries:
                    raise ChainUnavailable(self.rpc_url, reason) from None
                log.debug("%s on %s failed (%s); retry %d/%d in %.2fs", what, self.rpc_url, reason,
                          attempt + 1, self.retries, delay)
                time.sleep(delay)
                delay = min(delay * 2, _MAX_BACKOFF_S)
        raise AssertionError("unreachable")

    def call(self, contract_fn: Any, block: int | str = "latest") -> Any:
        """Call a view function.

        @param contract_fn a bound web3 contract function, e.g. ``c.functions.runOf(run_id)``
        @param block the block to read at
        @raise TxReverted when the view reverts; ChainUnavailable when the node does not answer
        """
        label = _fn_label(contract_fn)
        try:
            return self.read(lambda: contract_fn.call({"from": self.address}, block_identifier=block), label)
        except ContractLogicError as exc:
            raise self._reverted(exc, label) from None

    # -- writes --------------------------------------------------------------------------------------

    def transact(self, contract_fn: Any, *, gas: int | None = None) -> Any:
        """Send a contract call (or constructor) as a locally signed transaction and wait for it.

        @param contract_fn a bound web3 contract function or constructor
        @param gas the gas limit; None estimates it (a revert found then raises TxReverted and
            nothing is sent) and adds a 20% margin
        @return the mined receipt (status 1)
        @raise TxReverted on a revert; ChainUnavailable when the node does not answer; ChainError
            when the node refuses the transaction or it is not mined within ``timeout_s``
        """
        label = _fn_label(contract_fn)
        if gas is None:
            try:
                estimate = self.read(lambda: contract_fn.estimate_gas({"from": self.address}), f"{label} gas estimate")
            except ContractLogicError as exc:
                raise self._reverted(exc, label) from None
            except Web3RPCError as exc:
                raise ChainError(f"{label}: the node refused the gas estimate: {exc}") from None
            gas = int(estimate * 1.2) + 10_000
        with self._tx_lock:  # nonce, signature and submission in one step per account
            def build() -> dict[str, Any]:
                nonce = self.w3.eth.get_transaction_count(self.address, "pending")
                return dict(contract_fn.build_transaction(
                    {"from": self.address, "nonce": nonce, "gas": gas, "chainId": self.chain_id}))

            try:
                tx = self.read(build, f"{label} build")
            except ContractLogicError as exc:
                raise self._reverted(exc, label) from None
            signed = self._account.sign_transaction(tx)
            tx_hash = "0x" + bytes(signed.hash).hex()
            self._send(bytes(signed.raw_transaction), label)
        receipt = self._wait_for_receipt(tx_hash, label)
        if receipt["status"] != 1:
            raise self._replay_revert(tx, receipt, label, tx_hash)
        log.debug("%s mined in block %d (tx %s, gas %d)", label, receipt["blockNumber"], tx_hash, receipt["gasUsed"])
        return receipt

    def deploy(self, abi: list[dict[str, Any]], bytecode: str, *args: Any) -> Deployed:
        """Deploy a contract: the one way every contract of the project is deployed.

        @param abi its ABI
        @param bytecode its creation bytecode (0x-hex)
        @param args the constructor's arguments
        @return the new contract's checksummed address, its block and the gas it cost
        """
        constructor = self.w3.eth.contract(abi=abi, bytecode=bytecode).constructor(*args)
        receipt = self.transact(constructor)
        address = receipt["contractAddress"]
        if not address:
            raise ChainError(f"deployment tx 0x{bytes(receipt['transactionHash']).hex()} created no contract")
        return Deployed(to_checksum_address(address), int(receipt["blockNumber"]), int(receipt["gasUsed"]))

    def _send(self, raw: bytes, label: str) -> None:
        tried = False

        def send() -> None:
            nonlocal tried
            first, tried = not tried, True
            try:
                self.w3.eth.send_raw_transaction(raw)
            except Web3RPCError as exc:
                text = str(exc).lower()
                # An earlier try that "failed" in transport may have reached the node after all.
                if not first and ("already known" in text or "nonce too low" in text):
                    return
                raise ChainError(f"{label}: the node refused the transaction: {exc}") from None

        self.read(send, f"{label} send")

    def _wait_for_receipt(self, tx_hash: str, label: str) -> Any:
        deadline = time.monotonic() + self.timeout_s
        pause = 0.02
        while True:
            try:
                return self.read(lambda: self.w3.eth.get_transaction_receipt(tx_hash), f"{label} receipt")
            except TransactionNotFound:
                pass
            if time.monotonic() > deadline:
                raise ChainError(f"{label}: transaction {tx_hash} was sent but not mined within {self.timeout_s:g}s")
            time.sleep(pause)
            pause = min(pause * 2, 1.0)

    def _reverted(self, exc: BaseException, label: str, tx_hash: str | None = None) -> TxReverted:
        data = _revert_data(exc)
        if data is None:
            message = str(exc) or "execution reverted"
            return TxReverted(message, function=label, tx_hash=tx_hash)
        name, fields, text = _decoder().decode(data)
        return TxReverted(text, error=name, fields=fields, function=label, tx_hash=tx_hash)

    def _replay_revert(self, tx: dict[str, Any], receipt: Any, label: str, tx_hash: str) -> TxReverted:
        """Why a mined transaction failed: replay it as a call on the state before its block."""
        call = {k: tx[k] for k in ("from", "to", "data", "value", "gas") if k in tx}
        try:
            self.read(lambda: self.w3.eth.call(call, receipt["blockNumber"] - 1), f"{label} replay")
        except ContractLogicError as exc:
            return self._reverted(exc, label, tx_hash)
        except ChainError:
            pass
        return TxReverted(f"transaction {tx_hash} reverted in block {receipt['blockNumber']} (gas used "
                          f"{receipt['gasUsed']} of {tx.get('gas')}; the replay did not revert, so "
                          f"probably out of gas)", function=label, tx_hash=tx_hash)
