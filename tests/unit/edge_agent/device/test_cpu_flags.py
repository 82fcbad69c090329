"""The agent reports its CPU's INT8-relevant instruction-set flags in its capabilities, read from
/proc/cpuinfo (a fake one here), so the controller can tell a VNNI CPU from one whose INT8 kernels
saturate; the field is additive, so births from older agents still decode."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.device.health import Health, cpu_flags
from fleet_protocol.codec import decode_as, encode
from fleet_protocol.messages import Availability, Capabilities, cpu_flags_from_cpuinfo

# Shortened from real machines: two processors (only the first is read), the flags line long.
XEON_SAPPHIRE = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c avx2 bmi2 avx512f avx512dq avx512_vnni \
avx512_bf16 avx_vnni amx_bf16 amx_tile amx_int8

processor\t: 1
flags\t\t: fpu vme sse sse2 avx avx2
"""
EPYC_MILAN = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7763 64-Core Processor
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi1 bmi2 sha_ni
"""
GRAVITON = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc \
dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm \
i8mm bf16 dgh rng
CPU implementer\t: 0x41
"""


@pytest.mark.parametrize(
    ("text", "flags"),
    [
        (XEON_SAPPHIRE, ["avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8"]),
        (EPYC_MILAN, ["avx2"]),
        (GRAVITON, ["neon", "dotprod", "i8mm"]),
        ("processor\t: 0\nflags\t\t: fpu sse sse2\n", []),  # reported, none of the known ones
        ("processor\t: 0\nmodel name\t: something\n", None),  # no flags line: unknown
        ("", None),
    ],
    ids=["xeon-vnni-amx", "epyc-avx2", "arm-dotprod", "old-x86", "no-flags-line", "empty"],
)
def test_flags_from_cpuinfo_text(text: str, flags: list[str] | None) -> None:
    assert cpu_flags_from_cpuinfo(text) == flags


def test_capabilities_carry_the_flags_of_the_cpuinfo_given(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(EPYC_MILAN)
    caps = Health(tmp_path, cpuinfo=info).capabilities(["cam1"])
    assert caps.cpu_flags == ["avx2"]
    assert caps.has_vnni is False
    info.write_text(XEON_SAPPHIRE)
    assert Health(tmp_path, cpuinfo=info).capabilities([]).has_vnni is True


def test_unreadable_cpuinfo_reports_no_flags(tmp_path: Path) -> None:
    assert cpu_flags(tmp_path / "absent") is None
    caps = Health(tmp_path, cpuinfo=tmp_path / "absent").capabilities([])
    assert caps.cpu_flags is None and caps.has_vnni is None


def test_birth_round_trips_with_flags_and_old_births_still_decode() -> None:
    msg = Availability(state="online", capabilities=Capabilities(cpu_count=2, cpu_flags=["avx2", "avx_vnni"]))
    back = decode_as(Availability, encode(msg))
    assert isinstance(back, Availability) and back.capabilities is not None
    assert back.capabilities.cpu_flags == ["avx2", "avx_vnni"]
    # An agent older than the field sends no cpu_flags: valid, and "unknown" rather than "none".
    old = Capabilities.model_validate({"cpu_count": 2, "execution_providers": ["CPUExecutionProvider"]})
    assert old.cpu_flags is None and old.has_vnni is None


def test_flags_outside_the_known_set_are_dropped_not_refused() -> None:
    # A newer agent may know more flags; its birth must still decode on this controller.
    caps = Capabilities.model_validate({"cpu_flags": ["avx512_vnni", "sme2", "avx2", "avx2"]})
    assert caps.cpu_flags == ["avx2", "avx512_vnni"]
