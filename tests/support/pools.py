"""Camera pools as the API shows them, for the tests that declare one: a camera's declaration with a
secret-reference source, and reading back a pool, where its cameras run, the moves it recorded, and
the pool cameras each device was sent (and the model each runs); what a device reports of them."""

from __future__ import annotations

import time
from typing import Any

from fleet_protocol import TopicKind
from fleet_protocol.codec import decode
from fleet_protocol.messages import CameraDesired, CameraReported, DesiredState, ReportedState
from tests.support.controller_app import Fleet
from tests.support.waiting import wait_for


def pool_camera(cam: str, **over: Any) -> dict[str, Any]:
    """A camera of the tiny model at 10 FPS (5 at least), its source a ``{secret:…}`` reference whose
    host ends with the camera id's last number."""
    return {
        "id": cam,
        "source": f"rtsp://{{secret:north-cams}}@10.0.0.{cam.rsplit('-', 1)[-1]}/stream1",
        "model": "tiny",
        "version": "1",
        "target_fps": 10,
        "min_fps": 5,
        **over,
    }


def put_pool(fleet: Fleet, body: dict[str, Any]) -> dict[str, Any]:
    """Declare (or replace) the pool ``body`` names; its view."""
    r = fleet.client.put(f"/api/v1/pools/{body['name']}", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def get_pool(fleet: Fleet, name: str) -> dict[str, Any]:
    r = fleet.client.get(f"/api/v1/pools/{name}")
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def devices_of(pool: dict[str, Any]) -> dict[str, str]:
    """Camera -> the device that runs it, in a pool view."""
    return {cam: p["device"] for cam, p in pool["placements"].items()}


def cameras_on(pool: dict[str, Any], device: str) -> set[str]:
    return {cam for cam, dev in devices_of(pool).items() if dev == device}


def moved_events(fleet: Fleet) -> list[dict[str, Any]]:
    """Every ``camera_moved`` event recorded."""
    r = fleet.client.get("/api/v1/events", params={"kind": "camera_moved"})
    assert r.status_code == 200, r.text
    out: list[dict[str, Any]] = r.json()
    return out


def sent_desired(fleet: Fleet, device: str) -> DesiredState | None:
    """The last desired state the controller published for ``device`` (what the broker retains)."""
    published = fleet.transport.on_topic(fleet.topics.device(device, TopicKind.TWIN_DESIRED))
    if not published:
        return None
    msg = decode(TopicKind.TWIN_DESIRED, published[-1].payload)
    assert isinstance(msg, DesiredState)
    return msg


def sent_pool_cameras(fleet: Fleet, device: str) -> dict[str, CameraDesired]:
    """The pool cameras (those with a source) of the last desired state published for ``device``."""
    state = sent_desired(fleet, device)
    return {} if state is None else {c: cd for c, cd in state.cameras.items() if cd.source is not None}


def report_pool_cameras(fleet: Fleet, device: str, cameras: dict[str, tuple[str, str, str | None]]) -> None:
    """What ``device``'s agent reports once it applied its last desired state: per camera (model as
    "name:version", state, error); stored by the controller before this returns."""
    state = sent_desired(fleet, device)
    assert state is not None
    fleet.send(
        device,
        TopicKind.TWIN_REPORTED,
        ReportedState(
            ts=time.time(),
            desired_version=state.version,
            cameras={
                c: CameraReported(model=m, state=st, error=err)  # type: ignore[arg-type]
                for c, (m, st, err) in cameras.items()
            },
        ),
    )
    wait_for(
        lambda: fleet.device(device)["reported_version"] == state.version,
        timeout=10,
        what=f"{device}'s report of v{state.version} stored",
    )


def sent_model(fleet: Fleet, device: str, camera: str) -> str | None:
    """ "name:version" of the model the last desired state published for ``device`` runs on ``camera``."""
    state = sent_desired(fleet, device)
    cd = state.cameras.get(camera) if state is not None else None
    if cd is None or cd.model is None:
        return None
    return f"{cd.model.manifest.name}:{cd.model.manifest.version}"
