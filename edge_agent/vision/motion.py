"""Motion-gated inference: per camera, a cheap test on a small grey frame decides whether the detector
runs on a frame (PROTOCOL.md "Motion-gated inference").

The test is Frigate's: the frame downscaled to ``WIDTH`` pixels wide, grey, blurred; compared with a
running-average background (``cv2.accumulateWeighted``); pixels that differ by more than the camera's
``threshold`` are changed, dilated into regions; a region of at least ``min_area`` of the frame is
motion. It costs well under a millisecond, a small share of one detector run on a CPU.

What it must not do is lose objects, so a frame is inferred:

- the first one (no background yet, and nothing known about the scene);
- when anything moved;
- when most of the frame changed at once (lights switched, the camera's exposure or IR mode jumped):
  the background is reset to this frame, which is inferred once, instead of counting the whole
  frame as motion until the running average catches up;
- when no frame was inferred for ``full_frame_every_s`` (capture time): an object that stopped
  moving is still seen, its track matched again before the tracker's ``lost_after_s`` ends it, and a
  scene whose change was too slow or small for the test is still looked at.

- while the caller holds it open (``hold``): the pipeline does while the camera's last inferred frame
  had detections of tracks not yet confirmed, since the tracker confirms a track only over
  consecutive inferred frames and drops an unconfirmed one at the first frame it misses: an object
  that never moved would otherwise never get a track.

Frames that are not inferred coast the camera's tracks (edge_agent/vision/pipeline.py). A confirmed
track alone does not keep the detector running: a track that moves makes motion, and one that stands
still needs no more than the periodic look.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import numpy as np

from fleet_protocol.messages import MotionSettings

# The width the test runs at (Frigate: 160 to 320): a person in the footage's 768x576 is a blob of
# dozens of pixels at 240, while the test stays far cheaper than the detector.
WIDTH = 240
# The share of the frame changed at once that is a change of lighting, not motion.
LIGHTING_SHARE = 0.5
# The running average's weight of a new frame: an object that stops becomes background in a few
# seconds at camera rates (while it still differs, it is motion and inferred).
BACKGROUND_ALPHA = 0.05
_DILATE = np.ones((3, 3), np.uint8)


class Verdict(StrEnum):
    FIRST = "first"
    MOTION = "motion"
    LIGHTING = "lighting"
    PERIODIC = "periodic"
    HELD = "held"
    SKIP = "skip"

    @property
    def infer(self) -> bool:
        return self is not Verdict.SKIP


class MotionGate:
    """One camera's gate. Called from one thread (the pipeline's prepare thread), frames in capture
    order; a new gate (its first frame inferred) when the camera's motion settings change."""

    def __init__(self, settings: MotionSettings, *, width: int = WIDTH) -> None:
        # OpenCV is the agent extra's, imported here so that the pipeline module imports without it.
        import cv2

        self._cv2: Any = cv2
        self.settings = settings
        self._width = width
        self._background: np.ndarray | None = None
        self._last_inferred: float | None = None

    def check(self, image: np.ndarray, at: float, *, hold: bool = False) -> Verdict:
        """Whether the frame ``image`` (BGR or grey), captured at ``at`` (seconds), is inferred;
        ``hold``: inferred whatever the test says (the background is updated all the same)."""
        cv2 = self._cv2
        grey = self._small_grey(image)
        background = self._background
        if background is None or background.shape != grey.shape:
            self._background = grey.astype(np.float32)
            return self._inferred(Verdict.FIRST, at)
        diff = cv2.absdiff(grey, cv2.convertScaleAbs(background))
        _, mask = cv2.threshold(diff, self.settings.threshold, 255, cv2.THRESH_BINARY)
        changed = cv2.countNonZero(mask)
        if changed >= LIGHTING_SHARE * mask.size:
            self._background = grey.astype(np.float32)
            return self._inferred(Verdict.LIGHTING, at)
        cv2.accumulateWeighted(grey, background, BACKGROUND_ALPHA)
        if changed and self._largest_region(mask) >= self.settings.min_area * mask.size:
            return self._inferred(Verdict.MOTION, at)
        last = self._last_inferred
        if last is None or at - last >= self.settings.full_frame_every_s:
            return self._inferred(Verdict.PERIODIC, at)
        return self._inferred(Verdict.HELD, at) if hold else Verdict.SKIP

    def _inferred(self, verdict: Verdict, at: float) -> Verdict:
        self._last_inferred = at
        return verdict

    def _small_grey(self, image: np.ndarray) -> np.ndarray:
        cv2 = self._cv2
        h, w = image.shape[:2]
        width = min(self._width, w)
        height = max(1, round(h * width / w))
        # Downscaled first: the colour conversion and blur then touch a fraction of the pixels.
        small = cv2.resize(image, (width, height), interpolation=cv2.INTER_AREA)
        if small.ndim == 3:
            small = cv2.cvtColor(small, cv2.COLOR_BGR2GRAY)
        return cv2.GaussianBlur(small, (5, 5), 0)

    def _largest_region(self, mask: np.ndarray) -> int:
        """The pixel count of the largest changed region: scattered noise pixels add up to a share of
        the frame without being an object, so the regions, not the total, are compared with min_area."""
        cv2 = self._cv2
        grown = cv2.dilate(mask, _DILATE, iterations=2)
        count, _, stats, _ = cv2.connectedComponentsWithStats(grown, connectivity=8)
        if count <= 1:
            return 0
        return int(stats[1:, cv2.CC_STAT_AREA].max())
