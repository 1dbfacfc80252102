"""``dilocox``: start a coordinator, a worker, or a whole local demo cluster.

    dilocox demo [--set section.field=value ...]   local cluster on the embedded corpus
    dilocox coordinator --run-dir runs/x [--config cfg.json] [--set section.field=value ...]
                        [--host H --port P]        TLS: prints its certificate's fingerprint
    dilocox worker --coordinator H:P --worker-id w0 --tls-fingerprint HEX [--device cuda]
    dilocox status --coordinator H:P --tls-fingerprint HEX [--json [FILE] | --watch [SECONDS]]
                                                   what a running coordinator reports
    dilocox audit --run runs/demo [--json [FILE]]  verify a run's lineage from ledger and store
    dilocox settle --run runs/demo [--claim] [--reclaim]
                                                   what each worker is owed from the run's reward pool
    dilocox settle prove-receipt --run runs/demo --receipts RDIR
                                                   prove on chain a round that left a receipted worker out
    dilocox settle admit-auditor --run runs/demo --auditor-dir ADIR [--threshold K]
                                                   admit a persistent auditor to the run (the disputes owner)
    dilocox settle dispute --run runs/demo --verdicts F1 F2 ...
                                                   send the verdicts k admitted auditors signed
    dilocox chain up|down|deploy|mine ...          a local chain kept in a directory, the contracts on it
    dilocox run create ...                         a run's code measurement allowlisted, its coordinator a verifier
    dilocox run hand-over ...                      the run's creator hands it to another coordinator (--take-over)
    dilocox pool fund ...                          the run's reward pool opened and funded
    dilocox bench gas                              gas of the ledger's calls on a local chain
    dilocox bench ablation [--smoke]               the DiLoCoX ablation: loss, bytes, tokens/s per mode
    dilocox bench flood [--side worker]            honest rounds/min, health and coordinator RSS under each attack
    dilocox bench robust [--quick]                 one dishonest worker against each aggregation setting
    dilocox bench overlap                          synchronous vs overlapped rounds at two outer momenta
    dilocox bench scale [--smoke]                  a round's cost split by phase, RSS, store vs wire bytes
    dilocox config [--demo] [--model-config PATH/config.json | --init-from DIR] [--set ...] > cfg.json
                                                   the run configuration, to edit
    dilocox export --run DIR --round N OUT/       a round's checkpoint as a Hugging Face folder
    dilocox data prepare INPUT... --out DIR [--tokenizer byte|bpe|FILE] [--shards N]
                                                   tokenize a corpus once into token shards
    dilocox plot --run DIR [--out FILE.png]        loss, bytes and round time per round, as a PNG

Every run setting can be given as ``--set section.field=value`` (repeatable; ``dilocox config``
prints the sections and fields, ``dilocox config --help`` lists each with its accepted values). Each subcommand imports what it needs only when it runs.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from rich.logging import RichHandler

from storage_client import DilocoxError
from trainer.progress import PLAIN_LOG_FORMAT, use_console

# gRPC's C core writes connection-level lines (a GOAWAY when an idle connection is closed, say) to
# stderr at INFO; read before grpc is first imported, which the subcommands do.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

# Blocks a recorded round waits before its rewards can be claimed (about a day of 12 s blocks): time
# for an auditor to re-check the round, and for a revocation, before anyone is paid for it.
DEFAULT_CHALLENGE_WINDOW = 7200
# The demo's training stops after this long (--time-limit): a stuck demo ends; a slow machine asks for more.
DEMO_TIME_LIMIT_S = 600.0


def _logging(verbose: bool) -> None:
    handler: logging.Handler
    if sys.stderr.isatty():
        from rich.console import Console

        # Logs go to stderr, never stdout: stdout carries `--json` documents.
        handler = RichHandler(console=Console(stderr=True), show_path=False, rich_tracebacks=False)
        fmt = "%(name)s: %(message)s"
    else:  # log files and pipes: plain, timestamped, one line per record
        handler = logging.StreamHandler()
        fmt = PLAIN_LOG_FORMAT
    handler.setFormatter(logging.Formatter(fmt))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler], force=True)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` as people expect it: each option's default after its help (unless the help says
    it already), the descriptions as written. Flags (default False) and options with no default
    (None: "not given") show none. An epilog may be a function returning the text, called only
    when the help is shown (so that parsing a command line imports nothing heavy)."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(text() if callable(text) else text)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default == [] or default is argparse.SUPPRESS
                or "default" in text or "%(default)" in text or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def _stages_arg(text: str) -> int | None:
    """``--stages``: ``auto`` (None) or a positive count."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number of stages, got {text[:20]!r}") from None


def _threads(n: int) -> None:
    import torch

    torch.set_num_threads(max(1, n))


def cmd_coordinator(args: argparse.Namespace) -> int:
    from trainer.config import RunConfig

    config = RunConfig.load(args.config) if args.config else None
    if args.set:  # on the given config, or on the defaults (a resumed run refuses a different one)
        config = (config or RunConfig()).with_settings(args.set)
    from trainer.coordinator.server import serve  # torch: after a bad setting has been refused
    from trainer.runstore.run_dir import RunDir

    _threads(args.threads)
    run_dir = RunDir(args.run_dir)
    credentials, gateway_tls = _server_credentials(args, run_dir)
    settings = _trust_settings(args)
    if args.take_over:
        _take_over(args.take_over, run_dir, settings)
    trust = None
    if settings is not None:
        from settlement.ledger_trust import open_trust

        trust = functools.partial(open_trust, settings)
    return serve(run_dir, config, host=args.host, port=args.port, linger_s=args.linger, trust=trust,
                 credentials=credentials, idle_s=args.idle_timeout,
                 store_port=None if args.no_store_gateway else args.store_port, gateway_tls=gateway_tls)


