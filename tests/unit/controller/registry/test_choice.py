"""INT8 fidelity depends on the CPU's integer instructions: the controller records the ISA an int8
variant was judged on, keeps it through the database, and a CPU device that reports no VNNI gets an
int8 judged on a VNNI CPU only when it is portable (7-bit weights); otherwise fp32, with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlmodel import Session

from controller.db import crud
from controller.db.engine import make_engine, migrate
from controller.db.tables import ModelVariant, ModelVersion
from controller.registry.builder import VariantWorker
from controller.registry.choice import (
    Int8Isa,
    VariantReport,
    _reports,
    choose,
    choose_variant,
    cpu_isa,
    isa_of,
)
from fleet_protocol.messages import Capabilities, GpuInfo

PROVIDERS = ["CPUExecutionProvider"]
VNNI_DEVICE = Capabilities(execution_providers=PROVIDERS, cpu_flags=["avx2", "avx512f", "avx512_vnni"])
AVX2_DEVICE = Capabilities(execution_providers=PROVIDERS, cpu_flags=["avx2"])
ARM_DEVICE = Capabilities(execution_providers=PROVIDERS, cpu_flags=["neon", "dotprod"])
OLD_AGENT = Capabilities(execution_providers=PROVIDERS)  # no cpu_flags at all


def _reports_with(isa: Int8Isa | None, *, reduce_range: bool = False) -> list[VariantReport]:
    return [
        VariantReport(variant="fp32", fit=True, latency_ms_1t=20.0, f1=1.0, mean_iou=1.0, target="any"),
        VariantReport(variant="fp16", fit=True, f1=1.0, mean_iou=1.0, target="gpu"),
        VariantReport(
            variant="int8",
            fit=True,
            latency_ms_1t=10.0,
            f1=0.97,
            mean_iou=0.96,
            target="cpu",
            int8_isa=isa,
            reduce_range=reduce_range,
        ),
    ]


# --------------------------------------------------------------------------- the controller's own ISA


@pytest.mark.parametrize(
    ("flags", "isa"),
    [
        (["avx2", "avx512f", "avx512_vnni"], "vnni"),
        (["avx2", "avx_vnni"], "vnni"),
        (["avx2"], "no-vnni"),  # the saturating u8s8 kernels
        (["neon", "dotprod"], None),  # not the x86 case that was measured
        ([], None),
        (None, None),
    ],
)
def test_isa_of_flags(flags: list[str] | None, isa: str | None) -> None:
    assert isa_of(flags) == isa


def test_controller_reads_its_isa_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    assert cpu_isa(info) == "no-vnni"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni amx_int8\n")
    assert cpu_isa(info) == "vnni"
    assert cpu_isa(tmp_path / "missing") is None


# --------------------------------------------------------------------------- the per-device choice


def test_vnni_device_gets_int8_judged_on_vnni() -> None:
    variant, reason = choose_variant(_reports_with("vnni"), VNNI_DEVICE)
    assert variant == "int8"
    assert "int8 fit: F1 0.97, mean IoU 0.96, 2.0x faster" in reason
    assert "judged on a VNNI CPU, as this device has" in reason


@pytest.mark.parametrize("device", [AVX2_DEVICE, ARM_DEVICE], ids=["avx2", "arm"])
def test_device_without_vnni_gets_fp32_when_int8_was_judged_on_vnni(device: Capabilities) -> None:
    variant, reason = choose_variant(_reports_with("vnni"), device)
    assert variant == "fp32"
    assert "judged on a VNNI CPU; this device reports no VNNI, fidelity unverified" in reason
    assert reason.endswith("so fp32")


def test_device_without_vnni_gets_fp32_when_the_judging_isa_was_not_recorded() -> None:
    # Variants built before the ISA was recorded: nothing vouches for them on a saturating CPU.
    variant, reason = choose_variant(_reports_with(None), AVX2_DEVICE)
    assert variant == "fp32"
    assert "ISA was not recorded" in reason and "no VNNI" in reason


def test_device_without_vnni_gets_int8_judged_without_vnni() -> None:
    variant, reason = choose_variant(_reports_with("no-vnni"), AVX2_DEVICE)
    assert variant == "int8"
    assert "judged on a CPU without VNNI, as this device is" in reason


@pytest.mark.parametrize("device", [AVX2_DEVICE, ARM_DEVICE, VNNI_DEVICE, OLD_AGENT])
def test_portable_int8_goes_to_every_cpu(device: Capabilities) -> None:
    variant, reason = choose_variant(_reports_with("vnni", reduce_range=True), device)
    assert variant == "int8"
    assert "portable" in reason


def test_old_agent_keeps_int8_and_the_reason_says_its_isa_is_unknown() -> None:
    variant, reason = choose_variant(_reports_with("vnni"), OLD_AGENT)
    assert variant == "int8"
    assert "this device's ISA is unknown (it reports no CPU flags)" in reason


def test_gpu_devices_are_not_affected_by_cpu_flags() -> None:
    cuda = Capabilities(
        gpus=[GpuInfo(index=0, name="NVIDIA T4", compute_capability="7.5")],
        execution_providers=["CUDAExecutionProvider", "CPUExecutionProvider"],
        cpu_flags=["avx2"],
    )
    assert choose_variant(_reports_with("vnni"), cuda)[0] == "fp16"


@pytest.mark.parametrize(
    "providers",
    [
        ["CPUExecutionProvider"],
        ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
    ],
    ids=["cpu-onnxruntime", "gpu-providers"],
)
def test_a_jetson_never_gets_the_cpu_only_int8_variant(providers: list[str]) -> None:
    # As edge_agent/device/jetson.py reports an Orin without NVML: its integrated GPU by name, portable int8 too.
    jetson = Capabilities(
        arch="aarch64",
        gpus=[GpuInfo(index=0, name="Jetson AGX Orin (integrated GPU)", compute_capability="8.7")],
        execution_providers=providers,
        cpu_flags=["neon", "dotprod"],
    )
    for reports in (_reports_with("vnni"), _reports_with("no-vnni", reduce_range=True)):
        variant, reason = choose_variant(reports, jetson)
        assert variant != "int8", reason
    variant, reason = choose_variant(_reports_with(None), jetson)
    if "TensorrtExecutionProvider" in providers:
        assert variant == "fp16"
    else:
        assert variant == "fp32"
        assert "Jetson AGX Orin" in reason and "int8 variant is for x86 CPUs only" in reason


# --------------------------------------------------------------------------- persisted and read back


class _Store:
    """The artifact store's adopt(), enough for VariantWorker._row."""

    def adopt(self, path: Path, sha256: str) -> Path:
        return path


