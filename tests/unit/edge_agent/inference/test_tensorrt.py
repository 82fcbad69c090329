"""TensorRT at the seam: cache keys, the engine cache, build orchestration and provider fallback.

No GPU here: a fake TrtRuntime stands in for tensorrt + CUDA, a fake session for onnxruntime's GPU
providers; onnxruntime's CPU provider is real.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from edge_agent.agent import Agent
from edge_agent.core.settings import AgentSettings, CameraConfig, parse_settings
from edge_agent.inference.factory import AutoBackendFactory, BuildNote, LoadRequest
from edge_agent.inference.ort import OnnxRuntimeBackend
from edge_agent.inference.tensorrt.backend import TensorRtBackend
from edge_agent.inference.tensorrt.build_config import (
    BuildOptions,
    Calibration,
    calibration_from_frames,
)
from edge_agent.inference.tensorrt.cache import EngineCache, EngineKey
from edge_agent.inference.tensorrt.errors import TrtError
from fleet_protocol.codec import decode, encode
from fleet_protocol.messages import (
    ArtifactRef,
    Availability,
    CameraDesired,
    DesiredState,
    Event,
    InputSpec,
    Message,
    ModelManifest,
    ReportedState,
)
from fleet_protocol.signing import generate_private_key, public_key_b64, signed, signed_desired
from fleet_protocol.topics import TopicKind
from fleet_protocol.vision.preprocess import Preprocessor
from tests.support.fakes.ort import FakeSession
from tests.support.fakes.tensorrt import (
    FakeCudart,
    FakeEngine,
    FakeRuntime,
    FakeTensor,
    FakeTrt,
)
from tests.support.waiting import wait_for

KEY = EngineKey("a" * 64, "NVIDIA GeForce RTX 4090", "8.9", "10.3.0", "fp16")
TF_OD = ("num_detections:0", "detection_boxes:0", "detection_scores:0", "detection_classes:0")
SPEC = InputSpec(name="x", layout="NHWC", dtype="uint8", color="RGB", width=16, height=16)


# --------------------------------------------------------------------------- fakes


def tf_od_outputs(b: int, score: float = 0.9) -> dict[str, np.ndarray]:
    return {
        TF_OD[0]: np.ones((b,), np.float32),
        TF_OD[1]: np.tile(np.array([[[0.1, 0.1, 0.9, 0.9]]], np.float32), (b, 1, 1)),
        TF_OD[2]: np.full((b, 1), score, np.float32),
        TF_OD[3]: np.ones((b, 1), np.float32),
    }


def tf_od_runtime() -> FakeRuntime:
    """A fake TensorRT runtime whose engines answer like the bundled TF OD detector."""
    return FakeRuntime(outputs=lambda batch: tf_od_outputs(batch.shape[0]))


def tf_od_onnx(path: Path) -> Path:
    """A real ONNX model with TF-OD outputs for a [N,16,16,3] uint8 input: one 0.9 'person' box."""
    x = helper.make_tensor_value_info("x", TensorProto.UINT8, ["N", 16, 16, 3])
    outs = [
        helper.make_tensor_value_info(TF_OD[0], TensorProto.FLOAT, ["N"]),
        helper.make_tensor_value_info(TF_OD[1], TensorProto.FLOAT, ["N", 1, 4]),
        helper.make_tensor_value_info(TF_OD[2], TensorProto.FLOAT, ["N", 1]),
        helper.make_tensor_value_info(TF_OD[3], TensorProto.FLOAT, ["N", 1]),
    ]
    c = helper.make_tensor
    inits = [
        c("zero", TensorProto.FLOAT, [1], [0.0]),
        c("one", TensorProto.FLOAT, [1], [1.0]),
        c("score", TensorProto.FLOAT, [1], [0.9]),
        c("box", TensorProto.FLOAT, [1, 1, 4], [0.1, 0.1, 0.9, 0.9]),
    ]
    nodes = [
        helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMean", ["xf"], ["m"], axes=[1, 2, 3], keepdims=0),  # [N]
        helper.make_node("Mul", ["m", "zero"], ["z"]),  # zeros [N]
        helper.make_node("Add", ["z", "one"], [TF_OD[0]]),
        helper.make_node("Unsqueeze", ["z", "ax1"], ["z1"]),  # [N,1]
        helper.make_node("Add", ["z1", "score"], [TF_OD[2]]),
        helper.make_node("Add", ["z1", "one"], [TF_OD[3]]),
        helper.make_node("Unsqueeze", ["z1", "ax2"], ["z2"]),  # [N,1,1]
        helper.make_node("Add", ["z2", "box"], [TF_OD[1]]),
    ]
    inits += [c("ax1", TensorProto.INT64, [1], [1]), c("ax2", TensorProto.INT64, [1], [2])]
    graph = helper.make_graph(nodes, "tfod", [x], outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


# --------------------------------------------------------------------------- keys and cache


def test_the_cache_key_changes_with_every_component_and_is_a_safe_stable_file_name() -> None:
    variants = [
        KEY,
        replace(KEY, model_sha256="b" * 64),
        replace(KEY, gpu_name="NVIDIA GeForce RTX 3090"),
        replace(KEY, compute_capability="8.6"),
        replace(KEY, trt_version="10.4.0"),
        replace(KEY, precision="int8"),
        # Slug alike, yet different GPUs: the digest keeps them apart.
        replace(KEY, gpu_name="NVIDIA GeForce RTX/4090"),
    ]
    names = [k.file_name() for k in variants]
    assert len(set(names)) == len(names)
    assert KEY.file_name() == EngineKey(*KEY.__dict__.values()).file_name()  # stable
    hostile = EngineKey("../" * 30, "A/B\\C:*?<>| \x00 GPU" * 10, "../9.0", "10.0/../x", "fp16")
    for name in [*names, hostile.file_name()]:
        assert re.fullmatch(r"[a-z0-9.-]+\.engine", name), name
        assert ".." not in name and not name.startswith((".", "-"))
        assert len(name) < 160


def test_cache_stores_atomically_and_stays_within_its_size_bound(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "c", max_bytes=250)
    (tmp_path / "c" / f"{KEY.file_name()}.tmp123.4").write_bytes(b"half")  # a crash mid-write
    cache = EngineCache(tmp_path / "c", max_bytes=250)
    assert not list((tmp_path / "c").glob("*.tmp*"))
    keys = [replace(KEY, model_sha256=str(i) * 64) for i in range(3)]
    for i, k in enumerate(keys):
        cache.store(k, bytes([i]) * 100)
        time.sleep(0.01)  # distinct mtimes: "oldest" must be well defined
    assert cache.lookup(keys[0]) is None, "oldest evicted to stay under 250 bytes"
    assert cache.lookup(keys[1]) == b"\x01" * 100 and cache.lookup(keys[2]) == b"\x02" * 100
    assert cache.total_bytes() <= 250
    assert [e.reason for e in cache.evictions] == ["cache size bound"]
    assert not list((tmp_path / "c").glob("*.tmp*"))


# --------------------------------------------------------------------------- the factory


def factory(tmp_path: Path, runtime: FakeRuntime | None, **kw: Any) -> AutoBackendFactory:
    return AutoBackendFactory(
        engine=kw.pop("engine", "auto"),
        cache_dir=tmp_path / "trt_cache",
        threads=1,
        runtime=runtime,
        runtime_loader=lambda: (None, "ModuleNotFoundError: No module named 'tensorrt'"),
        available_providers=kw.pop("available", lambda: ["CPUExecutionProvider"]),
        **kw,
    )


def manifest_for(path: Path, name: str = "m") -> ModelManifest:
    blob = path.read_bytes()
    return ModelManifest(
        name=name,
        version="1",
        sha256=hashlib.sha256(blob).hexdigest(),
        size=len(blob),
        decoder="tf_od",
        input=SPEC,
        labels=["person"],
        decoder_params={"class_offset": 1},
    )


def test_a_cache_hit_skips_the_build(tmp_path: Path) -> None:
    rt = tf_od_runtime()
    model = tf_od_onnx(tmp_path / "m.onnx")
    notes: list[BuildNote] = []
    f = factory(tmp_path, rt)
    req = LoadRequest(variant="fp16", notify=notes.append)
    first = f.make(model, manifest_for(model), req)
    assert isinstance(first, TensorRtBackend) and first.provider == "TensorRT" and first.precision == "fp16"
    second = factory(tmp_path, rt).make(model, manifest_for(model), req)  # a restarted agent
    assert isinstance(second, TensorRtBackend)
    assert len(rt.builds) == 1
    assert [n.phase for n in notes] == [
        "started",
        "progress",
        "progress",
        "progress",
        "progress",
        "finished",
        "cached",
    ]
    out = second.run(np.zeros((2, 16, 16, 3), np.uint8))
    assert out[TF_OD[2]].shape == (2, 1)


def test_a_corrupt_cached_engine_is_evicted_reported_and_rebuilt(tmp_path: Path) -> None:
    rt = tf_od_runtime()
    model = tf_od_onnx(tmp_path / "m.onnx")
    man = manifest_for(model)
    f = factory(tmp_path, rt)
    f.make(model, man, LoadRequest(variant="fp16"))
    (engine_file,) = f.cache.entries()
    engine_file.write_bytes(b"\x00garbage from a bad sector")
    notes: list[BuildNote] = []
    backend = factory(tmp_path, rt).make(model, man, LoadRequest(variant="fp16", notify=notes.append))
    assert isinstance(backend, TensorRtBackend)
    assert len(rt.builds) == 2
    phases = [n.phase for n in notes]
    assert phases[0] == "evicted" and phases[1] == "started" and phases[-1] == "finished"
    assert "does not load" in notes[0].reason and "deserialize" in notes[0].reason
    assert engine_file.read_bytes().startswith(b"ENGINE:")


def test_int8_is_calibrated_on_camera_frames_through_the_models_preprocessor(tmp_path: Path) -> None:
    rt = tf_od_runtime()
    model = tf_od_onnx(tmp_path / "m.onnx")
    frames = [np.full((40, 60, 3), i, np.uint8) for i in range(5)]
    asked: list[int] = []

    def camera(n: int) -> list[np.ndarray]:
        asked.append(n)
        return frames

    f = factory(tmp_path, rt, precision="int8", calibration_frames=5)
    backend = f.make(model, manifest_for(model), LoadRequest(variant="fp16", calibration_frames=camera))
    assert isinstance(backend, TensorRtBackend) and backend.precision == "int8"
    (_, precision, calib) = rt.builds[0]
    assert precision == "int8" and asked == [5] and calib is not None
    expected = calibration_from_frames(frames, Preprocessor(SPEC))
    assert len(calib.batches) == 5 and calib.batches[0].shape == (1, 16, 16, 3)
    assert all(np.array_equal(a, b) for a, b in zip(calib.batches, expected.batches, strict=True))
    # A cache hit needs no calibration frames; an FP16 engine of the same model is another entry.
    f.make(model, manifest_for(model), LoadRequest(variant="fp16"))
    factory(tmp_path, rt).make(model, manifest_for(model), LoadRequest(variant="fp16"))
    assert [b[1] for b in rt.builds] == ["int8", "fp16"] and asked == [5]


def test_a_failed_build_falls_back_to_onnxruntime_cpu_with_the_reason(tmp_path: Path) -> None:
    rt = tf_od_runtime()
    rt.fail_with = "ONNX parser: unsupported operator NonMaxSuppression"
    model = tf_od_onnx(tmp_path / "m.onnx")
    notes: list[BuildNote] = []
    backend = factory(tmp_path, rt).make(model, manifest_for(model), LoadRequest(notify=notes.append))
    assert isinstance(backend, OnnxRuntimeBackend) and backend.provider == "CPUExecutionProvider"
    assert [n.phase for n in notes] == ["started", "failed", "fallback"]
    assert "NonMaxSuppression" in notes[1].reason and notes[2].provider == "CPUExecutionProvider"
    assert "NonMaxSuppression" in notes[2].reason
    assert backend.run(np.zeros((1, 16, 16, 3), np.uint8))[TF_OD[2]][0, 0] == pytest.approx(0.9)


def test_engine_tensorrt_without_tensorrt_reports_why_and_runs_on_onnxruntime(tmp_path: Path) -> None:
    model = tf_od_onnx(tmp_path / "m.onnx")
    notes: list[BuildNote] = []
    f = factory(tmp_path, None, engine="tensorrt")
    backend = f.make(model, manifest_for(model), LoadRequest(notify=notes.append))
    assert backend.provider == "CPUExecutionProvider"
    assert [n.phase for n in notes] == ["failed", "fallback"]
    assert "No module named 'tensorrt'" in notes[0].reason
    quiet: list[BuildNote] = []
    factory(tmp_path, None, engine="auto").make(model, manifest_for(model), LoadRequest(notify=quiet.append))
    assert quiet == [], "auto on a CPU device is the normal case, not a failure"


# --------------------------------------------------------------------------- providers


def ort_backend(
    tmp_path: Path, available: list[str], got: list[str], variant: str = "fp16"
) -> tuple[OnnxRuntimeBackend, list[dict[str, Any]]]:
    session = FakeSession(got)
    be = OnnxRuntimeBackend(
        tmp_path / "m.onnx",
        threads=1,
        trt_cache_dir=tmp_path / "ort_cache",
        fp16=variant == "fp16",
        available=available,
        session_factory=session,
    )
    return be, session.calls


ALL = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]


def test_tensorrt_ep_gets_the_engine_cache_and_fp16_flag(tmp_path: Path) -> None:
    be, calls = ort_backend(tmp_path, ALL, ALL)
    (trt, cuda, cpu) = calls[0]["providers"]
    assert trt[0] == "TensorrtExecutionProvider"
    opts = trt[1]
    assert opts["trt_engine_cache_enable"] == "True"
    assert opts["trt_engine_cache_path"] == str(tmp_path / "ort_cache")
    assert opts["trt_timing_cache_enable"] == "True"
    assert opts["trt_fp16_enable"] == "True" and opts["trt_int8_enable"] == "False"
    assert (tmp_path / "ort_cache").is_dir()
    assert cuda[0] == "CUDAExecutionProvider" and cuda[1]["cudnn_conv_algo_search"] == "HEURISTIC"
    assert cpu == "CPUExecutionProvider"
    assert be.provider == "TensorrtExecutionProvider" and be.fallback_reason is None
    _be32, calls32 = ort_backend(tmp_path, ALL, ALL, variant="fp32")
    assert calls32[0]["providers"][0][1]["trt_fp16_enable"] == "False"


def test_cuda_only_gets_cuda_and_cpu_only_gets_cpu(tmp_path: Path) -> None:
    be, calls = ort_backend(
        tmp_path, ["CUDAExecutionProvider", "CPUExecutionProvider"], ["CUDAExecutionProvider"]
    )
    assert [p[0] if isinstance(p, tuple) else p for p in calls[0]["providers"]] == [
        "CUDAExecutionProvider",
        "CPUExecutionProvider",
    ]
    assert be.provider == "CUDAExecutionProvider"
    be, calls = ort_backend(
        tmp_path, ["CPUExecutionProvider", "AzureExecutionProvider"], ["CPUExecutionProvider"]
    )
    assert calls[0]["providers"] == ["CPUExecutionProvider"] and be.provider == "CPUExecutionProvider"


def test_the_reported_provider_is_the_one_the_session_really_got(tmp_path: Path) -> None:
    # The TensorRT EP is listed but its libraries are missing: onnxruntime silently drops it.
    be, _ = ort_backend(tmp_path, ALL, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert be.provider == "CUDAExecutionProvider"
    assert be.fallback_reason == "asked for TensorrtExecutionProvider, onnxruntime gave CUDAExecutionProvider"
    notes: list[BuildNote] = []
    f = factory(
        tmp_path,
        None,
        engine="onnxruntime",
        available=lambda: ALL,
        session_factory=FakeSession(["CPUExecutionProvider"]),
    )
    backend = f.make(
        tmp_path / "m.onnx", manifest_for(tf_od_onnx(tmp_path / "m.onnx")), LoadRequest(notify=notes.append)
    )
    assert backend.provider == "CPUExecutionProvider"
    assert [(n.phase, n.provider) for n in notes] == [
        ("started", "TensorrtExecutionProvider"),
        ("finished", "CPUExecutionProvider"),
        ("fallback", "CPUExecutionProvider"),
    ]
    assert "gave CPUExecutionProvider" in notes[-1].reason


# --------------------------------------------------------------------------- the agent

CONTROLLER_KEY = generate_private_key()


class Transport:
    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.lock = threading.Lock()
        self.handlers: dict[TopicKind, Any] = {}
        self.connected = False

    def publish(self, kind: TopicKind, payload: bytes) -> bool:
        with self.lock:
            self.sent.append(decode(kind, payload))
        return True

    def on_message(self, kind: TopicKind, handler: Any) -> None:
        self.handlers[kind] = handler

    def on_chunk(self, handler: Any) -> None:
        pass

    def set_callbacks(self, *, birth: Callable[[], Availability], on_connected: Any, on_fatal: Any) -> None:
        self.birth, self.on_connected = birth, on_connected

    def start(self) -> None:
        self.connected = True
        self.publish(TopicKind.AVAILABILITY, encode(self.birth()))
        self.on_connected()

    def stop(self) -> None:
        self.connected = False

    def of(self, cls: type) -> list[Any]:
        with self.lock:
            return [m for m in self.sent if isinstance(m, cls)]


class Frames:
    fps: float | None = None

    def read(self) -> np.ndarray | None:
        time.sleep(0.01)
        return np.full((40, 60, 3), 50, np.uint8)

    def release(self) -> None:
        pass


def agent_settings(data_dir: Path) -> AgentSettings:
    return parse_settings(
        {
            "device_id": "dev-1",
            "data_dir": str(data_dir),
            "cameras": [CameraConfig(id="cam1", source="rtsp://fake").model_dump()],
            "outbox": {"batch_max_delay_s": 0.05},
            "artifact_public_key": public_key_b64(CONTROLLER_KEY.public_key()),
            "inference": {"threads": 1},
        },
        env={},
    )


def store_model(data_dir: Path, name: str) -> ModelManifest:
    """A real ONNX model in the agent's store; the name changes the bytes (and so the sha256)."""
    tmp = tf_od_onnx(data_dir / f"{name}.tmp.onnx")
    m = onnx.load(str(tmp))
    m.doc_string = name
    onnx.save(m, str(tmp))
    man = manifest_for(tmp, name)
    (data_dir / "models").mkdir(parents=True, exist_ok=True)
    tmp.rename(data_dir / "models" / f"{man.sha256}.onnx")
    return man


