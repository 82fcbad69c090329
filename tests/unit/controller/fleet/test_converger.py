"""Twin convergence: a device that drifts from its desired state, or never takes it up, gets it again
under a new version, with a capped backoff per device, and every re-send is an event with its reason."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlmodel import Session

from controller.db import crud
from controller.fleet.converger import EVENT_CONVERGED, ResendPolicy, resend_reason
from controller.fleet.twin import EVENT_RESEND
from fleet_protocol import TopicKind, decode
from fleet_protocol.messages import (
    Availability,
    CameraReported,
    Capabilities,
    ReportedState,
)
from tests.support.controller_app import Fleet, FleetFactory
from tests.support.fleet_replicas import POLICY, Parts
from tests.support.waiting import wait_for

# --------------------------------------------------------------------------- the rules (pure)


def test_backoff_doubles_and_is_capped() -> None:
    assert [POLICY.delay(n) for n in range(7)] == [0, 10, 20, 40, 40, 40, 40]
    assert ResendPolicy(backoff_s=1, backoff_max_s=600).delay(10_000) == 600  # no overflow


@pytest.mark.parametrize(
    ("sync", "online", "published_at", "online_since", "due"),
    [
        ("drifted", True, 990.0, None, "drifted: cam1 runs x"),
        ("drifted", False, 0.0, None, None),  # the retained message waits for it on the broker
        ("pending", True, 950.0, None, None),  # published 50 s ago: it may still be on its way
        ("pending", True, 900.0, None, "still on an older version 100s after the publish"),
        ("pending", True, 900.0, 980.0, None),  # came online 20 s ago: counted from then
        ("applying", True, 0.0, None, None),  # busy fetching or loading: never hurried
        ("failed", True, 0.0, None, None),  # would fail the same way; the rollout acts on it
        ("in_sync", True, 0.0, None, None),
    ],
)
def test_what_is_re_sent_and_when(
    sync: str, online: bool, published_at: float, online_since: float | None, due: str | None
) -> None:
    got = resend_reason(
        sync,
        "cam1 runs x",
        online=online,
        published_at=published_at,
        online_since=online_since,
        now=1000.0,
        policy=POLICY,
    )
    if due is None:
        assert got is None
    else:
        assert got is not None and got.startswith(due)


# --------------------------------------------------------------------------- the converger, clock in hand


def test_a_drifting_device_gets_its_state_again_with_a_capped_backoff(parts: Parts) -> None:
    t0 = time.time()
    parts.report("d1")
    parts.report("d2")
    assert parts.converger.check(t0) == []  # in sync: nothing to do
    assert [m.version for m in parts.desired("d1")] == [1]

    parts.report("d1", sha="f" * 64)  # applied v1, runs something else
    assert parts.converger.check(t0) == ["d1"]
    sent = parts.desired("d1")
    # Same content under a new version: the agent ignores a version it already has.
    assert [m.version for m in sent] == [1, 2]
    assert sent[1].cameras["cam1"].model == sent[0].cameras["cam1"].model
    (ev,) = parts.events("d1", EVENT_RESEND)
    assert ev.severity == "warning" and "drifted" in ev.message and "cam1 runs tiny:1" in ev.message
    assert ev.data["version"] == 2 and ev.data["attempt"] == 1 and ev.data["next_after_s"] == 10

    # It keeps drifting (it reports v2 and still runs the wrong thing): re-sends back off, then cap.
    sends = []
    for second in range(1, 200):
        parts.report("d1", sha="f" * 64)
        if parts.converger.check(t0 + second):
            sends.append(second)
    assert sends == [10, 30, 70, 110, 150, 190]  # +10, +20, then +40 (the cap) for ever
    assert len(parts.events("d1", EVENT_RESEND)) == 7
    assert parts.desired("d2")[-1].version == 1  # the device in sync was never touched

    # In sync again: one event says so, and the backoff starts over.
    parts.report("d1")
    assert parts.converger.check(t0 + 300) == []
    (done,) = parts.events("d1", EVENT_CONVERGED)
    assert done.data == {"version": parts.desired("d1")[-1].version, "resends": 7}
    parts.report("d1", sha="f" * 64)
    assert parts.converger.check(t0 + 301) == ["d1"]
    assert parts.events("d1", EVENT_RESEND)[-1].data["attempt"] == 1


def test_a_device_that_never_takes_up_its_state_gets_it_again_after_the_wait(parts: Parts) -> None:
    issued = parts.desired("d1")[-1].issued_at
    parts.report("d1", version=0)  # still on what it had before v1
    parts.report("d2")
    assert parts.converger.check(issued + 30) == []
    assert parts.converger.check(issued + 61) == ["d1"]
    (ev,) = parts.events("d1", EVENT_RESEND)
    assert "older version" in ev.message and "desired v1" in ev.message
    # Offline: nothing is re-sent (the retained message waits on the broker).
    with Session(parts.engine) as s:
        dev = crud.get_device(s, device_id="d1")
        assert dev is not None
        dev.status = "offline"
        s.add(dev)
        s.commit()
    assert parts.converger.check(issued + 10_000) == []


# --------------------------------------------------------------------------- wired into the controller


def _birth(fleet: Fleet, device: str) -> None:
    r = fleet.client.post("/api/v1/devices", json={"id": device, "labels": {}})
    assert r.status_code == 201, r.text
    caps = Capabilities(hostname=device, cpu_count=2, cameras=["cam1"])
    fleet.send(device, TopicKind.AVAILABILITY, Availability(state="online", capabilities=caps))
    wait_for(lambda: fleet.device(device)["status"] == "online", timeout=10, what=f"{device} online")


def _report(fleet: Fleet, device: str, version: int, sha: str) -> None:
    rep = ReportedState(
        ts=time.time(),
        desired_version=version,
        cameras={"cam1": CameraReported(model="tiny:1", sha256=sha, state="running")},
    )
    fleet.send(device, TopicKind.TWIN_REPORTED, rep)


def _events(fleet: Fleet, device: str, kind: str) -> list[dict[str, Any]]:
    r = fleet.client.get("/api/v1/events", params={"device": device, "kind": kind})
    assert r.status_code == 200, r.text
    out: list[dict[str, Any]] = r.json()
    return out


def test_the_running_controller_re_sends_to_a_drifted_device_until_it_converges(
    make_fleet: FleetFactory,
) -> None:
    fleet = make_fleet(twin_pending_resend_s=0.5, twin_resend_backoff_s=0.2, twin_resend_backoff_max_s=0.5)
    _birth(fleet, "d1")
    r = fleet.client.put("/api/v1/devices/d1/cameras/cam1/model", json={"model": "tiny", "version": "1"})
    assert r.status_code == 200, r.text
    sha = r.json()["cameras"]["cam1"]["model"]["manifest"]["sha256"]
    topic = fleet.topics.device("d1", TopicKind.TWIN_DESIRED)

    _report(fleet, "d1", 1, "f" * 64)
    resent = wait_for(
        lambda: _events(fleet, "d1", "twin_resend"), timeout=10, what="the drift re-send recorded"
    )
    assert "drifted" in resent[-1]["message"]
    assert fleet.device("d1")["desired_version"] >= 2

    def published() -> list[int] | None:
        # The re-send is committed (its event with it) before it is published: wait for the broker's copy.
        msgs = [decode(TopicKind.TWIN_DESIRED, p.payload) for p in fleet.transport.on_topic(topic)]
        versions = [m.version for m in msgs]  # type: ignore[union-attr]
        return versions if len(versions) >= 2 else None

    assert wait_for(published, timeout=10, what="the re-sent state published")[:2] == [1, 2]

    # The device takes it up: in sync, and the controller says it converged.
    version = fleet.device("d1")["desired_version"]
    _report(fleet, "d1", version, sha)
    wait_for(lambda: _events(fleet, "d1", "twin_converged"), timeout=10, what="converged event")
    body = fleet.device("d1")
    assert body["sync"] == "in_sync" and body["desired_version"] == version
