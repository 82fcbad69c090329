"""Wire messages the tests build again and again."""

from __future__ import annotations

import time
from collections.abc import Sequence

from fleet_protocol.messages import Box, Detection, DetectionBatch, FrameDetections


def detection_batch(
    seq: int, labels: Sequence[str] = ("person",), *, captured_at: float | None = None, camera: str = "cam1"
) -> DetectionBatch:
    """One frame of ``camera`` (frame number = seq), one 5x5 box at score 0.8 per label."""
    at = time.time() if captured_at is None else captured_at
    frame = FrameDetections(
        camera=camera,
        frame=seq,
        captured_at=at,
        width=640,
        height=480,
        model="tiny:1",
        inference_ms=5.0,
        detections=[
            Detection(label=lbl, class_id=0, score=0.8, box=Box(x0=0, y0=0, x1=5, y1=5)) for lbl in labels
        ],
    )
    return DetectionBatch(seq=seq, sent_at=at, frames=[frame])
