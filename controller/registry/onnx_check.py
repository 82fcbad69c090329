"""Validation of an uploaded ONNX model, and the manifest inferred from its graph when none is given.

Checks, in order: it parses as ONNX, it carries no external data (every weight inside the one file),
the dense size of its initializers and constants is under a cap (a few-KB file can declare a sparse
tensor of 2^62 elements, which agents and the variant builder would materialise), ``onnx.checker``
passes, shape inference passes, and its input/output layout is one a decoder knows (``tf_od``, ``gfl``,
``yolov5``, ``yolov8``), or, with a manifest, the names it declares exist and its input width/height
match the graph's where the graph's input size is static. Once the input size is known, every tensor
the graph computes must fit under the same cap (:func:`check_computed_sizes`).
Every failure is a :class:`ModelRejectedError` whose message names the problem.

``onnx`` is imported inside the functions: the controller's other parts start without it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from controller.registry.bundled import ModelRejectedError

log = logging.getLogger(__name__)

TF_OD_OUTPUTS = ("num_detections", "detection_boxes", "detection_scores", "detection_classes")
# TF-OD label maps are COCO's 90 ids (1-based): 91 generic labels when no manifest names them.
TF_OD_DEFAULT_CLASSES = 91
TF_OD_DEFAULT_SIZE = 300
NANODET_MEAN = (103.53, 116.28, 123.675)
NANODET_STD = (57.375, 57.12, 58.395)


class ModelTooLargeError(ModelRejectedError):
    """The model would take more memory than the cap once its tensors are materialised."""


def load_checked(path: Path, *, max_dense_bytes: int | None = None) -> Any:
    """The model at ``path`` after every structural check; raises ModelRejectedError naming the problem
    (:class:`ModelTooLargeError` when its tensors' dense size is over ``max_dense_bytes``)."""
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise ModelRejectedError(f"not an ONNX model: {_short(exc)}") from None
    if not model.graph.node and not model.graph.output:
        raise ModelRejectedError("not an ONNX model: the graph is empty")
    external = external_data_tensors(model)
    if external:
        raise ModelRejectedError(
            "the model uses external data files, which are not accepted (upload one self-contained "
            f"file): {', '.join(external[:5])}"
        )
    if max_dense_bytes is not None:
        dense, biggest = dense_bytes(model)
        if dense > max_dense_bytes:
            raise ModelTooLargeError(
                f"the model's initializers and constants take {dense} bytes when dense (sparse ones at "
                f"their dense size; largest: {biggest}), over the limit of {max_dense_bytes} bytes "
                "(max_model_dense_bytes)"
            )
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ModelRejectedError(f"ONNX checker refused the model: {_short(exc)}") from None
    try:
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except Exception as exc:
        raise ModelRejectedError(f"ONNX shape inference failed: {_short(exc)}") from None
    return model


def external_data_tensors(model: Any) -> list[str]:
    """``name -> location`` of every tensor (subgraphs included) whose data lives outside the file."""
    import onnx

    found: list[str] = []
    for t in _all_tensors(model.graph):
        if t.data_location == onnx.TensorProto.EXTERNAL or len(t.external_data):
            where = next((e.value for e in t.external_data if e.key == "location"), "?")
            found.append(f"{t.name or '<unnamed>'} -> {where}")
    return found


def dense_bytes(model: Any) -> tuple[int, str]:
    """Bytes every initializer and constant tensor (subgraphs included) takes once materialised, sparse
    ones at their dense size, and the largest one's name; from the declared shapes, so a tensor that
    declares more than it carries counts at what it declares. Python ints: no overflow."""
    total, biggest, biggest_n = 0, "-", -1
    for name, n in _dense_sizes(model.graph):
        total += n
        if n > biggest_n:
            biggest, biggest_n = f"{name or '<unnamed>'} ({n} bytes)", n
    return total, biggest


def _dense_sizes(graph: Any) -> Iterator[tuple[str, int]]:
    import onnx

    for t in graph.initializer:
        yield t.name, _tensor_bytes(t, t.dims)
    for sp in graph.sparse_initializer:
        yield sp.values.name, _tensor_bytes(sp.values, sp.dims)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t.name or node.name, _tensor_bytes(attr.t, attr.t.dims)
            elif attr.type == onnx.AttributeProto.SPARSE_TENSOR:
                yield (
                    attr.sparse_tensor.values.name or node.name,
                    _tensor_bytes(attr.sparse_tensor.values, attr.sparse_tensor.dims),
                )
            elif attr.type == onnx.AttributeProto.TENSORS:
                for t in attr.tensors:
                    yield t.name or node.name, _tensor_bytes(t, t.dims)
            elif attr.type == onnx.AttributeProto.SPARSE_TENSORS:
                for sp in attr.sparse_tensors:
                    yield sp.values.name or node.name, _tensor_bytes(sp.values, sp.dims)
            elif attr.type == onnx.AttributeProto.GRAPH:
                yield from _dense_sizes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _dense_sizes(g)


def _tensor_bytes(tensor: Any, dims: Any) -> int:
    """Dense bytes of a tensor of shape ``dims`` with ``tensor``'s element type (strings: their bytes)."""
    import onnx

    if tensor.data_type == onnx.TensorProto.STRING:
        return sum(len(b) for b in tensor.string_data)
    elements = math.prod(int(d) for d in dims)
    if elements < 0:
        raise ModelRejectedError(
            f"tensor {tensor.name or '<unnamed>'!r} has a negative dimension {list(dims)}"
        )
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except Exception:
        itemsize = 8  # an element type numpy does not know: count it at the widest
    return elements * max(1, itemsize)


def check_computed_sizes(model: Any, spec: Any, *, max_dense_bytes: int) -> None:
    """Every tensor the graph computes must fit in ``max_dense_bytes`` as shape inference sizes it.

    A graph can compute far more than it stores (``ConstantOfShape`` of a constant ``[134217728]`` is
    half a gigabyte from a few hundred bytes of file), and the variant builder and every device would
    allocate it. The image input's free dimensions are first fixed to what the builder and the devices
    feed (batch 1, the manifest's ``spec`` width and height, 3 channels), and inference runs with data
    propagation, so a shape computed from constants or from the input's shape (``ConstantOfShape``,
    ``Expand``, ``Tile``, ``Range``, ``Reshape``, ``Shape`` arithmetic) gets concrete dimensions.

    A dimension that stays unknown depends on the input's values (``NonZero``, a shape computed from
    pixels, a loop's trip count) and cannot be judged here: such a tensor is not counted, and what
    holds it is the variant build's child process and its address-space limit
    (``variant_build_memory_bytes``), which fails the build with that reason.
    Raises :class:`ModelTooLargeError` naming the largest tensor over the cap.
    """
    import onnx

    fixed = _without_weights(model)
    _fix_image_dims(fixed, spec)
    try:
        inferred = onnx.shape_inference.infer_shapes(
            fixed, check_type=False, strict_mode=False, data_prop=True
        )
    except Exception as exc:  # strict inference passed in load_checked; this pass is the extra one
        log.warning("shape inference with data propagation failed (%s); computed sizes not checked", exc)
        return
    name, dims, elem, size = max(_computed_sizes(inferred.graph), key=lambda t: t[3], default=("", [], 0, 0))
    if size > max_dense_bytes:
        kind = onnx.TensorProto.DataType.Name(elem).lower()
        raise ModelTooLargeError(
            f"the model computes tensor {name!r} of shape {dims} ({kind}): {size} bytes, over the limit "
            f"of {max_dense_bytes} bytes (max_model_dense_bytes)"
        )


# Initializers larger than this are weights, not shapes: shape inference needs only their type and shape.
_SHAPE_TENSOR_MAX_BYTES = 64 * 1024


def _without_weights(model: Any) -> Any:
    """A copy of ``model`` whose large top-level initializers are graph inputs of the same type and shape:
    what data propagation reads (small shape tensors) stays, and the copies shape inference makes do
    not hold the weights again."""
    import onnx

    light = onnx.ModelProto()
    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    graph, g = model.graph, light.graph
    g.name = graph.name
    g.node.extend(graph.node)
    g.input.extend(graph.input)
    g.output.extend(graph.output)
    g.value_info.extend(graph.value_info)
    g.sparse_initializer.extend(graph.sparse_initializer)
    inputs = {i.name for i in graph.input}
    for t in graph.initializer:
        if _tensor_bytes(t, t.dims) <= _SHAPE_TENSOR_MAX_BYTES:
            g.initializer.append(t)
        elif t.name not in inputs:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return light


def _fix_image_dims(model: Any, spec: Any) -> None:
    inp = next((i for i in model.graph.input if i.name == spec.name), None)
    if inp is None or len(inp.type.tensor_type.shape.dim) != 4:
        return
    order = (1, 3, spec.height, spec.width) if spec.layout == "NCHW" else (1, spec.height, spec.width, 3)
    for dim, value in zip(inp.type.tensor_type.shape.dim, order, strict=True):
        if not (dim.HasField("dim_value") and dim.dim_value > 0):
            dim.dim_value = value


def _computed_sizes(graph: Any) -> Iterator[tuple[str, list[int], int, int]]:
    """``(name, dims, element type, bytes)`` of every value of ``graph`` and its subgraphs whose shape
    shape inference fully knows."""
    import onnx

    for vi in (*graph.value_info, *graph.output):
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or not tt.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        if any(d is None or d < 0 for d in dims):
            continue
        known = [int(d) for d in dims if d is not None]
        try:
            itemsize = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).itemsize
        except Exception:
            itemsize = 8  # strings and types numpy does not know: counted at the widest
        yield vi.name, known, tt.elem_type, math.prod(known) * max(1, itemsize)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _computed_sizes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _computed_sizes(g)


