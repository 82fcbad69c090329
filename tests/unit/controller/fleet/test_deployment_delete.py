"""Deleting a deployment: its layer goes, each device falls back to the next layer and is sent a new
desired state; a rollout still running is cancelled first; unknown or already deleted answers 404."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.controller_app import (
    MODEL_BYTES,
    Fleet,
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


def _active(fleet: Fleet, name: str) -> None:
    wait_for(lambda: deployment(fleet, name)["state"] == "active", timeout=15, what=f"{name} active")


def test_deleting_a_layer_falls_back_to_the_next_one_and_frees_the_name(fleet: Fleet) -> None:
    for d in ("d1", "d2"):
        enroll(fleet, d, site="a")
    r = fleet.client.put("/api/v1/devices/d1/cameras/cam1/model", json={"model": "tiny", "version": "1"})
    assert r.status_code == 200, r.text
    deploy(fleet, name="low", version="2", selector="site=a", waves=["100%"])
    wait_for(lambda: runs(fleet, "d1") == "2:low" and runs(fleet, "d2") == "2:low", timeout=15, what="low")
    for d in ("d1", "d2"):
        report(fleet, d)
    _active(fleet, "low")
    high = deploy(fleet, name="high", version="3", selector="site=a", priority=10, waves=["100%"])
    wait_for(lambda: runs(fleet, "d1") == "3:high" and runs(fleet, "d2") == "3:high", timeout=15, what="high")
    for d in ("d1", "d2"):
        report(fleet, d)
    _active(fleet, "high")
    before = {d: fleet.device(d)["desired_version"] for d in ("d1", "d2")}

    r = fleet.client.delete("/api/v1/deployments/high")
    assert r.status_code == 204, r.text
    # The next layer down wins again, and each device is sent it as a new desired state.
    assert runs(fleet, "d1") == "2:low" and runs(fleet, "d2") == "2:low"
    assert all(fleet.device(d)["desired_version"] > v for d, v in before.items())
    assert fleet.client.get("/api/v1/deployments/high").status_code == 404
    assert [d["name"] for d in fleet.client.get("/api/v1/deployments").json()] == ["low"]
    assert [ro["deployment"] for ro in fleet.client.get("/api/v1/rollouts").json()] == ["low"]
    # Deleting twice, by name or by its old id, or something never known: 404.
    assert fleet.client.delete("/api/v1/deployments/high").status_code == 404
    assert fleet.client.delete(f"/api/v1/deployments/{high['id']}").status_code == 404
    assert fleet.client.delete("/api/v1/deployments/nope").status_code == 404

    # Under the last deployment: the direct assignment on d1, nothing on d2.
    assert fleet.client.delete("/api/v1/deployments/low").status_code == 204
    assert runs(fleet, "d1") == "1:direct" and runs(fleet, "d2") is None
    # Nothing deploys v3 any more, so it can be deleted; and the name can be used again.
    assert fleet.client.delete("/api/v1/models/tiny/versions/3").status_code == 204
    deploy(fleet, name="high", version="2", selector="site=a", waves=["100%"])
    wait_for(lambda: runs(fleet, "d2") == "2:high", timeout=15, what="a new deployment under the old name")


def test_deleting_during_a_rollout_cancels_it_and_reverts_what_it_reached(fleet: Fleet) -> None:
    for d in ("d1", "d2"):
        enroll(fleet, d, site="a")
    body = deploy(fleet, name="v2", version="2", selector="site=a", waves=[1, "100%"])
    wait_for(lambda: runs(fleet, "d1") == "2:v2", timeout=15, what="canary gets it")
    assert runs(fleet, "d2") is None
    r = fleet.client.delete("/api/v1/deployments/v2")
    assert r.status_code == 204, r.text
    assert runs(fleet, "d1") is None
    assert fleet.client.get(f"/api/v1/deployments/{body['id']}").status_code == 404
    assert fleet.client.get("/api/v1/rollouts").json() == []
    # Its rollout was cancelled, so it admits nobody any more.
    fleet.client.app.state.runtime.rollouts.tick()  # type: ignore[attr-defined]
    assert runs(fleet, "d2") is None and runs(fleet, "d1") is None
