"""Inference behind a tiny interface: ONNX Runtime with the best execution provider available, or a
native TensorRT engine built on the device (see :mod:`edge_agent.inference.trt`), chosen by
:class:`AutoBackendFactory`.

What the pipeline and the agent must handle (GPU audit G14/G15/G22):

- :class:`CudaFatalError` (not a :class:`BackendError`): a sticky CUDA error (illegal address, launch
  failure, ...). The CUDA context of this process is dead; every later load or run fails the same way.
  Raised by ``run()``, by :meth:`AutoBackendFactory.make` and by ``OnnxRuntimeBackend(...)``. Never
  retry or reload on it: publish a final event and exit with :data:`EXIT_CUDA_FATAL` so the service
  manager restarts the process.
- :class:`ProviderFallback` (a :class:`BackendError`): raised by ``OnnxRuntimeBackend.run()`` when the
  execution provider failed at run time and the session now runs on a lesser one. The batch is lost,
  the backend stays usable (``backend.provider`` already names the new provider): report it as an event.
- :class:`ProviderProbe`: which of the providers onnxruntime lists can really be used here, and why the
  others cannot (missing libraries, no GPU, both onnxruntime packages installed).
"""

from __future__ import annotations

import ctypes
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from edge_agent.core.files import atomic_write
from edge_agent.inference.engine_build import (
    DEFAULT_BUILD_TIMEOUT_S,
    BuildBusy,
    BuildFailed,
    BuildProgress,
    BuildRequest,
    BuildResult,
    BuildSupervisor,
    BuildTimedOut,
    ort_engines_ready,
)
from edge_agent.inference.trt import (
    ENGINE_SUFFIX,
    BuildCancelled,
    BuildOptions,
    Calibration,
    EngineCache,
    EngineKey,
    Precision,
    ProfileNotExpressible,
    TensorRtBackend,
    TrtError,
    TrtRuntime,
    calibration_from_frames,
    int8_qdq_problem,
    load_tensorrt_runtime,
    obtain_engine,
    onnx_input_shapes,
    ort_trt_profile_options_for,
    resolve_precision,
)
from fleet_protocol.messages import ModelManifest

log = logging.getLogger(__name__)

DEFAULT_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
TRT_EP = "TensorrtExecutionProvider"
CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"
GPU_PROVIDERS = (TRT_EP, CUDA_EP)

EXIT_CUDA_FATAL = 4
"""The agent's exit status after a :class:`CudaFatalError` (0 ok, 2 bad config, 3 fatal link)."""


class InferenceBackend(Protocol):
    provider: str
    input_name: str
    input_shape: tuple[int | str | None, ...]
    dynamic_batch: bool

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


BackendFactory = Callable[[Path, ModelManifest], InferenceBackend]


class BackendError(Exception):
    """A model file could not be loaded into a backend."""


class ProviderFallback(BackendError):
    """The execution provider failed during ``run()``; the session now runs on ``provider``.

    The batch that failed is lost; the backend stays usable. ``previous`` is the provider it ran on,
    ``reason`` the provider's error.
    """

    def __init__(self, previous: str, provider: str, reason: str) -> None:
        super().__init__(f"{previous} failed at run time, now running on {provider}: {reason}")
        self.previous = previous
        self.provider = provider
        self.reason = reason


class CudaFatalError(RuntimeError):
    """A sticky CUDA error: the CUDA context of this process is unusable until the process restarts.

    CUDA Runtime API on cudaErrorIllegalAddress (700), LaunchTimeout (702), Assert (710),
    HardwareStackError (714), IllegalInstruction (715), MisalignedAddress (716), InvalidAddressSpace
    (717), InvalidPc (718), LaunchFailure (719): "This leaves the process in an inconsistent state and
    any further CUDA work will return the same error. To continue using CUDA, the process must be
    terminated and relaunched." Deliberately not a :class:`BackendError`, so that code that reloads on
    a BackendError does not catch it by accident.
    """

    exit_code = EXIT_CUDA_FATAL


# cudaError_t codes whose documentation says the process must be terminated and relaunched.
STICKY_CUDA_ERRORS = {
    700: (
        "cudaErrorIllegalAddress",
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "an illegal memory access was encountered",
    ),
    702: ("cudaErrorLaunchTimeout", "CUDA_ERROR_LAUNCH_TIMEOUT", "the launch timed out and was terminated"),
    710: ("cudaErrorAssert", "CUDA_ERROR_ASSERT", "device-side assert triggered"),
    714: ("cudaErrorHardwareStackError", "CUDA_ERROR_HARDWARE_STACK_ERROR", "hardware stack error"),
    715: (
        "cudaErrorIllegalInstruction",
        "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        "an illegal instruction was encountered",
    ),
    716: ("cudaErrorMisalignedAddress", "CUDA_ERROR_MISALIGNED_ADDRESS", "misaligned address"),
    717: (
        "cudaErrorInvalidAddressSpace",
        "CUDA_ERROR_INVALID_ADDRESS_SPACE",
        "operation not supported on global/shared address space",
    ),
    718: ("cudaErrorInvalidPc", "CUDA_ERROR_INVALID_PC", "invalid program counter"),
    719: ("cudaErrorLaunchFailure", "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"),
}
# onnxruntime's CUDA_CALL formats "CUDA failure <code>: <cudaGetErrorString> ; GPU=… ; expr=…"
# (core/providers/cuda/cuda_call.cc); cuBLAS/cuDNN failures say "CUBLAS failure"/"CUDNN failure".
_ORT_CUDA_FAILURE = re.compile(r"\bCUDA failure (\d+)\b")
_STICKY_TEXT = tuple(t.lower() for names in STICKY_CUDA_ERRORS.values() for t in names)


def _texts(exc: BaseException | str) -> list[str]:
    if isinstance(exc, str):
        return [exc]
    out: list[str] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:  # the error and its causes (TrtError from CUDA, ...)
        seen.add(id(cur))
        out.append(f"{type(cur).__name__}: {cur}")
        cur = cur.__cause__ or cur.__context__
    return out


def is_sticky_cuda_error(exc: BaseException | str) -> bool:
    """True when the error (or one of its causes) is a sticky CUDA error, in any of the spellings that
    reach Python: onnxruntime's "CUDA failure 700: …", cuda-python's ``cudaError_t.cudaErrorIllegalAddress``
    / ``CUresult.CUDA_ERROR_ILLEGAL_ADDRESS``, or TensorRT's "Cuda Runtime (an illegal memory access …)"."""
    for text in _texts(exc):
        for m in _ORT_CUDA_FAILURE.finditer(text):
            if int(m.group(1)) in STICKY_CUDA_ERRORS:
                return True
        low = text.lower()
        if any(t in low for t in _STICKY_TEXT):
            return True
    return False


