"""What a graph computes is sized at upload: over max_model_dense_bytes it is refused, naming the tensor."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from controller.registry.onnx_check import ModelTooLargeError, check_computed_sizes
from fleet_protocol.messages import InputSpec
from tests.support.onnx_models import yolov8_like
from tests.support.upload_bombs import SIZE, constant_of_shape_bomb, data_dependent_bomb

MiB = 1024**2
DEFAULT_CAP = 2 * 1024**3  # the setting's default
SPEC = InputSpec(name="images", layout="NCHW", dtype="float32", color="RGB", width=SIZE, height=SIZE)


def _load(raw: bytes) -> Any:
    return onnx.load_from_string(raw)


def _graph(nodes: list[Any], inits: list[Any], out: str, *, dims: list[Any], opset: int = 13) -> Any:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _i64(name: str, values: list[int]) -> Any:
    return numpy_helper.from_array(np.array(values, dtype=np.int64), name)


def test_the_constant_of_shape_bomb_is_refused_naming_the_tensor_and_the_setting() -> None:
    model = _load(constant_of_shape_bomb(134_217_728))
    with pytest.raises(ModelTooLargeError) as err:
        check_computed_sizes(model, SPEC, max_dense_bytes=256 * MiB)
    assert "'big' of shape [134217728] (float): 536870912 bytes" in str(err.value)
    assert "max_model_dense_bytes" in str(err.value)
    # Under the default cap its half gigabyte is allowed: the build's child process holds it then.
    check_computed_sizes(model, SPEC, max_dense_bytes=DEFAULT_CAP)


def test_a_shape_computed_from_the_input_is_sized_at_the_manifests_input_size() -> None:
    # The graph's input has free height and width; the builder and the devices feed the manifest's.
    model = _graph(
        [
            helper.make_node("Shape", ["images"], ["shape"]),
            helper.make_node("Concat", ["shape", "more"], ["bigger"], axis=0),
            helper.make_node("ConstantOfShape", ["bigger"], ["big"]),
        ],
        [_i64("more", [1000, 1000])],
        "big",
        dims=[1, 3, "height", "width"],
    )
    with pytest.raises(ModelTooLargeError, match=r"'big' of shape \[1, 3, 64, 64, 1000, 1000\]"):
        check_computed_sizes(model, SPEC, max_dense_bytes=DEFAULT_CAP)


@pytest.mark.parametrize(
    ("node", "inits", "shape"),
    [
        (
            helper.make_node("Expand", ["images", "to"], ["out"]),
            [_i64("to", [100000, 3, 64, 64])],
            "[100000, 3, 64, 64]",
        ),
        (
            helper.make_node("Tile", ["images", "reps"], ["out"]),
            [_i64("reps", [1, 1, 1000, 1000])],
            "[1, 3, 64000, 64000]",
        ),
        (
            helper.make_node("Range", ["start", "limit", "delta"], ["out"]),
            [
                numpy_helper.from_array(np.array(0.0, np.float32), "start"),
                numpy_helper.from_array(np.array(1e9, np.float32), "limit"),
                numpy_helper.from_array(np.array(1.0, np.float32), "delta"),
            ],
            "[1000000000]",
        ),
    ],
    ids=["expand", "tile", "range"],
)
def test_expand_tile_and_range_of_constants_are_sized(node: Any, inits: list[Any], shape: str) -> None:
    model = _graph([node], inits, "out", dims=[1, 3, SIZE, SIZE])
    with pytest.raises(ModelTooLargeError) as err:
        check_computed_sizes(model, SPEC, max_dense_bytes=256 * MiB)
    assert f"'out' of shape {shape}" in str(err.value)


def test_a_size_that_depends_on_pixel_values_cannot_be_judged_and_is_let_through() -> None:
    # Documented: the variant build's child process and its memory limit hold this one.
    check_computed_sizes(_load(data_dependent_bomb(2**32)), SPEC, max_dense_bytes=256 * MiB)


def test_a_real_layout_model_passes() -> None:
    check_computed_sizes(_load(yolov8_like(size=SIZE)), SPEC, max_dense_bytes=1024**2)
