"""Controller-side reference preprocessing, decoding and detection matching for variant fidelity.

The controller must never import the agent (the wire contract is the only shared code), yet judging
an optimized variant means running it the way a device would and comparing its detections with the
FP32 model's. This module is that compact reference: preprocessing as an ``InputSpec`` describes it,
numpy decoders for the output layouts of ``DecoderKind``, and a greedy matcher that turns two lists
of detections into precision, recall, F1 and mean IoU.

Both the FP32 reference and every variant go through the same code here, so a small difference from
the agent's own implementation would cancel out of the comparison; it is still kept faithful (same
resize, colour order, normalization and box maths) so that the counts it reports are the agent's.
Only numpy is imported at module level; OpenCV is imported where frames are touched.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fleet_protocol.messages import DecoderKind, InputSpec, ModelManifest

log = logging.getLogger(__name__)

MATCH_IOU = 0.5  # a variant's detection counts as the reference's when IoU >= this, same class
MAX_DETECTIONS = 300
LETTERBOX_FILL = 114  # same grey as the agent and Ultralytics


@dataclass(frozen=True, slots=True)
class Geometry:
    """Maps model-input pixels back to the frame: ``x_frame = (x_input - pad_x) / scale_x``."""

    width: int
    height: int
    scale_x: float
    scale_y: float
    pad_x: float = 0.0
    pad_y: float = 0.0


@dataclass(frozen=True, slots=True)
class Det:
    """One detection in original-frame pixels."""

    class_id: int
    score: float
    x0: float
    y0: float
    x1: float
    y1: float


@dataclass(frozen=True, slots=True)
class Fidelity:
    """How well a variant's detections reproduce the reference's over a set of frames."""

    reference: int  # detections of the reference (FP32)
    candidate: int  # detections of the variant
    matched: int
    precision: float
    recall: float
    f1: float
    mean_iou: float | None  # over matched pairs; None when nothing matched


# --------------------------------------------------------------------------- frames


def read_footage_frames(footage: Path, calib: int, evaluation: int) -> tuple[list[Any], list[Any]]:
    """Calibration frames spread over the first half of the footage, evaluation over the second.

    Held-out evaluation matters: a quantizer calibrated on the very frames it is judged on would
    look better than it is on a camera's next hour of video.
    """
    import cv2

    cap = cv2.VideoCapture(str(footage))
    if not cap.isOpened():
        raise ValueError(f"cannot open footage {footage}")
    try:
        # Sequential reads: seeking in AVI/MP43 is slow and not frame-exact, and 800 frames decode
        # in about a second.
        frames = []
        while True:
            ok, frame = cap.read()
            if not ok:
                break
            frames.append(frame)
    finally:
        cap.release()
    n = len(frames)
    if n < 2:
        raise ValueError(f"footage {footage} has {n} frame(s); at least 2 are needed")
    half = n // 2

    def spread(lo: int, hi: int, count: int) -> list[Any]:
        count = max(0, min(count, hi - lo))
        if count == 0:
            return []
        idx = np.linspace(lo, hi - 1, count).round().astype(int)
        return [frames[i] for i in idx]

    return spread(0, half, calib), spread(half, n, evaluation)


# --------------------------------------------------------------------------- preprocessing


def preprocess(frame_bgr: np.ndarray, spec: InputSpec) -> tuple[np.ndarray, Geometry]:
    """One frame as a batch-of-one input tensor in the layout, dtype and colour the spec asks for."""
    import cv2

    fh, fw = frame_bgr.shape[:2]
    w, h = spec.width, spec.height
    if spec.letterbox:
        scale = min(w / fw, h / fh)
        nw, nh = max(1, min(w, round(fw * scale))), max(1, min(h, round(fh * scale)))
        px, py = (w - nw) // 2, (h - nh) // 2
        img: np.ndarray = np.full((h, w, 3), LETTERBOX_FILL, dtype=np.uint8)
        img[py : py + nh, px : px + nw] = cv2.resize(frame_bgr, (nw, nh), interpolation=cv2.INTER_LINEAR)
        geom = Geometry(fw, fh, nw / fw, nh / fh, float(px), float(py))
    else:
        img = cv2.resize(frame_bgr, (w, h), interpolation=cv2.INTER_LINEAR)
        geom = Geometry(fw, fh, w / fw, h / fh)
    if spec.color == "RGB":
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
    x: np.ndarray
    if spec.dtype == "float32":
        x = img.astype(np.float32)
        x = (x - np.asarray(spec.mean, dtype=np.float32)) / np.asarray(spec.std, dtype=np.float32)
    else:
        x = img
    if spec.layout == "NCHW":
        x = x.transpose(2, 0, 1)
    return np.ascontiguousarray(x)[None], geom


# --------------------------------------------------------------------------- decoding


def decode(
    manifest: ModelManifest, outputs: Mapping[str, np.ndarray], geom: Geometry, threshold: float
) -> list[Det]:
    """Detections of one frame (batch item 0), best first, score >= threshold, in frame pixels."""
    kind = DecoderKind(manifest.decoder)
    for name, arr in outputs.items():
        a = np.asarray(arr)
        # NaN compares false with any threshold and would read as "nothing detected": a variant
        # producing it must fail loudly, not look like an empty street.
        if a.dtype.kind == "f" and a.size and not np.isfinite(a).all():
            raise ValueError(f"output {name!r} contains NaN or infinite values")
    if kind is DecoderKind.TF_OD:
        return _decode_tf_od(manifest, outputs, geom, threshold)
    if kind is DecoderKind.GFL:
        return _decode_gfl(manifest, outputs, geom, threshold)
    if kind is DecoderKind.YOLOV5:
        return _decode_yolo(manifest, outputs, geom, threshold, v5=True)
    if kind is DecoderKind.YOLOV8:
        return _decode_yolo(manifest, outputs, geom, threshold, v5=False)
    raise ValueError(f"no reference decoder for {manifest.decoder!r}")


def _p(manifest: ModelManifest, key: str, default: Any) -> Any:
    return manifest.decoder_params.get(key, default)


def _out(outputs: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    if name not in outputs:
        raise ValueError(f"model output {name!r} missing (got {sorted(outputs)})")
    return np.asarray(outputs[name])


def _finish(
    boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, geom: Geometry, nms_iou: float | None
) -> list[Det]:
    """Model-input pixel boxes to clipped frame pixels, then class-aware NMS (or just order)."""
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4).copy()
    b[:, 0::2] = np.clip((b[:, 0::2] - geom.pad_x) / geom.scale_x, 0.0, geom.width)
    b[:, 1::2] = np.clip((b[:, 1::2] - geom.pad_y) / geom.scale_y, 0.0, geom.height)
    visible = (b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1])
    b, scores, classes = b[visible], scores[visible], classes[visible]
    keep = (
        np.argsort(-scores, kind="stable")[:MAX_DETECTIONS]
        if nms_iou is None
        else _nms(b, scores, classes, nms_iou)
    )
    return [Det(int(classes[k]), float(scores[k]), *(float(v) for v in b[k])) for k in keep]


def _nms(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, iou: float) -> list[int]:
    if boxes.shape[0] == 0:
        return []
    # Shifting each class into its own region makes one greedy pass class-aware.
    shifted = boxes + (classes.astype(np.float64) * (float(boxes.max()) + 1.0))[:, None]
    order = np.argsort(-scores, kind="stable")
    keep: list[int] = []
    while order.size and len(keep) < MAX_DETECTIONS:
        i = int(order[0])
        keep.append(i)
        rest = order[1:]
        over = iou_matrix(shifted[i : i + 1], shifted[rest])[0]
        order = rest[over <= iou]
    return keep


def _decode_tf_od(
    manifest: ModelManifest, outputs: Mapping[str, np.ndarray], geom: Geometry, threshold: float
) -> list[Det]:
    num = _out(outputs, str(_p(manifest, "num_detections", "num_detections:0")))
    boxes = _out(outputs, str(_p(manifest, "boxes", "detection_boxes:0")))
    scores = _out(outputs, str(_p(manifest, "scores", "detection_scores:0")))
    classes = _out(outputs, str(_p(manifest, "classes", "detection_classes:0")))
    count = int(min(max(float(num.reshape(-1)[0]), 0.0), boxes.shape[1]))
    sc = scores[0, :count].astype(np.float64)
    cls = np.rint(classes[0, :count]).astype(np.int64) - int(_p(manifest, "class_offset", 0))
    keep = (sc >= threshold) & (cls >= 0) & (cls < len(manifest.labels))
    bx = boxes[0, :count][keep].astype(np.float64)  # y0, x0, y1, x1 normalized to the model input
    w, h = manifest.input.width, manifest.input.height
    xyxy = np.stack([bx[:, 1] * w, bx[:, 0] * h, bx[:, 3] * w, bx[:, 2] * h], axis=1)
    return _finish(xyxy, sc[keep], cls[keep], geom, None)  # NMS already ran in the graph


def _decode_gfl(
    manifest: ModelManifest, outputs: Mapping[str, np.ndarray], geom: Geometry, threshold: float
) -> list[Det]:
    strides = [int(s) for s in _p(manifest, "strides", [8, 16, 32])]
    bins = int(_p(manifest, "reg_max", 7)) + 1
    cls_names = [str(n) for n in _p(manifest, "cls_outputs", [])]
    reg_names = [str(n) for n in _p(manifest, "reg_outputs", [])]
    if len(cls_names) != len(strides) or len(reg_names) != len(strides):
        raise ValueError("gfl: decoder_params needs cls_outputs and reg_outputs, one per stride")
    project = np.arange(bins, dtype=np.float64)
    all_boxes, all_scores, all_cls = [], [], []
    for stride, cname, rname in zip(strides, cls_names, reg_names, strict=True):
        gw = -(-manifest.input.width // stride)
        cls = _out(outputs, cname)[0]
        reg = _out(outputs, rname)[0]
        cells, labels = np.nonzero(cls >= threshold)
        if cells.size == 0:
            continue
        logits = reg[cells].reshape(-1, 4, bins).astype(np.float64)
        prob = np.exp(logits - logits.max(axis=2, keepdims=True))
        dist = (prob @ project) / prob.sum(axis=2) * stride  # l, t, r, b from the cell centre
        cy, cx = np.divmod(cells, gw)
        cxf, cyf = (cx + 0.5) * stride, (cy + 0.5) * stride
        all_boxes.append(
            np.stack([cxf - dist[:, 0], cyf - dist[:, 1], cxf + dist[:, 2], cyf + dist[:, 3]], axis=1)
        )
        all_scores.append(cls[cells, labels].astype(np.float64))
        all_cls.append(labels)
    if not all_boxes:
        return []
    return _finish(
        np.concatenate(all_boxes),
        np.concatenate(all_scores),
        np.concatenate(all_cls),
        geom,
        manifest.nms_iou,
    )


def _decode_yolo(
    manifest: ModelManifest, outputs: Mapping[str, np.ndarray], geom: Geometry, threshold: float, *, v5: bool
) -> list[Det]:
    name = _p(manifest, "output", None) or (manifest.outputs[0] if manifest.outputs else next(iter(outputs)))
    pred = _out(outputs, str(name))[0].astype(np.float64)
    if v5:  # [N, 5+C]: cx cy w h obj classes
        cls_scores = pred[:, 5:] * pred[:, 4:5]
        xywh = pred[:, :4]
    else:  # [4+C, N]: cx cy w h classes (YOLOv8 / YOLO11)
        cls_scores = pred[4:].T
        xywh = pred[:4].T
    if cls_scores.shape[0] == 0:
        return []
    best = cls_scores.argmax(axis=1)
    score = cls_scores[np.arange(cls_scores.shape[0]), best]
    keep = score >= threshold
    p = xywh[keep]
    xyxy = np.stack(
        [p[:, 0] - p[:, 2] / 2, p[:, 1] - p[:, 3] / 2, p[:, 0] + p[:, 2] / 2, p[:, 1] + p[:, 3] / 2], 1
    )
    return _finish(xyxy, score[keep], best[keep], geom, manifest.nms_iou)


# --------------------------------------------------------------------------- matching


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box in ``a`` [N, 4] with every box in ``b`` [M, 4] (x0, y0, x1, y1)."""
    a = np.asarray(a, dtype=np.float64).reshape(-1, 4)
    b = np.asarray(b, dtype=np.float64).reshape(-1, 4)
    iw = np.clip(np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0]), 0, None)
    ih = np.clip(np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1]), 0, None)
    inter = iw * ih
    area_a = np.clip(a[:, 2] - a[:, 0], 0, None) * np.clip(a[:, 3] - a[:, 1], 0, None)
    area_b = np.clip(b[:, 2] - b[:, 0], 0, None) * np.clip(b[:, 3] - b[:, 1], 0, None)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def match(
    reference: Sequence[Sequence[Det]], candidate: Sequence[Sequence[Det]], iou_min: float = MATCH_IOU
) -> Fidelity:
    """Match a variant's detections to the reference's, frame by frame.

    Greedy by candidate score: each candidate takes the unmatched reference detection of the same
    class with the highest IoU, if that IoU is >= ``iou_min``. Precision is matched / candidate
    detections, recall matched / reference detections. Two empty sets agree perfectly (F1 1.0); a
    variant that finds nothing where the reference finds something has recall 0 and F1 0.
    """
    if len(reference) != len(candidate):
        raise ValueError(f"frame counts differ: reference {len(reference)}, candidate {len(candidate)}")
    n_ref = n_cand = matched = 0
    ious: list[float] = []
    for ref, cand in zip(reference, candidate, strict=True):
        n_ref += len(ref)
        n_cand += len(cand)
        if not ref or not cand:
            continue
        ref_boxes = np.array([[d.x0, d.y0, d.x1, d.y1] for d in ref])
        ref_cls = np.array([d.class_id for d in ref])
        taken = np.zeros(len(ref), dtype=bool)
        for det in sorted(cand, key=lambda d: -d.score):
            overlap = iou_matrix(np.array([[det.x0, det.y0, det.x1, det.y1]]), ref_boxes)[0]
            overlap[(ref_cls != det.class_id) | taken] = -1.0
            j = int(overlap.argmax())
            if overlap[j] >= iou_min:
                taken[j] = True
                matched += 1
                ious.append(float(overlap[j]))
    precision = matched / n_cand if n_cand else 1.0
    recall = matched / n_ref if n_ref else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    return Fidelity(
        reference=n_ref,
        candidate=n_cand,
        matched=matched,
        precision=precision,
        recall=recall,
        f1=f1,
        mean_iou=float(np.mean(ious)) if ious else None,
    )