def desired(version: int, manifest: ModelManifest, variant: str = "fp16") -> DesiredState:
    ref = signed(ArtifactRef(manifest=manifest, variant=variant), CONTROLLER_KEY)
    state = DesiredState(
        version=version, issued_at=time.time(), device_id="dev-1", cameras={"cam1": CameraDesired(model=ref)}
    )
    return signed_desired(state, CONTROLLER_KEY)


@pytest.fixture
def agent_rt(tmp_path: Path) -> Iterator[tuple[Agent, Transport, FakeRuntime]]:
    data = tmp_path / "data"
    data.mkdir()
    rt = tf_od_runtime()
    t = Transport()
    agent = Agent.from_settings(
        agent_settings(data), transport=t, source_opener=lambda c: Frames(), trt_runtime=rt
    )
    agent.start()
    yield agent, t, rt
    if rt.gate is not None:
        rt.gate.set()
    agent.shutdown()


def builds(t: Transport) -> list[Event]:
    return [e for e in t.of(Event) if e.kind == "model_build"]


def frames_of(agent: Agent, model: str) -> int:
    last = agent.pipeline.last_result("cam1")
    return last.frame if last is not None and last.model == model else -1


def test_the_old_model_serves_throughout_a_build_that_fails_then_onnxruntime_takes_over(
    agent_rt: tuple[Agent, Transport, FakeRuntime],
) -> None:
    agent, t, rt = agent_rt
    old = store_model(agent.data_dir, "old")
    new = store_model(agent.data_dir, "new")
    agent.twin.accept(desired(1, old), persist=False)
    wait_for(lambda: frames_of(agent, "old:1") >= 0, what="old model serving")
    model = agent.pipeline.model_of("cam1")
    assert model is not None and model.backend.provider == "TensorRT"

    rt.gate = threading.Event()
    rt.fail_with = "out of GPU memory while building"
    agent.twin.accept(desired(2, new), persist=False)
    wait_for(lambda: len(rt.builds) == 2, what="the second build to start")
    wait_for(
        lambda: any(e.data["phase"] == "started" and e.data["model"] == "new:1" for e in builds(t)),
        what="build started event",
    )
    # While the build is held, the old model keeps producing detections frame after frame.
    seen = frames_of(agent, "old:1")
    wait_for(lambda: frames_of(agent, "old:1") >= seen + 5, what="old model detections during the build")
    rep = t.of(ReportedState)[-1].cameras["cam1"]
    assert rep.state == "loading" and rep.model == "new:1" and rep.progress_pct == 0.0
    assert agent.pipeline.model_of("cam1").key == "old:1"  # type: ignore[union-attr]
    rt.gate.set()

    wait_for(lambda: frames_of(agent, "new:1") >= 0, what="new model serving on onnxruntime")
    model = agent.pipeline.model_of("cam1")
    assert model is not None and model.backend.provider == "CPUExecutionProvider"
    wait_for(lambda: any(e.kind == "model_activate" and e.data["model"] == "new:1" for e in t.of(Event)))
    new_builds = [e for e in builds(t) if e.data["model"] == "new:1"]
    assert [e.data["phase"] for e in new_builds] == ["started", "failed", "fallback"]
    assert "out of GPU memory" in new_builds[1].data["reason"]
    assert new_builds[2].data["provider"] == "CPUExecutionProvider"
    assert new_builds[1].severity == "warning" and new_builds[0].camera == "cam1"
    activate = [e for e in t.of(Event) if e.kind == "model_activate"][-1]
    assert activate.data["provider"] == "CPUExecutionProvider"
    wait_for(lambda: (r := t.of(ReportedState)[-1].cameras["cam1"]).state == "running" and r.model == "new:1")