def _take_over(run_id_hex: str, run_dir, settings) -> None:  # RunDir, TrustSettings | None
    """--take-over: ``run_dir`` (filled by ``dilocox mirror``) made to resume the run the chain names
    this account the coordinator of (settlement.takeover)."""
    from settlement import Chain, Ledger
    from settlement.takeover import take_over
    from storage_client import unhex32

    run_id = unhex32(run_id_hex, "--take-over")  # and the ledger flags given: check_args
    dep = settings.deployment
    ledger = Ledger(Chain(settings.rpc_url, settings.private_key), dep.ledger, from_block=dep.deployed_block)
    last = take_over(run_dir, ledger, run_id)
    logging.getLogger("dilocox").info("run 0x%s…: %s is its coordinator on the ledger; taken over at round %d, the "
                                      "last the ledger had recorded", run_id.hex()[:16], ledger.chain.address, last)


def _server_credentials(args: argparse.Namespace, run_dir):  # -> (grpc.ServerCredentials, ssl.SSLContext) | (None, None)
    """TLS by default (the given pair, or a self-signed one in <run>/tls), for the gRPC port and the
    store gateway alike; (None, None) only with --insecure."""
    if args.insecure:
        if args.tls_cert or args.tls_key or args.tls_client_ca:
            raise ValueError("--insecure contradicts --tls-cert/--tls-key/--tls-client-ca")
        logging.getLogger("dilocox").warning(
            "INSECURE: serving plaintext gRPC (--insecure): anyone on the path can read and change "
            "every message; use it on a trusted loopback only")
        return None, None
    from trainer.net.tls import gateway_server_tls, server_credentials, server_identity

    hosts = [args.host] if args.host not in ("0.0.0.0", "::", "") else []
    identity = server_identity(run_dir.path / "tls", args.tls_cert, args.tls_key, hosts=hosts)
    return server_credentials(identity, args.tls_client_ca), gateway_server_tls(identity, args.tls_client_ca)


def _client_tls(args: argparse.Namespace):  # -> trainer.net.tls.ClientTls
    from trainer.net.tls import client_tls_from_flags

    return client_tls_from_flags(args.tls_ca, args.tls_fingerprint, args.insecure,
                                 args.tls_client_cert, args.tls_client_key)


def _client_tls_arguments(p: argparse.ArgumentParser) -> None:
    """How a client trusts the coordinator: exactly one of --tls-ca, --tls-fingerprint, --insecure."""
    p.add_argument("--tls-ca", help="CA certificate (PEM) that issued the coordinator's certificate")
    p.add_argument("--tls-fingerprint", metavar="HEX",
                   help="SHA-256 fingerprint of the coordinator's certificate, as it prints at start-up")
    p.add_argument("--insecure", action="store_true",
                   help="plaintext gRPC, no server identity (only against a coordinator started with --insecure)")
    p.add_argument("--tls-client-cert", help="client certificate (PEM) for a coordinator that requires mutual TLS")
    p.add_argument("--tls-client-key", help="key of --tls-client-cert")


def _trust_settings(args: argparse.Namespace):  # -> TrustSettings | None
    """The ledger a coordinator records to, from --ledger/--chain-rpc/--chain-key-file."""
    given = [args.ledger, args.chain_rpc, args.chain_key_file]
    if not any(given):
        return None
    if not all(given):
        missing = [flag for flag, value in zip(("--ledger", "--chain-rpc", "--chain-key-file"), given) if not value]
        raise UsageError(f"--ledger, --chain-rpc and --chain-key-file go together: {', '.join(missing)} missing")
    from attestation import Policy
    from audit.cli import dcap_settings
    from settlement import Deployment
    from settlement.gate import TrustSettings
    from settlement.provision import KeyFileError, read_key_file

    try:
        private_key = read_key_file(Path(args.chain_key_file), "--chain-key-file")
    except KeyFileError as exc:
        raise UsageError(str(exc)) from None
    dcap = dcap_settings(args.dcap_collateral, args.pccs_url, args.allow_tcb_status)
    if dcap.source is None:
        logging.getLogger("dilocox").warning(
            "no --dcap-collateral or --pccs-url: TDX quotes cannot be verified, so TDX workers are refused")
    policy = Policy(allow_dev=args.allow_dev, dev_roots=frozenset(args.dev_root), dcap=dcap)
    return TrustSettings(rpc_url=args.chain_rpc, private_key=private_key,
                         deployment=Deployment.load(args.ledger), policy=policy,
                         report_timeout_s=args.report_timeout, verification_time=args.attestation_time,
                         confirmations=args.confirmations, challenge_window=args.challenge_window)


def cmd_worker(args: argparse.Namespace) -> int:
    from trainer.worker import Worker

    # Threads are planned with the stages, at the first join (trainer.runtime.pipeline.plan_stages).
    provider = None
    if args.attestation != "none":
        from attestation import open_provider

        provider = open_provider(args.attestation, dev_root_dir=args.dev_root_dir)
    from trainer.net.link import Link

    link = Link(bandwidth_bps=args.link_bandwidth * 1e6, latency_s=args.link_latency / 1e3)
    worker = Worker(args.coordinator, args.worker_id, tls=_client_tls(args), attestation=provider,
                    reconnect_timeout_s=args.reconnect_timeout, link=link,
                    metrics=Path(args.metrics) if args.metrics else None, stages=args.stages, cores=args.cores,
                    threads=args.threads, device=args.device, receipts=Path(args.receipts) if args.receipts else None,
                    data_parallel=args.data_parallel, store_sources=tuple(args.store_source),
                    successors=_successors(args), retain=Path(args.retain) if args.retain else None,
                    reveal_address=None if args.reveal_port < 0 else (args.reveal_host, args.reveal_port))
    return _exit_now(worker.run())


