"""Inference behind a tiny interface: ONNX Runtime with the best execution provider available, or a
native TensorRT engine built on the device (see :mod:`edge_agent.trt`), chosen by
:class:`AutoBackendFactory`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from edge_agent.trt import (
    ENGINE_SUFFIX,
    PRECISIONS,
    BuildCancelled,
    BuildOptions,
    Calibration,
    EngineCache,
    EngineKey,
    Precision,
    TensorRtBackend,
    TrtError,
    TrtRuntime,
    calibration_from_frames,
    load_tensorrt_runtime,
    obtain_engine,
)
from fleet_protocol.messages import ModelManifest

log = logging.getLogger(__name__)

DEFAULT_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")


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


def choose_providers(preference: Sequence[str], available: Sequence[str]) -> list[str]:
    """The preferred providers this build of onnxruntime has, in preference order, CPU always last."""
    chosen = [p for p in preference if p in available and p != "CPUExecutionProvider"]
    chosen.append("CPUExecutionProvider")
    return chosen


def session_options(threads: int, *, spin: bool = False) -> Any:
    """The agent's onnxruntime session options (the pipeline benchmark's raw run uses the same)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    # Measured: without graph optimisation FP32 runs 1.4-2.2x slower on CPU.
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    # Spinning intra-op threads win a few percent alone, but steal the cores that capture,
    # preprocessing and publishing need on a small device.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return opts


def trt_ep_options(cache_dir: Path, *, fp16: bool = False, int8: bool = False) -> dict[str, str]:
    """onnxruntime TensorRT EP options: engine and timing caches on the device, precision flags.

    ``int8`` is for explicitly quantized (Q/DQ) models; no calibration table is used.
    """
    return {
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(cache_dir),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(cache_dir),
        "trt_fp16_enable": "True" if fp16 else "False",
        "trt_int8_enable": "True" if int8 else "False",
    }


def provider_list(
    names: Sequence[str], *, trt_cache_dir: Path | None, fp16: bool = False, int8: bool = False
) -> list[str | tuple[str, dict[str, str]]]:
    """What ``InferenceSession(providers=...)`` gets: names, the TensorRT EP with its options."""
    providers: list[str | tuple[str, dict[str, str]]] = []
    for name in names:
        if name == "TensorrtExecutionProvider" and trt_cache_dir is not None:
            providers.append((name, trt_ep_options(trt_cache_dir, fp16=fp16, int8=int8)))
        else:
            providers.append(name)
    return providers


SessionFactory = Callable[..., Any]
"""``(path: str, *, sess_options, providers) -> session``; onnxruntime.InferenceSession by default."""


