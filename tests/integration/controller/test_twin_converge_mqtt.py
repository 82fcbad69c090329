"""Twin convergence over a real mosquitto: a device that reports something other than its desired state
is sent that state again (retained, under a new version) until it reports it, and the API's events
say why and when it converged."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from fleet_protocol import TopicKind, Topics, decode
from fleet_protocol.messages import Availability, CameraReported, Capabilities, DesiredState, ReportedState
from tests.support.controller_app import AppFactory
from tests.support.fakes.agent import FakeAgent
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

DEV = "it-dev-drift"


def _desired(agent: FakeAgent) -> list[DesiredState]:
    out = []
    for raw in agent.got(TopicKind.TWIN_DESIRED):
        msg = decode(TopicKind.TWIN_DESIRED, raw)
        assert isinstance(msg, DesiredState)
        out.append(msg)
    return out


def _report(agent: FakeAgent, version: int, sha: str) -> None:
    rep = ReportedState(
        ts=time.time(),
        desired_version=version,
        cameras={"cam1": CameraReported(model="tiny:1", sha256=sha, state="running")},
    )
    agent.publish(TopicKind.TWIN_REPORTED, rep)


def test_a_drifted_device_is_sent_its_state_again_until_it_converges(
    make_app: AppFactory, agents: Callable[..., FakeAgent], broker: MosquittoBroker
) -> None:
    client = make_app(twin_resend_backoff_s=0.5, twin_resend_backoff_max_s=1.0)
    agent = agents(DEV, will=False)
    client.post("/api/v1/devices", json={"id": DEV}).raise_for_status()
    caps = Capabilities(hostname=DEV, cpu_count=2, cameras=["cam1"])
    agent.publish(TopicKind.AVAILABILITY, Availability(state="online", capabilities=caps))
    wait_for(
        lambda: client.get(f"/api/v1/devices/{DEV}").json()["status"] == "online", timeout=10, what="online"
    )
    r = client.put(f"/api/v1/devices/{DEV}/cameras/cam1/model", json={"model": "tiny", "version": "1"})
    assert r.status_code == 200, r.text
    first = wait_for(lambda: _desired(agent), timeout=10, what="desired v1")[-1]
    assert first.version == 1
    ref = first.cameras["cam1"].model
    assert ref is not None

    # It says it applied v1 but runs another model: v2 comes, with the same content.
    _report(agent, 1, "f" * 64)
    again = wait_for(
        lambda: [m for m in _desired(agent) if m.version > 1], timeout=15, what="the re-sent state"
    )[0]
    assert again.cameras["cam1"].model == ref

    def events(kind: str) -> list[dict[str, Any]]:
        body: list[dict[str, Any]] = client.get("/api/v1/events", params={"device": DEV, "kind": kind}).json()
        return body

    resent = events("twin_resend")
    assert resent and "drifted" in resent[-1]["message"] and resent[-1]["severity"] == "warning"

    # It takes the state up: in sync, one event says it converged.
    latest = _desired(agent)[-1].version
    _report(agent, latest, ref.manifest.sha256)
    wait_for(lambda: events("twin_converged"), timeout=15, what="converged event")
    body = client.get(f"/api/v1/devices/{DEV}").json()
    assert body["sync"] == "in_sync" and body["desired_version"] == latest
    # The re-sent state is the retained one: a subscriber arriving now gets it.
    late = FakeAgent(broker.host, broker.port, DEV, Topics(), will=False)
    try:
        got = wait_for(lambda: _desired(late), timeout=10, what="retained desired state")
        assert got[-1].version == latest
    finally:
        late.close()
