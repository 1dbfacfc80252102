"""The provider interface, and choosing a provider by name ("tdx" or "dev")."""

from __future__ import annotations

import os
from typing import Protocol

from .evidence import Evidence, Provider
from .tdx import DEFAULT_TSM_PATH, TdxProvider



class EvidenceProvider(Protocol):
    """A source of evidence: its name, and evidence over 64 bytes of REPORTDATA."""

    name: str

    def evidence(self, report_data: bytes) -> Evidence: ...


def open_provider(
    name: str,
    *,
    dev_root_dir: str | os.PathLike[str] | None = None,
    tsm_path: str | os.PathLike[str] = DEFAULT_TSM_PATH,
) -> EvidenceProvider:
    """The provider called `name`. "tdx" checks configfs-tsm exists (AttestationUnavailable
    otherwise); "dev" needs `dev_root_dir`, where its development root key lives."""
    if name == Provider.TDX:
        provider = TdxProvider(tsm_path)
        provider.check_available()
        return provider
    if name == Provider.DEV:
        if dev_root_dir is None:
            raise ValueError("the dev provider needs dev_root_dir (where its root key is kept)")
        from .dev import DevProvider

        return DevProvider(dev_root_dir)
    raise ValueError(f"unknown attestation provider {name!r}; known: {[p.value for p in Provider]}")
