"""A camera's motion gate set from the controller: from a direct assignment or a deployment's camera
entry into the signed desired state, and compared with what a device reports only where one is desired
(unset leaves the agent's own setting), on SQLite and PostgreSQL (``parts``)."""

from __future__ import annotations

from controller.fleet.sync import settings_drift
from fleet_protocol.messages import CameraReported, MotionSettings
from tests.support.fleet_replicas import Parts

SHA = "a" * 64
GATE = {"enabled": True, "threshold": 30, "min_area": 0.002, "full_frame_every_s": 1.5}


def test_an_assignment_puts_the_motion_gate_into_the_desired_state(parts: Parts) -> None:
    parts.twin.assign(device_id="d1", camera="cam1", model="tiny", version="1", motion=GATE)
    assert parts.desired("d1")[-1].cameras["cam1"].motion == MotionSettings.model_validate(GATE)
    parts.twin.assign(device_id="d1", camera="cam1", model="tiny", version="1")
    # Unset again: the field is left out, and the agent's own setting applies.
    assert parts.desired("d1")[-1].cameras["cam1"].motion is None


def test_a_deployment_entry_carries_the_motion_gate_into_the_layer(parts: Parts) -> None:
    assert parts.deployment_layers({"camera": "cam2", "motion": GATE})["cam2"].motion == GATE


def _running(motion: MotionSettings | None) -> CameraReported:
    return CameraReported(model="m:1", sha256=SHA, state="running", threshold=0.5, motion=motion)


def test_motion_drifts_only_where_a_gate_is_desired_and_reported() -> None:
    want = {"model": {"manifest": {"sha256": SHA, "default_threshold": 0.5}}, "motion": GATE}
    assert settings_drift(want, _running(MotionSettings.model_validate(GATE))) is None
    drift = settings_drift(want, _running(MotionSettings()))
    assert drift is not None and "motion" in drift
    # An agent before the gate reports none; a state that desires none leaves the agent's own.
    assert settings_drift(want, _running(None)) is None
    unset = {"model": {"manifest": {"sha256": SHA, "default_threshold": 0.5}}}
    assert settings_drift(unset, _running(MotionSettings(enabled=True))) is None
