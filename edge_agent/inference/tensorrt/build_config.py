"""What a TensorRT engine is built from: pure code, no TensorRT and no GPU needed.

The engine precision and builder flags, :class:`BuildOptions`, INT8 calibration batches, the
optimization profiles (:func:`optimization_profile`, and the same as onnxruntime TensorRT EP options:
:func:`ort_trt_profile_options`), the build fingerprint that goes into the cache key, and the check
that an INT8 model is one TensorRT can take (:func:`int8_qdq_problem`). The native path and
onnxruntime's TensorRT EP share them, so both build the same thing for the same request.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from edge_agent.inference.tensorrt.errors import ProfileNotExpressible, TrtError

Precision = Literal["fp32", "fp16", "int8"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "fp16", "int8")
ProgressFn = Callable[[float], None]
"""Build progress in percent (0-100); only called when the builder reports steps."""


def resolve_precision(variant: str, setting: str = "auto") -> Precision:
    """The engine precision for a model variant: what the controller chose is what gets built.

    ``setting`` (``inference.trt_precision``) wins when it names a precision; with ``auto`` an
    ``fp16`` variant builds FP16, an ``int8`` variant INT8, and anything else (``fp32``, which the
    controller sends precisely when FP16 was judged unfit for the model) a plain FP32 engine (TF32
    tensor cores allowed, TensorRT's default), never FP16.
    """
    if setting in PRECISIONS:
        return setting  # type: ignore[return-value]
    if variant in ("fp16", "int8"):
        return variant  # type: ignore[return-value]
    return "fp32"


def builder_flags(precision: Precision) -> tuple[str, ...]:
    """The ``trt.BuilderFlag`` names a build of ``precision`` sets: the only place they are decided,
    so the cache key (:func:`build_fingerprint`) and the build (:meth:`TensorRtRuntime.build_engine`)
    cannot disagree. FP32 sets none (TF32 is on by default in TensorRT 10)."""
    if precision == "fp16":
        return ("FP16",)
    if precision == "int8":
        return ("INT8", "FP16")  # layers without INT8 kernels may fall back to FP16, not FP32
    return ()


@dataclass
class Calibration:
    """Preprocessed INT8 calibration batches (model input layout and dtype), all of one batch size."""

    batches: list[np.ndarray]

    @property
    def batch_size(self) -> int:
        return int(self.batches[0].shape[0]) if self.batches else 0


class _Preprocessor(Protocol):
    def batch(self, frames: Sequence[np.ndarray]) -> tuple[np.ndarray, list[Any]]: ...


def calibration_from_frames(
    frames: Sequence[np.ndarray], preprocessor: _Preprocessor, *, batch_size: int = 1
) -> Calibration:
    """Calibration batches from camera frames (BGR uint8), preprocessed exactly as inference does.

    A trailing partial batch is dropped: the calibrator feeds fixed-size batches.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    batches = []
    for i in range(0, len(frames) - batch_size + 1, batch_size):
        batch, _ = preprocessor.batch(frames[i : i + batch_size])
        batches.append(np.ascontiguousarray(batch))
    return Calibration(batches)


@dataclass(frozen=True)
class BuildOptions:
    max_batch: int = 1
    sample_shape: tuple[int, ...] | None = None
    """Input shape of one sample without batch (e.g. (320, 320, 3)); fills dynamic non-batch dims."""
    workspace_mb: int = 1024
    progress: ProgressFn | None = None
    cancel: threading.Event | None = None
    opt_batch: int = 1
    """The batch TensorRT tunes kernels for (profile kOPT), clamped to [1, max_batch]: 1, the common
    case of one camera per model; the number of cameras sharing the model where that is known."""
    builder_optimization_level: int | None = None
    """TensorRT's 0-5 (default 3); lower builds faster on a Jetson, higher may run faster."""
    timing_cache: Path | None = None
    """A TensorRT timing cache file, read before and written (atomically) after a build."""


Dim = int | str | None
"""A model input dimension: an int > 0 is fixed; None, a name (ONNX dim_param) or <= 0 is dynamic."""


@dataclass(frozen=True)
class InputProfile:
    """Optimization profile shapes of one model input: the range every engine must accept."""

    name: str
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]


def _fixed(d: Dim) -> bool:
    return isinstance(d, int) and not isinstance(d, bool) and d > 0


