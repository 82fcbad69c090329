"""The errors of the TensorRT path: building, loading and running engines."""

from __future__ import annotations


class TrtError(Exception):
    """TensorRT could not build or load an engine; the message says why."""


class BuildCancelled(TrtError):
    """The build was cancelled (the agent is stopping)."""


class UnsupportedEngine(TrtError):
    """The engine is fine but the native runner cannot run it (e.g. data-dependent output shapes).

    Not a reason to evict or rebuild: the same engine would fail the same way. The model runs on
    onnxruntime instead, and the reason is reported.
    """


class ProfileNotExpressible(TrtError):
    """The optimization profile cannot be passed to onnxruntime's TensorRT EP as provider options."""
