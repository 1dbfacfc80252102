"""A hand-driven hostile client: it joins a run as a worker would, then pushes what no worker would.

    m = Mallory.joined(cluster)                 Join over the cluster's TLS channel, as "mallory"
    trainer = Trainer(m, cluster)               the honest inner loop on mallory's own shard
    base, delta = trainer.update(r)             fetch θ⁽ʳ⁻¹⁾, run H AdamW steps: Δ = θ⁽ʳ⁻¹⁾ − θ_H
    m.push(delta * 86, round=r, base_params_cid=base, train_loss=trainer.loss)
    m.refused(grpc.StatusCode.INVALID_ARGUMENT, m.zero)   the details of an expected refusal

``Mallory`` speaks the protocol directly (trainer.coordinator.service's RPCs), so every header field of a push
is its to choose; by default a push claims exactly what an honest worker's would (tokens and steps
from the config, the base it fetched). ``Trainer`` computes the update an honest worker on
mallory's shard would push (trainer.runtime.inner.InnerLoop on trainer.data.corpus.round_batches), so the only
dishonest thing about mallory is what it does with it. ``Heartbeats`` keeps mallory live while it
trains, as a worker's heartbeat thread does, so a round waits for its push.

Used by tests/integration/test_bad_input.py, test_dishonest_workers.py, benchmarks/robustness.py and
benchmarks/attacks.py (the header of a dripping push).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import grpc
import torch

from cli.cluster import LocalCluster
from proto import PROTOCOL_VERSION, Encoding, WorkerPhase, pb, session_metadata
from storage_client import canonical_json, open_store
from trainer.codec import AdaptiveRankPolicy, ErrorFeedbackCompressor
from trainer.codec.wire import chunked, decode_params, encode_params, layout_of, sha256_hex
from trainer.config import RunConfig
from trainer.data.corpus import load_corpus, round_batches
from trainer.model.gpt import build_model
from trainer.runtime.inner import FRESH_STATE, InnerLoop, inner_state_bytes
from trainer.runtime.kernels import current_kernels
from trainer.runtime.staged import staged_arithmetic

Params = dict[str, torch.Tensor]


class Mallory:
    """A hand-driven client that speaks the protocol directly, to send what no worker would."""

    def __init__(self, stub: Any, worker_id: str, config: RunConfig, session: tuple = ()) -> None:
        self.stub = stub
        self.worker_id = worker_id
        self.config = config
        self.session = session  # metadata proving the session of mallory's Join
        model = build_model(config.model, config.seed)
        self.zero = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        # What a push sends unless told otherwise: small, non-zero (an all-zero update is refused).
        self.default = {n: torch.full_like(p, 1e-4) for n, p in self.zero.items()}
        self.base: dict[str, object] | None = None  # base_params_cid of a push that names none
        # Tokens and steps are derived from the config, so a push claims exactly those by default.
        self.tokens = config.inner.steps * config.inner.batch_size * config.model.block_size
        self.wire_bytes = 0

    @classmethod
    def joined(cls, cluster: LocalCluster, worker_id: str = "mallory") -> Mallory:
        stub = cluster.stub()
        joined = stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, worker_id=worker_id), timeout=10)
        return cls(stub, worker_id, RunConfig.from_json(json.loads(joined.config_json)),
                   session_metadata(worker_id, joined.session_token))

    def push(self, tensors: Params | None = None, *, payload: bytes | None = None,
             layout: dict | None = None, state: bytes = b"", **header: object) -> pb.PushUpdateResponse:
        """Push ``tensors`` (or raw ``payload`` bytes), then ``state`` (inner-state bytes, as a worker
        sends them every rounds.state_every rounds); ``header`` overrides any UpdateHeader field."""
        tensors = self.default if tensors is None else tensors
        payload = encode_params(tensors) if payload is None else payload
        first = self.header(payload, layout_of(tensors) if layout is None else layout,
                            **{"inner_state_size": len(state), **header})
        stream = ([first] + [pb.UpdateChunk(data=p) for p in chunked(payload)]
                  + [pb.UpdateChunk(state=p) for p in chunked(state)])
        self.wire_bytes = sum(message.ByteSize() for message in stream)  # what the coordinator counts
        return self.stub.PushUpdate(iter(stream), timeout=30, metadata=self.session)

    def header(self, payload: bytes, layout: dict | None = None, **header: object) -> pb.UpdateChunk:
        """The first message of a push of ``payload`` (by default the layout of the default update):
        what an honest worker's header would claim, ``header`` overriding any field."""
        layout = layout_of(self.default) if layout is None else layout
        fields = dict(
            protocol_version=PROTOCOL_VERSION, run_id=self.config.run_id, round=1,
            worker_id=self.worker_id, encoding=Encoding.DENSE_F32,
            tensors=[pb.TensorSpec(name=n, dtype=d, shape=s) for n, (d, s) in layout.items()],
            payload_size=len(payload), payload_sha256=sha256_hex(payload), train_loss=2.0,
            tokens=self.tokens, inner_steps=self.config.inner.steps, stage=0, num_stages=1,
            inner_state_sha256=FRESH_STATE,
        )
        kernels = current_kernels(torch.device("cpu"))  # what it trains with in this process, as a worker names it
        if kernels is not None:
            fields.update(cpu_capability=kernels.capability, intra_op_threads=kernels.threads)
        if "base_params_cid" not in header:  # the state the run started from, fetched once
            self.base = self.base or {"base_params_cid": self.fetch()["base_params_cid"]}
            fields.update(self.base)
        fields.update(header)  # a stage slice names its worker's one commitment, and kernels, too
        return pb.UpdateChunk(header=pb.UpdateHeader(**fields))

    def fetch(self, min_round: int = 0) -> dict[str, object]:
        """Fetch the global parameters as a worker would; returns the header fields a push that
        builds on them names (the CID, and the wire bytes of the fetch)."""
        stream = list(self.stub.FetchGlobal(pb.FetchGlobalRequest(worker_id=self.worker_id, min_round=min_round,
                                                                  wait_s=10), timeout=30, metadata=self.session))
        if not stream[0].header.available:
            raise RuntimeError(f"no global state of round >= {min_round} within 10 s")
        return {"base_params_cid": stream[0].header.params_cid,
                "base_bytes_received": sum(message.ByteSize() for message in stream)}

    def refused(self, code: grpc.StatusCode, *args: object, **kwargs: object) -> str:
        """Push, expecting a refusal with ``code``: returns its details (AssertionError otherwise)."""
        try:
            self.push(*args, **kwargs)
        except grpc.RpcError as exc:
            if exc.code() != code:
                raise AssertionError(f"refused with {exc.code().name}, expected {code.name}: {exc.details()}") from exc
            return exc.details()
        raise AssertionError(f"the push was accepted; expected a refusal with {code.name}")

    def heartbeat(self, round_: int, phase: WorkerPhase) -> None:
        self.stub.Heartbeat(pb.HeartbeatRequest(worker_id=self.worker_id, round=round_, phase=phase),
                            timeout=10, metadata=self.session)


