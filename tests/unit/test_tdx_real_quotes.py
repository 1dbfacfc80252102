"""Real TDX quotes: the parser against published expected values, and dcap-qvl's verdicts through
verify_evidence (genuine, forged, expired, outdated, unconfigured).

The quotes and their collateral are public test data in ../shared/attestation (see its README),
read in place and never copied into this repository. Where that folder is absent every test here
fails, naming it (tests.conftest.shared_path): a missing input must not pass as a skip.
"""

from __future__ import annotations

import asyncio
import json
import re
import struct
import time
import types
from datetime import datetime, timezone
from pathlib import Path

import dcap_qvl
import pytest

from attestation import (
    TCB_STATUSES,
    DcapSettings,
    Evidence,
    Policy,
    PolicyViolation,
    measurement_of,
    parse_quote,
    verify_evidence,
)
from tests.conftest import SHARED as SHARED_ROOT, shared_path

SHARED = SHARED_ROOT / "attestation"


@pytest.fixture(autouse=True)
def _sample_quotes_present() -> None:
    """Every test here reads the sample quotes: without them it fails, naming the folder."""
    shared_path("attestation")


DCAP_QUOTE = SHARED / "dcap-qvl" / "tdx_quote"
DCAP_COLLATERAL = SHARED / "dcap-qvl" / "tdx_quote_collateral.json"
DCAP_SNAPSHOT = SHARED / "dcap-qvl" / "verify_quote__could_parse_tdx_quote.snap"
OUTDATED_QUOTE = SHARED / "dcap-qvl" / "tdx_quote_outdated"
OUTDATED_COLLATERAL = SHARED / "dcap-qvl" / "tdx_quote_outdated_collateral.json"
GO_QUOTE = SHARED / "go-tdx-guest" / "tdx_prod_quote_SPR_E4.dat"
GO_EXPECTED = SHARED / "go-tdx-guest" / "tdx_prod_quote_SPR_E4.expected.json"

REPORT_DATA_V4 = 48 + 520  # quote offset of REPORTDATA in a v4 quote
MRTD_V4 = 48 + 136


def unix(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp())


# The sample collateral is issued 2025-06-19 and next updated 2025-07-19 (README).
INSIDE_WINDOW = unix("2025-06-25T00:00:00")
OUTDATED_INSIDE_WINDOW = unix("2026-03-01T00:00:00")  # its collateral: 2026-02-18 .. 2026-03-20


def policy_for(collateral: Path, **dcap: object) -> Policy:
    return Policy(dcap=DcapSettings(collateral_file=collateral, **dcap))  # type: ignore[arg-type]


# --- parsing --------------------------------------------------------------------------------


def test_go_tdx_guest_production_quote_matches_its_expected_values():
    data = GO_QUOTE.read_bytes()
    expected = json.loads(GO_EXPECTED.read_text())
    q = parse_quote(data)
    assert (q.version, q.att_key_type, q.tee_type, q.body_type) == (4, 2, 0x81, None)
    (sig_len,) = struct.unpack_from("<I", data, 632)
    assert len(q.raw) == 636 + sig_len == len(data) - 39  # 39 bytes of padding dropped
    assert q.raw == data[: len(q.raw)] and q.signature_data == data[636 : 636 + sig_len]
    got = {
        "mrconfigid": q.mrconfigid,
        "mrowner": q.mrowner,
        "mrownerconfig": q.mrownerconfig,
        "mrseam": q.mrseam,
        "mrtd": q.mrtd,
        "qe_vendor_id": q.qe_vendor_id,
        "report_data": q.report_data,
        "rtmr0": q.rtmr0,
        "rtmr1": q.rtmr1,
        "rtmr2": q.rtmr2,
        "rtmr3": q.rtmr3,
        "td_attributes": struct.pack("<Q", q.td_attributes),
        "xfam": q.xfam,
    }
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert got[name].hex() == value, name
    assert q.debug is False


