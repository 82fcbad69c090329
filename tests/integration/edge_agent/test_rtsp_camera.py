"""RTSP cameras against a real RTSP server: GStreamer's, streaming the bundled footage as H.264
(tests/support/rtsp_server.py). Real agent, real mosquitto, real model. Frames and detections flow over
TCP and over UDP from one agent, each camera on the transport it asked for; the server killed under
them takes them down with the reason and capped backoff, and its return brings detections back; a
wrong path and refused credentials are camera errors that say so, retried with the same backoff, and
the password is nowhere: not in events, reported state, detections, logs or anything written to the
process's stdout and stderr.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_agent.agent import Agent
from fleet_protocol.messages import CameraState, Event, EventKind
from tests.support.camera_outages import (
    RECONNECT_MIN_S,
    assert_capped_backoff,
    camera_events,
    frames_of,
    settings_for,
)
from tests.support.edge_standin import StandInController, camera_with, desired, load_manifest
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import MODELS
from tests.support.rtsp_server import RtspServer
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

PED = MODELS / "ped_ssdlite"
USER = "alice"
PASSWORD = "Rtsp-pw-7731"
WRONG_PASSWORD = "Wrong-pw-9054"
# Short enough that a stream lost without a word (UDP) is noticed within the test's waits.
NETWORK = {"open_timeout_s": 5, "read_timeout_s": 3}


@pytest.fixture(scope="module")
def footage_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The footage encoded once for the module's servers."""
    return tmp_path_factory.mktemp("rtsp-footage") / "footage.h264au"


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    started: list[Agent] = []
    yield started
    for a in started:
        a.shutdown()


def first_event(ctl: StandInController, camera: str, kind: EventKind, after: int = 0) -> Event:
    return wait_for(
        lambda: [e for e in camera_events(ctl, camera, kind) if e.seq > after],
        timeout=30,
        what=f"{kind.value} of {camera}",
    )[0]


def with_people(ctl: StandInController, camera: str, after: float = 0.0) -> int:
    """Frames of ``camera`` captured after ``after`` in which the model found someone."""
    return sum(1 for f in frames_of(ctl, camera) if f.captured_at > after and f.detections)


def assert_no_password(ctl: StandInController, output: str, *passwords: str) -> None:
    with ctl.lock:
        sent = [m.model_dump_json() for m in (*ctl.events, *ctl.reported, *ctl.batches)]
    for password in passwords:
        assert not any(password in s for s in sent), f"{password} was sent"
        assert password not in output, f"{password} was logged"


