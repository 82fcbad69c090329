"""Tracking benchmark: what edge_agent/vision/tracking.py costs per inferred frame, against the tracking
library alone.

A synthetic scene of N boxes (default 20) moving at constant speeds and bouncing off the edges of a
1280x720 frame, with a pixel of noise on each coordinate, at 10 FPS of capture time. Raw limit: the
library's ``ByteTrackTracker.update`` on the same boxes already packed as ``supervision.Detections``, one
tracker (what no wrapper can go below). Ours: :class:`ByteTracker` through the pipeline's
:class:`CameraTracking` (the wire ``Detection`` objects in, packed per label, ids mapped to ours, copies
with ``track_id`` out). Both run the same frames in interleaved rounds and the median round is kept.
Ratio = raw ms / ours ms (1.0: the wrapper costs nothing). Also printed: a coasting step (no
detections) and the ids each made for the N objects (N is right).

Usage: ``python -m bench.tracking [--objects 20] [--frames 600] [--rounds 5] [--smoke]``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import numpy as np
import supervision as sv
import trackers

from edge_agent.core.settings import TrackingConfig
from edge_agent.vision.tracking import CameraTracking, tracker_factory
from fleet_protocol.messages import Box, Detection

W, H, FPS = 1280, 720, 10.0


def scene(objects: int, frames: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    size = rng.uniform(30, 80, size=(objects, 2))
    pos = rng.uniform([0, 0], [W - 80, H - 80], size=(objects, 2))
    vel = rng.uniform(-6, 6, size=(objects, 2))
    out = []
    for _ in range(frames):
        pos = pos + vel
        vel[(pos < 0) | (pos + size > [W, H])] *= -1
        pos = np.clip(pos, 0, np.array([W, H]) - size)
        boxes = np.hstack([pos, pos + size]) + rng.normal(0, 1.0, size=(objects, 4))
        boxes[:, 2:] = np.maximum(boxes[:, 2:], boxes[:, :2] + 1)
        out.append((boxes.astype(np.float32), rng.uniform(0.5, 0.95, size=objects).astype(np.float32)))
    return out


def raw_round(frames: list[tuple[np.ndarray, np.ndarray]], config: TrackingConfig) -> tuple[float, int]:
    packed = [sv.Detections(xyxy=b, confidence=s, class_id=np.zeros(len(b), dtype=int)) for b, s in frames]
    tracker = trackers.ByteTrackTracker(
        lost_track_buffer=round(config.lost_after_s * 30),
        frame_rate=FPS,
        track_activation_threshold=0.0,
        high_conf_det_threshold=0.0,
        minimum_consecutive_frames=config.confirm_frames,
        minimum_iou_threshold=config.match_iou,
    )
    ids: set[int] = set()
    t0 = time.perf_counter()
    for i, batch in enumerate(packed):
        found = tracker.update(batch, timestamp=i / FPS).tracker_id
        ids.update(int(x) for x in (found if found is not None else []) if x >= 0)
    return (time.perf_counter() - t0) * 1000.0 / len(frames), len(ids)


def ours_round(
    frames: list[tuple[np.ndarray, np.ndarray]], config: TrackingConfig
) -> tuple[float, float, int]:
    dets = [
        [
            Detection(label="person", class_id=0, score=float(s), box=Box(x0=b[0], y0=b[1], x1=b[2], y1=b[3]))
            for b, s in zip(boxes.tolist(), scores.tolist(), strict=True)
        ]
        for boxes, scores in frames
    ]
    factory = tracker_factory(config, itertools.count(1).__next__)
    assert factory is not None
    tracking = CameraTracking("bench", factory(lambda: FPS), None, events_per_minute=60_000)
    ids: set[int] = set()
    t0 = time.perf_counter()
    for i, frame in enumerate(dets):
        ids.update(d.track_id for d in tracking.update(frame, i / FPS, i / FPS) if d.track_id is not None)
    ms = (time.perf_counter() - t0) * 1000.0 / len(frames)
    t1 = time.perf_counter()
    coasts = 50
    for i in range(coasts):
        tracking.coast((len(frames) + i) / FPS)
    coast_ms = (time.perf_counter() - t1) * 1000.0 / coasts
    return ms, coast_ms, len(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=20)
    ap.add_argument("--frames", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="a quick check that it runs (60 frames, 1 round)")
    args = ap.parse_args()
    if args.smoke:
        args.frames, args.rounds = 60, 1
    config = TrackingConfig()
    frames = scene(args.objects, args.frames)
    raw_ms: list[float] = []
    ours_ms: list[float] = []
    coast_ms: list[float] = []
    for _ in range(args.rounds):
        ms, raw_ids = raw_round(frames, config)
        raw_ms.append(ms)
        ms, coast, our_ids = ours_round(frames, config)
        ours_ms.append(ms)
        coast_ms.append(coast)
    raw, ours = statistics.median(raw_ms), statistics.median(ours_ms)
    print(f"objects {args.objects}, frames {args.frames}, rounds {args.rounds}, trackers {_version()}")
    print(f"raw ByteTrackTracker: {raw:.3f} ms/frame, {raw_ids} ids")
    print(f"edgefleet CameraTracking: {ours:.3f} ms/frame, {our_ids} ids")
    print(f"coast (no detections): {statistics.median(coast_ms):.3f} ms")
    print(f"ratio raw / ours: {raw / ours:.3f}")


def _version() -> str:
    from importlib.metadata import version

    return version("trackers")


if __name__ == "__main__":
    main()