class Heartbeats:
    """Mallory's heartbeat thread: ``round`` and ``phase`` every ``interval_s`` until closed (a last
    beat says ``done``, so the coordinator need not wait for mallory at the end of the run)."""

    def __init__(self, m: Mallory, interval_s: float) -> None:
        self.m, self.interval_s = m, interval_s
        self.round, self.phase = 1, WorkerPhase.TRAINING
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mallory-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeats:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.m.heartbeat(self.round, WorkerPhase.DONE)
        except grpc.RpcError:
            pass  # the coordinator may have finished already

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.m.heartbeat(self.round, self.phase)
            except grpc.RpcError:
                pass  # as a worker's beat: the next one says it again


class Trainer:
    """Mallory's honest inner loop: the update an honest worker on its shard would push (with
    ``stages`` > 1, as a worker of that many pipeline stages computes it: trainer.runtime.staged)."""

    def __init__(self, m: Mallory, cluster: LocalCluster, stages: int = 1) -> None:
        cfg = m.config
        self.staged = staged_arithmetic(cfg.model, stages)
        (shard,) = [w.shard for w in cluster.status().workers if w.worker_id == m.worker_id]
        self.shard_index = shard
        self.shard = load_corpus(cfg.data, cfg.seed, cfg.model.block_size).shard(shard, cfg.rounds.expected_workers)
        self.loop = InnerLoop(build_model(cfg.model, cfg.seed), cfg.inner)
        self.m = m
        self.received: dict[str, int] = {}  # wire bytes of the fetch of each base, as a worker reports them
        self.loss = float("nan")
        self.state = FRESH_STATE  # digest of the inner state the last ``train`` started from
        self.state_bytes = b""  # and that state's bytes
        # Where a run that reveals states on challenge finds them: mallory keeps them as a worker does
        # (trainer.worker.retention), so its lies are judged by the replay, not by a missing reveal.
        self.retained = (open_store(cluster.retained_dir(m.worker_id))
                         if cfg.rounds.state_reveal == "on_challenge" else None)
        # With compression on, mallory's error feedback, as a one-process worker keeps it.
        self.compressor = (ErrorFeedbackCompressor(AdaptiveRankPolicy(cfg.compression))
                           if cfg.compression.enabled else None)

    def fetch(self, min_round: int) -> tuple[str, Params]:
        stream = list(self.m.stub.FetchGlobal(pb.FetchGlobalRequest(
            worker_id=self.m.worker_id, min_round=min_round, wait_s=30), timeout=60, metadata=self.m.session))
        header = stream[0].header
        if not (header.available and header.encoding == Encoding.DENSE_F32):
            raise RuntimeError(f"fetch of round >= {min_round}: available {header.available}, "
                               f"encoding {header.encoding} (expected {Encoding.DENSE_F32.name})")
        self.received[header.params_cid] = sum(c.ByteSize() for c in stream)
        return header.params_cid, decode_params(b"".join(c.data for c in stream[1:]))

    def train(self, params: Params, round_: int, steps: int | None = None) -> Params:
        """H inner steps (or ``steps``) from ``params`` on the round's batches of mallory's shard; the
        mean train loss in ``self.loss``, the digest of the inner state it started from in
        ``self.state`` (what a worker's push commits to)."""
        cfg = self.m.config
        batches = round_batches(self.shard, seed=cfg.seed, shard_index=self.shard_index, round_=round_,
                                steps=steps or cfg.inner.steps, batch_size=cfg.inner.batch_size,
                                block_size=cfg.model.block_size)
        errors = {} if self.compressor is None else {f"error.{n}": e for n, e in sorted(self.compressor.errors.items())}
        self.state_bytes = inner_state_bytes(self.loop.state(), errors)  # sent on rounds.state_every's rounds
        self.state = sha256_hex(self.state_bytes)
        if self.retained is not None and self.state != FRESH_STATE:
            self.retained.put(bytes(self.state_bytes))
        result = self.loop.run(params, batches, staged=self.staged)
        self.loss = result.mean_loss
        return result.pseudo_gradient

    def compressed(self, delta: Params) -> dict[str, object]:
        """``delta`` through mallory's compressor (its error feedback moves on): the keyword
        arguments of a compressed ``Mallory.push``."""
        assert self.compressor is not None
        payload, header, _ = self.compressor.compress(delta)
        return {"tensors": delta, "payload": payload, "encoding": Encoding.LOWRANK_INT4,
                "compression_header": canonical_json(header)}

    def update(self, round_: int) -> tuple[str, Params]:
        """The round's base CID and mallory's honest update (its mean train loss in ``self.loss``)."""
        base, params = self.fetch(round_ - 1)
        return base, self.train(params, round_)
