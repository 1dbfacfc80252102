"""The digests signed on the wire besides reports: each pushed update, each served global state.

    update digest = sha256("dilocox/update/v2" ‖ runId ‖ uint64be(round) ‖ uint32be(stage) ‖
                           uint32be(num_stages) ‖ payload sha256)       signed by the worker's key
    global digest = sha256("dilocox/global/v1" ‖ runId ‖ uint64be(round) ‖ params digest ‖
                           manifest digest)                              signed by the coordinator's

The stage is bound into an update's digest, so a signed slice cannot be replayed as another
stage's; a worker trains only from a global state the run's coordinator signed.
"""

from __future__ import annotations

import hashlib

UPDATE_DOMAIN = b"dilocox/update/v2"
GLOBAL_DOMAIN = b"dilocox/global/v1"


def update_digest(run_id: bytes, round_: int, stage: int, num_stages: int, payload_sha256_hex: str) -> bytes:
    """What a worker signs for each slice it pushes (stage 0 of 1 for a whole-model update)."""
    return hashlib.sha256(
        UPDATE_DOMAIN + run_id + round_.to_bytes(8, "big") + stage.to_bytes(4, "big")
        + num_stages.to_bytes(4, "big") + bytes.fromhex(payload_sha256_hex)
    ).digest()


def global_digest(run_id: bytes, round_: int, params_digest: bytes, manifest_digest: bytes) -> bytes:
    """What the coordinator signs for each global state it serves."""
    return hashlib.sha256(
        GLOBAL_DOMAIN + run_id + round_.to_bytes(8, "big") + params_digest + manifest_digest
    ).digest()
