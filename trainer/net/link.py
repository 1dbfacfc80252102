"""An emulated network link: a bandwidth and latency limit on the bytes a worker actually sends
and receives, so throughput under a slow link is measured, not modelled.

    delay(call)      = latency                       once per RPC
    delay(n bytes)   = 8·n / bandwidth               paced cumulatively per direction

Pacing is cumulative (a virtual clock per direction), so many small messages cost the same as one
large one, and time spent elsewhere (compute) is not charged twice.
"""

from __future__ import annotations

import threading
import time


class Link:
    def __init__(self, bandwidth_bps: float = 0.0, latency_s: float = 0.0) -> None:
        if bandwidth_bps < 0 or latency_s < 0:
            raise ValueError("link bandwidth and latency must be >= 0")
        self.bandwidth_bps = bandwidth_bps  # 0: unlimited
        self.latency_s = latency_s
        self._lock = threading.Lock()
        self._free_at = {"up": 0.0, "down": 0.0}

    @property
    def limited(self) -> bool:
        return self.bandwidth_bps > 0 or self.latency_s > 0

    def call(self) -> None:
        """One round trip's latency, at the start of an RPC."""
        if self.latency_s > 0:
            time.sleep(self.latency_s)

    def transfer(self, direction: str, nbytes: int) -> None:
        """Block until ``nbytes`` more could have crossed the link in ``direction``."""
        if self.bandwidth_bps <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free_at[direction])
            self._free_at[direction] = start + 8 * nbytes / self.bandwidth_bps
            wait = self._free_at[direction] - now
        if wait > 0:
            time.sleep(wait)