def check_input_size(model: Any, spec: Any) -> None:
    """The manifest's input width/height (``spec``: an InputSpec) must be the graph's where it is static."""
    inputs, _ = _graph_io(model)
    inp = next((i for i in inputs if i.name == spec.name), None)
    if inp is None:
        return  # check_manifest_names reports it
    dims = _dims(inp)
    if len(dims) != 4:
        return
    height, width = (dims[2], dims[3]) if spec.layout == "NCHW" else (dims[1], dims[2])
    wrong = [
        f"{what} {given} (the model's is {static})"
        for what, given, static in (("width", spec.width, width), ("height", spec.height, height))
        if static is not None and given != static
    ]
    if wrong:
        raise ModelRejectedError(
            f"manifest input {' and '.join(wrong)}: input {inp.name!r} has the static shape {dims} "
            f"({spec.layout})"
        )


def _all_tensors(graph: Any) -> Iterator[Any]:
    import onnx

    yield from graph.initializer
    yield from (s.values for s in graph.sparse_initializer)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t
            elif attr.type == onnx.AttributeProto.TENSORS:
                yield from attr.tensors
            elif attr.type == onnx.AttributeProto.GRAPH:
                yield from _all_tensors(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _all_tensors(g)


def _dims(value_info: Any) -> list[int | None]:
    return [
        d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
        for d in value_info.type.tensor_type.shape.dim
    ]


def _graph_io(model: Any) -> tuple[list[Any], list[Any]]:
    inits = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    return inputs, list(model.graph.output)


def check_manifest_names(model: Any, manifest: dict[str, Any]) -> None:
    """The input and outputs a given manifest names must exist in the graph."""
    inputs, outputs = _graph_io(model)
    in_names = {i.name for i in inputs}
    out_names = {o.name for o in outputs}
    want_in = (manifest.get("input") or {}).get("name")
    if want_in not in in_names:
        raise ModelRejectedError(
            f"manifest input {want_in!r} is not an input of the model (inputs: {sorted(in_names)})"
        )
    missing = [o for o in manifest.get("outputs") or [] if o not in out_names]
    if missing:
        raise ModelRejectedError(
            f"manifest outputs {missing} are not outputs of the model (outputs: {sorted(out_names)})"
        )


def infer_manifest(model: Any) -> dict[str, Any]:
    """Decoder, input spec, outputs and labels read from the graph (no name/version/sha256/size)."""
    import onnx

    inputs, outputs = _graph_io(model)
    if len(inputs) != 1:
        raise ModelRejectedError(
            f"cannot infer the model's layout: it has {len(inputs)} inputs, one image input is expected "
            "(give a manifest)"
        )
    inp = inputs[0]
    elem = inp.type.tensor_type.elem_type
    dtype = {onnx.TensorProto.UINT8: "uint8", onnx.TensorProto.FLOAT: "float32"}.get(elem)
    if dtype is None:
        raise ModelRejectedError(
            f"input {inp.name!r} has element type {onnx.TensorProto.DataType.Name(elem)}; "
            "uint8 or float32 images are expected"
        )
    dims = _dims(inp)
    if len(dims) != 4:
        raise ModelRejectedError(f"input {inp.name!r} has rank {len(dims)}; a 4-D image batch is expected")
    if dims[1] == 3:
        layout, height, width = "NCHW", dims[2], dims[3]
    elif dims[3] == 3:
        layout, height, width = "NHWC", dims[1], dims[2]
    else:
        raise ModelRejectedError(
            f"input {inp.name!r} has shape {dims}: no 3-channel NCHW or NHWC layout found"
        )
    out_names = [o.name for o in outputs]

    # TF Object Detection API: recognised by its four output names (their shapes are dynamic).
    tf_od = [next((n for n in out_names if n.split(":")[0].endswith(k)), None) for k in TF_OD_OUTPUTS]
    if all(tf_od):
        size_h, size_w = height or TF_OD_DEFAULT_SIZE, width or TF_OD_DEFAULT_SIZE
        return _manifest(
            "tf_od",
            inp.name,
            layout,
            dtype,
            "RGB",
            size_w,
            size_h,
            outputs=[str(n) for n in tf_od],
            labels=TF_OD_DEFAULT_CLASSES,
            decoder_params={
                "num_detections": tf_od[0],
                "boxes": tf_od[1],
                "scores": tf_od[2],
                "classes": tf_od[3],
                "class_offset": 1,
            },
        )
    if height is None or width is None:
        raise ModelRejectedError(
            f"input {inp.name!r} has a dynamic size {dims}; give a manifest with the input width/height"
        )
    float_norm = dtype == "float32"
    if len(outputs) == 1:
        od = _dims(outputs[0])
        if len(od) == 3 and od[1] is not None and od[2] is not None:
            a, b = od[1], od[2]
            # [B, 4+C, N] is YOLOv8/11, [B, N, 5+C] YOLOv5: same preprocessing, different head.
            yolo = ("yolov8", a - 4) if a < b and a > 4 else ("yolov5", b - 5) if b < a and b > 5 else None
            if yolo is not None:
                return _manifest(
                    yolo[0],
                    inp.name,
                    layout,
                    dtype,
                    "RGB",
                    width,
                    height,
                    outputs=out_names,
                    labels=yolo[1],
                    std=(255.0, 255.0, 255.0) if float_norm else (1.0, 1.0, 1.0),
                    letterbox=True,
                    default_threshold=0.25,
                    nms_iou=0.45,
                )
    gfl = _infer_gfl(outputs, width, height)
    if gfl is not None:
        strides, reg_max, cls_names, reg_names, classes = gfl
        return _manifest(
            "gfl",
            inp.name,
            layout,
            dtype,
            "BGR",
            width,
            height,
            outputs=cls_names + reg_names,
            labels=classes,
            mean=NANODET_MEAN if float_norm else (0.0, 0.0, 0.0),
            std=NANODET_STD if float_norm else (1.0, 1.0, 1.0),
            default_threshold=0.35,
            nms_iou=0.6,
            decoder_params={
                "strides": strides,
                "reg_max": reg_max,
                "cls_outputs": cls_names,
                "reg_outputs": reg_names,
            },
        )
    shapes = {o.name: _dims(o) for o in outputs}
    raise ModelRejectedError(
        "output layout not recognised by any decoder (tf_od, gfl, yolov5, yolov8): "
        f"outputs {shapes}; give a manifest naming the decoder"
    )


def _infer_gfl(
    outputs: list[Any], width: int, height: int
) -> tuple[list[int], int, list[str], list[str], int] | None:
    """NanoDet GFL: per stride a class map [B, cells, C] and a box distribution [B, cells, 4*(R+1)]."""
    by_cells: dict[int, list[tuple[str, int]]] = {}
    for o in outputs:
        d = _dims(o)
        if len(d) != 3 or d[1] is None or d[2] is None:
            return None
        by_cells.setdefault(d[1], []).append((o.name, d[2]))
    if len(by_cells) < 2 or any(len(v) != 2 for v in by_cells.values()):
        return None
    strides: list[int] = []
    cls_names: list[str] = []
    reg_names: list[str] = []
    classes: set[int] = set()
    reg_bins: set[int] = set()
    for cells, pair in sorted(by_cells.items(), reverse=True):  # most cells = smallest stride first
        stride = round(math.sqrt(width * height / cells))
        if stride <= 0 or math.ceil(width / stride) * math.ceil(height / stride) != cells:
            return None
        regs = [p for p in pair if p[1] % 4 == 0]
        if not regs:
            return None
        reg = min(regs, key=lambda p: p[1])
        cls = next(p for p in pair if p is not reg)
        strides.append(stride)
        reg_names.append(reg[0])
        cls_names.append(cls[0])
        classes.add(cls[1])
        reg_bins.add(reg[1] // 4)
    if len(classes) != 1 or len(reg_bins) != 1:
        return None
    return strides, reg_bins.pop() - 1, cls_names, reg_names, classes.pop()


def _manifest(
    decoder: str,
    input_name: str,
    layout: str,
    dtype: str,
    color: str,
    width: int,
    height: int,
    *,
    outputs: list[str],
    labels: int,
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0),
    std: tuple[float, float, float] = (1.0, 1.0, 1.0),
    letterbox: bool = False,
    default_threshold: float = 0.5,
    nms_iou: float = 0.5,
    decoder_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "decoder": decoder,
        "input": {
            "name": input_name,
            "layout": layout,
            "dtype": dtype,
            "color": color,
            "width": width,
            "height": height,
            "mean": list(mean),
            "std": list(std),
            "letterbox": letterbox,
        },
        "outputs": outputs,
        "labels": [f"class_{i}" for i in range(max(1, labels))],
        "default_threshold": default_threshold,
        "nms_iou": nms_iou,
        "decoder_params": decoder_params or {},
        "source": "layout inferred from the ONNX graph at upload",
    }


def _short(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"
