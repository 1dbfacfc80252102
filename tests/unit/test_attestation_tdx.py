"""Tests for attestation.tdx: the quote v4 layout, the configfs-tsm provider, DCAP glue."""

from __future__ import annotations

import hashlib
import shutil
import struct
import sys
import types
from pathlib import Path

import pytest

from attestation import (
    AttestationError,
    AttestationUnavailable,
    Evidence,
    EvidenceError,
    Policy,
    PolicyViolation,
    TdxProvider,
    TdxQuoteError,
    build_quote_v4,
    measurement_of,
    open_provider,
    parse_quote,
    verify_evidence,
)

# Offsets written out here from Intel's published layout, independently of attestation.tdx.
BODY = 48
OFF_TD_ATTRIBUTES = BODY + 120
OFF_MRTD = BODY + 136
OFF_RTMR = [BODY + 328, BODY + 376, BODY + 424, BODY + 472]
OFF_REPORT_DATA = BODY + 520
OFF_SIG_LEN = 48 + 584


def pack_quote(
    *,
    version: int = 4,
    key_type: int = 2,
    tee_type: int = 0x81,
    vendor: bytes = bytes(range(16)),
    user: bytes = b"U" * 20,
    td_attributes: int = 0,
    mrtd: bytes = b"\x11" * 48,
    rtmrs: tuple[bytes, ...] = (b"\x20" * 48, b"\x21" * 48, b"\x22" * 48, b"\x23" * 48),
    report_data: bytes = bytes(range(64)),
    sig: bytes = b"signature-data",
    sig_len: int | None = None,
) -> bytes:
    q = bytearray(OFF_SIG_LEN)
    struct.pack_into("<H", q, 0, version)
    struct.pack_into("<H", q, 2, key_type)
    struct.pack_into("<I", q, 4, tee_type)
    q[12:28] = vendor
    q[28:48] = user
    q[BODY : BODY + 16] = b"\x01" * 16  # TEE_TCB_SVN
    q[BODY + 16 : BODY + 64] = b"\x02" * 48  # MRSEAM
    q[BODY + 64 : BODY + 112] = b"\x03" * 48  # MRSIGNERSEAM
    struct.pack_into("<Q", q, OFF_TD_ATTRIBUTES, td_attributes)
    q[BODY + 128 : BODY + 136] = b"\x05" * 8  # XFAM
    q[OFF_MRTD : OFF_MRTD + 48] = mrtd
    q[BODY + 184 : BODY + 232] = b"\x06" * 48  # MRCONFIGID
    q[BODY + 232 : BODY + 280] = b"\x07" * 48  # MROWNER
    q[BODY + 280 : BODY + 328] = b"\x08" * 48  # MROWNERCONFIG
    for off, value in zip(OFF_RTMR, rtmrs):
        q[off : off + 48] = value
    q[OFF_REPORT_DATA : OFF_REPORT_DATA + 64] = report_data
    return bytes(q) + struct.pack("<I", len(sig) if sig_len is None else sig_len) + sig


def test_parser_reads_independently_packed_quote():
    raw = pack_quote(td_attributes=0)
    q = parse_quote(raw)
    assert (q.version, q.att_key_type, q.tee_type) == (4, 2, 0x81)
    assert q.qe_vendor_id == bytes(range(16))
    assert q.user_data == b"U" * 20
    assert q.tee_tcb_svn == b"\x01" * 16
    assert q.mrseam == b"\x02" * 48
    assert q.mrsignerseam == b"\x03" * 48
    assert q.xfam == b"\x05" * 8
    assert q.mrtd == b"\x11" * 48
    assert q.mrconfigid == b"\x06" * 48
    assert q.mrowner == b"\x07" * 48
    assert q.mrownerconfig == b"\x08" * 48
    assert q.rtmrs == (b"\x20" * 48, b"\x21" * 48, b"\x22" * 48, b"\x23" * 48)
    assert q.report_data == bytes(range(64))
    assert q.signature_data == b"signature-data"
    assert q.raw == raw
    assert q.signed_region == raw[:632]
    assert q.debug is False
    assert q.details()["mrtd"] == "11" * 48
    assert q.details()["rtmr3"] == "23" * 48


def test_debug_is_td_attributes_bit_0():
    assert parse_quote(pack_quote(td_attributes=1)).debug is True
    assert parse_quote(pack_quote(td_attributes=1 << 28)).debug is False  # SEPT_VE_DISABLE
    assert parse_quote(pack_quote(td_attributes=(1 << 28) | 1)).td_attributes == (1 << 28) | 1


