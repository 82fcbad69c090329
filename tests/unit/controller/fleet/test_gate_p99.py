"""The rollout gate judges p99 inference latency where the agent reports it ("p99 inference latency
under a bound"), and the median from agents that report none; the device API and /metrics show the p99."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from controller.db.tables import Deployment, Device
from controller.fleet.gate import GateConfig, GateResult, step
from controller.fleet.rollouts import camera_latency, device_view
from fleet_protocol import TopicKind
from fleet_protocol.messages import CameraState, CameraStats, Heartbeat
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
from tests.support.rollout_views import T0, M, member, ro
from tests.support.waiting import wait_for


def cam(**kw: Any) -> dict[str, Any]:
    return {"camera": "cam1", "state": "up", "fps": 10.0, "model": M, **kw}


def view(*cameras: dict[str, Any]) -> Any:
    """The gate's view of a device whose last heartbeat had ``cameras``, running the rollout's model."""
    dev = Device(
        id="d1",
        labels={},
        status="online",
        reported_version=5,
        reported={"cameras": {"cam1": {"model": M, "state": "running"}}},
        last_health={"cameras": list(cameras)},
    )
    dep = Deployment(id=1, name="dep", model="tiny", version="2", selector="", priority=0)
    return device_view(dev, dep)


# --------------------------------------------------------------------------- which figure is judged


def test_p99_is_used_where_reported_and_the_median_otherwise() -> None:
    assert camera_latency(cam(inference_ms=9.0, inference_p99_ms=40.0)) == (40.0, "p99")
    assert camera_latency(cam(inference_ms=9.0)) == (9.0, "median")  # an agent before p99
    assert camera_latency(cam(inference_ms=9.0, inference_p99_ms=None)) == (9.0, "median")
    assert camera_latency(cam(inference_ms=9.0, inference_p99_ms=math.nan)) == (9.0, "median")
    assert camera_latency(cam()) is None
    v = view(cam(inference_ms=9.0, inference_p99_ms=40.0))
    assert v.latency_ms == {"cam1": 40.0} and v.latency_stat == "p99"
    old = view(cam(inference_ms=9.0))
    assert old.latency_ms == {"cam1": 9.0} and old.latency_stat == "median"


def test_a_slow_tail_under_a_fine_median_fails_the_latency_bound() -> None:
    gate = GateConfig(soak_s=0, max_latency_ms=50)
    r = ro({"d1": member("d1", state="active", settled_at=T0)}, gate=gate)
    out = step(r, {"d1": view(cam(inference_ms=20.0, inference_p99_ms=180.0))}, T0 + 1)
    assert isinstance(out[0], GateResult) and not out[0].passed
    assert out[0].figures["latency_ms"] == {"d1": 180.0} and out[0].figures["latency_stat"] == {"d1": "p99"}
    assert out[0].reason == "inference latency over 50 ms: d1 180.0 ms p99"
    ok = step(r, {"d1": view(cam(inference_ms=20.0, inference_p99_ms=45.0))}, T0 + 1)
    assert isinstance(ok[0], GateResult) and ok[0].passed


def test_an_agent_without_p99_is_judged_on_its_median() -> None:
    gate = GateConfig(soak_s=0, max_latency_ms=50)
    r = ro({"d1": member("d1", state="active", settled_at=T0)}, gate=gate)
    ok = step(r, {"d1": view(cam(inference_ms=20.0))}, T0 + 1)
    assert (
        isinstance(ok[0], GateResult) and ok[0].passed and ok[0].figures["latency_stat"] == {"d1": "median"}
    )
    bad = step(r, {"d1": view(cam(inference_ms=80.0))}, T0 + 1)
    assert isinstance(bad[0], GateResult) and bad[0].reason == "inference latency over 50 ms: d1 80.0 ms"


def test_latency_ratio_compares_p99_with_the_p99_before() -> None:
    gate = GateConfig(soak_s=0, max_latency_ratio=3)
    r = ro({"d1": member("d1", state="active", settled_at=T0, baseline_latency_ms=30.0)}, gate=gate)
    out = step(r, {"d1": view(cam(inference_ms=25.0, inference_p99_ms=150.0))}, T0 + 1)
    assert isinstance(out[0], GateResult) and not out[0].passed
    assert out[0].figures["latency_ratio"] == {"d1": 5.0}
    assert out[0].reason == "inference latency rose above 3x the latency before: d1 5.0x (150.0 ms p99)"


# --------------------------------------------------------------------------- through the controller


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    d = tmp_path / "models"
    for v in ("1", "2"):
        write_model(d, "tiny", v, MODEL_BYTES + v.encode())
    return d


def beat(fleet: Fleet, device: str, ms: float, p99: float | None, model: str | None = None) -> None:
    cams = [
        CameraStats(
            camera="cam1", state=CameraState.UP, fps=10.0, inference_ms=ms, inference_p99_ms=p99, model=model
        )
    ]
    fleet.send(device, TopicKind.HEARTBEAT, Heartbeat(ts=time.time(), cameras=cams))


def p99_metric(fleet: Fleet) -> dict[tuple[str, str], float]:
    """The p99 gauge per (device, camera), in ms as the heartbeats carry it."""
    text = fleet.client.get("/metrics").text
    fams = [
        f for f in text_string_to_metric_families(text) if f.name == "edgefleet_inference_latency_p99_seconds"
    ]
    return {(s.labels["device"], s.labels["camera"]): s.value * 1000 for f in fams for s in f.samples}


def test_device_api_and_metrics_show_p99_and_old_agents_still_count(fleet: Fleet) -> None:
    enroll(fleet, "new", site="a")
    enroll(fleet, "old", site="a")
    beat(fleet, "new", 9.0, 41.5)
    # An agent from before p99: its heartbeat has no such key at all.
    raw = {"type": "heartbeat", "v": 1, "ts": time.time(), "cameras": [cam(inference_ms=8.0)]}
    fleet.send("old", TopicKind.HEARTBEAT, json.dumps(raw).encode())
    wait_for(
        lambda: (
            fleet.device("new")["cameras"][0]["inference_p99_ms"] == 41.5
            and fleet.device("old")["cameras"][0]["inference_ms"] == 8.0
        ),
        timeout=10,
        what="both heartbeats stored",
    )
    old = fleet.device("old")["cameras"][0]
    assert old["inference_p99_ms"] is None and old["model"] == M
    # Absent, not invented, for the old agent.
    assert p99_metric(fleet) == pytest.approx({("new", "cam1"): 41.5})


def test_rollout_records_a_p99_baseline_and_fails_on_a_p99_that_rose(fleet: Fleet) -> None:
    enroll(fleet, "d1", site="a")
    beat(fleet, "d1", 9.0, 20.0, "tiny:1")
    wait_for(lambda: fleet.device("d1")["cameras"][0]["inference_p99_ms"] == 20.0, timeout=10, what="hb")
    gate = {"soak_s": 0, "step_timeout_s": 30, "offline_timeout_s": 30, "max_latency_ratio": 3}
    deploy(fleet, name="v2", version="2", selector="site=a", waves=["100%"], gate=gate)
    wait_for(lambda: runs(fleet, "d1") == "2:v2", timeout=15, what="d1 gets v2")
    (member_,) = wait_for(
        lambda: [d for d in deployment(fleet, "v2")["rollout"]["devices"] if d["baseline_latency_ms"]],
        timeout=15,
        what="baseline recorded",
    )
    assert member_["baseline_latency_ms"] == 20.0  # the p99 before, not the median (9.0)
    # The new model: a median that barely moved, a tail five times longer.
    beat(fleet, "d1", 10.0, 100.0, "tiny:2")
    report(fleet, "d1")
    body = wait_for(
        lambda: (b := deployment(fleet, "v2"))["rollout"]["state"] == "failed" and b,
        timeout=15,
        what="gate fails",
    )
    (g,) = body["rollout"]["gates"]
    assert g["passed"] is False and g["latency_ratio"] == {"d1": 5.0} and g["latency_stat"] == {"d1": "p99"}
    assert "5.0x (100.0 ms p99)" in body["rollout"]["reason"]
