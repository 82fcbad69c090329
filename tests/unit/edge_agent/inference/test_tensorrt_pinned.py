"""native TensorRT path: pinned host staging sized to the profile max, allocated once per engine,
freed at close, every copy through it, one stream sync per run; pageable fallback with the reason.

No GPU here. The fakes extend the harness's cuda-python and TensorRT 10 fakes (tests/support/fakes/tensorrt.py): "device" memory and
"pinned" memory are real host buffers, ``cudaMemcpyAsync`` really copies (and records whether the host
side lay in pinned memory), and the fake execution context computes outputs from the input it finds at
the address given to ``set_tensor_address``. So the data that comes back has been through every copy.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np
import pytest

from edge_agent.inference.tensorrt.backend import TensorRtBackend
from edge_agent.inference.tensorrt.errors import TrtError
from edge_agent.inference.tensorrt.runtime import TensorRtRuntime
from tests.support.fakes.tensorrt import FakeCudart, FakeTrt

MAX_BATCH = 4
SAMPLE = (16, 16, 3)


def _view(ptr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


class MemCudart(FakeCudart):
    """cuda-python's runtime over real host memory: allocations, copies, syncs and frees recorded."""

    class cudaError_t(FakeCudart.cudaError_t):
        cudaErrorMemoryAllocation = 2

    def __init__(self, *, host_ok: int | None = None) -> None:
        super().__init__()
        self.host_ok = host_ok  # cudaMallocHost succeeds this many times, then fails (None: always)
        self.mem: dict[int, np.ndarray] = {}  # every live allocation, keeping its memory alive
        self.device: dict[int, int] = {}
        self.pinned: dict[int, int] = {}
        self.host_allocs: list[int] = []  # sizes asked of cudaMallocHost, in order
        self.device_allocs: list[int] = []
        self.freed_host: list[int] = []
        self.freed_device: list[int] = []
        self.copies: list[tuple[str, int, bool]] = []  # (h2d|d2h, bytes, host side pinned)
        self.syncs = 0
        self.streams_destroyed: list[int] = []

    def _alloc(self, nbytes: int) -> int:
        buf = np.zeros(nbytes, np.uint8)
        ptr = int(buf.ctypes.data)
        self.mem[ptr] = buf
        return ptr

    def cudaMalloc(self, nbytes: int) -> tuple[int, int]:
        ptr = self._alloc(nbytes)
        self.device[ptr] = nbytes
        self.allocations[ptr] = nbytes
        self.device_allocs.append(nbytes)
        return (0, ptr)

    def cudaMallocHost(self, nbytes: int) -> tuple[int, int]:
        if self.host_ok is not None and len(self.host_allocs) >= self.host_ok:
            return (self.cudaError_t.cudaErrorMemoryAllocation, 0)
        ptr = self._alloc(nbytes)
        self.pinned[ptr] = nbytes
        self.host_allocs.append(nbytes)
        return (0, ptr)

    def cudaFreeHost(self, ptr: int) -> tuple[int]:
        assert ptr in self.pinned, "cudaFreeHost of memory cudaMallocHost did not give"
        self.freed_host.append(ptr)
        del self.pinned[ptr]
        return (0,)

    def cudaFree(self, ptr: int) -> tuple[int]:
        assert ptr in self.device, "cudaFree of memory cudaMalloc did not give"
        self.freed_device.append(ptr)
        del self.device[ptr]
        return (0,)

    @staticmethod
    def _inside(table: dict[int, int], ptr: int, nbytes: int) -> bool:
        return any(base <= ptr and ptr + nbytes <= base + size for base, size in table.items())

    def cudaMemcpyAsync(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> tuple[int]:
        assert stream == 7, "copy outside the engine's stream"
        if kind == self.cudaMemcpyKind.cudaMemcpyHostToDevice:
            assert self._inside(self.device, dst, nbytes), "H2D past the device buffer"
            self.copies.append(("h2d", nbytes, self._inside(self.pinned, src, nbytes)))
        else:
            assert self._inside(self.device, src, nbytes), "D2H past the device buffer"
            self.copies.append(("d2h", nbytes, self._inside(self.pinned, dst, nbytes)))
        ctypes.memmove(dst, src, nbytes)
        return (0,)

    def cudaStreamSynchronize(self, stream: int) -> tuple[int]:
        self.syncs += 1
        return (0,)

    def cudaStreamDestroy(self, stream: int) -> tuple[int]:
        self.streams_destroyed.append(stream)
        return (0,)


class SumEngine:
    """A TensorRT 10 engine: input x [-1, 16, 16, 3] uint8 (profile 1..4), output y [-1, 4] float32 with
    y[b] = (sum of x[b], b, x[b, 0, 0, 0], 1). Its context reads and writes the addresses it is given."""

    num_io_tensors = 2

    def __init__(self, static: bool = False) -> None:
        self.static = static
        self.executions = 0

    def get_tensor_name(self, i: int) -> str:
        return ["x", "y"][i]

    def get_tensor_mode(self, name: str) -> str:
        return "INPUT" if name == "x" else "OUTPUT"

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        b = 2 if self.static else -1
        return (b, *SAMPLE) if name == "x" else (b, 4)

    def get_tensor_dtype(self, name: str) -> str:
        return "UINT8" if name == "x" else "FLOAT"

    def get_tensor_profile_shape(self, name: str, profile: int) -> list[tuple[int, ...]]:
        return [(1, *SAMPLE), (1, *SAMPLE), (MAX_BATCH, *SAMPLE)]

    def create_execution_context(self) -> Any:
        engine = self

        class Ctx:
            def __init__(self) -> None:
                self.shape: tuple[int, ...] | None = (2, *SAMPLE) if engine.static else None
                self.addresses: dict[str, int] = {}

            def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
                assert not engine.static
                if not (1 <= shape[0] <= MAX_BATCH and tuple(shape[1:]) == SAMPLE):
                    return False
                self.shape = tuple(shape)
                return True

            def get_tensor_shape(self, name: str) -> tuple[int, ...]:
                assert self.shape is not None, "output shapes need the input shape first"
                return self.shape if name == "x" else (self.shape[0], 4)

            def set_tensor_address(self, name: str, ptr: int) -> bool:
                self.addresses[name] = ptr
                return True

            def execute_async_v3(self, stream: int) -> bool:
                assert stream == 7 and self.shape is not None
                engine.executions += 1
                n = int(np.prod(self.shape))
                x = _view(self.addresses["x"], n).reshape(self.shape)
                y = _view(self.addresses["y"], self.shape[0] * 16).view(np.float32).reshape(self.shape[0], 4)
                for b in range(self.shape[0]):
                    y[b] = (x[b].sum(dtype=np.int64), b, x[b, 0, 0, 0], 1)
                return True

        return Ctx()


def load(cudart: MemCudart, engine: SumEngine | None = None) -> tuple[Any, SumEngine]:
    trt = FakeTrt(cudart, [])
    trt.engine = engine or SumEngine()
    rt = TensorRtRuntime(0, trt_module=trt, cudart_module=cudart)
    return rt.load_engine(b"PLAN"), trt.engine


def frames(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, *SAMPLE), dtype=np.uint8)


