"""Tests for attestation.tdx and the DCAP gate: the quote v4/v5 layouts (packed here independently),
the configfs-tsm provider, and that no TDX quote is accepted without dcap-qvl's verification.

Real quotes and collateral are exercised in test_tdx_real_quotes.py."""

from __future__ import annotations

import hashlib
import shutil
import struct
from pathlib import Path

import pytest

from attestation import (
    AttestationError,
    AttestationUnavailable,
    DcapSettings,
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


def pack_quote_v5(
    *,
    body_type: int = 3,
    body_size: int | None = None,
    report_data: bytes = bytes(range(64)),
    tee_tcb_svn2: bytes = b"\x31" * 16,
    mrservicetd: bytes = b"\x32" * 48,
    sig: bytes = b"signature-data",
    sig_len: int | None = None,
) -> bytes:
    """A v5 quote: the v4 header with version 5, then u16 body type and u32 body size at 48, the
    body at 54 (TD report 1.0 fields, and for type 3 TEE_TCB_SVN2 and MRSERVICETD), then the
    signature data length and the signature data."""
    v4 = pack_quote(version=5, report_data=report_data)
    body10 = v4[48:632]
    body = body10 + (tee_tcb_svn2 + mrservicetd if body_type == 3 else b"")
    size = len(body) if body_size is None else body_size
    return (v4[:48] + struct.pack("<HI", body_type, size) + body
            + struct.pack("<I", len(sig) if sig_len is None else sig_len) + sig)


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
        (pack_quote(version=3), "version at offset 0 is 3, expected 4 or 5"),
        (pack_quote(version=6), "version at offset 0 is 6"),
        (pack_quote(version=5), "body type at offset 48 is 257"),  # v4 layout labelled v5
        (pack_quote(key_type=3), "attestation key type at offset 2 is 3"),
        (pack_quote(tee_type=0), "TEE type at offset 4 is 0x0"),
        (pack_quote()[:100], "TD report body at offset 48"),
        (pack_quote()[:634], "signature data length at offset 632"),
        (pack_quote(sig=b""), "length at offset 632 is 0"),
        (pack_quote(sig=b"abc", sig_len=10), "short: signature data length at offset 632 says 10"),
        (pack_quote()[:-1], "short"),
        (pack_quote_v5()[:50], "too short for the 6-byte body type and size at offset 48"),
        (pack_quote_v5(body_type=1), "body type at offset 48 is 1"),
        (pack_quote_v5(body_type=4), "body type at offset 48 is 4"),
        (pack_quote_v5(body_type=3, body_size=584), "body size at offset 50 is 584, but body type 3"),
        (pack_quote_v5(body_type=2, body_size=648), "body size at offset 50 is 648, but body type 2"),
        (pack_quote_v5()[:600], "648-byte TD report body at offset 54 needs 702"),
        (pack_quote_v5(body_type=2)[:640], "signature data length at offset 638"),
        (pack_quote_v5(sig=b""), "length at offset 702 is 0"),
        (pack_quote_v5(sig=b"abc", sig_len=4), "short: signature data length at offset 702 says 4"),
    ],
)
def test_malformed_quotes_are_refused_by_field(raw, needle):
    with pytest.raises(TdxQuoteError, match="TDX quote") as info:
        parse_quote(raw)
    assert needle in str(info.value)
    assert isinstance(info.value, EvidenceError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("padding", [b"", b"\x00", bytes(70), b"\nextra bytes\n" * 3],
                         ids=["none", "one-zero", "70-zeros", "text"])
def test_padding_after_the_signature_data_is_ignored(padding):
    quote = pack_quote()
    q = parse_quote(quote + padding)
    assert q.raw == quote and q.signature_data == b"signature-data"
    assert q.signed_region == quote[:632]
    # a declared length shorter than what follows reads the rest as padding
    q = parse_quote(pack_quote(sig=b"abc", sig_len=2) + padding)
    assert q.signature_data == b"ab" and len(q.raw) == 636 + 2


def test_parser_reads_independently_packed_v5_quotes():
    raw = pack_quote_v5(body_type=3)
    q = parse_quote(raw + bytes(39))
    assert (q.version, q.body_type, q.body_offset) == (5, 3, 54)
    assert q.raw == raw and len(raw) == 54 + 648 + 4 + len(b"signature-data")
    assert q.tee_tcb_svn2 == b"\x31" * 16 and q.mrservicetd == b"\x32" * 48
    assert q.mrtd == b"\x11" * 48 and q.rtmr3 == b"\x23" * 48 and q.report_data == bytes(range(64))
    assert q.td_attributes == 0 and q.xfam == b"\x05" * 8
    assert q.signature_data == b"signature-data"
    assert q.signed_region == raw[: 54 + 648]
    assert q.details()["mrservicetd"] == "32" * 48 and q.details()["body_type"] == "3"
    assert measurement_of(q) == measurement_of(parse_quote(pack_quote()))  # same MRTD and RTMRs

    q10 = parse_quote(pack_quote_v5(body_type=2))
    assert (q10.version, q10.body_type) == (5, 2)
    assert q10.tee_tcb_svn2 is None and q10.mrservicetd is None
    assert q10.signed_region == pack_quote_v5(body_type=2)[: 54 + 584]
    assert q10.report_data == bytes(range(64))

    v4 = parse_quote(pack_quote())
    assert v4.body_type is None and v4.tee_tcb_svn2 is None and v4.mrservicetd is None
    assert "body_type" not in v4.details()


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


# --- the DCAP gate: no TDX quote without dcap-qvl -------------------------------------------
# (real quotes, real collateral and dcap-qvl's verdicts are in test_tdx_real_quotes.py)


TDX_QUOTE = pack_quote(report_data=RD)


def test_tdx_without_collateral_is_refused_not_admitted_unverified():
    """The default policy names no collateral: TDX evidence is refused by the dcap check, and there
    is no setting that accepts it unverified."""
    with pytest.raises(PolicyViolation) as info:
        verify_evidence(Evidence("tdx", TDX_QUOTE), expected_report_data=RD, policy=Policy())
    assert info.value.check == "dcap"
    assert "no DCAP collateral is configured" in str(info.value)
    assert "never accepted" in str(info.value)
    for gone in ("require_dcap", "allowed_tcb_statuses"):
        with pytest.raises(TypeError):
            Policy(**{gone: True})  # type: ignore[arg-type]


def test_unsigned_quote_is_refused_by_dcap_qvl(tmp_path):
    """A quote of the right layout but no Intel signature chain never reaches the later checks."""
    collateral = tmp_path / "collateral.json"
    collateral.write_text('{"tcb_info": "x"}')
    policy = Policy(dcap=DcapSettings(collateral_file=collateral))
    with pytest.raises(PolicyViolation) as info:
        verify_evidence(Evidence("tdx", TDX_QUOTE), expected_report_data=RD, policy=policy)
    assert info.value.check == "dcap" and "not QuoteCollateralV3 JSON" in str(info.value)
    # refused whatever else the policy allows, and before REPORTDATA is even compared
    lax = Policy(allow_debug=True, allow_dev=True, dcap=DcapSettings(collateral_file=tmp_path / "missing.json"))
    with pytest.raises(PolicyViolation) as info:
        verify_evidence(Evidence("tdx", pack_quote(report_data=RD, td_attributes=1)),
                        expected_report_data=bytes(64), policy=lax)
    assert info.value.check == "dcap" and "cannot read the DCAP collateral file" in str(info.value)


def test_dcap_settings_validate():
    assert DcapSettings().allowed_tcb_statuses == frozenset({"UpToDate"})
    assert DcapSettings().source is None
    assert DcapSettings(collateral_file="c.json").collateral_file == Path("c.json")
    assert DcapSettings(pccs_url="https://pccs.example/").pccs_url == "https://pccs.example"
    assert DcapSettings(pccs_url="https://pccs.example").source == "PCCS https://pccs.example"
    with pytest.raises(ValueError, match="not both"):
        DcapSettings(collateral_file="c.json", pccs_url="https://pccs.example")
    with pytest.raises(ValueError, match="http"):
        DcapSettings(pccs_url="file:///etc/passwd")
    with pytest.raises(ValueError, match="unknown TCB status"):
        DcapSettings(allowed_tcb_statuses=frozenset({"UpToDate", "Revoked"}))
    with pytest.raises(ValueError, match="unknown TCB status"):
        DcapSettings(allowed_tcb_statuses=frozenset({"uptodate"}))
    with pytest.raises(ValueError, match="empty"):
        DcapSettings(allowed_tcb_statuses=frozenset())
    with pytest.raises(TypeError):
        DcapSettings(allowed_tcb_statuses="UpToDate")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="DcapSettings"):
        Policy(dcap={"collateral_file": "c.json"})  # type: ignore[arg-type]
    ok = DcapSettings(allowed_tcb_statuses=frozenset({"UpToDate", "SWHardeningNeeded"}))
    assert Policy(dcap=ok).dcap.allowed_tcb_statuses == {"UpToDate", "SWHardeningNeeded"}
