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
from edge_agent.backends import (
    AutoBackendFactory,
    BuildNote,
    LoadRequest,
    OnnxRuntimeBackend,
)
from edge_agent.preprocess import Preprocessor
from edge_agent.settings import AgentSettings, CameraConfig, parse_settings
from edge_agent.trt import (
    BuildOptions,
    Calibration,
    EngineCache,
    EngineKey,
    Precision,
    TensorRtBackend,
    TrtError,
    calibration_from_frames,
)
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
from fleet_protocol.signing import generate_private_key, public_key_b64, signed
from fleet_protocol.topics import TopicKind

KEY = EngineKey("a" * 64, "NVIDIA GeForce RTX 4090", "8.9", "10.3.0", "fp16")
TF_OD = ("num_detections:0", "detection_boxes:0", "detection_scores:0", "detection_classes:0")
SPEC = InputSpec(name="x", layout="NHWC", dtype="uint8", color="RGB", width=16, height=16)


def wait_for(pred: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


# --------------------------------------------------------------------------- fakes


def tf_od_outputs(b: int, score: float = 0.9) -> dict[str, np.ndarray]:
    return {
        TF_OD[0]: np.ones((b,), np.float32),
        TF_OD[1]: np.tile(np.array([[[0.1, 0.1, 0.9, 0.9]]], np.float32), (b, 1, 1)),
        TF_OD[2]: np.full((b, 1), score, np.float32),
        TF_OD[3]: np.ones((b, 1), np.float32),
    }


class FakeEngine:
    input_name = "x"
    input_shape: tuple[int | str | None, ...] = (None, 16, 16, 3)
    dynamic_batch = True

    def __init__(self, tag: bytes) -> None:
        self.tag = tag
        self.runs = 0

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        self.runs += 1
        return tf_od_outputs(batch.shape[0])

    def close(self) -> None:
        pass


class FakeRuntime:
    """Counts builds; engines are b"ENGINE:<onnx name>:<precision>"; anything else does not load."""

    version = "10.3.0"
    gpu_name = "NVIDIA Jetson Orin"
    compute_capability = "8.7"

    def __init__(self) -> None:
        self.builds: list[tuple[str, Precision, Calibration | None]] = []
        self.gate: threading.Event | None = None  # when set up, builds wait for it
        self.fail_with: str | None = None
        self.progress_steps = (25.0, 50.0, 75.0, 100.0)

    def build_engine(
        self, onnx_path: Path, precision: Precision, calib: Calibration | None, options: BuildOptions
    ) -> bytes:
        self.builds.append((onnx_path.name, precision, calib))
        if self.gate is not None:
            assert self.gate.wait(30), "test gate never opened"
        if self.fail_with:
            raise TrtError(self.fail_with)
        for pct in self.progress_steps:
            if options.progress:
                options.progress(pct)
        return f"ENGINE:{onnx_path.name}:{precision}".encode()

    def load_engine(self, data: bytes) -> FakeEngine:
        if not data.startswith(b"ENGINE:"):
            raise TrtError("deserialize_cuda_engine returned None")
        return FakeEngine(data)


class FakeSession:
    """An onnxruntime session that got ``got`` out of the providers it was asked for."""

    def __init__(self, got: list[str], calls: list[dict[str, Any]]) -> None:
        self.got = got
        self.calls = calls

    def __call__(self, path: str, *, sess_options: Any, providers: list[Any]) -> FakeSession:
        self.calls.append({"path": path, "providers": providers})
        return self

    def get_providers(self) -> list[str]:
        return self.got

    def get_inputs(self) -> list[Any]:
        class Input:
            name = "x"
            shape = ["N", 3]

        return [Input()]

    def get_outputs(self) -> list[Any]:
        class Output:
            name = "y"

        return [Output()]


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
    rt = FakeRuntime()
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
    rt = FakeRuntime()
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
    rt = FakeRuntime()
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
    rt = FakeRuntime()
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
    calls: list[dict[str, Any]] = []
    be = OnnxRuntimeBackend(
        tmp_path / "m.onnx",
        threads=1,
        trt_cache_dir=tmp_path / "ort_cache",
        fp16=variant == "fp16",
        available=available,
        session_factory=FakeSession(got, calls),
    )
    return be, calls


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
    assert (cuda, cpu) == ("CUDAExecutionProvider", "CPUExecutionProvider")
    assert be.provider == "TensorrtExecutionProvider" and be.fallback_reason is None
    _be32, calls32 = ort_backend(tmp_path, ALL, ALL, variant="fp32")
    assert calls32[0]["providers"][0][1]["trt_fp16_enable"] == "False"


def test_cuda_only_gets_cuda_and_cpu_only_gets_cpu(tmp_path: Path) -> None:
    be, calls = ort_backend(
        tmp_path, ["CUDAExecutionProvider", "CPUExecutionProvider"], ["CUDAExecutionProvider"]
    )
    assert calls[0]["providers"] == ["CUDAExecutionProvider", "CPUExecutionProvider"]
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
    calls: list[dict[str, Any]] = []
    f = factory(
        tmp_path,
        None,
        engine="onnxruntime",
        available=lambda: ALL,
        session_factory=FakeSession(["CPUExecutionProvider"], calls),
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
    return DesiredState(version=version, issued_at=time.time(), cameras={"cam1": CameraDesired(model=ref)})


@pytest.fixture
def agent_rt(tmp_path: Path) -> Iterator[tuple[Agent, Transport, FakeRuntime]]:
    data = tmp_path / "data"
    data.mkdir()
    rt = FakeRuntime()
    t = Transport()
    agent = Agent(agent_settings(data), transport=t, source_opener=lambda c: Frames(), trt_runtime=rt)
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
    agent._accept_desired(desired(1, old), persist=False)
    wait_for(lambda: frames_of(agent, "old:1") >= 0, what="old model serving")
    model = agent.pipeline.model_of("cam1")
    assert model is not None and model.backend.provider == "TensorRT"

    rt.gate = threading.Event()
    rt.fail_with = "out of GPU memory while building"
    agent._accept_desired(desired(2, new), persist=False)
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
    agent._accept_desired(desired(1, model), persist=False)
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
