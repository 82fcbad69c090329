"""Choosing and building the engine a model runs on: :class:`AutoBackendFactory`.

Per ``inference.engine`` a native TensorRT engine (from the cache, or built out of process by
:class:`~edge_agent.inference.engine_build.ChildProcessBuilds`, or in a thread by
:class:`InProcessBuilds` where the TensorRT runtime is a test's), else onnxruntime with the best
usable provider, its TensorRT EP engines also built out of process first. Every step is reported as a
:class:`BuildNote`; every failure falls back to onnxruntime with the reason.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from edge_agent.core.files import atomic_write
from edge_agent.inference.backend import BackendError, CudaFatalError, InferenceBackend, cuda_fatal_from
from edge_agent.inference.engine_build import (
    DEFAULT_BUILD_TIMEOUT_S,
    BuildBusy,
    BuildFailed,
    BuildProgress,
    BuildRequest,
    BuildResult,
    BuildTimedOut,
    ChildProcessBuilds,
    ort_engines_ready,
)
from edge_agent.inference.ort import OnnxRuntimeBackend
from edge_agent.inference.providers import (
    DEFAULT_PROVIDERS,
    GRAPH_OPTIMIZATION_LEVEL,
    TRT_EP,
    ProviderProbe,
    ProviderSpec,
    SessionFactory,
    cached_provider_probe,
    choose_providers,
    ort_trt_precision,
    provider_list,
)
from edge_agent.inference.tensorrt.backend import TensorRtBackend, obtain_engine
from edge_agent.inference.tensorrt.build_config import (
    BuildOptions,
    Calibration,
    Precision,
    calibration_from_frames,
    int8_qdq_problem,
    onnx_input_shapes,
    ort_trt_profile_options_for,
    resolve_precision,
)
from edge_agent.inference.tensorrt.cache import ENGINE_SUFFIX, EngineCache, EngineKey
from edge_agent.inference.tensorrt.errors import BuildCancelled, ProfileNotExpressible, TrtError
from edge_agent.inference.tensorrt.runtime import TrtRuntime, load_tensorrt_runtime
from fleet_protocol.messages import ModelManifest

log = logging.getLogger(__name__)


class GuardedTensorRtBackend(TensorRtBackend):
    """The native TensorRT backend whose ``run`` raises :class:`CudaFatalError` on a sticky CUDA error
    (the runtime maps every CUDA error to TrtError; this tells the fatal ones apart)."""

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        try:
            return super().run(batch)
        except Exception as exc:
            fatal = cuda_fatal_from(exc, f"inference on {self.provider}")
            if fatal is not None:
                raise fatal from exc
            raise


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
    """What the factory needs of :class:`~edge_agent.inference.engine_build.ChildProcessBuilds` (the seam for tests)."""

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
    to the session creation itself: nothing is done here. Production uses :class:`ChildProcessBuilds`.
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
    build process (``builds``, a :class:`~edge_agent.inference.engine_build.ChildProcessBuilds` bounded by
    ``build_timeout_s``) while the caller waits (the old model keeps serving meanwhile: the pipeline
    swaps only after this returns and warm-up passes). Any failure falls back to onnxruntime with the
    configured provider order (TensorRT EP -> CUDA EP -> CPU EP, as this onnxruntime offers them) and
    the reason is reported. onnxruntime's TensorRT EP engines are built in a build process too,
    with explicit optimization profiles where they can be named, before the agent's session
    loads them from the cache.

    The engine precision is the variant's (fp32 builds fp32); the engine key covers the profile,
    workspace and builder flags; an INT8 variant TensorRT cannot take (QOperator, asymmetric
    Q/DQ) never reaches TensorRT. Call :meth:`close` when the agent stops: it ends running builds.

    ``builds`` defaults to a :class:`ChildProcessBuilds`; where a TensorRT runtime, runtime loader or
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
        # Which providers really work here: probed once per process unless a test passes the
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
                builds = ChildProcessBuilds(timeout_s=build_timeout_s)
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
        if req.variant == "int8":  # only symmetric S8 Q/DQ may reach TensorRT
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
        precision = resolve_precision(req.variant, self.precision)  # fp32 builds fp32
        options = BuildOptions(
            max_batch=self.max_batch, sample_shape=sample_shape(manifest), workspace_mb=self.workspace_mb
        )
        key = EngineKey.for_build(  # profile, workspace and flags are part of the key
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
            # In a build process: the agent's threads keep the GIL; cancel and the time bound
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
        """The TensorRT EP's explicit profile options and the warm-up batches of its build: none
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
        if not trt_allowed:  # no TensorRT EP, so no trt_int8_enable either
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
        """onnxruntime's TensorRT EP builds its engines in a build process (session creation holds
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