def _snapshot_values(text: str) -> dict[str, object]:
    """The first value of each field in dcap-qvl's Rust debug print: byte arrays as bytes,
    integers as int."""
    values: dict[str, object] = {}
    for match in re.finditer(r"(\w+): (?:\[([\d,\s]*)\]|(\d+),)", text):
        name, array, number = match.groups()
        if name in values:
            continue
        values[name] = bytes(int(b) for b in array.split(",") if b.strip()) if array is not None else int(number)
    return values


def test_dcap_qvl_sample_quote_matches_its_snapshot():
    data = DCAP_QUOTE.read_bytes()
    snap = _snapshot_values(DCAP_SNAPSHOT.read_text())
    q = parse_quote(data)
    assert len(data) - len(q.raw) == 70 and data[len(q.raw) :] == bytes(70)
    assert (q.version, q.att_key_type, q.tee_type) == (snap["version"], snap["attestation_key_type"], snap["tee_type"])
    assert (q.reserved1, q.reserved2) == (snap["qe_svn"], snap["pce_svn"])
    pairs = {
        "qe_vendor_id": q.qe_vendor_id,
        "user_data": q.user_data,
        "tee_tcb_svn": q.tee_tcb_svn,
        "mr_seam": q.mrseam,
        "mr_signer_seam": q.mrsignerseam,
        "seam_attributes": q.seam_attributes,
        "td_attributes": struct.pack("<Q", q.td_attributes),
        "xfam": q.xfam,
        "mr_td": q.mrtd,
        "mr_config_id": q.mrconfigid,
        "mr_owner": q.mrowner,
        "mr_owner_config": q.mrownerconfig,
        "rt_mr0": q.rtmr0,
        "rt_mr1": q.rtmr1,
        "rt_mr2": q.rtmr2,
        "rt_mr3": q.rtmr3,
        "report_data": q.report_data,
        # the signature data starts with the ECDSA signature and the attestation key
        "ecdsa_signature": q.signature_data[:64],
        "ecdsa_attestation_key": q.signature_data[64:128],
    }
    for name, value in pairs.items():
        assert value == snap[name], name
    assert q.signed_region == data[:632]


@pytest.mark.parametrize("path", [DCAP_QUOTE, GO_QUOTE, OUTDATED_QUOTE], ids=["dcap-qvl", "go-tdx-guest", "v5"])
def test_every_sample_agrees_with_dcap_qvls_own_parser(path):
    data = path.read_bytes()
    q = parse_quote(data)
    theirs = dcap_qvl.parse_quote(data)
    assert theirs.header.version == q.version and theirs.header.qe_vendor_id == q.qe_vendor_id
    r = theirs.report
    for ours, name in ((q.tee_tcb_svn, "tee_tcb_svn"), (q.mrseam, "mr_seam"), (q.mrtd, "mr_td"),
                       (q.mrconfigid, "mr_config_id"), (q.rtmr0, "rt_mr0"), (q.rtmr1, "rt_mr1"),
                       (q.rtmr2, "rt_mr2"), (q.rtmr3, "rt_mr3"), (q.report_data, "report_data"),
                       (struct.pack("<Q", q.td_attributes), "td_attributes"), (q.xfam, "xfam")):
        assert ours == getattr(r, name), name


def test_v5_outdated_quote_parses_with_td_report_15():
    data = OUTDATED_QUOTE.read_bytes()
    q = parse_quote(data)
    assert (q.version, q.body_type, q.body_offset) == (5, 3, 54)
    assert struct.unpack_from("<HI", data, 48) == (3, 648)
    (sig_len,) = struct.unpack_from("<I", data, 54 + 648)
    assert q.raw == data and len(data) == 54 + 648 + 4 + sig_len  # this one has no padding
    assert q.signed_region == data[: 54 + 648]
    report = dcap_qvl.parse_quote(data).report
    assert type(report).__name__ == "PyTdReport15"
    assert q.tee_tcb_svn2 == report.tee_tcb_svn2 == data[54 + 584 : 54 + 600]
    assert q.mrservicetd == report.mr_service_td == data[54 + 600 : 54 + 648]
    assert q.report_data == data[54 + 520 : 54 + 584]
    assert q.mrtd == data[54 + 136 : 54 + 184]
    assert q.details()["quote_version"] == "5" and "mrservicetd" in q.details()


