"""Where an agent roll back sends a device: the version it ran before, never one it refused or rolled back.

The README's upgrade story, on the controller with a real database: a good 1.1 everywhere, a broken 1.2
in canary waves that the canary rolls back, then the operator rolls the 1.1 deployment back. Every
device must go back to the 1.0 it ran first, and the canary's view keeps why 1.2 failed.
"""

from __future__ import annotations

import time
from typing import Any

from fleet_protocol import TopicKind
from fleet_protocol.messages import (
    AgentReported,
    AgentUpdateState,
    Availability,
    Capabilities,
    DesiredState,
    ReportedState,
)
from tests.support.agent_packages import make_package
from tests.support.controller_app import Fleet
from tests.support.waiting import wait_for

FAST = {"soak_s": 0, "step_timeout_s": 30, "offline_timeout_s": 30}
BROKEN = "exit code 1: ImportError: boom"


def _upload(fleet: Fleet, version: str) -> None:
    r = fleet.client.post(
        "/api/v1/agent-packages",
        files={"file": (f"edgefleet-agent-{version}.tar.gz", make_package(version), "application/gzip")},
    )
    assert r.status_code == 201, r.text


def _online(fleet: Fleet, device: str, version: str) -> None:
    r = fleet.client.post("/api/v1/devices", json={"id": device, "labels": {"site": "a"}})
    assert r.status_code == 201, r.text
    caps = Capabilities(hostname=device, cpu_count=2, cameras=["cam1"])
    fleet.send(
        device, TopicKind.AVAILABILITY, Availability(state="online", agent_version=version, capabilities=caps)
    )
    wait_for(lambda: fleet.device(device)["capabilities"], timeout=10, what=f"{device} birth stored")
    _report(fleet, device, version)


def _report(
    fleet: Fleet,
    device: str,
    version: str,
    state: AgentUpdateState = AgentUpdateState.IDLE,
    **kw: Any,
) -> None:
    rep = ReportedState(
        ts=time.time(),
        desired_version=fleet.device(device)["desired_version"],
        agent_version=version,
        agent=AgentReported(version=version, slot=version, state=state, **kw),
    )
    fleet.send(device, TopicKind.TWIN_REPORTED, rep)
    wait_for(
        lambda: (
            (fleet.device(device)["agent"] or {}).get("state") == state.value
            and fleet.device(device)["agent"]["version"] == version
        ),
        timeout=10,
        what=f"{device} reported agent {version} {state.value}",
    )


def _agent(fleet: Fleet, device: str) -> dict[str, Any]:
    view: dict[str, Any] = fleet.device(device)["agent"] or {}
    return view


def _deploy(fleet: Fleet, **body: Any) -> None:
    r = fleet.client.post("/api/v1/agent-deployments", json={"gate": FAST, **body})
    assert r.status_code == 201, r.text


def _rollout_state(fleet: Fleet, name: str) -> str:
    state: str = fleet.client.get(f"/api/v1/deployments/{name}").json()["rollout"]["state"]
    return state


def _sent(fleet: Fleet, device: str) -> list[str | None]:
    """Every agent version the device's published desired states named, in order."""
    out: list[str | None] = []
    for p in fleet.transport.on_topic(fleet.topics.device(device, TopicKind.TWIN_DESIRED)):
        agent = DesiredState.model_validate_json(p.payload).agent
        out.append(agent.version if agent is not None else None)
    return out