def test_model_build_events_arrive_in_order_with_progress_and_duration(
    agent_rt: tuple[Agent, Transport, FakeRuntime],
) -> None:
    agent, t, rt = agent_rt
    model = store_model(agent.data_dir, "m")
    agent.twin.accept(desired(1, model), persist=False)
    wait_for(lambda: any(e.kind == "model_activate" for e in t.of(Event)), what="activation")
    events = [e for e in t.of(Event) if e.kind in ("model_build", "model_activate")]
    assert [e.data.get("phase", e.kind) for e in events] == [
        "started",
        "progress",
        "progress",
        "progress",
        "progress",
        "finished",
        "model_activate",
    ]
    assert [e.data["pct"] for e in events[1:5]] == [25.0, 50.0, 75.0, 100.0]
    assert events[5].data["duration_s"] >= 0 and events[5].data["precision"] == "fp16"
    assert events[0].data["engine_file"].endswith(".engine")
    assert [e.seq for e in events] == sorted(e.seq for e in events)
    assert events[-1].data["provider"] == "TensorRT" and events[-1].data["precision"] == "fp16"
    loading = [r.cameras["cam1"] for r in t.of(ReportedState) if r.cameras["cam1"].state == "loading"]
    assert [r.progress_pct for r in loading if r.progress_pct] == [25.0, 50.0, 75.0, 100.0]
    assert len(rt.builds) == 1