def expected(x: np.ndarray) -> np.ndarray:
    return np.array(
        [(x[b].sum(dtype=np.int64), b, x[b, 0, 0, 0], 1) for b in range(len(x))], dtype=np.float32
    )


X_BYTES = MAX_BATCH * int(np.prod(SAMPLE))  # the input at the profile max
Y_BYTES = MAX_BATCH * 4 * 4


def test_pinned_buffers_at_the_profile_max_are_allocated_once_and_every_copy_goes_through_them() -> None:
    cudart = MemCudart()
    engine, fake = load(cudart)
    assert engine.host_memory == "pinned" and engine.pinned_problem is None
    assert sorted(cudart.host_allocs) == sorted([X_BYTES, Y_BYTES])  # sized to max_batch, at load
    assert sorted(cudart.device_allocs) == sorted([X_BYTES, Y_BYTES])
    assert engine.max_shapes == {"x": (MAX_BATCH, *SAMPLE), "y": (MAX_BATCH, 4)}
    results = []
    for i, n in enumerate([1, MAX_BATCH, 2, 3, 1]):  # a larger batch than before: no reallocation
        x = frames(n, i)
        syncs = cudart.syncs
        results.append((x, engine.run(x)))
        assert cudart.syncs == syncs + 1, "one stream synchronize per run"
    assert len(cudart.host_allocs) == 2 and len(cudart.device_allocs) == 2
    assert fake.executions == 5
    for x, out in results:  # what came back went H2D, through the engine and D2H again
        assert np.array_equal(out["y"], expected(x))
    assert all(pinned for _, _, pinned in cudart.copies), "a copy from or to pageable memory"
    assert [k for k, _, _ in cudart.copies] == ["h2d", "d2h"] * 5
    assert [b for k, b, _ in cudart.copies if k == "h2d"] == [
        n * int(np.prod(SAMPLE)) for n in (1, 4, 2, 3, 1)
    ]
    # The caller owns what it got: the next run does not overwrite it.
    first_x, first = results[0]
    assert np.array_equal(first["y"], expected(first_x))


