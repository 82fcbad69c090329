"""Optimized variants of an uploaded FP32 ONNX model, each judged against FP32 before it may be used.

From one upload the controller makes
  * ``fp16`` for GPUs: onnxconverter-common, inputs and outputs kept FP32. It does not speed up a CPU
    (onnxruntime computes the convolutions in FP32 there), so its CPU figures are for the record only.
  * ``int8`` for CPUs: onnxruntime static quantization (per-channel QInt8 weights, QUInt8 activations,
    MinMax) calibrated on frames of real footage. Which nodes to quantize and in which format (QDQ or
    QOperator) is fastest, and which stays faithful, depends on the model and on the CPU's integer
    instructions, so several candidates are built and the fastest fit one is kept (:func:`_build_int8`).
    The region candidates keep box decoding, NMS and Loop bodies in float: quantized, SSDLite's box
    decoding moves its boxes off FP32's.
and measures, for each, size, CPU latency at one and two threads, and fidelity against FP32 on
held-out frames, with the agent's own preprocessing and decoders (``controller.registry.fidelity``).

The contract with what uses a report (``controller.registry.choice``, the API):
  * The held-out frames are split in two: the first part judges and ranks the INT8 candidates (and
    gives FP16 its first verdict), the second part, which took no part in any choice, gives the figures
    reported (F1, precision, recall, mean IoU, detections) and a second verdict; a variant must pass
    the bar on both. Figures from the frames that chose among several candidates would be
    selection-biased (optimistic).
  * Quantization fails silently in practice (NanoDet's Pad with -inf fill gets an infinite scale and the
    model returns zero detections with no error), so a variant with non-finite scales, zero detections
    where FP32 has some, or F1 / mean IoU under the bar is marked unfit with the reason and never chosen;
    its file is deleted, so a report's ``path`` is set only for a file that may be shipped.
  * An INT8 report records the CPU instructions it was judged with (``int8_isa``): its figures vouch
    for CPUs of that kind only.

The figures of both bundled models, and the recipes tried and not kept, are in BENCHMARKS.md ("Model
variants"; ``bench/variants.py`` reruns them).

The controller runs :func:`build_variants` whole in a child process under an address-space limit
(``controller/registry/build_child.py``): what a graph allocates stays out of the controller's memory.
Everything heavy (onnx, onnxruntime, onnxconverter-common, OpenCV, sympy: the ``optimize`` extra) is
imported inside the functions, so the controller starts without them. No module state: a background
worker may call :func:`build_variants` for several models one after another.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from controller.registry.choice import VariantReport, cpu_isa
from controller.registry.fidelity import Fidelity, decode, match, preprocess_frames, read_footage_frames
from fleet_protocol.messages import ModelManifest

if TYPE_CHECKING:
    from fleet_protocol.vision.decoders import RawDetection
    from fleet_protocol.vision.preprocess import FrameMeta

log = logging.getLogger(__name__)

Progress = Callable[[str, float], None]

# The convolutional region that is quantized: seeds are ops with constant weights; the others are
# quantized only when every data input comes from the region, which keeps everything downstream of a
# Reshape/Split/Loop (box decoding, NMS, in-graph preprocessing) in float without naming nodes.
_SEED_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})
_REGION_OPS = frozenset(
    {
        "Add",
        "Mul",
        "Clip",
        "Relu",
        "LeakyRelu",
        "BatchNormalization",
        "Concat",
        "MaxPool",
        "AveragePool",
        "GlobalAveragePool",
        "Resize",
        "Pad",
    }
)


class VariantError(RuntimeError):
    """A variant could not be built or loaded; the message is the reason shown to the operator."""


# --------------------------------------------------------------------------- public API


def build_variants(
    model_path: Path,
    manifest: ModelManifest,
    out_dir: Path,
    *,
    footage: Path,
    calib_frames: int = 100,
    eval_frames: int = 40,
    bar_f1: float = 0.95,
    bar_iou: float = 0.95,
    progress: Progress | None = None,
    fp16_timeout_s: float = 120.0,
    latency_rounds: int = 5,
    latency_runs: int = 5,
    cpuinfo: Path = Path("/proc/cpuinfo"),
) -> list[VariantReport]:
    """Build, measure and judge the fp32, fp16 and int8 variants of ``model_path``.

    Variant files land in ``out_dir`` (``fp16.onnx``, ``int8.onnx``); unfit ones are deleted, so a
    report's ``path`` is set only for a file that may be shipped. The fp32 report points at the upload
    itself. Raises :class:`VariantError` only when the FP32 model itself cannot run or the footage
    cannot be read: without a reference no variant can be judged.
    """
    last_pct = 0.0

    def report(stage: str, pct: float) -> None:
        # Never backwards (an INT8 retry calibrates again): a progress bar that shrinks looks broken.
        nonlocal last_pct
        last_pct = max(last_pct, pct)
        if progress is not None:
            progress(stage, last_pct)

    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    report("frames", 0.0)
    calib, held_out = read_footage_frames(footage, calib_frames, eval_frames)
    if len(held_out) < 2:
        raise VariantError(
            f"footage {footage} gave {len(held_out)} evaluation frame(s); at least 2 are needed (one part "
            "chooses among the variants, the other gives the figures reported)"
        )
    calib_inputs = [x for x, _ in preprocess_frames(calib, manifest.input)]
    evaluation = preprocess_frames(held_out, manifest.input)
    # Contiguous parts (the held-out frames run in footage order), so the reported frames are later
    # footage than the choosing ones, as a camera's next hour of video would be.
    n_choose = len(evaluation) // 2
    choosing, reporting = evaluation[:n_choose], evaluation[n_choose:]
    log.info(
        "variants of %s: %d calibration, %d held-out frames (%d choose, %d report)",
        manifest.name,
        len(calib),
        len(held_out),
        len(choosing),
        len(reporting),
    )

    report("fp32", 10.0)
    t0 = time.perf_counter()
    try:
        reference = run_detections(model_path, manifest, evaluation)
    except Exception as exc:
        raise VariantError(f"the fp32 model does not run: {exc}") from exc
    ref_choosing, ref_reporting = reference[:n_choose], reference[n_choose:]
    n_ref = sum(len(d) for d in ref_reporting)
    fp32 = VariantReport(
        variant="fp32",
        path=model_path,
        sha256=_sha256(model_path),
        size=model_path.stat().st_size,
        f1=1.0,
        precision=1.0,
        recall=1.0,
        mean_iou=1.0,
        detections=n_ref,
        reference_detections=n_ref,
        fit=True,
        target="any",
        method="the upload, unchanged",
        build_s=time.perf_counter() - t0,
    )

    def judge(rep: VariantReport, path: Path) -> None:
        """Run a built variant on the choosing frames and fill in its fidelity and verdict there."""
        dets = run_detections(path, manifest, choosing)
        fid = match(ref_choosing, dets)
        _apply_fidelity(rep, fid)
        rep.reason = fidelity_problem(fid, bar_f1=bar_f1, bar_iou=bar_iou, frames=len(choosing))
        rep.fit = rep.reason is None

    def report_figures(rep: VariantReport, path: Path) -> None:
        """The figures reported: the variant on the frames no choice used; it must pass the bar there too."""
        if rep.detections is None or not path.exists():
            return  # never ran: nothing to measure
        try:
            dets = run_detections(path, manifest, reporting)
        except Exception as exc:  # ran on the choosing frames, so hardly reachable
            rep.fit, rep.reason = False, f"does not run on the report frames: {_short(exc)}"
            return
        fid = match(ref_reporting, dets)
        _apply_fidelity(rep, fid)
        problem = fidelity_problem(fid, bar_f1=bar_f1, bar_iou=bar_iou, frames=len(reporting))
        if rep.fit and problem is not None:
            rep.fit = False
            rep.reason = (
                f"{problem} on the {len(reporting)} report frames "
                f"(it passed on the {len(choosing)} frames that chose it)"
            )

    report("fp16", 20.0)
    fp16 = _build_fp16(model_path, out_dir / "fp16.onnx", fp16_timeout_s, judge)
    report_figures(fp16, out_dir / "fp16.onnx")

    report("int8", 35.0)

    def calib_progress(done: int, total: int) -> None:
        report("int8", 35.0 + 40.0 * done / max(total, 1))

    feed = {_input_name(model_path): evaluation[0][0]}

    def speed(candidates: dict[str, Path]) -> dict[str, float]:
        """One-thread latency of each candidate, interleaved (the devices' INT8 case)."""
        lat = measure_latency(candidates, feed, threads=(1,), rounds=latency_rounds, runs=latency_runs)
        return {name: by_threads[1] for name, by_threads in lat.items()}

    int8 = _build_int8(
        model_path, manifest, out_dir / "int8.onnx", calib_inputs, judge, calib_progress, speed
    )
    report_figures(int8, out_dir / "int8.onnx")
    int8.method += (
        f"; chosen on {len(choosing)} held-out frames, figures from {len(reporting)} other held-out frames"
    )
    int8.int8_isa = cpu_isa(cpuinfo)

    report("latency", 80.0)
    reports = [fp32, fp16, int8]
    # Unfit variants that ran are measured too: "what did not speed up" is worth recording.
    measurable: dict[str, Path] = {"fp32": model_path}
    measurable.update(
        {r.variant: out_dir / f"{r.variant}.onnx" for r in (fp16, int8) if r.detections is not None}
    )
    try:
        lat = measure_latency(measurable, feed, rounds=latency_rounds, runs=latency_runs)
    except Exception as exc:  # a figure is not worth losing the build over
        log.warning("latency measurement failed for %s: %s", manifest.name, exc)
        lat = {}
    for r in reports:
        r.latency_ms_1t = lat.get(r.variant, {}).get(1)
        r.latency_ms_2t = lat.get(r.variant, {}).get(2)

    for r in (fp16, int8):
        target = out_dir / f"{r.variant}.onnx"
        if r.fit:
            r.path, r.sha256, r.size = target, _sha256(target), target.stat().st_size
        else:
            # Keep the measured size for the record, but never leave an unfit file where it could ship.
            r.path = None
            target.unlink(missing_ok=True)
    report("done", 100.0)
    log.info(
        "variants of %s in %.1f s: %s",
        manifest.name,
        time.perf_counter() - started,
        ", ".join(f"{r.variant} {'fit' if r.fit else 'unfit'}" for r in reports),
    )
    return reports


def fidelity_problem(fid: Fidelity, *, bar_f1: float, bar_iou: float, frames: int) -> str | None:
    """Why a variant with these figures must not be used, or None when it passes the bar."""
    if fid.reference == 0:
        # Two empty sets "agree", which would let a broken variant through: no evidence, no pass.
        return f"cannot verify: fp32 finds nothing on the {frames} held-out frames"
    if fid.candidate == 0:
        return f"zero detections on {frames} held-out frames where fp32 has {fid.reference} (silent failure)"
    if fid.f1 < bar_f1:
        return (
            f"F1 {fid.f1:.3f} below the bar {bar_f1:.2f} "
            f"(precision {fid.precision:.3f}, recall {fid.recall:.3f} against fp32)"
        )
    if fid.mean_iou is None or fid.mean_iou < bar_iou:
        shown = "n/a" if fid.mean_iou is None else f"{fid.mean_iou:.3f}"
        return f"mean IoU {shown} below the bar {bar_iou:.2f} (boxes drift from fp32's)"
    return None


# --------------------------------------------------------------------------- running and timing


def cpu_session(path: Path, threads: int) -> Any:
    """An onnxruntime CPU session with the agent's defaults: full graph optimization, no spinning.

    Without ORT_ENABLE_ALL FP32 runs markedly slower, so latencies measured without it would not be a
    device's; spinning threads steal the cores a device needs for capture and decoding, so the agent
    turns it off and so do these figures.
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def run_detections(
    path: Path, manifest: ModelManifest, frames: Sequence[tuple[np.ndarray, FrameMeta]]
) -> list[list[RawDetection]]:
    """Detections of a model file on preprocessed frames, decoded by the reference decoders."""
    sess = cpu_session(path, threads=2)
    name = sess.get_inputs()[0].name
    out_names = [o.name for o in sess.get_outputs()]
    results = []
    for tensor, geom in frames:
        outputs = dict(zip(out_names, sess.run(None, {name: tensor}), strict=True))
        results.append(decode(manifest, outputs, geom, manifest.default_threshold))
    return results


def measure_latency(
    models: dict[str, Path],
    feed: dict[str, np.ndarray],
    *,
    threads: Iterable[int] = (1, 2),
    warmup: int = 3,
    rounds: int = 5,
    runs: int = 5,
) -> dict[str, dict[int, float]]:
    """Median ms per inference of each model at each thread count, measured interleaved.

    All sessions are loaded first; each round then times every (model, threads) pair in turn, so a
    slow spell of the machine (another process, frequency scaling) hits all variants alike and the
    ratios against fp32 stay meaningful.
    """
    thread_counts = list(threads)
    sessions = {(name, t): cpu_session(path, t) for name, path in models.items() for t in thread_counts}
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in sessions}
    for sess in sessions.values():
        for _ in range(warmup):
            sess.run(None, feed)
    for _ in range(rounds):
        for key, sess in sessions.items():
            for _ in range(runs):
                t0 = time.perf_counter()
                sess.run(None, feed)
                samples[key].append((time.perf_counter() - t0) * 1000.0)
    result: dict[str, dict[int, float]] = {}
    for (name, t), vals in samples.items():
        result.setdefault(name, {})[t] = statistics.median(vals)
    return result


# --------------------------------------------------------------------------- fp16


FP16_MEMORY_BASE = 3 * 1024**3  # address space the converter's Python, onnx and numpy need
FP16_MEMORY_PER_FILE_BYTE = 8  # the model, its protobuf copy, the fp16 copy, serialisation


def fp16_memory_limit(src: Path) -> int:
    """The fp16 child's address-space limit (RLIMIT_AS) for the model at ``src``."""
    return FP16_MEMORY_BASE + FP16_MEMORY_PER_FILE_BYTE * src.stat().st_size


def convert_fp16(src: Path, dst: Path, *, timeout_s: float, memory_bytes: int | None = None) -> None:
    """FP16 conversion with FP32 inputs/outputs, in a child process that is killed on timeout and
    whose address space is capped at ``memory_bytes`` (default :func:`fp16_memory_limit`).

    A separate process because onnxconverter-common may never return (it did not on ped_ssdlite with
    ``Cast`` blocked: its Loop bodies read outer tensors) and a Python thread cannot be stopped; the
    memory cap keeps a model that materialises far more than its file (a ``ConstantOfShape`` folded
    to gigabytes) from taking the controller's memory: it fails with MemoryError instead. The child
    sets its own limit before importing anything (no preexec_fn: the controller has threads).
    """
    limit = memory_bytes if memory_bytes is not None else fp16_memory_limit(src)
    cmd = [sys.executable, "-m", "controller.registry.variants", "fp16", str(src), str(dst), str(limit)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        dst.unlink(missing_ok=True)
        raise VariantError(f"fp16 conversion did not finish within {timeout_s:g} s") from None
    if proc.returncode != 0:
        dst.unlink(missing_ok=True)
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        raise VariantError(
            f"fp16 conversion failed: {lines[-1] if lines else f'exit code {proc.returncode}'}"
        )


def _fp16_main(src: str, dst: str, memory_bytes: int | None = None) -> None:
    if memory_bytes is not None:
        import resource

        # Under the build child's own limit (controller/registry/build_child.py) the hard limit is
        # inherited, and a limit may only be lowered.
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            memory_bytes = min(memory_bytes, hard)
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    import onnx
    from onnxconverter_common import float16

    model = float16.convert_float_to_float16(onnx.load(src), keep_io_types=True)
    onnx.save(model, dst)


def _build_fp16(
    src: Path, dst: Path, timeout_s: float, judge: Callable[[VariantReport, Path], None]
) -> VariantReport:
    rep = VariantReport(variant="fp16", target="gpu", method="onnxconverter-common float16, I/O kept FP32")
    t0 = time.perf_counter()
    try:
        convert_fp16(src, dst, timeout_s=timeout_s)
        rep.size = dst.stat().st_size
        judge(rep, dst)
    except VariantError as exc:
        rep.reason = str(exc)
    except Exception as exc:  # onnxruntime refuses to load it, or its outputs are NaN
        rep.reason = f"fp16 model does not run: {_short(str(exc).replace(str(dst), dst.name))}"
    rep.build_s = time.perf_counter() - t0
    if rep.reason:
        log.info("fp16 of %s unfit: %s", src.name, rep.reason)
    return rep


# --------------------------------------------------------------------------- int8


def select_nodes_to_quantize(model: Any, *, first_layer: bool = False) -> list[str]:
    """Names of the top-level nodes in the convolutional region (see ``_SEED_OPS``/``_REGION_OPS``).

    Excluded: the first layer unless ``first_layer`` (see ``_reads_image``), everything inside Loop/If
    bodies (not top-level), everything fed by a non-region node
    (box decoding, NMS, in-graph preprocessing) and Pad nodes whose constant fill is not zero, with
    whatever they feed (NanoDet's Pad with -inf before a MaxPool otherwise gets an infinite scale and
    the model silently returns nothing).
    """
    from onnx import numpy_helper

    graph = model.graph
    consts = {init.name for init in graph.initializer}
    consts |= {out for node in graph.node if node.op_type == "Constant" for out in node.output}
    values = {init.name: init for init in graph.initializer}
    region: set[str] = set()  # tensors produced by selected nodes
    selected: list[str] = []
    for node in graph.node:
        data_inputs = [i for i in node.input if i and i not in consts]
        if node.op_type in _SEED_OPS:
            ok = len(node.input) > 1 and node.input[1] in consts
            ok = ok and (first_layer or not _reads_image(node, values))
        elif node.op_type in _REGION_OPS:
            ok = bool(data_inputs) and all(i in region for i in data_inputs)
            if ok and node.op_type == "Pad":
                ok = _pad_fill_is_zero(node, values, numpy_helper)
        else:
            ok = False
        if ok and node.name:
            selected.append(node.name)
            region.update(node.output)
    return selected


def _reads_image(node: Any, values: dict[str, Any]) -> bool:
    """A convolution over the raw image (<= 4 input channels, not grouped): the first layer.

    Its errors reach every later layer: on an AVX2 CPU without VNNI, quantizing it costs fidelity (an
    SSDLite candidate in BENCHMARKS.md, "Model variants"). On a VNNI CPU it is the faster choice
    (NanoDet's MaxPool after it then runs on uint8), so ``_build_int8`` tries both and keeps the fastest
    candidate that is fit on the controller's CPU.
    """
    if node.op_type != "Conv" or node.input[1] not in values:
        return False
    group = next((a.i for a in node.attribute if a.name == "group"), 1)
    dims = list(values[node.input[1]].dims)
    return group == 1 and len(dims) == 4 and dims[1] <= 4


def _pad_fill_is_zero(node: Any, values: dict[str, Any], numpy_helper: Any) -> bool:
    mode = next((a.s.decode() for a in node.attribute if a.name == "mode"), "constant")
    if mode != "constant":
        return True  # reflect/edge only repeat values that are already in range
    if len(node.input) < 3 or not node.input[2]:
        return True  # default fill is 0
    init = values.get(node.input[2])
    if init is None:
        return False  # a computed fill value: cannot tell, keep it in float
    fill = numpy_helper.to_array(init)
    return bool(np.all(fill == 0))


def nonfinite_scales(path: Path) -> list[str]:
    """Names of quantization scale initializers that are inf, NaN or not positive."""
    import onnx
    from onnx import numpy_helper

    bad = []
    for init in onnx.load(str(path)).graph.initializer:
        if not init.name.endswith("scale") or init.data_type not in (
            onnx.TensorProto.FLOAT,
            onnx.TensorProto.FLOAT16,
            onnx.TensorProto.DOUBLE,
        ):
            continue
        arr = numpy_helper.to_array(init).astype(np.float64)
        if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
            bad.append(init.name)
    return bad


def quantize_int8(
    src: Path,
    dst: Path,
    input_name: str,
    calib_inputs: Sequence[np.ndarray],
    *,
    fmt: Literal["qdq", "qoperator"] = "qdq",
    nodes: Sequence[str] | None = None,
    on_calib: Callable[[int, int], None] | None = None,
    extra_options: dict[str, Any] | None = None,
    reduce_range: bool = False,
) -> None:
    """Static INT8: per-channel QInt8 weights, QUInt8 activations, MinMax on ``calib_inputs``.

    ``nodes`` limits quantization to those node names (None quantizes every supported node).
    ``reduce_range`` (7-bit weights) guards against u8s8 saturation on CPUs without VNNI, at a cost in
    fidelity on some models (on an AVX2 CPU it helped ped_ssdlite and cost NanoDet), so it is off.
    Fidelity is judged on the controller's CPU either way, so saturation there is caught.
    """
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self._i = 0

        def get_next(self) -> dict[str, np.ndarray] | None:
            if self._i >= len(calib_inputs):
                return None
            item = {input_name: calib_inputs[self._i]}
            self._i += 1
            if on_calib is not None:
                on_calib(self._i, len(calib_inputs))
            return item

        def rewind(self) -> None:
            self._i = 0

    quantize_static(
        str(src),
        str(dst),
        Reader(),
        quant_format=QuantFormat.QDQ if fmt == "qdq" else QuantFormat.QOperator,
        per_channel=True,
        reduce_range=reduce_range,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        nodes_to_quantize=list(nodes) if nodes is not None else None,
        calibrate_method=CalibrationMethod.MinMax,
        extra_options=extra_options,
    )


def _build_int8(
    src: Path,
    manifest: ModelManifest,
    dst: Path,
    calib_inputs: Sequence[np.ndarray],
    judge: Callable[[VariantReport, Path], None],
    on_calib: Callable[[int, int], None],
    speed: Callable[[dict[str, Path]], dict[str, float]],
) -> VariantReport:
    """Quantize ``src`` several ways, judge each with ``judge`` (the choosing part of the held-out
    frames), keep the fastest fit one; the caller measures the figures it reports on other frames.

    Which recipe is fastest, and which stays fit, depends on the model and on the CPU's integer
    instructions (on a VNNI CPU NanoDet is much faster quantized on every node than with its first
    layer in float; on AVX2 without VNNI the first layer must stay in float for ped_ssdlite to keep its
    boxes: BENCHMARKS.md, "Model variants"). So the candidates are built and measured here, on the
    controller, rather than chosen by a rule; an unfit candidate is never kept.
    """
    import onnx

    t0 = time.perf_counter()
    if not calib_inputs:
        return VariantReport(variant="int8", target="cpu", reason="no calibration frames", build_s=0.0)
    with tempfile.TemporaryDirectory(prefix="int8-", dir=dst.parent) as tmp:
        prepped = Path(tmp) / "prep.onnx"
        try:
            # Shape inference and graph cleanup first: the quantized graph runs faster for it.
            from onnxruntime.quantization.shape_inference import quant_pre_process

            quant_pre_process(str(src), str(prepped), skip_symbolic_shape=False)
            base, prep_note = prepped, "pre-processed"
        except Exception as exc:
            log.warning("quant_pre_process failed on %s (%s); quantizing the original graph", src.name, exc)
            base, prep_note = src, "not pre-processed"
        graph = onnx.load(str(base))
        region = select_nodes_to_quantize(graph)
        region_first = select_nodes_to_quantize(graph, first_layer=True)
        input_name = _input_name(base)
        candidates: list[tuple[str, Literal["qdq", "qoperator"], list[str] | None]] = [
            # No commas in a label: the method's first comma-separated part names the candidate.
            ("QOperator on every supported node", "qoperator", None),
            (f"QDQ on {len(region_first)} conv-region nodes incl. the first layer", "qdq", region_first),
            (f"QDQ on {len(region)} conv-region nodes (first layer in float)", "qdq", region),
            (f"QOperator on {len(region)} conv-region nodes (first layer in float)", "qoperator", region),
        ]
        attempts: list[tuple[VariantReport, Path]] = []
        for i, (label, fmt, nodes) in enumerate(candidates):
            rep = VariantReport(
                variant="int8",
                target="cpu",
                method=(
                    f"static {label}, per-channel QInt8 weights, QUInt8 activations, MinMax on "
                    f"{len(calib_inputs)} frames, {prep_note}"
                ),
            )
            path = Path(tmp) / f"candidate{i}.onnx"
            attempts.append((rep, path))
            try:
                quantize_int8(base, path, input_name, calib_inputs, fmt=fmt, nodes=nodes, on_calib=on_calib)
                rep.size = path.stat().st_size
                bad = nonfinite_scales(path)
                if bad:
                    rep.reason = f"{len(bad)} non-finite quantization scale(s), e.g. {bad[0]}"
                else:
                    judge(rep, path)
            except Exception as exc:
                rep.reason = f"quantization failed: {_short(exc)}"
            if not rep.fit:
                log.info("int8 candidate '%s' of %s unfit: %s", label, manifest.name, rep.reason)
        fit = {str(i): path for i, (rep, path) in enumerate(attempts) if rep.fit}
        if fit:
            try:
                lat = speed(fit)
            except Exception as exc:  # cannot rank them: the first fit one is still a safe choice
                log.warning("int8 candidates of %s could not be timed: %s", manifest.name, exc)
                lat = {}
            best = min(fit, key=lambda k: lat.get(k, float("inf")))
            chosen, chosen_path = attempts[int(best)]
            others = [
                f"{r.method.split(',')[0]}: "
                + (f"{lat[str(i)]:.1f} ms" if r.fit and str(i) in lat else f"unfit ({r.reason})")
                for i, (r, _) in enumerate(attempts)
                if r is not chosen
            ]
            chosen.method += f"; fastest fit of {len(attempts)} candidates (others: {'; '.join(others)})"
        else:
            # Keep the one closest to fp32 on disk so its speed is still measured for the record.
            ran = [(r, p) for r, p in attempts if r.f1 is not None]
            chosen, chosen_path = max(ran, key=lambda a: a[0].f1 or 0.0) if ran else attempts[-1]
            chosen.reason = "; ".join(f"{r.method.split(',')[0]}: {r.reason}" for r, _ in attempts)
        if chosen_path.exists():
            shutil.copyfile(chosen_path, dst)
        else:
            dst.unlink(missing_ok=True)
    chosen.build_s = time.perf_counter() - t0
    return chosen


# --------------------------------------------------------------------------- helpers


def _apply_fidelity(rep: VariantReport, fid: Fidelity) -> None:
    rep.f1, rep.precision, rep.recall, rep.mean_iou = fid.f1, fid.precision, fid.recall, fid.mean_iou
    rep.detections, rep.reference_detections = fid.candidate, fid.reference


def _input_name(path: Path) -> str:
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    return next(i.name for i in graph.input if i.name not in inits)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _short(exc: BaseException | str, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


if __name__ == "__main__":
    # The fp16 worker: ``python -m controller.registry.variants fp16 SRC DST [MEMORY_BYTES]`` (see
    # convert_fp16).
    if len(sys.argv) in (4, 5) and sys.argv[1] == "fp16":
        _fp16_main(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) == 5 else None)
    else:
        sys.exit("usage: python -m controller.registry.variants fp16 SRC DST [MEMORY_BYTES]")