class OnnxRuntimeBackend:
    """An onnxruntime session; ``provider`` is the one the session really got, not the one asked.

    ``requested`` is the provider order asked for (what this build of onnxruntime offers, in the
    configured preference); ``fallback_reason`` says why the session got less than the first of them.
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
    ) -> None:
        import onnxruntime as ort

        opts = session_options(threads, spin=spin)
        if available is None:
            available = ort.get_available_providers()
        names = choose_providers(providers_preference, available)
        if "TensorrtExecutionProvider" in names and trt_cache_dir is not None:
            # Engines are GPU-specific and slow to build: cache them on the device.
            trt_cache_dir.mkdir(parents=True, exist_ok=True)
        providers = provider_list(names, trt_cache_dir=trt_cache_dir, fp16=fp16, int8=int8)
        make = session_factory or ort.InferenceSession
        try:
            self._session = make(str(path), sess_options=opts, providers=providers)
        except Exception as exc:
            raise BackendError(f"onnxruntime cannot load {path.name}: {exc}") from exc
        self.requested: list[str] = names
        got = list(self._session.get_providers())
        self.provider: str = got[0] if got else "CPUExecutionProvider"
        self.fallback_reason: str | None = None
        if self.provider != names[0]:
            # onnxruntime drops a provider it cannot initialise (no driver, wrong CUDA/TensorRT) with
            # only a log line: say so, and report what was really obtained.
            self.fallback_reason = f"asked for {names[0]}, onnxruntime gave {self.provider}"
            log.warning("%s (asked %s)", self.fallback_reason, ", ".join(names))
        inp = self._session.get_inputs()[0]
        self.input_name: str = inp.name
        self.input_shape: tuple[int | str | None, ...] = tuple(inp.shape)
        first = self.input_shape[0] if self.input_shape else 1
        self.dynamic_batch: bool = not isinstance(first, int) or first <= 0
        self.output_names: list[str] = [o.name for o in self._session.get_outputs()]
        log.info(
            "loaded %s on %s (asked %s; input %s %s, dynamic batch: %s)",
            path.name,
            self.provider,
            ", ".join(names),
            self.input_name,
            self.input_shape,
            self.dynamic_batch,
        )

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        outs = self._session.run(None, {self.input_name: batch})
        return {name: np.asarray(v) for name, v in zip(self.output_names, outs, strict=True)}

    def close(self) -> None:
        # onnxruntime frees the session with its last reference; nothing else holds it.
        self.__dict__.pop("_session", None)


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


def precision_for(variant: str, setting: str = "auto") -> Precision:
    """The engine precision: the setting when it names one, else the variant's (fp32 variants: FP16,
    which TensorRT applies per layer only where it is faster and supported)."""
    if setting in PRECISIONS:
        return setting  # type: ignore[return-value]
    if variant == "int8":
        return "int8"
    return "fp16"


def sample_shape(manifest: ModelManifest) -> tuple[int, int, int]:
    spec = manifest.input
    return (spec.height, spec.width, 3) if spec.layout == "NHWC" else (3, spec.height, spec.width)


class AutoBackendFactory:
    """Picks the engine per ``inference.engine`` and builds it; falls back to onnxruntime on failure.

    ``tensorrt`` (or ``auto`` where TensorRT loads): a native engine from the cache, or built in a
    worker thread ("trt-build") while the caller waits interruptibly (the old model keeps serving
    meanwhile: the pipeline swaps only after this returns and warm-up passes). Any failure falls back
    to onnxruntime with the configured provider order (TensorRT EP -> CUDA EP -> CPU EP, as this
    onnxruntime offers them) and the reason is reported.
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
    ) -> None:
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
        self._session_factory = session_factory
        self._preprocessor_factory = preprocessor_factory
        self._lock = threading.Lock()

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
        if self.engine == "onnxruntime":
            return self._onnxruntime(path, req, None)
        rt, problem = self.runtime()
        if rt is None:
            reason = None
            if self.engine == "tensorrt":
                reason = f"inference.engine is tensorrt but TensorRT is not usable here: {problem}"
                req.notify(BuildNote("failed", reason=reason))
            return self._onnxruntime(path, req, reason)
        precision = precision_for(req.variant, self.precision)
        key = EngineKey(manifest.sha256, rt.gpu_name, rt.compute_capability, rt.version, precision)
        try:
            return self._native(rt, path, manifest, key, req)
        except BuildCancelled as exc:
            raise BackendError(f"TensorRT engine build cancelled: {exc}") from exc
        except Exception as exc:
            reason = f"TensorRT {precision} engine failed: {type(exc).__name__}: {exc}"
            log.error("%s; falling back to onnxruntime", reason)
            req.notify(BuildNote("failed", reason=reason, engine_file=key.file_name(), precision=precision))
            return self._onnxruntime(path, req, reason)

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
            from edge_agent.preprocess import Preprocessor

            factory = Preprocessor
        return calibration_from_frames(frames, factory(manifest.input), batch_size=1)

    def _native(
        self, rt: TrtRuntime, path: Path, manifest: ModelManifest, key: EngineKey, req: LoadRequest
    ) -> InferenceBackend:
        cache = self.cache
        common = {"engine_file": key.file_name(), "precision": key.precision}

        def calib() -> Calibration | None:
            return self._calibration(manifest, req, key.precision)

        options = BuildOptions(
            max_batch=self.max_batch,
            sample_shape=sample_shape(manifest),
            workspace_mb=self.workspace_mb,
            progress=lambda pct: req.notify(BuildNote("progress", pct=pct, **common)),  # type: ignore[arg-type]
            cancel=req.cancel,
        )
        box: dict[str, Any] = {}
        done = threading.Event()

        def work() -> None:
            try:
                box["result"] = obtain_engine(
                    rt,
                    cache,
                    path,
                    key,
                    calib=calib,
                    options=options,
                    on_build_start=lambda: req.notify(BuildNote("started", **common)),  # type: ignore[arg-type]
                    on_evict=lambda ev: req.notify(BuildNote("evicted", reason=ev.reason, **common)),  # type: ignore[arg-type]
                )
            except BaseException as exc:  # handed to the waiting thread
                box["error"] = exc
            finally:
                done.set()

        worker = threading.Thread(target=work, name="trt-build", daemon=True)
        worker.start()
        while not done.wait(0.2):
            if req.cancel is not None and req.cancel.is_set():
                raise BuildCancelled("the agent is stopping")
        if "error" in box:
            raise box["error"]
        engine, outcome = box["result"]
        if outcome.cache_hit:
            req.notify(BuildNote("cached", **common))  # type: ignore[arg-type]
        else:
            req.notify(BuildNote("finished", duration_s=outcome.build_s, **common))  # type: ignore[arg-type]
        return TensorRtBackend(engine, precision=key.precision, engine_file=key.file_name())

    # ------------------------------------------------------------------ onnxruntime

    def _ort_cache_dir(self) -> Path:
        # onnxruntime names its engines by model hash only: one folder per GPU/CC/TensorRT version.
        rt = self._runtime
        if rt is None:
            return self.cache_dir / "ort"
        tag = EngineKey("-", rt.gpu_name, rt.compute_capability, rt.version, "fp32").file_name()
        return self.cache_dir / "ort" / tag.removeprefix("--").removesuffix(ENGINE_SUFFIX)

    def _onnxruntime(self, path: Path, req: LoadRequest, reason: str | None) -> InferenceBackend:
        available = self._available() if self._available is not None else None
        if available is None:
            import onnxruntime as ort

            available = ort.get_available_providers()
        names = choose_providers(self.providers_preference, available)
        via_trt_ep = names[0] == "TensorrtExecutionProvider"
        if via_trt_ep:  # onnxruntime builds (or loads from its cache) a TensorRT engine in the session
            req.notify(BuildNote("started", engine="onnxruntime", provider=names[0]))
        t0 = time.monotonic()
        backend = OnnxRuntimeBackend(
            path,
            threads=self.threads,
            providers_preference=self.providers_preference,
            trt_cache_dir=self._ort_cache_dir(),
            spin=self.spin,
            fp16=req.variant == "fp16",
            int8=req.variant == "int8",
            available=available,
            session_factory=self._session_factory,
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
        why = "; ".join(r for r in (reason, backend.fallback_reason) if r)
        if why:
            req.notify(BuildNote("fallback", engine="onnxruntime", provider=backend.provider, reason=why))
        return backend