def _successors(args: argparse.Namespace):  # -> trainer.worker.succession.Successors
    """--successor H:P, each with its --successor-fingerprint in order (or the --tls-ca / --insecure
    the first coordinator is trusted with), and --chain-rpc to ask whether one is the run's."""
    from trainer.net.tls import client_tls_from_flags
    from trainer.worker.succession import Endpoint, Successors

    fingerprints = args.successor_fingerprint or []  # as many as --successor, or none (check_args)
    endpoints = [Endpoint(address, client_tls_from_flags(args.tls_ca, fingerprint, args.insecure,
                                                         args.tls_client_cert, args.tls_client_key))
                 for address, fingerprint in zip(args.successor or [],
                                                 fingerprints or [None] * len(args.successor or []), strict=True)]
    return Successors(tuple(endpoints), _run_coordinator_check(args.chain_rpc) if args.chain_rpc else None)


def _run_coordinator_check(rpc_url: str):  # -> trainer.worker.succession.RunCoordinatorCheck
    """Who the ledger of a worker's pinned domain, on the chain at ``rpc_url``, names as a run's
    coordinator now: asked before the worker trusts a successor."""
    def check(domain, run_digest: bytes, address: str) -> str | None:  # (Domain, bytes, str)
        from settlement import Chain, Ledger

        chain = Chain(rpc_url, os.urandom(32), retries=2)  # a throwaway account: the check only reads
        if chain.chain_id != domain.chain_id:
            raise ValueError(f"--chain-rpc {rpc_url} is chain {chain.chain_id}, but the run's reports are signed "
                             f"for chain {domain.chain_id}")
        run = Ledger(chain, domain.ledger).run_of(run_digest)
        return None if run is None else run.coordinator

    return check


def _exit_now(code: int) -> int:
    """A finished worker leaves with its own code (trainer.runtime.pipeline.leave says why): its threads are
    joined, its channel and stage processes closed and its files written by now."""
    from trainer.runtime.pipeline import leave

    leave(code)


def cmd_status(args: argparse.Namespace) -> int:
    if args.watch is not None:
        return _watch_status(args)
    status = _fetch_status(args)
    if args.json is not None:
        _write_json(message_json(status), args.json)
    if args.json != JSON_STDOUT:
        _print_status(status)
    return 0


def _fetch_status(args: argparse.Namespace):  # -> pb.StatusResponse
    """The coordinator's Status; ConnectionError naming it when it does not answer."""
    import grpc

    from proto import CHANNEL_OPTIONS, pb, pb_grpc
    from trainer.net.tls import open_channel

    with open_channel(args.coordinator, _client_tls(args), CHANNEL_OPTIONS) as channel:
        try:
            return pb_grpc.CoordinatorStub(channel).Status(pb.StatusRequest(), timeout=10)
        except grpc.RpcError as exc:
            detail = (exc.details() or "").splitlines()[0][:300] if hasattr(exc, "details") else ""
            code = exc.code().name if hasattr(exc, "code") and exc.code() is not None else "error"
            raise ConnectionError(f"--coordinator {args.coordinator}: no answer from a coordinator "
                                  f"({code}: {detail})") from None


def _watch_status(args: argparse.Namespace) -> int:
    """``status --watch S``: the tables again every S seconds until interrupted (Ctrl-C: exit 0). On
    a terminal they are redrawn in place; piped, each refresh follows the last under a time line. A
    coordinator that does not answer is said in one line, and asked again at the next refresh."""
    import time

    from rich.console import Console, Group
    from rich.live import Live
    from rich.markup import escape

    console = Console()
    live = Live(console=console, auto_refresh=False) if console.is_terminal else None
    try:
        if live is not None:
            live.start()
        while True:
            try:
                shown = Group(*_status_tables(_fetch_status(args)))
            except (ConnectionError, OSError, ValueError) as exc:  # TlsError is a ValueError
                shown = Group(f"[red]{escape(' '.join(str(exc).split())[:500])}[/]")
            stamp = time.strftime("%H:%M:%S")
            if live is not None:
                live.update(Group(f"{stamp}, every {args.watch:g}s (Ctrl-C to stop)", shown), refresh=True)
            else:
                console.print(f"--- {stamp}")
                console.print(shown)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    finally:
        if live is not None:
            live.stop()


JSON_STDOUT = "-"  # ``--json`` without a FILE: the document goes to stdout, alone
DEFAULT_WATCH_S = 2.0  # ``status --watch`` alone: seconds between refreshes


def message_json(message) -> dict:  # message: a protobuf Message
    """A protobuf message as the JSON a person or a script expects: every field under its proto
    name (zero values included), integers as numbers (protobuf's JSON mapping writes 64-bit ones as
    strings), enums by name, bytes as hex, and a non-finite double as null (strict JSON has no NaN)."""
    import math

    from google.protobuf.descriptor import FieldDescriptor

    def value(field, v):
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            return message_json(v)
        if field.type == FieldDescriptor.TYPE_ENUM:
            known = field.enum_type.values_by_number.get(v)
            return known.name if known is not None else v
        if field.type == FieldDescriptor.TYPE_BYTES:
            return v.hex()
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return v

    out: dict = {}
    for field in message.DESCRIPTOR.fields:
        v = getattr(message, field.name)
        repeated = getattr(field, "is_repeated", None)
        repeated = repeated if repeated is not None else field.label == FieldDescriptor.LABEL_REPEATED
        out[field.name] = [value(field, x) for x in v] if repeated else value(field, v)
    return out


def _write_json(doc: dict, where: str) -> None:
    from storage_client import strict_json, write_atomic

    text = strict_json(doc, indent=2) + "\n"
    if where == JSON_STDOUT:
        sys.stdout.write(text)
    else:
        write_atomic(Path(where), text.encode())


def _print_status(status) -> None:  # status: pb.StatusResponse
    from rich.console import Console

    console = Console()
    for shown in _status_tables(status):
        console.print(shown)


