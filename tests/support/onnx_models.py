"""Tiny ONNX models built with onnx.helper for registry and activation tests."""

from __future__ import annotations

import numpy as np


def yolov8_like(classes: int = 2, size: int = 64) -> bytes:
    """A valid YOLOv8-layout model: float NCHW image in, ``[1, 4+classes, N]`` out, no manifest needed."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    ch = 4 + classes
    w = numpy_helper.from_array(np.full((ch, 3, 8, 8), 0.01, dtype=np.float32), "w")
    shape = numpy_helper.from_array(np.array([1, ch, -1], dtype=np.int64), "shape")
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["images", "w"], ["feat"], strides=[8, 8]),
            helper.make_node("Reshape", ["feat", "shape"], ["output0"]),
        ],
        "yolov8_like",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, ch, (size // 8) ** 2])],
        [w, shape],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def with_external_data() -> bytes:
    """A model whose weight claims to live in an external file."""
    from onnx import TensorProto, helper

    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[6, 3, 8, 8])
    w.data_location = TensorProto.EXTERNAL
    entry = w.external_data.add()
    entry.key, entry.value = "location", "../../etc/weights.bin"
    graph = helper.make_graph(
        [helper.make_node("Conv", ["images", "w"], ["out"], strides=[8, 8])],
        "external",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 64, 64])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 6, 8, 8])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def tf_od_nan(size: int = 300) -> bytes:
    """Loads and runs, with ped_ssdlite's TF-OD input/output names, but every score is NaN."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    consts = {
        "num_detections:0": np.array([10.0], dtype=np.float32),
        "detection_boxes:0": np.tile(np.array([0.1, 0.1, 0.5, 0.5], np.float32), (1, 10, 1)),
        "detection_scores:0": np.full((1, 10), np.nan, dtype=np.float32),
        "detection_classes:0": np.ones((1, 10), dtype=np.float32),
    }
    nodes = [helper.make_node("Cast", ["image_tensor:0"], ["as_float"], to=TensorProto.FLOAT)]
    nodes.append(helper.make_node("ReduceMax", ["as_float"], ["mx"], keepdims=0))
    nodes.append(helper.make_node("Mul", ["mx", "zero"], ["z"]))
    inits = [numpy_helper.from_array(np.array(0.0, np.float32), "zero")]
    outputs = []
    for name, arr in consts.items():
        c = f"c_{len(inits)}"
        inits.append(numpy_helper.from_array(arr, c))
        # Depend on the input so that the graph really runs per frame: out = const + 0 * max(image).
        nodes.append(helper.make_node("Add", [c, "z"], [name]))
        outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(arr.shape)))
    graph = helper.make_graph(
        nodes,
        "tf_od_nan",
        [helper.make_tensor_value_info("image_tensor:0", TensorProto.UINT8, [1, size, size, 3])],
        outputs,
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def retagged(base: bytes, tag: str) -> bytes:
    """``base`` with ``tag`` as its doc string: the same graph and outputs, another sha256 (a new version
    of a model that an agent must fetch and load as such)."""
    import onnx

    model = onnx.load_from_string(base)
    model.doc_string = tag
    return bytes(model.SerializeToString())


def tf_od_slow(base: bytes, *, steps: int = 64, rows: int = 256, width: int = 1024) -> bytes:
    """``base`` (a TF-OD model such as ped_ssdlite) with a heavy branch added: the same outputs, the same
    detections, but every frame also runs ``steps`` matrix products of ``[rows, width] x [width, width]``
    whose result only enters ``detection_scores:0`` multiplied by zero.

    The branch starts from the frame itself (``0 * max(image)``), so onnxruntime can neither fold it
    into a constant nor prune it; ``Tanh`` keeps it finite, so ``0 * x`` stays exactly 0.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load_from_string(base)
    g = model.graph
    image = g.input[0].name
    scores = "detection_scores:0"
    inner = "detection_scores_base"
    for node in g.node:
        node.output[:] = [inner if o == scores else o for o in node.output]
        node.input[:] = [inner if i == scores else i for i in node.input]
    rng = np.random.default_rng(0)
    g.initializer.extend(
        [
            numpy_helper.from_array(rng.standard_normal((rows, width)).astype(np.float32), "slow_a"),
            numpy_helper.from_array(
                (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32), "slow_w"
            ),
            numpy_helper.from_array(np.array(0.0, np.float32), "slow_zero"),
        ]
    )
    nodes = [
        helper.make_node("Cast", [image], ["slow_img"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMax", ["slow_img"], ["slow_mx"], keepdims=0),
        helper.make_node("Mul", ["slow_mx", "slow_zero"], ["slow_seed"]),
        helper.make_node("Add", ["slow_a", "slow_seed"], ["slow_x0"]),
    ]
    for i in range(steps):
        nodes.append(helper.make_node("MatMul", [f"slow_x{i}", "slow_w"], [f"slow_m{i}"]))
        nodes.append(helper.make_node("Tanh", [f"slow_m{i}"], [f"slow_x{i + 1}"]))
    nodes += [
        helper.make_node("ReduceMax", [f"slow_x{steps}"], ["slow_out"], keepdims=0),
        helper.make_node("Mul", ["slow_out", "slow_zero"], ["slow_nothing"]),
        helper.make_node("Add", [inner, "slow_nothing"], [scores]),
    ]
    g.node.extend(nodes)
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def with_sparse_bomb(elements_per_dim: int = 2**31, size: int = 64) -> bytes:
    """``yolov8_like`` plus a sparse initializer that carries one value but declares
    ``elements_per_dim`` x ``elements_per_dim`` floats: a few KB of file, exabytes once dense."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load_from_string(yolov8_like(size=size))
    values = helper.make_tensor("bomb", TensorProto.FLOAT, [1], [1.0])
    indices = helper.make_tensor("bomb_idx", TensorProto.INT64, [1], [0])
    sparse = helper.make_sparse_tensor(values, indices, [elements_per_dim, elements_per_dim])
    model.graph.sparse_initializer.append(sparse)
    return bytes(model.SerializeToString())
