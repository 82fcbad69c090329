"""An inference that hangs: detected within the bound, abandoned, restarted (rate-limited), reported.

The agent runs for real (capture of the real footage, real MQTT link to a real mosquitto, the
stand-in controller) with one fake at the backend seam: a backend whose ``run`` blocks on an event
while the test says so, like a wedged GPU driver call.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_agent.agent import Agent
from edge_agent.core.settings import parse_settings
from fleet_protocol.messages import CameraReported, CameraState, Event, EventKind, InputSpec, ModelManifest
from tests.support.edge_standin import (
    PUBLIC_KEY,
    StandInController,
    camera_with,
    desired,
)
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import FOOTAGE
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

HANG_TIMEOUT_S = 1.0
PERSON, CAR = 1, 2  # TF-OD classes (1-based): a live run says person, a stuck run that returns says car


class HangSwitch:
    """What the test controls: while ``hanging`` is set every run blocks until ``release`` is set."""

    def __init__(self) -> None:
        self.hanging = threading.Event()
        self.release = threading.Event()
        self.stuck = 0
        self.backends: list[HangingBackend] = []
        self.lock = threading.Lock()


class HangingBackend:
    provider = "HangingExecutionProvider"
    input_name = "x"
    input_shape: tuple[int | str | None, ...] = ("N", 16, 16, 3)
    dynamic_batch = True

    def __init__(self, switch: HangSwitch) -> None:
        self.switch = switch
        self.closed = False

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        cls = PERSON
        if self.switch.hanging.is_set():
            with self.switch.lock:
                self.switch.stuck += 1
            self.switch.release.wait()
            cls = CAR  # the late result of an abandoned run: it must never be published
        b = batch.shape[0]
        return {
            "num_detections:0": np.ones((b,), np.float32),
            "detection_boxes:0": np.tile(np.array([[[0.1, 0.1, 0.9, 0.9]]], np.float32), (b, 1, 1)),
            "detection_scores:0": np.full((b, 1), 0.9, np.float32),
            "detection_classes:0": np.full((b, 1), float(cls), np.float32),
        }

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def switch() -> Iterator[HangSwitch]:
    sw = HangSwitch()
    yield sw
    sw.release.set()  # let abandoned threads go whatever happened


def watchdog_events(ctl: StandInController) -> list[Event]:
    with ctl.lock:
        return [e for e in ctl.events if e.kind == EventKind.WATCHDOG_RESTART]


def reported(ctl: StandInController, camera: str) -> CameraReported | None:
    rep = ctl.latest_reported()
    return rep.cameras.get(camera) if rep else None


def actions(ctl: StandInController) -> list[str]:
    return [str(e.data.get("action")) for e in watchdog_events(ctl)]


def test_hung_inference_is_abandoned_restarted_rate_limited_and_recovers(
    broker: MosquittoBroker, tmp_path: Path, switch: HangSwitch
) -> None:
    blob = b"a model file; the backend under test never reads it"
    model_file = tmp_path / "fake.onnx"
    model_file.write_bytes(blob)
    manifest = ModelManifest(
        name="hangs",
        version="1",
        sha256=hashlib.sha256(blob).hexdigest(),
        size=len(blob),
        decoder="tf_od",
        input=InputSpec(name="x", layout="NHWC", dtype="uint8", color="RGB", width=16, height=16),
        labels=["person", "car"],
        decoder_params={"class_offset": 1},
    )

    def factory(path: Path, m: ModelManifest) -> HangingBackend:
        backend = HangingBackend(switch)
        switch.backends.append(backend)
        return backend

    settings = parse_settings(
        {
            "device_id": "wd-1",
            "mqtt_url": broker.url,
            "mqtt_reconnect_max_s": 1,
            "data_dir": str(tmp_path / "agent"),
            "heartbeat_interval_s": 1,
            "cameras": [{"id": "cam1", "source": str(FOOTAGE), "loop": True}],
            "inference": {
                "threads": 1,
                "hang_timeout_s": HANG_TIMEOUT_S,
                "max_restarts": 2,
                "restart_window_s": 600,
                "restart_backoff_min_s": 0.5,
                "restart_backoff_max_s": 2.0,
            },
            "outbox": {"ack_timeout_s": 2, "batch_max_frames": 5, "batch_max_delay_s": 0.2},
            "artifact_public_key": PUBLIC_KEY,
        },
        env={},
    )
    ctl = StandInController(broker.host, broker.port, "wd-1", {manifest.sha256: model_file})
    agent = Agent.from_settings(settings, backend_factory=factory)
    try:
        ctl.publish_desired(desired(1, {"cam1": camera_with(manifest)}))
        agent.start()

        def labels() -> list[str]:
            return [d.label for f in ctl.frames() for d in f.detections]

        wait_for(lambda: labels().count("person") >= 5, timeout=30, what="detections before the hang")
        assert len(switch.backends) == 1

        switch.hanging.set()
        # Two immediate restarts (max_restarts), then failed, with retries after 0.5, 1, 2, 2 s (capped):
        # every new backend hangs too while the switch is on.
        expected = ["restarted", "restarted"] + ["failed", "retry"] * 3 + ["failed"]
        wait_for(
            lambda: actions(ctl)[: len(expected)] == expected,
            timeout=60,
            what=f"watchdog steps {expected} (got {actions(ctl)})",
        )
        events = watchdog_events(ctl)[: len(expected)]
        hangs = [e for e in events if e.data["action"] in ("restarted", "failed") and "stuck_s" in e.data]
        assert len(hangs) == 6, [e.data for e in events]
        for e in hangs:
            # Detected within the bound: after hang_timeout_s, and at most one watchdog tick later
            # (plus scheduling slack on a loaded machine).
            assert HANG_TIMEOUT_S <= e.data["stuck_s"] < HANG_TIMEOUT_S + 1.5, e.data
            assert e.camera is None and e.data["cameras"] == ["cam1"] and e.data["model"] == "hangs:1"
            assert "hung" in e.data["reason"]
        failed = [e for e in events if e.data["action"] == "failed"]
        assert [e.data["retry_in_s"] for e in failed[:4]] == [0.5, 1.0, 2.0, 2.0], "capped backoff"
        assert all(e.severity == "error" for e in failed)
        assert all(e.data["restarts_in_window"] == 2 and e.data["max_restarts"] == 2 for e in failed)
        # Each restart and each retry ran on a fresh backend (one more may be in the making).
        restarts = sum(1 for a in actions(ctl) if a in ("restarted", "retry"))
        assert 1 + restarts <= len(switch.backends) <= 2 + restarts

        def failed_report() -> CameraReported | None:
            rep = reported(ctl, "cam1")
            return rep if rep is not None and rep.state == "failed" else None

        rep = wait_for(failed_report, timeout=10, what="cam1 reported failed")
        assert "hung" in (rep.error or "")

        # The backend stops hanging. Released while the pipeline waits out its 2 s backoff, so no run
        # is live: every stuck run returns late (to be ignored), and the next retry serves.
        wait_for(lambda: agent.pipeline.watchdog_status()["failed"], timeout=10, what="pipeline failed")
        before = len(ctl.frames())
        switch.hanging.clear()
        switch.release.set()
        assert switch.stuck >= 6
        wait_for(lambda: "recovered" in actions(ctl), timeout=30, what="a recovered watchdog event")
        wait_for(lambda: len(ctl.frames()) >= before + 5, timeout=30, what="detections after recovery")
        wait_for(
            lambda: (r := reported(ctl, "cam1")) and r.state == "running",
            timeout=10,
            what="cam1 reported running again",
        )
        status: dict[str, Any] = wait_for(
            lambda: (s := agent.pipeline.watchdog_status())["stuck_threads"] == 0 and s,
            timeout=10,
            what="abandoned threads gone once their runs returned",
        )
        assert status["late_results_dropped"] == switch.stuck, "every late result was dropped"
        assert status["failed"] is False
        assert "car" not in labels(), "a result of an abandoned run was published"
        assert agent.pipeline.camera_states()["cam1"] == CameraState.UP
        assert not agent.stop_event.is_set() and agent.exit_code == 0, "the agent kept running"
        diag = agent.commands.diagnostics()
        assert diag["watchdog"]["restarts"] == sum(1 for a in actions(ctl) if a in ("restarted", "retry"))
    finally:
        agent.shutdown()
        ctl.close()
