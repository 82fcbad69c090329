"""ONNX Runtime as an :class:`~edge_agent.inference.backend.InferenceBackend`.

:class:`OnnxRuntimeBackend`: a session on the best execution provider available, that reports the
provider it really got, turns run-time provider failures into
:class:`~edge_agent.inference.backend.ProviderFallback` and sticky CUDA errors into
:class:`~edge_agent.inference.backend.CudaFatalError`, and runs GPU providers through IOBinding.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edge_agent.inference.backend import BackendError, ProviderFallback, cuda_fatal_from
from edge_agent.inference.providers import (
    CPU_EP,
    DEFAULT_PROVIDERS,
    GPU_PROVIDERS,
    TRT_EP,
    ProviderSpec,
    SessionFactory,
    choose_providers,
    provider_list,
    session_options,
)

log = logging.getLogger(__name__)


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

    On the CUDA and TensorRT providers a run goes through onnxruntime's IOBinding: the batch is
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
        self._threads = threads
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
            disable()  # no silent re-creation of the session inside run()
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

    @property
    def cpu_threads(self) -> int:
        """The intra-op threads a run keeps busy on the CPU provider; 0 on a device provider, whose
        run is on the accelerator (``backend.host_threads``)."""
        return self._threads if self.provider == CPU_EP else 0

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