def optimization_profile(
    inputs: Mapping[str, Sequence[Dim]],
    *,
    sample_shape: Sequence[int] | None,
    max_batch: int,
    opt_batch: int = 1,
) -> list[InputProfile]:
    """min/opt/max shapes for every dynamic model input, from the manifest's sample shape and batch.

    One function for the native builder and onnxruntime's TensorRT EP (``trt_profile_*_shapes``),
    so that an engine covers every batch the pipeline sends (1..``max_batch``) and nothing is ever
    rebuilt inside ``run()``; kernels are tuned for ``opt_batch``. A fixed batch stays
    fixed (min = opt = max); dynamic non-batch dims take the manifest's size (the preprocessor
    always produces exactly that); a fixed non-batch dim that contradicts the manifest is an error.
    A model without dynamic inputs needs no profile: the result is then empty.
    """
    if max_batch < 1:
        raise ValueError("max_batch must be >= 1")
    opt_b = min(max(1, opt_batch), max_batch)
    out: list[InputProfile] = []
    for name, shape in inputs.items():
        dims = list(shape)
        if not dims:
            continue  # a scalar input has nothing to profile
        if all(_fixed(d) for d in dims):
            continue
        rest_model = dims[1:]
        if sample_shape is None or len(sample_shape) != len(rest_model):
            raise TrtError(
                f"input {name} has dynamic dims {_fmt(dims)} and the manifest gives no "
                f"{len(rest_model)}-dimensional sample shape to fill them"
            )
        rest: list[int] = []
        for d, s in zip(rest_model, sample_shape, strict=True):
            if _fixed(d):
                if int(d) != int(s):  # type: ignore[arg-type]
                    raise TrtError(
                        f"input {name} is {_fmt(dims)} but the manifest's input is {tuple(sample_shape)}"
                    )
                rest.append(int(d))  # type: ignore[arg-type]
            else:
                rest.append(int(s))
        if _fixed(dims[0]):
            lo = opt = hi = int(dims[0])  # type: ignore[arg-type]
        else:
            lo, opt, hi = 1, opt_b, max_batch
        out.append(InputProfile(name, (lo, *rest), (opt, *rest), (hi, *rest)))
    return out


def _fmt(dims: Sequence[Dim]) -> str:
    return "[" + ",".join(str(d) if _fixed(d) else "?" for d in dims) + "]"


def ort_trt_profile_options(profiles: Sequence[InputProfile]) -> dict[str, str]:
    """onnxruntime TensorRT EP provider options for explicit profiles (``{}`` for a static model).

    Format (onnxruntime ``ParseProfileShapes``): ``"input1:1x3x320x320,input2:..."``; onnxruntime
    splits each entry at the first ``:`` and the list at ``,``, so an input whose name contains either
    cannot be named at all (TF models: ``image_tensor:0``): :class:`ProfileNotExpressible` then, and
    the build process instead widens onnxruntime's implicit profile by warm-up runs at batch 1 and
    ``max_batch`` (see :mod:`edge_agent.inference.engine_build`).
    """
    if not profiles:
        return {}
    bad = [p.name for p in profiles if ":" in p.name or "," in p.name or not p.name]
    if bad:
        raise ProfileNotExpressible(
            f"onnxruntime's trt_profile_*_shapes cannot name input(s) {bad}: the option is split at ':' and ','"
        )

    def fmt(pick: Callable[[InputProfile], tuple[int, ...]]) -> str:
        return ",".join(f"{p.name}:{'x'.join(str(d) for d in pick(p))}" for p in profiles)

    return {
        "trt_profile_min_shapes": fmt(lambda p: p.min),
        "trt_profile_opt_shapes": fmt(lambda p: p.opt),
        "trt_profile_max_shapes": fmt(lambda p: p.max),
    }


