"""What the opt-in GPU tests need, and what happens where it is missing.

Where tensorrt, cuda-python, a GPU or onnxruntime-gpu is missing, a test that needs it skips and says
why, so that the suite passes on the CPU machines it is developed on (tests/run.sh). On a machine that
is meant to have them, ``EDGEFLEET_REQUIRE_GPU=1`` turns every such skip into a failure:

    EDGEFLEET_REQUIRE_GPU=1 .venv/bin/pytest tests/gpu

The checks are called from the test bodies (not fixtures), so that a required GPU that is missing is
reported as a failed test, not as an error in its setup.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import NoReturn

import pytest

from edge_agent.inference.providers import CUDA_EP
from edge_agent.inference.tensorrt.runtime import TensorRtRuntime, _import_cudart, load_tensorrt_runtime

REQUIRE_ENV = "EDGEFLEET_REQUIRE_GPU"
INSTALL = "see the README's 'GPU install' (pip install -c docker/constraints-gpu-cu12.txt '.[gpu]')"


def gpu_missing(why: str) -> NoReturn:
    """Skip with ``why``, or fail with it where ``EDGEFLEET_REQUIRE_GPU=1`` says a GPU must be there."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{why} ({REQUIRE_ENV}=1: a GPU test may not skip)", pytrace=False)
    pytest.skip(f"{why}; {REQUIRE_ENV}=1 makes this a failure")


@functools.cache
def _load_trt_runtime() -> tuple[TensorRtRuntime | None, str]:
    """Once per test session: the runtime, or None and why not (the message the agent would log)."""
    try:
        importlib.import_module("tensorrt")
    except Exception as exc:  # ImportError, or a wheel whose libraries do not load
        return None, f"tensorrt is not importable ({type(exc).__name__}: {exc}); {INSTALL}"
    try:
        _import_cudart()  # how the agent imports cuda-python's runtime bindings (either layout)
    except Exception as exc:
        return None, f"cuda-python is not importable ({type(exc).__name__}: {exc}); {INSTALL}"
    rt, problem = load_tensorrt_runtime(0)  # no GPU or driver, or a TensorRT other than 10
    if rt is None:
        return None, f"the agent's TensorRT runtime cannot start here: {problem}"
    return rt, ""


def trt_runtime() -> TensorRtRuntime:
    """The agent's real TensorRT runtime (TensorRT 10 + cuda-python) on CUDA device 0, or skip/fail."""
    rt, why = _load_trt_runtime()
    if rt is None:
        gpu_missing(why)
    return rt


def require_ort_cuda() -> None:
    """onnxruntime-gpu with its CUDA execution provider compiled in (whether it works is the test's)."""
    try:
        import onnxruntime as ort
    except Exception as exc:
        why = f"onnxruntime is not importable ({type(exc).__name__}: {exc})"
    else:
        available = list(ort.get_available_providers())
        if CUDA_EP in available:
            return
        why = (
            f"this onnxruntime {ort.__version__} has no {CUDA_EP} (providers: {', '.join(available)}): "
            f"the CPU package, not onnxruntime-gpu; {INSTALL}"
        )
    gpu_missing(why)
