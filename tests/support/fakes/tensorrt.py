"""Stand-ins for TensorRT: a runtime and its engines, the TensorRT and cuda-python APIs, and builders
for the real build process.

:class:`FakeRuntime` is a ``TrtRuntime`` without TensorRT or a GPU: its engines are the bytes
``ENGINE:<onnx name>:<precision>``, and anything else does not load. :class:`FakeEngine` is what it
loads. :class:`FakeTrt` and :class:`FakeCudart` are one level lower: fakes of the ``tensorrt`` (10.x)
Python API and of cuda-python's runtime, for running the real ``TensorRtRuntime`` and its engine.

The builders (``gil_builder``, ``failing_builder``, ...) run inside the real engine build process,
which imports them by ``module:function`` (``BuildRequest.builder``), the seam that puts a stand-in
for TensorRT into the child. ``gil_builder`` behaves like the builds it stands for: it
holds its process's GIL for long stretches (as onnxruntime's session creation does), reports
progress, and writes its engine only at the end (a partial file first, so a kill mid-build would
show up as a half engine if the child's work folder were the cache).
"""

from __future__ import annotations

import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edge_agent.inference.engine_build import BuildRequest
from edge_agent.inference.engine_build.child import BuildContext, BuildOutput
from edge_agent.inference.tensorrt.build_config import BuildOptions, Calibration, Precision
from edge_agent.inference.tensorrt.errors import TrtError

Outputs = Callable[[np.ndarray], dict[str, np.ndarray]]


def zeros_y(batch: np.ndarray) -> dict[str, np.ndarray]:
    """One output ``y``: a zero per sample."""
    return {"y": np.zeros((batch.shape[0], 1), np.float32)}


class FakeEngine:
    """A deserialized engine (``TrtEngine``): ``data`` is what it was loaded from; ``run`` counts the
    runs and answers ``outputs(batch)``, or raises ``error``. The batch is dynamic unless the first
    dim of ``input_shape`` is fixed."""

    input_name = "x"

    def __init__(
        self,
        data: bytes = b"",
        *,
        outputs: Outputs = zeros_y,
        error: Exception | None = None,
        input_shape: tuple[int | str | None, ...] = (None, 16, 16, 3),
    ) -> None:
        self.data = data
        self.outputs = outputs
        self.error = error
        self.input_shape = input_shape
        self.dynamic_batch = not isinstance(input_shape[0], int)
        self.runs = 0

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        self.runs += 1
        if self.error is not None:
            raise self.error
        return self.outputs(batch)

    def close(self) -> None:
        pass


class FakeRuntime:
    """A ``TrtRuntime`` that records its builds; engines are ``b"ENGINE:<onnx name>:<precision>"``, and
    anything else does not load.

    ``builds_here=False``: the agent's runtime when builds run in a build process; a build in this
    process fails the test. ``gate`` (when set up) holds builds until it is set; ``fail_with`` makes
    them fail; ``progress_steps`` are reported through ``options.progress``. Loaded engines answer
    ``outputs``.
    """

    version = "10.3.0"
    gpu_name = "NVIDIA Jetson Orin"
    compute_capability = "8.7"
    device = 0

    def __init__(self, *, outputs: Outputs = zeros_y, builds_here: bool = True) -> None:
        self.outputs = outputs
        self.builds_here = builds_here
        self.builds: list[tuple[str, Precision, Calibration | None]] = []
        self.gate: threading.Event | None = None
        self.fail_with: str | None = None
        self.progress_steps = (25.0, 50.0, 75.0, 100.0)

    def build_engine(
        self, onnx_path: Path, precision: Precision, calib: Calibration | None, options: BuildOptions
    ) -> bytes:
        if not self.builds_here:
            raise AssertionError("a build in the agent's process: it must go through the build process")
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
        return FakeEngine(data, outputs=self.outputs)


# --------------------------------------------------------------------------- TensorRT 10 and cuda-python
# TensorRtRuntime and _CudaEngine run for real against a fake of the TensorRT 10 Python API (names and
# signatures as in NVIDIA/TensorRT python/src/infer/pyCore.cpp, release/10.3 and 10.13) and of
# cuda-python's runtime. The fake builder behaves as TensorRT does where it matters: it calibrates at
# the calibration profile's kOPT and reads that many bytes from the calibrator's device pointer.


