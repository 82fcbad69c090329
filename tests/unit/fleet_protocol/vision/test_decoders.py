from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import cv2
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from fleet_protocol.messages import ModelManifest
from fleet_protocol.vision.decoders import RawDetection, batched_nms, decode
from fleet_protocol.vision.preprocess import FrameMeta, Preprocessor
from tests.support.paths import FOOTAGE, MODELS

LABELS = ["person", "car", "dog"]
SHA = "0" * 64


def _manifest(decoder: str, **kw: Any) -> ModelManifest:
    data: dict[str, Any] = {
        "name": "t",
        "version": "1",
        "sha256": SHA,
        "size": 1,
        "decoder": decoder,
        "input": {
            "name": "images",
            "layout": "NCHW",
            "dtype": "float32",
            "color": "RGB",
            "width": 320,
            "height": 320,
            "std": [255.0, 255.0, 255.0],
            "letterbox": True,
        },
        "labels": LABELS,
        "nms_iou": 0.5,
    }
    data.update(kw)
    return ModelManifest.model_validate(data)


def _boxes(dets: Sequence[RawDetection]) -> list[tuple[int, float, float, float, float]]:
    return [(d.class_id, d.x0, d.y0, d.x1, d.y1) for d in dets]


def _iou(a: Sequence[float], b: Sequence[float]) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


# --------------------------------------------------------------------------- YOLO through onnxruntime

# A 640x480 frame letterboxed into 320x320: scale 0.5, 40 px of padding above and below.
FRAME_W, FRAME_H = 640, 480
PERSON = (100.0, 100.0, 200.0, 300.0)  # frame pixels
CAR = (400.0, 200.0, 600.0, 400.0)


def _to_input_cxcywh(box: Sequence[float]) -> list[float]:
    x0, y0, x1, y1 = (box[0] * 0.5, box[1] * 0.5 + 40, box[2] * 0.5, box[3] * 0.5 + 40)
    return [(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0]


def _yolo_rows() -> list[tuple[list[float], float, list[float]]]:
    """(cx cy w h in model-input pixels, objectness, class probabilities) per predicted box."""
    person = _to_input_cxcywh(PERSON)
    shifted = [person[0] + 2, person[1] + 1, person[2], person[3]]
    return [
        (person, 0.9, [0.9, 0.05, 0.05]),  # person 0.81
        (shifted, 0.8, [0.9, 0.05, 0.05]),  # same person, 0.72: NMS removes it
        (_to_input_cxcywh(CAR), 0.95, [0.1, 0.8, 0.1]),  # car 0.76
        (person, 0.3, [0.9, 0.05, 0.05]),  # 0.27: under the threshold
        (person, 0.875, [0.1, 0.1, 0.8]),  # dog 0.70 on the person's box: another class, kept
        ([160.0, 10.0, 40.0, 10.0], 0.99, [0.99, 0.0, 0.0]),  # inside the letterbox padding: dropped
    ]


def _constant_model(preds: np.ndarray, transpose: bool) -> bytes:
    """An ONNX model taking a real image input and returning fixed predictions.

    With ``transpose`` the constant is stored [B, N, 4+C] and transposed to [B, 4+C, N] in the
    graph, the way Ultralytics' YOLOv8/11 exports end.
    """
    const = helper.make_node("Constant", [], ["preds"], value=numpy_helper.from_array(preds, "preds_value"))
    nodes = [const]
    out_shape = list(preds.shape)
    if transpose:
        nodes.append(helper.make_node("Transpose", ["preds"], ["output0"], perm=[0, 2, 1]))
        out_shape = [preds.shape[0], preds.shape[2], preds.shape[1]]
    else:
        nodes.append(helper.make_node("Identity", ["preds"], ["output0"]))
    graph = helper.make_graph(
        nodes,
        "yolo_stub",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 320, 320])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, out_shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _run_yolo(manifest: ModelManifest, model_bytes: bytes, threshold: float) -> list[RawDetection]:
    frame = np.full((FRAME_H, FRAME_W, 3), 90, dtype=np.uint8)
    batch, metas = Preprocessor(manifest.input).batch([frame])
    assert metas[0] == FrameMeta(width=640, height=480, scale_x=0.5, scale_y=0.5, pad_x=0.0, pad_y=40.0)
    session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    outputs = dict(zip(names, session.run(None, {"images": batch}), strict=True))
    [dets] = decode(manifest, outputs, metas, threshold)
    return dets


