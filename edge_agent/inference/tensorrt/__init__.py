"""Native TensorRT engines, split on the line between pure code and the hardware.

:mod:`.build_config` (precision, profiles, calibration batches, the INT8 check), :mod:`.cache`
(engine keys and the engine cache), :mod:`.backend` (getting an engine and running it) and
:mod:`.errors` run without TensorRT or a GPU; :mod:`.runtime` is the one module that needs
``tensorrt`` and ``cuda-python`` (imported inside the functions that use them).
"""
