"""Replaying a worker's contributions in the kernels it trained with, bit for bit.

An honest update and its replay differ only by floating-point rounding, and on a CPU that
rounding is decided by the worker's ATen CPU capability and its intra-op thread count
(trainer.runtime.kernels), which every CPU worker records with each push (a worker of
several pipeline stages: the kernels its stages all ran; its replay runs their arithmetic,
trainer.runtime.staged) and its manifest participant restates (``kernels``, covered by every report's signature). So the audit
replays a worker's chain of contributions (audit.replay) in a fresh interpreter of its own with

    ATEN_CPU_CAPABILITY = the recorded capability     (torch reads it once, at import)
    OMP_NUM_THREADS = MKL_NUM_THREADS = torch.set_num_threads = the recorded threads

whenever this machine's CPU can run that capability (trainer.runtime.kernels.cpu_runs), and every
contribution of the chain recorded the same kernels. There an honest contribution re-derives
exactly, d = 0 (measured: the demo run, every contribution, under every auditor capability and
thread count; docs/verification.md), so the tolerance is EXACT_TOLERANCE and a cheat has nowhere
to hide in it.

Otherwise (a capability this CPU lacks, kernels not recorded: a worker on an accelerator or an
older run, or a chain whose kernels changed) the chain is replayed in this process's own kernels,
and the honest distance is no longer 0: it grows along the chain, as AdamW amplifies the rounding
of each step (measured on the demo run: 1e-6 at the first round of a chain, 2e-3 at the fifth, 0.28
at the eighth). With m(n) the largest honest distance measured at the first n contributions of a
chain (n = 1 at its fresh start; FALLBACK_MEASURED), the n-th is held to

    tolerance(n) = FALLBACK_TOLERANCE     for n ≤ REPLAY_HORIZON (trainer.config: 5, the positions
                                          where FALLBACK_MARGIN · m(n) ≤ FALLBACK_TOLERANCE)
                 = none: "inconclusive"   further down the chain (never an accusation of the worker)

so the fallback catches what it can (an update scaled by 1.05 at the start of a chain). A run bounds
every chain by the horizon (rounds.state_every ≤ REPLAY_HORIZON: a stored state per window of K rounds), so
an "inconclusive" row is a failure of the run, not of its worker: the coordinator accepted a chain
no audit can decide (audit.recompute, AuditCheck.REPLAY_HORIZON). Each row says which kernels
replayed it and against which tolerance.

The child process is given JSON on stdin (the store's directory, the config, the manifests the
audit has verified, the chains) and answers one JSON line; nothing is pickled, and the answer is
parsed as strictly as any other input (bounded, typed, rows only for the chains it was asked for).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from storage_client import Kernels, Manifest, ObjectStore, Store, strict_json
from trainer.config import REPLAY_HORIZON, RunConfig
from trainer.progress import use_console
from trainer.runtime.kernels import cpu_runs, current_kernels

# d an honest contribution replayed in its own kernels stays within: measured 0 exactly; the bound
# leaves room for nothing but the last bits of a float64 norm.
EXACT_TOLERANCE = 1e-6
# The largest honest distance measured at the n-th contribution of a chain (n = 1, 2, ...), replayed
# in other kernels than the worker's (docs/verification.md, "Replay tolerance": the demo run, its
# workers on avx512 with 1 thread, replayed under default and avx2 with 1 thread and avx512 with 2).
FALLBACK_MEASURED = (1.7e-6, 2.1e-5, 1.5e-5, 9.1e-5, 2.1e-3, 0.047, 0.17, 0.28)
# d a contribution replayed in the auditor's own kernels is held to, at the chain positions where it
# is FALLBACK_MARGIN times the largest distance measured up to there (positions 1..5: 8.3e-3 there;
# dense runs measured ≤ 1e-2 over 8 rounds); further down a chain the fallback decides nothing.
FALLBACK_TOLERANCE = 0.05
FALLBACK_MARGIN = 4.0
CHILD_TIMEOUT_S = 24 * 3600.0  # a replay child that runs longer than a day is stuck
CHILD_OUTPUT_LIMIT = 64 << 20  # bytes of the child's answer
# A worker's recorded thread count is its claim: a replay child runs at most this many intra-op
# threads (oversubscribing this CPU by 4 at most), so a claim of 1,024 costs the auditor nothing; past
# it the chain is replayed in this process's kernels, and its rows say why.
MAX_CHILD_THREADS = max(16, 4 * (os.cpu_count() or 1))
_STATUSES = ("ok", "MISMATCH", "inconclusive", "unrevealed", "not replayed")
_CHILD = "import sys; from audit.replay_env import main; sys.exit(main())"
_NOTE_CHARS = 500


class ChildError(RuntimeError):
    """A replay child that failed or answered out of form (a replay problem, not a verdict)."""


@dataclass(frozen=True)
class ChainKernels:
    """How one worker's chain is replayed: in ``kernels`` (the worker's, in a child process) or, with
    None, in this process's own, ``reason`` saying why."""

    kernels: Kernels | None
    reason: str = ""