def onnx_input_shapes(onnx_path: Path) -> dict[str, tuple[Dim, ...]]:
    """The model's graph inputs (initializers excluded) and their dims, read with ``onnx`` (no
    weights loaded, no session created): what :func:`optimization_profile` takes."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    out: dict[str, tuple[Dim, ...]] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        dims: list[Dim] = []
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(int(d.dim_value))
            else:
                dims.append(d.dim_param or None)
        out[vi.name] = tuple(dims)
    return out


def ort_trt_profile_options_for(
    onnx_path: Path, *, sample_shape: Sequence[int], max_batch: int, opt_batch: int = 1
) -> dict[str, str]:
    """:func:`ort_trt_profile_options` of the model file at ``onnx_path`` (the factory's entry point)."""
    return ort_trt_profile_options(
        optimization_profile(
            onnx_input_shapes(onnx_path), sample_shape=sample_shape, max_batch=max_batch, opt_batch=opt_batch
        )
    )


def build_fingerprint(
    options: BuildOptions, precision: Precision, *, calibrated: bool = False, device: str = ""
) -> str:
    """A short digest of everything besides the model, GPU, TensorRT version and precision that
    makes an engine what it is: the profile inputs (max/opt batch, sample shape), the builder
    flags, workspace, optimization level, whether INT8 scales came from calibration, and device
    details (SM count, memory: Jetson modules share one name and compute capability). Progress,
    cancel and the timing cache path change how a build runs, not what it builds: left out."""
    canonical = json.dumps(
        {
            "max_batch": options.max_batch,
            "opt_batch": min(max(1, options.opt_batch), options.max_batch),
            "sample_shape": list(options.sample_shape) if options.sample_shape is not None else None,
            "workspace_mb": options.workspace_mb,
            "opt_level": options.builder_optimization_level,
            "flags": list(builder_flags(precision)),
            "int8_scales": ("calibrated" if calibrated else "qdq") if precision == "int8" else None,
            "device": device,
        },
        sort_keys=True,
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


_QOPERATOR_OPS = frozenset(
    {
        "QLinearConv",
        "QLinearMatMul",
        "QLinearAdd",
        "QLinearMul",
        "QLinearAveragePool",
        "QLinearGlobalAveragePool",
        "QLinearConcat",
        "QLinearLeakyRelu",
        "QLinearSigmoid",
        "QLinearSoftmax",
        "QGemm",
        "ConvInteger",
        "MatMulInteger",
        "DynamicQuantizeLinear",
        "DynamicQuantizeMatMul",
        "MatMulIntegerToFloat",
    }
)


def int8_qdq_problem(onnx_path: Path) -> str | None:
    """Why this INT8 model must not go to TensorRT (native or onnxruntime's TensorRT EP), or None.

    TensorRT takes INT8 only as explicit, symmetric quantization: QuantizeLinear/DequantizeLinear
    pairs with signed INT8 zero points that are all 0 (its ONNX parser rejects UINT8 Q/DQ and asserts
    "TRT only supports symmetric quantization - zeroPt must be all zeros"); onnxruntime documents
    GPU quantization as S8S8 only; a DequantizeLinear of an INT32 (quantized) bias is refused by
    TensorRT's parser too. So an acceptable model is what ``quantize_static`` makes with QInt8
    activations and weights and ``extra_options={"ActivationSymmetric": True, "WeightSymmetric":
    True, "QuantizeBias": False}``. QOperator models (QLinearConv, ConvInteger, ...) and U8S8 QDQ
    (what a CPU-tuned ``quantize_static`` produces) are CPU models: refused here with the reason,
    so the agent runs them on onnxruntime's CPU/CUDA path instead of fragmenting a TensorRT graph.
    """
    import onnx
    from onnx import numpy_helper

    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as exc:
        return f"cannot read the model: {exc}"
    consts: dict[str, Any] = {i.name: i for i in model.graph.initializer}
    elem: dict[str, int] = {i.name: i.data_type for i in model.graph.initializer}
    nodes = list(model.graph.node)
    for n in nodes:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value" and n.output:
                    consts[n.output[0]] = a.t
                    elem[n.output[0]] = a.t.data_type
    qoperators = sorted({n.op_type for n in nodes if n.op_type in _QOPERATOR_OPS})
    if qoperators:
        return (
            f"QOperator INT8 ({', '.join(qoperators)}) is a CPU format; TensorRT needs symmetric "
            "QuantizeLinear/DequantizeLinear (S8S8)"
        )
    qdq = [n for n in nodes if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    if not qdq:
        return "no QuantizeLinear/DequantizeLinear nodes: nothing tells TensorRT the INT8 scales"
    int8 = onnx.TensorProto.INT8
    for n in qdq:
        label = f"{n.op_type} {n.name or (n.output[0] if n.output else '?')}"
        zp = n.input[2] if len(n.input) > 2 and n.input[2] else None
        if zp is None:
            if n.op_type == "QuantizeLinear":
                return f"{label} has no zero point, so by ONNX it quantizes to UINT8; TensorRT needs INT8"
            src = n.input[0]
            if src in elem and elem[src] != int8:
                return f"{label} dequantizes {onnx.TensorProto.DataType.Name(elem[src])}; TensorRT needs INT8"
            continue
        if zp not in consts:
            return f"{label}: zero point {zp} is computed at run time; TensorRT needs constant zeros"
        t = consts[zp]
        if t.data_type == onnx.TensorProto.INT32:
            return (
                f"{label} dequantizes INT32 (a quantized bias); TensorRT dequantizes only 8-bit tensors "
                "(quantize with QuantizeBias=False)"
            )
        if t.data_type != int8:
            why = " (asymmetric U8 activations)" if t.data_type == onnx.TensorProto.UINT8 else ""
            return (
                f"{label}: zero point is {onnx.TensorProto.DataType.Name(t.data_type)}{why}; "
                "TensorRT needs INT8 zero points, all 0"
            )
        if np.any(numpy_helper.to_array(t) != 0):
            return f"{label}: zero point is not 0 (asymmetric); TensorRT supports symmetric INT8 only"
    return None
