"""Every error the CLI reports in one line descends from DilocoxError, under its own name and with
the standard base it had (so existing ``except ValueError`` / ``except RuntimeError`` still hold)."""

from __future__ import annotations

import pytest

from attestation import AttestationError, AttestationUnavailable, PolicyViolation
from cli.main import UsageError
from settlement.anvil import AnvilError
from settlement.chain import ChainError
from storage_client import CorruptObjectError, DilocoxError, MissingObjectError, StoreError
from trainer.codec.wire import WireError
from trainer.config import ConfigError, SettingError
from trainer.data.corpus import CorpusError
from trainer.net.tls import TlsError
from trainer.worker import WorkerError

# (the class, the standard base it must keep)
USER_FACING = [
    (ConfigError, ValueError), (SettingError, ValueError), (CorpusError, ValueError), (TlsError, ValueError),
    (WireError, ValueError), (UsageError, ValueError), (AttestationError, RuntimeError),
    (AttestationUnavailable, RuntimeError), (WorkerError, RuntimeError), (AnvilError, RuntimeError),
    (PolicyViolation, Exception), (StoreError, Exception), (MissingObjectError, Exception),
    (CorruptObjectError, Exception), (ChainError, Exception),
]


@pytest.mark.parametrize("error, standard_base", USER_FACING, ids=[e.__name__ for e, _ in USER_FACING])
def test_user_facing_errors_share_one_root(error: type, standard_base: type) -> None:
    assert issubclass(error, DilocoxError)
    assert issubclass(error, standard_base)

