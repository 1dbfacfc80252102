"""Which coordinator a worker serves, and whether a new one is the run's (docs/trust.md, "A run that
outlives its coordinator").

A worker is given its coordinator and, optionally, successors (``dilocox worker --successor H:P
--successor-fingerprint HEX``), each with how to trust its TLS. When the coordinator it serves stays
unreachable for the reconnect timeout, the worker moves to the next in the list
(trainer.worker.client). It trusts the new coordinator only as far as the first: the same run
(run digest), the same ledger (the EIP-712 domain its reports are signed in, pinned at the first
Join), and a signing key that is either the one pinned at the first Join or one the chain names as
the run's coordinator *now* (with a chain to ask, a rejoin with the pinned key is refused too once
the chain names another coordinator: the run was handed over) (``ContributionLedger.runOf(run).coordinator``, asked through
``RunCoordinatorCheck``, which the CLI builds from ``--chain-rpc``: trainer imports nothing of
settlement). A coordinator that names another run, another ledger, or a key the chain does not
name is refused with one line, and the worker ends (WorkerError): a worker distrusts its
coordinator, and a successor is no exception. A run without a ledger cannot change its key.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from attestation import Domain
from proto import CHANNEL_OPTIONS
from storage_client import DilocoxError
from trainer.net.limits import Backoff
from trainer.net.tls import ClientTls, TlsUnreachable, open_channel

log = logging.getLogger("dilocox.worker")

__all__ = ["Endpoint", "RunCoordinatorCheck", "Succession", "SuccessionError", "Successors"]

# (ledger domain, run digest, signing address) -> the run's coordinator on that chain now, or None
# when the chain knows no such run. Raises on a chain that cannot be asked.
RunCoordinatorCheck = Callable[[Domain, bytes, str], "str | None"]


class SuccessionError(DilocoxError, RuntimeError):
    """A coordinator the worker moved to is not the run's; the message says why."""


@dataclass(frozen=True)
class Endpoint:
    """One coordinator: where it listens, and how its TLS is trusted."""

    address: str
    tls: ClientTls


@dataclass(frozen=True)
class Successors:
    """The coordinators to move to after the first, in order, and how to ask the chain about them
    (None: no chain given, so no key other than the one pinned at the first Join is ever trusted)."""

    endpoints: tuple[Endpoint, ...] = ()
    check: RunCoordinatorCheck | None = None


class Succession:
    """The coordinators a worker may serve, in order, and the one it serves now.

    @param first the first coordinator
    @param successors the ones after it, and the chain check
    """

    def __init__(self, first: Endpoint, successors: Successors = Successors()) -> None:
        self.endpoints = (first, *successors.endpoints)
        self.check = successors.check
        self.index = 0  # the coordinator served now
        self.connected = 0  # the one the last channel (``connect``) goes to
        self._lock = threading.Lock()

    @property
    def current(self) -> Endpoint:
        return self.endpoints[self.index]

    def advance(self, from_index: int) -> Endpoint | None:
        """The next coordinator after the one at ``from_index`` (what the caller was serving), or None
        when it was the last; a caller that lost a race to another thread gets the one already moved to."""
        with self._lock:
            if self.index == from_index:
                if self.index + 1 >= len(self.endpoints):
                    return None
                self.index += 1
            return self.current

    def connect(self, timeout_s: float, sleep: Callable[[float], None] = time.sleep) -> grpc.Channel:
        """A channel to the coordinator served now: one not up yet is waited for with backoff (a pinned
        certificate is fetched first) for ``timeout_s``, then the next one is tried.

        @raise SuccessionError when the last one stays unreachable
        """
        deadline, backoff = time.monotonic() + timeout_s, Backoff(sleep=sleep)
        while True:
            serving = self.index
            try:
                channel = open_channel(self.current.address, self.current.tls, CHANNEL_OPTIONS)
                self.connected = serving
                return channel
            except TlsUnreachable as exc:
                if time.monotonic() >= deadline:
                    if self.advance(serving) is None:
                        raise SuccessionError(f"coordinator at {self.current.address} unreachable for "
                                              f"{timeout_s:.0f}s: {exc}") from exc
                    log.warning("coordinator at %s unreachable; moving to %s", self.endpoints[serving].address,
                                self.current.address)
                    deadline = time.monotonic() + timeout_s
                backoff.wait()

    def _still_held(self, where: str, key: str, run: bytes, pinned_domain: Domain | None) -> None:
        """On a rejoin with the pinned key: refused once the ledger names another coordinator (the run
        was handed over, and this one is not it any more). A chain that cannot be asked, or does not
        know the run yet (it is created after the first rounds start), does not stop the worker."""
        if self.check is None or pinned_domain is None:
            return
        try:
            on_chain = self.check(pinned_domain, run, key)
        except Exception as exc:  # noqa: BLE001 - the pinned key stays trusted while the chain is away
            log.warning("could not ask the ledger whether %s is still the run's coordinator: %s", key, str(exc)[:300])
            return
        if on_chain is not None and on_chain != key:
            raise SuccessionError(f"the coordinator at {where} signs with {key}, but the ledger names {on_chain} as "
                                  f"the run's coordinator now: the run was handed over")

    def accept(self, pinned_key: str | None, key: str, pinned_run: bytes, run: bytes,
               pinned_domain: Domain | None, domain: Domain | None) -> str:
        """The signing key to pin after a coordinator named ``key``, ``run`` and ``domain`` (a Challenge);
        ``pinned_*`` is what the first Join pinned (None and b"" before it).

        @raise SuccessionError when the coordinator is not the run's (module docstring)
        """
        where = self.current.address
        if pinned_key is None or key == pinned_key and (not pinned_run or run == pinned_run):
            if pinned_key is not None:
                self._still_held(where, key, run, pinned_domain)
            return key
        if run != pinned_run:
            raise SuccessionError(f"the coordinator at {where} serves run 0x{run.hex()[:16]}…, not this worker's "
                                  f"run 0x{pinned_run.hex()[:16]}…")
        if pinned_domain is None:
            raise SuccessionError(f"the coordinator's signing key changed from {pinned_key} to {key} (at {where}), "
                                  f"and the run has no ledger to say which is its coordinator")
        if domain != pinned_domain:
            raise SuccessionError(f"the coordinator at {where} names the ledger {domain}, not the run's "
                                  f"{pinned_domain}")
        if self.check is None:
            raise SuccessionError(f"the coordinator at {where} signs with {key}, not {pinned_key}; give the worker "
                                  f"--chain-rpc so that it can ask the ledger whether {key} is the run's coordinator")
        try:
            on_chain = self.check(pinned_domain, run, key)
        except Exception as exc:  # noqa: BLE001 - whatever the chain says, nothing is trusted without its answer
            raise SuccessionError(f"the coordinator at {where} signs with {key}, not {pinned_key}, and the ledger "
                                  f"cannot be asked whether it is the run's: {str(exc)[:300]}") from None
        if on_chain != key:
            raise SuccessionError(f"the coordinator at {where} signs with {key}, but the ledger names "
                                  f"{on_chain or 'no such run'} as the run's coordinator: refused")
        return key
