from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from edge_agent.inference.backend import BackendError
from edge_agent.inference.ort import OnnxRuntimeBackend
from edge_agent.inference.providers import choose_providers


def tiny_model(path: Path, batch: int | str) -> Path:
    """y = x + 1 over [batch, 3] float32."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3])
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    graph = helper.make_graph([helper.make_node("Add", ["x", "one"], ["y"])], "tiny", [x], [y], [one])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_cpu_provider_is_chosen_and_reported_when_gpus_are_absent(tmp_path: Path) -> None:
    be = OnnxRuntimeBackend(tiny_model(tmp_path / "m.onnx", "N"), threads=1)
    assert be.provider == "CPUExecutionProvider"
    assert be.input_name == "x" and be.dynamic_batch
    out = be.run(np.zeros((2, 3), np.float32))
    assert set(out) == {"y"} and np.allclose(out["y"], 1.0)
    be.close()


def test_fixed_batch_dimension_is_detected(tmp_path: Path) -> None:
    be = OnnxRuntimeBackend(tiny_model(tmp_path / "m.onnx", 1), threads=1)
    assert not be.dynamic_batch


def test_unloadable_file_raises_backend_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(BackendError, match=r"bad\.onnx"):
        OnnxRuntimeBackend(bad, threads=1)


def test_provider_preference_keeps_order_of_what_exists_and_ends_with_cpu() -> None:
    pref = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert choose_providers(pref, ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert (
        choose_providers(pref, ["CUDAExecutionProvider", "TensorrtExecutionProvider", "CPUExecutionProvider"])
        == pref
    )
    assert choose_providers(["CUDAExecutionProvider"], ["CUDAExecutionProvider", "CPUExecutionProvider"]) == [
        "CUDAExecutionProvider",
        "CPUExecutionProvider",
    ]
