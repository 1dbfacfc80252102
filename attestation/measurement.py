"""The code measurement: which code and which run configuration a worker runs (docs/trust.md).

    code measurement = sha256(canonical_json({"code": {relative path: sha256 hex of the file's bytes},
                                              "config": config CID text}))

"code" covers every `*.py` and `*.proto` file under the directories of the packages `trainer`,
`attestation`, `proto`, `storage_client`, `settlement` and `cli`, named "package/sub/file.py" with
forward slashes (canonical JSON sorts them).

Decisions a second implementation must copy:
- A package that cannot be found on this interpreter's path is left out (for instance
  `settlement` before it exists). Its absence changes the measurement, as any code change should.
- The gRPC stubs generated from proto/dilocox.proto (`*_pb2.py`, `*_pb2_grpc.py`) are left out:
  they are derived from the .proto file, which is measured, and are regenerated per machine
  (`make stubs`), so measuring them would add nothing but differences between generator runs.
- `__pycache__` and directories whose names start with "." are skipped; files are read as bytes.

An auditor's key is bound the same way to the *audit code's* measurement: the same function over
``AUDIT_PACKAGES`` (the worker's packages and ``audit``, which holds the checks its verdicts name),
``audit_code_measurement``.

The measurement is a claim the worker makes in REPORTDATA[32:64]. For the dev provider it is the
allowlisted measurement; under TDX the hardware measurement (MRTD, RTMRs) is what is allowlisted.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from storage_client import CID, InvalidCIDError, canonical_json

DEFAULT_PACKAGES: tuple[str, ...] = (
    "trainer",
    "attestation",
    "proto",
    "storage_client",
    "settlement",
    "cli",
)
AUDIT_PACKAGES: tuple[str, ...] = (*DEFAULT_PACKAGES, "audit")
SUFFIXES = (".py", ".proto")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py")


def package_roots(packages: Iterable[str] = DEFAULT_PACKAGES) -> dict[str, Path]:
    """The directory of each importable package, found without importing it; missing ones skipped."""
    roots: dict[str, Path] = {}
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            continue
        roots[name] = Path(next(iter(spec.submodule_search_locations)))
    return roots


def _measured(filename: str) -> bool:
    return filename.endswith(SUFFIXES) and not filename.endswith(GENERATED_SUFFIXES)


def code_files(roots: Mapping[str, str | os.PathLike[str]]) -> dict[str, str]:
    """{"package/sub/file.py": sha256 hex} for every measured file under each root."""
    out: dict[str, str] = {}
    for name, root in roots.items():
        if not name or "/" in name:
            raise ValueError(f"package name {name!r} is not a plain name")
        base = Path(root)
        if not base.is_dir():
            raise FileNotFoundError(f"package {name!r}: {base} is not a directory")
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            for filename in sorted(filenames):
                if not _measured(filename):
                    continue
                path = Path(dirpath) / filename
                rel = f"{name}/{path.relative_to(base).as_posix()}"
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def code_manifest(
    config_cid: str,
    packages: Iterable[str] = DEFAULT_PACKAGES,
    *,
    roots: Mapping[str, str | os.PathLike[str]] | None = None,
) -> dict[str, object]:
    """The JSON object whose canonical bytes are hashed: {"code": {...}, "config": config_cid}.
    Useful to see why two measurements differ."""
    if not isinstance(config_cid, str):
        raise TypeError(f"config_cid must be CID text, not {type(config_cid).__name__}")
    try:
        parsed = CID.parse(config_cid)
    except InvalidCIDError as exc:
        raise ValueError(f"config_cid {config_cid!r} is not a CID: {exc}") from None
    if str(parsed) != config_cid:
        raise ValueError(f"config_cid {config_cid!r} is not in canonical text form ({parsed})")
    return {"code": code_files(package_roots(packages) if roots is None else roots), "config": config_cid}


def code_measurement(
    config_cid: str,
    packages: Iterable[str] = DEFAULT_PACKAGES,
    *,
    roots: Mapping[str, str | os.PathLike[str]] | None = None,
) -> bytes:
    """sha256 of the canonical JSON of `code_manifest` (32 bytes).

    `roots` ({package name: directory}) replaces the import-path lookup of `packages`; tests use it
    to measure a package tree of their own.
    """
    return hashlib.sha256(canonical_json(code_manifest(config_cid, packages, roots=roots))).digest()


def audit_code_measurement(config_cid: str) -> bytes:
    """The measurement an auditor's key is bound to: ``code_measurement`` over ``AUDIT_PACKAGES``."""
    return code_measurement(config_cid, AUDIT_PACKAGES)
