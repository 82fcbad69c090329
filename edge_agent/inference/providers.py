"""onnxruntime's execution providers: which to ask for, with which options, and which really work.

Provider names and preference (:func:`choose_providers`), the agent's session options, the TensorRT
and CUDA EP options (:func:`provider_list`), and :class:`ProviderProbe`: which of the providers
onnxruntime lists can really be used here, and why the others cannot (missing libraries, no GPU, both
onnxruntime packages installed). Small on purpose: the device's health report imports the probe
without the backends.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)


DEFAULT_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
TRT_EP = "TensorrtExecutionProvider"
CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"
GPU_PROVIDERS = (TRT_EP, CUDA_EP)


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
    # Without graph optimisation FP32 runs markedly slower on CPU.
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
    ``trt_profile_*_shapes``)."""
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
