"""A native TensorRT engine as an :class:`~edge_agent.inference.backend.InferenceBackend`.

:func:`obtain_engine` gets the engine for a key: from the cache when it loads, else built (in
another process, or by the runtime), cached and loaded. A cached engine that does not deserialize is
evicted, reported and rebuilt; one that deserializes but cannot be run here (data-dependent output
shapes) is kept and reported, and the model runs on onnxruntime instead. :class:`TensorRtBackend`
runs the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edge_agent.inference.tensorrt.build_config import BuildOptions, Calibration, Precision
from edge_agent.inference.tensorrt.cache import EngineCache, EngineKey, Eviction
from edge_agent.inference.tensorrt.errors import TrtError, UnsupportedEngine
from edge_agent.inference.tensorrt.runtime import TrtEngine, TrtRuntime

NATIVE_PROVIDER = "TensorRT"


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
    """An :class:`~edge_agent.inference.backend.InferenceBackend` over a native TensorRT engine."""

    def __init__(self, engine: TrtEngine, *, precision: Precision, engine_file: str) -> None:
        self._engine = engine
        self.provider: str = NATIVE_PROVIDER
        self.precision = precision
        self.engine_file = engine_file
        self.input_name: str = engine.input_name
        self.input_shape: tuple[int | str | None, ...] = engine.input_shape
        self.dynamic_batch: bool = engine.dynamic_batch
        self.host_memory: str | None = getattr(engine, "host_memory", None)
        """``pinned`` or ``pageable`` host staging, None for an engine that does not say."""

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        return self._engine.run(batch)

    def close(self) -> None:
        engine, self.__dict__["_engine"] = self.__dict__.get("_engine"), None
        if engine is not None:
            engine.close()
