"""Variant fidelity: run a model the way a device does, and match its detections against FP32's.

Judging an optimized variant means running it as a device would and comparing its detections with the
FP32 model's. The preprocessing and the decoders are the agent's own, from ``fleet_protocol.vision``
(the shared half of the contract that says what a manifest's ``InputSpec`` and ``DecoderKind`` mean),
so the counts and the figure reported measure the code devices run. What is the controller's alone is
the choice of frames from the footage and a greedy matcher that turns two lists of detections into
precision, recall, F1 and mean IoU.

Only numpy is imported at module level: ``fleet_protocol.vision`` needs OpenCV, which the controller
does without unless it builds variants, so it is imported where frames are touched.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fleet_protocol.messages import InputSpec, ModelManifest

if TYPE_CHECKING:
    from fleet_protocol.vision.decoders import RawDetection
    from fleet_protocol.vision.preprocess import FrameMeta

log = logging.getLogger(__name__)

MATCH_IOU = 0.5  # a variant's detection counts as the reference's when IoU >= this, same class


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

    # Sequential reads: seeking in AVI/MP43 is slow and not frame-exact, and 800 frames decode in
    # about a second. Two passes (count, then keep the chosen frames) rather than one that keeps them
    # all: a few minutes of footage decoded whole would take gigabytes of the build's memory limit.
    n = 0
    for _ in _frames(cv2, footage):
        n += 1
    if n < 2:
        raise ValueError(f"footage {footage} has {n} frame(s); at least 2 are needed")
    half = n // 2

    def spread(lo: int, hi: int, count: int) -> list[int]:
        count = max(0, min(count, hi - lo))
        if count == 0:
            return []
        return [int(i) for i in np.linspace(lo, hi - 1, count).round().astype(int)]

    calib_idx, eval_idx = spread(0, half, calib), spread(half, n, evaluation)
    wanted = set(calib_idx) | set(eval_idx)
    kept = {i: frame for i, frame in enumerate(_frames(cv2, footage)) if i in wanted}
    if len(kept) < len(wanted):
        raise ValueError(f"footage {footage} gave fewer frames on its second reading")
    return [kept[i] for i in calib_idx], [kept[i] for i in eval_idx]


def _frames(cv2: Any, footage: Path) -> Iterator[np.ndarray]:
    cap = cv2.VideoCapture(str(footage))
    if not cap.isOpened():
        raise ValueError(f"cannot open footage {footage}")
    try:
        while True:
            ok, frame = cap.read()
            if not ok:
                return
            yield frame
    finally:
        cap.release()


# --------------------------------------------------------------------------- the agent's pipeline


def preprocess_frames(frames: Sequence[np.ndarray], spec: InputSpec) -> list[tuple[np.ndarray, FrameMeta]]:
    """Each frame as a batch-of-one input tensor, prepared by the agent's own ``Preprocessor``: one
    for all the frames, as in the agent, so its buffers are allocated once (each tensor it returns
    is new, so keeping them all is safe)."""
    from fleet_protocol.vision.preprocess import Preprocessor

    prepare = Preprocessor(spec)
    out = []
    for frame in frames:
        tensor, meta = prepare(frame)
        out.append((tensor[None], meta))
    return out


def preprocess(frame_bgr: np.ndarray, spec: InputSpec) -> tuple[np.ndarray, FrameMeta]:
    """One frame as a batch-of-one input tensor (:func:`preprocess_frames` for several)."""
    return preprocess_frames([frame_bgr], spec)[0]


def decode(
    manifest: ModelManifest, outputs: Mapping[str, np.ndarray], meta: FrameMeta, threshold: float
) -> list[RawDetection]:
    """Detections of one frame (batch item 0), best first, score >= threshold, in frame pixels, by the
    agent's own decoder for the manifest's ``DecoderKind``."""
    from fleet_protocol.vision.decoders import decode as decode_batch

    return decode_batch(manifest, outputs, [meta], threshold)[0]


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
    reference: Sequence[Sequence[RawDetection]],
    candidate: Sequence[Sequence[RawDetection]],
    iou_min: float = MATCH_IOU,
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
