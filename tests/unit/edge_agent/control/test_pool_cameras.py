"""Pool cameras (PROTOCOL.md "Pool cameras"): cameras the desired state gives the device with a source,
started, kept, restarted and stopped by the twin while the device's own cameras run on untouched; one
that could not start is tried again without a new state."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from edge_agent.control.pool import PoolCameraError, SecretFiles, pool_camera_config
from fleet_protocol.codec import encode
from fleet_protocol.messages import CameraState, Event, EventKind, ReportedState
from fleet_protocol.topics import TopicKind
from tests.support.edge_twin import (
    FakeTransport,
    Harness,
    camera,
    model_in_store,
    put_secret,
    state,
)
from tests.support.waiting import wait_for

DOOR = "rtsp://{secret:north}@10.0.0.21/stream1"
DOOR_PASSWORD = "viewer:pw-7QX"
DOCK = "file:///srv/footage/dock%202.mp4"


def reported(t: FakeTransport, version: int, **states: str) -> Callable[[], ReportedState | None]:
    """The reported state of ``version`` once each camera named is in the state given."""

    def check() -> ReportedState | None:
        rep = t.reported()
        if rep is None or rep.desired_version != version:
            return None
        if all(c in rep.cameras and rep.cameras[c].state == s for c, s in states.items()):
            return rep
        return None

    return check


def test_pool_cameras_are_taken_kept_and_dropped(harness: Harness) -> None:
    model = model_in_store(harness.data_dir, "a")
    put_secret(harness.data_dir, "north", DOOR_PASSWORD)
    agent, t = harness.agent()
    t.deliver(
        TopicKind.TWIN_DESIRED,
        state(1, {"cam1": camera(model), "door": camera(model, source=DOOR, max_fps=5.0)}),
    )
    rep = wait_for(reported(t, 1, cam1="running", door="running"), what="v1: the pool camera runs")
    assert rep.cameras["door"].model == "a:1" and rep.cameras["door"].max_fps == 5.0
    (door,) = harness.opens("door")
    assert door.source == "rtsp://viewer:pw-7QX@10.0.0.21/stream1" and door.max_fps == 5.0
    wait_for(lambda: agent.pipeline.last_result("door") is not None, what="detections of the pool camera")
    door_worker = agent.pipeline.cameras["door"]

    # Kept at another rate, and a file camera added: neither the door nor cam1 is reopened.
    t.deliver(
        TopicKind.TWIN_DESIRED,
        state(
            2,
            {
                "cam1": camera(model),
                "door": camera(model, source=DOOR, max_fps=10.0),
                "dock": camera(model, source=DOCK),
            },
        ),
    )
    wait_for(reported(t, 2, cam1="running", door="running", dock="running"), what="v2 applied")
    (dock,) = harness.opens("dock")
    assert dock.source == "/srv/footage/dock 2.mp4" and dock.loop
    assert agent.pipeline.cameras["door"] is door_worker and door_worker.config.max_fps == 10.0
    assert [len(harness.opens(c)) for c in ("cam1", "door")] == [1, 1]

    # Dropped: stopped, gone from the pipeline and from the reported state; the others untouched.
    t.deliver(TopicKind.TWIN_DESIRED, state(3, {"cam1": camera(model), "dock": camera(model, source=DOCK)}))
    rep = wait_for(reported(t, 3, cam1="running", dock="running"), what="v3 applied")
    assert "door" not in rep.cameras and "door" not in agent.pipeline.cameras
    assert door_worker.state == CameraState.STOPPED
    assert agent.pipeline.model_of("door") is None
    assert [len(harness.opens(c)) for c in ("cam1", "door", "dock")] == [1, 1, 1]
    wait_for(
        lambda: any(e.kind == EventKind.CAMERA_DOWN and e.camera == "door" for e in t.of(Event)),
        what="camera_down for the camera that left",
    )
    assert harness.loads == ["a"], "one model shared by every camera, loaded once"


def test_a_changed_source_restarts_the_pool_camera_from_it(harness: Harness) -> None:
    model = model_in_store(harness.data_dir, "a")
    agent, t = harness.agent()
    t.deliver(TopicKind.TWIN_DESIRED, state(1, {"gate": camera(model, source="rtsp://10.0.0.30/a")}))
    wait_for(reported(t, 1, gate="running"), what="v1 running")
    first = agent.pipeline.cameras["gate"]
    t.deliver(TopicKind.TWIN_DESIRED, state(2, {"gate": camera(model, source="rtsps://10.0.0.31/b")}))
    wait_for(reported(t, 2, gate="running"), what="v2 running")
    assert [c.source for c in harness.opens("gate")] == ["rtsp://10.0.0.30/a", "rtsps://10.0.0.31/b"]
    assert first.state == CameraState.STOPPED and agent.pipeline.cameras["gate"] is not first
    wait_for(lambda: agent.pipeline.last_result("gate") is not None, what="detections from the new source")
    assert len(harness.opens("cam1")) == 1


def test_pool_cameras_that_cannot_run_are_failed_the_rest_applies_and_no_secret_leaks(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    model = model_in_store(harness.data_dir, "a")
    put_secret(harness.data_dir, "yard", "tok-Z9K2")
    put_secret(harness.data_dir, "shared", "root:pw-0PEN", mode=0o644)
    harness.unreachable.add("yard")
    agent, t = harness.agent()
    t.deliver(
        TopicKind.TWIN_DESIRED,
        state(
            1,
            {
                "cam1": camera(model, source="rtsp://10.0.0.9/x"),  # one of the device's own cameras
                "door": camera(model, source=DOOR),  # its secret is not on the device
                "lobby": camera(model, source="rtsp://{secret:shared}@10.0.0.8/s"),  # others may read it
                "ftp": camera(model, source="ftp://10.0.0.7/cam"),
                "yard": camera(model, source="http://10.0.0.7/mjpg?token={secret:yard}"),
            },
        ),
    )
    rep = wait_for(
        reported(t, 1, cam1="failed", door="failed", lobby="failed", ftp="failed", yard="running"),
        what="v1 applied",
    )
    errors = {c: rep.cameras[c].error or "" for c in ("cam1", "door", "lobby", "ftp")}
    assert "configured on this device" in errors["cam1"]
    assert "secret north is not on this device" in errors["door"]
    assert "chmod 600" in errors["lobby"] and "0644" in errors["lobby"]
    assert "cannot be opened" in errors["ftp"] and "'ftp'" in errors["ftp"]
    # The device's own camera is left as it was: not reopened, no model forced on it.
    assert len(harness.opens("cam1")) == 1 and agent.pipeline.model_of("cam1") is None
    assert not any(harness.opens(c) for c in ("door", "lobby", "ftp"))
    assert agent.pipeline.cameras.keys() == {"cam1", "yard"}

    # The yard's source (token expanded) cannot be opened: its camera_down says why, redacted.
    assert harness.opens("yard")[0].source == "http://10.0.0.7/mjpg?token=tok-Z9K2"
    down = wait_for(
        lambda: next(
            (e for e in t.of(Event) if e.kind == EventKind.CAMERA_DOWN and e.camera == "yard"), None
        ),
        what="camera_down of the yard",
    )
    assert "token=***" in (down.message or "")
    agent.shutdown()
    sent = b"".join(encode(m) for _, m in t.sent)
    for secret in ("tok-Z9K2", "root:pw-0PEN", "pw-0PEN"):
        assert secret.encode() not in sent, f"{secret} was sent"
        assert secret not in caplog.text, f"{secret} was logged"


def test_a_failed_pool_camera_leaves_the_report_with_the_state_that_named_it(harness: Harness) -> None:
    model = model_in_store(harness.data_dir, "a")
    _agent, t = harness.agent()
    t.deliver(TopicKind.TWIN_DESIRED, state(1, {"cam1": camera(model), "door": camera(model, source=DOOR)}))
    wait_for(reported(t, 1, cam1="running", door="failed"), what="door failed: no secret")
    put_secret(harness.data_dir, "north", DOOR_PASSWORD)
    t.deliver(TopicKind.TWIN_DESIRED, state(2, {"cam1": camera(model), "door": camera(model, source=DOOR)}))
    wait_for(reported(t, 2, door="running"), what="door runs once its secret is there")
    t.deliver(TopicKind.TWIN_DESIRED, state(3, {"cam1": camera(model)}))
    rep = wait_for(reported(t, 3, cam1="running"), what="v3")
    assert rep.cameras.keys() == {"cam1"}


def test_a_pool_camera_whose_secret_is_added_later_starts_without_a_new_state(harness: Harness) -> None:
    model = model_in_store(harness.data_dir, "a")
    _agent, t = harness.agent(pool_retry_s=0.2)
    t.deliver(TopicKind.TWIN_DESIRED, state(1, {"cam1": camera(model), "door": camera(model, source=DOOR)}))
    failed = wait_for(reported(t, 1, cam1="running", door="failed"), what="door failed: no secret")
    assert "north" in (failed.cameras["door"].error or "")
    assert harness.opens("door") == []
    # A technician puts the secret on the device; the same state (still v1) now runs the door.
    put_secret(harness.data_dir, "north", DOOR_PASSWORD)
    wait_for(
        reported(t, 1, cam1="running", door="running"), what="door runs from v1 once its secret is there"
    )
    (door,) = harness.opens("door")
    assert door.source == "rtsp://viewer:pw-7QX@10.0.0.21/stream1"
    assert len(harness.opens("cam1")) == 1  # the device's own camera was not reopened by the retry


def test_pool_cameras_come_back_after_an_offline_restart(harness: Harness, tmp_path: Path) -> None:
    model = model_in_store(harness.data_dir, "a")
    remote = model_in_store(tmp_path / "elsewhere", "remote")  # never answered: fetched forever
    put_secret(harness.data_dir, "north", DOOR_PASSWORD)
    agent, t = harness.agent()
    t.deliver(TopicKind.TWIN_DESIRED, state(1, {"cam1": camera(model), "door": camera(model, source=DOOR)}))
    wait_for(reported(t, 1, cam1="running", door="running"), what="v1 running")
    wait_for(lambda: (harness.data_dir / "applied.json").exists(), what="v1 in effect")
    agent.shutdown()

    # Restarted with the broker unreachable: the persisted state brings the pool camera back.
    agent2, t2 = harness.agent()
    wait_for(reported(t2, 1, cam1="running", door="running"), what="v1 running from disk")
    wait_for(lambda: agent2.pipeline.last_result("door") is not None, what="detections after restart")

    # A newer state still being fetched at a restart: the last applied one is served from the store
    # first, its pool camera included.
    t2.deliver(
        TopicKind.TWIN_DESIRED,
        state(2, {"cam1": camera(model), "door": camera(remote, source=DOOR)}),
    )
    wait_for(lambda: any(k == TopicKind.ARTIFACT_REQUEST for k, _ in t2.sent), what="v2 fetching")
    agent2.shutdown()
    agent3, _t3 = harness.agent()

    def serving() -> bool:
        model_now = agent3.pipeline.model_of("door")
        return model_now is not None and model_now.key == "a:1"

    wait_for(serving, what="the door serving v1's model while v2 is fetched")
    wait_for(lambda: agent3.pipeline.last_result("door") is not None, what="detections from the door")
    assert [c.source for c in harness.opens("door")] == [f"rtsp://{DOOR_PASSWORD}@10.0.0.21/stream1"] * 3


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_secret_file_of_the_owner_alone_fills_the_source(tmp_path: Path, mode: int) -> None:
    path = put_secret(tmp_path, "north", DOOR_PASSWORD, mode=mode)
    config = pool_camera_config("door", DOOR, 2.5, SecretFiles(path.parent))
    assert config.source == "rtsp://viewer:pw-7QX@10.0.0.21/stream1"  # the editor's newline left out
    assert config.max_fps == 2.5 and not config.loop


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("file://nas/footage/a.mp4", "not a local file URL"),
        ("/srv/footage/a.mp4", "no scheme"),
        ("rtmp://10.0.0.1/live", "scheme 'rtmp'"),
    ],
)
def test_a_source_the_device_cannot_open_is_refused(tmp_path: Path, source: str, why: str) -> None:
    with pytest.raises(PoolCameraError, match=why):
        pool_camera_config("cam", source, None, SecretFiles(tmp_path))