def _check_yolo_result(dets: list[RawDetection]) -> None:
    assert [(d.class_id, round(d.score, 3)) for d in dets] == [(0, 0.81), (1, 0.76), (2, 0.7)]
    np.testing.assert_allclose([[d.x0, d.y0, d.x1, d.y1] for d in dets], [PERSON, CAR, PERSON], atol=1e-3)


def test_yolov5_onnx_boxes_come_back_in_frame_pixels_nms_and_threshold() -> None:
    rows = [[*box, obj, *cls] for box, obj, cls in _yolo_rows()]
    preds = np.asarray([rows], dtype=np.float32)  # [1, 6, 5+3]
    manifest = _manifest("yolov5")
    _check_yolo_result(_run_yolo(manifest, _constant_model(preds, transpose=False), 0.5))


def test_yolov8_onnx_boxes_come_back_in_frame_pixels_nms_and_threshold() -> None:
    # YOLOv8 has no objectness: fold it into the class scores for the same expected result.
    rows = [[*box, *(obj * c for c in cls)] for box, obj, cls in _yolo_rows()]
    preds = np.asarray([rows], dtype=np.float32)  # [1, 6, 4+3], transposed in the graph
    manifest = _manifest("yolov8")
    _check_yolo_result(_run_yolo(manifest, _constant_model(preds, transpose=True), 0.5))


def test_yolo_threshold_is_the_callers() -> None:
    rows = [[*box, *(obj * c for c in cls)] for box, obj, cls in _yolo_rows()]
    pred = np.asarray([rows], dtype=np.float32).transpose(0, 2, 1)
    meta = FrameMeta(width=640, height=480, scale_x=0.5, scale_y=0.5, pad_y=40.0)
    [high] = decode(_manifest("yolov8"), {"output0": pred}, [meta], 0.8)
    assert [d.score for d in high] == pytest.approx([0.81])
    [low] = decode(_manifest("yolov8"), {"output0": pred}, [meta], 0.2)
    # The 0.27 duplicate of the person is suppressed by the 0.81 one, not returned.
    assert sorted(round(d.score, 2) for d in low) == [0.7, 0.76, 0.81]


def test_yolov8_batch_items_use_their_own_meta() -> None:
    box = [50.0, 50.0, 20.0, 20.0, 0.9, 0.0, 0.0]  # input box 40..60 in both axes
    pred = np.asarray([[box], [box]], dtype=np.float32).transpose(0, 2, 1)  # [2, 7, 1]
    metas = [
        FrameMeta(width=100, height=100, scale_x=1.0, scale_y=1.0),
        FrameMeta(width=400, height=200, scale_x=0.25, scale_y=0.5, pad_x=0.0, pad_y=0.0),
    ]
    a, b = decode(_manifest("yolov8"), {"output0": pred}, metas, 0.5)
    assert _boxes(a) == [(0, 40.0, 40.0, 60.0, 60.0)]
    assert _boxes(b) == [(0, 160.0, 80.0, 240.0, 120.0)]


def test_yolo_boxes_are_clipped_to_the_frame() -> None:
    pred = np.asarray([[[95.0, 5.0, 20.0, 20.0, 0.9, 0.9, 0.0, 0.0]]], dtype=np.float32)
    meta = FrameMeta(width=100, height=100, scale_x=1.0, scale_y=1.0)
    [[det]] = decode(_manifest("yolov5"), {"output0": pred}, [meta], 0.5)
    assert (det.x0, det.y0, det.x1, det.y1) == (85.0, 0.0, 100.0, 15.0)


def test_yolo_output_chosen_by_decoder_params_when_several() -> None:
    pred = np.asarray([[[50.0, 50.0, 20.0, 20.0, 0.9, 0.9, 0.0, 0.0]]], dtype=np.float32)
    meta = FrameMeta(width=100, height=100, scale_x=1.0, scale_y=1.0)
    outputs = {"proto": np.zeros((1, 32, 8, 8), np.float32), "det": pred}
    with pytest.raises(ValueError, match="which of the outputs"):
        decode(_manifest("yolov5"), outputs, [meta], 0.5)
    [dets] = decode(_manifest("yolov5", decoder_params={"output": "det"}), outputs, [meta], 0.5)
    assert len(dets) == 1
    [dets] = decode(_manifest("yolov5", outputs=["det", "proto"]), outputs, [meta], 0.5)
    assert len(dets) == 1


