"""Zones and counting lines in the controller's twin: from a direct assignment or a deployment's camera
entry into the signed desired state, and compared with what a device reports only when it reports
them (PROTOCOL.md "Zones and lines"), on SQLite and PostgreSQL (``parts``)."""

from __future__ import annotations

import time

from controller.fleet.sync import settings_drift
from fleet_protocol.messages import CameraReported, CountLine, Zone
from tests.support.fleet_replicas import Parts

SHA = "a" * 64
ZONE = {"id": "desk", "points": [[0.6, 0.1], [0.9, 0.1], [0.9, 0.4]], "labels": ["person"]}
LINE = {"id": "door", "a": [0.1, 0.5], "b": [0.9, 0.5]}


def test_an_assignment_puts_zones_and_lines_into_the_desired_state(parts: Parts) -> None:
    parts.twin.assign(device_id="d1", camera="cam1", model="tiny", version="1", zones=[ZONE], lines=[LINE])
    want = parts.desired("d1")[-1].cameras["cam1"]
    assert want.zones == [Zone.model_validate(ZONE)] and want.lines == [CountLine.model_validate(LINE)]


def test_a_deployment_entry_carries_zones_into_the_layer(parts: Parts) -> None:
    got = parts.deployment_layers({"camera": "cam2", "zones": [ZONE], "lines": [LINE]})
    assert got["cam2"].zones == [ZONE] and got["cam2"].lines == [LINE]


def _running(**settings: object) -> CameraReported:
    return CameraReported(model="m:1", sha256=SHA, state="running", threshold=0.5, **settings)  # type: ignore[arg-type]


def test_zones_drift_only_where_the_device_reports_them() -> None:
    want = {
        "model": {"manifest": {"sha256": SHA, "default_threshold": 0.5}},
        "zones": [ZONE],
        "lines": [LINE],
    }
    same = _running(zones=[Zone.model_validate(ZONE)], lines=[CountLine.model_validate(LINE)])
    assert settings_drift(want, same) is None
    moved = {**LINE, "b": [0.8, 0.5]}
    drift = settings_drift(
        want, _running(zones=[Zone.model_validate(ZONE)], lines=[CountLine.model_validate(moved)])
    )
    assert drift is not None and "lines" in drift
    assert "zones" in (settings_drift(want, _running(zones=[], lines=[CountLine.model_validate(LINE)])) or "")
    # An agent before zones reports none: not compared.
    assert settings_drift(want, _running()) is None


def test_the_converger_re_sends_to_a_device_that_runs_other_zones_or_lines(parts: Parts) -> None:
    t0 = time.time()
    parts.twin.assign(device_id="d1", camera="cam1", model="tiny", version="1", zones=[ZONE], lines=[LINE])
    zones, lines = [Zone.model_validate(ZONE)], [CountLine.model_validate(LINE)]
    parts.report("d1", threshold=0.5, zones=zones, lines=lines)
    parts.report("d2", threshold=0.5, zones=[], lines=[])
    assert parts.converger.check(t0) == []
    sent = len(parts.desired("d1"))
    moved = [CountLine.model_validate({**LINE, "b": [0.8, 0.5]})]
    parts.report("d1", threshold=0.5, zones=zones, lines=moved)
    assert parts.converger.check(t0 + 1) == ["d1"]
    assert len(parts.desired("d1")) == sent + 1
    parts.report("d1", threshold=0.5, zones=[], lines=lines)  # its zone lost
    assert parts.converger.check(t0 + 100) == ["d1"]
    # An agent before zones reports none: in sync with the same desired state.
    parts.report("d1", threshold=0.5)
    assert parts.converger.check(t0 + 200) == []