def test_isa_survives_the_database_and_drives_the_choice(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    migrate(url)  # the schema from the migrations, 0006 included
    engine = make_engine(url)
    model = tmp_path / "m.onnx"
    model.write_bytes(b"fp32")
    int8_file = tmp_path / "int8.onnx"
    int8_file.write_bytes(b"int8")
    reports = _reports_with("vnni")
    reports[2].path, reports[2].sha256, reports[2].size = int8_file, "b" * 64, 4
    worker = VariantWorker.__new__(VariantWorker)  # only _row is used: no thread, no queue
    worker._store = _Store()  # type: ignore[assignment]
    rows = [worker._row(r, model, "a" * 64) for r in reports]
    with Session(engine) as s:
        mv = ModelVersion(
            name="m",
            version="1",
            sha256="a" * 64,
            size=4,
            path=str(model),
            manifest={},
        )
        s.add(mv)
        s.commit()
        s.refresh(mv)
        assert mv.id is not None
        crud.replace_variants(s, model_version_id=mv.id, variants=rows)
        s.commit()
        stored = {r.variant: r for r in crud.list_variants(s, model_version_id=mv.id)}
        assert (stored["int8"].int8_isa, stored["int8"].reduce_range) == ("vnni", False)
        back = {r.variant: r for r in _reports(list(stored.values()))}
        assert back["int8"].int8_isa == "vnni"

        assert choose(s, mv=mv, capabilities=VNNI_DEVICE.model_dump()).variant == "int8"
        refused = choose(s, mv=mv, capabilities=AVX2_DEVICE.model_dump())
        assert refused.variant == "fp32" and "no VNNI" in refused.reason
        stored["int8"].reduce_range = True
        s.add(stored["int8"])
        s.commit()
        assert choose(s, mv=mv, capabilities=AVX2_DEVICE.model_dump()).variant == "int8"


def test_rows_from_before_the_migration_read_as_unknown() -> None:
    row = ModelVariant(model_version_id=1, variant="int8", fit=True, target="cpu")
    (rep,) = _reports([row])
    assert rep.int8_isa is None and rep.reduce_range is False