# --- dcap-qvl through verify_evidence ------------------------------------------------------


def test_genuine_v4_quote_verifies_up_to_date_inside_its_collateral_window():
    data = DCAP_QUOTE.read_bytes()
    q = parse_quote(data)
    policy = Policy(allowed_measurements=frozenset({measurement_of(q)}),
                    dcap=DcapSettings(collateral_file=DCAP_COLLATERAL))
    v = verify_evidence(Evidence("tdx", data), expected_report_data=q.report_data, policy=policy,
                        now=INSIDE_WINDOW)
    assert v.provider == "tdx" and v.proves_nothing is False and v.warnings == ()
    assert v.details["tcb_status"] == "UpToDate"
    assert v.details["collateral"] == f"collateral file {DCAP_COLLATERAL}"
    assert v.details["verified_at"] == str(INSIDE_WINDOW)
    assert v.measurement == measurement_of(q) and v.report_data == q.report_data
    assert "UpToDate" in v.label and "DEV" not in v.label
    # the same evidence through its canonical bytes
    again = verify_evidence(Evidence("tdx", data).to_bytes(), expected_report_data=q.report_data,
                            policy=policy, now=INSIDE_WINDOW)
    assert again.measurement == v.measurement
    # and the quote's REPORTDATA is still compared with what the verifier expects
    with pytest.raises(PolicyViolation) as info:
        verify_evidence(Evidence("tdx", data), expected_report_data=bytes(64), policy=policy, now=INSIDE_WINDOW)
    assert info.value.check == "report_data"
    with pytest.raises(PolicyViolation) as info:
        verify_evidence(Evidence("tdx", data), expected_report_data=q.report_data,
                        policy=Policy(allowed_measurements=frozenset({bytes(32)}),
                                      dcap=DcapSettings(collateral_file=DCAP_COLLATERAL)),
                        now=INSIDE_WINDOW)
    assert info.value.check == "measurement"


@pytest.mark.parametrize(("offset", "size"), [(REPORT_DATA_V4, 64), (MRTD_V4, 48)], ids=["REPORTDATA", "MRTD"])
def test_rewritten_quote_is_refused_by_its_signature(offset, size):
    """The attack the review ran: copy a public quote and put your own REPORTDATA into it."""
    data = DCAP_QUOTE.read_bytes()
    forged = data[:offset] + b"\x42" * size + data[offset + size :]
    claimed = parse_quote(forged).report_data
    with pytest.raises(PolicyViolation) as info:
        verify_evidence(Evidence("tdx", forged), expected_report_data=claimed,
                        policy=policy_for(DCAP_COLLATERAL), now=INSIDE_WINDOW)
    assert info.value.check == "dcap"
    message = str(info.value)
    assert "signature does not verify" in message
    assert len(message) < 400 and forged.hex()[:64] not in message  # short, and no quote dump


def test_genuine_quote_is_refused_today_naming_the_collaterals_expiry():
    data = DCAP_QUOTE.read_bytes()
    q = parse_quote(data)
    assert time.time() > unix("2025-07-19T10:16:03"), "this test expects the real clock to be past the window"
    for now in (None, unix("2026-11-01T00:00:00")):  # the real clock, and a fixed day in 2026-11
        with pytest.raises(PolicyViolation) as info:
            verify_evidence(Evidence("tdx", data), expected_report_data=q.report_data,
                            policy=policy_for(DCAP_COLLATERAL), now=now)
        assert info.value.check == "dcap"
        assert "collateral" in str(info.value) and "expired on 2025-07-19T10:16:03Z" in str(info.value)
        assert "issued 2025-06-19" in str(info.value)
    with pytest.raises(PolicyViolation, match="not valid yet at 2025-06-01T00:00:00Z"):
        verify_evidence(Evidence("tdx", data), expected_report_data=q.report_data,
                        policy=policy_for(DCAP_COLLATERAL), now=unix("2025-06-01T00:00:00"))


