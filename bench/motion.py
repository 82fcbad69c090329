"""Motion-gated inference benchmark: what edge_agent/vision/motion.py saves, and what it loses.

Two scenes at 10 FPS of capture time: (a) the bundled footage (768x576 pedestrians, real CCTV, people
in view nearly all the time), (b) a mostly static synthetic scene: the footage's first frame held still,
with a few grey levels of sensor noise on every frame, and a person (cut from that frame where the
detector finds one) walking across it for 6 s of every minute. Each scene runs twice through the
agent's own pieces, in one process, the frames decoded beforehand: ungated (every frame: the agent's
preprocessing, the ped_ssdlite model on the agent's onnxruntime backend, its decoder, the camera's
filters, the real tracker) and gated (the camera's :class:`MotionGate` first, held open while the last
inferred frame had unconfirmed tracks, as the pipeline does; a skipped frame coasts the tracker).

Printed per scene: the share of frames inferred, CPU seconds per camera-hour of each run (process CPU
time, every thread, over the scene's capture time), energy in J where RAPL is readable
(/sys/class/powercap; else "not measured"), and the track recall of the gated run against the ungated
one. An ungated track counts as found when one gated track overlaps it: IoU >= 0.5 on at least half of
the frames both runs inferred within the ungated track's life and on which the gated track has a box
(at least one such frame). Targets, each PASS or FAIL: recall >= 0.98 on both scenes, >= 2x fewer
inferences on the static scene.

Usage: ``python -m bench.motion [--minutes 3] [--smoke]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np

from edge_agent.core.settings import TrackingConfig
from edge_agent.inference.ort import OnnxRuntimeBackend
from edge_agent.vision.motion import MotionGate
from edge_agent.vision.pipeline import CameraParams
from edge_agent.vision.tracking import CameraTracking, tracker_factory
from fleet_protocol.messages import Box, Detection, ModelManifest, MotionSettings
from fleet_protocol.vision.decoders import decode
from fleet_protocol.vision.preprocess import Preprocessor
from tests.support.paths import FOOTAGE, MODELS

FPS = 10.0
MODEL_DIR = MODELS / "ped_ssdlite"
RAPL = Path("/sys/class/powercap/intel-rapl:0/energy_uj")
RECALL_TARGET = 0.98
FEWER_TARGET = 2.0


@dataclass
class Run:
    inferred: int = 0
    frames: int = 0
    cpu_s: float = 0.0
    joules: float | None = None
    # track id -> {frame index: box}
    tracks: dict[int, dict[int, Box]] = field(default_factory=dict)
    inferred_frames: set[int] = field(default_factory=set)


class Detector:
    """The agent's preprocessing, backend and decoder for ped_ssdlite, with the camera's filters."""

    def __init__(self) -> None:
        self.manifest = ModelManifest.model_validate_json((MODEL_DIR / "manifest.json").read_text())
        self.pre = Preprocessor(self.manifest.input)
        self.backend = OnnxRuntimeBackend(
            MODEL_DIR / "model.onnx", providers_preference=["CPUExecutionProvider"]
        )
        self.params = CameraParams(threshold=self.manifest.default_threshold)

    def __call__(self, image: np.ndarray) -> list[Detection]:
        tensor, meta = self.pre(image)
        outputs = self.backend.run(tensor[None])
        (raws,) = decode(self.manifest, outputs, [meta], self.params.floor)
        area = float(meta.width) * float(meta.height)
        dets = [
            Detection(
                label=self.manifest.labels[r.class_id],
                class_id=r.class_id,
                score=min(1.0, float(r.score)),
                box=Box(x0=float(r.x0), y0=float(r.y0), x1=float(r.x1), y1=float(r.y1)),
            )
            for r in raws
            if 0 <= r.class_id < len(self.manifest.labels)
        ]
        return [d for d in dets if self.params.keeps(d, area)]


def footage(limit: int | None) -> list[np.ndarray]:
    cap = cv2.VideoCapture(str(FOOTAGE))
    frames: list[np.ndarray] = []
    while limit is None or len(frames) < limit:
        ok, frame = cap.read()
        if not ok:
            break
        frames.append(frame)
    cap.release()
    return frames


def static_scene(background: np.ndarray, person: np.ndarray, frames: int) -> Iterator[np.ndarray]:
    """The still frame with sensor noise, and ``person`` walking left to right for 6 s a minute."""
    rng = np.random.default_rng(0)
    # A handful of noise frames, cycled: drawing fresh noise for every frame costs more than the gate.
    noises = [rng.normal(0.0, 2.0, size=background.shape).astype(np.int16) for _ in range(7)]
    h, w = background.shape[:2]
    ph, pw = person.shape[:2]
    y = h - ph - 20
    walk = int(6 * FPS)
    for i in range(frames):
        frame = background.copy()
        into = (i - int(20 * FPS)) % int(60 * FPS)  # the walk starts 20 s into each minute
        if into < walk:
            x = int((w - pw) * into / (walk - 1))
            frame[y : y + ph, x : x + pw] = person
        yield np.clip(frame + noises[i % len(noises)], 0, 255).astype(np.uint8)


def run(frames: Callable[[], Iterator[np.ndarray]], detector: Detector, motion: MotionSettings | None) -> Run:
    factory = tracker_factory(TrackingConfig(), iter(range(1, 10**9)).__next__)
    assert factory is not None
    tracking = CameraTracking("bench", factory(lambda: FPS), None, events_per_minute=60_000)
    gate = MotionGate(motion) if motion is not None else None
    out = Run()
    confirming = False

    def infer(i: int, image: np.ndarray, at: float) -> None:
        nonlocal confirming
        out.inferred += 1
        out.inferred_frames.add(i)
        dets = tracking.update(detector(image), at, at)
        confirming = any(d.track_id is None for d in dets)
        for d in dets:
            if d.track_id is not None:
                out.tracks.setdefault(d.track_id, {})[i] = d.box

    energy0 = _energy()
    for i, image in enumerate(frames()):
        # Only the camera's own work is timed, not making the synthetic frame.
        cpu0 = time.process_time()
        try:
            at = i / FPS
            out.frames += 1
            if gate is not None and not gate.check(image, at, hold=confirming).infer:
                tracking.coast(at)
                continue
            infer(i, image, at)
        finally:
            out.cpu_s += time.process_time() - cpu0
    energy1 = _energy()
    if energy0 is not None and energy1 is not None:
        out.joules = (energy1 - energy0) / 1e6
    return out


def _energy() -> float | None:
    try:
        return float(RAPL.read_text())
    except (OSError, ValueError):
        return None


def iou(a: Box, b: Box) -> float:
    ix = max(0.0, min(a.x1, b.x1) - max(a.x0, b.x0))
    iy = max(0.0, min(a.y1, b.y1) - max(a.y0, b.y0))
    inter = ix * iy
    union = (a.x1 - a.x0) * (a.y1 - a.y0) + (b.x1 - b.x0) * (b.y1 - b.y0) - inter
    return inter / union if union > 0 else 0.0


def recall(ungated: Run, gated: Run) -> tuple[int, int]:
    """(ungated tracks found in the gated run, ungated tracks): see the module's definition."""
    found = 0
    for boxes in ungated.tracks.values():
        life = range(min(boxes), max(boxes) + 1)
        common = [f for f in life if f in gated.inferred_frames and f in boxes]
        for g in gated.tracks.values():
            shared = [f for f in common if f in g]
            if shared and sum(iou(boxes[f], g[f]) >= 0.5 for f in shared) * 2 >= len(shared):
                found += 1
                break
    return found, len(ungated.tracks)