# --------------------------------------------------------------------------- the real runtime, at a fake TensorRT 10
# TensorRtRuntime and _CudaEngine run for real against the fakes of TensorRT 10 and cuda-python
# (tests/support/fakes/tensorrt.py).


NHWC_DYNAMIC = [FakeTensor("x", (-1, 16, 16, 3))]


def fake_runtime(inputs: list[FakeTensor] = NHWC_DYNAMIC, version: str = "10.3.0") -> tuple[Any, FakeTrt]:
    from edge_agent.inference.tensorrt.runtime import TensorRtRuntime

    cudart = FakeCudart()
    trt = FakeTrt(cudart, inputs, version)
    return TensorRtRuntime(0, trt_module=trt, cudart_module=cudart), trt


def qdq_model(tmp_path: Path, name: str, **quant: Any) -> Path:
    """A small conv model quantized by onnxruntime's own quantize_static (the controller's tool)."""
    from onnx import numpy_helper
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        quantize_static,
    )

    rng = np.random.default_rng(0)
    src = tmp_path / "fp32.onnx"
    if not src.exists():
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])
        w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
        b = numpy_helper.from_array(rng.standard_normal((4,)).astype(np.float32), "b")
        nodes = [
            helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["y"]),
        ]
        model = helper.make_model(
            helper.make_graph(nodes, "g", [x], [y], [w, b]), opset_imports=[helper.make_opsetid("", 13)]
        )
        model.ir_version = 8
        onnx.save(model, str(src))
    if not quant:
        return src

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self.left = 4

        def get_next(self) -> dict[str, np.ndarray] | None:
            self.left -= 1
            return None if self.left < 0 else {"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)}

    dst = tmp_path / f"{name}.onnx"
    fmt = quant.pop("fmt", QuantFormat.QDQ)
    quantize_static(
        str(src),
        str(dst),
        Reader(),
        quant_format=fmt,
        per_channel=True,
        calibrate_method=CalibrationMethod.MinMax,
        **quant,
    )
    return dst


def test_the_precision_the_controller_chose_is_the_precision_built(tmp_path: Path) -> None:
    from edge_agent.inference.tensorrt.build_config import builder_flags, resolve_precision

    # fp32 is what the controller sends when FP16 was judged unfit: it must not turn into FP16.
    assert [resolve_precision(v) for v in ("fp32", "fp16", "int8", "something-new")] == [
        "fp32",
        "fp16",
        "int8",
        "fp32",
    ]
    assert resolve_precision("fp32", "fp16") == "fp16" and resolve_precision("int8", "fp32") == "fp32"
    rt, trt = fake_runtime()
    model = tf_od_onnx(tmp_path / "m.onnx")
    options = BuildOptions(max_batch=4, sample_shape=(16, 16, 3))
    plans = {p: rt.build_engine(model, p, None, options) for p in ("fp32", "fp16")}
    assert [c.flags for c in trt.configs] == [[], ["FP16"]]
    assert plans == {"fp32": b"PLAN:fp32", "fp16": b"PLAN:FP16"}
    assert builder_flags("int8") == ("INT8", "FP16") and builder_flags("fp32") == ()


def test_int8_calibration_on_a_dynamic_batch_reads_exactly_the_buffer_it_gets(tmp_path: Path) -> None:
    rt, trt = fake_runtime()
    model = tf_od_onnx(tmp_path / "m.onnx")
    calib = Calibration([np.full((1, 16, 16, 3), i, np.uint8) for i in range(3)])
    options = BuildOptions(max_batch=4, sample_shape=(16, 16, 3))
    assert rt.build_engine(model, "int8", calib, options) == b"PLAN:INT8+FP16"
    (config,) = trt.configs
    # Inference profile: batches 1..4, tuned for 1. Calibration profile: exactly the batches' shape.
    assert config.profiles[0].shapes["x"] == ((1, 16, 16, 3), (1, 16, 16, 3), (4, 16, 16, 3))
    assert config.calibration_profile is not None
    assert config.calibration_profile.shapes["x"] == ((1, 16, 16, 3),) * 3
    assert trt.calibration_reads == [((1, 16, 16, 3), 16 * 16 * 3)] * 3
    # Batches that do not fit the network are refused before TensorRT sees a pointer.
    bad = Calibration([np.zeros((1, 8, 8, 3), np.uint8)])
    with pytest.raises(TrtError, match="calibration batches are"):
        rt.build_engine(model, "int8", bad, options)
    with pytest.raises(TrtError, match="must be uint8"):
        rt.build_engine(model, "int8", Calibration([np.zeros((1, 16, 16, 3), np.float32)]), options)
    assert len(trt.calibration_reads) == 3


def test_a_static_model_calibrates_without_a_calibration_profile(tmp_path: Path) -> None:
    rt, trt = fake_runtime([FakeTensor("x", (2, 16, 16, 3))])
    calib = Calibration([np.zeros((2, 16, 16, 3), np.uint8)])
    rt.build_engine(
        tf_od_onnx(tmp_path / "m.onnx"), "int8", calib, BuildOptions(max_batch=4, sample_shape=(16, 16, 3))
    )
    (config,) = trt.configs
    assert config.profiles == [] and config.calibration_profile is None
    assert trt.calibration_reads == [((2, 16, 16, 3), 2 * 16 * 16 * 3)]


class FakeCudaEngine:
    """A deserialized engine whose detector ends in NonMaxSuppression: ``boxes`` is [-1, 4]."""

    def __init__(self, output_shape: tuple[int, ...]) -> None:
        self.output_shape = output_shape
        self.num_io_tensors = 2

    def get_tensor_name(self, i: int) -> str:
        return ["x", "boxes"][i]

    def get_tensor_mode(self, name: str) -> str:
        return "INPUT" if name == "x" else "OUTPUT"

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return (-1, 16, 16, 3) if name == "x" else (-1, *self.output_shape[1:])

    def get_tensor_dtype(self, name: str) -> str:
        return "UINT8" if name == "x" else "FLOAT"

    def get_tensor_profile_shape(self, name: str, profile: int) -> list[tuple[int, ...]]:
        return [(1, 16, 16, 3), (1, 16, 16, 3), (4, 16, 16, 3)]

    def create_execution_context(self) -> Any:
        engine = self

        class Ctx:
            input_shape: tuple[int, ...] | None = None

            def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
                self.input_shape = tuple(shape)
                return True

            def get_tensor_shape(self, name: str) -> tuple[int, ...]:
                assert self.input_shape is not None, "output shapes need the input shape first"
                return engine.output_shape

        return Ctx()


def test_data_dependent_outputs_are_refused_at_load_and_not_rebuilt(tmp_path: Path) -> None:
    from edge_agent.inference.tensorrt.backend import obtain_engine
    from edge_agent.inference.tensorrt.errors import UnsupportedEngine

    rt, trt = fake_runtime()
    trt.engine = FakeCudaEngine((-1, 4))
    with pytest.raises(UnsupportedEngine, match=r"output boxes has a data-dependent shape \(-1, 4\)"):
        rt.load_engine(b"PLAN")
    trt.engine = FakeCudaEngine((4, 100, 4))  # batch-dependent only: fine
    engine = rt.load_engine(b"PLAN")
    assert engine.dynamic_batch and engine.input_name == "x"

    class NmsRuntime(FakeRuntime):
        def load_engine(self, data: bytes) -> FakeEngine:
            raise UnsupportedEngine("output boxes has a data-dependent shape (-1, 4)")

    nms = NmsRuntime()
    cache = EngineCache(tmp_path / "engines")
    model = tf_od_onnx(tmp_path / "m.onnx")
    for _ in range(2):  # a build, then a restart: no eviction, no second build
        with pytest.raises(UnsupportedEngine):
            obtain_engine(nms, cache, model, KEY)
    assert len(nms.builds) == 1 and cache.lookup(KEY) is not None and cache.evictions == []
    # The agent's factory falls back to onnxruntime with the reason, and does not rebuild either.
    notes: list[BuildNote] = []
    for _ in range(2):
        backend = factory(tmp_path, nms).make(model, manifest_for(model), LoadRequest(notify=notes.append))
        assert isinstance(backend, OnnxRuntimeBackend)
    assert len(nms.builds) == 2  # one per model key (the factory's key differs from KEY)
    assert any("data-dependent" in n.reason for n in notes if n.phase == "fallback")


def test_the_key_covers_profile_batch_and_builder_flags() -> None:
    rt = tf_od_runtime()
    base = BuildOptions(max_batch=4, sample_shape=(320, 320, 3))
    key = EngineKey.for_build(rt, "a" * 64, "fp16", base)
    changed = [
        EngineKey.for_build(rt, "a" * 64, "fp16", replace(base, max_batch=1)),
        EngineKey.for_build(rt, "a" * 64, "fp16", replace(base, opt_batch=4)),
        EngineKey.for_build(rt, "a" * 64, "fp16", replace(base, sample_shape=(416, 416, 3))),
        EngineKey.for_build(rt, "a" * 64, "fp16", replace(base, workspace_mb=512)),
        EngineKey.for_build(rt, "a" * 64, "fp16", replace(base, builder_optimization_level=1)),
        EngineKey.for_build(rt, "a" * 64, "fp32", base),
        EngineKey.for_build(rt, "a" * 64, "int8", base),
        EngineKey.for_build(rt, "a" * 64, "int8", base, calibrated=True),
    ]
    names = {key.file_name(), *(k.file_name() for k in changed)}
    assert len(names) == 1 + len(changed)
    # How a build runs (progress, cancel, timing cache) is not what it builds.
    same = replace(base, progress=lambda pct: None, cancel=threading.Event(), timing_cache=Path("/t.cache"))
    assert EngineKey.for_build(rt, "a" * 64, "fp16", same) == key
    # opt_batch is clamped like the profile: above max_batch it is max_batch.
    assert EngineKey.for_build(rt, "a" * 64, "fp16", replace(base, opt_batch=9)) == EngineKey.for_build(
        rt, "a" * 64, "fp16", replace(base, opt_batch=4)
    )
    # Jetson modules share a name and compute capability: the device details tell them apart.
    nano, agx = tf_od_runtime(), tf_od_runtime()
    nano.device_fingerprint, agx.device_fingerprint = "sm8-7620MiB", "sm16-62800MiB"  # type: ignore[attr-defined]
    assert EngineKey.for_build(nano, "a" * 64, "fp16", base) != EngineKey.for_build(
        agx, "a" * 64, "fp16", base
    )
    # A key made the old way (no build fingerprint) keeps its old file name: old caches stay valid.
    assert KEY.build == "" and KEY.file_name().endswith(
        hashlib.sha256("\x1f".join(("a" * 64, KEY.gpu_name, "8.9", "10.3.0", "fp16")).encode()).hexdigest()[
            :16
        ]
        + ".engine"
    )


def test_a_max_batch_change_builds_a_new_engine_instead_of_reusing_one_that_rejects_batches(
    tmp_path: Path,
) -> None:
    from edge_agent.inference.tensorrt.backend import obtain_engine

    rt = tf_od_runtime()
    cache = EngineCache(tmp_path / "engines")
    model = tf_od_onnx(tmp_path / "m.onnx")
    for max_batch in (1, 4, 1):
        options = BuildOptions(max_batch=max_batch, sample_shape=(16, 16, 3))
        obtain_engine(rt, cache, model, EngineKey.for_build(rt, "a" * 64, "fp16", options), options=options)
    assert len(rt.builds) == 2 and len(cache.entries()) == 2


def test_explicit_profiles_for_both_engines_from_the_manifest(tmp_path: Path) -> None:
    from edge_agent.inference.tensorrt.build_config import (
        InputProfile,
        onnx_input_shapes,
        optimization_profile,
        ort_trt_profile_options,
        ort_trt_profile_options_for,
    )
    from edge_agent.inference.tensorrt.errors import ProfileNotExpressible

    # ped_ssdlite-like: [?, ?, ?, 3]; the manifest says 300x300; the pipeline batches up to 4 cameras.
    profiles = optimization_profile({"images": (None, "h", -1, 3)}, sample_shape=(300, 300, 3), max_batch=4)
    assert profiles == [InputProfile("images", (1, 300, 300, 3), (1, 300, 300, 3), (4, 300, 300, 3))]
    assert ort_trt_profile_options(profiles) == {
        "trt_profile_min_shapes": "images:1x300x300x3",
        "trt_profile_opt_shapes": "images:1x300x300x3",
        "trt_profile_max_shapes": "images:4x300x300x3",
    }
    two = optimization_profile(
        {"images": ("N", 3, 320, 320)}, sample_shape=(3, 320, 320), max_batch=4, opt_batch=2
    )
    assert two[0].opt == (2, 3, 320, 320)
    assert optimization_profile({"images": (1, 3, 416, 416)}, sample_shape=(3, 416, 416), max_batch=4) == []
    assert ort_trt_profile_options([]) == {}
    assert optimization_profile({"x": (2, -1, 8, 3)}, sample_shape=(8, 8, 3), max_batch=4)[0].max == (
        2,
        8,
        8,
        3,
    )
    with pytest.raises(TrtError, match="manifest"):
        optimization_profile({"x": (-1, 3, 320, 320)}, sample_shape=(3, 416, 416), max_batch=4)
    with pytest.raises(TrtError, match="sample shape"):
        optimization_profile({"x": (-1, -1, -1, 3)}, sample_shape=None, max_batch=4)
    # onnxruntime splits the option at ':' and ',': a TF input name cannot be expressed.
    tf = optimization_profile({"image_tensor:0": (-1, -1, -1, 3)}, sample_shape=(300, 300, 3), max_batch=4)
    with pytest.raises(ProfileNotExpressible, match="image_tensor:0"):
        ort_trt_profile_options(tf)
    # From a model file: the dynamic batch of the TF-OD test model.
    model = tf_od_onnx(tmp_path / "m.onnx")
    assert onnx_input_shapes(model) == {"x": ("N", 16, 16, 3)}
    assert (
        ort_trt_profile_options_for(model, sample_shape=(16, 16, 3), max_batch=4)["trt_profile_max_shapes"]
        == "x:4x16x16x3"
    )
    # The native builder uses the very same profile.
    rt, trt = fake_runtime([FakeTensor("images", (-1, -1, -1, 3))])
    rt.build_engine(model, "fp16", None, BuildOptions(max_batch=4, sample_shape=(300, 300, 3)))
    assert trt.configs[0].profiles[0].shapes["images"] == (profiles[0].min, profiles[0].opt, profiles[0].max)


def test_gpu_int8_only_as_symmetric_qdq_tensorrt_accepts(tmp_path: Path) -> None:
    from onnxruntime.quantization import QuantFormat, QuantType

    from edge_agent.inference.tensorrt.build_config import int8_qdq_problem

    s8 = {"activation_type": QuantType.QInt8, "weight_type": QuantType.QInt8}
    ok = qdq_model(
        tmp_path,
        "trt",
        **s8,
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False},
    )
    assert int8_qdq_problem(ok) is None
    refused = {
        # What the controller's CPU variants are (controller/registry/variants.py): U8S8, QDQ or QOperator.
        "u8s8 qdq": (
            qdq_model(
                tmp_path,
                "u8",
                activation_type=QuantType.QUInt8,
                weight_type=QuantType.QInt8,
                extra_options={"QuantizeBias": False},
            ),
            "UINT8",
        ),
        "qoperator": (
            qdq_model(
                tmp_path,
                "qop",
                fmt=QuantFormat.QOperator,
                activation_type=QuantType.QUInt8,
                weight_type=QuantType.QInt8,
            ),
            "QLinearConv",
        ),
        "asymmetric s8": (qdq_model(tmp_path, "asym", **s8, extra_options={"QuantizeBias": False}), "not 0"),
        "int32 bias": (
            qdq_model(
                tmp_path, "bias", **s8, extra_options={"ActivationSymmetric": True, "WeightSymmetric": True}
            ),
            "INT32",
        ),
        "no q/dq": (qdq_model(tmp_path, "fp32"), "no QuantizeLinear"),
    }
    for what, (path, reason) in refused.items():
        problem = int8_qdq_problem(path)
        assert problem is not None and reason in problem, (what, problem)
    # The native build refuses before TensorRT parses anything (no calibration: Q/DQ is the only way).
    rt, trt = fake_runtime([FakeTensor("x", (-1, 3, 8, 8), "FLOAT")])
    with pytest.raises(TrtError, match=r"INT8 on TensorRT refused: .*UINT8"):
        rt.build_engine(
            refused["u8s8 qdq"][0], "int8", None, BuildOptions(max_batch=1, sample_shape=(3, 8, 8))
        )
    assert trt.parsed == []
    assert (
        rt.build_engine(ok, "int8", None, BuildOptions(max_batch=1, sample_shape=(3, 8, 8)))
        == b"PLAN:INT8+FP16"
    )


