"""Turn raw model outputs into detections in original-frame pixels; pure numpy, no runtime.

One decoder per output layout (``fleet_protocol.messages.DecoderKind``), chosen by the model's
manifest. Every decoder validates the shapes it is given against the manifest and raises
``ValueError`` naming what it expected, so a wrong model or a broken export is reported by the agent
instead of producing garbage boxes. NaN in an output is an error too: NaN compares false with any
threshold, so it would silently turn into "nothing detected".

Box coordinates from the model are in model-input pixels (or normalized to the model input); the
``FrameMeta`` of each frame (from ``fleet_protocol.vision.preprocess``) undoes the resize and letterbox.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleet_protocol.messages import DecoderKind, ModelManifest
from fleet_protocol.vision.preprocess import FrameMeta

log = logging.getLogger(__name__)

MAX_DETECTIONS = 300
# Candidates kept (by score) before NMS: bounds the O(n * kept) NMS when a low threshold lets
# thousands of anchors through.
MAX_CANDIDATES = 3000

TF_OD_OUTPUTS = {
    "num_detections": "num_detections:0",
    "boxes": "detection_boxes:0",
    "scores": "detection_scores:0",
    "classes": "detection_classes:0",
}


@dataclass(frozen=True, slots=True)
class RawDetection:
    class_id: int  # index into manifest.labels
    score: float
    # Pixels in the ORIGINAL frame, clipped to it.
    x0: float
    y0: float
    x1: float
    y1: float


Outputs = Mapping[str, np.ndarray]
Decoder = Callable[[ModelManifest, Outputs, Sequence[FrameMeta], float], list[list[RawDetection]]]


def decode(
    manifest: ModelManifest, outputs: Outputs, metas: Sequence[FrameMeta], threshold: float
) -> list[list[RawDetection]]:
    """Detections per batch item (one list per meta), best first, scores >= threshold."""
    if not metas:
        raise ValueError("decode needs at least one FrameMeta")
    try:
        decoder = _DECODERS[DecoderKind(manifest.decoder)]
    except (KeyError, ValueError):
        raise ValueError(f"no decoder for kind {manifest.decoder!r}") from None
    return decoder(manifest, outputs, metas, threshold)


# --------------------------------------------------------------------------- shared helpers


def _param(manifest: ModelManifest, key: str, default: Any) -> Any:
    return manifest.decoder_params.get(key, default)


def _output(outputs: Outputs, name: str) -> np.ndarray:
    try:
        arr = outputs[name]
    except KeyError:
        raise ValueError(f"model output {name!r} missing (got {sorted(outputs)})") from None
    arr = np.asarray(arr)
    _check_finite(name, arr)
    return arr


def _check_finite(name: str, arr: np.ndarray) -> None:
    if arr.size == 0 or arr.dtype.kind not in "fc":
        return
    # A max/min reduction propagates NaN and costs no temporary array, unlike isnan(arr).any().
    hi, lo = arr.max(), arr.min()
    if np.isnan(hi) or np.isnan(lo):
        raise ValueError(f"model output contains NaN ({name!r})")
    if np.isinf(hi) or np.isinf(lo):
        raise ValueError(f"model output contains infinite values ({name!r})")


def _expect(name: str, arr: np.ndarray, expected: Sequence[int | None], what: str) -> None:
    ok = arr.ndim == len(expected) and all(
        e is None or e == s for e, s in zip(expected, arr.shape, strict=True)
    )
    if not ok:
        shown = ", ".join("*" if e is None else str(e) for e in expected)
        raise ValueError(f"output {name!r}: expected shape [{shown}] ({what}), got {list(arr.shape)}")


def _single_output(manifest: ModelManifest, outputs: Outputs) -> str:
    """The output a single-tensor (YOLO) model's predictions are in."""
    name = _param(manifest, "output", None)
    if isinstance(name, str):
        return name
    if len(outputs) == 1:
        return next(iter(outputs))
    for candidate in manifest.outputs:
        if candidate in outputs:
            return candidate
    raise ValueError(
        f"cannot tell which of the outputs {sorted(outputs)} holds the predictions; "
        "set decoder_params.output or manifest.outputs"
    )


