"""TensorRT on the device: engine cache, the native TensorRT backend, and the runtime seam.

Engines are specific to the GPU, its compute capability and the TensorRT version, and to how they
were built (optimization profile, builder flags, workspace), so they are built on the device and
cached under an :class:`EngineKey` of (model sha256, GPU name, compute capability, TensorRT version,
precision, build fingerprint). A cached engine that does not deserialize is evicted, reported and
rebuilt; one that deserializes but cannot be run here (data-dependent output shapes) is kept and
reported, and the model runs on onnxruntime instead.

Everything that touches TensorRT or CUDA sits behind :class:`TrtRuntime`: :class:`TensorRtRuntime`
is the real one (``tensorrt`` + ``cuda-python``, both from the ``gpu`` extra, imported lazily), tests
pass a fake. Nothing here imports ``tensorrt`` at module import time: on a CPU device the module
loads and :func:`load_tensorrt_runtime` says why TensorRT cannot be used.

Builds themselves run out of process (:mod:`edge_agent.inference.engine_build`); the pure functions here
(:func:`optimization_profile`, :func:`ort_trt_profile_options`, :func:`resolve_precision`,
:func:`int8_qdq_problem`, :func:`build_fingerprint`) are what the native path and onnxruntime's
TensorRT execution provider share, so both build the same thing for the same request.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from edge_agent.core.files import atomic_write

log = logging.getLogger(__name__)

Precision = Literal["fp32", "fp16", "int8"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "fp16", "int8")
ProgressFn = Callable[[float], None]
"""Build progress in percent (0-100); only called when the builder reports steps."""

ENGINE_SUFFIX = ".engine"
NATIVE_PROVIDER = "TensorRT"


class TrtError(Exception):
    """TensorRT could not build or load an engine; the message says why."""


class BuildCancelled(TrtError):
    """The build was cancelled (the agent is stopping)."""


class UnsupportedEngine(TrtError):
    """The engine is fine but the native runner cannot run it (e.g. data-dependent output shapes).

    Not a reason to evict or rebuild: the same engine would fail the same way. The model runs on
    onnxruntime instead, and the reason is reported.
    """


class ProfileNotExpressible(TrtError):
    """The optimization profile cannot be passed to onnxruntime's TensorRT EP as provider options."""


# --------------------------------------------------------------------------- precision

TRT_MAJOR_SUPPORTED = 10


