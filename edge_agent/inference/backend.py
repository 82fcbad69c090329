"""The interface every inference runtime offers, and the errors a caller must tell apart.

:class:`InferenceBackend` is what the pipeline runs batches through (onnxruntime in :mod:`.ort`, a
native TensorRT engine in :mod:`.tensorrt.backend`); :data:`BackendFactory` is what loads one.

- :class:`BackendError`: a model file could not be loaded into a backend.
- :class:`ProviderFallback` (a :class:`BackendError`): raised by ``OnnxRuntimeBackend.run()`` when the
  execution provider failed at run time and the session now runs on a lesser one. The batch is lost,
  the backend stays usable (``backend.provider`` already names the new provider): report it as an event.
- :class:`CudaFatalError` (not a :class:`BackendError`): a sticky CUDA error (illegal address, launch
  failure, ...). The CUDA context of this process is dead; every later load or run fails the same way.
  Raised by ``run()``, by ``AutoBackendFactory.make`` and by ``OnnxRuntimeBackend(...)``. Never retry
  or reload on it: publish a final event and exit with :data:`EXIT_CUDA_FATAL` so the service manager
  restarts the process. :func:`is_sticky_cuda_error` and :func:`cuda_fatal_from` recognise one in the
  spellings onnxruntime, cuda-python and TensorRT use.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

from fleet_protocol.messages import ModelManifest

EXIT_CUDA_FATAL = 4
"""The agent's exit status after a :class:`CudaFatalError` (0 ok, 2 bad config, 3 fatal link)."""


class InferenceBackend(Protocol):
    provider: str
    input_name: str
    input_shape: tuple[int | str | None, ...]
    dynamic_batch: bool

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


BackendFactory = Callable[[Path, ModelManifest], InferenceBackend]


def host_threads(backend: InferenceBackend) -> int:
    """The CPU threads a run of ``backend`` keeps busy while it runs on the CPU (its ``cpu_threads``,
    optional: a backend without it, like one on an accelerator, says 0), for the per-frame CPU cost
    the heartbeat reports."""
    threads = getattr(backend, "cpu_threads", 0)
    return threads if isinstance(threads, int) and threads > 0 else 0


class BackendError(Exception):
    """A model file could not be loaded into a backend."""


class ProviderFallback(BackendError):
    """The execution provider failed during ``run()``; the session now runs on ``provider``.

    The batch that failed is lost; the backend stays usable. ``previous`` is the provider it ran on,
    ``reason`` the provider's error.
    """

    def __init__(self, previous: str, provider: str, reason: str) -> None:
        super().__init__(f"{previous} failed at run time, now running on {provider}: {reason}")
        self.previous = previous
        self.provider = provider
        self.reason = reason


class CudaFatalError(RuntimeError):
    """A sticky CUDA error: the CUDA context of this process is unusable until the process restarts.

    CUDA Runtime API on cudaErrorIllegalAddress (700), LaunchTimeout (702), Assert (710),
    HardwareStackError (714), IllegalInstruction (715), MisalignedAddress (716), InvalidAddressSpace
    (717), InvalidPc (718), LaunchFailure (719): "This leaves the process in an inconsistent state and
    any further CUDA work will return the same error. To continue using CUDA, the process must be
    terminated and relaunched." Deliberately not a :class:`BackendError`, so that code that reloads on
    a BackendError does not catch it by accident.
    """

    exit_code = EXIT_CUDA_FATAL


# cudaError_t codes whose documentation says the process must be terminated and relaunched.
STICKY_CUDA_ERRORS = {
    700: (
        "cudaErrorIllegalAddress",
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "an illegal memory access was encountered",
    ),
    702: ("cudaErrorLaunchTimeout", "CUDA_ERROR_LAUNCH_TIMEOUT", "the launch timed out and was terminated"),
    710: ("cudaErrorAssert", "CUDA_ERROR_ASSERT", "device-side assert triggered"),
    714: ("cudaErrorHardwareStackError", "CUDA_ERROR_HARDWARE_STACK_ERROR", "hardware stack error"),
    715: (
        "cudaErrorIllegalInstruction",
        "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        "an illegal instruction was encountered",
    ),
    716: ("cudaErrorMisalignedAddress", "CUDA_ERROR_MISALIGNED_ADDRESS", "misaligned address"),
    717: (
        "cudaErrorInvalidAddressSpace",
        "CUDA_ERROR_INVALID_ADDRESS_SPACE",
        "operation not supported on global/shared address space",
    ),
    718: ("cudaErrorInvalidPc", "CUDA_ERROR_INVALID_PC", "invalid program counter"),
    719: ("cudaErrorLaunchFailure", "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"),
}


# onnxruntime's CUDA_CALL formats "CUDA failure <code>: <cudaGetErrorString> ; GPU=… ; expr=…"
# (core/providers/cuda/cuda_call.cc); cuBLAS/cuDNN failures say "CUBLAS failure"/"CUDNN failure".
_ORT_CUDA_FAILURE = re.compile(r"\bCUDA failure (\d+)\b")
_STICKY_TEXT = tuple(t.lower() for names in STICKY_CUDA_ERRORS.values() for t in names)


def _texts(exc: BaseException | str) -> list[str]:
    if isinstance(exc, str):
        return [exc]
    out: list[str] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:  # the error and its causes (TrtError from CUDA, ...)
        seen.add(id(cur))
        out.append(f"{type(cur).__name__}: {cur}")
        cur = cur.__cause__ or cur.__context__
    return out


def is_sticky_cuda_error(exc: BaseException | str) -> bool:
    """True when the error (or one of its causes) is a sticky CUDA error, in any of the spellings that
    reach Python: onnxruntime's "CUDA failure 700: …", cuda-python's ``cudaError_t.cudaErrorIllegalAddress``
    / ``CUresult.CUDA_ERROR_ILLEGAL_ADDRESS``, or TensorRT's "Cuda Runtime (an illegal memory access …)"."""
    for text in _texts(exc):
        for m in _ORT_CUDA_FAILURE.finditer(text):
            if int(m.group(1)) in STICKY_CUDA_ERRORS:
                return True
        low = text.lower()
        if any(t in low for t in _STICKY_TEXT):
            return True
    return False


def cuda_fatal_from(exc: BaseException, where: str) -> CudaFatalError | None:
    """A :class:`CudaFatalError` for ``exc`` when it is a sticky CUDA error, else None."""
    if isinstance(exc, CudaFatalError):
        return exc
    if not is_sticky_cuda_error(exc):
        return None
    return CudaFatalError(
        f"{where}: sticky CUDA error, the process must restart: {type(exc).__name__}: {exc}"
    )