def test_builder_writes_the_published_layout():
    kwargs = {
        "report_data": bytes(range(64)),
        "mrtd": b"\x11" * 48,
        "rtmrs": (b"\x20" * 48, b"\x21" * 48, b"\x22" * 48, b"\x23" * 48),
        "td_attributes": 0,
        "signature_data": b"signature-data",
        "qe_vendor_id": bytes(range(16)),
        "user_data": b"U" * 20,
        "tee_tcb_svn": b"\x01" * 16,
        "mrseam": b"\x02" * 48,
        "mrsignerseam": b"\x03" * 48,
        "xfam": b"\x05" * 8,
        "mrconfigid": b"\x06" * 48,
        "mrowner": b"\x07" * 48,
        "mrownerconfig": b"\x08" * 48,
    }
    assert build_quote_v4(**kwargs) == pack_quote()


def test_measurement_of_is_sha256_of_mrtd_and_rtmrs():
    q = parse_quote(pack_quote())
    expected = hashlib.sha256(
        b"\x11" * 48 + b"\x20" * 48 + b"\x21" * 48 + b"\x22" * 48 + b"\x23" * 48
    ).digest()
    assert measurement_of(q) == expected
    other = parse_quote(pack_quote(rtmrs=(b"\x20" * 48, b"\x21" * 48, b"\x22" * 48, b"\x24" * 48)))
    assert measurement_of(other) != expected


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"", "too short for the 48-byte header"),
        (pack_quote()[:47], "too short for the 48-byte header"),
        (pack_quote(version=3), "version at offset 0 is 3, expected 4"),
        (pack_quote(version=5), "version at offset 0 is 5"),
        (pack_quote(key_type=3), "attestation key type at offset 2 is 3"),
        (pack_quote(tee_type=0), "TEE type at offset 4 is 0x0"),
        (pack_quote()[:100], "TD report body at offset 48"),
        (pack_quote()[:634], "signature data length at offset 632"),
        (pack_quote(sig=b""), "length at offset 632 is 0"),
        (pack_quote(sig=b"abc", sig_len=10), "short: signature data length at offset 632 says 10"),
        (pack_quote(sig=b"abc", sig_len=2), "long: signature data length at offset 632 says 2"),
        (pack_quote() + b"\x00", "long"),
        (pack_quote()[:-1], "short"),
    ],
)
def test_malformed_quotes_are_refused_by_field(raw, needle):
    with pytest.raises(TdxQuoteError, match="TDX quote") as info:
        parse_quote(raw)
    assert needle in str(info.value)
    assert isinstance(info.value, EvidenceError) and isinstance(info.value, ValueError)


def test_parser_refuses_non_bytes_and_huge_input():
    with pytest.raises(TdxQuoteError, match="must be bytes"):
        parse_quote("not bytes")  # type: ignore[arg-type]
    with pytest.raises(TdxQuoteError, match="limit"):
        parse_quote(pack_quote(sig=bytes(2 << 20)))


def test_builder_refuses_wrong_field_sizes():
    with pytest.raises(ValueError, match="report_data must be 64 bytes"):
        build_quote_v4(report_data=bytes(63))
    with pytest.raises(ValueError, match="mrtd must be 48 bytes"):
        build_quote_v4(report_data=bytes(64), mrtd=bytes(32))
    with pytest.raises(ValueError, match="signature_data"):
        build_quote_v4(report_data=bytes(64), signature_data=b"")


# --- configfs-tsm ---------------------------------------------------------------------------


class FakeConfigfs:
    """A plain directory tree standing in for configfs-tsm: mkdir fills the entry with the files
    the kernel would create, rmdir removes it (recording what had been written to inblob)."""

    def __init__(self, root: Path, outblob: bytes, provider: str = "tdx_guest"):
        self.root = root
        self.outblob = outblob
        self.provider = provider
        self.inblobs: list[bytes] = []
        self.made: list[Path] = []
        root.mkdir(parents=True, exist_ok=True)

    def mkdir(self, path: Path) -> None:
        path.mkdir()
        self.made.append(path)
        (path / "provider").write_text(self.provider + "\n")
        (path / "inblob").write_bytes(b"")
        (path / "outblob").write_bytes(self.outblob)
        (path / "generation").write_text("1\n")

    def rmdir(self, path: Path) -> None:
        self.inblobs.append((path / "inblob").read_bytes())
        shutil.rmtree(path)

    def provider_for(self) -> TdxProvider:
        return TdxProvider(self.root, mkdir=self.mkdir, rmdir=self.rmdir)


RD = bytes(range(64))


def test_configfs_flow_against_fake_tree(tmp_path):
    quote = pack_quote(report_data=RD)
    fake = FakeConfigfs(tmp_path / "tsm" / "report", quote)
    provider = fake.provider_for()
    assert provider.quote(RD) == quote
    assert fake.inblobs == [RD]  # the 64 bytes went to inblob
    assert len(fake.made) == 1 and fake.made[0].parent == fake.root
    assert list(fake.root.iterdir()) == []  # the entry was removed
    ev = provider.evidence(RD)
    assert ev == Evidence(provider="tdx", quote=quote)
    assert fake.made[0] != fake.made[1]  # a fresh entry each time


