"""Which variant of a model version a device runs, and why.

A build (``controller.registry.variants``) leaves one :class:`VariantReport` per variant: what it is,
where its file is, and the figures it was judged by, including the CPU instructions an INT8 variant was
judged with (:func:`cpu_isa`). :func:`choose_variant` picks among those reports for a device's
reported capabilities and says why in a sentence the API shows; :func:`choose` does it for a model
version stored in the database, honouring a variant pinned by an assignment. The twin calls
:func:`choose` for every camera whenever it derives a device's desired state.

The report and the ISA helpers live here, below the builds, so that the builds (which stamp the ISA)
and the twin (which chooses) both import them without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from sqlmodel import Session

from controller.db import crud
from controller.db.states import ModelVersionStatus
from controller.db.tables import ModelVariant, ModelVersion
from controller.errors import ConflictError
from fleet_protocol.messages import VNNI_FLAGS, Capabilities, cpu_flags_from_cpuinfo

VariantName = Literal["fp32", "fp16", "int8"]
# The integer instructions INT8 fidelity was judged with: onnxruntime's u8s8 kernels are exact with VNNI
# and can saturate on AVX2 without it (BENCHMARKS.md, "Model variants": an SSDLite candidate loses F1
# there), so a figure from one kind of CPU does not vouch for the other. None: not x86 with AVX2, or not
# recorded.
Int8Isa = Literal["vnni", "no-vnni"]

TRT_EP = "TensorrtExecutionProvider"
CUDA_EP = "CUDAExecutionProvider"
# An assignment's pin that leaves the choice to :func:`choose_variant`.
AUTO = "auto"


class VariantReport(BaseModel):
    """One variant of one model version, with the figures it was judged by."""

    model_config = ConfigDict(extra="forbid")

    variant: VariantName
    path: Path | None = None  # None when unfit or failed: nothing to ship
    sha256: str | None = None
    size: int | None = None
    latency_ms_1t: float | None = None  # CPU, on the controller, median after warm-up
    latency_ms_2t: float | None = None
    f1: float | None = None  # against fp32 on the held-out frames that took no part in the choice
    precision: float | None = None
    recall: float | None = None
    mean_iou: float | None = None
    detections: int | None = None  # on those report frames
    reference_detections: int | None = None  # fp32's on the same frames
    fit: bool = False
    reason: str | None = None
    target: Literal["cpu", "gpu", "any"] = "any"  # fp32 runs anywhere; fp16 is for GPUs, int8 for CPUs
    method: str = ""
    build_s: float = 0.0
    # int8 only: the controller CPU it was judged on, and whether its weights are 7-bit (reduce_range),
    # which gives the same results with and without VNNI, so its figures hold on any CPU.
    int8_isa: Int8Isa | None = None
    reduce_range: bool = False


# --------------------------------------------------------------------------- the choice


def cpu_isa(cpuinfo: Path = Path("/proc/cpuinfo")) -> Int8Isa | None:
    """This machine's :data:`Int8Isa`, from ``cpuinfo`` (a seam for tests); None when unknown."""
    try:
        flags = cpu_flags_from_cpuinfo(cpuinfo.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return None
    return isa_of(flags)


def isa_of(flags: Sequence[str] | None) -> Int8Isa | None:
    """ "vnni", "no-vnni" (x86 with AVX2 but no VNNI: the saturating kernels), or None (unknown/other)."""
    if flags is None:
        return None
    if VNNI_FLAGS.intersection(flags):
        return "vnni"
    return "no-vnni" if "avx2" in flags else None


def is_jetson(capabilities: Capabilities) -> bool:
    """A Jetson reports its integrated GPU as ``Jetson …`` (edge_agent/device/jetson.py), NVML or not."""
    return any(g.name.startswith("Jetson") for g in capabilities.gpus)


def choose_variant(reports: Sequence[VariantReport], capabilities: Capabilities) -> tuple[str, str]:
    """The variant a device should run, and a sentence saying why (shown in the API).

    TensorRT-capable -> fp16 (the device builds its engine from it), CUDA only -> fp16, CPU -> int8;
    each only when fit, otherwise fp32, which always runs. A CPU device that reports flags without VNNI
    gets int8 only when its figures hold there (see :func:`_int8_on_this_cpu`).
    """
    by_name = {r.variant: r for r in reports}
    providers = capabilities.execution_providers
    shown = ", ".join(p.removesuffix("ExecutionProvider") for p in providers) or "none reported"
    gpu = capabilities.gpus[0] if capabilities.gpus else None
    trt = TRT_EP in providers or (capabilities.tensorrt_version is not None and gpu is not None)
    if trt or CUDA_EP in providers:
        if trt:
            parts = [
                f"TensorRT {capabilities.tensorrt_version}" if capabilities.tensorrt_version else "TensorRT"
            ]
            what = "TensorRT-capable device"
        else:
            parts = []
            what = "CUDA device without TensorRT"
        if gpu is not None:
            cc = f", compute {gpu.compute_capability}" if gpu.compute_capability else ""
            parts.insert(0, f"{gpu.name}{cc}")
        head = f"{what} ({'; '.join([*parts, f'providers: {shown}'])})"
        fp16 = by_name.get("fp16")
        if fp16 is not None and fp16.fit:
            tail = "; the device builds its TensorRT engine from it" if trt else ""
            return "fp16", f"{head}; fp16 fit: {_figures(fp16, by_name.get('fp32'), speed=False)}{tail}"
        return "fp32", f"{head}; fp16 {_unfit(fp16)}, so fp32"
    if gpu is not None and is_jetson(capabilities):
        # The INT8 variant is QOperator/QDQ judged on an x86 CPU for onnxruntime's CPU kernels: a Jetson
        # running without its GPU providers (CPU-only onnxruntime) gets fp32, which always runs, and a
        # Jetson with them took the branch above.
        return "fp32", (
            f"Jetson ({gpu.name}) without its GPU providers (providers: {shown}); the int8 variant is "
            "for x86 CPUs only, so fp32"
        )
    head = f"CPU-only device (providers: {shown})"
    int8 = by_name.get("int8")
    if int8 is not None and int8.fit:
        figures = _figures(int8, by_name.get("fp32"), speed=True)
        refusal, note = _int8_on_this_cpu(int8, capabilities)
        if refusal is not None:
            return "fp32", f"{head}; int8 fit ({figures}) but {refusal}, so fp32"
        return "int8", f"{head}; int8 fit: {figures}{note}"
    return "fp32", f"{head}; int8 {_unfit(int8)}, so fp32"


def _int8_on_this_cpu(int8: VariantReport, capabilities: Capabilities) -> tuple[str | None, str]:
    """(why a fit int8 must not go to this CPU, or None; a note for the reason when it may).

    Any CPU that is not known to lack VNNI may run a fit int8: VNNI devices compute what a VNNI
    controller judged, and a device that reports no flags (an agent without ``cpu_flags``) is given the
    benefit of the doubt, with the doubt said. A device known to lack VNNI (AVX2, also ARM: never
    measured) gets int8 only when its figures hold without VNNI: 7-bit weights, or judged on such a CPU.
    """
    judged = int8.int8_isa
    device_flags = capabilities.cpu_flags
    if int8.reduce_range:
        return None, "; portable (7-bit weights: same results with and without VNNI)"
    if device_flags is None:
        if judged is None:
            return None, ""  # neither side known (a variant stored without its ISA): nothing to add
        shown = "a VNNI CPU" if judged == "vnni" else "a CPU without VNNI"
        return None, f"; judged on {shown}, this device's ISA is unknown (it reports no CPU flags)"
    if capabilities.has_vnni:
        if judged == "vnni":
            return None, "; judged on a VNNI CPU, as this device has"
        return None, ""
    if judged == "no-vnni":
        return None, "; judged on a CPU without VNNI, as this device is"
    shown = "a VNNI CPU" if judged == "vnni" else "a CPU whose ISA was not recorded"
    return f"it was judged on {shown}; this device reports no VNNI, fidelity unverified", ""


def _figures(rep: VariantReport, fp32: VariantReport | None, *, speed: bool) -> str:
    text = (
        f"F1 {rep.f1:.2f}, mean IoU {rep.mean_iou:.2f}"
        if rep.f1 is not None and rep.mean_iou is not None
        else ""
    )
    if speed and fp32 and fp32.latency_ms_1t and rep.latency_ms_1t:
        text += f", {fp32.latency_ms_1t / rep.latency_ms_1t:.1f}x faster"
    return text


def _unfit(rep: VariantReport | None) -> str:
    if rep is None:
        return "not built"
    return f"unfit ({rep.reason})" if rep.reason else "unfit"


# --------------------------------------------------------------------------- for a stored model version


@dataclass(frozen=True)
class Choice:
    """The variant a device gets, why, and the file that goes with it."""

    variant: str
    reason: str
    sha256: str
    size: int


def _reports(rows: list[ModelVariant]) -> list[Any]:
    """The stored variant rows as the reports :func:`choose_variant` reads (unknown names left out)."""
    out = []
    for r in rows:
        if r.variant not in ("fp32", "fp16", "int8"):
            continue
        out.append(
            VariantReport(
                variant=r.variant,  # type: ignore[arg-type]
                path=Path(r.path) if r.path else None,
                sha256=r.sha256,
                size=r.size,
                latency_ms_1t=r.latency_ms_1t,
                latency_ms_2t=r.latency_ms_2t,
                f1=r.f1,
                mean_iou=r.mean_iou,
                detections=r.detections,
                fit=r.fit,
                reason=r.reason,
                target=r.target if r.target in ("cpu", "gpu", "any") else "any",  # type: ignore[arg-type]
                build_s=r.build_s,
                int8_isa=r.int8_isa if r.int8_isa in ("vnni", "no-vnni") else None,  # type: ignore[arg-type]
                reduce_range=r.reduce_range,
            )
        )
    return out


def choose(s: Session, *, mv: ModelVersion, capabilities: dict[str, Any] | None, pin: str = AUTO) -> Choice:
    """The variant of ``mv`` a device with ``capabilities`` runs, and why; ConflictError for a bad pin."""
    assert mv.id is not None
    rows = list(crud.list_variants(s, model_version_id=mv.id))
    by_name = {r.variant: r for r in rows}
    fp32 = Choice("fp32", "", mv.sha256, mv.size)
    if pin != AUTO:
        if pin == "fp32":
            return Choice("fp32", "fp32 pinned by the assignment", mv.sha256, mv.size)
        row = by_name.get(pin)
        if row is None:
            state = f"variant builds {mv.status}" if mv.status != ModelVersionStatus.READY else "not built"
            raise ConflictError(f"variant {pin} of {mv.name}:{mv.version} is not available ({state})")
        if not row.fit or not row.path or not row.sha256 or not row.size:
            raise ConflictError(
                f"variant {pin} of {mv.name}:{mv.version} is unfit: {row.reason or 'no file to ship'}"
            )
        return Choice(pin, f"{pin} pinned by the assignment", row.sha256, row.size)
    if not rows:
        if mv.status == ModelVersionStatus.BUILDING:
            why = f"variants of {mv.name}:{mv.version} are still building ({mv.build_stage or 'queued'})"
        else:
            why = f"{mv.name}:{mv.version} has no optimized variants"
        return Choice("fp32", f"{why}; fp32 runs everywhere", mv.sha256, mv.size)
    try:
        caps = Capabilities.model_validate(capabilities or {})
    except ValueError:
        caps = Capabilities()
    name, reason = choose_variant(_reports(rows), caps)
    row = by_name.get(name)
    if name == "fp32" or row is None or not row.fit or not row.path or not row.sha256 or not row.size:
        return Choice(
            "fp32",
            reason if name == "fp32" else f"{reason}; its file is missing, so fp32",
            fp32.sha256,
            fp32.size,
        )
    return Choice(name, reason, row.sha256, row.size)