def chain_kernels(manifests: Mapping[int, Manifest], worker: str, rounds: list[int]) -> ChainKernels:
    """The kernels ``worker``'s chain of ``rounds`` is replayed in."""
    recorded = {next(p.kernels for p in manifests[r].participants if p.worker == worker) for r in rounds}
    if None in recorded:
        return ChainKernels(None, "no kernels recorded")
    if len(recorded) > 1:
        return ChainKernels(None, "the chain's recorded kernels change")
    kernels = recorded.pop()
    if not cpu_runs(kernels.capability):
        return ChainKernels(None, f"this CPU cannot run {kernels.capability}")
    if kernels.threads > MAX_CHILD_THREADS:
        return ChainKernels(None, f"{kernels.threads} threads, more than a replay here runs ({MAX_CHILD_THREADS})")
    return ChainKernels(kernels)


def split_by_kernels(manifests: Mapping[int, Manifest], chains: Mapping[str, Iterable[int]], worker_kernels: bool
                     ) -> tuple[dict[Kernels, dict[str, list[int]]], dict[str, list[int]], dict[str, str]]:
    """``chains`` (worker → rounds) split into those replayed in their workers' kernels, by kernels, and
    those replayed in this process's own (all of them without ``worker_kernels``), with why."""
    exact: dict[Kernels, dict[str, list[int]]] = {}
    own: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for worker, rounds in sorted(chains.items()):
        how = chain_kernels(manifests, worker, sorted(rounds)) if worker_kernels else ChainKernels(None)
        if how.kernels is None:
            own[worker], reasons[worker] = sorted(rounds), how.reason
        else:
            exact.setdefault(how.kernels, {})[worker] = sorted(rounds)
    return exact, own, reasons


def judge(distance: float, position: int, exact: bool) -> tuple[str, str, float | None]:
    """(status, note, tolerance) of a contribution ``distance`` off its replay, the ``position``-th
    of its chain: held to EXACT_TOLERANCE in its worker's kernels, else to the fallback tolerance of
    its position, and inconclusive past the replay horizon."""
    tolerance = EXACT_TOLERANCE if exact else fallback_tolerance(position)
    if tolerance is None:
        return ("inconclusive", f"contribution {position} of its chain, replayed in other kernels than its "
                                f"worker's: past the replay horizon ({REPLAY_HORIZON})", None)
    return "ok" if distance <= tolerance else "MISMATCH", "", tolerance


def kernels_label(exact: bool, reason: str = "") -> str:
    """What a row says replayed it: this process's kernels, which are its worker's in a replay child
    (``exact``), else the auditor's, and why."""
    kernels = current_kernels(torch.device("cpu"))
    label = f"{'worker' if exact else 'auditor'}'s{f' ({kernels})' if kernels else ''}"
    return f"{label}: {reason}" if reason else label


def fallback_tolerance(position: int) -> float | None:
    """The tolerance of the ``position``-th contribution of a chain replayed in other kernels than
    its worker's: FALLBACK_TOLERANCE up to REPLAY_HORIZON (where it is FALLBACK_MARGIN times every
    honest distance measured; tests/unit/test_replay_horizon.py holds the two to each other), else
    None (the replay is inconclusive there)."""
    return FALLBACK_TOLERANCE if 1 <= position <= REPLAY_HORIZON else None


def fallback_horizon() -> int:
    """The last chain position whose fallback tolerance the measurements support: FALLBACK_MARGIN times
    every honest distance measured up to it is within FALLBACK_TOLERANCE (what REPLAY_HORIZON states)."""
    supported = 0
    while (supported < len(FALLBACK_MEASURED)
           and FALLBACK_MARGIN * max(FALLBACK_MEASURED[:supported + 1]) <= FALLBACK_TOLERANCE):
        supported += 1
    return supported