def test_configfs_refuses_other_tsm_provider(tmp_path):
    fake = FakeConfigfs(tmp_path / "report", pack_quote(report_data=RD), provider="sev_guest")
    with pytest.raises(AttestationUnavailable, match="'sev_guest', not 'tdx_guest'"):
        fake.provider_for().quote(RD)
    assert list(fake.root.iterdir()) == []  # cleaned up even on failure


def test_configfs_refuses_quote_over_other_report_data(tmp_path):
    fake = FakeConfigfs(tmp_path / "report", pack_quote(report_data=bytes(64)))
    with pytest.raises(AttestationError, match="REPORTDATA is not what was written"):
        fake.provider_for().quote(RD)


def test_configfs_refuses_garbage_and_empty_outblob(tmp_path):
    fake = FakeConfigfs(tmp_path / "a", b"garbage")
    with pytest.raises(AttestationError, match="not a quote"):
        fake.provider_for().quote(RD)
    fake = FakeConfigfs(tmp_path / "b", b"")
    with pytest.raises(AttestationError, match="outblob is empty"):
        fake.provider_for().quote(RD)


def test_configfs_detects_generation_change(tmp_path, monkeypatch):
    """Another writer to the same entry bumps `generation` while this one reads outblob."""
    fake = FakeConfigfs(tmp_path / "report", pack_quote(report_data=RD))
    real_read_bytes = Path.read_bytes

    def read_bytes(self: Path) -> bytes:
        data = real_read_bytes(self)
        if self.name == "outblob":
            (self.parent / "generation").write_text("2\n")
        return data

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    with pytest.raises(AttestationError, match=r"generation 1 -> 2"):
        fake.provider_for().quote(RD)


def test_missing_configfs_says_so_and_names_dev(tmp_path):
    missing = tmp_path / "no" / "tsm" / "report"
    with pytest.raises(AttestationUnavailable) as info:
        TdxProvider(missing).quote(RD)
    text = str(info.value)
    assert f"configfs-tsm is missing at {missing}" in text
    assert "'dev' provider" in text and "PROVES NOTHING" in text
    with pytest.raises(AttestationUnavailable, match="configfs-tsm is missing"):
        open_provider("tdx", tsm_path=missing)


def test_default_path_is_the_kernel_one():
    assert str(TdxProvider().tsm_path) == "/sys/kernel/config/tsm/report"


def test_permission_denied_is_unavailable(tmp_path):
    def mkdir(path: Path) -> None:
        raise PermissionError(13, "Permission denied")

    (tmp_path / "report").mkdir()
    with pytest.raises(AttestationUnavailable, match="root or write access"):
        TdxProvider(tmp_path / "report", mkdir=mkdir).quote(RD)


def test_provider_requires_64_bytes(tmp_path):
    with pytest.raises(ValueError, match="64 bytes"):
        TdxProvider(tmp_path).quote(bytes(32))


# --- DCAP verification policy ----------------------------------------------------------------


TDX_QUOTE = pack_quote(report_data=RD)


@pytest.fixture
def no_dcap(monkeypatch):
    monkeypatch.setitem(sys.modules, "dcap_qvl", None)  # import raises ImportError
    monkeypatch.delenv("DILOCOX_DCAP_COLLATERAL", raising=False)


@pytest.fixture
def fake_dcap(monkeypatch):
    """A stand-in for the dcap_qvl module with the API this package calls."""
    calls: list[tuple] = []
    mod = types.ModuleType("dcap_qvl")
    mod.status = "UpToDate"
    mod.fail = None

    class QuoteCollateralV3:
        def __init__(self, text):
            self.text = text

        @classmethod
        def from_json(cls, text):
            if not text.startswith("{"):
                raise ValueError("bad collateral json")
            return cls(text)

    def verify(quote, collateral, now):
        calls.append((quote, collateral.text, now))
        if mod.fail:
            raise ValueError(mod.fail)
        return types.SimpleNamespace(status=mod.status, advisory_ids=["INTEL-SA-00001"])

    mod.QuoteCollateralV3 = QuoteCollateralV3
    mod.verify = verify
    mod.calls = calls
    monkeypatch.setitem(sys.modules, "dcap_qvl", mod)
    monkeypatch.delenv("DILOCOX_DCAP_COLLATERAL", raising=False)
    return mod


def test_tdx_without_dcap_is_accepted_but_proves_nothing(no_dcap):
    v = verify_evidence(Evidence("tdx", TDX_QUOTE), expected_report_data=RD, policy=Policy())
    assert v.provider == "tdx"
    assert v.proves_nothing is True
    assert "NOT verified" in v.warnings[0] and "dcap-qvl is not installed" in v.warnings[0]
    assert v.measurement == measurement_of(parse_quote(TDX_QUOTE))
    assert v.details["mrtd"] == "11" * 48