def per_hour(r: Run) -> float:
    return r.cpu_s / (r.frames / FPS) * 3600.0


def report(name: str, ungated: Run, gated: Run, *, fewer_target: bool) -> list[bool]:
    found, total = recall(ungated, gated)
    share = gated.inferred / gated.frames
    fewer = ungated.inferred / max(gated.inferred, 1)
    rec = found / total if total else 1.0
    joules = (
        f"{ungated.joules:.1f} J ungated, {gated.joules:.1f} J gated"
        if ungated.joules is not None and gated.joules is not None
        else "not measured (no readable RAPL)"
    )
    print(f"== {name}: {gated.frames} frames ({gated.frames / FPS:.0f} s at {FPS:g} FPS)")
    print(
        f"frames inferred: ungated {ungated.inferred}, gated {gated.inferred} (share {share:.3f}, {fewer:.2f}x fewer)"
    )
    print(
        f"CPU s per camera-hour: ungated {per_hour(ungated):.0f}, gated {per_hour(gated):.0f} "
        f"(ratio gated / ungated {per_hour(gated) / per_hour(ungated):.3f})"
    )
    print(f"energy: {joules}")
    verdicts = [rec >= RECALL_TARGET]
    print(
        f"track recall against ungated: {found}/{total} = {rec:.3f} (target >= {RECALL_TARGET}): "
        f"{'PASS' if verdicts[0] else 'FAIL'}"
    )
    if fewer_target:
        verdicts.append(fewer >= FEWER_TARGET)
        print(
            f"fewer inferences: {fewer:.2f}x (target >= {FEWER_TARGET:g}x): {'PASS' if verdicts[1] else 'FAIL'}"
        )
    return verdicts


def person_crop(first: np.ndarray, detector: Detector) -> np.ndarray:
    dets = sorted(detector(first), key=lambda d: -d.score)
    if not dets:
        raise SystemExit("the detector found no person in the footage's first frame")
    b = dets[0].box
    return first[int(b.y0) : int(b.y1), int(b.x0) : int(b.x1)].copy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="length of the static scene")
    ap.add_argument("--smoke", action="store_true", help="a quick check that it runs (50 + 200 frames)")
    args = ap.parse_args()
    detector = Detector()
    settings = MotionSettings(enabled=True)
    clip = footage(50 if args.smoke else None)
    static_frames = 200 if args.smoke else int(args.minutes * 60 * FPS)
    person = person_crop(clip[0], detector)
    print(f"ped_ssdlite on {detector.backend.provider}; gate {settings.model_dump()}")
    verdicts = report(
        "footage",
        run(lambda: iter(clip), detector, None),
        run(lambda: iter(clip), detector, settings),
        fewer_target=False,
    )
    verdicts += report(
        "static scene",
        run(lambda: static_scene(clip[0], person, static_frames), detector, None),
        run(lambda: static_scene(clip[0], person, static_frames), detector, settings),
        fewer_target=True,
    )
    print(f"overall: {'PASS' if all(verdicts) else 'FAIL'}")


if __name__ == "__main__":
    main()