def test_crl_expiry_inside_the_tcb_info_window_is_named():
    """The CRLs' next update (10:00:35) comes before the TCB info's (10:16:03) on 2025-07-19:
    dcap-qvl refuses on the CRL, and the message names its date."""
    data = DCAP_QUOTE.read_bytes()
    with pytest.raises(PolicyViolation) as info:
        verify_evidence(Evidence("tdx", data), expected_report_data=parse_quote(data).report_data,
                        policy=policy_for(DCAP_COLLATERAL), now=unix("2025-07-19T10:10:00"))
    assert info.value.check == "dcap"
    assert "expired" in str(info.value) and "2025-07-19T10:00:35Z" in str(info.value)


def test_outdated_v5_quote_is_refused_by_tcb_status():
    """dcap-qvl finds no TCB level of its collateral that this platform meets (its own tests need a
    TCB override to pass it): there is no status to allow, so it is refused whatever is allowed."""
    data = OUTDATED_QUOTE.read_bytes()
    q = parse_quote(data)
    for allowed in (frozenset({"UpToDate"}), frozenset(TCB_STATUSES)):
        with pytest.raises(PolicyViolation) as info:
            verify_evidence(Evidence("tdx", data), expected_report_data=q.report_data,
                            policy=policy_for(OUTDATED_COLLATERAL, allowed_tcb_statuses=allowed),
                            now=OUTDATED_INSIDE_WINDOW)
        assert info.value.check == "dcap"
        assert "TCB status" in str(info.value) and "No matching TCB level found" in str(info.value)


def test_tcb_status_other_than_up_to_date_must_be_named(monkeypatch):
    """The status policy itself. No sample quote is OutOfDate, so dcap-qvl's verdict is replaced
    here (only the verdict; collateral loading and the window check are real)."""
    data = DCAP_QUOTE.read_bytes()
    q = parse_quote(data)
    calls = []

    def verify(quote, collateral, now):
        calls.append((quote, now))
        return types.SimpleNamespace(status="OutOfDate", advisory_ids=["INTEL-SA-00837"])

    monkeypatch.setattr(dcap_qvl, "verify", verify)
    with pytest.raises(PolicyViolation) as info:
        verify_evidence(Evidence("tdx", data + bytes(7)), expected_report_data=q.report_data,
                        policy=policy_for(DCAP_COLLATERAL), now=INSIDE_WINDOW)
    assert info.value.check == "dcap"
    assert "TCB status 'OutOfDate' is not allowed (allowed: UpToDate)" in str(info.value)
    assert "INTEL-SA-00837" in str(info.value)
    assert calls == [(q.raw, INSIDE_WINDOW)]  # dcap-qvl gets the quote without padding
    v = verify_evidence(Evidence("tdx", data), expected_report_data=q.report_data, now=INSIDE_WINDOW,
                        policy=policy_for(DCAP_COLLATERAL, allowed_tcb_statuses=frozenset({"UpToDate", "OutOfDate"})))
    assert v.details["tcb_status"] == "OutOfDate" and v.details["advisory_ids"] == "INTEL-SA-00837"


def test_tdx_evidence_without_collateral_is_refused():
    data = DCAP_QUOTE.read_bytes()
    q = parse_quote(data)
    for policy in (Policy(), Policy(allow_dev=True, allow_debug=True, allowed_measurements=None)):
        with pytest.raises(PolicyViolation) as info:
            verify_evidence(Evidence("tdx", data), expected_report_data=q.report_data, policy=policy,
                            now=INSIDE_WINDOW)
        assert info.value.check == "dcap" and "no DCAP collateral is configured" in str(info.value)