def test_require_dcap_refuses_without_dcap(no_dcap):
    with pytest.raises(PolicyViolation, match="require_dcap=True") as info:
        verify_evidence(
            Evidence("tdx", TDX_QUOTE), expected_report_data=RD, policy=Policy(require_dcap=True)
        )
    assert info.value.check == "dcap"
    assert "dcap-qvl is not installed" in str(info.value)


def test_require_dcap_refuses_without_collateral(fake_dcap):
    with pytest.raises(PolicyViolation, match="no DCAP collateral"):
        verify_evidence(
            Evidence("tdx", TDX_QUOTE), expected_report_data=RD, policy=Policy(require_dcap=True)
        )


def test_dcap_verified_quote_proves_something(fake_dcap, tmp_path, monkeypatch):
    v = verify_evidence(
        Evidence("tdx", TDX_QUOTE),
        expected_report_data=RD,
        policy=Policy(require_dcap=True),
        collateral='{"tcb_info": "x"}',
        now=1_700_000_000,
    )
    assert v.proves_nothing is False and v.warnings == ()
    assert v.details["tcb_status"] == "UpToDate"
    assert fake_dcap.calls == [(TDX_QUOTE, '{"tcb_info": "x"}', 1_700_000_000)]
    # collateral from a file named by the environment
    path = tmp_path / "collateral.json"
    path.write_text('{"from": "env"}')
    monkeypatch.setenv("DILOCOX_DCAP_COLLATERAL", str(path))
    verify_evidence(Evidence("tdx", TDX_QUOTE), expected_report_data=RD, policy=Policy(require_dcap=True))
    assert fake_dcap.calls[-1][1] == '{"from": "env"}'


def test_dcap_failures_and_tcb_status_are_refused(fake_dcap):
    ev = Evidence("tdx", TDX_QUOTE)
    fake_dcap.status = "OutOfDate"
    with pytest.raises(PolicyViolation, match="TCB status 'OutOfDate' is not allowed") as info:
        verify_evidence(ev, expected_report_data=RD, policy=Policy(), collateral="{}")
    assert info.value.check == "dcap" and "INTEL-SA-00001" in str(info.value)
    ok = Policy(allowed_tcb_statuses=frozenset({"UpToDate", "OutOfDate"}))
    assert verify_evidence(ev, expected_report_data=RD, policy=ok, collateral="{}").details[
        "tcb_status"
    ] == "OutOfDate"
    fake_dcap.fail = "signature mismatch"
    with pytest.raises(PolicyViolation, match="dcap-qvl refused the quote: signature mismatch"):
        verify_evidence(ev, expected_report_data=RD, policy=Policy(), collateral="{}")
    with pytest.raises(PolicyViolation, match="not valid QuoteCollateralV3 JSON"):
        verify_evidence(ev, expected_report_data=RD, policy=Policy(), collateral="nope")


def test_tdx_debug_refused_by_default_and_allowed_by_policy(no_dcap):
    ev = Evidence("tdx", pack_quote(report_data=RD, td_attributes=1))
    with pytest.raises(PolicyViolation, match="TUD.DEBUG") as info:
        verify_evidence(ev, expected_report_data=RD, policy=Policy())
    assert info.value.check == "debug"
    v = verify_evidence(ev, expected_report_data=RD, policy=Policy(allow_debug=True))
    assert v.debug is True


def test_tdx_measurement_allowlist(no_dcap):
    ev = Evidence("tdx", TDX_QUOTE)
    m = measurement_of(parse_quote(TDX_QUOTE))
    assert verify_evidence(
        ev, expected_report_data=RD, policy=Policy(allowed_measurements=frozenset({m}))
    ).measurement == m
    with pytest.raises(PolicyViolation, match=f"measurement {m.hex()} is not in the policy's allowlist") as info:
        verify_evidence(ev, expected_report_data=RD, policy=Policy(allowed_measurements=frozenset()))
    assert info.value.check == "measurement"
    # the code measurement in REPORTDATA[32:64] is not the tdx measurement
    with pytest.raises(PolicyViolation, match="measurement"):
        verify_evidence(
            ev, expected_report_data=RD, policy=Policy(allowed_measurements=frozenset({RD[32:]}))
        )


def test_tdx_report_data_mismatch(no_dcap):
    with pytest.raises(PolicyViolation, match="REPORTDATA is") as info:
        verify_evidence(Evidence("tdx", TDX_QUOTE), expected_report_data=bytes(64), policy=Policy())
    assert info.value.check == "report_data"
    assert RD.hex() in str(info.value) and ("00" * 64) in str(info.value)
