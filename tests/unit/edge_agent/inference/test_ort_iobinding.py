"""onnxruntime path: runs on the CUDA and TensorRT providers go through IOBinding (the input in a
device buffer kept per shape, outputs on the device and copied out once); the CPU provider keeps
``session.run``. A fake session records the binding calls; the real onnxruntime (CPU build), forced onto
the IOBinding path, checks the binding code itself against ``session.run`` on the bundled models.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

from edge_agent.inference.backend import CudaFatalError, ProviderFallback
from edge_agent.inference.ort import OnnxRuntimeBackend
from fleet_protocol.messages import ModelManifest
from fleet_protocol.vision.preprocess import Preprocessor
from tests.support.fakes.ort import EPFail, FakeIoBindingSession, FakeOrtValue
from tests.support.paths import FOOTAGE, MODELS

TRT, CUDA, CPU = "TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"


class Values:
    """The OrtValue factory seam: records what was made."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.made: list[FakeOrtValue] = []
        self.fail = fail

    def __call__(self, shape: tuple[int, ...], dtype: Any, device: str, device_id: int) -> FakeOrtValue:
        if self.fail is not None:
            raise self.fail
        self.made.append(FakeOrtValue(shape, dtype, device, device_id))
        return self.made[-1]


def make(
    tmp_path: Path,
    session: FakeIoBindingSession,
    values: Values | None = None,
    available: tuple[str, ...] = (TRT, CUDA, CPU),
    **kw: Any,
) -> OnnxRuntimeBackend:
    return OnnxRuntimeBackend(
        tmp_path / "m.onnx",
        threads=1,
        available=available,
        trt_cache_dir=tmp_path / "ort",
        session_factory=session,
        ort_value_factory=values or Values(),
        **kw,
    )


def batch(n: int, k: float = 0.0) -> np.ndarray:
    return np.arange(n * 3, dtype=np.float32).reshape(n, 3) + k


@pytest.mark.parametrize("provider", [CUDA, TRT])
def test_gpu_providers_run_through_one_binding_with_a_device_input_kept_per_shape(
    tmp_path: Path, provider: str
) -> None:
    session, values = FakeIoBindingSession([provider, CPU]), Values()
    backend = make(tmp_path, session, values, device_id=1)
    runs = [batch(1), batch(1, 10), batch(2), batch(1, 20), batch(2, 5)]
    for x in runs:
        out = backend.run(x)
        assert np.array_equal(out["y"], x + 1)
    assert backend.io_binding and session.runs == 0 and session.bound_runs == 5
    assert len(session.bindings) == 1, "the binding is reused across runs"
    # One device buffer per input shape, on the provider's device, updated in place on every run.
    assert [(v.shape, v.device, v.device_id) for v in values.made] == [
        ((1, 3), "cuda", 1),
        ((2, 3), "cuda", 1),
    ]
    assert [v.updates for v in values.made] == [3, 2]
    calls = session.bindings[0].calls
    per_run = [
        ("bind_ortvalue_input", "x", id(values.made[0])),
        ("bind_output", "y", "cuda", 1),
        ("copy_outputs_to_cpu",),
    ]
    assert calls[:3] == per_run
    assert calls.count(("copy_outputs_to_cpu",)) == 5, "outputs copied to the host once per run"
    assert [c for c in calls if c[0] == "bind_output"] == [("bind_output", "y", "cuda", 1)] * 5


def test_the_cpu_provider_keeps_session_run(tmp_path: Path) -> None:
    session = FakeIoBindingSession([CPU])
    backend = make(tmp_path, session, available=(CPU,))
    assert backend.provider == CPU and backend.fallback_reason is None
    assert np.array_equal(backend.run(batch(2))["y"], batch(2) + 1)
    assert not backend.io_binding and session.runs == 1 and session.bindings == []