class FakeCudart:
    class cudaError_t:
        cudaSuccess = 0

    class cudaMemcpyKind:
        cudaMemcpyHostToDevice = 1
        cudaMemcpyDeviceToHost = 2

    def __init__(self) -> None:
        self.allocations: dict[int, int] = {}
        self._next = 0x10000

    def cudaSetDevice(self, device: int) -> tuple[int]:
        return (0,)

    def cudaGetDeviceProperties(self, device: int) -> tuple[int, Any]:
        props = type("Props", (), {"name": b"Orin\x00", "major": 8, "minor": 7})()
        props.multiProcessorCount, props.totalGlobalMem = 8, 8 * 2**30
        return (0, props)

    def cudaMalloc(self, nbytes: int) -> tuple[int, int]:
        ptr, self._next = self._next, self._next + nbytes + 4096
        self.allocations[ptr] = nbytes
        return (0, ptr)

    def cudaMemcpy(self, dst: int, src: int, nbytes: int, kind: int) -> tuple[int]:
        assert nbytes <= self.allocations[dst], "host-to-device copy past the buffer"
        return (0,)

    def cudaFree(self, ptr: int) -> tuple[int]:
        return (0,)

    def cudaStreamCreate(self) -> tuple[int, int]:
        return (0, 7)

    def cudaStreamDestroy(self, stream: int) -> tuple[int]:
        return (0,)


class FakeTensor:
    def __init__(self, name: str, shape: tuple[int, ...], dtype: str = "UINT8") -> None:
        self.name, self.shape, self.dtype = name, shape, dtype


class FakeProfile:
    def __init__(self) -> None:
        self.shapes: dict[str, tuple[tuple[int, ...], ...]] = {}

    def set_shape(self, name: str, lo: Any, opt: Any, hi: Any) -> None:
        self.shapes[name] = (tuple(lo), tuple(opt), tuple(hi))


class FakeTimingCache:
    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    def serialize(self) -> bytes:
        return b"TIMING:" + str(int(self.blob.split(b":")[1]) + 1 if self.blob else 1).encode()


class FakeConfig:
    def __init__(self) -> None:
        self.flags: list[str] = []
        self.pools: dict[str, int] = {}
        self.profiles: list[FakeProfile] = []
        self.calibration_profile: FakeProfile | None = None
        self.int8_calibrator: Any = None
        self.progress_monitor: Any = None
        self.builder_optimization_level = 3
        self.timing: FakeTimingCache | None = None
        self.created_timing: list[bytes] = []

    def set_memory_pool_limit(self, pool: str, nbytes: int) -> None:
        self.pools[pool] = nbytes

    def set_flag(self, flag: str) -> None:
        self.flags.append(flag)

    def add_optimization_profile(self, profile: FakeProfile) -> int:
        self.profiles.append(profile)
        return len(self.profiles) - 1

    def set_calibration_profile(self, profile: FakeProfile) -> bool:
        self.calibration_profile = profile
        return True

    def create_timing_cache(self, blob: bytes) -> FakeTimingCache:
        self.created_timing.append(bytes(blob))
        return FakeTimingCache(bytes(blob))

    def set_timing_cache(self, cache: FakeTimingCache, ignore_mismatch: bool) -> bool:
        assert ignore_mismatch is False
        self.timing = cache
        return True

    def get_timing_cache(self) -> FakeTimingCache | None:
        return self.timing


