"""Remote troubleshooting end to end: a controller process, a real Mosquitto, an agent under its
supervisor (as systemd runs it) on the footage, and an operator asking through the API: the agent's
log (filtered, redacted), a diagnostics bundle with the clock offset, probes of a working and a dead
camera, a camera restart and an agent restart, each recorded with who asked; a viewer is refused."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.mqtt_broker import MosquittoBroker, free_port
from tests.support.paths import FOOTAGE
from tests.support.stack import Stack
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

DEVICE = "diag-1"
# The dead camera's password: it must come back from the device nowhere.
PASSWORD = "pr0be-s3cret-pw"


@pytest.fixture
def site(tmp_path: Path, broker: MosquittoBroker) -> Iterator[tuple[Stack, str]]:
    s = Stack(tmp_path, broker).start()
    dead = f"rtsp://admin:{PASSWORD}@127.0.0.1:{free_port()}/stream"
    try:
        s.enrol(DEVICE)
        s.agent(
            DEVICE,
            cameras=[
                {"id": "cam1", "source": str(FOOTAGE), "loop": True},
                {"id": "gate", "source": dead, "open_timeout_s": 2, "reconnect_max_s": 2},
            ],
            module="edge_agent.supervisor",
        ).start()
        s.assign(DEVICE)
        s.in_sync(DEVICE, timeout=120)
        operator = s.call("POST", "/api/v1/tokens", json={"name": "alice", "role": "operator"})["token"]
        yield s, operator
    finally:
        s.stop()


def _events(s: Stack, kind: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = s.call("GET", "/api/v1/events", params={"device": DEVICE, "kind": kind})
    return events


def test_an_operator_reads_logs_diagnoses_probes_and_restarts_a_device_and_a_viewer_cannot(
    site: tuple[Stack, str],
) -> None:
    s, operator = site
    # A viewer (a wall screen) is refused all of it, and nothing is asked of the device for it.
    viewer = s.call("POST", "/api/v1/tokens", json={"name": "wall", "role": "viewer"})["token"]
    with s.controller.client(viewer) as api:
        assert api.get(f"/api/v1/devices/{DEVICE}/logs").status_code == 403
        assert api.get(f"/api/v1/devices/{DEVICE}/diagnostics").status_code == 403
        assert api.post(f"/api/v1/devices/{DEVICE}/restart").status_code == 403
        assert api.post(f"/api/v1/devices/{DEVICE}/cameras/cam1/probe").status_code == 403
        assert api.get(f"/api/v1/devices/{DEVICE}").status_code == 200
    assert _events(s, "remote_command") == []

    with s.controller.client(operator) as api:
        # The log: the dead camera's failures are there without its password; a level filter holds.
        def gate_lines() -> dict[str, Any] | None:
            r = api.get(f"/api/v1/devices/{DEVICE}/logs", params={"level": "info", "lines": 500})
            assert r.status_code == 200, r.text
            body: dict[str, Any] = r.json()
            return body if any("camera gate" in ln["message"] for ln in body["lines"]) else None

        logs = wait_for(gate_lines, timeout=30, what="the dead camera's lines in the device's log")
        assert {ln["level"] for ln in logs["lines"]} >= {"info", "warning"}
        warnings = api.get(f"/api/v1/devices/{DEVICE}/logs", params={"level": "warning"}).json()
        assert warnings["lines"] and {ln["level"] for ln in warnings["lines"]} <= {
            "warning",
            "error",
            "critical",
        }
        assert PASSWORD not in str(logs) and "admin:***@" in str(logs)

        # The bundle: versions, usable providers, config without the password, the clock.
        r = api.get(f"/api/v1/devices/{DEVICE}/diagnostics")
        assert r.status_code == 200, r.text
        diag = r.json()
        bundle = diag["bundle"]
        assert bundle["uplink"]["connected"] is True
        assert "CPUExecutionProvider" in bundle["inference_stack"]["providers_usable"]
        assert "onnxruntime" in bundle["inference_stack"]["packages"]
        assert bundle["config"]["device_id"] == DEVICE and PASSWORD not in str(bundle)
        # Same machine, same clock: the offset is within the round trip.
        assert diag["clock"] is not None and abs(diag["clock"]["offset_s"]) <= max(
            0.5, diag["clock"]["round_trip_s"]
        )
        assert diag["clock"]["off"] is False

        # Probes: the footage opens with its size; the dead camera fails within its bound, redacted.
        ok = api.post(f"/api/v1/devices/{DEVICE}/cameras/cam1/probe").json()
        assert ok["ok"] is True and (ok["width"], ok["height"]) == (768, 576) and ok["first_frame_s"] < 10, ok
        assert ok["codec"] == "MP43" and ok["fps"] == 10.0, ok  # the footage: MS-MPEG4 v3 at 10 FPS
        started = time.monotonic()
        dead = api.post(f"/api/v1/devices/{DEVICE}/cameras/gate/probe", params={"probe_timeout_s": 3}).json()
        assert time.monotonic() - started < 3 + 10  # the device's bound plus the command's own
        assert dead["ok"] is False and dead["elapsed_s"] <= 3.5 and dead["error"], dead
        assert PASSWORD not in str(dead) and "admin:***@" in dead["error"], dead
        assert api.post(f"/api/v1/devices/{DEVICE}/cameras/nope/probe").status_code == 404

        # A camera restart, then the agent's: it answers, exits, its supervisor starts it again at
        # once and it says why; nothing it had sent or kept is lost or doubled.
        assert api.post(f"/api/v1/devices/{DEVICE}/cameras/cam1/restart").json()["restarted"] == "cam1"
        before = s.device(DEVICE)["stats"]
        assert api.post(f"/api/v1/devices/{DEVICE}/restart").json()["restarting"] is True

    def restarted() -> dict[str, Any] | None:
        started = [e for e in _events(s, "agent_started") if (e.get("data") or {}).get("restart")]
        return started[0] if started else None

    again = wait_for(restarted, timeout=60, what="the agent started again, saying why")
    assert again["data"]["restart"]["by"] == "alice", again
    s.in_sync(DEVICE, timeout=120)
    wait_for(
        lambda: s.device(DEVICE)["stats"]["stored"] > before["stored"], timeout=30, what="new batches stored"
    )
    after = s.device(DEVICE)["stats"]
    assert after["lost"] == before["lost"] == 0 and after["duplicates"] == 0, (before, after)

    # Every ask is on the audit trail with who asked, written by the controller.
    audit = _events(s, "remote_command")
    asked = {e["data"]["command"] for e in audit}
    assert {"logs", "diagnostics", "probe_camera", "restart_camera", "restart_agent"} <= asked, asked
    assert {e["data"]["by"] for e in audit} == {"alice"} and {e["source"] for e in audit} == {"controller"}
