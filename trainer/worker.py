"""A worker: joins a run, then round after round fetches θ⁽ʳ⁻¹⁾, runs H inner steps, pushes Δ⁽ʳ⁾.

The worker trusts nothing it receives without checking: the run configuration must hash to the CID
the coordinator names, the global parameters to their CID, and the corpus to the configured digest.

Faults it rides out:
  * coordinator unreachable (restart, network blip): every call is retried with backoff for up to
    ``reconnect_timeout_s``; after reconnecting the worker joins again and re-sends an update the
    coordinator may not have received (a duplicate is answered ALREADY_EXISTS and counts as sent);
  * dropped from a round (too late, or refused): it logs why and starts the next round from the
    latest global checkpoint.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable, Iterator, TypeVar

import grpc
import torch

from proto import PROTOCOL_VERSION, pb, pb_grpc
from storage_client import CID, Codec
from trainer.config import RunConfig
from trainer.coordinator import grpc_options
from trainer.data import load_corpus, round_batches
from trainer.diloco import InnerLoop, InnerResult
from trainer.model import build_model
from trainer.wire import (
    ENCODING_DENSE_F32, Params, WireError, chunked, decode_params, encode_params, layout_of,
    reassemble, sha256_hex,
)

log = logging.getLogger("dilocox.worker")
T = TypeVar("T")

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class WorkerError(RuntimeError):
    """The worker cannot go on; the message says why."""


class Worker:
    def __init__(self, address: str, worker_id: str, *, reconnect_timeout_s: float = 120.0,
                 fetch_wait_s: float = 5.0) -> None:
        self.address = address
        self.worker_id = worker_id
        self.reconnect_timeout_s = reconnect_timeout_s
        self.fetch_wait_s = fetch_wait_s
        self.channel = grpc.insecure_channel(address, options=grpc_options())
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.round = 0
        self.phase = "starting"
        self.config: RunConfig | None = None
        self._stop = threading.Event()
        self.bytes_sent = 0
        self.bytes_received = 0

    # ----------------------------------------------------------------------------- plumbing

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn``; while the coordinator is unreachable, retry with backoff, then rejoin."""
        deadline = time.monotonic() + self.reconnect_timeout_s
        delay, lost = 0.2, False
        while True:
            try:
                if lost:
                    self.join()
                    log.info("reconnected to %s", self.address)
                return fn()
            except grpc.RpcError as exc:
                if exc.code() not in _RETRYABLE:
                    raise
                if time.monotonic() >= deadline:
                    raise WorkerError(
                        f"coordinator at {self.address} unreachable for {self.reconnect_timeout_s:.0f}s "
                        f"({what}: {exc.details()})"
                    ) from exc
                if not lost:
                    log.warning("%s: coordinator unreachable (%s); retrying", what, exc.details())
                lost = True
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def join(self) -> pb.JoinResponse:
        response = self.stub.Join(pb.JoinRequest(
            protocol_version=PROTOCOL_VERSION, worker_id=self.worker_id,
            capabilities=pb.Capabilities(device="cpu", threads=torch.get_num_threads(),
                                         encodings=[ENCODING_DENSE_F32]),
        ), timeout=30)
        actual = CID.of(response.config_json, Codec.JSON)
        if str(actual) != response.config_cid:
            raise WorkerError(f"run configuration hashes to {actual}, coordinator named {response.config_cid}")
        config = RunConfig.from_json(json.loads(response.config_json))
        if self.config is not None and config.cid != self.config.cid:
            raise WorkerError(f"coordinator now runs config {config.cid}, not {self.config.cid}")
        if self.config is None:
            self._set_up(config, response.shard, response.num_shards)
        self.heartbeat_interval_s = response.heartbeat_interval_s
        log.info("joined run %s at %s: shard %d of %d, open round %d", config.run_id, self.address,
                 response.shard, response.num_shards, response.open_round)
        return response

    def _set_up(self, config: RunConfig, shard: int, num_shards: int) -> None:
        self.config = config
        self.shard_index = shard
        corpus = load_corpus(config.data, config.seed, config.model.block_size)
        self.shard = corpus.shard(shard, num_shards)
        self.model = build_model(config.model, config.seed)
        self.inner = InnerLoop(self.model, config.inner)

    def _heartbeats(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_s):
            try:
                self.stub.Heartbeat(pb.HeartbeatRequest(worker_id=self.worker_id, round=self.round,
                                                        phase=self.phase), timeout=5)
            except grpc.RpcError as exc:
                log.debug("heartbeat failed: %s", exc.details())

    # ----------------------------------------------------------------------------- a round

    def fetch(self, min_round: int) -> tuple[pb.GlobalHeader, bytes]:
        """The global checkpoint of round >= ``min_round`` (waits for it), verified by its CID."""
        self.phase = "waiting"
        while True:
            def call() -> tuple[pb.GlobalHeader, bytes | None]:
                stream = self.stub.FetchGlobal(pb.FetchGlobalRequest(
                    worker_id=self.worker_id, min_round=min_round, wait_s=self.fetch_wait_s),
                    timeout=self.fetch_wait_s + 60)
                first = next(stream)
                self.bytes_received += first.ByteSize()
                if not first.HasField("header"):
                    raise WireError("global state stream did not start with its header")
                header = first.header
                if not header.available:
                    return header, None

                def data() -> Iterator[bytes]:
                    for message in stream:
                        self.bytes_received += message.ByteSize()
                        yield message.data
                payload = reassemble(data(), header.payload_size, header.payload_sha256,
                                     what=f"global parameters of round {header.round}")
                if str(CID.of(payload)) != header.params_cid:
                    raise WireError(f"global parameters hash to {CID.of(payload)}, header names {header.params_cid}")
                return header, payload

            header, payload = self._call("fetch global state", call)
            if payload is not None:
                return header, payload

    def push(self, round_: int, result: InnerResult, base_cid: str) -> bool:
        """Send Δ for ``round_``; True if the coordinator holds it, False if it was refused."""
        self.phase = "pushing"
        payload = encode_params(result.pseudo_gradient)
        header = pb.UpdateHeader(
            protocol_version=PROTOCOL_VERSION, run_id=self.config.run_id, round=round_,
            worker_id=self.worker_id, encoding=ENCODING_DENSE_F32,
            tensors=[pb.TensorSpec(name=n, dtype=d, shape=s) for n, (d, s) in layout_of(result.pseudo_gradient).items()],
            payload_size=len(payload), payload_sha256=sha256_hex(payload), train_loss=result.mean_loss,
            tokens=result.tokens, inner_steps=result.steps, base_params_cid=base_cid,
        )
        # A fresh stream per attempt: after a reconnect the same bytes are sent again.
        def messages() -> Iterator[pb.UpdateChunk]:
            first = pb.UpdateChunk(header=header)
            self.bytes_sent += first.ByteSize()
            yield first
            for piece in chunked(payload):
                message = pb.UpdateChunk(data=piece)
                self.bytes_sent += message.ByteSize()
                yield message

        try:
            response = self._call(f"push round {round_}", lambda: self.stub.PushUpdate(messages(), timeout=120))
            log.info("round %d: update %s accepted", round_, response.update_cid)
            return True
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.ALREADY_EXISTS:
                log.info("round %d: coordinator already holds this worker's update", round_)
                return True
            if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                log.warning("round %d: update refused (%s): %s", round_, code.name, exc.details())
                return False
            raise

    def train(self, round_: int, params: Params) -> InnerResult:
        self.phase = "training"
        cfg = self.config
        batches = round_batches(
            self.shard, seed=cfg.seed, shard_index=self.shard_index, round_=round_,
            steps=cfg.inner.steps, batch_size=cfg.inner.batch_size, block_size=cfg.model.block_size,
        )
        return self.inner.run(params, batches)

    def run(self) -> int:
        self._call("join", self.join)
        beat = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
        beat.start()
        try:
            min_round = 0
            while True:
                header, payload = self.fetch(min_round)
                if header.finished:
                    log.info("run finished at round %d (%s); sent %d bytes, received %d",
                             header.round, header.manifest_cid, self.bytes_sent, self.bytes_received)
                    return 0
                self.round = header.round + 1
                started = time.monotonic()
                result = self.train(self.round, decode_params(payload))
                trained = time.monotonic() - started
                self.push(self.round, result, header.params_cid)
                log.info("round %d: %d steps, loss %.4f, %d tokens, train %.2fs, push %.2fs",
                         self.round, result.steps, result.mean_loss, result.tokens, trained,
                         time.monotonic() - started - trained)
                min_round = self.round
        finally:
            self.phase = "done"
            self._stop.set()
            try:  # tell the coordinator at once, so it need not wait for liveness to lapse
                self.stub.Heartbeat(pb.HeartbeatRequest(worker_id=self.worker_id, round=self.round,
                                                        phase="done"), timeout=2)
            except grpc.RpcError:
                pass
            self.channel.close()
