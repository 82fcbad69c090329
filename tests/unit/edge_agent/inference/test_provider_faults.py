"""Execution providers that fail, fall back or cannot be used, and CUDA errors that kill the context
. Hand-written fakes stand in for onnxruntime's session and for the
native engine; a few tests use the real onnxruntime (CPU build) to pin the API the fakes imitate."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnxruntime.capi import onnxruntime_pybind11_state as C

from edge_agent.device.health import Health
from edge_agent.inference.backend import (
    EXIT_CUDA_FATAL,
    BackendError,
    CudaFatalError,
    ProviderFallback,
    is_sticky_cuda_error,
)
from edge_agent.inference.factory import AutoBackendFactory, BuildNote, GuardedTensorRtBackend, LoadRequest
from edge_agent.inference.ort import OnnxRuntimeBackend
from edge_agent.inference.providers import (
    ProviderProbe,
    cuda_ep_options,
    ort_trt_precision,
    probe_providers,
    provider_list,
    trt_ep_options,
)
from edge_agent.inference.tensorrt.errors import TrtError
from fleet_protocol.messages import InputSpec, ModelManifest
from tests.support.fakes.ort import EPFail, FakeSession
from tests.support.fakes.tensorrt import FakeEngine, FakeRuntime

TRT, CUDA, CPU = "TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"
ALL = [TRT, CUDA, CPU]


def backend(tmp_path: Path, session: FakeSession, available: list[str] = ALL) -> OnnxRuntimeBackend:
    return OnnxRuntimeBackend(
        tmp_path / "m.onnx",
        threads=1,
        trt_cache_dir=tmp_path / "ort",
        available=available,
        session_factory=session,
        trt_workspace_bytes=512 * 2**20,
    )


def model_file(tmp_path: Path) -> tuple[Path, ModelManifest]:
    """A model file and its manifest (the fake sessions never parse it)."""
    path = tmp_path / "m.onnx"
    path.write_bytes(_tiny())
    blob = path.read_bytes()
    manifest = ModelManifest(
        name="m",
        version="1",
        sha256=hashlib.sha256(blob).hexdigest(),
        size=len(blob),
        decoder="tf_od",
        input=InputSpec(name="x", layout="NHWC", dtype="uint8", color="RGB", width=16, height=16),
        labels=["person"],
    )
    return path, manifest


X = np.zeros((1, 3), np.float32)


# --------------------------------------------------------------------------- run-time fallback


def test_onnxruntimes_silent_run_fallback_is_switched_off() -> None:
    sess = FakeSession(ALL)
    OnnxRuntimeBackend(Path("m.onnx"), available=ALL, session_factory=sess, trt_cache_dir=None)
    assert sess.fallback_enabled is False
    assert C.EPFail.__name__ == "EPFail", "the exception name the backend recognises is onnxruntime's"


def test_real_onnxruntime_session_has_fallback_disabled(tmp_path: Path) -> None:
    from onnx import TensorProto, helper, save

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    graph = helper.make_graph([helper.make_node("Add", ["x", "one"], ["y"])], "t", [x], [y], [one])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    save(model, str(tmp_path / "m.onnx"))
    be = OnnxRuntimeBackend(tmp_path / "m.onnx", threads=1)
    assert be._session._enable_fallback is False  # onnxruntime's own flag, set by disable_fallback()
    assert np.allclose(be.run(np.zeros((2, 3), np.float32))["y"], 1.0)


def test_an_ep_failure_at_run_time_moves_to_the_next_provider_and_says_so(tmp_path: Path) -> None:
    sess = FakeSession(ALL, run_errors=[EPFail("TensorRT EP Failed to Build Engine.")])
    be = backend(tmp_path, sess)
    assert be.provider == TRT
    with pytest.raises(ProviderFallback) as info:
        be.run(X)
    err = info.value
    assert isinstance(err, BackendError)
    assert (err.previous, err.provider) == (TRT, CUDA) and "Failed to Build Engine" in err.reason
    assert be.provider == CUDA, "heartbeats and MODEL_ACTIVATE now say CUDA, not TensorRT"
    assert be.fallback_reason is not None and "TensorRT" in be.fallback_reason
    # the session was re-created on the providers after TensorRT, with their options
    (rest,) = sess.set_to
    assert rest[0][0] == CUDA and rest[0][1]["cudnn_conv_algo_search"] == "HEURISTIC" and rest[-1] == CPU
    assert np.allclose(be.run(X)["y"], 1.0), "the backend keeps serving on CUDA"


def test_a_switch_made_by_onnxruntime_itself_is_reported(tmp_path: Path) -> None:
    class SwitchingSession(FakeSession):
        def run(self, names: Any, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
            self.got = [CPU]  # a session whose own fallback re-created it, then failed again
            raise RuntimeError("CUDNN failure 4: CUDNN_STATUS_INTERNAL_ERROR")

    be = backend(tmp_path, SwitchingSession(ALL))
    with pytest.raises(ProviderFallback) as info:
        be.run(X)
    assert (info.value.previous, info.value.provider, be.provider) == (TRT, CPU, CPU)


def test_an_ordinary_run_error_is_left_as_it_is(tmp_path: Path) -> None:
    be = backend(tmp_path, FakeSession(ALL, run_errors=[ValueError("bad input shape")]))
    with pytest.raises(ValueError, match="bad input shape"):
        be.run(X)
    assert be.provider == TRT
    cpu = backend(tmp_path, FakeSession([CPU], run_errors=[EPFail("cpu kernel failed")]), available=[CPU])
    with pytest.raises(EPFail):
        cpu.run(X)


# --------------------------------------------------------------------------- sticky CUDA errors


@pytest.mark.parametrize(
    ("message", "sticky"),
    [
        (
            "CUDA failure 700: an illegal memory access was encountered ; GPU=0 ; hostname=h ; expr=cudaMemcpyAsync",
            True,
        ),
        ("CUDA failure 719: unspecified launch failure ; GPU=0", True),
        ("CUDA error: cudaError_t.cudaErrorIllegalAddress", True),  # _cuda_check's text, cuda-python enum
        ("CUresult.CUDA_ERROR_LAUNCH_FAILED", True),
        ("[TRT] Error Code 1: Cuda Runtime (an illegal memory access was encountered)", True),
        ("CUDA failure 716: misaligned address", True),
        ("device-side assert triggered", True),
        ("CUDA failure 2: out of memory ; GPU=0", False),  # recoverable
        ("CUBLAS failure 13: CUBLAS_STATUS_EXECUTION_FAILED", False),
        ("TensorRT EP Failed to Build Engine.", False),
        ("CUDA failure 7000: made up", False),
    ],
)
def test_sticky_cuda_errors_are_recognised_in_every_spelling(message: str, sticky: bool) -> None:
    assert is_sticky_cuda_error(message) is sticky


def test_a_sticky_error_in_a_cause_counts() -> None:
    try:
        try:
            raise TrtError("CUDA error: cudaError_t.cudaErrorLaunchFailure")
        except TrtError as inner:
            raise RuntimeError("inference failed") from inner
    except RuntimeError as outer:
        assert is_sticky_cuda_error(outer)


def test_a_sticky_cuda_error_at_run_time_means_restart_the_process(tmp_path: Path) -> None:
    sess = FakeSession(ALL, run_errors=[EPFail("CUDA failure 700: an illegal memory access was encountered")])
    be = backend(tmp_path, sess)
    with pytest.raises(CudaFatalError) as info:
        be.run(X)
    assert not isinstance(info.value, BackendError), "a reload-on-BackendError path must not swallow it"
    assert info.value.exit_code == EXIT_CUDA_FATAL == 4
    assert sess.set_to == [], "no fallback session in a process whose CUDA context is dead"


def test_a_sticky_error_while_loading_is_fatal_too(tmp_path: Path) -> None:
    def broken(path: Any, **kw: Any) -> Any:
        raise RuntimeError("CUDA failure 719: unspecified launch failure ; GPU=0")

    with pytest.raises(CudaFatalError):
        OnnxRuntimeBackend(tmp_path / "m.onnx", available=ALL, session_factory=broken)


def engine(error: Exception | None) -> FakeEngine:
    """A native engine of a fixed (1, 3) input that answers y = x + 1, or raises ``error``."""
    return FakeEngine(input_shape=(1, 3), outputs=lambda batch: {"y": batch + 1}, error=error)


def test_the_native_backend_raises_cuda_fatal_on_sticky_errors_only() -> None:
    fatal = GuardedTensorRtBackend(
        engine(TrtError("CUDA error: cudaError_t.cudaErrorIllegalAddress")),
        precision="fp16",
        engine_file="e",
    )
    with pytest.raises(CudaFatalError):
        fatal.run(X)
    other = GuardedTensorRtBackend(
        engine(TrtError("shape outside profile")), precision="fp16", engine_file="e"
    )
    with pytest.raises(TrtError, match="outside profile"):
        other.run(X)
    assert np.allclose(GuardedTensorRtBackend(engine(None), precision="fp16", engine_file="e").run(X)["y"], 1)


class StickyNativeFactory(AutoBackendFactory):
    """The factory with a native build that hits a sticky CUDA error (the seam: ``_native``)."""

    def _native(self, *a: Any, **kw: Any) -> Any:
        raise TrtError("CUDA error: cudaError_t.cudaErrorIllegalAddress")


def test_a_sticky_error_in_a_native_build_does_not_fall_back_to_onnxruntime(tmp_path: Path) -> None:
    model, manifest = model_file(tmp_path)
    sessions: list[Any] = []
    f = StickyNativeFactory(
        engine="auto",
        cache_dir=tmp_path / "c",
        runtime=FakeRuntime(),
        available_providers=lambda: [CPU],
        session_factory=lambda *a, **kw: sessions.append(1),
    )
    notes: list[BuildNote] = []
    with pytest.raises(CudaFatalError):
        f.make(model, manifest, LoadRequest(variant="fp16", notify=notes.append))
    assert sessions == [], "no onnxruntime session in the same dead CUDA context"
    assert [n.phase for n in notes] == ["failed"] and "restart" in notes[0].reason


# --------------------------------------------------------------------------- provider options


def test_provider_options_use_onnxruntimes_names_and_values() -> None:
    trt = trt_ep_options(Path("/c"), fp16=True, workspace_bytes=1024 * 2**20, device_id=1)
    assert trt["trt_max_workspace_size"] == str(2**30) and trt["device_id"] == "1"
    assert trt["trt_engine_cache_enable"] == "True" and trt["trt_engine_cache_path"] == "/c"
    assert trt["trt_timing_cache_enable"] == "True" and trt["trt_timing_cache_path"] == "/c"
    assert trt["trt_fp16_enable"] == "True" and trt["trt_int8_enable"] == "False"
    assert cuda_ep_options() == {
        "device_id": "0",
        "cudnn_conv_algo_search": "HEURISTIC",
        "arena_extend_strategy": "kSameAsRequested",
    }
    assert cuda_ep_options(gpu_mem_limit_bytes=2**31)["gpu_mem_limit"] == str(2**31)
    providers = provider_list(ALL, trt_cache_dir=Path("/c"), device_id=0)
    assert [p[0] if isinstance(p, tuple) else p for p in providers] == ALL


def test_tensorrt_ep_precision_follows_the_variant_and_the_setting() -> None:
    assert ort_trt_precision("fp16") == (True, False)
    assert ort_trt_precision("fp32") == (False, False), "fp32 is sent where fp16 was judged unfit"
    assert ort_trt_precision("int8") == (False, True)  # Q/DQ: TensorRT reads the model's scales
    assert ort_trt_precision("fp32", "fp16") == (True, False)
    assert ort_trt_precision("fp16", "fp32") == (False, False)
    # An int8 setting on an unquantized model: no calibration table on this path, the variant decides.
    assert ort_trt_precision("fp32", "int8") == (False, False)


@pytest.mark.filterwarnings("ignore:Specified provider")
def test_real_onnxruntime_accepts_the_cpu_session_with_these_options_lists(tmp_path: Path) -> None:
    # On a CPU build the GPU entries are dropped with a warning, never an error: the list is well formed.
    sess = ort.InferenceSession(
        _tiny(),
        providers=provider_list([CUDA, CPU], trt_cache_dir=tmp_path, device_id=0),
    )
    assert sess.get_providers() == [CPU]


def _tiny() -> bytes:
    from edge_agent.inference.providers import _probe_model

    return _probe_model()


# --------------------------------------------------------------------------- usable providers


def test_available_but_unusable_providers_are_dropped_with_the_loader_error() -> None:
    def session(model: bytes, *, sess_options: Any, providers: list[Any]) -> FakeSession:
        if providers[0] == CUDA:
            raise RuntimeError(
                "CUDA failure 35: CUDA driver version is insufficient for CUDA runtime version"
            )
        assert providers[0] == (TRT, {"trt_min_subgraph_size": "1000"}), "no engine build in the probe"
        return FakeSession([CPU])  # onnxruntime quietly dropped the TensorRT EP

    probe = probe_providers(
        ALL,
        session_factory=session,
        library_error=lambda p: "libnvinfer.so.10: cannot open shared object file: No such file or directory",
        installed=lambda: {"onnxruntime", "onnxruntime-gpu"},
    )
    assert probe.available == tuple(ALL) and probe.usable == (CPU,)
    assert "libnvinfer.so.10" in probe.problems[TRT]
    assert "driver version is insufficient" in probe.problems[CUDA]
    assert "both onnxruntime and onnxruntime-gpu" in probe.problems["onnxruntime"]
    assert probe.why_not(ALL) is not None and "libnvinfer" in (probe.why_not(ALL) or "")


@pytest.mark.filterwarnings("ignore:Specified provider")
def test_real_probe_on_this_cpu_build() -> None:
    probe = probe_providers([CUDA, CPU])  # as a wheel that lists CUDA would; this one cannot use it
    assert probe.usable == (CPU,)
    assert CUDA in probe.problems


def test_the_factory_uses_only_usable_providers_and_reports_why(tmp_path: Path) -> None:
    model, manifest = model_file(tmp_path)
    sess = FakeSession([CUDA, CPU])
    probe = ProviderProbe(tuple(ALL), (CUDA, CPU), {TRT: "libnvinfer.so.10: cannot open shared object file"})
    f = AutoBackendFactory(
        engine="onnxruntime",
        cache_dir=tmp_path / "c",
        provider_probe=lambda: probe,
        session_factory=sess,
        workspace_mb=256,
    )
    notes: list[BuildNote] = []
    be = f.make(model, manifest, LoadRequest(notify=notes.append))
    assert be.provider == CUDA
    assert [p[0] if isinstance(p, tuple) else p for p in sess.created_with] == [CUDA, CPU]
    (note,) = notes
    assert note.phase == "fallback" and "libnvinfer.so.10" in note.reason


def test_the_factory_passes_workspace_and_device_to_the_tensorrt_ep(tmp_path: Path) -> None:
    model, manifest = model_file(tmp_path)
    sess = FakeSession(ALL)
    f = AutoBackendFactory(
        engine="onnxruntime",
        cache_dir=tmp_path / "c",
        available_providers=lambda: ALL,
        session_factory=sess,
        workspace_mb=256,
        device_id=0,
        precision="fp16",
    )
    f.make(model, manifest, LoadRequest(variant="fp32"))
    trt_opts = sess.created_with[0][1]
    assert trt_opts["trt_max_workspace_size"] == str(256 * 2**20) and trt_opts["device_id"] == "0"
    assert trt_opts["trt_fp16_enable"] == "True", "inference.trt_precision: fp16 wins over the variant"


def test_capabilities_advertise_usable_providers_only(tmp_path: Path) -> None:
    probe = ProviderProbe(tuple(ALL), (CUDA, CPU), {TRT: "libnvinfer.so.10 missing"})
    h = Health(
        tmp_path, cpuinfo=tmp_path / "absent", sysfs_root=tmp_path / "none", provider_probe=lambda: probe
    )
    assert h.capabilities([]).execution_providers == [CUDA, CPU]
    assert h.system()["provider_problems"] == {TRT: "libnvinfer.so.10 missing"}