def _status_tables(status) -> list:  # status: pb.StatusResponse; -> the run line and two rich Tables
    from rich.markup import escape
    from rich.table import Table

    from proto import WorkerPhase

    head = (f"run [bold]{escape(status.run_id)}[/]: open round {status.open_round} of {status.total_rounds}"
            f"{' (finished)' if status.finished else ''}; ledger lag {status.ledger_lag_rounds} round(s)"
            + (f"; store gateway on port {status.store_port}, {status.store_bytes_served:,} bytes served"
               if status.store_port else ""))
    workers = Table(title="workers")
    for column in ("worker", "address", "shard", "alive", "round", "phase", "last seen"):
        workers.add_column(column)
    for w in status.workers:
        phase = WorkerPhase(w.phase).label if w.phase in iter(WorkerPhase) else str(w.phase)
        workers.add_row(escape(w.worker_id), escape(w.address) or "—", str(w.shard), "yes" if w.alive else "no",
                        str(w.round), phase, f"{w.last_seen_s:.1f}s ago" if w.last_seen_s >= 0 else "—")
    rounds = Table(title="rounds")
    for column in ("round", "eval loss", "participants", "dropped", "bytes up", "bytes down"):
        rounds.add_column(column)
    for r in status.rounds:
        rounds.add_row(str(r.round), f"{r.eval_loss:.4f}", ", ".join(r.participants) or "—",
                       ", ".join(r.dropped) or "—", str(r.bytes_up), str(r.bytes_down))
    return [head, workers, rounds]


def cmd_config(args: argparse.Namespace) -> int:
    from storage_client import strict_json
    from trainer.config import RunConfig, demo_config

    base = demo_config() if args.demo else RunConfig()
    if args.diloco:
        base = base.plain_diloco()
    if args.model_config and args.init_from:
        raise UsageError("--init-from DIR takes the model section from DIR/config.json: give it or --model-config")
    if args.model_config or args.init_from:
        from trainer.model.hf import read_hf_config
        from trainer.model.init_weights import pin_init

        body = base.to_json()
        body["model"] = read_hf_config(args.model_config or args.init_from)
        if args.init_from:  # the weights beside it are θ⁽⁰⁾, pinned by their CID (trainer.model.init_weights)
            body["model"]["init_from"] = str(Path(args.init_from).resolve())
        config, _ = pin_init(RunConfig.from_json_with_settings(body, args.set))
    else:
        config = base.with_settings(args.set)
    print(strict_json(config.to_json(), indent=2, sort_keys=True))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from cli.demo import run_demo

    return run_demo(Path(args.run_dir), workers=args.workers, settings=args.set, insecure=args.insecure,
                    diloco=args.diloco, time_limit_s=args.time_limit, report_timeout_s=args.report_timeout)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "ablation":
        from benchmarks.ablation import run, run_sweep, settings_of

        (run_sweep if args.sweep else run)(settings_of(args))
        return 0
    if args.what == "flood":
        from benchmarks.flood import main as flood

        flood(args)
        return 0
    if args.what == "overlap":
        from benchmarks.overlap_momentum import main as overlap

        overlap(args)
        return 0
    if args.what == "scale":
        import shlex

        from benchmarks.scale import run as scale
        from benchmarks.scale import settings_of as scale_settings

        scale(scale_settings(args), shlex.join(["dilocox", *sys.argv[1:]]))
        return 0
    if args.what == "robust":
        import shlex

        from benchmarks.robustness import run as robust
        from benchmarks.robustness import settings_of as robust_settings

        robust(robust_settings(args), shlex.join(["dilocox", *sys.argv[1:]]))
        return 0
    from settlement.gas import format_markdown, gas_table

    rows = gas_table()
    print("Gas of the registry's, ledger's and reward pool's calls on a fresh local anvil (1.7.1, chain 31337); "
          "contracts from solc-js 0.8.28, optimizer 100,000 runs. Reports are signed by fresh random keys, "
          "so per-report figures move by a few dozen gas between runs (calldata zero bytes).\n")
    print(format_markdown(rows))
    return 0


# ------------------------------------------------------------------------------- arguments


def _set_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="a run setting (repeatable), e.g. --set rounds.overlap=true --set inner.lr=3e-4; "
                        "`dilocox config --help` lists every field with its default and accepted values")


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default="runs/demo", help="replaced if it holds an earlier demo run")
    p.add_argument("--workers", type=int, default=2, help="worker processes (and the run's expected workers)")
    _diloco_argument(p)
    _set_argument(p)
    p.add_argument("--insecure", action="store_true",
                   help="plaintext gRPC between the demo's processes (to measure what TLS costs)")
    p.add_argument("--time-limit", type=float, default=DEMO_TIME_LIMIT_S, metavar="SECONDS",
                   help="stop the demo if its training has not finished by then")
    p.add_argument("--report-timeout", type=float, default=None, metavar="SECONDS",
                   help="the coordinator's --report-timeout (default: the coordinator's)")


