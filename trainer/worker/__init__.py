"""A worker: joins a run, then round after round fetches θ⁽ʳ⁻¹⁾, runs H inner steps, pushes Δ⁽ʳ⁾.

    client   CoordinatorClient: the channel, retried calls, joining and attestation, verified
             fetches (dense, held, or the compressed global update), push streams, reports
    role     Worker: set-up at the first Join, training a round, pushing (and undoing a refused
             round), signing reports, progress records
    loops    the synchronous and the overlapped (one-step-delay) round loops
    hold     a test-only pause before a round's inner steps (DILOCOX_TEST_HOLD_DIR; refused outside pytest)

A worker of P pipeline stages (``--stages P``, trainer.runtime.pipeline) pushes Δᵢ⁽ʳ⁾ as P slices, one
stream each, every slice encoded by the stage that computed it (trainer.codec.uplink); a one-process
worker pushes its whole Δᵢ⁽ʳ⁾ as stage 0 of 1. With compression on, both directions travel as
adaptive low-rank + int4 (trainer.codec.uplink, trainer.codec.downlink).
"""

from trainer.worker.client import WorkerError
from trainer.worker.role import Worker

__all__ = ["Worker", "WorkerError"]