def test_a_non_contiguous_or_other_dtype_batch_lands_in_the_pinned_input_as_the_models_dtype() -> None:
    cudart = MemCudart()
    engine, _ = load(cudart)
    x = frames(2, 5)
    wide = np.asfortranarray(x.astype(np.int64))
    assert np.array_equal(engine.run(wide)["y"], expected(x))
    assert all(pinned for _, _, pinned in cudart.copies)


def test_close_frees_the_pinned_and_device_buffers_and_the_stream_once() -> None:
    cudart = MemCudart()
    engine, _ = load(cudart)
    engine.run(frames(1, 0))
    pinned, device = set(cudart.pinned), set(cudart.device)
    backend = TensorRtBackend(engine, precision="fp16", engine_file="e.engine")
    assert backend.host_memory == "pinned"
    backend.close()
    assert set(cudart.freed_host) == pinned and set(cudart.freed_device) == device
    assert cudart.pinned == {} and cudart.device == {} and cudart.streams_destroyed == [7]
    engine.close()  # twice: nothing freed twice (the fake asserts on a double free)
    assert len(cudart.freed_host) == 2 and cudart.streams_destroyed == [7]
    with pytest.raises(TrtError, match="closed"):
        engine.run(frames(1, 0))


def test_a_batch_past_the_profile_max_is_refused_without_allocating() -> None:
    cudart = MemCudart()
    engine, fake = load(cudart)
    with pytest.raises(TrtError, match="outside the engine's profile"):
        engine.run(frames(MAX_BATCH + 1, 0))
    assert len(cudart.host_allocs) == 2 and len(cudart.device_allocs) == 2 and fake.executions == 0


def test_a_static_engine_gets_buffers_of_its_own_shape_and_refuses_another() -> None:
    cudart = MemCudart()
    engine, _ = load(cudart, SumEngine(static=True))
    assert sorted(cudart.host_allocs) == sorted([2 * int(np.prod(SAMPLE)), 2 * 16])
    x = frames(2, 3)
    assert np.array_equal(engine.run(x)["y"], expected(x))
    with pytest.raises(TrtError, match="is not the engine's"):
        engine.run(frames(1, 3))


def test_pinned_allocation_failure_falls_back_to_pageable_buffers_with_the_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cudart = MemCudart(host_ok=1)  # the input's pinned buffer is granted, the output's is not
    with caplog.at_level(logging.WARNING, logger="edge_agent.inference.tensorrt.runtime"):
        engine, _ = load(cudart)
    assert engine.host_memory == "pageable"
    assert engine.pinned_problem is not None and "cudaMallocHost failed" in engine.pinned_problem
    assert "cudaErrorMemoryAllocation" in engine.pinned_problem or "CUDA error: 2" in engine.pinned_problem
    assert any("pageable host buffers" in r.getMessage() for r in caplog.records)
    assert cudart.pinned == {} and len(cudart.freed_host) == 1  # the one granted went back: all or none
    for i, n in enumerate([1, 3]):
        x = frames(n, i)
        assert np.array_equal(engine.run(x)["y"], expected(x))
    assert not any(pinned for _, _, pinned in cudart.copies)
    assert len(cudart.device_allocs) == 2  # the pageable buffers are made once too
    engine.close()
    assert len(cudart.freed_host) == 1


def test_a_cuda_python_without_cuda_malloc_host_falls_back_too() -> None:
    class OldCudart(MemCudart):
        cudaMallocHost = None  # type: ignore[assignment]

    cudart = OldCudart()
    engine, _ = load(cudart)
    assert engine.host_memory == "pageable" and "TypeError" in (engine.pinned_problem or "")
    x = frames(2, 9)
    assert np.array_equal(engine.run(x)["y"], expected(x))