@pytest.mark.parametrize(
    ("decoder", "shape", "expected"),
    [
        ("yolov5", (1, 10, 7), "5\\+3"),  # one class too few
        ("yolov8", (1, 10, 7), "4\\+3"),  # [B, N, 4+C] instead of [B, 4+C, N]
        ("yolov8", (1, 7), "expected shape"),
        ("yolov5", (2, 10, 8), "expected shape"),  # batch 2 for one meta
    ],
)
def test_yolo_wrong_shapes_raise(decoder: str, shape: tuple[int, ...], expected: str) -> None:
    meta = FrameMeta(width=100, height=100, scale_x=1.0, scale_y=1.0)
    with pytest.raises(ValueError, match=expected):
        decode(_manifest(decoder), {"output0": np.zeros(shape, np.float32)}, [meta], 0.5)


@pytest.mark.parametrize("decoder", ["yolov5", "yolov8"])
def test_nan_output_raises(decoder: str) -> None:
    shape = (1, 4, 8) if decoder == "yolov5" else (1, 7, 4)
    pred = np.full(shape, 0.9, dtype=np.float32)
    pred.flat[5] = np.nan
    meta = FrameMeta(width=100, height=100, scale_x=1.0, scale_y=1.0)
    with pytest.raises(ValueError, match="model output contains NaN"):
        decode(_manifest(decoder), {"output0": pred}, [meta], 0.5)


# --------------------------------------------------------------------------- TF Object Detection API


def _tf_od_manifest() -> ModelManifest:
    return _manifest(
        "tf_od",
        input={
            "name": "image_tensor:0",
            "layout": "NHWC",
            "dtype": "uint8",
            "color": "RGB",
            "width": 300,
            "height": 300,
        },
        labels=["person"],
        decoder_params={"class_offset": 1},
    )


def _tf_od_outputs(num: list[float], boxes: Any, scores: Any, classes: Any) -> dict[str, np.ndarray]:
    return {
        "num_detections:0": np.asarray(num, np.float32),
        "detection_boxes:0": np.asarray(boxes, np.float32),
        "detection_scores:0": np.asarray(scores, np.float32),
        "detection_classes:0": np.asarray(classes, np.float32),
    }


