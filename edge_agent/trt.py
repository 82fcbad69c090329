"""TensorRT on the device: engine cache, the native TensorRT backend, and the runtime seam.

Engines are specific to the GPU, its compute capability and the TensorRT version, so they are built
on the device and cached under an :class:`EngineKey` of (model sha256, GPU name, compute capability,
TensorRT version, precision). A cached engine that does not deserialize is evicted, reported and
rebuilt.

Everything that touches TensorRT or CUDA sits behind :class:`TrtRuntime`: :class:`TensorRtRuntime`
is the real one (``tensorrt`` + ``cuda-python``, both from the ``gpu`` extra, imported lazily), tests
pass a fake. Nothing here imports ``tensorrt`` at module import time: on a CPU device the module
loads and :func:`load_tensorrt_runtime` says why TensorRT cannot be used.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

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


# --------------------------------------------------------------------------- cache keys


def _slug(text: str, max_len: int = 40) -> str:
    s = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9.]+", "-", text.strip())).strip("-.").lower()
    return (s or "none")[:max_len]


@dataclass(frozen=True)
class EngineKey:
    """What makes an engine reusable: the same model bytes, on the same GPU, TensorRT and precision."""

    model_sha256: str
    gpu_name: str
    compute_capability: str
    trt_version: str
    precision: Precision

    def digest(self) -> str:
        canonical = "\x1f".join(
            (self.model_sha256, self.gpu_name, self.compute_capability, self.trt_version, self.precision)
        )
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

    def __init__(self, directory: Path, *, max_bytes: int = 4 * 2**30) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be > 0")
        self.dir = directory
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self.evictions: list[Eviction] = []
        self.dir.mkdir(parents=True, exist_ok=True)
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
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
        with self._lock:
            try:
                with tmp.open("wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            self._enforce_bound(keep=path)
        return path

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

    def _enforce_bound(self, *, keep: Path) -> None:
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
) -> tuple[TrtEngine, EngineOutcome]:
    """The engine for ``key``: from the cache when it loads, else built, cached and loaded.

    ``calib`` may be a function: it is called only when a build is needed (gathering calibration
    frames from a camera takes seconds; a cache hit needs none).
    """
    options = options or BuildOptions()
    outcome = EngineOutcome(key=key, cache_hit=False)
    cached = cache.lookup(key)
    if cached is not None:
        try:
            engine = runtime.load_engine(cached)
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
    data = runtime.build_engine(onnx_path, key.precision, calibration, options)
    outcome.build_s = time.monotonic() - t0
    if not data:
        raise TrtError("the TensorRT builder returned no engine")
    cache.store(key, data)
    try:
        engine = runtime.load_engine(data)
    except Exception as exc:
        ev = cache.evict(key, f"freshly built engine does not load: {exc}")
        outcome.evicted.append(ev)
        raise TrtError(f"freshly built engine does not load: {exc}") from exc
    return engine, outcome


class TensorRtBackend:
    """An :class:`~edge_agent.backends.InferenceBackend` over a native TensorRT engine."""

    def __init__(self, engine: TrtEngine, *, precision: Precision, engine_file: str) -> None:
        self._engine = engine
        self.provider: str = NATIVE_PROVIDER
        self.precision = precision
        self.engine_file = engine_file
        self.input_name: str = engine.input_name
        self.input_shape: tuple[int | str | None, ...] = engine.input_shape
        self.dynamic_batch: bool = engine.dynamic_batch

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


class TensorRtRuntime:
    """``tensorrt`` + ``cuda-python`` on CUDA device ``device``."""

    def __init__(self, device: int = 0) -> None:
        import tensorrt as trt

        cudart = _import_cudart()
        self._trt = trt
        self._cudart = cudart
        self.device = device
        _cuda_check(cudart, cudart.cudaSetDevice(device))
        props = _cuda_check(cudart, cudart.cudaGetDeviceProperties(device))
        name = props.name
        self.gpu_name: str = (name.decode() if isinstance(name, bytes) else str(name)).rstrip("\x00")
        self.compute_capability: str = f"{props.major}.{props.minor}"
        self.version: str = str(trt.__version__)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)

    def build_engine(
        self, onnx_path: Path, precision: Precision, calib: Calibration | None, options: BuildOptions
    ) -> bytes:
        trt = self._trt
        _cuda_check(self._cudart, self._cudart.cudaSetDevice(self.device))  # the build thread's device
        builder = trt.Builder(self._logger)
        network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
        parser = trt.OnnxParser(network, self._logger)
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise TrtError(f"the ONNX parser refused {onnx_path.name}: {errors or 'no detail'}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_mb * 2**20)
        profile = self._profile(builder, network, options)
        if profile is not None:
            config.add_optimization_profile(profile)
        calibrator = None
        if precision in ("fp16", "int8") and builder.platform_has_fast_fp16:
            config.set_flag(trt.BuilderFlag.FP16)
        if precision == "int8":
            if not builder.platform_has_fast_int8:
                raise TrtError("this GPU has no fast INT8")
            config.set_flag(trt.BuilderFlag.INT8)
            if calib is not None and calib.batches:
                calibrator = _make_calibrator(trt, self._cudart, calib)
                config.int8_calibrator = calibrator
                if profile is not None:
                    config.set_calibration_profile(profile)
            # Without calibration frames only a Q/DQ (explicitly quantized) model builds in INT8.
        monitor = None
        if options.progress is not None or options.cancel is not None:
            monitor = _make_progress_monitor(trt, options.progress, options.cancel)
            config.progress_monitor = monitor
        serialized = builder.build_serialized_network(network, config)
        if options.cancel is not None and options.cancel.is_set():
            raise BuildCancelled("engine build cancelled")
        if serialized is None:
            raise TrtError("the TensorRT builder failed (see the agent log for TensorRT's messages)")
        del calibrator, monitor  # they must outlive the build, no longer
        return bytes(memoryview(serialized))

    def _profile(self, builder: Any, network: Any, options: BuildOptions) -> Any:
        dynamic = False
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            tensor = network.get_input(i)
            shape = list(tensor.shape)
            if all(d > 0 for d in shape):
                continue
            dynamic = True
            rest = shape[1:]
            if any(d <= 0 for d in rest):
                if options.sample_shape is None or len(options.sample_shape) != len(rest):
                    raise TrtError(f"input {tensor.name} has dynamic dims {shape} and no sample shape")
                rest = [d if d > 0 else s for d, s in zip(rest, options.sample_shape, strict=True)]
            if shape[0] > 0:
                lo = opt = hi = shape[0]
            else:
                lo, opt, hi = 1, options.max_batch, options.max_batch
            profile.set_shape(tensor.name, [lo, *rest], [opt, *rest], [hi, *rest])
        return profile if dynamic else None

    def load_engine(self, data: bytes) -> TrtEngine:
        _cuda_check(self._cudart, self._cudart.cudaSetDevice(self.device))
        engine = self._runtime.deserialize_cuda_engine(data)
        if engine is None:
            raise TrtError("TensorRT could not deserialize the engine (corrupt, or another GPU/version)")
        return _CudaEngine(self._trt, self._cudart, engine, self.device)


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


def _make_calibrator(trt: Any, cudart: Any, calib: Calibration) -> Any:
    class Calibrator(trt.IInt8EntropyCalibrator2):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self._batches = list(calib.batches)
            self._next = 0
            self._nbytes = max(b.nbytes for b in self._batches)
            self._ptr = _cuda_check(cudart, cudart.cudaMalloc(self._nbytes))
            self._cache: bytes | None = None

        def get_batch_size(self) -> int:
            return calib.batch_size

        def get_batch(self, names: list[str]) -> list[int] | None:
            if self._next >= len(self._batches):
                return None
            host = np.ascontiguousarray(self._batches[self._next])  # the model input's own dtype
            self._next += 1
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


class _CudaEngine:
    """One execution context, one stream, device buffers grown on demand."""

    def __init__(self, trt: Any, cudart: Any, engine: Any, device: int) -> None:
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
        self._stream = _cuda_check(cudart, cudart.cudaStreamCreate())
        self._buffers: dict[str, tuple[Any, int]] = {}
        self._thread_device_set: set[int] = set()

    def _buffer(self, name: str, nbytes: int) -> Any:
        have = self._buffers.get(name)
        if have is not None and have[1] >= nbytes:
            return have[0]
        if have is not None:
            _cuda_check(self._cudart, self._cudart.cudaFree(have[0]))
        ptr = _cuda_check(self._cudart, self._cudart.cudaMalloc(max(nbytes, 1)))
        self._buffers[name] = (ptr, max(nbytes, 1))
        return ptr

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        cudart, ctx = self._cudart, self._ctx
        tid = threading.get_ident()
        if tid not in self._thread_device_set:  # the inference thread may not be the build thread
            _cuda_check(cudart, cudart.cudaSetDevice(self._device))
            self._thread_device_set.add(tid)
        x = np.ascontiguousarray(batch, dtype=self._dtypes[self.input_name])
        dynamic = self.dynamic_batch or any(d is None for d in self.input_shape)
        if dynamic and not ctx.set_input_shape(self.input_name, tuple(x.shape)):
            raise TrtError(f"input shape {x.shape} is outside the engine's profile")
        h2d, d2h = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        ptr = self._buffer(self.input_name, x.nbytes)
        _cuda_check(cudart, cudart.cudaMemcpyAsync(ptr, x.ctypes.data, x.nbytes, h2d, self._stream))
        ctx.set_tensor_address(self.input_name, int(ptr))
        outs: dict[str, np.ndarray] = {}
        for name in self.output_names:
            shape = tuple(int(d) for d in ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise TrtError(f"output {name} has a data-dependent shape {shape}; not supported")
            arr = np.empty(shape, dtype=self._dtypes[name])
            ctx.set_tensor_address(name, int(self._buffer(name, arr.nbytes)))
            outs[name] = arr
        if not ctx.execute_async_v3(int(self._stream)):
            raise TrtError("TensorRT execution failed")
        for name, arr in outs.items():
            src = self._buffers[name][0]
            _cuda_check(cudart, cudart.cudaMemcpyAsync(arr.ctypes.data, src, arr.nbytes, d2h, self._stream))
        _cuda_check(cudart, cudart.cudaStreamSynchronize(self._stream))
        return outs

    def close(self) -> None:
        cudart = self._cudart
        for ptr, _ in self._buffers.values():
            with contextlib.suppress(Exception):
                cudart.cudaFree(ptr)
        self._buffers.clear()
        with contextlib.suppress(Exception):
            cudart.cudaStreamDestroy(self._stream)
        self._ctx = None
        self._engine = None