def _coordinator_arguments(p: argparse.ArgumentParser) -> None:
    from audit.cli import add_dcap_arguments

    p.add_argument("--run-dir", required=True, help="store, manifests and HEAD of the run")
    p.add_argument("--config", help="run configuration JSON (default: `dilocox config`'s; optional to resume)")
    _set_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (see <run-dir>/coordinator.addr)")
    p.add_argument("--store-port", type=int, default=0,
                   help="port of the run's store served as an IPFS trustless gateway with the same TLS "
                        "(workers fetch the global state by CID from it; 0 picks a free port, shown by `dilocox status`)")
    p.add_argument("--no-store-gateway", action="store_true", help="serve no store gateway")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--linger", type=float, default=10.0, help="seconds to let workers see the end of the run")
    p.add_argument("--ledger", help="deployment.json of the registry and ledger to record to")
    p.add_argument("--chain-rpc", help="RPC URL of the chain holding the ledger")
    p.add_argument("--chain-key-file", help="file with the coordinator's chain key (hex); never logged")
    p.add_argument("--take-over", metavar="RUN_ID",
                   help="resume a run another coordinator started, once the ledger names this account its "
                        "coordinator (`dilocox run hand-over`): --run-dir filled by `dilocox mirror`, checked "
                        "against the chain's last recorded round")
    p.add_argument("--allow-dev", action="store_true",
                   help="accept dev attestation, which PROVES NOTHING (local development only)")
    p.add_argument("--dev-root", action="append", default=[], help="address of a trusted dev root (repeatable)")
    p.add_argument("--report-timeout", type=float, default=30.0,
                   help="seconds, from a round's publication, to wait for every participant's report before "
                        "recording the round (its unreported updates then on the coordinator's word, credited "
                        "to nobody)")
    p.add_argument("--challenge-window", type=int, default=DEFAULT_CHALLENGE_WINDOW, metavar="BLOCKS",
                   help="blocks a recorded round waits before its rewards can be claimed, set when the run is "
                        f"created on the ledger (default {DEFAULT_CHALLENGE_WINDOW}, about a day of 12 s blocks)")
    p.add_argument("--confirmations", type=int, default=1,
                   help="blocks deep a round must be on the ledger before its outbox copy is set aside "
                        "(1: in a block; a chain that mines only on transactions never goes deeper)")
    add_dcap_arguments(p)
    p.add_argument("--attestation-time", type=int, metavar="UNIX_SECONDS",
                   help="verify evidence as of this time instead of now (tests and replays of old collateral)")
    p.add_argument("--tls-cert", help="certificate (PEM) to serve with; default: a self-signed one in <run-dir>/tls")
    p.add_argument("--tls-key", help="key of --tls-cert (PEM)")
    p.add_argument("--tls-client-ca", help="require mutual TLS: worker certificates must be issued by this CA (PEM)")
    p.add_argument("--insecure", action="store_true",
                   help="serve plaintext gRPC (no TLS): only for a trusted loopback; workers need --insecure too")
    p.add_argument("--idle-timeout", type=float, default=30.0,
                   help="seconds a call may wait for its request (10 at most), a stream go without a "
                        "message, and a stream moving data fall behind 256 KiB/s before it is ended")


def _worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", required=True, help="host:port")
    p.add_argument("--worker-id", required=True, help="this worker's name in the run ([A-Za-z0-9._-], 1-64)")
    _client_tls_arguments(p)
    p.add_argument("--cores", type=int, default=None,
                   help="cores this worker may use (default: the cores this process may run on); the stages and "
                        "torch threads are planned on them (trainer.runtime.pipeline.plan_stages)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads to share among the stages instead of --cores (default: the cores)")
    p.add_argument("--attestation", choices=("none", "tdx", "dev"), default="none",
                   help="evidence provider: tdx (configfs-tsm) or dev (a stand-in that PROVES NOTHING)")
    p.add_argument("--dev-root-dir", help="directory of the dev attestation root key")
    p.add_argument("--link-bandwidth", type=float, default=0.0,
                   help="emulate a link of this many Mbit/s on the bytes actually sent and received (0: off)")
    p.add_argument("--link-latency", type=float, default=0.0, help="emulated latency per RPC, in ms")
    p.add_argument("--metrics", help="append a JSON line per round (tokens, compute seconds, bytes each way) "
                                     "and one at the end (wall and compute seconds) to this file")
    p.add_argument("--reconnect-timeout", type=float, default=120.0,
                   help="seconds to keep retrying an unreachable coordinator (then the next --successor)")
    p.add_argument("--successor", action="append", metavar="H:P",
                   help="a coordinator to move to when the one served stays unreachable (repeatable: tried in "
                        "order); trusted only once the ledger names its key the run's coordinator (--chain-rpc)")
    p.add_argument("--successor-fingerprint", action="append", metavar="HEX",
                   help="SHA-256 fingerprint of each --successor's certificate, in the same order")
    p.add_argument("--chain-rpc", metavar="URL",
                   help="the chain whose ledger the run's reports are signed for: asked whether a successor is "
                        "the run's coordinator")
    p.add_argument("--receipts", metavar="DIR",
                   help="where the coordinator's signed receipts of this worker's counted updates and taken reports "
                        "are kept, for `dilocox settle prove-receipt` (default: receipts/WORKER_ID)")
    p.add_argument("--retain", metavar="DIR",
                   help="where the committed inner states of the last rounds.reveal_rounds rounds are kept to "
                        "reveal when an auditor challenges one, in a run that reveals them on challenge "
                        "(default: retained/WORKER_ID; serve it after the run with `dilocox store serve --run DIR`)")
    p.add_argument("--reveal-host", default="127.0.0.1",
                   help="address the kept states are served on by CID (a trustless gateway; default 127.0.0.1)")
    p.add_argument("--reveal-port", type=int, default=0, metavar="P",
                   help="port of that gateway (default 0: any free one, written to DIR/gateway.url; -1: none)")
    p.add_argument("--stages", type=_stages_arg, default=None, metavar="auto|P",
                   help="pipeline stages: P local processes, each holding a contiguous slice of layers "
                        "(torch.distributed gloo on CPU), with max(1, cores // P) torch threads each; auto "
                        "(default): 2 when the model has 2+ layers and the worker 2+ cores, else 1")
    p.add_argument("--data-parallel", type=int, default=1, metavar="N",
                   help="N data-parallel replicas of the worker's stages (trainer.runtime.island): N x P local "
                        "processes, each replica training on its slice of every batch, gradients averaged in "
                        "rank order; one identity, attestation and update to the coordinator (default 1)")
    p.add_argument("--store-source", action="append", default=[], metavar="URL",
                   help="a trustless gateway (a mirror, a peer) to fetch the global state from by CID, verified "
                        "block by block (repeatable, tried in order, the coordinator's own gateway last); "
                        "without it the state comes over gRPC")
    p.add_argument("--device", default="cpu",
                   help="where the inner loop runs: cpu, cuda or cuda:N (bf16 autocast on CUDA; pipeline stages "
                        "then each on their own GPU over NCCL); what is sent and checked stays on the CPU")