def _to_frame(boxes: np.ndarray, meta: FrameMeta) -> np.ndarray:
    """Model-input pixel boxes [N, 4] (x0, y0, x1, y1) to clipped original-frame pixels."""
    out = np.empty_like(boxes, dtype=np.float64)
    out[:, 0::2] = (boxes[:, 0::2] - meta.pad_x) / meta.scale_x
    out[:, 1::2] = (boxes[:, 1::2] - meta.pad_y) / meta.scale_y
    np.clip(out[:, 0::2], 0.0, float(meta.width), out=out[:, 0::2])
    np.clip(out[:, 1::2], 0.0, float(meta.height), out=out[:, 1::2])
    return out


def nms(boxes: np.ndarray, scores: np.ndarray, iou: float, max_keep: int = MAX_DETECTIONS) -> np.ndarray:
    """Greedy NMS; indices of the kept boxes, best first. Vectorised over the remaining boxes."""
    order = np.argsort(-scores, kind="stable")
    x0, y0, x1, y1 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
    areas = np.maximum(x1 - x0, 0.0) * np.maximum(y1 - y0, 0.0)
    keep: list[int] = []
    while order.size and len(keep) < max_keep:
        i = int(order[0])
        keep.append(i)
        rest = order[1:]
        iw = np.maximum(np.minimum(x1[i], x1[rest]) - np.maximum(x0[i], x0[rest]), 0.0)
        ih = np.maximum(np.minimum(y1[i], y1[rest]) - np.maximum(y0[i], y0[rest]), 0.0)
        inter = iw * ih
        union = areas[i] + areas[rest] - inter
        overlap = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
        order = rest[overlap <= iou]
    return np.asarray(keep, dtype=np.intp)


def batched_nms(
    boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, iou: float, max_keep: int = MAX_DETECTIONS
) -> np.ndarray:
    """Class-aware NMS: boxes of different classes never suppress each other."""
    if boxes.shape[0] == 0:
        return np.empty(0, dtype=np.intp)
    # Shifting each class into its own disjoint region makes one NMS pass class-aware.
    span = float(boxes.max()) + 1.0
    shifted = boxes + (classes.astype(np.float64) * span)[:, None]
    return nms(shifted, scores, iou, max_keep)


def _finish(
    boxes_in: np.ndarray,
    scores: np.ndarray,
    classes: np.ndarray,
    meta: FrameMeta,
    iou: float | None,
    max_det: int,
) -> list[RawDetection]:
    """Map to the frame, drop boxes that vanish on clipping (e.g. in letterbox padding), NMS."""
    if boxes_in.shape[0] > MAX_CANDIDATES:
        top = np.argpartition(-scores, MAX_CANDIDATES)[:MAX_CANDIDATES]
        boxes_in, scores, classes = boxes_in[top], scores[top], classes[top]
    boxes = _to_frame(boxes_in, meta)
    visible = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    boxes, scores, classes = boxes[visible], scores[visible], classes[visible]
    if iou is None:
        keep = np.argsort(-scores, kind="stable")[:max_det]
    else:
        keep = batched_nms(boxes, scores, classes, iou, max_det)
    return [
        RawDetection(
            class_id=int(classes[k]),
            score=float(scores[k]),
            x0=float(boxes[k, 0]),
            y0=float(boxes[k, 1]),
            x1=float(boxes[k, 2]),
            y1=float(boxes[k, 3]),
        )
        for k in keep
    ]


def _batch_dim(name: str, arr: np.ndarray, metas: Sequence[FrameMeta]) -> None:
    if arr.ndim == 0 or arr.shape[0] != len(metas):
        got = list(arr.shape)
        raise ValueError(f"output {name!r}: expected a leading batch dimension of {len(metas)}, got {got}")


# --------------------------------------------------------------------------- TF Object Detection API


