"""bench/gpu_check.py on a machine without an NVIDIA GPU: it says what it skips and why, still probes
and records the installed stack, writes its JSON and exits 0. (With a GPU the full check takes minutes;
it is run by hand there, and this test skips.)"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.benches import run_bench


def load_script() -> ModuleType:
    return importlib.import_module("bench.gpu_check")


def test_without_a_gpu_it_exits_0_after_saying_why(tmp_path: Path) -> None:
    devices, why = load_script().cuda_devices()
    if devices:
        pytest.skip("this machine has an NVIDIA GPU: run `python -m bench.gpu_check` by hand (minutes)")
    out = tmp_path / "result.json"
    done = run_bench("gpu_check", "--out", str(out))
    lines = done.stdout.splitlines()
    assert f"SKIP gpu: {why}" in lines
    assert "SKIP engines, fidelity, speed and power: no NVIDIA GPU on this machine: nothing to check" in lines
    skips = [line for line in lines if line.startswith("SKIP")]
    assert all(re.fullmatch(r"SKIP [^:]+: \S.*", line) for line in skips), skips
    assert "Traceback" not in done.stderr
    data = json.loads(out.read_text())
    assert data["gpu"] is None and data["models"] == {} and data["passed"] is True
    assert {"what": "gpu", "why": why} in data["skipped"]
    assert data["stack"]["packages"], "the installed stack is probed and recorded even without a GPU"


class OnnxFileEngine:
    """onnxruntime on the CPU standing in for a deserialized TensorRT engine."""

    def __init__(self, data: bytes) -> None:
        import onnxruntime as ort

        self._session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        inp = self._session.get_inputs()[0]
        self.input_name, self.input_shape = inp.name, tuple(inp.shape)
        self.dynamic_batch = not isinstance(self.input_shape[0], int)
        self._outputs = [o.name for o in self._session.get_outputs()]

    def run(self, batch: object) -> dict[str, object]:
        return dict(zip(self._outputs, self._session.run(None, {self.input_name: batch}), strict=True))

    def close(self) -> None:
        pass


class OnnxFileRuntime:
    """A TrtRuntime whose "engine" is the ONNX file itself: the script's own logic, no GPU."""

    version, gpu_name, compute_capability = "10.16.1.11", "Fake GPU", "9.0"

    def __init__(self) -> None:
        self.builds = 0

    def build_engine(self, onnx_path: Path, precision: str, calib: object, options: object) -> bytes:
        self.builds += 1
        progress = getattr(options, "progress", None)
        for pct in (25.0, 100.0):
            if progress is not None:
                progress(pct)
        return onnx_path.read_bytes()

    def load_engine(self, data: bytes) -> OnnxFileEngine:
        return OnnxFileEngine(data)


def test_each_model_is_built_reloaded_from_the_cache_and_scored_with_the_agents_and_controllers_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the seams (a fake TensorRT runtime): guards the script against drift in edge_agent.inference.tensorrt,
    the agent's preprocessing/decoders and the controller's fidelity module, which no CI GPU runs."""
    import cv2
    import onnxruntime as ort

    from edge_agent.inference.tensorrt.cache import EngineCache

    gc = load_script()
    from controller.registry import fidelity

    cap = cv2.VideoCapture(str(gc.FOOTAGE))
    frames = [cap.read()[1] for _ in range(3)]
    cap.release()
    run = gc.Run(tmp_path / "result.json", budget_s=300)
    rt = OnnxFileRuntime()
    cache = EngineCache(tmp_path / "engines")
    args = type("Args", (), {"build_timeout_s": 60.0, "workspace_mb": 256, "seconds": 0.2, "device": 0})()
    for model in gc.bundled_models(None):
        gc.check_model(run, model, rt, cache, None, ort, fidelity, frames, args)
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "result.json").read_text())
    assert rt.builds == len(data["models"]) == 2  # built once each, then reloaded from the cache
    for name, res in data["models"].items():
        assert res["build"]["ok"] and not res["build"]["cache_hit"]
        assert res["reload"]["cache_hit"]
        assert res["fidelity"]["f1"] == 1.0 and res["fidelity"]["ok"]  # the same model: identical detections
        assert res["speed"]["agent_path"]["frames"] > 0
        assert f"PASS reload {name}: from the engine cache" in out
        assert f"SKIP raw engine {name}:" in out  # no tensorrt module here
    assert f"build nanodet_coco fp16: {100.0:5.1f}%" in out
    assert run.failures == []
