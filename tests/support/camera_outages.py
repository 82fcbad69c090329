"""An in-process agent whose cameras lose their sources: its settings (short backoff), what the stand-in
controller saw per camera, and the check that retries followed the capped backoff."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from edge_agent.core.settings import AgentSettings, CameraConfig
from edge_agent.vision.capture import CameraWorker
from fleet_protocol.messages import Event, EventKind, FrameDetections
from tests.support.edge_standin import StandInController, agent_settings
from tests.support.mqtt_broker import MosquittoBroker

RECONNECT_MIN_S = 0.2
RECONNECT_MAX_S = 1.0


def settings_for(
    device: str, broker: MosquittoBroker, data_dir: Path, cameras: list[dict[str, object]]
) -> AgentSettings:
    """The stand-in's agent settings with ``cameras``, each retried after 0.2, 0.4, 0.8, 1, 1 ... s."""
    configs = [
        CameraConfig.model_validate(
            {"reconnect_min_s": RECONNECT_MIN_S, "reconnect_max_s": RECONNECT_MAX_S, **c}
        )
        for c in cameras
    ]
    return agent_settings(device, broker, data_dir, cameras=False).model_copy(update={"cameras": configs})


def camera_events(ctl: StandInController, camera: str, kind: EventKind) -> list[Event]:
    with ctl.lock:
        return [e for e in ctl.events if e.camera == camera and e.kind == kind]


def frames_of(ctl: StandInController, camera: str) -> list[FrameDetections]:
    return [f for f in ctl.frames() if f.camera == camera]


def assert_capped_backoff(cam: CameraWorker, since: float) -> int:
    """The retries of the outage that began at ``since`` waited min, 2*min, ... capped at max; returns
    how many there were."""
    retries = [r for r in cam.retries if r.at >= since]
    expected = [min(RECONNECT_MAX_S, RECONNECT_MIN_S * 2**i) for i in range(len(retries))]
    assert [r.delay_s for r in retries] == pytest.approx(expected), [r.delay_s for r in retries]
    for prev, nxt in itertools.pairwise(retries):
        # Recorded by the capture thread itself: the next attempt came no sooner than the backoff.
        assert nxt.at - prev.at >= prev.delay_s - 0.01, (prev, nxt)
    return len(retries)