def child_environment(kernels: Kernels) -> dict[str, str]:
    """The environment a replay child runs in: this one's, with the worker's kernels."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(ATEN_CPU_CAPABILITY=kernels.capability, OMP_NUM_THREADS=str(kernels.threads),
               MKL_NUM_THREADS=str(kernels.threads))
    return env


def replay_in(kernels: Kernels, store: Store, config: RunConfig, manifests: Mapping[int, Manifest],
              chains: Mapping[str, list[int]], sampled: set[tuple[int, str]]) -> dict[str, Any]:
    """``chains`` (worker → its rounds, in order) replayed in a child process in ``kernels``; returns
    its checked answer: ``rows`` (ReplayRow JSON), ``steps``, ``round_steps`` (H_r), ``problems``."""
    from storage_client.remote import RemoteStore

    from .reveal import RevealedStore

    revealed: dict[str, Any] = {}
    if isinstance(store, RevealedStore):  # the run's store and the audit's revealed states: the child reads both
        store, revealed = store.run, {"revealed": str(store.cache.root)}
    if isinstance(store, ObjectStore):
        where: dict[str, Any] = {"store": str(store.root)}
    elif isinstance(store, RemoteStore):  # the child fetches and verifies from the same gateways
        where = {"store_urls": list(store.urls), "store_ca": store.ca_file}
    else:
        raise ChildError(f"a replay child reads a local or gateway store; {store.location} is neither")
    request = {**where, **revealed, "config": config.to_json(), "kernels": kernels.to_json(),
               "manifests": [m.to_json() for _, m in sorted(manifests.items())],
               "chains": {w: list(rs) for w, rs in sorted(chains.items())},
               "sampled": sorted([r, w] for r, w in sampled if w in chains)}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = child_environment(kernels)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD], input=strict_json(request).encode(),
                              stdout=subprocess.PIPE, env=env, timeout=CHILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ChildError(f"the replay child in {kernels} could not run: {str(exc)[:200]}") from None
    if done.returncode != 0:
        raise ChildError(f"the replay child in {kernels} exited with status {done.returncode}")
    return parse_answer(done.stdout, kernels, chains)


def parse_answer(out: bytes, kernels: Kernels, chains: Mapping[str, list[int]]) -> dict[str, Any]:
    """The child's answer, every field checked: it ran in ``kernels`` and replayed only ``chains``."""
    if len(out) > CHILD_OUTPUT_LIMIT:
        raise ChildError(f"the replay child's answer is over {CHILD_OUTPUT_LIMIT} bytes")
    try:
        answer = json.loads(out.decode().strip().splitlines()[-1])
        if Kernels.from_json(answer["kernels"]) != kernels:
            raise ChildError(f"the replay child ran in other kernels than {kernels}")
        rows = [_row(obj, chains) for obj in answer["rows"]]
        steps, round_steps = answer["steps"], {int(r): h for r, h in answer["round_steps"].items()}
        problems = [(p[0], str(p[1])[:300], str(p[2])[:_NOTE_CHARS]) for p in answer["problems"]]
        if type(steps) is not int or not all(type(h) is int for h in round_steps.values()) or not all(
                p[0] is None or type(p[0]) is int for p in problems):
            raise ChildError("the replay child's step counts or problems are not of the expected form")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:  # ManifestError: ValueError
        raise ChildError(f"the replay child's answer is not of the expected form: {str(exc)[:200]}") from None
    return {"rows": rows, "steps": steps, "round_steps": round_steps, "problems": problems}


def _row(obj: Any, chains: Mapping[str, list[int]]) -> dict[str, Any]:
    fields = {"round", "worker", "sampled", "distance", "status", "note", "kernels", "tolerance"}
    if not isinstance(obj, dict) or set(obj) != fields:
        raise ValueError("a row is not an object of the expected fields")
    if obj["worker"] not in chains or obj["round"] not in chains[obj["worker"]]:
        raise ValueError("a row for a contribution it was not asked to replay")
    if obj["status"] not in _STATUSES or not isinstance(obj["sampled"], bool):
        raise ValueError("a row's status or sampled flag")
    for key in ("distance", "tolerance"):
        if obj[key] is not None and not (isinstance(obj[key], float) and not math.isnan(obj[key])):
            raise ValueError(f"a row's {key}")
    if not isinstance(obj["note"], str) or not isinstance(obj["kernels"], str):
        raise ValueError("a row's note or kernels")
    return {**obj, "note": obj["note"][:_NOTE_CHARS], "kernels": obj["kernels"][:_NOTE_CHARS]}


def main() -> int:
    """The replay child: read the request on stdin, replay in this process's kernels (which must be
    the requested ones), answer one JSON line on stdout."""
    from audit.replay import Replayer, ReplayRow  # the replay imports this module

    use_console()  # its progress on the auditor's console (stderr), as the audit's own would be
    request = json.loads(sys.stdin.buffer.read())
    wanted = Kernels.from_json(request["kernels"])
    torch.set_num_threads(wanted.threads)
    ran = current_kernels(torch.device("cpu"))
    # A process's kernels are its capability and threads; an island's ranks (data_parallel) are replayed
    # by the arithmetic (trainer.runtime.staged), in these same kernels.
    if ran != dataclasses.replace(wanted, data_parallel=1):
        print(f"audit replay child: asked for {wanted}, torch runs {ran}", file=sys.stderr)
        return 1
    manifests = {m.round: m for m in (Manifest.from_json(obj) for obj in request["manifests"])}
    from storage_client.remote import RemoteStore

    store = (RemoteStore(request["store_urls"], ca_file=request["store_ca"]) if "store_urls" in request
             else ObjectStore(request["store"]))
    if "revealed" in request:
        from audit.reveal import RevealedStore

        store = RevealedStore(store, ObjectStore(request["revealed"]))
    replayer = Replayer(store, RunConfig.from_json(request["config"]), manifests,
                        worker_kernels=False, exact=True)
    sampled = {(r, w) for r, w in request["sampled"]}
    rows: list[ReplayRow] = []
    steps = replayer.replay_chains({w: list(rs) for w, rs in request["chains"].items()}, sampled, rows)
    print(strict_json({"kernels": wanted.to_json(), "rows": [row.to_json() for row in rows], "steps": steps,
                      "round_steps": {str(r): h for r, h in replayer.steps.items()},
                      "problems": [list(p) for p in replayer.problems]}))
    return 0

