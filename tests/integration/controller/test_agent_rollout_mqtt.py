"""Agent rollouts over a real mosquitto, the controller's side: devices (raw MQTT clients
speaking the protocol) get the signed agent ref in their retained desired state, fetch the package over
the chunked artifact channel and find its sha256; a canary that reports its update rolled back fails
the gate, later waves are never admitted, and the canary is sent its previous version again; rolling
back the version before then sends every device to what it ran first, never to the one the canary
rolled back, and the canary's view keeps why that one failed.

The agent's own side (install, supervisor, restart, real roll back) is tests/integration/edge_agent/
test_self_update.py."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from fleet_protocol import TopicKind, decode, decode_chunk
from fleet_protocol.messages import (
    AgentReported,
    AgentUpdateState,
    ArtifactRequest,
    Availability,
    Capabilities,
    DesiredState,
    ReportedState,
)
from fleet_protocol.signing import load_public_key, verify_agent_package, verify_desired
from tests.support.agent_packages import make_package
from tests.support.controller_app import AppFactory
from tests.support.fakes.agent import FakeAgent
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

GATE = {"soak_s": 0, "step_timeout_s": 60, "offline_timeout_s": 60}


def _desired(agent: FakeAgent) -> DesiredState | None:
    got = agent.got(TopicKind.TWIN_DESIRED)
    if not got:
        return None
    msg = decode(TopicKind.TWIN_DESIRED, got[-1])
    assert isinstance(msg, DesiredState)
    return msg


def _wants(agent: FakeAgent, version: str) -> DesiredState | None:
    d = _desired(agent)
    return d if d is not None and d.agent is not None and d.agent.version == version else None


def _online(client: TestClient, agent: FakeAgent, version: str) -> None:
    caps = Capabilities(hostname=agent.device_id, cpu_count=2, cameras=["cam1"])
    agent.publish(
        TopicKind.AVAILABILITY, Availability(state="online", agent_version=version, capabilities=caps)
    )
    _report(agent, version, AgentUpdateState.IDLE)
    wait_for(
        lambda: (
            (client.get(f"/api/v1/devices/{agent.device_id}").json().get("agent") or {}).get("version")
            == version
        ),
        timeout=10,
        what=f"{agent.device_id} online on {version}",
    )


def _report(agent: FakeAgent, version: str, state: AgentUpdateState, **kw: Any) -> None:
    d = _desired(agent)
    rep = ReportedState(
        ts=time.time(),
        desired_version=d.version if d is not None else 0,
        agent_version=version,
        agent=AgentReported(version=version, slot=version, state=state, **kw),
    )
    agent.publish(TopicKind.TWIN_REPORTED, rep, retain=True)


def _fetch(agent: FakeAgent, sha256: str, size: int, chunk_size: int) -> bytes:
    """Ask for every chunk, the way an agent does, and put the file together."""
    n = -(-size // chunk_size)
    agent.publish(
        TopicKind.ARTIFACT_REQUEST,
        ArtifactRequest(sha256=sha256, chunks=list(range(n)), chunk_size=chunk_size),
    )

    def chunks() -> dict[int, bytes] | None:
        got = dict(
            (h.index, body) for h, body in (decode_chunk(p) for p in agent.got(TopicKind.ARTIFACT_CHUNK))
        )
        return got if len(got) >= n else None

    got = wait_for(chunks, timeout=20, what=f"{n} chunks of {sha256[:12]}")
    return b"".join(got[i] for i in range(n))


def _rollout(client: TestClient, name: str) -> dict[str, Any]:
    body: dict[str, Any] = client.get(f"/api/v1/deployments/{name}").json()["rollout"]
    return body


def test_agent_rollout_over_mqtt_ships_a_verifiable_package_and_a_failed_canary_goes_back(
    make_app: AppFactory, agents: Callable[..., FakeAgent]
) -> None:
    client = make_app()
    packages = {v: make_package(v) for v in ("1.0", "1.1")}
    for v, data in packages.items():
        r = client.post("/api/v1/agent-packages", files={"file": (f"edgefleet-agent-{v}.tar.gz", data)})
        assert r.status_code == 201, r.text
    devices = [f"it-agent-{i}" for i in range(3)]
    fakes: dict[str, FakeAgent] = {}
    for d in devices:
        client.post("/api/v1/devices", json={"id": d, "labels": {"ring": "it-agent"}}).raise_for_status()
        fakes[d] = agents(d, will=False)
        _online(client, fakes[d], "1.0")
    key = load_public_key(client.get("/api/v1/keys/artifacts").json()["public_key"])

    # 1. A first rollout to the whole ring (1 canary, then the rest) succeeds device by device.
    r = client.post(
        "/api/v1/agent-deployments",
        json={
            "name": "ring-11",
            "version": "1.1",
            "selector": "ring=it-agent",
            "waves": [1, "100%"],
            "gate": GATE,
        },
    )
    assert r.status_code == 201, r.text
    for d in devices:
        state = wait_for(lambda d=d: _wants(fakes[d], "1.1"), timeout=20, what=f"{d} desired names 1.1")  # type: ignore[misc]
        verify_desired(state, key)
        assert state.agent is not None
        verify_agent_package(state.agent, key)
        data = _fetch(fakes[d], state.agent.sha256, state.agent.size, state.agent.chunk_size)
        assert hashlib.sha256(data).hexdigest() == state.agent.sha256 and data == packages["1.1"]
        _report(fakes[d], "1.1", AgentUpdateState.IDLE)
    wait_for(
        lambda: _rollout(client, "ring-11")["state"] == "succeeded", timeout=20, what="ring-11 succeeded"
    )

    # 2. The next version crashes at start on the canary: the gate fails, nobody else gets it, and the
    # canary is sent 1.1 again (what it ran before), signed.
    packages["1.2"] = make_package("1.2")
    r = client.post("/api/v1/agent-packages", files={"file": ("edgefleet-agent-1.2.tar.gz", packages["1.2"])})
    assert r.status_code == 201, r.text
    r = client.post(
        "/api/v1/agent-deployments",
        json={
            "name": "ring-12",
            "version": "1.2",
            "selector": "ring=it-agent",
            "waves": [1, "100%"],
            "gate": GATE,
            "priority": 1,
        },
    )
    assert r.status_code == 201, r.text
    canary = devices[0]
    wait_for(lambda: _wants(fakes[canary], "1.2"), timeout=20, what="the canary is sent 1.2")
    _report(
        fakes[canary], "1.1", AgentUpdateState.ROLLED_BACK, target="1.2", error="not healthy within 120 s"
    )
    wait_for(lambda: _rollout(client, "ring-12")["state"] == "failed", timeout=20, what="ring-12 gate failed")
    ro = _rollout(client, "ring-12")
    assert "rolled back: not healthy within 120 s" in ro["reason"]
    assert [m["device_id"] for m in ro["devices"]] == [canary]
    back = wait_for(lambda: _wants(fakes[canary], "1.1"), timeout=20, what="the canary is sent 1.1 again")
    verify_desired(back, key)
    for d in devices[1:]:
        assert _wants(fakes[d], "1.1") is not None and not any(
            (m := decode(TopicKind.TWIN_DESIRED, raw)).agent is not None and m.agent.version == "1.2"  # type: ignore[union-attr]
            for raw in fakes[d].got(TopicKind.TWIN_DESIRED)
        )
    view = client.get(f"/api/v1/devices/{canary}").json()["agent"]
    assert (
        view["state"] == "rolled_back"
        and view["error"] == "not healthy within 120 s"
        and view["desired"] == "1.1"
    )
    # What a device still needs cannot be deleted.
    assert client.delete("/api/v1/agent-packages/1.1").status_code == 409

    # 3. Back on 1.1 and no longer asked for 1.2, the canary's agent reports idle without the error; the
    # view keeps why 1.2 failed, and 1.2 is not where a roll back of 1.1 would send it.
    _report(fakes[canary], "1.1", AgentUpdateState.IDLE)
    view = wait_for(
        lambda: (v := client.get(f"/api/v1/devices/{canary}").json()["agent"])["state"] == "idle" and v,
        timeout=10,
        what="the canary reports idle on 1.1",
    )
    assert view["fallback"] == "1.0", view
    assert view["last_failure"]["version"] == "1.2" and view["last_failure"]["state"] == "rolled_back", view
    assert view["last_failure"]["error"] == "not healthy within 120 s", view

    # 4. The operator rolls 1.1 back: every device, the canary included, is sent the 1.0 it ran first.
    sent_12 = sum(_names(raw, "1.2") for raw in fakes[canary].got(TopicKind.TWIN_DESIRED))
    r = client.post("/api/v1/deployments/ring-11/rollback")
    assert r.status_code == 200, r.text
    for d in devices:
        back = wait_for(lambda d=d: _wants(fakes[d], "1.0"), timeout=20, what=f"{d} sent 1.0")  # type: ignore[misc]
        verify_desired(back, key)
    assert sum(_names(raw, "1.2") for raw in fakes[canary].got(TopicKind.TWIN_DESIRED)) == sent_12
    assert _rollout(client, "ring-12")["state"] == "failed"
    assert client.get("/api/v1/deployments/ring-12").json()["state"] == "failed"


def _names(raw: bytes, version: str) -> bool:
    msg = decode(TopicKind.TWIN_DESIRED, raw)
    return isinstance(msg, DesiredState) and msg.agent is not None and msg.agent.version == version
