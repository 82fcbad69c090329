"""Uploads that are small on the wire and huge once unpacked or run, made on the spot (never committed).

* :func:`write_gzip_bomb_package`: an agent package whose wheel member is ``member_bytes`` of zeros,
  streamed through ``tarfile`` and ``gzip`` into a file (gzip packs zeros about 1000:1).
* :func:`constant_of_shape_bomb`: ``ConstantOfShape([elements])`` feeding ``ReduceSum``, added to a
  valid YOLOv8-layout output: a few hundred bytes of file, ``4 * elements`` bytes when run. Its shape
  is a constant, so shape inference sizes it at upload.
* :func:`data_dependent_bomb`: the same, but the element count is computed from the input's pixel
  values, so nothing can size it before it runs.
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from tests.support.agent_packages import MANIFEST, REQUIRES, wheel_name

SIZE = 64  # the image input of the bomb models, NCHW float


def write_gzip_bomb_package(path: Path, version: str, member_bytes: int) -> Path:
    """``path``: a package whose manifest is valid and whose wheel is ``member_bytes`` zeros."""
    info = {
        "format": 1,
        "version": version,
        "python": "3.11",
        "requires": list(REQUIRES),
        "wheel": f"wheels/{wheel_name(version)}",
    }
    raw = json.dumps(info).encode()

    class Zeros(io.RawIOBase):
        def __init__(self, n: int) -> None:
            self.left = n

        def readable(self) -> bool:
            return True

        def readinto(self, b: Any) -> int:
            n = min(len(b), self.left)
            b[:n] = bytes(n)
            self.left -= n
            return n

    with (
        path.open("wb") as fh,
        gzip.GzipFile(fileobj=fh, mode="wb", mtime=0, compresslevel=9) as gz,
        tarfile.open(fileobj=gz, mode="w") as tar,
    ):
        m = tarfile.TarInfo(MANIFEST)
        m.size = len(raw)
        tar.addfile(m, io.BytesIO(raw))
        w = tarfile.TarInfo(f"wheels/{wheel_name(version)}")
        w.size = member_bytes
        tar.addfile(w, io.BufferedReader(Zeros(member_bytes), buffer_size=1 << 20))
    return path


def _yolo_plus(extra_nodes: list[Any], extra_inits: list[Any], scalar: str) -> bytes:
    """``yolov8_like`` (one 8x8 stride conv, [1, 6, N] out) whose output adds ``scalar``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.full((6, 3, 8, 8), 0.01, dtype=np.float32), "w")
    shape = numpy_helper.from_array(np.array([1, 6, -1], dtype=np.int64), "yolo_shape")
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["images", "w"], ["feat"], strides=[8, 8]),
            helper.make_node("Reshape", ["feat", "yolo_shape"], ["head"]),
            *extra_nodes,
            helper.make_node("Add", ["head", scalar], ["output0"]),
        ],
        "bomb",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, SIZE, SIZE])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, 6, (SIZE // 8) ** 2])],
        [w, shape, *extra_inits],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def constant_of_shape_bomb(elements: int = 134_217_728) -> bytes:
    """``ConstantOfShape([elements]) -> ReduceSum``: ``4 * elements`` bytes of float32 when run."""
    from onnx import TensorProto, helper, numpy_helper

    count = numpy_helper.from_array(np.array([elements], dtype=np.int64), "count")
    return _yolo_plus(
        [
            helper.make_node(
                "ConstantOfShape",
                ["count"],
                ["big"],
                value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0]),
            ),
            helper.make_node("ReduceSum", ["big"], ["total"], keepdims=0),
        ],
        [count],
        "total",
    )


def data_dependent_bomb(elements: int = 2**32) -> bytes:
    """``ConstantOfShape`` of ``elements`` float32, the count computed from the pixels
    (``max(image) * 0 + elements``), so shape inference cannot size it."""
    from onnx import TensorProto, helper, numpy_helper

    return _yolo_plus(
        [
            helper.make_node("ReduceMax", ["images"], ["peak"], keepdims=0),
            helper.make_node("Mul", ["peak", "zero"], ["nothing"]),
            helper.make_node("Add", ["nothing", "many"], ["count_f"]),
            helper.make_node("Cast", ["count_f"], ["count_s"], to=TensorProto.INT64),
            helper.make_node("Reshape", ["count_s", "one_dim"], ["count"]),
            helper.make_node(
                "ConstantOfShape",
                ["count"],
                ["big"],
                value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0]),
            ),
            helper.make_node("ReduceSum", ["big"], ["total"], keepdims=0),
        ],
        [
            numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero"),
            numpy_helper.from_array(np.array(float(elements), dtype=np.float32), "many"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "one_dim"),
        ],
        "total",
    )