def test_a_version_the_canary_rolled_back_is_never_where_a_later_rollback_sends_it(fleet: Fleet) -> None:
    for v in ("1.0", "1.1", "1.2"):
        _upload(fleet, v)
    for d in ("d1", "d2"):
        _online(fleet, d, "1.0")

    _deploy(fleet, name="agent-11", version="1.1", selector="site=a", waves=["100%"])
    for d in ("d1", "d2"):
        wait_for(lambda d=d: _agent(fleet, d).get("desired") == "1.1", timeout=15, what=f"{d} sent 1.1")  # type: ignore[misc]
        _report(fleet, d, "1.1")
    wait_for(lambda: _rollout_state(fleet, "agent-11") == "succeeded", timeout=15, what="agent-11 succeeded")

    # The same priority: the newer deployment wins, so the canary is sent 1.2 over 1.1.
    _deploy(fleet, name="agent-12", version="1.2", selector="site=a", waves=[1, "100%"])
    wait_for(lambda: _agent(fleet, "d1").get("desired") == "1.2", timeout=15, what="the canary is sent 1.2")
    _report(fleet, "d1", "1.1", AgentUpdateState.ROLLED_BACK, target="1.2", previous="1.2", error=BROKEN)
    wait_for(lambda: _rollout_state(fleet, "agent-12") == "failed", timeout=15, what="agent-12 gate failed")
    wait_for(lambda: _agent(fleet, "d1").get("desired") == "1.1", timeout=15, what="the canary back on 1.1")
    # The agent stops reporting the failure once 1.1 is desired again; the view still says what happened.
    _report(fleet, "d1", "1.1")
    view = _agent(fleet, "d1")
    assert view["fallback"] == "1.0", view
    assert view["last_failure"]["version"] == "1.2", view
    assert view["last_failure"]["state"] == "rolled_back" and view["last_failure"]["error"] == BROKEN, view
    assert _agent(fleet, "d2")["fallback"] == "1.0"

    r = fleet.client.post("/api/v1/deployments/agent-11/rollback")
    assert r.status_code == 200, r.text
    for d in ("d1", "d2"):
        wait_for(lambda d=d: _agent(fleet, d).get("desired") == "1.0", timeout=15, what=f"{d} back to 1.0")  # type: ignore[misc]
    assert _sent(fleet, "d1")[-1] == "1.0" and _sent(fleet, "d1").count("1.2") == 1
    assert "1.2" not in _sent(fleet, "d2")


def test_a_device_that_refused_the_new_version_is_not_sent_it_as_its_fallback(fleet: Fleet) -> None:
    """Refused (unsigned, missing dependencies) rather than rolled back: the same rule."""
    for v in ("1.0", "1.1", "1.2"):
        _upload(fleet, v)
    _online(fleet, "d1", "1.0")
    _deploy(fleet, name="agent-11", version="1.1", selector="site=a", waves=["100%"])
    wait_for(lambda: _agent(fleet, "d1").get("desired") == "1.1", timeout=15, what="d1 sent 1.1")
    _report(fleet, "d1", "1.1")
    wait_for(lambda: _rollout_state(fleet, "agent-11") == "succeeded", timeout=15, what="agent-11 succeeded")

    _deploy(fleet, name="agent-12", version="1.2", selector="site=a", waves=["100%"], priority=1)
    wait_for(lambda: _agent(fleet, "d1").get("desired") == "1.2", timeout=15, what="d1 sent 1.2")
    _report(fleet, "d1", "1.1", AgentUpdateState.FAILED, target="1.2", error="missing pydantic==9")
    wait_for(lambda: _rollout_state(fleet, "agent-12") == "failed", timeout=15, what="agent-12 gate failed")
    wait_for(lambda: _agent(fleet, "d1").get("desired") == "1.1", timeout=15, what="d1 back on 1.1")
    _report(fleet, "d1", "1.1")
    view = _agent(fleet, "d1")
    assert view["fallback"] == "1.0" and view["last_failure"]["error"] == "missing pydantic==9", view

    fleet.client.post("/api/v1/deployments/agent-11/rollback").raise_for_status()
    wait_for(lambda: _agent(fleet, "d1").get("desired") == "1.0", timeout=15, what="d1 back to 1.0")


def test_a_failure_the_agent_got_past_is_not_shown_as_its_last_failure(fleet: Fleet) -> None:
    for v in ("1.0", "1.1"):
        _upload(fleet, v)
    _online(fleet, "d1", "1.0")
    fleet.client.put("/api/v1/devices/d1/agent", json={"version": "1.1"}).raise_for_status()
    retry = "transfer failed: no answer; trying again in 10 s"
    _report(fleet, "d1", "1.0", AgentUpdateState.FAILED, target="1.1", error=retry)
    assert _agent(fleet, "d1")["last_failure"] == {
        "version": "1.1",
        "state": "failed",
        "error": retry,
        "at": None,
    }
    _report(fleet, "d1", "1.1")
    assert _agent(fleet, "d1")["last_failure"] is None