def resolve_precision(variant: str, setting: str = "auto") -> Precision:
    """The engine precision for a model variant: what the controller chose is what gets built (G8).

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


# --------------------------------------------------------------------------- cache keys


def _slug(text: str, max_len: int = 40) -> str:
    s = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9.]+", "-", text.strip())).strip("-.").lower()
    return (s or "none")[:max_len]


@dataclass(frozen=True)
class EngineKey:
    """What makes an engine reusable: the same model bytes, on the same GPU, TensorRT and precision,
    built the same way (``build``: :func:`build_fingerprint` of the optimization profile, builder
    flags, workspace and device details; "" for keys made before it existed).

    Prefer :meth:`for_build`, which fills ``build`` from the runtime and the build options.
    """

    model_sha256: str
    gpu_name: str
    compute_capability: str
    trt_version: str
    precision: Precision
    build: str = ""

    @classmethod
    def for_build(
        cls,
        runtime: TrtRuntime,
        model_sha256: str,
        precision: Precision,
        options: BuildOptions,
        *,
        calibrated: bool = False,
    ) -> EngineKey:
        """The key of the engine ``runtime`` builds from these options (G11)."""
        return cls(
            model_sha256,
            runtime.gpu_name,
            runtime.compute_capability,
            runtime.version,
            precision,
            build=build_fingerprint(
                options,
                precision,
                calibrated=calibrated,
                device=str(getattr(runtime, "device_fingerprint", "")),
            ),
        )

    def digest(self) -> str:
        fields = [self.model_sha256, self.gpu_name, self.compute_capability, self.trt_version, self.precision]
        if self.build:
            fields.append(self.build)  # keys without it keep their old digest (and file name)
        canonical = "\x1f".join(fields)
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def file_name(self) -> str:
        """Stable, filesystem-safe (``[a-z0-9.-]``, no path separators, < 160 chars) and unique.

        The readable parts are for people listing the folder; the digest of the exact fields is
        what makes two keys that slug alike ("GeForce RTX/4090" and "GeForce RTX 4090") differ.
        """
        cc = _slug(self.compute_capability, 8)
        return (
            f"{_slug(self.model_sha256, 16)}-{_slug(self.gpu_name)}-sm{cc}-"
            f"trt{_slug(self.trt_version, 16)}-{self.precision}-{self.digest()[:16]}{ENGINE_SUFFIX}"
        )


@dataclass(frozen=True)
class Eviction:
    file_name: str
    reason: str


class EngineCache:
    """Serialized engines on disk, one file per :class:`EngineKey`; bounded in bytes, oldest out.

    "Oldest" is by last use: a lookup that hits refreshes the file's mtime. Writes are atomic
    (temporary file, fsync, rename), so a power loss leaves either the old state or the new engine,
    never half an engine under the final name. Thread-safe.
    """

    def __init__(self, directory: Path, *, max_bytes: int = 4 * 2**30, sweep_stale: bool = True) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be > 0")
        self.dir = directory
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self.evictions: list[Eviction] = []
        self.dir.mkdir(parents=True, exist_ok=True)
        if sweep_stale:  # not in a build process: another build may be writing its temporary file
            for stale in self.dir.glob(f"*{ENGINE_SUFFIX}.tmp*"):
                stale.unlink(missing_ok=True)  # a write cut short by a crash

    def path(self, key: EngineKey) -> Path:
        return self.dir / key.file_name()

    def lookup(self, key: EngineKey) -> bytes | None:
        path = self.path(key)
        with self._lock:
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                return None
            except OSError as exc:
                log.warning("cannot read cached engine %s: %s", path.name, exc)
                return None
            with contextlib.suppress(OSError):
                os.utime(path)  # most recently used
        if not data:
            self.evict(key, "empty engine file")
            return None
        return data

    def store(self, key: EngineKey, data: bytes) -> Path:
        if not data:
            raise ValueError("refusing to cache an empty engine")
        path = self.path(key)
        with self._lock:
            atomic_write(path, data)
            self._enforce_bound(keep=path)
        return path

    def enforce_bound(self, keep: EngineKey | None = None) -> None:
        """Apply the size bound now (after a build process wrote ``keep``'s engine into the folder)."""
        with self._lock:
            self._enforce_bound(keep=self.path(keep) if keep is not None else None)

    def evict(self, key: EngineKey, reason: str) -> Eviction:
        """Remove ``key``'s engine (it is corrupt or will not load) and record why."""
        ev = Eviction(key.file_name(), reason)
        with self._lock:
            self.path(key).unlink(missing_ok=True)
            self.evictions.append(ev)
        log.warning("evicted cached engine %s: %s", ev.file_name, reason)
        return ev

    def entries(self) -> list[Path]:
        return sorted(self.dir.glob(f"*{ENGINE_SUFFIX}"))

    def total_bytes(self) -> int:
        total = 0
        for p in self.entries():
            with contextlib.suppress(OSError):
                total += p.stat().st_size
        return total

    def _enforce_bound(self, *, keep: Path | None) -> None:
        files = []
        for p in self.dir.glob(f"*{ENGINE_SUFFIX}"):
            with contextlib.suppress(OSError):
                st = p.stat()
                files.append((st.st_mtime_ns, p.name, p, st.st_size))
        total = sum(f[3] for f in files)
        for _, name, p, size in sorted(files):
            if total <= self.max_bytes:
                break
            if p == keep:
                continue  # the engine just built stays, even when it alone exceeds the bound
            p.unlink(missing_ok=True)
            total -= size
            self.evictions.append(Eviction(name, "cache size bound"))
            log.info("evicted cached engine %s (cache over %d bytes)", name, self.max_bytes)


# --------------------------------------------------------------------------- calibration


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


# --------------------------------------------------------------------------- the seam


class TrtEngine(Protocol):
    """A deserialized engine ready to run."""

    input_name: str
    input_shape: tuple[int | str | None, ...]
    dynamic_batch: bool

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


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
    case of one camera per model (G20); the number of cameras sharing the model where that is known."""
    builder_optimization_level: int | None = None
    """TensorRT's 0-5 (default 3); lower builds faster on a Jetson, higher may run faster."""
    timing_cache: Path | None = None
    """A TensorRT timing cache file, read before and written (atomically) after a build (G21)."""


# --------------------------------------------------------------------------- build config (pure)

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
    rebuilt inside ``run()`` (G4); kernels are tuned for ``opt_batch`` (G20). A fixed batch stays
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
    """:func:`ort_trt_profile_options` of the model file at ``onnx_path`` (the backends' entry point)."""
    return ort_trt_profile_options(
        optimization_profile(
            onnx_input_shapes(onnx_path), sample_shape=sample_shape, max_batch=max_batch, opt_batch=opt_batch
        )
    )


def build_fingerprint(
    options: BuildOptions, precision: Precision, *, calibrated: bool = False, device: str = ""
) -> str:
    """A short digest of everything besides the model, GPU, TensorRT version and precision that
    makes an engine what it is (G11): the profile inputs (max/opt batch, sample shape), the builder
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


# --------------------------------------------------------------------------- INT8 on the GPU (G12)

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


class TrtRuntime(Protocol):
    """Everything the agent needs from TensorRT; the real one is :class:`TensorRtRuntime`."""

    version: str
    gpu_name: str
    compute_capability: str

    def build_engine(
        self, onnx_path: Path, precision: Precision, calib: Calibration | None, options: BuildOptions
    ) -> bytes: ...

    def load_engine(self, data: bytes) -> TrtEngine: ...


# --------------------------------------------------------------------------- backend


@dataclass
class EngineOutcome:
    """How an engine was obtained: for the MODEL_BUILD events and the log."""

    key: EngineKey
    cache_hit: bool
    build_s: float | None = None
    evicted: list[Eviction] = field(default_factory=list)


OutOfProcessBuild = Callable[[Calibration | None], None]
"""Builds ``key``'s engine into the cache in another process and returns when it is there; raises
:class:`BuildCancelled` or another :class:`TrtError` (see :mod:`edge_agent.inference.engine_build`)."""


def obtain_engine(
    runtime: TrtRuntime,
    cache: EngineCache,
    onnx_path: Path,
    key: EngineKey,
    *,
    calib: Calibration | Callable[[], Calibration | None] | None = None,
    options: BuildOptions | None = None,
    on_build_start: Callable[[], None] | None = None,
    on_evict: Callable[[Eviction], None] | None = None,
    build: OutOfProcessBuild | None = None,
) -> tuple[TrtEngine, EngineOutcome]:
    """The engine for ``key``: from the cache when it loads, else built, cached and loaded.

    ``calib`` may be a function: it is called only when a build is needed (gathering calibration
    frames from a camera takes seconds; a cache hit needs none). ``build``: build in another
    process (which writes the engine into ``cache`` atomically) instead of calling
    ``runtime.build_engine`` here; the engine is then read back from the cache.

    An engine that loads but cannot be run natively (:class:`UnsupportedEngine`) is neither evicted
    nor rebuilt: the error goes straight to the caller, which falls back to onnxruntime.
    """
    options = options or BuildOptions()
    outcome = EngineOutcome(key=key, cache_hit=False)
    cached = cache.lookup(key)
    if cached is not None:
        try:
            engine = runtime.load_engine(cached)
        except UnsupportedEngine:
            raise
        except Exception as exc:
            ev = cache.evict(key, f"cached engine does not load: {exc}")
            outcome.evicted.append(ev)
            if on_evict is not None:
                on_evict(ev)
        else:
            outcome.cache_hit = True
            return engine, outcome
    if on_build_start is not None:
        on_build_start()
    t0 = time.monotonic()
    calibration = calib() if callable(calib) else calib
    if build is not None:
        build(calibration)
        data = cache.lookup(key)
        if data is None:
            raise TrtError("the engine build process finished but left no engine in the cache")
        cache.enforce_bound(keep=key)
    else:
        data = runtime.build_engine(onnx_path, key.precision, calibration, options)
        if not data:
            raise TrtError("the TensorRT builder returned no engine")
        cache.store(key, data)
    outcome.build_s = time.monotonic() - t0
    try:
        engine = runtime.load_engine(data)
    except UnsupportedEngine:
        raise  # the engine stays cached: the next start falls back at once, without a rebuild
    except Exception as exc:
        ev = cache.evict(key, f"freshly built engine does not load: {exc}")
        outcome.evicted.append(ev)
        raise TrtError(f"freshly built engine does not load: {exc}") from exc
    return engine, outcome


class TensorRtBackend:
    """An :class:`~edge_agent.inference.backends.InferenceBackend` over a native TensorRT engine."""

    def __init__(self, engine: TrtEngine, *, precision: Precision, engine_file: str) -> None:
        self._engine = engine
        self.provider: str = NATIVE_PROVIDER
        self.precision = precision
        self.engine_file = engine_file
        self.input_name: str = engine.input_name
        self.input_shape: tuple[int | str | None, ...] = engine.input_shape
        self.dynamic_batch: bool = engine.dynamic_batch
        self.host_memory: str | None = getattr(engine, "host_memory", None)
        """``pinned`` or ``pageable`` host staging (G18), None for an engine that does not say."""

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        return self._engine.run(batch)

    def close(self) -> None:
        engine, self.__dict__["_engine"] = self.__dict__.get("_engine"), None
        if engine is not None:
            engine.close()


# --------------------------------------------------------------------------- the real runtime
# Written against the TensorRT 10 Python API and cuda-python's runtime bindings. NOT run on a GPU
# in this project's test suite (no GPU here); exercised only through the TrtRuntime seam.


def _import_cudart() -> Any:
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6

        return cudart
    except ImportError:
        from cuda import cudart  # older cuda-python

        return cudart


def _cuda_check(cudart: Any, result: Any) -> Any:
    """cuda-python returns (err, *values); raise on an error, return the value(s)."""
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if err != cudart.cudaError_t.cudaSuccess:
        raise TrtError(f"CUDA error: {err}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def load_tensorrt_runtime(device: int = 0) -> tuple[TensorRtRuntime | None, str]:
    """The real runtime, or None and the reason TensorRT cannot be used on this device."""
    try:
        return TensorRtRuntime(device), ""
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def _major(version: str) -> int | None:
    m = re.match(r"\s*(\d+)", version)
    return int(m.group(1)) if m else None


class TensorRtRuntime:
    """``tensorrt`` + ``cuda-python`` on CUDA device ``device``.

    ``trt_module`` / ``cudart_module``: the seam for tests (a fake of the TensorRT 10 Python API and
    of cuda-python's runtime); by default the real packages are imported.
    """

    def __init__(self, device: int = 0, *, trt_module: Any = None, cudart_module: Any = None) -> None:
        if trt_module is None:
            import tensorrt

            trt_module = tensorrt
        trt = trt_module
        cudart = cudart_module if cudart_module is not None else _import_cudart()
        self.version: str = str(trt.__version__)
        if _major(self.version) != TRT_MAJOR_SUPPORTED:
            # TensorRT 11 removed BuilderFlag.FP16/INT8, calibrators and weakly typed networks; 8.x
            # has no IProgressMonitor and builds implicit-batch networks from create_network(0).
            raise TrtError(
                f"TensorRT {self.version} is installed; the native engine path is written for TensorRT "
                f"{TRT_MAJOR_SUPPORTED}.x (onnxruntime is used instead)"
            )
        self._trt = trt
        self._cudart = cudart
        self.device = device
        _cuda_check(cudart, cudart.cudaSetDevice(device))
        props = _cuda_check(cudart, cudart.cudaGetDeviceProperties(device))
        name = props.name
        self.gpu_name: str = (name.decode() if isinstance(name, bytes) else str(name)).rstrip("\x00")
        self.compute_capability: str = f"{props.major}.{props.minor}"
        sms = getattr(props, "multiProcessorCount", None)
        mem = getattr(props, "totalGlobalMem", None)
        # Jetson AGX, NX and Nano Orin are all "Orin", compute capability 8.7: engines are tuned per module.
        self.device_fingerprint: str = f"sm{sms}-{int(mem) // 2**20}MiB" if sms and mem else ""
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)

    def build_engine(
        self, onnx_path: Path, precision: Precision, calib: Calibration | None, options: BuildOptions
    ) -> bytes:
        trt = self._trt
        _cuda_check(self._cudart, self._cudart.cudaSetDevice(self.device))  # the build thread's device
        if precision == "int8" and (calib is None or not calib.batches):
            problem = int8_qdq_problem(onnx_path)  # explicit quantization only: symmetric INT8 Q/DQ
            if problem is not None:
                raise TrtError(f"INT8 on TensorRT refused: {problem}")
        builder = trt.Builder(self._logger)
        network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
        parser = trt.OnnxParser(network, self._logger)
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise TrtError(f"the ONNX parser refused {onnx_path.name}: {errors or 'no detail'}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_mb * 2**20)
        if options.builder_optimization_level is not None:
            config.builder_optimization_level = int(options.builder_optimization_level)
        for flag in builder_flags(precision):  # exactly the precision asked for: fp32 sets no FP16 (G8)
            value = getattr(trt.BuilderFlag, flag, None)
            if value is None:
                raise TrtError(f"TensorRT {self.version} has no BuilderFlag.{flag}; cannot build {precision}")
            config.set_flag(value)
        inputs = [network.get_input(i) for i in range(network.num_inputs)]
        profiles = optimization_profile(
            {t.name: tuple(int(d) for d in t.shape) for t in inputs},
            sample_shape=options.sample_shape,
            max_batch=options.max_batch,
            opt_batch=options.opt_batch,
        )
        if profiles:
            profile = builder.create_optimization_profile()
            for ip in profiles:
                profile.set_shape(ip.name, ip.min, ip.opt, ip.max)
            config.add_optimization_profile(profile)
        calibrator = None
        if precision == "int8" and calib is not None and calib.batches:
            calibrator = self._attach_calibrator(builder, config, inputs, calib, dynamic=bool(profiles))
        timing_cache = _attach_timing_cache(config, options.timing_cache)
        monitor = None
        if options.progress is not None or options.cancel is not None:
            monitor = _make_progress_monitor(trt, options.progress, options.cancel)
            config.progress_monitor = monitor
        serialized = builder.build_serialized_network(network, config)
        if options.cancel is not None and options.cancel.is_set():
            raise BuildCancelled("engine build cancelled")
        if serialized is None:
            raise TrtError("the TensorRT builder failed (see the agent log for TensorRT's messages)")
        if options.timing_cache is not None:
            _save_timing_cache(config, options.timing_cache)
        del calibrator, monitor, timing_cache  # they must outlive the build, no longer
        return bytes(memoryview(serialized))

    def _attach_calibrator(
        self, builder: Any, config: Any, inputs: list[Any], calib: Calibration, *, dynamic: bool
    ) -> Any:
        """INT8 entropy calibration whose device buffer is exactly the shape TensorRT reads (G9).

        With runtime dimensions TensorRT calibrates at the calibration profile's kOPT ("MIN and MAX
        values will be overwritten by kOPT", NvInfer.h), and reads that many bytes from the pointer
        ``get_batch`` returns. So the calibration profile is exactly the calibration batches' shape,
        not the inference profile (whose kOPT was ``max_batch``: reads past a one-sample buffer).
        """
        trt = self._trt
        if len(inputs) != 1:
            raise TrtError(f"INT8 calibration feeds one input; this model has {len(inputs)}")
        tensor = inputs[0]
        shapes = {tuple(int(d) for d in b.shape) for b in calib.batches}
        if len(shapes) != 1:
            raise TrtError(f"calibration batches differ in shape: {sorted(shapes)}")
        (shape,) = shapes
        net_shape = tuple(int(d) for d in tensor.shape)
        if len(shape) != len(net_shape) or any(
            d > 0 and d != s for d, s in zip(net_shape, shape, strict=True)
        ):
            raise TrtError(f"calibration batches are {shape}; the network input {tensor.name} is {net_shape}")
        dtype = np.dtype(trt.nptype(tensor.dtype))
        if any(b.dtype != dtype for b in calib.batches):
            raise TrtError(f"calibration batches must be {dtype} like the network input {tensor.name}")
        nbytes = int(np.prod(shape)) * dtype.itemsize
        calibrator = _make_calibrator(trt, self._cudart, calib, nbytes)
        config.int8_calibrator = calibrator
        if dynamic:
            calib_profile = builder.create_optimization_profile()
            calib_profile.set_shape(tensor.name, shape, shape, shape)
            if config.set_calibration_profile(calib_profile) is False:
                raise TrtError(f"TensorRT refused the calibration profile {shape} for {tensor.name}")
        return calibrator

    def load_engine(self, data: bytes) -> TrtEngine:
        _cuda_check(self._cudart, self._cudart.cudaSetDevice(self.device))
        engine = self._runtime.deserialize_cuda_engine(data)
        if engine is None:
            raise TrtError("TensorRT could not deserialize the engine (corrupt, or another GPU/version)")
        return _CudaEngine(self._trt, self._cudart, engine, self.device)


def _attach_timing_cache(config: Any, path: Path | None) -> Any:
    """Reuse the tactic timings of earlier builds on this GPU (G21): a rebuild after a model update
    takes seconds instead of minutes. A cache from another device or TensorRT is not trusted
    (``ignore_mismatch=False``); an unreadable one starts empty."""
    if path is None:
        return None
    blob = b""
    with contextlib.suppress(OSError):
        blob = path.read_bytes()
    cache = config.create_timing_cache(blob)
    if blob and (cache is None or not config.set_timing_cache(cache, False)):
        log.warning("timing cache %s does not fit this GPU/TensorRT; starting an empty one", path.name)
        cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, False)
    elif not blob:
        config.set_timing_cache(cache, False)
    return cache


def _save_timing_cache(config: Any, path: Path) -> None:
    try:
        cache = config.get_timing_cache()
        if cache is None:
            return
        atomic_write(path, bytes(memoryview(cache.serialize())))
    except Exception as exc:  # a timing cache only saves time later; never fail a good build on it
        log.warning("could not save the TensorRT timing cache %s: %s", path, exc)


def timing_cache_path(cache_dir: Path, key: EngineKey) -> Path:
    """Where the TensorRT timing cache of ``key``'s GPU lives: one per GPU name, compute capability
    and TensorRT version, shared by every model built there (not an engine: no size bound)."""
    cc = _slug(key.compute_capability, 8)
    return cache_dir / f"timing-{_slug(key.gpu_name)}-sm{cc}-trt{_slug(key.trt_version, 16)}.cache"


def _make_progress_monitor(trt: Any, progress: ProgressFn | None, cancel: threading.Event | None) -> Any:
    class Monitor(trt.IProgressMonitor):  # type: ignore[misc,name-defined]
        """Percent from the top-level phases' steps; returning False cancels the build."""

        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self._lock = threading.Lock()
            self._top: dict[str, tuple[int, int]] = {}  # top-level phase -> (done, steps)

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            if parent_phase is None:
                with self._lock:
                    self._top[phase_name] = (0, max(1, num_steps))

        def step_complete(self, phase_name: str, step: int) -> bool:
            with self._lock:
                if phase_name in self._top:
                    _, steps = self._top[phase_name]
                    self._top[phase_name] = (min(step + 1, steps), steps)
                    done = sum(d for d, _ in self._top.values())
                    total = sum(s for _, s in self._top.values())
                    pct = 100.0 * done / total
                else:
                    pct = None
            if pct is not None and progress is not None:
                with contextlib.suppress(Exception):
                    progress(pct)
            return not (cancel is not None and cancel.is_set())

        def phase_finish(self, phase_name: str) -> None:
            pass

    return Monitor()


def _make_calibrator(trt: Any, cudart: Any, calib: Calibration, nbytes: int) -> Any:
    """Feeds ``calib``'s batches; the device buffer is ``nbytes``, exactly one calibration batch."""
    bad = [b.nbytes for b in calib.batches if b.nbytes != nbytes]
    if bad:
        raise TrtError(f"calibration batches of {bad[0]} bytes; TensorRT reads {nbytes} per batch")

    class Calibrator(trt.IInt8EntropyCalibrator2):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self._batches = list(calib.batches)
            self._next = 0
            self._nbytes = nbytes
            self._ptr = _cuda_check(cudart, cudart.cudaMalloc(self._nbytes))
            self._cache: bytes | None = None

        def get_batch_size(self) -> int:
            return calib.batch_size  # ignored by TensorRT 10 (explicit batch); kOPT decides

        def get_batch(self, names: list[str]) -> list[int] | None:
            if self._next >= len(self._batches):
                return None
            host = np.ascontiguousarray(self._batches[self._next])  # the model input's own dtype
            self._next += 1
            if host.nbytes != self._nbytes:
                return None  # unreachable (checked above); never let TensorRT read past the buffer
            _cuda_check(
                cudart,
                cudart.cudaMemcpy(
                    self._ptr, host.ctypes.data, host.nbytes, cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
                ),
            )
            return [int(self._ptr)]

        def read_calibration_cache(self) -> bytes | None:
            return self._cache

        def write_calibration_cache(self, cache: bytes) -> None:
            self._cache = bytes(cache)

        def __del__(self) -> None:
            with contextlib.suppress(Exception):
                cudart.cudaFree(self._ptr)

    return Calibrator()


HostMemory = Literal["pinned", "pageable"]


class _CudaEngine:
    """One execution context, one stream; device and host buffers sized to the profile max, allocated
    once at load and freed at :meth:`close` (G18).

    Host staging is page-locked (``cudaMallocHost``), as in NVIDIA's own samples
    (``samples/python/common_runtime.py``): ``cudaMemcpyAsync`` from or to pageable memory is staged
    through a driver buffer and returns only when the copy is done, so nothing overlaps; from pinned
    memory it is a DMA on the engine's stream. Each run copies the preprocessed batch into the pinned
    input (a host memcpy: preprocessing runs on another thread, overlapped with the previous run, so
    it cannot write into the one buffer the running batch is copied from), queues H2D, inference and
    D2H on the stream and synchronizes once. When pinned memory cannot be had (``cudaMallocHost``
    fails: locked-memory limits, an old cuda-python), the same buffers are pageable numpy arrays and
    ``pinned_problem`` says why (logged once). On a Jetson the GPU shares the RAM and mapped
    (zero-copy) memory would skip the copies altogether; not done here.
    """

    def __init__(self, trt: Any, cudart: Any, engine: Any, device: int, *, pinned: bool = True) -> None:
        self._trt, self._cudart, self._engine, self._device = trt, cudart, engine, device
        self._ctx = engine.create_execution_context()
        if self._ctx is None:
            raise TrtError("TensorRT could not create an execution context (GPU memory?)")
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        if len(inputs) != 1:
            raise TrtError(f"the agent runs single-input models; this engine has inputs {inputs}")
        self.input_name: str = inputs[0]
        self.output_names = [n for n in names if n not in inputs]
        dims = tuple(int(d) for d in engine.get_tensor_shape(self.input_name))
        self.input_shape: tuple[int | str | None, ...] = tuple(d if d >= 0 else None for d in dims)
        self.dynamic_batch: bool = dims[0] < 0
        self._dtypes = {n: np.dtype(trt.nptype(engine.get_tensor_dtype(n))) for n in names}
        # Every tensor's shape at the profile max (G10's check included): what the buffers must hold.
        self.max_shapes: dict[str, tuple[int, ...]] = self._max_shapes(dims)
        self._stream = _cuda_check(cudart, cudart.cudaStreamCreate())
        self._buffers: dict[str, tuple[Any, int]] = {}
        self._host: dict[str, np.ndarray] = {}  # flat uint8 staging per tensor, pinned or pageable
        self._pinned_ptrs: list[Any] = []  # what close() hands back to cudaFreeHost
        self.host_memory: HostMemory = "pageable"
        self.pinned_problem: str | None = None
        self._thread_device_set: set[int] = set()
        try:
            nbytes = {n: self._nbytes(n, s) for n, s in self.max_shapes.items()}
            for name, size in nbytes.items():
                self._buffer(name, size)  # device memory at the max: never reallocated in run()
            self._allocate_host(nbytes, pinned=pinned)
        except BaseException:
            self.close()
            raise

    def _nbytes(self, name: str, shape: tuple[int, ...]) -> int:
        return int(np.prod(shape, dtype=np.int64)) * self._dtypes[name].itemsize

    def _max_shapes(self, dims: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The input's shape at the profile max and every output's shape there.

        Refuses at load, not at the first frame, an engine whose outputs have data-dependent shapes
        (NonZero, NonMaxSuppression: -1 even once every input shape is set) (G10). This runner has
        no ``IOutputAllocator``; the model runs on onnxruntime (whose TensorRT EP has one)."""
        ctx = self._ctx
        biggest = dims
        if any(d < 0 for d in dims):
            shapes = self._engine.get_tensor_profile_shape(self.input_name, 0)  # [min, opt, max]
            biggest = tuple(int(d) for d in shapes[2])
            if not ctx.set_input_shape(self.input_name, biggest):
                raise TrtError(f"the engine refuses its own profile max {biggest} for {self.input_name}")
        out = {self.input_name: biggest}
        for name in self.output_names:
            shape = tuple(int(d) for d in ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise UnsupportedEngine(
                    f"output {name} has a data-dependent shape {shape} (e.g. NonZero or NMS in the graph); "
                    "the native TensorRT runner does not support it"
                )
            out[name] = shape
        return out

    def _allocate_host(self, nbytes: Mapping[str, int], *, pinned: bool) -> None:
        """Host staging buffers, one per tensor at its max size: pinned where CUDA gives it, else
        pageable numpy (all or none pinned, so one run never mixes the two)."""
        import ctypes

        if pinned:
            cudart = self._cudart
            try:
                views: dict[str, np.ndarray] = {}
                for name, size in nbytes.items():
                    size = max(size, 1)
                    ptr = _cuda_check(cudart, cudart.cudaMallocHost(size))
                    self._pinned_ptrs.append(ptr)
                    views[name] = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(int(ptr)))
            except Exception as exc:
                self._free_pinned()
                self.pinned_problem = f"cudaMallocHost failed ({type(exc).__name__}: {exc})"
                log.warning(
                    "TensorRT engine: %s; using pageable host buffers (copies will not overlap)",
                    self.pinned_problem,
                )
            else:
                self._host = views
                self.host_memory = "pinned"
                return
        else:
            self.pinned_problem = "pinned host memory not requested"
        self._host = {name: np.empty(max(size, 1), np.uint8) for name, size in nbytes.items()}
        self.host_memory = "pageable"

    def _host_view(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The first bytes of ``name``'s staging buffer as an array of ``shape`` (never past the max)."""
        flat = self._host[name]
        nbytes = self._nbytes(name, shape)
        if nbytes > flat.nbytes:
            raise TrtError(
                f"{name} of shape {shape} needs {nbytes} bytes; buffers hold the profile max "
                f"{self.max_shapes[name]} ({flat.nbytes} bytes)"
            )
        return flat[:nbytes].view(self._dtypes[name]).reshape(shape)

    def _buffer(self, name: str, nbytes: int) -> Any:
        have = self._buffers.get(name)
        if have is not None and have[1] >= nbytes:
            return have[0]
        if have is not None:
            _cuda_check(self._cudart, self._cudart.cudaFree(have[0]))
            del self._buffers[name]
        ptr = _cuda_check(self._cudart, self._cudart.cudaMalloc(max(nbytes, 1)))
        self._buffers[name] = (ptr, max(nbytes, 1))
        return ptr

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        cudart, ctx = self._cudart, self._ctx
        if ctx is None:
            raise TrtError("the engine is closed")
        tid = threading.get_ident()
        if tid not in self._thread_device_set:  # the inference thread may not be the build thread
            _cuda_check(cudart, cudart.cudaSetDevice(self._device))
            self._thread_device_set.add(tid)
        shape = tuple(int(d) for d in np.shape(batch))
        dynamic = self.dynamic_batch or any(d is None for d in self.input_shape)
        if dynamic and not ctx.set_input_shape(self.input_name, shape):
            raise TrtError(f"input shape {shape} is outside the engine's profile")
        if not dynamic and shape != self.max_shapes[self.input_name]:
            raise TrtError(f"input shape {shape} is not the engine's {self.max_shapes[self.input_name]}")
        host_in = self._host_view(self.input_name, shape)
        np.copyto(host_in, batch, casting="unsafe")  # the model's dtype, as np.ascontiguousarray(dtype=) did
        h2d, d2h = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        ptr = self._buffer(self.input_name, host_in.nbytes)
        _cuda_check(
            cudart, cudart.cudaMemcpyAsync(ptr, host_in.ctypes.data, host_in.nbytes, h2d, self._stream)
        )
        ctx.set_tensor_address(self.input_name, int(ptr))
        outs: dict[str, np.ndarray] = {}
        for name in self.output_names:
            out_shape = tuple(int(d) for d in ctx.get_tensor_shape(name))
            if any(d < 0 for d in out_shape):
                raise UnsupportedEngine(
                    f"output {name} has a data-dependent shape {out_shape}; not supported"
                )
            view = self._host_view(name, out_shape)
            ctx.set_tensor_address(name, int(self._buffer(name, view.nbytes)))
            outs[name] = view
        if not ctx.execute_async_v3(int(self._stream)):
            raise TrtError("TensorRT execution failed")
        for name, view in outs.items():
            src = self._buffers[name][0]
            _cuda_check(cudart, cudart.cudaMemcpyAsync(view.ctypes.data, src, view.nbytes, d2h, self._stream))
        _cuda_check(cudart, cudart.cudaStreamSynchronize(self._stream))
        # The staging buffers are reused by the next run: the caller gets its own (small) copies.
        return {name: view.copy() for name, view in outs.items()}

    def _free_pinned(self) -> None:
        ptrs, self._pinned_ptrs = self._pinned_ptrs, []
        for ptr in ptrs:
            with contextlib.suppress(Exception):
                self._cudart.cudaFreeHost(ptr)

    def close(self) -> None:
        cudart = self._cudart
        self._host = {}  # the views go before the memory under them
        self._free_pinned()
        for ptr, _ in self._buffers.values():
            with contextlib.suppress(Exception):
                cudart.cudaFree(ptr)
        self._buffers.clear()
        stream, self._stream = getattr(self, "_stream", None), None
        if stream is not None:
            with contextlib.suppress(Exception):
                cudart.cudaStreamDestroy(stream)
        self._ctx = None
        self._engine = None