def _status_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", required=True, help="host:port")
    _client_tls_arguments(p)
    p.add_argument("--json", nargs="?", const=JSON_STDOUT, metavar="FILE",
                   help="write the status as JSON to FILE; --json alone (or --json -) writes it to stdout, alone")
    p.add_argument("--watch", nargs="?", type=float, const=DEFAULT_WATCH_S, metavar="SECONDS",
                   help=f"show the tables again every SECONDS (default {DEFAULT_WATCH_S:g}) until Ctrl-C")


def cmd_gc(args: argparse.Namespace) -> int:
    from cli.gc import run

    return run(args)


def _diloco_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--diloco", action="store_true",
                   help="plain DiLoCo instead of DiLoCoX: dense fp32 updates, synchronous rounds, DiLoCo's outer "
                        "step (RunConfig.plain_diloco); --set applies after it")


def _config_fields_help() -> str:
    """The epilog of ``dilocox config --help``: every field, from its declaration (trainer.config)."""
    from trainer.config import fields_help

    return "settings (--set section.field=value), with RunConfig()'s defaults:\n" + fields_help()


def _config_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = _config_fields_help  # type: ignore[assignment]  # a function: HelpFormatter calls it
    p.add_argument("--demo", action="store_true", help="the demo's configuration")
    _diloco_argument(p)
    p.add_argument("--model-config", metavar="PATH",
                   help="a Hugging Face config.json (or its folder; llama or qwen2) as the model section: its "
                        "sizes, context, RoPE (base and scaling), tied embeddings, attention biases and head_dim; "
                        "lower the context with --set model.block_size=N")
    p.add_argument("--init-from", metavar="DIR",
                   help="start the run from existing weights: a Hugging Face folder (config.json and "
                        "model.safetensors; llama, qwen2, or a GPT-2 folder of `dilocox export`); its config.json "
                        "is the model section and its weights are θ(0), pinned in the config by their CID")
    _set_argument(p)


# name: (help, the module defining its arguments and description, or None)
BENCHES: dict[str, tuple[str, str | None]] = {
    "gas": ("the ledger's gas per call on a local anvil", None),
    "ablation": ("DiLoCoX ablation: held-out loss, bytes/token, tokens/s per mode", "benchmarks.ablation"),
    "flood": ("honest rounds/min, health latency and coordinator resources under each attack "
              "(--side worker: a worker against a hostile coordinator)", "benchmarks.flood"),
    "robust": ("one admitted dishonest worker against each aggregation setting", "benchmarks.robustness"),
    "overlap": ("synchronous rounds against the one-step-delay overlap at two outer momenta",
                "benchmarks.overlap_momentum"),
    "scale": ("a round's cost by phase, peak RSS, store against wire bytes at three model sizes",
              "benchmarks.scale"),
}


def _bench_arguments(p: argparse.ArgumentParser, rest: Sequence[str]) -> None:
    import importlib

    bench = p.add_subparsers(dest="what", required=True)
    chosen = _chosen(rest)
    for name, (help_, module_name) in BENCHES.items():
        if name != chosen or module_name is None:
            bench.add_parser(name, help=help_)
            continue
        module = importlib.import_module(module_name)  # argument definitions only: torch loads in cmd_bench
        module.add_arguments(bench.add_parser(name, help=help_, description=module.__doc__,
                                              formatter_class=HelpFormatter))


def _lazy(module: str, name: str) -> Callable:
    """``module.name``, imported only when called: a subcommand's arguments and code load only when it
    is the one asked for."""
    def call(*args: object) -> object:
        import importlib

        return getattr(importlib.import_module(module), name)(*args)

    return call


# name: (help, its arguments, what runs it); a subcommand's arguments are defined only when it is chosen.
COMMANDS: dict[str, tuple[str, Callable[..., None], Callable[[argparse.Namespace], int]]] = {
    "demo": ("run a coordinator and workers locally on the embedded corpus", _demo_arguments, cmd_demo),
    "coordinator": ("serve a run: collect updates, aggregate, store checkpoints", _coordinator_arguments,
                    cmd_coordinator),
    "worker": ("train on one data shard and push pseudo-gradients", _worker_arguments, cmd_worker),
    "status": ("what a running coordinator reports (a table; --json for JSON)", _status_arguments, cmd_status),
    "audit": ("verify a run's lineage from the ledger and the store alone",
              _lazy("audit.cli", "add_arguments"), _lazy("audit.cli", "run")),
    "settle": ("what each worker of a run is owed from its reward pool; --claim pays it",
               _lazy("cli.settle", "add_arguments"), _lazy("cli.settle", "run")),
    "chain": ("a local chain kept in a directory (up, down, mine); the contracts deployed on a chain (deploy)",
              _lazy("cli.chain", "chain_arguments"), _lazy("cli.chain", "run")),
    "run": ("run create: allow a run configuration on the registry, its coordinator a verifier; run hand-over: "
            "its creator hands the run to another coordinator",
            _lazy("cli.chain", "run_arguments"), _lazy("cli.chain", "run")),
    "pool": ("pool fund: open and fund a run's reward pool", _lazy("cli.chain", "pool_arguments"),
             _lazy("cli.chain", "run")),
    "bench": ("benchmarks", _bench_arguments, cmd_bench),
    "store": ("store serve: a run's store as an IPFS trustless gateway; store car: a round as a CARv1",
              _lazy("cli.store", "add_arguments"), _lazy("cli.store", "run")),
    "mirror": ("copy a run's store from gateways, verified and incrementally", _lazy("cli.mirror", "add_arguments"),
               _lazy("cli.mirror", "run")),
    "gc": ("remove store objects the run no longer references (--dry-run: count them)",
           _lazy("cli.gc", "add_arguments"), cmd_gc),
    "config": ("print a run configuration to start from", _config_arguments, cmd_config),
    "export": ("a round's checkpoint as a Hugging Face folder", _lazy("cli.export", "add_arguments"),
               _lazy("cli.export", "run")),
    "plot": ("a run's loss, bytes and round time per round as a PNG (from rounds.jsonl)",
             _lazy("cli.plot", "add_arguments"), _lazy("cli.plot", "run")),
    "data": ("data prepare: tokenize a corpus once into token shards", _lazy("cli.data", "add_arguments"),
             _lazy("cli.data", "run")),
}