def test_the_timing_cache_carries_over_between_builds(tmp_path: Path) -> None:
    from edge_agent.inference.tensorrt.cache import timing_cache_path

    rt, trt = fake_runtime()
    model = tf_od_onnx(tmp_path / "m.onnx")
    key = EngineKey.for_build(rt, "a" * 64, "fp16", BuildOptions())
    path = timing_cache_path(tmp_path / "engines", key)
    assert path.parent == tmp_path / "engines" and "orin" in path.name and "trt10.3.0" in path.name
    path.parent.mkdir()
    options = BuildOptions(
        max_batch=4, sample_shape=(16, 16, 3), timing_cache=path, builder_optimization_level=2
    )
    rt.build_engine(model, "fp16", None, options)
    assert trt.configs[0].created_timing == [b""] and path.read_bytes() == b"TIMING:1"
    rt.build_engine(model, "fp16", None, options)  # the next build starts from the first one's timings
    assert trt.configs[1].created_timing == [b"TIMING:1"] and path.read_bytes() == b"TIMING:2"
    assert trt.configs[1].builder_optimization_level == 2
    assert trt.configs[1].pools == {"WORKSPACE": 1024 * 2**20}
    assert not list(path.parent.glob("*.tmp*"))


def test_build_progress_reaches_the_caller_and_cancel_stops_the_build(tmp_path: Path) -> None:
    from edge_agent.inference.tensorrt.errors import BuildCancelled

    rt, _ = fake_runtime()
    model = tf_od_onnx(tmp_path / "m.onnx")
    seen: list[float] = []
    rt.build_engine(
        model, "fp16", None, BuildOptions(max_batch=1, sample_shape=(16, 16, 3), progress=seen.append)
    )
    assert seen == [50.0, 100.0]
    stop = threading.Event()
    stop.set()
    with pytest.raises(BuildCancelled):
        rt.build_engine(model, "fp16", None, BuildOptions(max_batch=1, sample_shape=(16, 16, 3), cancel=stop))


def test_the_native_path_refuses_a_tensorrt_it_was_not_written_for() -> None:
    for version in ("11.1.0", "8.6.1"):
        with pytest.raises(TrtError, match=f"TensorRT {version} is installed"):
            fake_runtime(version=version)
    rt, _ = fake_runtime(version="10.13.2.6")
    assert rt.gpu_name == "Orin" and rt.compute_capability == "8.7" and rt.device_fingerprint == "sm8-8192MiB"