def test_tf_od_normalized_yxyx_to_frame_pixels_with_class_offset() -> None:
    boxes = [
        [[0.1, 0.2, 0.5, 0.4], [0.0, 0.0, 1.0, 1.0], [0.3, 0.3, 0.4, 0.4], [0.2, 0.2, 0.3, 0.3]],
        [[0.5, 0.5, 0.75, 1.0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],
    ]
    scores = [[0.9, 0.3, 0.8, 0.95], [0.7, 0.0, 0.0, 0.0]]
    # Item 0: second box under threshold, third has class 2 (no such label), fourth is past
    # num_detections (padding the graph leaves undefined).
    classes = [[1, 1, 2, 1], [1, 0, 0, 0]]
    metas = [
        FrameMeta(width=768, height=576, scale_x=300 / 768, scale_y=300 / 576),
        # A 600x300 frame letterboxed into 300x300: scale 0.5, 75 px of padding above.
        FrameMeta(width=600, height=300, scale_x=0.5, scale_y=0.5, pad_y=75.0),
    ]
    a, b = decode(_tf_od_manifest(), _tf_od_outputs([3, 1], boxes, scores, classes), metas, 0.5)
    assert len(a) == 1 and a[0].class_id == 0 and a[0].score == pytest.approx(0.9)
    np.testing.assert_allclose([a[0].x0, a[0].y0, a[0].x1, a[0].y1], [153.6, 57.6, 307.2, 288.0], atol=1e-3)
    np.testing.assert_allclose(_boxes(b)[0], (0, 300.0, 150.0, 600.0, 300.0), atol=1e-3)


def test_tf_od_orders_best_first_and_keeps_overlaps() -> None:
    # The graph already ran NMS; the decoder must not drop its overlapping results.
    boxes = [[[0.1, 0.1, 0.5, 0.5], [0.1, 0.1, 0.5, 0.52]]]
    dets = decode(
        _tf_od_manifest(),
        _tf_od_outputs([2], boxes, [[0.6, 0.9]], [[1, 1]]),
        [FrameMeta(width=300, height=300, scale_x=1.0, scale_y=1.0)],
        0.5,
    )[0]
    assert [round(d.score, 2) for d in dets] == [0.9, 0.6]


def test_tf_od_missing_output_and_nan_raise() -> None:
    meta = FrameMeta(width=300, height=300, scale_x=1.0, scale_y=1.0)
    outputs = _tf_od_outputs([1], [[[0.1, 0.1, 0.2, 0.2]]], [[0.9]], [[1]])
    del outputs["detection_scores:0"]
    with pytest.raises(ValueError, match="detection_scores:0"):
        decode(_tf_od_manifest(), outputs, [meta], 0.5)
    nan = _tf_od_outputs([1], [[[0.1, 0.1, 0.2, 0.2]]], [[np.nan]], [[1]])
    with pytest.raises(ValueError, match="model output contains NaN"):
        decode(_tf_od_manifest(), nan, [meta], 0.5)
    bad = _tf_od_outputs([1], [[[0.1, 0.1, 0.2]]], [[0.9]], [[1]])
    with pytest.raises(ValueError, match="y0 x0 y1 x1"):
        decode(_tf_od_manifest(), bad, [meta], 0.5)


# --------------------------------------------------------------------------- GFL (NanoDet)

BIG = 50.0  # a logit this much above the others takes all the softmax mass


def _gfl_manifest() -> ModelManifest:
    return _manifest(
        "gfl",
        input={"name": "in", "layout": "NCHW", "dtype": "float32", "color": "BGR", "width": 64, "height": 64},
        labels=["person", "car"],
        decoder_params={
            "strides": [8, 16],
            "reg_max": 3,
            "cls_outputs": ["cls8", "cls16"],
            "reg_outputs": ["reg8", "reg16"],
        },
    )


def _side(*weights_at_bins: int) -> list[float]:
    """Logits of one side's 4 bins, with equal mass on the given bins."""
    logits = [0.0] * 4
    for b in weights_at_bins:
        logits[b] = BIG
    return logits


def _gfl_outputs() -> dict[str, np.ndarray]:
    cls8 = np.zeros((1, 64, 2), np.float32)
    reg8 = np.zeros((1, 64, 16), np.float32)
    cls16 = np.zeros((1, 16, 2), np.float32)
    reg16 = np.zeros((1, 16, 16), np.float32)
    # Stride 8, row 2, column 3: centre (28, 20). Distances l, t, r, b = 1.5, 2, 3, 1 bins.
    cell = 2 * 8 + 3
    cls8[0, cell, 0] = 0.9
    reg8[0, cell] = _side(1, 2) + _side(2) + _side(3) + _side(1)
    # Stride 16, row 0, column 1: centre (24, 8); l, t, r, b = 0.5, 0, 1.5, 1.5 bins -> (16, 8, 48, 32),
    # overlapping the first box (IoU 0.65): as a person it is suppressed, as a car it stays.
    cell16 = 0 * 4 + 1
    cls16[0, cell16] = [0.6, 0.7]
    reg16[0, cell16] = _side(0, 1) + _side(0) + _side(1, 2) + _side(1, 2)
    return {"cls8": cls8, "reg8": reg8, "cls16": cls16, "reg16": reg16}


def test_gfl_distribution_expectation_cell_centres_and_class_wise_nms() -> None:
    meta = FrameMeta(width=128, height=128, scale_x=0.5, scale_y=0.5)
    [dets] = decode(_gfl_manifest(), _gfl_outputs(), [meta], 0.5)
    # Model input: person (28 - 12, 20 - 16, 28 + 24, 20 + 8) = (16, 4, 52, 28); doubled into the frame.
    assert [(d.class_id, round(d.score, 2)) for d in dets] == [(0, 0.9), (1, 0.7)]
    np.testing.assert_allclose(_boxes(dets)[0], (0, 32.0, 8.0, 104.0, 56.0), atol=1e-3)
    np.testing.assert_allclose(_boxes(dets)[1], (1, 32.0, 16.0, 96.0, 64.0), atol=1e-3)
    # The stride-16 person (0.6) overlaps the 0.9 one by IoU > 0.5 and is gone.
    assert _iou((32.0, 8.0, 104.0, 56.0), (32.0, 16.0, 96.0, 64.0)) > 0.5


def test_gfl_threshold_and_empty() -> None:
    meta = FrameMeta(width=64, height=64, scale_x=1.0, scale_y=1.0)
    [dets] = decode(_gfl_manifest(), _gfl_outputs(), [meta], 0.95)
    assert dets == []


def test_gfl_wrong_shapes_and_nan_raise() -> None:
    meta = FrameMeta(width=64, height=64, scale_x=1.0, scale_y=1.0)
    outputs = _gfl_outputs()
    outputs["cls16"] = np.zeros((1, 15, 2), np.float32)
    with pytest.raises(ValueError, match="4x4 cells at stride 16"):
        decode(_gfl_manifest(), outputs, [meta], 0.5)
    outputs = _gfl_outputs()
    outputs["reg8"] = np.zeros((1, 64, 44), np.float32)
    with pytest.raises(ValueError, match="4x4 bins"):
        decode(_gfl_manifest(), outputs, [meta], 0.5)
    outputs = _gfl_outputs()
    outputs["reg8"][0, 19, 0] = np.nan
    with pytest.raises(ValueError, match="model output contains NaN"):
        decode(_gfl_manifest(), outputs, [meta], 0.5)
    with pytest.raises(ValueError, match="decoder_params"):
        decode(_manifest("gfl"), _gfl_outputs(), [meta], 0.5)


def test_batched_nms_is_class_aware_and_capped() -> None:
    boxes = np.array([[0, 0, 10, 10], [1, 1, 11, 11], [0, 0, 10, 10], [50, 50, 60, 60]], dtype=np.float64)
    scores = np.array([0.9, 0.8, 0.7, 0.6])
    classes = np.array([0, 0, 1, 0])
    assert batched_nms(boxes, scores, classes, 0.5).tolist() == [0, 2, 3]
    assert batched_nms(boxes, scores, classes, 0.5, max_keep=2).tolist() == [0, 2]
    # At a high IoU bar the near-duplicate (IoU 0.68) survives.
    assert batched_nms(boxes, scores, classes, 0.9).tolist() == [0, 1, 2, 3]


# --------------------------------------------------------------------------- the bundled real models


@functools.cache
def _vtest_frames() -> list[np.ndarray]:
    cap = cv2.VideoCapture(str(FOOTAGE))
    frames: list[np.ndarray] = []
    try:
        for i in range(81):
            ok, frame = cap.read()
            assert ok, f"could not read frame {i} of {FOOTAGE}"
            if i % 40 == 0:
                frames.append(frame)
    finally:
        cap.release()
    return frames


@functools.cache
def _bundled(name: str) -> tuple[ModelManifest, ort.InferenceSession]:
    manifest = ModelManifest.model_validate_json((MODELS / name / "manifest.json").read_text())
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    session = ort.InferenceSession(
        str(MODELS / name / "model.onnx"), sess_options=opts, providers=["CPUExecutionProvider"]
    )
    return manifest, session


def _detect(name: str, frame: np.ndarray) -> list[RawDetection]:
    manifest, session = _bundled(name)
    batch, metas = Preprocessor(manifest.input).batch([frame])
    names = [o.name for o in session.get_outputs()]
    outputs = dict(zip(names, session.run(None, {manifest.input.name: batch}), strict=True))
    [dets] = decode(manifest, outputs, metas, manifest.default_threshold)
    return dets


def test_ped_ssdlite_finds_pedestrians_on_vtest() -> None:
    for frame in _vtest_frames():
        dets = _detect("ped_ssdlite", frame)
        assert 2 <= len(dets) <= 6, dets
        for d in dets:
            assert d.class_id == 0 and d.score >= 0.5
            w, h = d.x1 - d.x0, d.y1 - d.y0
            # Upright people of the size vtest.avi shows, inside the 768x576 frame.
            assert 0 <= d.x0 < d.x1 <= 768 and 0 <= d.y0 < d.y1 <= 576
            assert 15 <= w <= 150 and 40 <= h <= 250 and h > w, d


def test_nanodet_coco_finds_persons_on_vtest() -> None:
    manifest, _ = _bundled("nanodet_coco")
    dets = _detect("nanodet_coco", _vtest_frames()[0])
    persons = [d for d in dets if manifest.labels[d.class_id] == "person"]
    assert len(persons) >= 2
    for d in persons:
        assert d.score >= manifest.default_threshold
        assert d.y1 - d.y0 > d.x1 - d.x0  # upright


def test_gfl_and_tf_od_agree_on_the_same_pedestrians() -> None:
    # Two unrelated models, two decoders: boxes that overlap are evidence that the GFL geometry
    # (cell centres, bin expectation, stride scaling, meta) is right, not just plausible.
    nano_manifest, _ = _bundled("nanodet_coco")
    for frame in _vtest_frames()[:2]:
        ssd = [(d.x0, d.y0, d.x1, d.y1) for d in _detect("ped_ssdlite", frame)]
        nano = [
            (d.x0, d.y0, d.x1, d.y1)
            for d in _detect("nanodet_coco", frame)
            if nano_manifest.labels[d.class_id] == "person"
        ]
        matched = [a for a in ssd if any(_iou(a, b) >= 0.5 for b in nano)]
        assert len(matched) >= 2, (ssd, nano)