def cuda_fatal_from(exc: BaseException, where: str) -> CudaFatalError | None:
    """A :class:`CudaFatalError` for ``exc`` when it is a sticky CUDA error, else None."""
    if isinstance(exc, CudaFatalError):
        return exc
    if not is_sticky_cuda_error(exc):
        return None
    return CudaFatalError(
        f"{where}: sticky CUDA error, the process must restart: {type(exc).__name__}: {exc}"
    )


def choose_providers(preference: Sequence[str], available: Sequence[str]) -> list[str]:
    """The preferred providers this build of onnxruntime has, in preference order, CPU always last."""
    chosen = [p for p in preference if p in available and p != "CPUExecutionProvider"]
    chosen.append("CPUExecutionProvider")
    return chosen


GRAPH_OPTIMIZATION_LEVEL = "ORT_ENABLE_ALL"
"""The agent's sessions' graph optimisation level; an out-of-process TensorRT EP build uses the same,
since onnxruntime's engines are made for the graph as optimised."""


def session_options(threads: int, *, spin: bool = False) -> Any:
    """The agent's onnxruntime session options (the pipeline benchmark's raw run uses the same)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    # Measured: without graph optimisation FP32 runs 1.4-2.2x slower on CPU.
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, GRAPH_OPTIMIZATION_LEVEL)
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    # Spinning intra-op threads win a few percent alone, but steal the cores that capture,
    # preprocessing and publishing need on a small device.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return opts


def trt_ep_options(
    cache_dir: Path,
    *,
    fp16: bool = False,
    int8: bool = False,
    workspace_bytes: int | None = None,
    device_id: int | None = None,
) -> dict[str, str]:
    """onnxruntime TensorRT EP options: engine and timing caches on the device, precision flags, the
    builder workspace and the CUDA device (names as in onnxruntime's
    ``tensorrt_execution_provider_info.cc``; booleans parse from "True"/"False").

    ``int8`` is for explicitly quantized (Q/DQ) models; no calibration table is used.
    ``workspace_bytes``: TensorRT's builder workspace limit (``trt_max_workspace_size``), the same as
    the native path's ``workspace_mb``; unset, onnxruntime's own default applies, which matters on a
    Jetson whose GPU shares the system RAM.
    """
    opts = {
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(cache_dir),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(cache_dir),
        "trt_fp16_enable": "True" if fp16 else "False",
        "trt_int8_enable": "True" if int8 else "False",
    }
    if workspace_bytes is not None:
        opts["trt_max_workspace_size"] = str(int(workspace_bytes))
    if device_id is not None:
        opts["device_id"] = str(device_id)
    return opts


def cuda_ep_options(
    *,
    device_id: int = 0,
    cudnn_conv_algo_search: Literal["HEURISTIC", "EXHAUSTIVE", "DEFAULT"] = "HEURISTIC",
    arena_extend_strategy: Literal["kSameAsRequested", "kNextPowerOfTwo"] = "kSameAsRequested",
    gpu_mem_limit_bytes: int | None = None,
) -> dict[str, str]:
    """onnxruntime CUDA EP options (names and values as in ``cuda_execution_provider_info.cc``).

    onnxruntime's defaults are ``EXHAUSTIVE`` (every conv algorithm is benchmarked on the first run at
    each new input shape, on the inference thread, under the watchdog) and ``kNextPowerOfTwo`` (the
    arena doubles; on a Jetson it grows in the shared system RAM). ``HEURISTIC`` and ``kSameAsRequested``
    avoid both; ``gpu_mem_limit`` caps the arena when given.
    """
    opts = {
        "device_id": str(device_id),
        "cudnn_conv_algo_search": cudnn_conv_algo_search,
        "arena_extend_strategy": arena_extend_strategy,
    }
    if gpu_mem_limit_bytes is not None:
        opts["gpu_mem_limit"] = str(int(gpu_mem_limit_bytes))
    return opts


ProviderSpec = str | tuple[str, dict[str, str]]


def provider_list(
    names: Sequence[str],
    *,
    trt_cache_dir: Path | None,
    fp16: bool = False,
    int8: bool = False,
    trt_workspace_bytes: int | None = None,
    device_id: int | None = None,
    cuda_options: Mapping[str, str] | None = None,
    trt_extra_options: Mapping[str, str] | None = None,
) -> list[ProviderSpec]:
    """What ``InferenceSession(providers=...)`` gets: names, the TensorRT and CUDA EPs with options.

    ``trt_extra_options`` are merged into the TensorRT EP's (the optimization profile's
    ``trt_profile_*_shapes``, G4)."""
    providers: list[ProviderSpec] = []
    for name in names:
        if name == TRT_EP and trt_cache_dir is not None:
            opts = trt_ep_options(
                trt_cache_dir, fp16=fp16, int8=int8, workspace_bytes=trt_workspace_bytes, device_id=device_id
            )
            opts.update(trt_extra_options or {})
            providers.append((name, opts))
        elif name == CUDA_EP:
            cuda = (
                dict(cuda_options) if cuda_options is not None else cuda_ep_options(device_id=device_id or 0)
            )
            providers.append((name, cuda))
        else:
            providers.append(name)
    return providers


def ort_trt_precision(variant: str, setting: str = "auto") -> tuple[bool, bool]:
    """``(trt_fp16_enable, trt_int8_enable)`` for the onnxruntime TensorRT EP.

    INT8 only for the int8 (Q/DQ) variant: this path has no calibration table, so INT8 on an
    unquantized model would have no scales. FP16 follows ``inference.trt_precision`` when it says fp16
    or fp32, else the variant (the controller sends fp32 where it judged fp16 unfit).
    """
    int8 = variant == "int8"
    if setting == "fp32":
        return False, int8
    if setting == "fp16":
        return True, int8
    return variant == "fp16", int8


# --------------------------------------------------------------------------- usable providers (G22)


@dataclass(frozen=True)
class ProviderProbe:
    """The providers onnxruntime lists (``available``: compiled in) and those that really work here
    (``usable``: a session could be created with them), with the reason for each one that does not.

    ``problems`` may also carry an ``"onnxruntime"`` entry for an installation problem (both the CPU
    and the GPU package installed).
    """

    available: tuple[str, ...]
    usable: tuple[str, ...]
    problems: dict[str, str] = field(default_factory=dict)

    def why_not(self, preference: Sequence[str]) -> str | None:
        """Why the preferred providers before the first usable one are not used; None if none skipped."""
        reasons = []
        for p in preference:
            if p in self.usable:
                break
            if p in self.problems:
                reasons.append(f"{p} not usable: {self.problems[p]}")
        return "; ".join(reasons) or None


def _probe_model() -> bytes:
    """A one-node ONNX model (y = x + 1) to open a session with."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    graph = helper.make_graph([helper.make_node("Add", ["x", "one"], ["y"])], "probe", [x], [y], [one])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return bytes(onnx.ModelProto.SerializeToString(model))


