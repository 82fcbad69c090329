"""On a GPU: the agent's real TensorRT runtime and onnxruntime's CUDA provider compute what onnxruntime's
CPU provider computes.

tests/unit/edge_agent/inference/test_tensorrt.py checks the TensorRT path through a fake runtime. Here the real
one runs (``edge_agent.inference.tensorrt.runtime.TensorRtRuntime``: the TensorRT 10 builder, ``deserialize_cuda_engine``,
cuda-python device and pinned host buffers, one stream, ``execute_async_v3``), on a tiny ONNX model:

* through the agent's own path, ``AutoBackendFactory`` with ``inference.engine: tensorrt``: the engine
  is built in a build process (``edge_agent.inference.engine_build.child``), cached, loaded and run at several batch
  sizes of its dynamic profile, then loaded again from the cache;
* ``TensorRtRuntime.build_engine`` / ``load_engine`` called directly, in this process, on a model with
  a fixed batch;
* onnxruntime's CUDA execution provider through the agent's ``OnnxRuntimeBackend`` (IOBinding).

Outputs must match onnxruntime's CPU provider within a tolerance that allows TF32 (TensorRT 10's
default for FP32 engines) or FP16. Opt-in: without tensorrt, cuda-python, a GPU or onnxruntime-gpu
the tests skip and say why; ``EDGEFLEET_REQUIRE_GPU=1`` makes that a failure (tests/support/gpu_stack.py):

    EDGEFLEET_REQUIRE_GPU=1 .venv/bin/pytest tests/gpu
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edge_agent.inference.engine_build import ChildProcessBuilds
from edge_agent.inference.factory import AutoBackendFactory, BuildNote, LoadRequest
from edge_agent.inference.ort import OnnxRuntimeBackend
from edge_agent.inference.providers import CPU_EP, CUDA_EP
from edge_agent.inference.tensorrt.backend import NATIVE_PROVIDER, TensorRtBackend
from edge_agent.inference.tensorrt.build_config import BuildOptions, Precision
from edge_agent.inference.tensorrt.errors import TrtError
from fleet_protocol.messages import InputSpec, ModelManifest
from tests.support.gpu_stack import require_ort_cuda, trt_runtime

pytestmark = pytest.mark.gpu

SIZE = 32
CHANNELS = 8
MAX_BATCH = 4
BUILD_TIMEOUT_S = 240.0
# Largest absolute difference from onnxruntime CPU on outputs in (0, 1): FP32 engines may use TF32
# (10-bit mantissa) for the convolution, FP16 engines compute in half precision.
TOLERANCE: dict[str, float] = {"fp32": 5e-3, "fp16": 2e-2}
OUTPUTS = ("feat", "pooled")

Run = Callable[[np.ndarray], dict[str, np.ndarray]]


def tiny_convnet(*, dynamic_batch: bool) -> bytes:
    """images [N, 3, 32, 32] float32 -> feat = sigmoid(conv 3x3 stride 2) [N, 8, 16, 16] and
    pooled = its global average [N, 8]: two outputs, a batch that is dynamic or fixed at 1."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((CHANNELS, 3, 3, 3)) * 0.3).astype(np.float32), "w")
    b = numpy_helper.from_array((rng.standard_normal(CHANNELS) * 0.1).astype(np.float32), "b")
    n: int | str = "batch" if dynamic_batch else 1
    half = SIZE // 2
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["images", "w", "b"], ["conv"], strides=[2, 2], pads=[1, 1, 1, 1]),
            helper.make_node("Sigmoid", ["conv"], ["feat"]),
            helper.make_node("GlobalAveragePool", ["feat"], ["gap"]),
            helper.make_node("Flatten", ["gap"], ["pooled"], axis=1),
        ],
        "tiny_convnet",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [n, 3, SIZE, SIZE])],
        [
            helper.make_tensor_value_info("feat", TensorProto.FLOAT, [n, CHANNELS, half, half]),
            helper.make_tensor_value_info("pooled", TensorProto.FLOAT, [n, CHANNELS]),
        ],
        [w, b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def write_model(tmp_path: Path, *, dynamic_batch: bool) -> tuple[Path, ModelManifest]:
    path = tmp_path / ("tiny-dynamic.onnx" if dynamic_batch else "tiny-static.onnx")
    blob = tiny_convnet(dynamic_batch=dynamic_batch)
    path.write_bytes(blob)
    manifest = ModelManifest(
        name="tiny",
        version="1",
        sha256=hashlib.sha256(blob).hexdigest(),
        size=len(blob),
        decoder="yolov8",  # never decoded here: the raw outputs are compared
        input=InputSpec(name="images", layout="NCHW", dtype="float32", color="RGB", width=SIZE, height=SIZE),
        outputs=list(OUTPUTS),
        labels=["thing"],
    )
    return path, manifest


def assert_like_onnxruntime_cpu(run: Run, model: Path, batches: tuple[int, ...], tolerance: float) -> None:
    """``run`` gives onnxruntime CPU's outputs, by name and shape, at each batch size in turn (fresh
    random frames every time, so a buffer left over from the previous run cannot pass)."""
    import onnxruntime as ort

    cpu = ort.InferenceSession(str(model), providers=[CPU_EP])
    rng = np.random.default_rng(1)
    for n in batches:
        x = rng.random((n, 3, SIZE, SIZE), dtype=np.float32)
        want = dict(zip(OUTPUTS, cpu.run(list(OUTPUTS), {"images": x}), strict=True))
        got = run(x)
        assert sorted(got) == sorted(OUTPUTS), f"batch {n}: outputs {sorted(got)}"
        for name in OUTPUTS:
            g, w = np.asarray(got[name]), want[name]
            assert g.shape == w.shape, f"batch {n}, {name}: shape {g.shape}, onnxruntime CPU {w.shape}"
            assert np.all(np.isfinite(g)), f"batch {n}, {name}: non-finite values"
            worst = float(np.max(np.abs(g.astype(np.float64) - w)))
            assert worst <= tolerance, f"batch {n}, {name}: off by {worst:.2e} (tolerance {tolerance:.0e})"


def phases(notes: list[BuildNote]) -> list[str]:
    return [n.phase for n in notes if n.phase != "progress"]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_the_agents_tensorrt_path_builds_caches_and_runs_an_engine_like_onnxruntime_cpu(
    tmp_path: Path, precision: Precision
) -> None:
    rt = trt_runtime()
    model, manifest = write_model(tmp_path, dynamic_batch=True)
    factory = AutoBackendFactory(
        engine="tensorrt",
        cache_dir=tmp_path / "cache",
        max_batch=MAX_BATCH,
        runtime=rt,  # loads the engine in this process, as the agent does
        builds=ChildProcessBuilds(timeout_s=BUILD_TIMEOUT_S),  # the build runs in a build process
        available_providers=lambda: [CPU_EP],  # where it would fall back to (which must not happen)
    )
    notes: list[BuildNote] = []
    try:
        backend = factory.make(model, manifest, LoadRequest(variant=precision, notify=notes.append))
        failures = [f"{n.phase}: {n.reason}" for n in notes if n.phase in ("failed", "fallback")]
        assert isinstance(backend, TensorRtBackend), f"not native TensorRT: {failures or backend}"
        assert backend.provider == NATIVE_PROVIDER and backend.precision == precision
        assert phases(notes) == ["started", "finished"], notes
        assert backend.input_name == "images" and backend.dynamic_batch, backend.input_shape
        assert backend.host_memory == "pinned", "host staging is pageable (cudaMallocHost failed?)"
        engines = sorted(p.name for p in (tmp_path / "cache" / "engines").glob("*.engine"))
        assert engines == [backend.engine_file], engines
        # Largest batch first (the buffers are sized to the profile max), then smaller ones in them.
        batches = (MAX_BATCH, 1, MAX_BATCH - 1, MAX_BATCH)
        assert_like_onnxruntime_cpu(backend.run, model, batches, TOLERANCE[precision])
        with pytest.raises(TrtError):
            backend.run(np.zeros((MAX_BATCH + 1, 3, SIZE, SIZE), np.float32))  # beyond the profile
        backend.close()

        # The next load (an agent restart, the same model again) reads the engine from the cache.
        notes.clear()
        again = factory.make(model, manifest, LoadRequest(variant=precision, notify=notes.append))
        assert isinstance(again, TensorRtBackend) and phases(notes) == ["cached"], notes
        assert_like_onnxruntime_cpu(again.run, model, (1, MAX_BATCH), TOLERANCE[precision])
        again.close()
    finally:
        factory.close()


def test_tensorrt_runtime_builds_and_runs_a_fixed_batch_engine_in_this_process(tmp_path: Path) -> None:
    rt = trt_runtime()
    model, _ = write_model(tmp_path, dynamic_batch=False)
    progress: list[float] = []
    options = BuildOptions(
        max_batch=1, sample_shape=(3, SIZE, SIZE), workspace_mb=256, progress=progress.append
    )
    data = rt.build_engine(model, "fp32", None, options)
    assert data, "no serialized engine"
    assert all(0.0 <= p <= 100.0 for p in progress), progress
    engine = rt.load_engine(data)
    try:
        assert engine.input_name == "images" and not engine.dynamic_batch
        assert engine.input_shape == (1, 3, SIZE, SIZE)
        assert_like_onnxruntime_cpu(engine.run, model, (1, 1), TOLERANCE["fp32"])
        with pytest.raises(TrtError):
            engine.run(np.zeros((2, 3, SIZE, SIZE), np.float32))  # a fixed batch of 1 takes only 1
    finally:
        engine.close()
    with pytest.raises(TrtError):
        engine.run(np.zeros((1, 3, SIZE, SIZE), np.float32))  # closed: its buffers are freed


def test_onnxruntime_cuda_provider_runs_like_onnxruntime_cpu(tmp_path: Path) -> None:
    require_ort_cuda()
    model, manifest = write_model(tmp_path, dynamic_batch=True)
    factory = AutoBackendFactory(
        engine="onnxruntime",
        cache_dir=tmp_path / "cache",
        max_batch=MAX_BATCH,
        providers_preference=(CUDA_EP, CPU_EP),  # the real provider probe decides what is usable
    )
    notes: list[BuildNote] = []
    try:
        backend = factory.make(model, manifest, LoadRequest(notify=notes.append))
        assert isinstance(backend, OnnxRuntimeBackend)
        assert backend.provider == CUDA_EP, f"got {backend.provider}: {[n.reason for n in notes]}"
        assert not [n for n in notes if n.phase in ("failed", "fallback")], notes
        assert_like_onnxruntime_cpu(backend.run, model, (MAX_BATCH, 1, MAX_BATCH), TOLERANCE["fp32"])
        assert backend.io_binding, "the CUDA provider ran without IOBinding"
        backend.close()
    finally:
        factory.close()