def _chosen(argv: Sequence[str]) -> str | None:
    """The first word of ``argv`` that is not an option: the subcommand being asked for."""
    return next((word for word in argv if not word.startswith("-")), None)


def parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The command line; only the subcommand named in ``argv`` gets its arguments (and imports)."""
    p = argparse.ArgumentParser(prog="dilocox", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    chosen = _chosen(argv)
    for name, (help_, arguments, run) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_, formatter_class=HelpFormatter)
        sp.set_defaults(func=run)
        if name != chosen:
            continue
        if name == "bench":
            arguments(sp, list(argv)[list(argv).index(name) + 1:])
        else:
            arguments(sp)
    return p


# Long-running processes show their progress in their logs; every other command on its console
# (trainer.progress: a bar on a terminal, lines on stderr when piped).
LOGGED_PROGRESS = ("worker", "coordinator")


class UsageError(DilocoxError, ValueError):
    """Command-line arguments that cannot work together or are out of range (exit status 2)."""


MAX_DEMO_WORKERS = 1024  # = the run configuration's bound on rounds.expected_workers


def _port(value: int, flag: str, lowest: int) -> None:
    if not lowest <= value <= 65535:
        raise UsageError(f"{flag} {value} is out of range: must be in [{lowest}, 65535]")


def _coordinator_address(address: str, flag: str = "--coordinator") -> None:
    """--coordinator (or ``flag``) must be host:port with a port in [1, 65535] and a host that resolves."""
    import socket

    from trainer.net.tls import TlsError, split_address

    try:
        host, port = split_address(address)
    except TlsError:
        raise UsageError(f"{flag} {address[:200]!r} is not host:port (port in [1, 65535]; "
                         f"IPv6 as [addr]:port)") from None
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise UsageError(f"{flag} {address[:200]}: cannot resolve host {host[:200]!r} "
                         f"({getattr(exc, 'strerror', None) or exc})") from None


def _store_sources(urls: Sequence[str]) -> None:
    """--store-source: at most MAX_STORE_SOURCES gateway URLs, each http(s)://host[:port][/path]."""
    if not urls:
        return
    from storage_client import StoreError
    from storage_client.remote import check_source_url
    from trainer.worker.cid_fetch import MAX_STORE_SOURCES

    if len(urls) > MAX_STORE_SOURCES:
        raise UsageError(f"--store-source given {len(urls)} times, more than {MAX_STORE_SOURCES}")
    for url in urls:
        try:
            check_source_url(url)
        except StoreError as exc:
            raise UsageError(f"--store-source: {exc}") from None


def _successor_arguments(successors: list[str], fingerprints: list[str], tls_fingerprint: str | None) -> None:
    """Each --successor is host:port with its own --successor-fingerprint, in order (none: --tls-ca or
    --insecure trust them all as they trust the first)."""
    for address in successors:
        _coordinator_address(address, "--successor")
    if fingerprints and len(fingerprints) != len(successors):
        raise UsageError(f"{len(fingerprints)} --successor-fingerprint for {len(successors)} --successor: give one "
                         f"per successor, in the same order, or none (with --tls-ca or --insecure)")
    if successors and not fingerprints and tls_fingerprint:
        raise UsageError("--successor needs its own --successor-fingerprint: the first coordinator's "
                         "--tls-fingerprint pins its certificate only")


def _take_over_arguments(run_id_hex: str, ledger_given: bool) -> None:
    """--take-over names a run id, and goes with the ledger flags (the chain says whose run it is)."""
    from storage_client import unhex32

    if not ledger_given:
        raise UsageError("--take-over needs --ledger, --chain-rpc and --chain-key-file: the chain says whose run "
                         "it is and how far it got")
    try:
        unhex32(run_id_hex, "--take-over")
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _warn_oversubscribed(cores: int | None, threads: int | None) -> None:
    """More cores or threads than this process may run on is allowed (a benchmark may want it) but
    never silent: every stage and thread then shares a core with another."""
    from trainer.runtime.procgroup import available_cpus  # the worker loads torch next anyway

    have = available_cpus()
    for flag, value in (("--cores", cores), ("--threads", threads)):
        if value is not None and value > have:
            logging.getLogger("dilocox").warning(
                "%s %d but this process may run on %d core(s): the worker's stages and threads will "
                "oversubscribe them and run slower, not faster", flag, value, have)


