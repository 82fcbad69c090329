"""Stand-ins for onnxruntime: sessions (with or without IOBinding) and the TensorRT EP's build.

:class:`FakeSession` is an ``InferenceSession`` and its factory in one (pass it as
``session_factory``); :class:`FakeIoBindingSession` adds onnxruntime's IOBinding
(:class:`FakeBinding`, :class:`FakeOrtValue`). :class:`FakeTrtSession` runs inside the real engine
build process (named ``tests.support.fakes.ort:FakeTrtSession``) and behaves like the TensorRT EP
creating its engines.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

CPU = "CPUExecutionProvider"


class EPFail(Exception):
    """Named like onnxruntime's ``onnxruntime.capi.onnxruntime_pybind11_state.EPFail``."""


def provider_names(providers: list[Any]) -> list[str]:
    return [p[0] if isinstance(p, tuple) else p for p in providers]


class FakeSession:
    """An onnxruntime ``InferenceSession`` and its factory in one; y = x + 1.

    Every creation is recorded in ``calls`` (path, providers, graph optimisation level). The session
    got the providers ``got``, or all it was asked for when ``got`` is None. ``run_errors`` are raised
    by the runs, one per run, in order (None: that run succeeds). ``set_providers`` re-creates it on
    the providers given, with the CPU provider always last, as onnxruntime does; ``disable_fallback``
    is recorded in ``fallback_enabled``. No IOBinding: see :class:`FakeIoBindingSession`.
    """

    def __init__(
        self,
        got: list[str] | None = None,
        run_errors: list[Exception | None] | None = None,
        *,
        input_shape: list[int | str] | None = None,
    ) -> None:
        self.got = got
        self.run_errors = list(run_errors or [])
        self.input_shape = input_shape if input_shape is not None else ["N", 3]
        self.calls: list[dict[str, Any]] = []
        self.fallback_enabled = True
        self.set_to: list[list[Any]] = []
        self.runs = 0

    def __call__(self, path: Any, *, sess_options: Any, providers: list[Any]) -> FakeSession:
        self.calls.append(
            {"path": path, "providers": providers, "level": sess_options.graph_optimization_level}
        )
        return self

    @property
    def created_with(self) -> list[Any]:
        """The providers of the last creation."""
        return self.calls[-1]["providers"] if self.calls else []

    def provider_names(self, i: int = -1) -> list[str]:
        return provider_names(self.calls[i]["providers"])

    def trt_options(self, i: int = -1) -> dict[str, str]:
        return next(
            p[1]
            for p in self.calls[i]["providers"]
            if isinstance(p, tuple) and p[0] == "TensorrtExecutionProvider"
        )

    def disable_fallback(self) -> None:
        self.fallback_enabled = False

    def get_providers(self) -> list[str]:
        return self.got if self.got is not None else self.provider_names()

    def set_providers(self, providers: list[Any]) -> None:
        self.set_to.append(providers)
        self.got = provider_names(providers)
        if CPU not in self.got:
            self.got.append(CPU)

    def get_inputs(self) -> list[Any]:
        return [type("I", (), {"name": "x", "shape": self.input_shape})()]

    def get_outputs(self) -> list[Any]:
        return [type("O", (), {"name": "y"})()]

    def _next_error(self) -> None:
        err = self.run_errors.pop(0) if self.run_errors else None
        if err is not None:
            raise err

    def run(self, names: Any, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.runs += 1
        self._next_error()
        return [feed["x"] + 1]


class FakeOrtValue:
    """An OrtValue on a device: ``update_inplace`` copies numpy data into it."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, device: str, device_id: int) -> None:
        self.shape, self.dtype, self.device, self.device_id = shape, np.dtype(dtype), device, device_id
        self.data = np.zeros(shape, self.dtype)
        self.updates = 0

    def update_inplace(self, arr: np.ndarray) -> None:
        assert arr.shape == self.shape and arr.dtype == self.dtype and arr.flags.c_contiguous
        self.data[...] = arr
        self.updates += 1


class FakeBinding:
    """onnxruntime.IOBinding: records every call; outputs appear at run time on the bound device."""

    def __init__(self, session: FakeIoBindingSession) -> None:
        self.session = session
        self.calls: list[tuple[Any, ...]] = []
        self.input: Any = None
        self.outputs: dict[str, tuple[str, int]] = {}
        self.results: list[np.ndarray] | None = None

    def bind_ortvalue_input(self, name: str, value: FakeOrtValue) -> None:
        self.calls.append(("bind_ortvalue_input", name, id(value)))
        self.input = value

    def bind_cpu_input(self, name: str, arr: np.ndarray) -> None:
        self.calls.append(("bind_cpu_input", name, arr.shape))
        self.input = arr

    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0) -> None:
        self.calls.append(("bind_output", name, device_type, device_id))
        self.outputs[name] = (device_type, device_id)
        self.results = None  # unallocated again: onnxruntime allocates at the run

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        self.calls.append(("copy_outputs_to_cpu",))
        assert self.results is not None, "copy before a run"
        return list(self.results)


class FakeIoBindingSession(FakeSession):
    """A :class:`FakeSession` with onnxruntime's IOBinding: ``bindings`` made, ``bound_runs`` through
    them (``runs`` counts the plain ``session.run`` calls); ``run_errors`` are raised by either."""

    def __init__(
        self, got: list[str] | None = None, run_errors: list[Exception | None] | None = None
    ) -> None:
        super().__init__(got, run_errors)
        self.bindings: list[FakeBinding] = []
        self.bound_runs = 0

    def io_binding(self) -> FakeBinding:
        self.bindings.append(FakeBinding(self))
        return self.bindings[-1]

    def run_with_iobinding(self, binding: FakeBinding) -> None:
        assert binding is self.bindings[-1], "a binding of an older session"
        self._next_error()
        self.bound_runs += 1
        x = binding.input.data if isinstance(binding.input, FakeOrtValue) else binding.input
        assert set(binding.outputs) == {"y"}
        binding.results = [x + 1]


class FakeTrtSession:
    """onnxruntime.InferenceSession as the TensorRT EP would behave: its engine files appear in
    ``trt_engine_cache_path`` at session creation; every run is recorded in ``runs.jsonl``."""

    def __init__(self, path: str, *, sess_options: Any, providers: list[Any]) -> None:
        trt_opts = next(
            p[1] for p in providers if isinstance(p, tuple) and p[0] == "TensorrtExecutionProvider"
        )
        cache = Path(trt_opts["trt_engine_cache_path"])
        self.record = Path(os.environ["FAKE_ORT_RECORD"])
        got = os.environ.get("FAKE_ORT_PROVIDER", "TensorrtExecutionProvider")
        self.providers = [got, "CPUExecutionProvider"] if got != "CPUExecutionProvider" else [got]
        with self.record.open("a") as f:
            f.write(json.dumps({"init": {"path": path, "providers": providers}}) + "\n")
        if got == "TensorrtExecutionProvider":
            name = "TensorrtExecutionProvider_TRTKernel_graph_main_123_0_0_sm87"
            (cache / f"{name}.engine").write_bytes(b"ORT-ENGINE")
            (cache / f"{name}.profile").write_bytes(b"ORT-PROFILE")
            (cache / "TensorrtExecutionProvider_cache_sm87.timing").write_bytes(b"ORT-TIMING")

    def get_providers(self) -> list[str]:
        return self.providers

    def run(self, outputs: Any, feeds: dict[str, Any]) -> list[Any]:
        with self.record.open("a") as f:
            f.write(json.dumps({"run": {k: [list(v.shape), str(v.dtype)] for k, v in feeds.items()}}) + "\n")
        return []
