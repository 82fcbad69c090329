"""Per-label thresholds and the minimum box area in the controller's twin: from a deployment's camera
entry or a direct assignment into the desired state, and compared with what the device reports
(drift and the converger's re-send) only when the device reports them (PROTOCOL.md "Desired and
reported state"), on SQLite and PostgreSQL (``parts``)."""

from __future__ import annotations

import time

from controller.fleet.sync import settings_drift
from fleet_protocol.messages import CameraReported
from tests.support.fleet_replicas import Parts

SHA = "a" * 64


def test_a_deployment_entry_and_a_direct_assignment_carry_the_settings_into_the_layer(parts: Parts) -> None:
    got = parts.deployment_layers(
        {"camera": "cam2", "min_box_area": 0.01, "label_thresholds": {"person": 0.7}},
        direct={"cam1": {"model": "tiny", "version": "1", "label_thresholds": {"car": 0.2}}},
    )
    assert got["cam1"].label_thresholds == {"car": 0.2} and got["cam1"].min_box_area is None
    assert got["cam2"].label_thresholds == {"person": 0.7} and got["cam2"].min_box_area == 0.01


def _camera(**settings: object) -> dict[str, object]:
    return {"model": {"manifest": {"sha256": SHA, "default_threshold": 0.5}}, **settings}


def _running(**settings: object) -> CameraReported:
    return CameraReported(model="m:1", sha256=SHA, state="running", threshold=0.5, **settings)  # type: ignore[arg-type]


def test_the_settings_drift_only_where_the_device_reports_them() -> None:
    want = _camera(label_thresholds={"car": 0.2}, min_box_area=0.01)
    assert settings_drift(want, _running(label_thresholds={"car": 0.2}, min_box_area=0.01)) is None
    assert "min_box_area 0 instead of 0.01" in (
        settings_drift(want, _running(label_thresholds={"car": 0.2}, min_box_area=0.0)) or ""
    )
    assert "label_thresholds" in (
        settings_drift(want, _running(label_thresholds={}, min_box_area=0.01)) or ""
    )
    # An agent before these settings reports neither: not compared, it is not drifting for it.
    assert settings_drift(want, _running()) is None
    # None desired and the empty/zero a device reports are the same.
    assert settings_drift(_camera(), _running(label_thresholds={}, min_box_area=0.0)) is None


def test_the_converger_re_sends_to_a_device_that_runs_other_per_label_settings(parts: Parts) -> None:
    t0 = time.time()
    parts.twin.assign(
        device_id="d1",
        camera="cam1",
        model="tiny",
        version="1",
        label_thresholds={"person": 0.3},
        min_box_area=0.01,
    )
    want = parts.desired("d1")[-1].cameras["cam1"]
    assert want.label_thresholds == {"person": 0.3} and want.min_box_area == 0.01
    parts.report("d1", threshold=0.5, label_thresholds={"person": 0.3}, min_box_area=0.01)
    parts.report("d2", threshold=0.5, label_thresholds={}, min_box_area=0.0)
    assert parts.converger.check(t0) == []
    sent = len(parts.desired("d1"))
    parts.report("d1", threshold=0.5, label_thresholds={"person": 0.3}, min_box_area=0.0)
    assert parts.converger.check(t0 + 1) == ["d1"]
    assert len(parts.desired("d1")) == sent + 1
    # An agent before them (it reports the threshold only) is in sync with the same desired state.
    parts.report("d1", threshold=0.5)
    assert parts.converger.check(t0 + 100) == []