def test_use_io_binding_false_and_sessions_without_io_binding_keep_session_run(tmp_path: Path) -> None:
    session = FakeIoBindingSession([CUDA, CPU])
    backend = make(tmp_path, session, use_io_binding=False)
    backend.run(batch(1))
    assert session.runs == 1 and session.bindings == []

    class NoBinding(FakeIoBindingSession):
        io_binding = None  # type: ignore[assignment]

    old = NoBinding([CUDA, CPU])
    backend = make(tmp_path, old)
    assert np.array_equal(backend.run(batch(1))["y"], batch(1) + 1)
    assert old.runs == 1 and not backend.io_binding


def test_no_device_input_buffer_binds_the_input_from_host_memory_with_the_reason_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    session = FakeIoBindingSession([CUDA, CPU])
    values = Values(fail=RuntimeError("cuda OrtValue not supported by this build"))
    backend = make(tmp_path, session, values)
    with caplog.at_level(logging.WARNING, logger="edge_agent.inference.ort"):
        for n in (1, 2, 1):
            assert np.array_equal(backend.run(batch(n))["y"], batch(n) + 1)
    assert backend.io_binding
    calls = session.bindings[0].calls
    assert [c for c in calls if c[0].startswith("bind_")][:2] == [
        ("bind_cpu_input", "x", (1, 3)),
        ("bind_output", "y", "cuda", 0),
    ]
    warnings = [
        r.getMessage() for r in caplog.records if "binding the input from host memory" in r.getMessage()
    ]
    assert len(warnings) == 1 and "not supported by this build" in warnings[0]


def test_a_provider_failure_inside_a_bound_run_falls_back_and_the_binding_is_not_reused(
    tmp_path: Path,
) -> None:
    session = FakeIoBindingSession(
        [TRT, CUDA, CPU], run_errors=[None, EPFail("TensorRT EP failed to build engine")]
    )
    backend = make(tmp_path, session)
    backend.run(batch(1))
    with pytest.raises(ProviderFallback) as info:
        backend.run(batch(1))
    assert info.value.previous == TRT and backend.provider == CUDA
    out = backend.run(batch(2))  # on CUDA now: still bound, through a binding of the re-created session
    assert np.array_equal(out["y"], batch(2) + 1) and backend.io_binding
    assert len(session.bindings) == 2


def test_a_sticky_cuda_error_inside_a_bound_run_is_fatal(tmp_path: Path) -> None:
    err = RuntimeError("CUDA failure 700: an illegal memory access was encountered ; GPU=0")
    session = FakeIoBindingSession([CUDA, CPU], run_errors=[err])
    backend = make(tmp_path, session)
    with pytest.raises(CudaFatalError):
        backend.run(batch(1))


# --------------------------------------------------------------------------- the real onnxruntime


def _frames(n: int) -> list[np.ndarray]:
    cap = cv2.VideoCapture(str(FOOTAGE))
    out: list[np.ndarray] = []
    try:
        while len(out) < n:
            ok, frame = cap.read()
            assert ok, "footage too short"
            out.append(frame)
    finally:
        cap.release()
    return out


@pytest.mark.parametrize("model", ["ped_ssdlite", "nanodet_coco"])
def test_the_binding_code_on_the_real_cpu_provider_gives_what_session_run_gives(model: str) -> None:
    path = MODELS / model / "model.onnx"
    manifest = ModelManifest.model_validate_json((MODELS / model / "manifest.json").read_text())
    pre = Preprocessor(manifest.input)
    frames = _frames(3)
    bound = OnnxRuntimeBackend(path, threads=1, available=[CPU], use_io_binding=True)
    plain = OnnxRuntimeBackend(path, threads=1, available=[CPU])
    batches = [pre(frames[0])[0][None], pre(frames[1])[0][None], pre(frames[0])[0][None]]
    if bound.dynamic_batch:
        batches.append(pre.batch(frames[:3])[0])  # another batch size, then back
        batches.append(pre(frames[2])[0][None])
    for x in batches:
        got, want = bound.run(x), plain.run(x)
        assert bound.io_binding and not plain.io_binding
        assert list(got) == list(want) == bound.output_names
        for name in want:
            assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{model} {name} {x.shape}")
    # Something was detected, so the comparison is not of empty outputs.
    assert any(np.abs(v).sum() > 0 for v in got.values())
    bound.close()
    plain.close()