def check_args(args: argparse.Namespace) -> None:
    """Refuse out-of-range and contradictory arguments before anything starts, with one line each
    naming the flag (argparse checks only types)."""
    command = args.command
    if command == "demo":
        if not 1 <= args.workers <= MAX_DEMO_WORKERS:
            raise UsageError(f"--workers {args.workers} is out of range: must be in [1, {MAX_DEMO_WORKERS}]")
        if not 1 <= args.time_limit <= 7 * 86_400:  # also refuses NaN
            raise UsageError(f"--time-limit {args.time_limit} is out of range: must be in [1, 604800] seconds")
        if args.report_timeout is not None and not 0 <= args.report_timeout <= 86_400:
            raise UsageError(f"--report-timeout {args.report_timeout} is out of range: must be in [0, 86400] seconds")
    if command == "coordinator":
        _port(args.port, "--port", 0)
        _port(args.store_port, "--store-port", 0)
        given = [args.ledger, args.chain_rpc, args.chain_key_file]
        if any(given) and not all(given):
            missing = [flag for flag, value in zip(("--ledger", "--chain-rpc", "--chain-key-file"), given)
                       if not value]
            raise UsageError(f"--ledger, --chain-rpc and --chain-key-file go together: {', '.join(missing)} missing")
        if args.take_over is not None:
            _take_over_arguments(args.take_over, all(given))
        for flag, value in (("--threads", args.threads),):
            if value < 1:
                raise UsageError(f"{flag} {value} is out of range: must be >= 1")
        if not 1 <= args.confirmations <= 1024:
            raise UsageError(f"--confirmations {args.confirmations} is out of range: must be in [1, 1024]")
        if not 0 <= args.challenge_window < 2**32:
            raise UsageError(f"--challenge-window {args.challenge_window} is out of range: must be in [0, 2^32)")
        for flag, value in (("--linger", args.linger), ("--report-timeout", args.report_timeout),
                            ("--idle-timeout", args.idle_timeout)):
            if not 0 <= value <= 86_400:  # also refuses NaN
                raise UsageError(f"{flag} {value} is out of range: must be in [0, 86400] seconds")
    if command == "worker":
        from trainer.net.limits import WORKER_ID

        if not WORKER_ID.fullmatch(args.worker_id):
            raise UsageError(f"--worker-id {args.worker_id[:80]!r} must match [A-Za-z0-9._-]{{1,64}}")
        if args.attestation == "dev" and not args.dev_root_dir:
            raise UsageError("--attestation dev needs --dev-root-dir (the directory of the dev root key)")
        for flag, value in (("--threads", args.threads), ("--stages", args.stages), ("--cores", args.cores),
                            ("--data-parallel", args.data_parallel)):
            if value is not None and not 1 <= value <= 4096:
                raise UsageError(f"{flag} {value} must be in [1, 4096]")
        _warn_oversubscribed(args.cores, args.threads)
        _store_sources(args.store_source)
        from trainer.runtime.device import DeviceError, parse_device

        try:
            parse_device(args.device)
        except DeviceError as exc:
            raise UsageError(str(exc)) from None
        for flag, value in (("--link-bandwidth", args.link_bandwidth), ("--link-latency", args.link_latency),
                            ("--reconnect-timeout", args.reconnect_timeout)):
            if not 0 <= value < float("inf"):  # also refuses NaN
                raise UsageError(f"{flag} {value} is out of range: must be a finite number >= 0")
    if command == "chain" and args.action == "up":
        _port(args.port, "--port", 0)
    if command == "status" and args.watch is not None:
        if args.json is not None:
            raise UsageError("--watch shows the tables; it does not go with --json")
        if not 0.1 <= args.watch <= 86_400:  # also refuses NaN
            raise UsageError(f"--watch {args.watch} is out of range: must be in [0.1, 86400] seconds")
    if command in ("worker", "status"):
        _coordinator_address(args.coordinator)
    if command == "worker":
        _successor_arguments(args.successor or [], args.successor_fingerprint or [], args.tls_fingerprint)
    if command == "settle" and (args.action == "prove-receipt") != (args.receipts is not None):
        raise UsageError("--receipts RDIR goes with `settle prove-receipt`, and prove-receipt needs it")
    if command == "settle" and (args.action == "admit-auditor") != (args.auditor_dir is not None):
        raise UsageError("--auditor-dir ADIR goes with `settle admit-auditor`, and admit-auditor needs it")
    if command == "settle" and (args.action == "dispute") != (args.verdicts is not None):
        raise UsageError("--verdicts F1 F2 … goes with `settle dispute`, and dispute needs it")
    if command == "settle" and args.verdicts is not None and len(args.verdicts) > 256:
        raise UsageError(f"--verdicts names {len(args.verdicts)} files, more than the 256 a panel may send")
    if command == "settle" and args.threshold is not None and (args.action != "admit-auditor"
                                                               or not 1 <= args.threshold <= 2**32):
        raise UsageError("--threshold K goes with `settle admit-auditor` and must be in [1, 2^32]")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    import os

    if "COLUMNS" not in os.environ and not any(stream.isatty() for stream in (sys.stdin, sys.stdout, sys.stderr)):
        # Piped or logged: rich would wrap tables at 80 columns; a file has no width to fit.
        os.environ["COLUMNS"] = "200"
    args = parser(argv).parse_args(argv)
    _logging(args.verbose)
    if args.command not in LOGGED_PROGRESS:
        use_console()
    try:
        check_args(args)
        return args.func(args)
    except KeyboardInterrupt:  # the with blocks have unwound: anvil stopped, temporary files removed
        logging.getLogger("dilocox").error("interrupted (SIGINT): stopped, cleaned up, exiting")
        return 130
    except Exception as exc:  # one clear line for expected failures; the traceback with -v
        # A SettingError can only come from trainer.config once it is imported; importing it here
        # just to compare would load torch (a second of CPU) into every command that fails.
        config = sys.modules.get("trainer.config")
        usage_errors = (UsageError, config.SettingError) if config is not None else (UsageError,)
        # DilocoxError is every error of the product's own; OSError and ValueError are the standard
        # library's refusals of what the user gave (a missing file, a port in use, a bad number).
        if isinstance(exc, (DilocoxError, OSError, ValueError)) and not args.verbose:
            text = " ".join(str(exc).split()) or type(exc).__name__  # one line, whatever the message holds
            logging.getLogger("dilocox").error("%s: %s", type(exc).__name__, text)
            return 2 if isinstance(exc, usage_errors) else 1
        raise


if __name__ == "__main__":
    sys.exit(main())