def test_rtsp_cameras_over_tcp_and_udp_detect_go_down_when_the_server_dies_and_come_back_with_it(
    broker: MosquittoBroker,
    tmp_path: Path,
    agents: list[Agent],
    footage_cache: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    server = RtspServer(
        tmp_path / "rtsp", cache=footage_cache, paths=("/cam", "/udp"), user=USER, password=PASSWORD
    )
    server.start()
    manifest = load_manifest(PED)
    ctl = StandInController(broker.host, broker.port, "rtsp-1", {manifest.sha256: PED / "model.onnx"})
    try:
        ctl.publish_desired(desired(1, {c: camera_with(manifest, max_fps=4) for c in ("gate", "yard")}))
        agent = Agent.from_settings(
            settings_for(
                "rtsp-1",
                broker,
                tmp_path / "agent",
                [
                    {"id": "gate", "source": server.url(), "rtsp_transport": "tcp", **NETWORK},
                    {"id": "yard", "source": server.url(path="/udp"), "rtsp_transport": "udp", **NETWORK},
                ],
            )
        )
        agents.append(agent)
        agent.start()
        gate = agent.pipeline.cameras["gate"]
        wait_for(
            lambda: with_people(ctl, "gate") >= 3 and with_people(ctl, "yard") >= 3,
            timeout=60,
            what="detections from both RTSP cameras",
        )
        frame = gate.slot.peek_latest()
        assert frame is not None and frame.image.shape == (576, 768, 3)
        # Each camera took the transport it asked for, in the same process at the same time.
        assert set(server.setups()) == {("/cam", "TCP"), ("/udp", "UDP")}

        outage_start = time.monotonic()
        server.stop()
        downs = {c: first_event(ctl, c, EventKind.CAMERA_DOWN) for c in ("gate", "yard")}
        url = f"rtsp://{USER}:***@127.0.0.1:{server.port}"
        assert downs["gate"].message == f"stream ended or read failed: {url}/cam"
        assert downs["gate"].data == {"reason": downs["gate"].message, "retry_in_s": RECONNECT_MIN_S}
        assert downs["yard"].message.endswith(f": {url}/udp") and downs["yard"].severity == "warning"
        # Retried with capped backoff while the server is away; each attempt says why it failed.
        wait_for(lambda: len(gate.retries) >= 5, timeout=30, what="five attempts at reopening gate")
        assert gate.retries[-1].reason == f"open failed: cannot open {url}/cam: connection refused"
        stats = {s.camera: s for s in agent.pipeline.stats()}
        assert stats["gate"].state == CameraState.DOWN and stats["yard"].state == CameraState.DOWN
        assert [len(camera_events(ctl, c, EventKind.CAMERA_DOWN)) for c in ("gate", "yard")] == [1, 1]

        server.start()  # the same port
        ups = {c: first_event(ctl, c, EventKind.CAMERA_UP, after=downs[c].seq) for c in ("gate", "yard")}
        attempts = assert_capped_backoff(gate, outage_start)
        assert ups["gate"].data["attempts"] == attempts >= 5
        assert ups["gate"].data["down_s"] > 0
        wait_for(
            lambda: (
                with_people(ctl, "gate", ups["gate"].ts) >= 3
                and with_people(ctl, "yard", ups["yard"].ts) >= 3
            ),
            timeout=30,
            what="detections again from both cameras",
        )
        assert set(server.setups()) == {("/cam", "TCP"), ("/udp", "UDP")}
        assert [len(camera_events(ctl, c, EventKind.CAMERA_DOWN)) for c in ("gate", "yard")] == [1, 1]
        agent.shutdown()
        out = capfd.readouterr()
        assert_no_password(ctl, caplog.text + out.out + out.err, PASSWORD)
    finally:
        ctl.close()
        server.stop()


def test_a_wrong_path_and_refused_credentials_are_camera_errors_that_say_so_without_the_password(
    broker: MosquittoBroker,
    tmp_path: Path,
    agents: list[Agent],
    footage_cache: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    # Digest, as IP cameras ask: what FFmpeg and the agent's own diagnosis must both speak.
    server = RtspServer(tmp_path / "rtsp", cache=footage_cache, user=USER, password=PASSWORD, auth="digest")
    server.start()
    ctl = StandInController(broker.host, broker.port, "rtsp-2", {})
    try:
        agent = Agent.from_settings(
            settings_for(
                "rtsp-2",
                broker,
                tmp_path / "agent",
                [
                    {"id": "lobby", "source": server.url(path="/nope"), **NETWORK},
                    {"id": "dock", "source": server.url(password=WRONG_PASSWORD), **NETWORK},
                    {"id": "gate", "source": server.url(), **NETWORK},
                ],
            )
        )
        start = time.monotonic()
        agents.append(agent)
        agent.start()
        url = f"rtsp://{USER}:***@127.0.0.1:{server.port}"
        lobby = first_event(ctl, "lobby", EventKind.CAMERA_DOWN)
        assert (
            lobby.message
            == f"open failed: cannot open {url}/nope: no stream at this path (RTSP 404 Not Found)"
        )
        dock = first_event(ctl, "dock", EventKind.CAMERA_DOWN)
        assert dock.message == (
            f"open failed: cannot open {url}/cam: the camera refused the credentials (RTSP 401 Unauthorized)"
        )
        # Not a crash loop: each camera stays down, retried with the capped backoff, one event per
        # outage, while the camera with the right credentials streams on.
        cams = agent.pipeline.cameras
        wait_for(
            lambda: len(cams["lobby"].retries) >= 5 and len(cams["dock"].retries) >= 5,
            timeout=30,
            what="five attempts at each camera",
        )
        for cam in ("lobby", "dock"):
            assert_capped_backoff(cams[cam], start)
            assert cams[cam].state == CameraState.DOWN
            assert len(camera_events(ctl, cam, EventKind.CAMERA_DOWN)) == 1
            assert {r.reason for r in cams[cam].retries} == {(lobby if cam == "lobby" else dock).message}
        first_event(ctl, "gate", EventKind.CAMERA_UP)
        frames = cams["gate"].frames
        wait_for(lambda: cams["gate"].frames >= frames + 5, timeout=20, what="frames from gate")
        agent.shutdown()
        out = capfd.readouterr()
        assert_no_password(ctl, caplog.text + out.out + out.err, PASSWORD, WRONG_PASSWORD)
    finally:
        ctl.close()
        server.stop()
