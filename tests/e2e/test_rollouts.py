"""Rollouts end to end: a real Mosquitto, a controller process and several agent processes (FPS capped
low so that they fit on two cores). A good model goes out wave by wave with every gate visible, and
keeps going after a kill -9 of the controller; a model that fails to activate, and one that activates
but runs far slower than its predecessor, stop at the canary, which goes back to its previous model
while the other devices are never touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.mqtt_broker import MosquittoBroker
from tests.support.onnx_models import tf_od_nan, tf_od_slow
from tests.support.paths import MODELS
from tests.support.stack import Stack
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

OLD = "ped_ssdlite:1"
CAP: dict[str, Any] = {"max_fps": 2}


def _start(stack: Stack, n: int) -> None:
    """Devices ro-1..ro-n labelled site=e2e, each running OLD at CAP, FPS reported."""
    devices = [f"ro-{i}" for i in range(1, n + 1)]
    for d in devices:
        stack.agent(d)
    stack.start()
    for d in devices:
        stack.deploy(d, labels={"site": "e2e"}, **CAP)
    for a in stack.agents:
        a.start()
    with stack.api() as api:
        for d in devices:
            wait_for(partial(stack.runs, d, OLD, api), timeout=120, what=f"{d} runs {OLD}")
            wait_for(partial(stack.fps, d, api), timeout=60, what=f"{d} reports FPS")


@pytest.fixture
def site(tmp_path: Path, broker: MosquittoBroker, request: pytest.FixtureRequest) -> Iterator[Stack]:
    s = Stack(tmp_path, broker, camera=CAP, EDGEFLEET_BUILD_VARIANTS_ON_UPLOAD="false")
    try:
        _start(s, request.param)
        yield s
    finally:
        s.stop()


def _manifest_fields(model_dir: Path) -> str:
    manifest = json.loads((model_dir / "manifest.json").read_text())
    for server_owned in ("name", "version", "sha256", "size"):
        manifest.pop(server_owned)
    return json.dumps(manifest)


def _upload(api: httpx.Client, name: str, version: str, data: bytes) -> None:
    r = api.post(
        "/api/v1/models",
        data={"name": name, "version": version, "manifest": _manifest_fields(MODELS / "ped_ssdlite")},
        files={"file": ("model.onnx", data, "application/octet-stream")},
    )
    assert r.status_code in (200, 201), r.text


def _cli(site: Stack, *args: str) -> str:
    """``edgefleet ARGS --api URL`` as an operator runs it; must succeed."""
    out = subprocess.run(
        [sys.executable, "-m", "controller", *args, "--api", site.controller.url],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200", "EDGEFLEET_TOKEN": site.controller.token},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _deployment(api: httpx.Client, name: str) -> dict[str, Any]:
    r = api.get(f"/api/v1/deployments/{name}")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _until(api: httpx.Client, name: str, check: Callable[[dict[str, Any]], bool]) -> Callable[[], Any]:
    def poll() -> dict[str, Any] | None:
        body = _deployment(api, name)
        return body if check(body) else None

    return poll


@pytest.mark.parametrize("site", [5], indirect=True)
def test_good_model_rolls_out_wave_by_wave_and_survives_a_controller_kill9(site: Stack) -> None:
    with site.api() as api:
        _upload(api, "ped_ssdlite", "2", (MODELS / "ped_ssdlite" / "model.onnx").read_bytes())
        r = api.post(
            "/api/v1/deployments",
            json={
                "name": "ped-v2",
                "model": "ped_ssdlite",
                "version": "2",
                "selector": "site=e2e",
                "cameras": [{"camera": "cam1", **CAP}],
                "gate": {"soak_s": 4, "min_fps_ratio": 0.25, "step_timeout_s": 120, "offline_timeout_s": 60},
            },
        )
        assert r.status_code == 201, r.text
        assert r.json()["rollout"]["plan"] == [1, 2, 3, 5]
        # Mid-rollout: the canary's gate passed, later waves still to come.
        wait_for(
            _until(
                api,
                "ped-v2",
                lambda b: len(b["rollout"]["gates"]) >= 1 and b["rollout"]["state"] == "running",
            ),
            timeout=120,
            what="canary gate passed",
        )
    before = _deployment(site.controller.client(), "ped-v2")["rollout"]
    site.controller.kill9()
    # The kill landed mid-rollout: still running, with waves left to gate (the plan has 4).
    assert before["state"] == "running" and len(before["gates"]) < len(before["plan"]), before
    site.controller.start()
    with site.api() as api:
        body = wait_for(
            _until(api, "ped-v2", lambda b: b["rollout"]["state"] not in ("running", "paused")),
            timeout=240,
            what="rollout finished after the restart",
        )
        ro = body["rollout"]
        assert ro["state"] == "succeeded", ro
        assert body["state"] == "active"
        # The restart resumed it: nothing done before was redone, every wave gated once, in order.
        assert [g["wave"] for g in ro["gates"]] == [1, 2, 3, 4]
        assert all(g["passed"] for g in ro["gates"]), ro["gates"]
        assert ro["gates"][: len(before["gates"])] == before["gates"]
        assert [g["size"] for g in ro["gates"]] == [1, 1, 1, 2]
        waves = {d["device_id"]: d["wave"] for d in ro["devices"]}
        assert sorted(waves.values()) == [1, 2, 3, 4, 4]
        assert all(d["state"] == "active" for d in ro["devices"])
        for d in site.devices:
            wait_for(partial(site.runs, d, "ped_ssdlite:2", api), timeout=60, what=f"{d} runs v2")
        site.alive()

        # A device that joins later with matching labels gets the deployment on its own.
        api.post("/api/v1/devices", json={"id": "ro-late", "labels": {"site": "e2e"}}).raise_for_status()
        late = site.agent("ro-late")
        late.start()
        wait_for(lambda: site.runs("ro-late", "ped_ssdlite:2", api), timeout=120, what="late device runs v2")
        assert api.get("/api/v1/devices/ro-late").json()["assignments"]["cam1"]["deployment"] == "ped-v2"


@pytest.mark.parametrize("site", [3], indirect=True)
def test_model_that_fails_to_activate_stops_at_the_canary_and_rolls_it_back(site: Stack) -> None:
    with site.api() as api:
        untouched = {d: api.get(f"/api/v1/devices/{d}").json()["desired_version"] for d in site.devices[1:]}
        _upload(api, "nanmodel", "1", tf_od_nan())
        r = api.post(
            "/api/v1/deployments",
            json={
                "name": "nan",
                "model": "nanmodel",
                "version": "1",
                "variant": "fp32",
                "selector": "site=e2e",
                "cameras": [{"camera": "cam1", **CAP}],
                "gate": {"soak_s": 2, "step_timeout_s": 120, "offline_timeout_s": 60},
            },
        )
        assert r.status_code == 201, r.text
        body = wait_for(
            _until(api, "nan", lambda b: b["rollout"]["state"] == "failed"),
            timeout=180,
            what="canary gate fails",
        )
        ro = body["rollout"]
        assert body["state"] == "failed"
        assert "NaN" in ro["reason"] and site.devices[0] in ro["reason"], ro["reason"]
        assert len(ro["gates"]) == 1 and ro["gates"][0]["passed"] is False
        assert ro["gates"][0]["failed"] == [site.devices[0]]
        assert [(d["device_id"], d["state"]) for d in ro["devices"]] == [(site.devices[0], "rolled_back")]
        # The canary is back on its previous model, by its own report.
        wait_for(
            lambda: site.runs(site.devices[0], OLD, api), timeout=60, what="canary back on the old model"
        )
        canary = api.get(f"/api/v1/devices/{site.devices[0]}").json()
        assert canary["assignments"]["cam1"]["source"] == "direct"
        # The others were never touched.
        assert {
            d: api.get(f"/api/v1/devices/{d}").json()["desired_version"] for d in site.devices[1:]
        } == untouched
        for d in site.devices[1:]:
            assert site.runs(d, OLD, api)
        site.alive()

    # The operator's view through the CLI, and operations on a finished rollout are harmless.
    cli = partial(_cli, site)

    shown = cli("rollouts", "show", "nan")
    assert "FAIL" in shown and "rolled_back" in shown and site.devices[0] in shown
    assert "nan" in cli("rollouts", "ls")
    assert "rollout failed" in cli("rollouts", "pause", "nan")
    assert "rollout failed" in cli("rollouts", "rollback", "nan")
    assert "zone=b" in cli("devices", "label", site.devices[1], "zone=b", "site-")
    listed = cli("devices", "ls", "--select", "zone=b")
    assert site.devices[1] in listed and site.devices[2] not in listed
    assert "ped_ssdlite:1" in cli("devices", "show", site.devices[1])


@pytest.mark.parametrize("site", [3], indirect=True)
def test_model_that_activates_but_runs_far_slower_fails_the_canary_gate_and_rolls_it_back(
    site: Stack,
) -> None:
    # ped_ssdlite with a heavy branch whose result is multiplied by zero: same outputs, same
    # detections, about 10x the compute per frame (~0.3 s instead of ~30 ms on one idle core). The gate
    # judges latency against the device's own latency before, so a busy machine slows both alike.
    slow = tf_od_slow((MODELS / "ped_ssdlite" / "model.onnx").read_bytes())
    with site.api() as api:
        untouched = {d: api.get(f"/api/v1/devices/{d}").json()["desired_version"] for d in site.devices[1:]}
        _upload(api, "slowmodel", "1", slow)
        r = api.post(
            "/api/v1/deployments",
            json={
                "name": "slow",
                "model": "slowmodel",
                "version": "1",
                "variant": "fp32",
                "selector": "site=e2e",
                "cameras": [{"camera": "cam1", **CAP}],
                # The agent reports the median of its last 50 inference times, which a swap does not
                # reset: the soak lets well over 25 frames of the new model in (2 FPS cap), even when
                # a loaded machine makes each take ~1 s.
                "gate": {
                    "soak_s": 45,
                    "min_fps_ratio": 0.25,
                    "max_latency_ratio": 2.5,
                    "step_timeout_s": 120,
                    "offline_timeout_s": 60,
                },
            },
        )
        assert r.status_code == 201, r.text
        canary = site.devices[0]
        # It really activates: the canary runs it, by its own report, before the gate says no.
        wait_for(
            partial(site.runs, canary, "slowmodel:1", api), timeout=120, what="canary runs the slow model"
        )
        body = wait_for(
            _until(api, "slow", lambda b: b["rollout"]["state"] == "failed"),
            timeout=180,
            what="canary gate fails",
        )
        ro = body["rollout"]
        assert body["state"] == "failed"
        assert "wave 1 gate failed" in ro["reason"] and canary in ro["reason"], ro["reason"]
        assert "latency" in ro["reason"] or "FPS" in ro["reason"], ro["reason"]
        (gate,) = ro["gates"]
        assert gate["passed"] is False and gate["failed"] == [] and gate["active"] == 1
        assert gate["latency_ratio_max"] > 2.5 or gate["fps_ratio_min"] < 0.25, gate
        assert [(d["device_id"], d["state"]) for d in ro["devices"]] == [(canary, "rolled_back")]
        wait_for(partial(site.runs, canary, OLD, api), timeout=60, what="canary back on the old model")
        assert api.get(f"/api/v1/devices/{canary}").json()["assignments"]["cam1"]["source"] == "direct"
        assert {
            d: api.get(f"/api/v1/devices/{d}").json()["desired_version"] for d in site.devices[1:]
        } == untouched
        for d in site.devices[1:]:
            assert site.runs(d, OLD, api)
        site.alive()

    # The operator removes the failed deployment: gone from the API, nothing on a device changes.
    assert "slow" in _cli(site, "deployments", "ls")
    assert "deleted" in _cli(site, "deployments", "delete", "slow", "--yes")
    with site.api() as api:
        assert api.get("/api/v1/deployments/slow").status_code == 404
        assert api.delete("/api/v1/deployments/slow").status_code == 404
        for d in site.devices:
            assert site.runs(d, OLD, api)


@pytest.mark.parametrize("site", [3], indirect=True)
def test_pause_resume_cancel_and_rollback_leave_every_device_in_an_agreed_state(site: Stack) -> None:
    with site.api() as api:
        _upload(api, "ped_ssdlite", "2", (MODELS / "ped_ssdlite" / "model.onnx").read_bytes())
        r = api.post(
            "/api/v1/deployments",
            json={
                "name": "ops",
                "model": "ped_ssdlite",
                "version": "2",
                "selector": "site=e2e",
                "cameras": [{"camera": "cam1", **CAP}],
                "waves": [1, "100%"],
                "gate": {"soak_s": 5, "min_fps_ratio": 0.25, "step_timeout_s": 120},
            },
        )
        assert r.status_code == 201, r.text
        canary = site.devices[0]
        wait_for(partial(site.runs, canary, "ped_ssdlite:2", api), timeout=120, what="canary runs v2")

        def op(name: str) -> dict[str, Any]:
            resp = api.post(f"/api/v1/deployments/ops/{name}")
            assert resp.status_code == 200, resp.text
            body: dict[str, Any] = resp.json()
            return body

        assert op("pause")["rollout"]["state"] == "paused"
        paused = wait_for(
            _until(api, "ops", lambda b: len(b["rollout"]["gates"]) == 1), timeout=60, what="canary gate"
        )
        assert paused["rollout"]["state"] == "paused" and len(paused["rollout"]["devices"]) == 1
        assert op("resume")["rollout"]["state"] == "running"
        wait_for(
            _until(api, "ops", lambda b: len(b["rollout"]["devices"]) == 3),
            timeout=60,
            what="wave 2 admitted",
        )
        body = op("cancel")
        assert body["rollout"]["state"] == "cancelled" and op("cancel")["rollout"]["state"] == "cancelled"
        # Whatever each device had reached: active keeps v2, anything else went back to v1, and the
        # device's own report agrees.
        states = {d["device_id"]: d["state"] for d in body["rollout"]["devices"]}
        assert set(states.values()) <= {"active", "rolled_back"}, states
        for d, state in states.items():
            want = "ped_ssdlite:2" if state == "active" else OLD
            wait_for(partial(site.runs, d, want, api), timeout=120, what=f"{d} ({state}) runs {want}")

        body = op("rollback")
        assert body["state"] == "rolled_back" and op("rollback")["state"] == "rolled_back"
        assert all(d["state"] == "rolled_back" for d in body["rollout"]["devices"])
        for d in site.devices:
            wait_for(partial(site.runs, d, OLD, api), timeout=120, what=f"{d} back on {OLD}")
            assert api.get(f"/api/v1/devices/{d}").json()["assignments"]["cam1"]["source"] == "direct"
        site.alive()


@pytest.mark.parametrize("site", [3], indirect=True)
def test_a_device_offline_in_its_wave_fails_per_policy_and_converges_when_it_returns(site: Stack) -> None:
    away, away_agent = site.devices[1], site.agents[1]
    with site.api() as api:
        _upload(api, "ped_ssdlite", "2", (MODELS / "ped_ssdlite" / "model.onnx").read_bytes())
        away_agent.kill9()
        wait_for(
            lambda: api.get(f"/api/v1/devices/{away}").json()["status"] == "offline",
            timeout=60,
            what=f"{away} offline",
        )
        r = api.post(
            "/api/v1/deployments",
            json={
                "name": "offline",
                "model": "ped_ssdlite",
                "version": "2",
                "selector": "site=e2e",
                "cameras": [{"camera": "cam1", **CAP}],
                "waves": [1, "100%"],
                "gate": {
                    "soak_s": 2,
                    "min_fps_ratio": 0.25,
                    "max_failure_ratio": 0.5,
                    "offline_timeout_s": 3,
                },
            },
        )
        assert r.status_code == 201, r.text
        body = wait_for(
            _until(api, "offline", lambda b: b["rollout"]["state"] not in ("running", "paused")),
            timeout=180,
            what="rollout finished",
        )
        ro = body["rollout"]
        assert ro["state"] == "succeeded", ro
        member = {d["device_id"]: d for d in ro["devices"]}
        assert member[away]["state"] == "failed" and "offline" in member[away]["reason"]
        assert ro["gates"][1]["failed"] == [away] and ro["gates"][1]["passed"] is True
        for d in (site.devices[0], site.devices[2]):
            wait_for(partial(site.runs, d, "ped_ssdlite:2", api), timeout=60, what=f"{d} runs v2")
        away_agent.start()
        wait_for(
            partial(site.runs, away, "ped_ssdlite:2", api), timeout=120, what=f"{away} converges on return"
        )
        site.alive()
