"""The model-load path wired to out-of-process engine builds.

No GPU and no TensorRT here: a fake of ``ChildProcessBuilds`` stands in for the build process (it writes what
the child would publish and reports progress), a fake runtime for TensorRT, a fake session for
onnxruntime's GPU providers. The seams are the factory's ``builds``, ``runtime`` and
``session_factory`` arguments.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from edge_agent.core.settings import parse_settings
from edge_agent.inference.backend import BackendError
from edge_agent.inference.engine_build import (
    BuildFailed,
    BuildProgress,
    BuildRequest,
    BuildResult,
    BuildTimedOut,
    ChildProcessBuilds,
    ort_engines_ready,
)
from edge_agent.inference.factory import (
    AutoBackendFactory,
    BuildNote,
    GuardedTensorRtBackend,
    InProcessBuilds,
    LoadRequest,
)
from edge_agent.inference.ort import OnnxRuntimeBackend
from edge_agent.inference.tensorrt.errors import BuildCancelled
from fleet_protocol.messages import InputSpec, ModelManifest
from tests.support.fakes.ort import FakeSession
from tests.support.fakes.tensorrt import FakeRuntime

TRT, CUDA, CPU = "TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"
ALL = [TRT, CUDA, CPU]


# --------------------------------------------------------------------------- fakes


class FakeHandle:
    def __init__(self, request: BuildRequest, error: Exception | None) -> None:
        self.request = request
        self.error = error

    def result(self, timeout: float | None = None) -> BuildResult:
        if self.error is not None:
            raise self.error
        return BuildResult(self.request.build_id, [], 0.1, {})


class FakeSupervisor:
    """What the build process would do, done at once: a native build publishes
    ``ENGINE:<precision>`` under the engine file name, an onnxruntime build writes its marker;
    progress events as the real supervisor forwards them (spawned, building %, succeeded)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.started: list[tuple[BuildRequest, threading.Event | None]] = []
        self.cancelled: list[str] = []

    def start(
        self,
        request: BuildRequest,
        *,
        on_progress: Callable[[BuildProgress], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> FakeHandle:
        self.started.append((request, cancel))
        emit = on_progress or (lambda e: None)
        emit(BuildProgress("spawned", None, "build process 4242"))
        emit(BuildProgress("starting", 0.0))
        if self.error is None:
            for pct in (10.0, 60.0, 100.0):
                emit(BuildProgress("building", pct))
            emit(BuildProgress("building", None, "no pct: not a progress note"))
            if request.engine_file:
                (request.target_dir / request.engine_file).write_bytes(f"ENGINE:{request.precision}".encode())
            if request.marker:
                request.target_dir.mkdir(parents=True, exist_ok=True)
                (request.target_dir / "model.engine").write_bytes(b"ort engine")
                (request.target_dir / request.marker).write_text("{}")
            emit(BuildProgress("succeeded", 100.0))
        else:
            emit(BuildProgress("failed", None, str(self.error)))
        return FakeHandle(request, self.error)

    def cancel_all(self, reason: str = "cancelled", wait_s: float | None = None) -> None:
        self.cancelled.append(reason)

    def native(self) -> list[BuildRequest]:
        return [r for r, _ in self.started if r.engine_file]

    def ort(self) -> list[BuildRequest]:
        return [r for r, _ in self.started if r.marker]


def model(tmp_path: Path, input_name: str = "x", batch: int | str = "N", name: str = "m.onnx") -> Path:
    x = helper.make_tensor_value_info(input_name, TensorProto.UINT8, [batch, 16, 16, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 16, 16, 3])
    graph = helper.make_graph(
        [helper.make_node("Cast", [input_name], ["y"], to=TensorProto.FLOAT)], "g", [x], [y]
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    path = tmp_path / name
    onnx.save(m, str(path))
    return path


def qoperator_model(tmp_path: Path) -> Path:
    """A U8S8 QOperator model as the CPU int8 variant is (QLinearConv): what TensorRT cannot take."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])
    c = helper.make_tensor
    inits = [
        c("s", TensorProto.FLOAT, [], [0.02]),
        c("zp_u8", TensorProto.UINT8, [], [128]),
        c("w", TensorProto.INT8, [4, 3, 1, 1], [1] * 12),
        c("ws", TensorProto.FLOAT, [], [0.01]),
        c("wzp", TensorProto.INT8, [], [0]),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "zp_u8"], ["xq"]),
        helper.make_node("QLinearConv", ["xq", "s", "zp_u8", "w", "ws", "wzp", "s", "zp_u8"], ["yq"]),
        helper.make_node("DequantizeLinear", ["yq", "s", "zp_u8"], ["y"]),
    ]
    m = helper.make_model(
        helper.make_graph(nodes, "q", [x], [y], inits), opset_imports=[helper.make_opsetid("", 13)]
    )
    m.ir_version = 8
    path = tmp_path / "int8.onnx"
    onnx.save(m, str(path))
    return path


def manifest_for(path: Path) -> ModelManifest:
    blob = path.read_bytes()
    return ModelManifest(
        name="m",
        version="1",
        sha256=hashlib.sha256(blob).hexdigest(),
        size=len(blob),
        decoder="tf_od",
        input=InputSpec(name="x", layout="NHWC", dtype="uint8", color="RGB", width=16, height=16),
        labels=["person"],
    )


def make_factory(
    tmp_path: Path,
    sup: FakeSupervisor,
    *,
    runtime: FakeRuntime | None = None,
    session: FakeSession | None = None,
    available: list[str] | None = None,
    **kw: Any,
) -> AutoBackendFactory:
    return AutoBackendFactory(
        engine=kw.pop("engine", "auto"),
        cache_dir=tmp_path / "trt_cache",
        threads=1,
        runtime=runtime,
        runtime_loader=lambda: (None, "ModuleNotFoundError: No module named 'tensorrt'"),
        available_providers=lambda: available or [CPU],
        session_factory=session,
        builds=sup,
        **kw,
    )


# --------------------------------------------------------------------------- precision and key


def test_the_fp32_variant_requests_an_fp32_build_not_fp16(tmp_path: Path) -> None:
    path = model(tmp_path)
    sup = FakeSupervisor()
    f = make_factory(tmp_path, sup, runtime=FakeRuntime(builds_here=False))
    be32 = f.make(path, manifest_for(path), LoadRequest(variant="fp32"))
    be16 = f.make(path, manifest_for(path), LoadRequest(variant="fp16"))
    assert [r.precision for r in sup.native()] == ["fp32", "fp16"]
    assert isinstance(be32, GuardedTensorRtBackend) and be32.precision == "fp32"
    assert isinstance(be16, GuardedTensorRtBackend) and be16.precision == "fp16"
    assert "-fp32-" in sup.native()[0].engine_file and "-fp16-" in sup.native()[1].engine_file
    # inference.trt_precision still wins when it names a precision.
    forced = make_factory(
        tmp_path / "forced", FakeSupervisor(), runtime=FakeRuntime(builds_here=False), precision="fp16"
    )
    assert forced.make(path, manifest_for(path), LoadRequest(variant="fp32")).precision == "fp16"  # type: ignore[attr-defined]


def test_the_engine_key_differs_with_max_batch_and_precision(tmp_path: Path) -> None:
    path = model(tmp_path)
    man = manifest_for(path)
    files: dict[tuple[int, str], str] = {}
    for max_batch in (1, 4):
        for variant in ("fp32", "fp16"):
            sup = FakeSupervisor()
            make_factory(tmp_path, sup, runtime=FakeRuntime(builds_here=False), max_batch=max_batch).make(
                path, man, LoadRequest(variant=variant)
            )
            (req,) = sup.native()
            files[(max_batch, variant)] = req.engine_file
            assert req.options.max_batch == max_batch and req.options.sample_shape == (16, 16, 3)
    assert len(set(files.values())) == 4, files
    # The same settings find their engine in the cache: no second build.
    sup = FakeSupervisor()
    be = make_factory(tmp_path, sup, runtime=FakeRuntime(builds_here=False), max_batch=4).make(
        path, man, LoadRequest(variant="fp16")
    )
    assert sup.started == [] and isinstance(be, GuardedTensorRtBackend)


# --------------------------------------------------------------------------- native builds out of process


def test_a_native_build_goes_through_the_supervisor_and_its_progress_becomes_build_notes(
    tmp_path: Path,
) -> None:
    path = model(tmp_path)
    sup = FakeSupervisor()
    rt = FakeRuntime(builds_here=False)
    rt.device = 1
    stop = threading.Event()
    notes: list[BuildNote] = []
    f = make_factory(tmp_path, sup, runtime=rt, max_batch=4)
    be = f.make(path, manifest_for(path), LoadRequest(variant="fp16", notify=notes.append, cancel=stop))
    ((req, cancel),) = sup.started
    assert cancel is stop, "the agent's stop event cancels the build process"
    assert req.builder.endswith(":native_builder") and req.device == 1 and req.onnx_path == path
    assert req.target_dir == f.cache.dir and req.calibration is None
    assert req.options.progress is None and req.options.cancel is None, "nothing unpicklable crosses"
    assert [n.phase for n in notes] == ["started", "progress", "progress", "progress", "finished"]
    assert [n.pct for n in notes if n.phase == "progress"] == [10.0, 60.0, 100.0]
    assert all(n.engine_file == req.engine_file and n.precision == "fp16" for n in notes)
    assert isinstance(be, GuardedTensorRtBackend) and be.provider == "TensorRT"
    assert be.run(np.zeros((2, 16, 16, 3), np.uint8))["y"].shape == (2, 1)


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (BuildFailed("TrtError: out of GPU memory while building"), "out of GPU memory"),
        (BuildTimedOut("engine build exceeded its time bound of 1200 s and was stopped"), "time bound"),
        # A sticky CUDA error in the build process killed that process's context, not this one's.
        (BuildFailed("TrtError: CUDA error: cudaError_t.cudaErrorIllegalAddress"), "cudaErrorIllegalAddress"),
    ],
)
def test_a_failed_or_timed_out_build_falls_back_to_onnxruntime_with_the_reason(
    tmp_path: Path, error: Exception, words: str
) -> None:
    path = model(tmp_path)
    notes: list[BuildNote] = []
    f = make_factory(
        tmp_path, FakeSupervisor(error), runtime=FakeRuntime(builds_here=False), session=FakeSession()
    )
    be = f.make(path, manifest_for(path), LoadRequest(variant="fp16", notify=notes.append))
    assert isinstance(be, OnnxRuntimeBackend) and be.provider == CPU
    assert [n.phase for n in notes] == ["started", "failed", "fallback"]
    assert words in notes[1].reason and words in notes[2].reason
    assert type(error).__name__ in notes[1].reason and notes[1].engine_file and notes[1].precision == "fp16"
    assert not f.cache.entries(), "nothing half-built in the cache"


def test_a_cancelled_build_ends_the_load_without_falling_back(tmp_path: Path) -> None:
    path = model(tmp_path)
    session = FakeSession()
    f = make_factory(
        tmp_path,
        FakeSupervisor(BuildCancelled("engine build cancelled")),
        runtime=FakeRuntime(builds_here=False),
        session=session,
    )
    with pytest.raises(BackendError, match="cancelled"):
        f.make(path, manifest_for(path), LoadRequest(variant="fp16"))
    assert session.calls == []


def test_close_cancels_the_running_builds(tmp_path: Path) -> None:
    sup = FakeSupervisor()
    f = make_factory(tmp_path, sup)
    f.close()
    assert sup.cancelled and "stopping" in sup.cancelled[0]


BASE = {"device_id": "dev-1", "data_dir": "/tmp/edgefleet-unused"}


def test_the_default_supervisor_takes_the_build_time_bound_from_the_settings(tmp_path: Path) -> None:
    s = parse_settings({**BASE, "inference": {"trt_build_timeout_s": 90}}, env={})
    assert s.inference.trt_build_timeout_s == 90.0
    assert parse_settings(BASE, env={}).inference.trt_build_timeout_s == 1200.0
    with pytest.raises(Exception, match="trt_build_timeout_s"):
        parse_settings({**BASE, "inference": {"trt_build_timeout_s": 0}}, env={})
    f = AutoBackendFactory(engine="auto", cache_dir=tmp_path, build_timeout_s=s.inference.trt_build_timeout_s)
    assert isinstance(f.builds, ChildProcessBuilds) and f.builds.timeout_s == 90.0
    # A runtime passed in lives in this process: a build process could not use it.
    g = AutoBackendFactory(engine="auto", cache_dir=tmp_path, runtime=FakeRuntime(builds_here=False))  # type: ignore[arg-type]
    assert isinstance(g.builds, InProcessBuilds)
    with pytest.raises(ValueError):
        AutoBackendFactory(engine="auto", cache_dir=tmp_path, build_timeout_s=0)


# --------------------------------------------------------------------------- int8 variants TensorRT cannot take


@pytest.mark.parametrize("engine", ["auto", "tensorrt", "onnxruntime"])
def test_an_int8_qoperator_model_never_reaches_tensorrt_and_the_reason_is_reported(
    tmp_path: Path, engine: str
) -> None:
    path = qoperator_model(tmp_path)
    sup = FakeSupervisor()
    session = FakeSession()
    notes: list[BuildNote] = []
    f = make_factory(
        tmp_path, sup, runtime=FakeRuntime(builds_here=False), session=session, available=ALL, engine=engine
    )
    be = f.make(path, manifest_for(path), LoadRequest(variant="int8", notify=notes.append))
    assert sup.started == [], "no native build and no TensorRT EP build"
    assert session.provider_names() == [CUDA, CPU] and be.provider == CUDA
    assert all(
        "trt_int8_enable" not in (p[1] if isinstance(p, tuple) else {}) for p in session.calls[0]["providers"]
    )
    (note,) = notes
    assert note.phase == "fallback" and note.provider == CUDA
    assert "QOperator" in note.reason and "QLinearConv" in note.reason


# --------------------------------------------------------------------------- onnxruntime's TensorRT EP


def test_the_tensorrt_ep_gets_explicit_profile_shapes_and_builds_out_of_process(tmp_path: Path) -> None:
    path = model(tmp_path)
    sup = FakeSupervisor()
    session = FakeSession()
    notes: list[BuildNote] = []
    f = make_factory(
        tmp_path, sup, session=session, available=ALL, engine="onnxruntime", max_batch=4, precision="fp16"
    )
    stop = threading.Event()
    be = f.make(path, manifest_for(path), LoadRequest(notify=notes.append, cancel=stop))
    ((req, cancel),) = sup.started
    assert cancel is stop and req.builder.endswith(":ort_trt_ep_builder")
    trt_opts = session.trt_options()
    assert trt_opts["trt_profile_min_shapes"] == "x:1x16x16x3"
    assert trt_opts["trt_profile_opt_shapes"] == "x:1x16x16x3"
    assert trt_opts["trt_profile_max_shapes"] == "x:4x16x16x3"
    assert trt_opts["trt_fp16_enable"] == "True"
    assert list(req.ort_providers) == session.calls[0]["providers"], "the build used the session's providers"
    assert req.warmup_batches == (), "an explicit profile covers every batch from the start"
    assert req.input_name == "x" and req.input_dtype == "uint8" and req.sample_shape == (16, 16, 3)
    assert str(session.calls[0]["level"]).endswith(req.ort_graph_optimization_level)
    assert be.provider == TRT
    assert [n.phase for n in notes] == ["started", "progress", "progress", "progress", "finished"]
    assert ort_engines_ready(req)
    # The engines are in the cache: the next load only deserializes them, no build process.
    f.make(path, manifest_for(path), LoadRequest())
    assert len(sup.started) == 1 and len(session.calls) == 2


def test_a_profile_onnxruntime_cannot_parse_falls_back_to_warmups_at_1_and_max_batch(
    tmp_path: Path,
) -> None:
    path = model(tmp_path, input_name="image_tensor:0")
    sup = FakeSupervisor()
    session = FakeSession()
    f = make_factory(tmp_path, sup, session=session, available=ALL, engine="onnxruntime", max_batch=4)
    f.make(path, manifest_for(path), LoadRequest())
    (req,) = sup.ort()
    assert not any(k.startswith("trt_profile_") for k in session.trt_options())
    assert req.warmup_batches == (1, 4) and req.input_name == "image_tensor:0"
    # A static model needs neither: onnxruntime builds its engine when the session is created.
    static = model(tmp_path, input_name="image_tensor:0", batch=1, name="static.onnx")
    sup2 = FakeSupervisor()
    make_factory(
        tmp_path, sup2, session=FakeSession(), available=ALL, engine="onnxruntime", max_batch=4
    ).make(static, manifest_for(static), LoadRequest())
    assert sup2.ort()[0].warmup_batches == ()


def test_a_failed_tensorrt_ep_build_drops_the_tensorrt_ep_and_says_why(tmp_path: Path) -> None:
    path = model(tmp_path)
    session = FakeSession()
    notes: list[BuildNote] = []
    f = make_factory(
        tmp_path,
        FakeSupervisor(BuildFailed("TrtError: onnxruntime gave CUDAExecutionProvider, not the TensorRT EP")),
        session=session,
        available=ALL,
        engine="onnxruntime",
    )
    be = f.make(path, manifest_for(path), LoadRequest(notify=notes.append))
    assert session.provider_names() == [CUDA, CPU] and be.provider == CUDA
    assert [n.phase for n in notes] == ["started", "failed", "fallback"]
    assert "not the TensorRT EP" in notes[1].reason and "not the TensorRT EP" in notes[2].reason


def test_native_failure_falls_back_to_the_tensorrt_ep_built_out_of_process(tmp_path: Path) -> None:
    """auto: the native build fails, so onnxruntime's TensorRT EP is tried, also in a build process."""
    path = model(tmp_path)

    class NativeFails(FakeSupervisor):
        def start(self, request: BuildRequest, **kw: Any) -> FakeHandle:
            self.error = BuildFailed("TrtError: parser: unsupported op") if request.engine_file else None
            return super().start(request, **kw)

    sup = NativeFails()
    session = FakeSession()
    notes: list[BuildNote] = []
    f = make_factory(
        tmp_path, sup, runtime=FakeRuntime(builds_here=False), session=session, available=ALL, max_batch=2
    )
    be = f.make(path, manifest_for(path), LoadRequest(variant="fp16", notify=notes.append))
    assert len(sup.native()) == 1 and len(sup.ort()) == 1 and be.provider == TRT
    assert session.trt_options()["trt_profile_max_shapes"] == "x:2x16x16x3"
    assert [n.phase for n in notes if n.engine == "tensorrt"] == ["started", "failed"]
    assert notes[-1].phase == "fallback" and "unsupported op" in notes[-1].reason