_PROVIDER_LIBRARY = {TRT_EP: "tensorrt", CUDA_EP: "cuda"}


def provider_library_error(provider: str) -> str | None:
    """The dynamic loader's message for the provider's shared library (e.g. "libnvinfer.so.10: cannot
    open shared object file"), loaded the way onnxruntime does (providers_shared first, global); None
    when it loads. Only called after onnxruntime already failed to use the provider, so this loads
    nothing that onnxruntime had loaded successfully."""
    import onnxruntime as ort

    suffix = _PROVIDER_LIBRARY.get(provider)
    if suffix is None:
        return None
    capi = Path(ort.__file__).parent / "capi"
    lib = capi / f"libonnxruntime_providers_{suffix}.so"
    if not lib.exists():
        return f"{lib.name} is not part of this onnxruntime installation"
    try:
        ctypes.CDLL(str(capi / "libonnxruntime_providers_shared.so"), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(lib))
    except OSError as exc:
        return str(exc)
    return None


def installed_onnxruntime_packages() -> set[str]:
    """Which onnxruntime distributions are installed (``onnxruntime``, ``onnxruntime-gpu``)."""
    from importlib import metadata

    found = set()
    for name in ("onnxruntime", "onnxruntime-gpu"):
        try:
            metadata.distribution(name)
            found.add(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def _default_probe_session(model: bytes, **kw: Any) -> Any:
    import onnxruntime as ort

    # enable_fallback=0: a provider that fails to initialise raises with its own message instead of
    # onnxruntime quietly retrying on the CPU.
    return ort.InferenceSession(model, enable_fallback=0, **kw)


def probe_providers(
    available: Sequence[str] | None = None,
    *,
    session_factory: SessionFactory | None = None,
    library_error: Callable[[str], str | None] | None = None,
    installed: Callable[[], set[str]] | None = None,
    preload: Callable[[], None] | None = None,
) -> ProviderProbe:
    """Open a one-node session with each GPU provider onnxruntime lists and keep those it really got.

    ``ort.get_available_providers()`` lists the providers compiled into the wheel, not those whose
    CUDA/cuDNN/TensorRT libraries load, and onnxruntime only logs the loader error. Every argument is
    a seam for tests; by default the real onnxruntime is asked.
    """
    if preload is not None:
        preload()
    if available is None:
        import onnxruntime as ort

        available = list(ort.get_available_providers())
    make = session_factory or _default_probe_session
    why_lib = library_error or provider_library_error
    problems: dict[str, str] = {}
    usable: list[str] = []
    model: bytes | None = None
    for p in available:
        if p not in GPU_PROVIDERS:
            usable.append(p)
            continue
        try:
            if model is None:
                model = _probe_model()
            opts = session_options(1)
            # The TensorRT EP gets no node of the one-node graph (min subgraph size 1000): its libraries
            # load and it registers, without an engine build holding the GIL for seconds.
            spec: ProviderSpec = (p, {"trt_min_subgraph_size": "1000"}) if p == TRT_EP else p
            sess = make(model, sess_options=opts, providers=[spec, CPU_EP])
            got = list(sess.get_providers())
        except Exception as exc:
            problems[p] = f"{type(exc).__name__}: {exc}"
            continue
        if p in got:
            usable.append(p)
        else:
            lib = why_lib(p)
            problems[p] = lib or "onnxruntime dropped it when creating a session (no GPU or driver?)"
    packages = (installed or installed_onnxruntime_packages)()
    if {"onnxruntime", "onnxruntime-gpu"} <= packages:
        problems["onnxruntime"] = (
            "both onnxruntime and onnxruntime-gpu are installed; only one may be (onnxruntime docs): "
            "the CPU package can shadow the GPU one"
        )
    for p, why in problems.items():
        log.warning("execution provider %s: %s", p, why)
    return ProviderProbe(available=tuple(available), usable=tuple(usable), problems=problems)


def _preload_tensorrt() -> None:
    # The pip tensorrt wheel keeps libnvinfer in site-packages/tensorrt_libs, off the loader path;
    # importing tensorrt loads it, so that the TensorRT EP's dlopen finds it afterwards.
    try:
        import tensorrt  # noqa: F401
    except Exception as exc:  # absent or broken: the probe says what that means for the EP
        log.debug("tensorrt not preloaded: %s", exc)


_probe_lock = threading.Lock()
_probe_result: ProviderProbe | None = None


def cached_provider_probe() -> ProviderProbe:
    """:func:`probe_providers` once per process (libraries do not become loadable while it runs)."""
    global _probe_result
    with _probe_lock:
        if _probe_result is None:
            try:
                import onnxruntime as ort

                available = list(ort.get_available_providers())
            except Exception as exc:  # no onnxruntime at all
                _probe_result = ProviderProbe((), (), {"onnxruntime": f"{type(exc).__name__}: {exc}"})
                return _probe_result
            gpu = any(p in GPU_PROVIDERS for p in available)
            _probe_result = probe_providers(available, preload=_preload_tensorrt if gpu else None)
        return _probe_result


SessionFactory = Callable[..., Any]
"""``(path: str, *, sess_options, providers) -> session``; onnxruntime.InferenceSession by default."""

OrtValueFactory = Callable[[tuple[int, ...], Any, str, int], Any]
"""``(shape, numpy dtype, device_type, device_id) -> OrtValue``;
``onnxruntime.OrtValue.ortvalue_from_shape_and_type`` by default (the seam for tests)."""

_BOUND_INPUT_SHAPES = 8
"""Device input buffers kept per backend (one per batch shape seen: 1..max_batch in practice)."""


def _provider_name(spec: ProviderSpec) -> str:
    return spec[0] if isinstance(spec, tuple) else spec


class OnnxRuntimeBackend:
    """An onnxruntime session; ``provider`` is the one the session really got, not the one asked.

    ``requested`` is the provider order asked for (what this build of onnxruntime offers, in the
    configured preference); ``fallback_reason`` says why the session got less than the first of them.

    onnxruntime's Python ``run()`` silently re-creates the session on CUDA/CPU when an execution
    provider fails (``EPFail``), printing to stdout. That is switched off here (``disable_fallback``);
    a run-time provider failure instead raises :class:`ProviderFallback` after the session has been
    moved to the next provider, so the change is reported and ``provider`` stays true. A sticky CUDA
    error raises :class:`CudaFatalError`.

    On the CUDA and TensorRT providers a run goes through onnxruntime's IOBinding (G18): the batch is
    copied into an input buffer on the device that is kept per input shape and bound to one binding
    reused across runs, outputs are bound to the device and copied to the host once, together, after
    the run. ``session.run`` with numpy instead allocates the device input afresh on every run. On the
    CPU provider ``session.run`` stays: there is no device to copy to, IOBinding buys nothing.
    ``use_io_binding`` forces the choice (True: IOBinding on any provider, e.g. to check the binding
    code against the CPU provider; False: never); ``io_binding`` says what the last run used.
    """

    def __init__(
        self,
        path: Path,
        *,
        threads: int = 2,
        providers_preference: Sequence[str] = DEFAULT_PROVIDERS,
        trt_cache_dir: Path | None = None,
        spin: bool = False,
        fp16: bool = False,
        int8: bool = False,
        available: Sequence[str] | None = None,
        session_factory: SessionFactory | None = None,
        device_id: int = 0,
        trt_workspace_bytes: int | None = None,
        cuda_options: Mapping[str, str] | None = None,
        provider_problems: Mapping[str, str] | None = None,
        providers: Sequence[ProviderSpec] | None = None,
        use_io_binding: bool | None = None,
        ort_value_factory: OrtValueFactory | None = None,
    ) -> None:
        import onnxruntime as ort

        opts = session_options(threads, spin=spin)
        asked: list[ProviderSpec]
        if providers is not None:
            # Exactly these (with their options): what an out-of-process TensorRT EP build used.
            asked = list(providers)
            names = [_provider_name(p) for p in asked]
        else:
            if available is None:
                available = ort.get_available_providers()
            names = choose_providers(providers_preference, available)
            asked = provider_list(
                names,
                trt_cache_dir=trt_cache_dir,
                fp16=fp16,
                int8=int8,
                trt_workspace_bytes=trt_workspace_bytes,
                device_id=device_id,
                cuda_options=cuda_options,
            )
        if TRT_EP in names and trt_cache_dir is not None:
            # Engines are GPU-specific and slow to build: cache them on the device.
            trt_cache_dir.mkdir(parents=True, exist_ok=True)
        self._providers_asked = asked
        self._problems = dict(provider_problems or {})
        make = session_factory or ort.InferenceSession
        try:
            self._session = make(str(path), sess_options=opts, providers=asked)
        except Exception as exc:
            fatal = cuda_fatal_from(exc, f"onnxruntime loading {path.name}")
            if fatal is not None:
                raise fatal from exc
            raise BackendError(f"onnxruntime cannot load {path.name}: {exc}") from exc
        disable = getattr(self._session, "disable_fallback", None)
        if callable(disable):
            disable()  # no silent re-creation of the session inside run() (G14)
        self.requested: list[str] = names
        got = self._session_providers()
        self.provider: str = got[0] if got else CPU_EP
        self.fallback_reason: str | None = None
        if self.provider != names[0]:
            # onnxruntime drops a provider it cannot initialise (no driver, wrong CUDA/TensorRT) with
            # only a log line: say so, and report what was really obtained.
            self.fallback_reason = f"asked for {names[0]}, onnxruntime gave {self.provider}"
            if names[0] in self._problems:
                self.fallback_reason += f" ({self._problems[names[0]]})"
            log.warning("%s (asked %s)", self.fallback_reason, ", ".join(names))
        inp = self._session.get_inputs()[0]
        self.input_name: str = inp.name
        self.input_shape: tuple[int | str | None, ...] = tuple(inp.shape)
        first = self.input_shape[0] if self.input_shape else 1
        self.dynamic_batch: bool = not isinstance(first, int) or first <= 0
        self.output_names: list[str] = [o.name for o in self._session.get_outputs()]
        self._use_io_binding = use_io_binding
        self._device_id = device_id
        self._ort_value: OrtValueFactory = ort_value_factory or ort.OrtValue.ortvalue_from_shape_and_type
        self._binding: Any = None
        self._bound_inputs: dict[tuple[tuple[int, ...], str], Any] = {}  # (shape, dtype) -> OrtValue
        self._cpu_input_reason: str | None = None  # why the input is bound from host memory instead
        self.io_binding: bool = False
        """Whether the last run went through IOBinding."""
        log.info(
            "loaded %s on %s (asked %s; input %s %s, dynamic batch: %s)",
            path.name,
            self.provider,
            ", ".join(names),
            self.input_name,
            self.input_shape,
            self.dynamic_batch,
        )

    def _session_providers(self) -> list[str]:
        try:
            return list(self._session.get_providers())
        except Exception:
            return []

    @property
    def concurrent_runs(self) -> bool:
        """Whether several threads may call :meth:`run` at once: onnxruntime's session.run is
        thread-safe, but the kept IOBinding and device buffers of the GPU path are not."""
        return self.provider == "CPUExecutionProvider" and not self._binding_wanted()

    def _binding_wanted(self) -> bool:
        # CPU provider: session.run already hands onnxruntime the numpy memory; IOBinding buys nothing.
        wanted = self.provider in GPU_PROVIDERS if self._use_io_binding is None else self._use_io_binding
        session = self._session
        return (
            wanted
            and callable(getattr(session, "io_binding", None))
            and callable(getattr(session, "run_with_iobinding", None))
        )

    def _device_type(self) -> str:
        return "cuda" if self.provider in GPU_PROVIDERS else "cpu"

    def _drop_binding(self) -> None:
        """Forget the binding and its device buffers (the session was re-created, or a run failed)."""
        self._binding = None
        self._bound_inputs.clear()

    def _device_input(self, x: np.ndarray, device: str, device_id: int) -> Any:
        """The kept device buffer (OrtValue) for ``x``'s shape and dtype, None when none can be made."""
        if self._cpu_input_reason is not None:
            return None
        key = (tuple(int(d) for d in x.shape), x.dtype.str)
        value = self._bound_inputs.get(key)
        if value is None:
            try:
                value = self._ort_value(key[0], x.dtype, device, device_id)
            except Exception as exc:
                self._cpu_input_reason = f"no {device} input buffer ({type(exc).__name__}: {exc})"
                log.warning("IOBinding: %s; binding the input from host memory", self._cpu_input_reason)
                return None
            if len(self._bound_inputs) >= _BOUND_INPUT_SHAPES:
                self._bound_inputs.clear()
            self._bound_inputs[key] = value
        return value

    def _run_bound(self, batch: np.ndarray) -> list[Any]:
        """One run through IOBinding: the input in a device buffer kept for its shape, outputs on the
        device, copied to the host once after the run."""
        device, device_id = self._device_type(), self._device_id
        if self._binding is None:
            self._binding = self._session.io_binding()
        binding = self._binding
        x = np.ascontiguousarray(batch)
        value = self._device_input(x, device, device_id)
        if value is not None:
            value.update_inplace(x)  # the one host-to-device copy of the batch, into the kept buffer
            # Bound again every run: where the input's consumer sits on another device, onnxruntime
            # copies at bind time, so only a fresh bind is sure to see the new data.
            binding.bind_ortvalue_input(self.input_name, value)
        else:
            binding.bind_cpu_input(self.input_name, x)  # onnxruntime copies it to the device in the run
        # Outputs bound again every run (by device, unallocated): a binding still holding the last
        # run's outputs fails at another batch size ("The output OrtValue provided for output ... has
        # shape {1,100} but the computed output shape for this run is {2,100}") or with data-dependent
        # output shapes (NMS in the graph). onnxruntime allocates them from its arena.
        for name in self.output_names:
            binding.bind_output(name, device, device_id)
        self._session.run_with_iobinding(binding)
        return list(binding.copy_outputs_to_cpu())

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        bound = self._binding_wanted()
        try:
            outs = self._run_bound(batch) if bound else self._session.run(None, {self.input_name: batch})
        except Exception as exc:
            self._drop_binding()
            self._after_run_failure(exc)
            raise
        self.io_binding = bound
        got = self._session_providers()
        if got and got[0] != self.provider:  # a session whose own fallback is still on switched
            self._note_switch(got[0], "onnxruntime switched providers inside run()")
        return {name: np.asarray(v) for name, v in zip(self.output_names, outs, strict=True)}

    def _note_switch(self, new: str, reason: str) -> str:
        self._drop_binding()  # it belongs to the session onnxruntime has just re-created
        previous, self.provider = self.provider, new
        self.fallback_reason = f"{previous} failed at run time, now {new}: {reason}"
        log.error("%s", self.fallback_reason)
        return previous

    def _after_run_failure(self, exc: Exception) -> None:
        """Turn a run failure into CudaFatalError or ProviderFallback where it is one; else return and
        let the caller re-raise the original error."""
        fatal = cuda_fatal_from(exc, f"inference on {self.provider}")
        if fatal is not None:
            raise fatal from exc
        reason = f"{type(exc).__name__}: {exc}"
        got = self._session_providers()
        if got and got[0] != self.provider:  # onnxruntime already moved the session
            previous = self._note_switch(got[0], reason)
            raise ProviderFallback(previous, got[0], reason) from exc
        if type(exc).__name__ != "EPFail" or self.provider == CPU_EP:
            return
        # An execution provider failure (e.g. "TensorRT EP Failed to Build Engine" at a new input
        # shape): continue on the next provider asked for, as onnxruntime would, but say so.
        names = [_provider_name(p) for p in self._providers_asked]
        rest = self._providers_asked[names.index(self.provider) + 1 :] if self.provider in names else []
        if not rest:
            rest = [CPU_EP]
        try:
            self._session.set_providers(rest)
        except Exception as switch_exc:
            fatal = cuda_fatal_from(switch_exc, f"re-creating the session after {self.provider} failed")
            if fatal is not None:
                raise fatal from switch_exc
            raise BackendError(
                f"{self.provider} failed at run time ({reason}) and the session could not be re-created "
                f"on {', '.join(_provider_name(p) for p in rest)}: {switch_exc}"
            ) from exc
        got = self._session_providers()
        new = got[0] if got else _provider_name(rest[0])
        previous = self._note_switch(new, reason)
        raise ProviderFallback(previous, new, reason) from exc

    def close(self) -> None:
        # onnxruntime frees the session with its last reference; nothing else holds it.
        self._drop_binding()
        self.__dict__.pop("_session", None)


class GuardedTensorRtBackend(TensorRtBackend):
    """The native TensorRT backend whose ``run`` raises :class:`CudaFatalError` on a sticky CUDA error
    (trt.py maps every CUDA error to TrtError; this tells the fatal ones apart)."""

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        try:
            return super().run(batch)
        except Exception as exc:
            fatal = cuda_fatal_from(exc, f"inference on {self.provider}")
            if fatal is not None:
                raise fatal from exc
            raise


# --------------------------------------------------------------------------- engine choice and builds

EngineChoice = Literal["auto", "onnxruntime", "tensorrt"]
BuildPhase = Literal["started", "progress", "cached", "evicted", "finished", "failed", "fallback"]


@dataclass(frozen=True)
class BuildNote:
    """One step of getting a model onto its engine; the agent turns these into MODEL_BUILD events."""

    phase: BuildPhase
    engine: Literal["tensorrt", "onnxruntime"] = "tensorrt"
    pct: float | None = None
    duration_s: float | None = None
    reason: str = ""
    engine_file: str | None = None
    precision: str | None = None
    provider: str | None = None


def _ignore(note: BuildNote) -> None:
    pass


@dataclass
class LoadRequest:
    """What the agent knows about a load beyond (path, manifest)."""

    variant: str = "fp32"
    notify: Callable[[BuildNote], None] = _ignore
    cancel: threading.Event | None = None
    """Set when the agent stops: a native build is abandoned (and TensorRT asked to stop)."""
    calibration_frames: Callable[[int], list[np.ndarray]] | None = None
    """Up to n BGR frames from the camera, for INT8 calibration."""


def sample_shape(manifest: ModelManifest) -> tuple[int, int, int]:
    spec = manifest.input
    return (spec.height, spec.width, 3) if spec.layout == "NHWC" else (3, spec.height, spec.width)


class BuildWaiter(Protocol):
    def result(self, timeout: float | None = None) -> BuildResult: ...


class BuildStarter(Protocol):
    """What the factory needs of :class:`~edge_agent.inference.engine_build.BuildSupervisor` (the seam for tests)."""

    def start(
        self,
        request: BuildRequest,
        *,
        on_progress: Callable[[BuildProgress], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> BuildWaiter: ...

    def cancel_all(self, reason: str = ..., wait_s: float | None = None) -> None: ...


class _InProcessBuild:
    def __init__(self, request: BuildRequest, timeout_s: float, cancel: threading.Event | None) -> None:
        self.request = request
        self.timeout_s = timeout_s
        self.cancel_event = cancel
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.files: list[Path] = []
        self.t0 = time.monotonic()

    def result(self, timeout: float | None = None) -> BuildResult:
        waited_until = None if timeout is None else time.monotonic() + timeout
        while not self.done.wait(0.2):
            if self.cancel_event is not None and self.cancel_event.is_set():
                raise BuildCancelled("the agent is stopping")
            if time.monotonic() - self.t0 > self.timeout_s:
                raise BuildTimedOut(
                    f"engine build exceeded its time bound of {self.timeout_s:.0f} s "
                    "(an in-process build cannot be stopped; it finishes in the background)"
                )
            if waited_until is not None and time.monotonic() >= waited_until:
                raise TimeoutError(f"engine build {self.request.build_id} still running after {timeout} s")
        if self.error is not None:
            raise self.error
        return BuildResult(self.request.build_id, self.files, time.monotonic() - self.t0, {})


class InProcessBuilds:
    """Builds in a thread of this process, with the runtime the factory was given.

    For a TensorRT runtime or session factory passed into :class:`AutoBackendFactory` (tests, bench):
    those live in this process, so a build process could not use them. Native builds run
    ``runtime.build_engine`` in a worker thread while the caller waits interruptibly (cancel and the
    time bound end the wait; the thread cannot be stopped). An onnxruntime TensorRT EP build is left
    to the session creation itself: nothing is done here. Production uses :class:`BuildSupervisor`.
    """

    def __init__(self, runtime: Callable[[], TrtRuntime | None], *, timeout_s: float) -> None:
        self._runtime = runtime
        self.timeout_s = timeout_s

    def start(
        self,
        request: BuildRequest,
        *,
        on_progress: Callable[[BuildProgress], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> BuildWaiter:
        handle = _InProcessBuild(request, request.timeout_s or self.timeout_s, cancel)
        if not request.engine_file:  # an onnxruntime build: the session creation builds
            handle.done.set()
            return handle
        rt = self._runtime()

        def progress(pct: float) -> None:
            if on_progress is not None:
                on_progress(BuildProgress("building", pct, "", time.monotonic() - handle.t0))

        def work() -> None:
            try:
                if rt is None:
                    raise TrtError("no TensorRT runtime for an in-process build")
                options = replace(request.options, progress=progress, cancel=cancel)
                data = rt.build_engine(request.onnx_path, request.precision, request.calibration, options)
                if not data:
                    raise TrtError("the TensorRT builder returned no engine")
                handle.files = [atomic_write(request.target_dir / request.engine_file, data)]
            except BaseException as exc:  # handed to the waiting thread
                handle.error = exc
            finally:
                handle.done.set()

        threading.Thread(target=work, name="trt-build", daemon=True).start()
        return handle

    def cancel_all(
        self, reason: str = "cancelled: the agent is stopping", wait_s: float | None = None
    ) -> None:
        pass  # the waits end on the load's cancel event; the threads cannot be stopped


class AutoBackendFactory:
    """Picks the engine per ``inference.engine`` and builds it; falls back to onnxruntime on failure.

    ``tensorrt`` (or ``auto`` where TensorRT loads): a native engine from the cache, or built in a
    build process (``builds``, a :class:`~edge_agent.inference.engine_build.BuildSupervisor` bounded by
    ``build_timeout_s``) while the caller waits (the old model keeps serving meanwhile: the pipeline
    swaps only after this returns and warm-up passes). Any failure falls back to onnxruntime with the
    configured provider order (TensorRT EP -> CUDA EP -> CPU EP, as this onnxruntime offers them) and
    the reason is reported. onnxruntime's TensorRT EP engines are built in a build process too (G5),
    with explicit optimization profiles where they can be named (G4), before the agent's session
    loads them from the cache.

    The engine precision is the variant's (G8: fp32 builds fp32); the engine key covers the profile,
    workspace and builder flags (G11); an INT8 variant TensorRT cannot take (QOperator, asymmetric
    Q/DQ) never reaches TensorRT (G12). Call :meth:`close` when the agent stops: it ends running builds.

    ``builds`` defaults to a :class:`BuildSupervisor`; where a TensorRT runtime, runtime loader or
    session factory is passed in (tests), to :class:`InProcessBuilds`, which can use them.
    """

    def __init__(
        self,
        *,
        engine: EngineChoice,
        cache_dir: Path,
        cache_max_bytes: int = 4 * 2**30,
        threads: int = 2,
        providers_preference: Sequence[str] = DEFAULT_PROVIDERS,
        spin: bool = False,
        max_batch: int = 1,
        precision: str = "auto",
        workspace_mb: int = 1024,
        calibration_frames: int = 32,
        runtime: TrtRuntime | None = None,
        runtime_loader: Callable[[], tuple[TrtRuntime | None, str]] | None = None,
        available_providers: Callable[[], Sequence[str]] | None = None,
        session_factory: SessionFactory | None = None,
        preprocessor_factory: Callable[[Any], Any] | None = None,
        provider_probe: Callable[[], ProviderProbe] | None = None,
        device_id: int = 0,
        cuda_options: Mapping[str, str] | None = None,
        builds: BuildStarter | None = None,
        build_timeout_s: float = DEFAULT_BUILD_TIMEOUT_S,
    ) -> None:
        if build_timeout_s <= 0:
            raise ValueError("build_timeout_s must be > 0")
        self.engine = engine
        self.cache_dir = cache_dir
        self._cache_max_bytes = cache_max_bytes
        self._cache: EngineCache | None = None
        self.threads = threads
        self.providers_preference = list(providers_preference)
        self.spin = spin
        self.max_batch = max_batch
        self.precision = precision
        self.workspace_mb = workspace_mb
        self.calibration_frames = calibration_frames
        self._runtime = runtime
        self._runtime_problem = ""
        self._runtime_resolved = runtime is not None or engine == "onnxruntime"
        self._runtime_loader = runtime_loader or load_tensorrt_runtime
        self._available = available_providers
        # Which providers really work here (G22): probed once per process unless a test passes the
        # list (``available_providers``, taken as all usable) or its own probe.
        self._provider_probe = provider_probe
        if provider_probe is None and available_providers is None:
            self._provider_probe = cached_provider_probe
        self.device_id = device_id
        self.cuda_options = dict(cuda_options) if cuda_options is not None else None
        self._session_factory = session_factory
        self._preprocessor_factory = preprocessor_factory
        self._lock = threading.Lock()
        self.build_timeout_s = build_timeout_s
        if builds is None:
            if runtime is not None or runtime_loader is not None or session_factory is not None:
                builds = InProcessBuilds(lambda: self.runtime()[0], timeout_s=build_timeout_s)
            else:
                builds = BuildSupervisor(timeout_s=build_timeout_s)
        self.builds: BuildStarter = builds

    def cancel_all(
        self, reason: str = "cancelled: the agent is stopping", wait_s: float | None = None
    ) -> None:
        """Stop every running engine build (its process and work folder); loads waiting on one fall
        back or end with BackendError."""
        self.builds.cancel_all(reason, wait_s=wait_s)

    def close(self) -> None:
        """At agent shutdown: no build process outlives the agent."""
        self.cancel_all()

    @property
    def cache(self) -> EngineCache:
        with self._lock:
            if self._cache is None:
                self._cache = EngineCache(self.cache_dir / "engines", max_bytes=self._cache_max_bytes)
            return self._cache

    def runtime(self) -> tuple[TrtRuntime | None, str]:
        """The TensorRT runtime (loaded once, on first use) or None and why not."""
        with self._lock:
            if not self._runtime_resolved:
                self._runtime_resolved = True
                self._runtime, self._runtime_problem = self._runtime_loader()
                if self._runtime is None:
                    log.info("native TensorRT not available: %s", self._runtime_problem)
                else:
                    rt = self._runtime
                    log.info(
                        "TensorRT %s on %s (compute capability %s)",
                        rt.version,
                        rt.gpu_name,
                        rt.compute_capability,
                    )
            return self._runtime, self._runtime_problem

    def __call__(self, path: Path, manifest: ModelManifest) -> InferenceBackend:
        return self.make(path, manifest, LoadRequest())

    def make(self, path: Path, manifest: ModelManifest, req: LoadRequest) -> InferenceBackend:
        trt_refused = None
        if req.variant == "int8":  # G12: only symmetric S8 Q/DQ may reach TensorRT
            problem = int8_qdq_problem(path)
            if problem is not None:
                trt_refused = f"the int8 variant cannot run on TensorRT, running without it: {problem}"
                log.warning("%s: %s", path.name, trt_refused)
        if self.engine == "onnxruntime" or trt_refused is not None:
            return self._onnxruntime(path, manifest, req, trt_refused, trt_allowed=trt_refused is None)
        rt, problem = self.runtime()
        if rt is None:
            reason = None
            if self.engine == "tensorrt":
                reason = f"inference.engine is tensorrt but TensorRT is not usable here: {problem}"
                req.notify(BuildNote("failed", reason=reason))
            return self._onnxruntime(path, manifest, req, reason)
        precision = resolve_precision(req.variant, self.precision)  # G8: fp32 builds fp32
        options = BuildOptions(
            max_batch=self.max_batch, sample_shape=sample_shape(manifest), workspace_mb=self.workspace_mb
        )
        key = EngineKey.for_build(  # G11: profile, workspace and flags are part of the key
            rt,
            manifest.sha256,
            precision,
            options,
            calibrated=(precision == "int8" and req.variant != "int8"),
        )
        try:
            return self._native(rt, path, manifest, key, options, req)
        except BuildCancelled as exc:
            raise BackendError(f"TensorRT engine build cancelled: {exc}") from exc
        except CudaFatalError:
            raise
        except (BuildFailed, BuildTimedOut, BuildBusy) as exc:
            # The build process failed: whatever it hit (even a sticky CUDA error) stayed in that
            # process, so this one's CUDA context is fine and onnxruntime can take over.
            return self._native_failed(path, manifest, req, key, exc)
        except Exception as exc:
            fatal = cuda_fatal_from(exc, f"TensorRT {precision} engine for {path.name}")
            if fatal is not None:  # onnxruntime in this process would fail the same way
                req.notify(
                    BuildNote("failed", reason=str(fatal), engine_file=key.file_name(), precision=precision)
                )
                raise fatal from exc
            return self._native_failed(path, manifest, req, key, exc)

    def _native_failed(
        self, path: Path, manifest: ModelManifest, req: LoadRequest, key: EngineKey, exc: Exception
    ) -> InferenceBackend:
        reason = f"TensorRT {key.precision} engine failed: {type(exc).__name__}: {exc}"
        log.error("%s; falling back to onnxruntime", reason)
        req.notify(BuildNote("failed", reason=reason, engine_file=key.file_name(), precision=key.precision))
        return self._onnxruntime(path, manifest, req, reason)

    # ------------------------------------------------------------------ native TensorRT

    def _calibration(
        self, manifest: ModelManifest, req: LoadRequest, precision: Precision
    ) -> Calibration | None:
        # A Q/DQ (int8 variant) model carries its own scales; anything else needs calibration frames.
        if precision != "int8" or req.variant == "int8":
            return None
        frames = req.calibration_frames(self.calibration_frames) if req.calibration_frames else []
        if not frames:
            raise TrtError("INT8 needs calibration frames and none were available from the camera")
        factory = self._preprocessor_factory
        if factory is None:
            from fleet_protocol.vision.preprocess import Preprocessor

            factory = Preprocessor
        return calibration_from_frames(frames, factory(manifest.input), batch_size=1)

    def _native(
        self,
        rt: TrtRuntime,
        path: Path,
        manifest: ModelManifest,
        key: EngineKey,
        options: BuildOptions,
        req: LoadRequest,
    ) -> InferenceBackend:
        cache = self.cache
        engine_file, precision = key.file_name(), key.precision

        def note(phase: BuildPhase, **kw: Any) -> None:
            req.notify(BuildNote(phase, engine_file=engine_file, precision=precision, **kw))

        def calib() -> Calibration | None:
            return self._calibration(manifest, req, precision)

        def on_progress(event: BuildProgress) -> None:
            if event.phase == "building" and event.pct is not None:
                note("progress", pct=event.pct)

        def build(cal: Calibration | None) -> None:
            # In a build process (G5): the agent's threads keep the GIL; cancel and the time bound
            # kill the process; the engine reaches the cache by an atomic rename or not at all.
            request = BuildRequest.native(
                onnx_path=path,
                cache=cache,
                key=key,
                options=options,
                calibration=cal,
                device=getattr(rt, "device", 0),
            )
            self.builds.start(request, on_progress=on_progress, cancel=req.cancel).result()

        engine, outcome = obtain_engine(
            rt,
            cache,
            path,
            key,
            calib=calib,
            options=options,
            on_build_start=lambda: note("started"),
            on_evict=lambda ev: note("evicted", reason=ev.reason),
            build=build,
        )
        if outcome.cache_hit:
            note("cached")
        else:
            note("finished", duration_s=outcome.build_s)
        return GuardedTensorRtBackend(engine, precision=precision, engine_file=engine_file)

    # ------------------------------------------------------------------ onnxruntime

    def _ort_cache_dir(self) -> Path:
        # onnxruntime names its engines by model hash only: one folder per GPU/CC/TensorRT version.
        rt = self._runtime
        if rt is None:
            return self.cache_dir / "ort"
        tag = EngineKey("-", rt.gpu_name, rt.compute_capability, rt.version, "fp32").file_name()
        return self.cache_dir / "ort" / tag.removeprefix("--").removesuffix(ENGINE_SUFFIX)

    def providers(self) -> ProviderProbe:
        """The providers this factory chooses from: the usable ones, and why the others are not."""
        if self._provider_probe is not None:
            return self._provider_probe()
        assert self._available is not None
        listed = tuple(self._available())
        return ProviderProbe(available=listed, usable=listed)

    def _ort_trt_profile(self, path: Path, manifest: ModelManifest) -> tuple[dict[str, str], tuple[int, ...]]:
        """The TensorRT EP's explicit profile options (G4) and the warm-up batches of its build: none
        with an explicit profile (the engine covers 1..max_batch from the start); without one
        (input names onnxruntime cannot parse, a shape that contradicts the manifest) batch 1 and
        ``max_batch`` for a dynamic batch, which widens onnxruntime's implicit profile at build time."""
        try:
            return (
                ort_trt_profile_options_for(
                    path, sample_shape=sample_shape(manifest), max_batch=self.max_batch
                ),
                (),
            )
        except ProfileNotExpressible as exc:
            log.info("%s: no explicit TensorRT EP profile: %s", path.name, exc)
        except Exception as exc:
            log.warning("%s: no explicit TensorRT EP profile: %s: %s", path.name, type(exc).__name__, exc)
        try:
            first = next(iter(onnx_input_shapes(path).values()), ())
            dynamic = bool(first) and not (isinstance(first[0], int) and first[0] > 0)
        except Exception:
            dynamic = False  # unreadable here: onnxruntime will say more when it loads it
        return {}, ((1, self.max_batch) if dynamic and self.max_batch > 1 else (1,))

    def _ort_input(self, path: Path, manifest: ModelManifest) -> str:
        try:
            return next(iter(onnx_input_shapes(path)), manifest.input.name)
        except Exception:
            return manifest.input.name

    def _onnxruntime(
        self,
        path: Path,
        manifest: ModelManifest,
        req: LoadRequest,
        reason: str | None,
        *,
        trt_allowed: bool = True,
    ) -> InferenceBackend:
        probe = self.providers()
        names = choose_providers(self.providers_preference, probe.usable)
        skipped = probe.why_not(self.providers_preference)
        reasons = [reason, skipped]
        fp16, int8 = ort_trt_precision(req.variant, self.precision)
        if not trt_allowed:  # G12: no TensorRT EP, so no trt_int8_enable either
            names = [n for n in names if n != TRT_EP]
            int8 = False
        trt_dir = self._ort_cache_dir()

        def providers_for(names: list[str], trt_extra: Mapping[str, str] | None = None) -> list[ProviderSpec]:
            return provider_list(
                names,
                trt_cache_dir=trt_dir,
                fp16=fp16,
                int8=int8,
                trt_workspace_bytes=self.workspace_mb * 2**20,
                device_id=self.device_id,
                cuda_options=self.cuda_options,
                trt_extra_options=trt_extra,
            )

        via_trt_ep = names[0] == TRT_EP
        t0 = time.monotonic()
        if via_trt_ep:  # onnxruntime builds (or loads from its cache) a TensorRT engine
            req.notify(BuildNote("started", engine="onnxruntime", provider=TRT_EP))
            profile, warmups = self._ort_trt_profile(path, manifest)
            providers = providers_for(names, profile)
            try:
                self._ort_trt_build(path, manifest, req, providers, warmups, trt_dir)
            except BuildCancelled as exc:
                raise BackendError(f"TensorRT EP engine build cancelled: {exc}") from exc
            except TrtError as exc:  # BuildFailed, BuildTimedOut, BuildBusy
                why = (
                    f"TensorRT EP engine build failed, running without TensorRT: {type(exc).__name__}: {exc}"
                )
                log.error("%s: %s", path.name, why)
                req.notify(BuildNote("failed", engine="onnxruntime", provider=TRT_EP, reason=why))
                reasons.append(why)
                names = [n for n in names if n != TRT_EP]
                providers = providers_for(names)
                via_trt_ep = False
        else:
            providers = providers_for(names)
        backend = OnnxRuntimeBackend(
            path,
            threads=self.threads,
            trt_cache_dir=trt_dir,
            spin=self.spin,
            session_factory=self._session_factory,
            provider_problems=probe.problems,
            providers=providers,
        )
        if via_trt_ep:
            req.notify(
                BuildNote(
                    "finished",
                    engine="onnxruntime",
                    duration_s=time.monotonic() - t0,
                    provider=backend.provider,
                )
            )
        why = "; ".join(r for r in (*reasons, backend.fallback_reason) if r)
        if why:
            req.notify(BuildNote("fallback", engine="onnxruntime", provider=backend.provider, reason=why))
        return backend

    def _ort_trt_build(
        self,
        path: Path,
        manifest: ModelManifest,
        req: LoadRequest,
        providers: Sequence[ProviderSpec],
        warmups: tuple[int, ...],
        trt_dir: Path,
    ) -> None:
        """onnxruntime's TensorRT EP builds its engines in a build process (G5: session creation holds
        the GIL for the whole build), with exactly the providers and graph optimisation level the
        agent's session gets, so that the session only deserializes them."""
        request = BuildRequest.ort_trt_ep(
            onnx_path=path,
            model_sha256=manifest.sha256,
            cache_dir=trt_dir,
            providers=providers,
            input_name=self._ort_input(path, manifest),
            input_dtype=manifest.input.dtype,
            sample_shape=sample_shape(manifest),
            warmup_batches=warmups,
            graph_optimization_level=GRAPH_OPTIMIZATION_LEVEL,
        )
        if ort_engines_ready(request):
            return

        def on_progress(event: BuildProgress) -> None:
            if event.phase in ("building", "warmup") and event.pct is not None:
                req.notify(BuildNote("progress", engine="onnxruntime", pct=event.pct, provider=TRT_EP))

        self.builds.start(request, on_progress=on_progress, cancel=req.cancel).result()
