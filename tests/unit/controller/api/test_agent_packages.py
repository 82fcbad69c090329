"""Agent packages on the controller: upload and its checks, the signed agent ref in the
desired state, the artifact channel serving the package, agent rollouts whose gate reads the agent's
reported version and whose failure sends the wave back to the previous version, and the device view."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import pytest

from controller.db.states import MemberState
from controller.db.tables import Deployment
from controller.fleet.gate import (
    DeviceView,
    Finish,
    GateConfig,
    GateResult,
    MemberView,
    RolloutView,
    Settle,
    step,
)
from fleet_protocol import TopicKind, decode_chunk
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
from tests.support.agent_packages import make_package, make_wheel, wheel_name
from tests.support.controller_app import Fleet
from tests.support.waiting import wait_for

FAST = {"soak_s": 0, "step_timeout_s": 30, "offline_timeout_s": 30}


def upload(fleet: Fleet, data: bytes, name: str = "edgefleet-agent.tar.gz", **params: str) -> Any:
    return fleet.client.post(
        "/api/v1/agent-packages", params=params, files={"file": (name, data, "application/gzip")}
    )


def uploaded(fleet: Fleet, version: str) -> dict[str, Any]:
    r = upload(fleet, make_package(version))
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    return body


def enroll(fleet: Fleet, device: str, agent: str = "1.0", **labels: str) -> None:
    r = fleet.client.post("/api/v1/devices", json={"id": device, "labels": labels})
    assert r.status_code == 201, r.text
    caps = Capabilities(hostname=device, cpu_count=2, cameras=["cam1"])
    fleet.send(
        device, TopicKind.AVAILABILITY, Availability(state="online", agent_version=agent, capabilities=caps)
    )
    wait_for(lambda: fleet.device(device)["capabilities"], timeout=10, what=f"{device} birth stored")
    report_agent(fleet, device, agent)


def report_agent(
    fleet: Fleet,
    device: str,
    version: str,
    state: AgentUpdateState = AgentUpdateState.IDLE,
    *,
    target: str | None = None,
    error: str | None = None,
) -> None:
    body = fleet.device(device)
    rep = ReportedState(
        ts=time.time(),
        desired_version=body["desired_version"],
        agent_version=version,
        agent=AgentReported(version=version, slot=version, state=state, target=target, error=error),
    )
    fleet.send(device, TopicKind.TWIN_REPORTED, rep)
    wait_for(
        lambda: (fleet.device(device)["agent"] or {}).get("state") == state.value,
        timeout=10,
        what=f"{device} reported agent {version} {state.value}",
    )


def desired_agent(fleet: Fleet, device: str) -> str | None:
    return (fleet.device(device)["agent"] or {}).get("desired")


def deployment(fleet: Fleet, name: str) -> dict[str, Any]:
    r = fleet.client.get(f"/api/v1/deployments/{name}")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def last_desired(fleet: Fleet, device: str) -> DesiredState:
    topic = fleet.topics.device(device, TopicKind.TWIN_DESIRED)
    published = fleet.transport.on_topic(topic)
    assert published, f"no desired state published for {device}"
    return DesiredState.model_validate_json(published[-1].payload)


# --------------------------------------------------------------------------- upload


def test_a_valid_package_is_stored_listed_and_refused_a_second_time(fleet: Fleet, tmp_path: Path) -> None:
    data = make_package("1.1")
    r = upload(fleet, data, notes="first canary")
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["version"] == "1.1" and body["size"] == len(data)
    assert body["sha256"] == hashlib.sha256(data).hexdigest()
    assert body["requires"] == ["paho-mqtt==2.1.0", "pydantic==2.11.7"] and body["notes"] == "first canary"
    assert [p["version"] for p in fleet.client.get("/api/v1/agent-packages").json()] == ["1.1"]
    assert fleet.client.get("/api/v1/agent-packages/1.1").json()["sha256"] == body["sha256"]
    assert fleet.client.get("/api/v1/agent-packages/9.9").status_code == 404
    stored = list((tmp_path / "data").rglob(f"{body['sha256']}*"))
    assert len(stored) == 1 and stored[0].read_bytes() == data

    again = upload(fleet, make_package("1.1", manifest={"requires": []}))
    assert again.status_code == 409 and "already uploaded" in again.json()["detail"]
    same = upload(fleet, data)
    assert same.status_code == 409 and "the same bytes" in same.json()["detail"]


BAD: dict[str, tuple[bytes, str]] = {
    "not gzip": (b"PK\x03\x04 a zip, not a tarball" * 10, "not a gzip tarball"),
    "no manifest": (make_package("1.1", omit_manifest=True), "no agent-package.json"),
    "format": (make_package("1.1", manifest={"format": 2}), "format must be 1"),
    "version": (make_package("1.1", manifest={"version": "../1.1"}), "version '../1.1' is not valid"),
    "python": (make_package("1.1", manifest={"python": "three"}), "python must be like"),
    "requires": (make_package("1.1", manifest={"requires": ["paho-mqtt>=2"]}), "must be pins"),
    "wheel missing": (
        make_package("1.1", wheel_path="wheels/other.whl"),
        "names wheels/edgefleet-1.1-py3-none-any.whl, which is not in the package",
    ),
    "wheel of another version": (
        make_package(
            "1.1", manifest={"wheel": f"wheels/{wheel_name('1.0')}"}, wheel_path=f"wheels/{wheel_name('1.0')}"
        ),
        "is version 1.0, the package says 1.1",
    ),
    "metadata of another version": (
        make_package("1.1", wheel=make_wheel("1.1", metadata_version="1.0")),
        "its METADATA says version '1.0'",
    ),
    "another project's wheel": (make_package("1.1", wheel=make_wheel("1.1", name="evil")), "names 'evil'"),
    "wheel not a zip": (make_package("1.1", wheel=b"not a zip at all"), "is not a wheel (zip)"),
    "path escape": (make_package("1.1", extra={"../../etc/cron.d/x": b"boom"}), "outside the package"),
    "stray file": (make_package("1.1", extra={"install.sh": b"rm -rf /"}), "unexpected file 'install.sh'"),
    "truncated": (make_package("1.1")[:-200], "truncated or corrupt"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_packages_are_refused_with_the_reason_and_leave_nothing(
    fleet: Fleet, tmp_path: Path, case: str
) -> None:
    data, why = BAD[case]
    r = upload(fleet, data)
    assert r.status_code == 400, r.text
    assert why in r.json()["detail"]
    assert fleet.client.get("/api/v1/agent-packages").json() == []
    assert not [p for p in (tmp_path / "data").rglob("*.agent.tar.gz")]
    assert not [p for p in (tmp_path / "data").rglob(".incoming-*")]


def test_an_empty_or_missing_file_is_a_422_and_a_body_that_is_not_multipart_a_400(fleet: Fleet) -> None:
    assert upload(fleet, b"").status_code == 422
    r = fleet.client.post(
        "/api/v1/agent-packages", content=b"{}", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "multipart" in r.text


def test_a_symlink_member_is_refused(fleet: Fleet) -> None:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        link = tarfile.TarInfo("agent-package.json")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    r = upload(fleet, buf.getvalue())
    assert r.status_code == 400 and "links are refused" in r.json()["detail"]


# --------------------------------------------------------------------------- direct assignment + channel


def test_a_device_is_sent_a_signed_agent_ref_and_can_fetch_the_package_by_its_chunks(fleet: Fleet) -> None:
    pkg = uploaded(fleet, "1.1")
    data = make_package("1.1")
    enroll(fleet, "d1")
    assert fleet.client.put("/api/v1/devices/d1/agent", json={"version": "9.9"}).status_code == 404
    assert fleet.client.put("/api/v1/devices/nope/agent", json={"version": "1.1"}).status_code == 404
    r = fleet.client.put("/api/v1/devices/d1/agent", json={"version": "1.1", "health_timeout_s": 45})
    assert r.status_code == 200, r.text

    state = last_desired(fleet, "d1")
    key = load_public_key(fleet.client.get("/api/v1/keys/artifacts").json()["public_key"])
    verify_desired(state, key)  # the whole state, the agent ref inside it included
    assert state.agent is not None
    verify_agent_package(state.agent, key)  # and the ref on its own, checked before any fetch
    assert (state.agent.version, state.agent.sha256, state.agent.size) == ("1.1", pkg["sha256"], len(data))
    assert state.agent.health_timeout_s == 45
    agent = fleet.device("d1")["agent"]
    assert agent["desired"] == "1.1" and agent["desired_source"] == "direct" and agent["version"] == "1.0"

    # The artifact channel serves it like a model file: every chunk, whose bytes make up the package.
    cs = state.agent.chunk_size
    n = -(-len(data) // cs)
    fleet.send(
        "d1",
        TopicKind.ARTIFACT_REQUEST,
        ArtifactRequest(sha256=pkg["sha256"], chunks=list(range(n)), chunk_size=cs),
    )
    topic = fleet.topics.device("d1", TopicKind.ARTIFACT_CHUNK)
    frames = wait_for(
        lambda: f if len(f := fleet.transport.on_topic(topic)) >= n else None, timeout=10, what="chunks"
    )
    chunks = dict((h.index, body) for h, body in (decode_chunk(p.payload) for p in frames))
    assert b"".join(chunks[i] for i in range(n)) == data

    # Another device, whose desired state names no package, is refused it.
    enroll(fleet, "d2")
    fleet.send(
        "d2", TopicKind.ARTIFACT_REQUEST, ArtifactRequest(sha256=pkg["sha256"], chunks=[0], chunk_size=cs)
    )
    wait_for(
        lambda: fleet.counters().get("artifacts/request", {}).get("not_assigned", 0) >= 1,
        timeout=10,
        what="refusal",
    )
    assert not fleet.transport.on_topic(fleet.topics.device("d2", TopicKind.ARTIFACT_CHUNK))

    # A desired package cannot be deleted; cleared, it can.
    assert fleet.client.delete("/api/v1/agent-packages/1.1").status_code == 409
    assert fleet.client.put("/api/v1/devices/d1/agent", json={"version": None}).status_code == 200
    assert fleet.client.delete("/api/v1/agent-packages/1.1").status_code == 204
    assert fleet.client.get("/api/v1/agent-packages").json() == []


# --------------------------------------------------------------------------- agent rollouts


def agent_deploy(fleet: Fleet, **body: Any) -> dict[str, Any]:
    r = fleet.client.post("/api/v1/agent-deployments", json={"gate": FAST, **body})
    assert r.status_code == 201, r.text
    out: dict[str, Any] = r.json()
    return out


def test_a_canary_that_rolls_back_fails_the_gate_and_its_device_is_sent_the_previous_version(
    fleet: Fleet,
) -> None:
    uploaded(fleet, "1.0")
    uploaded(fleet, "1.1")
    for d in ("d1", "d2", "d3"):
        enroll(fleet, d, "1.0", site="a")
    r = fleet.client.post("/api/v1/agent-deployments", json={"version": "9.9", "selector": "site=a"})
    assert r.status_code == 404 and "not uploaded" in r.text
    dep = agent_deploy(fleet, name="agent-11", version="1.1", selector="site=a", waves=[1, "100%"])
    assert dep["kind"] == "agent" and dep["agent_version"] == "1.1" and dep["rollout"]["plan"] == [1, 3]

    wait_for(lambda: desired_agent(fleet, "d1") == "1.1", timeout=15, what="the canary is sent 1.1")
    assert last_desired(fleet, "d1").agent is not None
    # The new version crashed at start; the supervisor went back to 1.0 and the agent says why.
    report_agent(
        fleet, "d1", "1.0", AgentUpdateState.ROLLED_BACK, target="1.1", error="exit code 1: ImportError: boom"
    )
    wait_for(
        lambda: deployment(fleet, "agent-11")["rollout"]["state"] == "failed", timeout=15, what="gate failed"
    )
    ro = deployment(fleet, "agent-11")["rollout"]
    assert "agent 1.1 rolled back: exit code 1: ImportError: boom" in ro["reason"]
    assert [d["device_id"] for d in ro["devices"]] == ["d1"]  # the later wave was never admitted
    assert deployment(fleet, "agent-11")["state"] == "failed"
    # Back to what it ran: the 1.0 package, signed, not "leave as is".
    wait_for(lambda: desired_agent(fleet, "d1") == "1.0", timeout=15, what="d1 sent back to 1.0")
    assert fleet.device("d1")["agent"]["desired_source"] == "rollback"
    back = last_desired(fleet, "d1").agent
    assert back is not None and back.version == "1.0"
    for d in ("d2", "d3"):
        assert desired_agent(fleet, d) is None and last_desired_or_none(fleet, d) is None


def last_desired_or_none(fleet: Fleet, device: str) -> DesiredState | None:
    published = fleet.transport.on_topic(fleet.topics.device(device, TopicKind.TWIN_DESIRED))
    return DesiredState.model_validate_json(published[-1].payload) if published else None


def test_waves_advance_as_devices_report_the_new_version_and_a_rollback_sends_all_back(fleet: Fleet) -> None:
    uploaded(fleet, "1.0")
    uploaded(fleet, "1.1")
    for d in ("d1", "d2", "d3"):
        enroll(fleet, d, "1.0", site="a")
    agent_deploy(fleet, name="agent-11", version="1.1", selector="site=a", waves=[1, "100%"])
    wait_for(lambda: desired_agent(fleet, "d1") == "1.1", timeout=15, what="canary sent 1.1")
    assert desired_agent(fleet, "d2") is None  # not before the canary passed its gate
    report_agent(fleet, "d1", "1.1")
    for d in ("d2", "d3"):
        wait_for(lambda d=d: desired_agent(fleet, d) == "1.1", timeout=15, what=f"{d} sent 1.1")  # type: ignore[misc]
        report_agent(fleet, d, "1.1")
    wait_for(
        lambda: deployment(fleet, "agent-11")["rollout"]["state"] == "succeeded", timeout=15, what="succeeded"
    )
    assert deployment(fleet, "agent-11")["state"] == "active"
    view = fleet.device("d3")["agent"]
    assert (view["version"], view["desired"], view["deployment"], view["fallback"]) == (
        "1.1",
        "1.1",
        "agent-11",
        "1.0",
    )

    r = fleet.client.post("/api/v1/deployments/agent-11/rollback")
    assert r.status_code == 200, r.text
    for d in ("d1", "d2", "d3"):
        wait_for(lambda d=d: desired_agent(fleet, d) == "1.0", timeout=15, what=f"{d} back to 1.0")  # type: ignore[misc]


def test_an_agent_deployment_leaves_the_cameras_models_alone(fleet: Fleet) -> None:
    uploaded(fleet, "1.1")
    enroll(fleet, "d1", "1.0")
    assert (
        fleet.client.put(
            "/api/v1/devices/d1/cameras/cam1/model", json={"model": "tiny", "version": "1"}
        ).status_code
        == 200
    )
    before = last_desired(fleet, "d1").cameras
    agent_deploy(fleet, name="a", version="1.1", waves=["100%"])
    wait_for(lambda: desired_agent(fleet, "d1") == "1.1", timeout=15, what="sent 1.1")
    after = last_desired(fleet, "d1")
    assert after.cameras == before and fleet.device("d1")["assignments"]["cam1"]["source"] == "direct"


# --------------------------------------------------------------------------- the gate, pure

T0 = 1_000_000.0


def _view(members: dict[str, MemberView]) -> RolloutView:
    return RolloutView(
        state="running",
        model=":",
        plan=(1, 2),
        current_wave=0,
        gate=GateConfig(soak_s=0, step_timeout_s=60, offline_timeout_s=20),
        members=members,
        agent_version="1.1",
        agent_health_timeout_s=30,
    )


def _member(state: str = "applying") -> MemberView:
    return MemberView(device_id="d1", wave=0, state=state, admitted_at=T0, target_version=3)


def _dev(**agent: Any) -> DeviceView:
    return DeviceView(id="d1", agent=agent or None)


def test_agent_gate_waits_through_fetch_and_restart_then_settles_on_what_the_agent_reports() -> None:
    r = _view({"d1": _member()})
    for busy in (
        {"version": "1.0", "state": "fetching", "target": "1.1"},
        {"version": "1.0", "state": "restarting"},
    ):
        assert step(r, {"d1": _dev(**busy)}, T0 + 10) == []
    # Offline while it restarts, within the bound, is no failure either.
    assert step(r, {"d1": DeviceView(id="d1", online=False, offline_since=T0 + 5)}, T0 + 15) == []
    assert step(r, {"d1": _dev(version="1.1", state="idle")}, T0 + 12)[0] == Settle("d1", MemberState.ACTIVE)
    # Past step_timeout_s + the health timeout without the new version: failed, saying what it runs.
    late = step(r, {"d1": _dev(version="1.0", state="installing")}, T0 + 91)
    assert isinstance(late[0], Settle) and late[0].state == "failed"
    assert "not running agent 1.1 after 90s" in str(late[0].reason) and "1.0 (installing)" in str(
        late[0].reason
    )
    assert step(r, {"d1": _dev(version="1.0", state="installing")}, T0 + 89) == []


def test_agent_gate_fails_on_a_refused_package_or_a_later_fallback() -> None:
    r = _view({"d1": _member()})
    out = step(
        r, {"d1": _dev(version="1.0", state="failed", target="1.1", error="unsigned agent package")}, T0 + 1
    )
    assert out[0] == Settle(
        "d1", MemberState.FAILED, "agent 1.1 refused or could not install: unsigned agent package; runs 1.0"
    )
    assert isinstance(out[1], GateResult) and not out[1].passed
    assert isinstance(out[2], Finish) and out[2].state == "failed"
    # A member already active whose supervisor later fell back to 1.0 fails during its soak.
    soaking = _view({"d1": _member("active")})
    soaking = RolloutView(**{**soaking.__dict__, "gate": GateConfig(soak_s=100, step_timeout_s=60)})
    fell = step(soaking, {"d1": _dev(version="1.0", state="idle")}, T0 + 5)
    assert fell[0] == Settle("d1", MemberState.FAILED, "agent runs 1.0, not 1.1")


def test_model_layers_ignore_agent_deployments() -> None:
    from controller.db.tables import Device
    from controller.fleet.deployments import agent_layer, layers

    dev = Device(
        id="d1", labels={"site": "a"}, capabilities={"cameras": ["cam1"]}, agent_desired={"direct": "1.0"}
    )
    agent = Deployment(
        id=1, name="a", model="", version="", kind="agent", agent_version="1.1", state="active"
    )
    low = Deployment(
        id=2, name="b", model="", version="", kind="agent", agent_version="1.2", state="active", priority=-1
    )
    assert layers(dev, [agent], {}) == {}
    found = agent_layer(dev, [low, agent], {})
    assert found is not None and (found.version, found.deployment) == ("1.1", "a")
    direct = agent_layer(dev, [], {})
    assert direct is not None and (direct.version, direct.source) == ("1.0", "direct")