def decode_tf_od(
    manifest: ModelManifest, outputs: Outputs, metas: Sequence[FrameMeta], threshold: float
) -> list[list[RawDetection]]:
    """num_detections [B], boxes [B,N,4] (y0,x0,y1,x1 normalized), scores [B,N], classes [B,N].

    The graph already ran NMS; boxes are normalized to the image tensor it was fed, which is the
    model-input size of the manifest (the graph resizes internally), so the meta maps them on.
    """
    names = {k: str(_param(manifest, k, v)) for k, v in TF_OD_OUTPUTS.items()}
    num = _output(outputs, names["num_detections"])
    boxes = _output(outputs, names["boxes"])
    scores = _output(outputs, names["scores"])
    classes = _output(outputs, names["classes"])
    b = len(metas)
    _expect(names["num_detections"], num, [b], "batch")
    _expect(names["boxes"], boxes, [b, None, 4], "batch, detections, y0 x0 y1 x1")
    n = boxes.shape[1]
    _expect(names["scores"], scores, [b, n], "batch, detections")
    _expect(names["classes"], classes, [b, n], "batch, detections")
    offset = int(_param(manifest, "class_offset", 0))
    max_det = int(_param(manifest, "max_detections", MAX_DETECTIONS))
    n_labels = len(manifest.labels)
    in_w, in_h = manifest.input.width, manifest.input.height
    results: list[list[RawDetection]] = []
    for i, meta in enumerate(metas):
        count = int(min(max(num[i], 0), n))
        sc = scores[i, :count]
        cls = np.rint(classes[i, :count]).astype(np.int64) - offset
        keep = (sc >= threshold) & (cls >= 0) & (cls < n_labels)
        if np.any((cls < 0) | (cls >= n_labels)):
            log.debug("tf_od: dropped detections with class ids outside the %d labels", n_labels)
        bx = boxes[i, :count][keep].astype(np.float64)
        xyxy = np.stack([bx[:, 1] * in_w, bx[:, 0] * in_h, bx[:, 3] * in_w, bx[:, 2] * in_h], axis=1)
        # Already NMS'd in the graph; only order and cap.
        results.append(_finish(xyxy, sc[keep].astype(np.float64), cls[keep], meta, None, max_det))
    return results


# --------------------------------------------------------------------------- NanoDet GFL head


