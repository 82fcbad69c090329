"""Inference behind a tiny interface; ONNX Runtime with the best execution provider available."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

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


class OnnxRuntimeBackend:
    """An onnxruntime session; ``provider`` is the one the session really got, not the one asked."""

    def __init__(
        self,
        path: Path,
        *,
        threads: int = 2,
        providers_preference: Sequence[str] = DEFAULT_PROVIDERS,
        trt_cache_dir: Path | None = None,
        spin: bool = False,
    ) -> None:
        import onnxruntime as ort

        opts = session_options(threads, spin=spin)
        names = choose_providers(providers_preference, ort.get_available_providers())
        providers: list[str | tuple[str, dict[str, str]]] = []
        for name in names:
            if name == "TensorrtExecutionProvider" and trt_cache_dir is not None:
                # Engines are GPU-specific and slow to build: cache them on the device.
                trt_cache_dir.mkdir(parents=True, exist_ok=True)
                providers.append(
                    (name, {"trt_engine_cache_enable": "True", "trt_engine_cache_path": str(trt_cache_dir)})
                )
            else:
                providers.append(name)
        try:
            self._session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
        except Exception as exc:
            raise BackendError(f"onnxruntime cannot load {path.name}: {exc}") from exc
        self.provider: str = self._session.get_providers()[0]
        inp = self._session.get_inputs()[0]
        self.input_name: str = inp.name
        self.input_shape: tuple[int | str | None, ...] = tuple(inp.shape)
        first = self.input_shape[0] if self.input_shape else 1
        self.dynamic_batch: bool = not isinstance(first, int) or first <= 0
        self.output_names: list[str] = [o.name for o in self._session.get_outputs()]
        if self.provider != names[0]:
            log.warning("asked for %s, onnxruntime gave %s", names[0], self.provider)
        log.info(
            "loaded %s on %s (input %s %s, dynamic batch: %s)",
            path.name,
            self.provider,
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


def onnxruntime_factory(
    *,
    threads: int,
    providers_preference: Sequence[str],
    trt_cache_dir: Path | None = None,
    spin: bool = False,
) -> BackendFactory:
    def make(path: Path, manifest: ModelManifest) -> InferenceBackend:
        return OnnxRuntimeBackend(
            path,
            threads=threads,
            providers_preference=providers_preference,
            trt_cache_dir=trt_cache_dir,
            spin=spin,
        )

    return make
