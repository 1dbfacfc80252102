"""A patched coordinator for tests (issue 28): with this directory first on PYTHONPATH, the real
``dilocox coordinator`` adds a ghost participant to round 1 as it closes.

The ghost's update is half the first accepted update, stored as the coordinator stores any push
(its bytes and an update record) but with no push signature: no admitted worker signed it. It is
averaged into the round like the others, so the checkpoint re-derives; the coordinator's
unmodified settlement code then records it as unreported (nobody reports for it), as if a worker
had died before reporting. What a compromised coordinator could do, done by monkeypatching the
real code at start-up (only in a process started as ``python -m cli.main coordinator``).
"""

from __future__ import annotations

import dataclasses
import sys

GHOST = "ghost"

if sys.argv[1:2] == ["coordinator"]:
    from proto import Encoding
    from storage_client import Codec
    from trainer.codec.wire import encode_params
    from trainer.coordinator.machine import Coordinator
    from trainer.coordinator.state import Accepted
    from trainer.rounds.aggregation import exact_norm
    from trainer.rounds.update_source import DenseUpdate, dense
    from trainer.runstore.update_record import record_bytes, slice_ref, store_slice

    honest_close = Coordinator.close_round

    def close_round_with_a_ghost(self: Coordinator):  # type: ignore[no-untyped-def]
        r = self.round
        if r.number == 1 and r.accepted and GHOST not in r.accepted:
            first = r.accepted[min(r.accepted)]
            delta = {name: 0.5 * tensor for name, tensor in dense(first.source).items()}
            payload = encode_params(delta)
            ref = slice_ref(0, 1, Encoding.DENSE_F32, payload, None)  # no signature: nobody pushed it
            store = self.run.run_dir.store
            store_slice(store, ref, payload, None)
            cid = store.put(record_bytes([ref]), Codec.JSON)
            entry = dataclasses.replace(first.entry, cid=str(cid), bytes_sent=0, bytes_received=0)
            source = DenseUpdate(delta)
            r.accepted[GHOST] = Accepted(source, entry, exact_norm(source))
        return honest_close(self)

    Coordinator.close_round = close_round_with_a_ghost  # type: ignore[method-assign]