def test_collateral_of_another_platform_is_refused():
    data = DCAP_QUOTE.read_bytes()
    with pytest.raises(PolicyViolation) as info:
        verify_evidence(Evidence("tdx", data), expected_report_data=parse_quote(data).report_data,
                        policy=policy_for(OUTDATED_COLLATERAL), now=OUTDATED_INSIDE_WINDOW)
    assert info.value.check == "dcap" and "another platform" in str(info.value)


def test_collateral_from_a_pccs(monkeypatch):
    """get_collateral is dcap-qvl's fetch; here it hands back the sample collateral (nothing is
    downloaded), and dcap-qvl verifies with it for real."""
    data = DCAP_QUOTE.read_bytes()
    q = parse_quote(data)
    fetched = []

    async def get_collateral(url, quote):
        fetched.append((url, quote))
        await asyncio.sleep(0)
        return dcap_qvl.QuoteCollateralV3.from_json(DCAP_COLLATERAL.read_text())

    monkeypatch.setattr(dcap_qvl, "get_collateral", get_collateral)
    policy = Policy(dcap=DcapSettings(pccs_url="https://pccs.example/"))
    v = verify_evidence(Evidence("tdx", data), expected_report_data=q.report_data, policy=policy,
                        now=INSIDE_WINDOW)
    assert v.details["tcb_status"] == "UpToDate" and v.details["collateral"] == "PCCS https://pccs.example"
    assert fetched == [("https://pccs.example", q.raw)]

    async def verify_inside_a_running_loop():
        return verify_evidence(Evidence("tdx", data), expected_report_data=q.report_data, policy=policy,
                               now=INSIDE_WINDOW)

    assert asyncio.run(verify_inside_a_running_loop()).details["tcb_status"] == "UpToDate"

    async def slow(url, quote):
        await asyncio.sleep(5)

    monkeypatch.setattr(dcap_qvl, "get_collateral", slow)
    with pytest.raises(PolicyViolation, match="did not deliver collateral within 0.05s") as info:
        verify_evidence(Evidence("tdx", data), expected_report_data=q.report_data, now=INSIDE_WINDOW,
                        policy=Policy(dcap=DcapSettings(pccs_url="https://pccs.example", pccs_timeout_s=0.05)))
    assert info.value.check == "dcap"


def test_unreachable_pccs_is_a_refusal_through_the_real_binding():
    """dcap-qvl's real fetch, against a local port where nothing listens (no network is used)."""
    data = DCAP_QUOTE.read_bytes()
    with pytest.raises(PolicyViolation) as info:
        verify_evidence(Evidence("tdx", data), expected_report_data=parse_quote(data).report_data,
                        policy=Policy(dcap=DcapSettings(pccs_url="http://127.0.0.1:1", pccs_timeout_s=10)))
    assert info.value.check == "dcap" and "cannot fetch collateral from PCCS http://127.0.0.1:1" in str(info.value)


@pytest.mark.parametrize(
    ("content", "needle"),
    [(b"{" * 100, "nests deeper"), (b"not json", "not JSON"), (b'{"tcb_info": 1}', "not QuoteCollateralV3 JSON")],
    ids=["nested", "not-json", "wrong-shape"],
)
def test_bad_collateral_files_are_refused_by_name(tmp_path, content, needle):
    path = tmp_path / "collateral.json"
    path.write_bytes(content)
    data = DCAP_QUOTE.read_bytes()
    with pytest.raises(PolicyViolation, match=needle) as info:
        verify_evidence(Evidence("tdx", data), expected_report_data=parse_quote(data).report_data,
                        policy=policy_for(path), now=INSIDE_WINDOW)
    assert info.value.check == "dcap"
