"""Labels, deployments and the layered desired state, through the REST API on a fake transport."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from controller.db.tables import Deployment, Device
from controller.fleet.deployments import Layer, agent_layer, layers
from tests.support.controller_app import (
    MODEL_BYTES,
    Fleet,
    beat,
    deploy,
    deployment,
    enroll,
    report,
    runs,
    write_model,
)
from tests.support.waiting import wait_for


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    d = tmp_path / "models"
    for v in ("1", "2", "3"):
        write_model(d, "tiny", v, MODEL_BYTES + v.encode())
    return d


# --------------------------------------------------------------------------- layering (pure)


def _dep(i: int, selector: str, version: str, priority: int, state: str = "active", **kw: Any) -> Deployment:
    return Deployment(
        id=i,
        name=f"dep{i}",
        model="tiny",
        version=version,
        selector=selector,
        priority=priority,
        state=state,
        **kw,
    )


def _device(labels: dict[str, str], direct: dict[str, Any] | None = None) -> Device:
    return Device(id="d1", labels=labels, capabilities={"cameras": ["cam1", "cam2"]}, direct=direct)


def _versions(out: dict[str, Layer]) -> dict[str, str]:
    return {cam: f"{lay.version}:{lay.deployment or 'direct'}" for cam, lay in out.items()}


def test_higher_priority_wins_and_direct_assignment_is_the_bottom_layer() -> None:
    dev = _device(
        {"site": "a", "gpu": "t4"},
        {"cam1": {"model": "tiny", "version": "1"}, "cam9": {"model": "tiny", "version": "1"}},
    )
    deps = [
        _dep(1, "site=a", "2", 0),
        _dep(2, "gpu in (t4,orin)", "3", 10, cameras=[{"camera": "cam2", "threshold": 0.7}]),
        _dep(3, "site=b", "3", 100),
    ]
    out = layers(dev, deps, {})
    assert _versions(out) == {"cam1": "2:dep1", "cam2": "3:dep2", "cam9": "1:direct"}
    assert out["cam2"].threshold == 0.7


def test_of_equal_priority_the_newer_deployment_wins_whatever_the_order_they_come_in() -> None:
    dev = _device({"site": "a"})
    old, new = _dep(1, "site=a", "2", 5), _dep(2, "site=a", "3", 5)
    for order in ([old, new], [new, old]):
        assert _versions(layers(dev, order, {})) == {"cam1": "3:dep2", "cam2": "3:dep2"}
    old_agent, new_agent = (
        Deployment(id=i, name=name, model="", version="", kind="agent", agent_version=v, state="active")
        for i, name, v in ((1, "old", "1.1"), (2, "new", "1.2"))
    )
    for order in ([old_agent, new_agent], [new_agent, old_agent]):
        layer = agent_layer(dev, order, {})
        assert layer is not None and (layer.version, layer.deployment) == ("1.2", "new")


def test_rolling_out_applies_only_to_admitted_devices_and_cancelled_only_where_active() -> None:
    dev = _device({"site": "a"})
    rolling = [_dep(1, "site=a", "2", 0, state="rolling_out")]
    assert layers(dev, rolling, {}) == {}
    assert _versions(layers(dev, rolling, {1: "applying"}))["cam1"] == "2:dep1"
    assert layers(dev, rolling, {1: "rolled_back"}) == {}
    cancelled = [_dep(1, "site=a", "2", 0, state="cancelled")]
    assert layers(dev, cancelled, {1: "applying"}) == {}
    assert _versions(layers(dev, cancelled, {1: "active"}))["cam1"] == "2:dep1"
    assert layers(dev, [_dep(1, "site=a", "2", 0, state="rolled_back")], {1: "active"}) == {}


# --------------------------------------------------------------------------- through the API


def test_labels_are_replaced_and_validated(fleet: Fleet) -> None:
    enroll(fleet, "d1", site="a")
    r = fleet.client.put("/api/v1/devices/d1/labels", json={"labels": {"site": "b", "gpu": "t4"}})
    assert r.status_code == 200, r.text
    assert r.json()["labels"] == {"site": "b", "gpu": "t4"}
    bad = fleet.client.put("/api/v1/devices/d1/labels", json={"labels": {"bad key!": "x"}})
    assert bad.status_code == 422 and "bad key!" in bad.text
    assert fleet.client.put("/api/v1/devices/nope/labels", json={"labels": {}}).status_code == 404


def test_bad_selector_waves_or_model_are_refused_with_the_reason(fleet: Fleet) -> None:
    r = fleet.client.post(
        "/api/v1/deployments", json={"model": "tiny", "version": "2", "selector": "site in (a"}
    )
    assert r.status_code == 422 and "selector" in r.text
    r = fleet.client.post("/api/v1/deployments", json={"model": "tiny", "version": "2", "waves": [0]})
    assert r.status_code == 422 and "waves" in r.text
    r = fleet.client.post("/api/v1/deployments", json={"model": "tiny", "version": "9"})
    assert r.status_code == 404
    deploy(fleet, name="x", version="2")
    assert (
        fleet.client.post(
            "/api/v1/deployments", json={"name": "x", "model": "tiny", "version": "2"}
        ).status_code
        == 409
    )


def test_rollout_in_waves_then_new_and_relabelled_devices_follow(fleet: Fleet) -> None:
    for d in ("d1", "d2", "d3"):
        enroll(fleet, d, site="a")
    enroll(fleet, "d4", site="b")
    r = fleet.client.put("/api/v1/devices/d2/cameras/cam1/model", json={"model": "tiny", "version": "1"})
    assert r.status_code == 200, r.text
    assert runs(fleet, "d2") == "1:direct"

    deploy(fleet, name="v2", version="2", selector="site=a", waves=[1, "100%"])
    wait_for(lambda: runs(fleet, "d1") == "2:v2", timeout=15, what="canary d1 gets v2")
    assert runs(fleet, "d2") == "1:direct" and runs(fleet, "d3") is None  # not admitted yet
    report(fleet, "d1")
    beat(fleet, "d1", 10.0, "tiny:2")
    wait_for(lambda: runs(fleet, "d2") == "2:v2" and runs(fleet, "d3") == "2:v2", timeout=15, what="wave 2")
    for d in ("d2", "d3"):
        report(fleet, d)
    body = wait_for(
        lambda: (b := deployment(fleet, "v2"))["state"] == "active" and b,
        timeout=15,
        what="rollout succeeded",
    )
    ro = body["rollout"]
    assert ro["state"] == "succeeded"
    assert [g["wave"] for g in ro["gates"]] == [1, 2] and all(g["passed"] for g in ro["gates"])
    assert {d["device_id"]: d["state"] for d in ro["devices"]} == {
        "d1": "active",
        "d2": "active",
        "d3": "active",
    }
    assert runs(fleet, "d4") is None

    # A device that starts to match later gets the deployment on its own; one that stops falls back.
    fleet.client.put("/api/v1/devices/d4/labels", json={"labels": {"site": "a"}})
    wait_for(lambda: runs(fleet, "d4") == "2:v2", timeout=10, what="relabelled d4 gets v2")
    enroll(fleet, "d5", site="a")
    wait_for(lambda: runs(fleet, "d5") == "2:v2", timeout=10, what="new device d5 gets v2")
    fleet.client.put("/api/v1/devices/d2/labels", json={"labels": {"site": "c"}})
    wait_for(lambda: runs(fleet, "d2") == "1:direct", timeout=10, what="d2 back on its direct assignment")

    # A higher-priority deployment wins over v2 where both match.
    deploy(fleet, name="v3", version="3", selector="site=a", priority=5, waves=["100%"])
    wait_for(lambda: runs(fleet, "d1") == "3:v3", timeout=15, what="v3 over v2")


def test_failed_canary_rolls_back_and_others_are_never_touched(fleet: Fleet) -> None:
    for d in ("d1", "d2", "d3"):
        enroll(fleet, d, site="a")
        fleet.client.put(f"/api/v1/devices/{d}/cameras/cam1/model", json={"model": "tiny", "version": "1"})
    versions = {d: fleet.device(d)["desired_version"] for d in ("d2", "d3")}
    deploy(fleet, name="bad", version="3", selector="site=a")
    wait_for(lambda: runs(fleet, "d1") == "3:bad", timeout=15, what="canary gets it")
    report(fleet, "d1", state="failed", error="model produced non-finite output")
    body = wait_for(
        lambda: (b := deployment(fleet, "bad"))["rollout"]["state"] == "failed" and b,
        timeout=15,
        what="gate fails",
    )
    assert body["state"] == "failed"
    assert "non-finite" in body["rollout"]["reason"]
    gate = body["rollout"]["gates"][0]
    assert gate["passed"] is False and gate["failed"] == ["d1"]
    assert [(d["device_id"], d["state"]) for d in body["rollout"]["devices"]] == [("d1", "rolled_back")]
    wait_for(lambda: runs(fleet, "d1") == "1:direct", timeout=10, what="canary back on v1")
    assert {d: fleet.device(d)["desired_version"] for d in ("d2", "d3")} == versions


def test_pause_resume_cancel_rollback_are_idempotent_in_every_state(fleet: Fleet) -> None:
    for d in ("d1", "d2"):
        enroll(fleet, d, site="a")
    deploy(fleet, name="v2", version="2", selector="site=a", waves=[1, "100%"])
    wait_for(lambda: runs(fleet, "d1") == "2:v2", timeout=15, what="canary gets it")

    def op(name: str) -> dict[str, Any]:
        r = fleet.client.post(f"/api/v1/deployments/v2/{name}")
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    assert op("pause")["rollout"]["state"] == "paused"
    assert op("pause")["rollout"]["state"] == "paused"
    report(fleet, "d1")
    wait_for(
        lambda: deployment(fleet, "v2")["rollout"]["gates"], timeout=15, what="the canary gate while paused"
    )
    assert runs(fleet, "d2") is None  # paused: no new wave
    assert op("resume")["rollout"]["state"] == "running"
    assert op("resume")["rollout"]["state"] == "running"
    wait_for(lambda: runs(fleet, "d2") == "2:v2", timeout=15, what="wave 2 after resume")
    body = op("cancel")
    assert body["rollout"]["state"] == "cancelled" and body["state"] == "cancelled"
    states = {d["device_id"]: d["state"] for d in body["rollout"]["devices"]}
    assert states == {"d1": "active", "d2": "rolled_back"}
    assert op("cancel")["rollout"]["state"] == "cancelled"
    assert op("pause")["rollout"]["state"] == "cancelled" and op("resume")["rollout"]["state"] == "cancelled"
    wait_for(lambda: runs(fleet, "d2") is None, timeout=10, what="d2 reverted")
    assert runs(fleet, "d1") == "2:v2"  # cancelled: active devices keep it
    body = op("rollback")
    assert body["state"] == "rolled_back" and body["rollout"]["state"] == "rolled_back"
    assert op("rollback")["state"] == "rolled_back"
    wait_for(lambda: runs(fleet, "d1") is None, timeout=10, what="d1 reverted")
    assert fleet.client.post("/api/v1/deployments/nope/pause").status_code == 404
    listed = fleet.client.get("/api/v1/rollouts").json()
    assert [r["deployment"] for r in listed] == ["v2"]


def test_a_deployment_without_devices_succeeds_at_once_and_is_listed(fleet: Fleet) -> None:
    body = deploy(fleet, version="2", selector="site=nowhere")
    assert body["name"].startswith("tiny-2-") and body["rollout"]["plan"] == []
    wait_for(lambda: deployment(fleet, body["name"])["state"] == "active", timeout=15, what="active")
    listed = fleet.client.get("/api/v1/deployments").json()
    assert [d["name"] for d in listed] == [body["name"]]
    assert listed[0]["rollout"]["state"] == "succeeded"
    # Deployed models cannot be deleted from under the deployment.
    r = fleet.client.delete("/api/v1/models/tiny/versions/2")
    assert r.status_code == 409 and body["name"] in r.text
