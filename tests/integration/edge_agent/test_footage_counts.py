"""Counts that are right on real footage: the agent's pipeline (the bundled person detector, the
tracker, the zone counter) on a stretch of the bundled footage whose line crossings and zone entries
were counted by hand (tests/data/footage_counts.json says how), every frame inferred; the id switches
on it are printed with the counts."""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass

import numpy as np
import pytest

from edge_agent.core.settings import CameraConfig, TrackingConfig
from edge_agent.inference.ort import OnnxRuntimeBackend
from edge_agent.vision.capture import CameraWorker, VideoSource, open_cv_source
from edge_agent.vision.pipeline import CameraParams, Pipeline
from edge_agent.vision.tracking import tracker_factory
from fleet_protocol.messages import CountLine, EventKind, LineCrossing, ModelManifest, Zone, ZoneTransit
from tests.support.paths import FOOTAGE, MODELS, REPO
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

TRUTH = json.loads((REPO / "tests" / "data" / "footage_counts.json").read_text())
# Id switches: the confirmed track ids in the stretch's zone and line events beyond one per person
# counted by hand (a person whose track broke up counts afresh under each id). This many at most.
MAX_ID_SWITCHES = 2


class Stretch:
    """The footage's first ``frames`` frames, once: a reopen after the end gives no frame, so no frame
    of the stretch is counted twice."""

    def __init__(self, frames: int) -> None:
        self.left = frames
        self.fps: float | None = None
        self._src: VideoSource | None = None

    def __call__(self, config: CameraConfig) -> Stretch:
        if self._src is None:
            self._src = open_cv_source(config)
            self.fps = self._src.fps
        return self

    def read(self) -> np.ndarray | None:
        if self.left <= 0 or self._src is None:
            return None
        self.left -= 1
        return self._src.read()

    def release(self) -> None:
        pass

    def close(self) -> None:
        if self._src is not None:
            self._src.release()


@dataclass
class Counted:
    events: list[tuple[EventKind, ZoneTransit | LineCrossing]]

    @property
    def id_switches(self) -> int:
        return len({e.track_id for _, e in self.events}) - TRUTH["people_counted"]

    def crossings(self, direction: str) -> int:
        return sum(1 for _, e in self.events if isinstance(e, LineCrossing) and e.direction == direction)

    def of(self, kind: EventKind) -> list[ZoneTransit | LineCrossing]:
        return [e for k, e in self.events if k == kind]


@pytest.fixture(scope="module")
def counted() -> Counted:
    """The stretch through the pipeline once, with the hand-counted line and zone: every event."""
    first, last = TRUTH["frames"]["first"], TRUTH["frames"]["last"]
    assert first == 0, "the stretch starts at the footage's first frame"
    frames = last - first + 1
    events: list[tuple[EventKind, ZoneTransit | LineCrossing]] = []
    lock = threading.Lock()

    def on_event(kind: EventKind, camera: str, data: ZoneTransit | LineCrossing) -> None:
        with lock:
            events.append((kind, data))

    stop = threading.Event()
    stretch = Stretch(frames)
    wake = threading.Event()
    camera = CameraWorker(
        CameraConfig(id="c0", source=str(FOOTAGE), realtime=False), stop=stop, opener=stretch, wake=wake
    )
    factory = tracker_factory(TrackingConfig(), itertools.count(1).__next__)
    assert factory is not None, "the trackers package is part of the agent's install"
    p = Pipeline(
        [camera],
        stop=stop,
        wake=wake,
        backend_factory=lambda path, m: OnnxRuntimeBackend(
            path, threads=2, available=["CPUExecutionProvider"]
        ),
        tracker_factory=factory,
    )
    p.on_zone_event = on_event
    p.start()
    try:
        manifest = ModelManifest.model_validate_json((MODELS / "ped_ssdlite" / "manifest.json").read_text())
        model = p.load(MODELS / "ped_ssdlite" / "model.onnx", manifest)
        zone, line = Zone.model_validate(TRUTH["zone"]), CountLine.model_validate(TRUTH["line"])
        p.activate("c0", model, CameraParams(threshold=0.5, min_box_area=0.001, zones=(zone,), lines=(line,)))
        seen: set[int] = set()

        def every_frame_inferred() -> bool:
            while (r := p.out.get(timeout=0.05)) is not None:
                seen.add(r.frame)
            return len(seen) >= frames

        wait_for(every_frame_inferred, timeout=300, what=f"{frames} frames inferred", interval=0.0)
        p.clear("c0")  # the tracks end: those inside the zone leave it
    finally:
        stop.set()
        stretch.close()
    with lock:
        out = Counted(list(events))
    ids = {e.track_id for _, e in out.events}
    print(
        f"\nline {TRUTH['line']['id']}: in {out.crossings('in')} (by hand {TRUTH['crossings']['in']}), out "
        f"{out.crossings('out')} (by hand {TRUTH['crossings']['out']}); zone {TRUTH['zone']['id']}: entries "
        f"{len(out.of(EventKind.ZONE_ENTERED))} (by hand {TRUTH['zone_entries']}); confirmed track ids in "
        f"these events {len(ids)} against {TRUTH['people_counted']} people by hand: id switches "
        f"{out.id_switches} (up to {out.id_switches + TRUTH['people_counted_uncertain']})"
    )
    return out


@pytest.mark.parametrize("direction", ["in", "out"])
def test_line_crossings_match_the_hand_count_within_one(counted: Counted, direction: str) -> None:
    assert abs(counted.crossings(direction) - TRUTH["crossings"][direction]) <= 1, counted.events


def test_id_switches_stay_within_their_bound_and_every_entry_is_left(counted: Counted) -> None:
    assert counted.id_switches <= MAX_ID_SWITCHES, sorted({e.track_id for _, e in counted.events})
    # The counter pairs them, and the tracks ended at the end of the stretch: all have left.
    entered = sorted(e.track_id for e in counted.of(EventKind.ZONE_ENTERED))
    assert sorted(e.track_id for e in counted.of(EventKind.ZONE_LEFT)) == entered


def test_zone_entries_match_the_hand_count_within_one(counted: Counted) -> None:
    entries = counted.of(EventKind.ZONE_ENTERED)
    assert abs(len(entries) - TRUTH["zone_entries"]) <= 1, [(e.track_id, e.at) for e in entries]