def decode_gfl(
    manifest: ModelManifest, outputs: Outputs, metas: Sequence[FrameMeta], threshold: float
) -> list[list[RawDetection]]:
    """Per stride: class scores [B,N,C] (already sigmoid) and box distributions [B,N,4*(reg_max+1)].

    A softmax over each side's bins, its expectation times the stride, is the distance from the cell
    centre ((i + 0.5) * stride) to the left, top, right and bottom edge. Each (cell, class) pair over
    the threshold is a candidate (as NanoDet's multiclass NMS does); class-wise NMS follows.
    """
    strides = [int(s) for s in _param(manifest, "strides", [8, 16, 32])]
    reg_max = int(_param(manifest, "reg_max", 7))
    cls_names = [str(n) for n in _param(manifest, "cls_outputs", [])]
    reg_names = [str(n) for n in _param(manifest, "reg_outputs", [])]
    if len(cls_names) != len(strides) or len(reg_names) != len(strides):
        raise ValueError(
            f"gfl: decoder_params needs cls_outputs and reg_outputs with one name per stride {strides}"
        )
    max_det = int(_param(manifest, "max_detections", MAX_DETECTIONS))
    n_cls = len(manifest.labels)
    bins = reg_max + 1
    in_w, in_h = manifest.input.width, manifest.input.height
    b = len(metas)
    levels = []
    for stride, cname, rname in zip(strides, cls_names, reg_names, strict=True):
        gw, gh = -(-in_w // stride), -(-in_h // stride)
        cls = _output(outputs, cname)
        reg = _output(outputs, rname)
        _expect(cname, cls, [b, gw * gh, n_cls], f"batch, {gw}x{gh} cells at stride {stride}, classes")
        _expect(
            rname, reg, [b, gw * gh, 4 * bins], f"batch, {gw}x{gh} cells at stride {stride}, 4x{bins} bins"
        )
        levels.append((stride, gw, cls, reg))
    project = np.arange(bins, dtype=np.float32)
    results: list[list[RawDetection]] = []
    for i, meta in enumerate(metas):
        all_boxes, all_scores, all_cls = [], [], []
        for stride, gw, cls, reg in levels:
            # Threshold first, on each cell's best class (a contiguous reduction, much cheaper than
            # nonzero over all cells x classes); only the few cells over it pay for the softmax.
            hot = np.flatnonzero(cls[i].max(axis=1) >= threshold)
            if hot.size == 0:
                continue
            sub, labels = np.nonzero(cls[i, hot] >= threshold)
            cells = hot[sub]
            logits = reg[i, cells].reshape(-1, 4, bins).astype(np.float32)
            logits = logits - logits.max(axis=2, keepdims=True)
            prob = np.exp(logits)
            dist = (prob @ project) / prob.sum(axis=2) * stride
            cy, cx = np.divmod(cells, gw)
            cxf = (cx + 0.5) * stride
            cyf = (cy + 0.5) * stride
            all_boxes.append(
                np.stack([cxf - dist[:, 0], cyf - dist[:, 1], cxf + dist[:, 2], cyf + dist[:, 3]], axis=1)
            )
            all_scores.append(cls[i, cells, labels].astype(np.float64))
            all_cls.append(labels)
        if not all_boxes:
            results.append([])
            continue
        results.append(
            _finish(
                np.concatenate(all_boxes).astype(np.float64),
                np.concatenate(all_scores),
                np.concatenate(all_cls),
                meta,
                manifest.nms_iou,
                max_det,
            )
        )
    return results


# --------------------------------------------------------------------------- YOLO


def _xywh_to_xyxy(p: np.ndarray) -> np.ndarray:
    half_w, half_h = p[:, 2] / 2.0, p[:, 3] / 2.0
    return np.stack([p[:, 0] - half_w, p[:, 1] - half_h, p[:, 0] + half_w, p[:, 1] + half_h], axis=1)


def decode_yolov5(
    manifest: ModelManifest, outputs: Outputs, metas: Sequence[FrameMeta], threshold: float
) -> list[list[RawDetection]]:
    """[B, N, 5+C]: cx, cy, w, h (model-input pixels), objectness, class probabilities.

    score = objectness * best class probability (one class per box, as Ultralytics' default).
    """
    name = _single_output(manifest, outputs)
    pred = _output(outputs, name)
    n_cls = len(manifest.labels)
    _expect(name, pred, [len(metas), None, 5 + n_cls], f"batch, boxes, 5+{n_cls} (cx cy w h obj classes)")
    max_det = int(_param(manifest, "max_detections", MAX_DETECTIONS))
    results: list[list[RawDetection]] = []
    for i, meta in enumerate(metas):
        p = pred[i]
        # obj * cls <= obj, so rows with low objectness can never pass: skip them cheaply.
        p = p[p[:, 4] >= threshold]
        cls_scores = p[:, 5:] * p[:, 4:5]
        best = cls_scores.argmax(axis=1) if p.shape[0] else np.empty(0, dtype=np.intp)
        score = cls_scores[np.arange(p.shape[0]), best].astype(np.float64)
        keep = score >= threshold
        results.append(
            _finish(
                _xywh_to_xyxy(p[keep, :4].astype(np.float64)),
                score[keep],
                best[keep],
                meta,
                manifest.nms_iou,
                max_det,
            )
        )
    return results


def decode_yolov8(
    manifest: ModelManifest, outputs: Outputs, metas: Sequence[FrameMeta], threshold: float
) -> list[list[RawDetection]]:
    """[B, 4+C, N]: cx, cy, w, h (model-input pixels), class scores; no objectness (also YOLO11)."""
    name = _single_output(manifest, outputs)
    pred = _output(outputs, name)
    n_cls = len(manifest.labels)
    _expect(name, pred, [len(metas), 4 + n_cls, None], f"batch, 4+{n_cls} (cx cy w h classes), boxes")
    max_det = int(_param(manifest, "max_detections", MAX_DETECTIONS))
    results: list[list[RawDetection]] = []
    for i, meta in enumerate(metas):
        p = pred[i]
        cls_scores = p[4:]
        best = cls_scores.argmax(axis=0)
        score = cls_scores[best, np.arange(p.shape[1])]
        keep = np.nonzero(score >= threshold)[0]
        results.append(
            _finish(
                _xywh_to_xyxy(p[:4, keep].T.astype(np.float64)),
                score[keep].astype(np.float64),
                best[keep],
                meta,
                manifest.nms_iou,
                max_det,
            )
        )
    return results


_DECODERS: dict[DecoderKind, Decoder] = {
    DecoderKind.TF_OD: decode_tf_od,
    DecoderKind.GFL: decode_gfl,
    DecoderKind.YOLOV5: decode_yolov5,
    DecoderKind.YOLOV8: decode_yolov8,
}
