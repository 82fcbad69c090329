"""TensorRT itself: the :class:`TrtRuntime` seam and the real runtime on ``tensorrt`` + ``cuda-python``.

Everything that touches TensorRT or CUDA sits behind :class:`TrtRuntime` (and the :class:`TrtEngine`
it loads): :class:`TensorRtRuntime` is the real one (``tensorrt`` and ``cuda-python``, both from the
``gpu`` extra, imported lazily), tests pass a fake. Nothing here imports ``tensorrt`` at module import
time: on a CPU device the module loads and :func:`load_tensorrt_runtime` says why TensorRT cannot be
used. It is where the agent calls the TensorRT API, written for TensorRT
:data:`TRT_MAJOR_SUPPORTED`.x.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from edge_agent.core.files import atomic_write
from edge_agent.inference.tensorrt.build_config import (
    BuildOptions,
    Calibration,
    Precision,
    ProgressFn,
    builder_flags,
    int8_qdq_problem,
    optimization_profile,
)
from edge_agent.inference.tensorrt.errors import BuildCancelled, TrtError, UnsupportedEngine

log = logging.getLogger(__name__)


TRT_MAJOR_SUPPORTED = 10


class TrtEngine(Protocol):
    """A deserialized engine ready to run."""

    input_name: str
    input_shape: tuple[int | str | None, ...]
    dynamic_batch: bool

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


class TrtRuntime(Protocol):
    """Everything the agent needs from TensorRT; the real one is :class:`TensorRtRuntime`."""

    version: str
    gpu_name: str
    compute_capability: str

    def build_engine(
        self, onnx_path: Path, precision: Precision, calib: Calibration | None, options: BuildOptions
    ) -> bytes: ...

    def load_engine(self, data: bytes) -> TrtEngine: ...


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
        for flag in builder_flags(precision):  # exactly the precision asked for: fp32 sets no FP16
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
        """INT8 entropy calibration whose device buffer is exactly the shape TensorRT reads.

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
    """Reuse the tactic timings of earlier builds on this GPU: a rebuild after a model update
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
    once at load and freed at :meth:`close`.

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
        # Every tensor's shape at the profile max (data-dependent outputs refused): what the buffers must hold.
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
        (NonZero, NonMaxSuppression: -1 even once every input shape is set). This runner has
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
