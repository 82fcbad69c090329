"""Inference: the runtimes behind ``InferenceBackend``.

The interface and its errors (:mod:`.backend`); ONNX Runtime (CPU, CUDA and TensorRT execution
providers: :mod:`.providers`, :mod:`.ort`) and native TensorRT engines (:mod:`.tensorrt`) as peers,
chosen and built by :mod:`.factory`; engine builds in a child process (:mod:`.engine_build`), and the
check that the installed GPU stack is one the agent was written for (:mod:`.gpu_stack`). ``onnxruntime``,
``tensorrt`` and ``cuda`` are imported here (and ``device`` for NVML) and nowhere else, always inside
the function that needs them, so the wings above import with no extras installed. May import
``uplink``, ``core`` and ``fleet_protocol``.
"""