class FakeTrt:
    """The parts of ``tensorrt`` (10.x) that TensorRtRuntime and _CudaEngine use."""

    class Logger:
        WARNING = 2

        def __init__(self, level: int) -> None:
            pass

    class MemoryPoolType:
        WORKSPACE = "WORKSPACE"

    class BuilderFlag:
        FP16, INT8, TF32 = "FP16", "INT8", "TF32"

    class TensorIOMode:
        INPUT, OUTPUT = "INPUT", "OUTPUT"

    class IProgressMonitor:
        def __init__(self) -> None:
            pass

    class IInt8EntropyCalibrator2:
        def __init__(self) -> None:
            pass

    def __init__(self, cudart: FakeCudart, inputs: list[FakeTensor], version: str = "10.3.0") -> None:
        self.__version__ = version
        self.cudart = cudart
        self.inputs = inputs
        self.configs: list[FakeConfig] = []
        self.parsed: list[str] = []
        self.calibration_reads: list[tuple[tuple[int, ...], int]] = []  # (shape read, bytes allocated)
        self.engine: Any = None
        fake = self

        class Runtime:
            def __init__(self, logger: Any) -> None:
                pass

            def deserialize_cuda_engine(self, data: bytes) -> Any:
                return fake.engine

        class Network:
            num_inputs = len(inputs)

            def get_input(self, i: int) -> FakeTensor:
                return fake.inputs[i]

        class OnnxParser:
            num_errors = 0

            def __init__(self, network: Any, logger: Any) -> None:
                pass

            def parse_from_file(self, path: str) -> bool:
                fake.parsed.append(path)
                return True

        class Builder:
            def __init__(self, logger: Any) -> None:
                pass

            def create_network(self, flags: int) -> Network:
                return Network()

            def create_builder_config(self) -> FakeConfig:
                fake.configs.append(FakeConfig())
                return fake.configs[-1]

            def create_optimization_profile(self) -> FakeProfile:
                return FakeProfile()

            def build_serialized_network(self, network: Any, config: FakeConfig) -> bytes:
                if config.progress_monitor is not None:
                    config.progress_monitor.phase_start("Building engine", None, 2)
                    for step in range(2):
                        config.progress_monitor.step_complete("Building engine", step)
                    config.progress_monitor.phase_finish("Building engine")
                cal = config.int8_calibrator
                if cal is not None:
                    tensor = fake.inputs[0]
                    if any(d < 0 for d in tensor.shape):  # runtime dims: calibrate at kOPT
                        assert config.calibration_profile is not None, "no calibration profile"
                        shape = config.calibration_profile.shapes[tensor.name][1]
                    else:
                        shape = tensor.shape
                    itemsize = np.dtype(fake.nptype(tensor.dtype)).itemsize
                    while (ptrs := cal.get_batch([tensor.name])) is not None:
                        fake.calibration_reads.append((shape, fake.cudart.allocations[ptrs[0]]))
                        assert int(np.prod(shape)) * itemsize <= fake.cudart.allocations[ptrs[0]], (
                            f"TensorRT reads {shape} from a {fake.cudart.allocations[ptrs[0]]}-byte buffer"
                        )
                return f"PLAN:{'+'.join(config.flags) or 'fp32'}".encode()

        self.Runtime, self.OnnxParser, self.Builder = Runtime, OnnxParser, Builder

    @staticmethod
    def nptype(dtype: str) -> type:
        return {"UINT8": np.uint8, "FLOAT": np.float32, "INT32": np.int32}[dtype]


# --------------------------------------------------------------------------- builders for the build process


_PATHOLOGICAL = re.compile(r"(a+)+b")


def hold_gil(seconds: float) -> None:
    """Keep the GIL for about ``seconds`` in one C call (the regex engine never releases it)."""
    runs = []
    for _ in range(3):  # the quickest of three: a busy machine only makes the hold longer
        t0 = time.perf_counter()
        _PATHOLOGICAL.match("a" * 18)
        runs.append(time.perf_counter() - t0)
    base = max(min(runs), 1e-4)  # each extra 'a' doubles the time
    n = 18 + max(0, math.ceil(math.log2(seconds / base)))
    _PATHOLOGICAL.match("a" * n)


def gil_builder(request: BuildRequest, ctx: BuildContext) -> BuildOutput:
    p = request.params
    seconds = float(p.get("seconds", 2.0))
    if p.get("ignore_sigterm"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = ctx.workdir / request.engine_file
    out.write_bytes(b"PARTIAL")  # what a half-written engine looks like
    if p.get("pid_file"):
        Path(p["pid_file"]).write_text(str(os.getpid()))
    t0 = time.monotonic()
    ctx.progress("building", 0.0)
    while (elapsed := time.monotonic() - t0) < seconds:
        hold_gil(min(0.25, seconds - elapsed))
        ctx.progress("building", min(99.9, 100.0 * (time.monotonic() - t0) / seconds))
    out.write_bytes(p.get("engine", b"ENGINE:fake"))
    return BuildOutput([request.engine_file], {"seconds": seconds, "pid": os.getpid()})


def failing_builder(request: BuildRequest, ctx: BuildContext) -> BuildOutput:
    ctx.progress("building", 10.0)
    (ctx.workdir / request.engine_file).write_bytes(b"PARTIAL")
    raise RuntimeError(request.params.get("message", "out of GPU memory while building"))


def crashing_builder(request: BuildRequest, ctx: BuildContext) -> BuildOutput:
    ctx.progress("building", 5.0)
    print("about to crash: tactic 42 of 97", flush=True)
    (ctx.workdir / request.engine_file).write_bytes(b"PARTIAL")
    os.kill(os.getpid(), signal.SIGSEGV)
    raise AssertionError("unreachable")


def chatty_builder(request: BuildRequest, ctx: BuildContext) -> BuildOutput:
    """Many progress events (each a new phase, so none is coalesced away), then a small engine."""
    for i in range(int(request.params.get("events", 600))):
        ctx.progress(f"phase-{i}", None)
    (ctx.workdir / request.engine_file).write_bytes(b"ENGINE:chatty")
    return BuildOutput([request.engine_file])
