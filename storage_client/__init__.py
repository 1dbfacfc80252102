"""storage_client: content-addressed storage for a verifiable training run.

Everything a run produces (checkpoints, worker updates, configs, per-round
manifests) is stored under the sha256 of its bytes and named by a CIDv1, so any
party can check that what it reads is what was recorded. Manifests link each
round to its parent, giving a hash chain from any checkpoint back to genesis.

    cid      CID / Codec: content identifiers and their text form
    canonical  canonical JSON (one byte form per value, floats refused)
    errors   DilocoxError: the root of every error reported to the user in one line
    backend  Store: the interface every reader and writer uses; open_store: a run's store
    store    ObjectStore: Store's local implementation, hash-verified files, atomic writes
    manifest Manifest / Participant / Downlink / Traffic / lineage: the per-round record and its chain
"""

from .backend import (
    RUN_STORE_DIR,
    CorruptObjectError,
    MissingObjectError,
    Store,
    StoreError,
    open_store,
)
from .canonical import (
    JSONBoundsError, bytes32, canonical_json, digest_json, hex32, hex_or_none, loads_bounded, strict_json, unhex32,
)
from .cid import CID, Codec, InvalidCIDError, decode_varint, encode_varint
from .errors import DilocoxError
from .manifest import (
    KERNEL_CAPABILITIES,
    MAX_DATA_PARALLEL,
    MAX_KERNEL_THREADS,
    SCHEMA,
    Downlink,
    Kernels,
    Manifest,
    ManifestError,
    Participant,
    Traffic,
    from_e6,
    lineage,
    to_e6,
)
from .store import ObjectStore, write_atomic

__all__ = [
    "DilocoxError",
    "bytes32",
    "hex32",
    "hex_or_none",
    "unhex32",
    "CID",
    "Codec",
    "InvalidCIDError",
    "encode_varint",
    "decode_varint",
    "canonical_json",
    "strict_json",
    "JSONBoundsError",
    "loads_bounded",
    "digest_json",
    "Store",
    "open_store",
    "RUN_STORE_DIR",
    "ObjectStore",
    "StoreError",
    "MissingObjectError",
    "CorruptObjectError",
    "write_atomic",
    "SCHEMA",
    "Participant",
    "Kernels",
    "KERNEL_CAPABILITIES",
    "MAX_DATA_PARALLEL",
    "MAX_KERNEL_THREADS",
    "Downlink",
    "Traffic",
    "Manifest",
    "ManifestError",
    "to_e6",
    "from_e6",
    "lineage",
]
