"""The controller signs each desired state as a whole for its device; the twin status treats other
settings than the desired ones as drift; a device that reports a version this controller never issued
is brought back by re-issuing the current state above it."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
from sqlmodel import Session

from controller.db import crud
from controller.fleet.sync import twin_sync
from controller.fleet.twin import EVENT_RESEND
from controller.security.keys import load_or_create_signer
from fleet_protocol.messages import CameraReported
from fleet_protocol.signing import key_id, load_public_key, verify_desired
from tests.support.fleet_replicas import Parts

SHA = "a" * 64


def want(**cam1: Any) -> dict[str, Any]:
    return {"cameras": {"cam1": {"model": {"manifest": {"sha256": SHA, "default_threshold": 0.5}}, **cam1}}}


def runs(**settings: Any) -> dict[str, CameraReported]:
    return {"cam1": CameraReported(model="m:1", sha256=SHA, state="running", **settings)}


@pytest.mark.parametrize(
    ("desired", "reported", "state", "reason"),
    [
        (want(), runs(), "in_sync", None),  # an agent before the settings fields: not compared
        (want(), runs(threshold=0.5), "in_sync", None),  # the manifest's default is in effect
        (
            want(threshold=0.4, max_fps=5.0, labels=["b", "a"]),
            runs(threshold=0.4, max_fps=5, labels=["a", "b"]),
            "in_sync",
            None,
        ),
        (
            want(threshold=0.4),
            runs(threshold=1.0),
            "drifted",
            "cam1 runs m:1 with threshold 1 instead of 0.4",
        ),
        (want(), runs(threshold=0.5, max_fps=0.01), "drifted", "max_fps 0.01 instead of unset"),
        (want(max_fps=5.0), runs(threshold=0.5), "drifted", "max_fps unset instead of 5"),
        (
            want(),
            runs(threshold=0.5, labels=["__nothing__"]),
            "drifted",
            "labels ['__nothing__'] instead of unset",
        ),
        (
            want(labels=["person"]),
            runs(threshold=0.5, labels=[]),
            "drifted",
            "labels [] instead of ['person']",
        ),
    ],
)
def test_settings_other_than_the_desired_ones_are_drift(
    desired: dict[str, Any], reported: dict[str, CameraReported], state: str, reason: str | None
) -> None:
    got, why = twin_sync(desired, 3, reported, 3)
    assert got == state
    if reason is None:
        assert why is None
    else:
        assert why is not None and reason in why


def test_a_reported_version_above_any_issued_is_drift() -> None:
    got, why = twin_sync(want(), 3, runs(threshold=0.5), 2**31 - 1)
    assert (
        got == "drifted"
        and why == f"device reports v{2**31 - 1}, above v3, the newest this controller issued"
    )


def test_every_published_state_is_signed_for_its_device(parts: Parts, tmp_path: Any) -> None:
    signer = load_or_create_signer(tmp_path / "keys")
    pub = load_public_key(signer.public_key)
    for device in ("d1", "d2"):
        (state,) = parts.desired(device)
        assert state.device_id == device and state.key_id == key_id(pub)
        verify_desired(state, pub)
    # The republish after a broker restart is byte-identical: Ed25519 is deterministic.
    before = parts.desired("d1")[-1]
    parts.twin.republish_all()
    assert parts.desired("d1")[-1] == before


def test_a_device_reporting_a_version_never_issued_gets_the_current_state_above_it(
    parts: Parts,
    tmp_path: Any,
) -> None:
    pub = load_public_key(load_or_create_signer(tmp_path / "keys").public_key)
    parts.report("d1", version=1000)  # e.g. a restored database, or a state from another controller
    parts.report("d2")
    assert parts.converger.check(time.time()) == ["d1"]
    sent = parts.desired("d1")
    assert [m.version for m in sent] == [1, 1001]
    assert sent[1].cameras == sent[0].cameras and sent[1].issued_at >= sent[0].issued_at
    verify_desired(sent[1], pub)
    (ev,) = parts.events("d1", EVENT_RESEND)
    assert "device reports v1000" in ev.message and ev.data["version"] == 1001
    parts.report("d1")
    assert parts.converger.check(time.time()) == []
    with Session(parts.engine) as s:
        dev = crud.get_device(s, device_id="d1")
        assert dev is not None and dev.desired_version == 1001


def test_issue_time_never_goes_back_when_the_clock_does(
    parts: Parts,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = parts.desired("d1")[-1]
    monkeypatch.setattr("controller.fleet.twin.time", SimpleNamespace(time=lambda: first.issued_at - 3600))
    parts.twin.assign(device_id="d1", camera="cam1", model="tiny", version="1", threshold=0.9)
    second = parts.desired("d1")[-1]
    assert second.version == 2 and second.issued_at == first.issued_at
