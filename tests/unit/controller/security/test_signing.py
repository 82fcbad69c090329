"""The controller's artifact signing key and the signatures on what it puts in desired states."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from controller.security.keys import KEY_FILE
from fleet_protocol import TopicKind, decode
from fleet_protocol.messages import DesiredState
from fleet_protocol.signing import KeyFileError, SignatureError, load_public_key, verify
from tests.support.controller_app import Fleet, FleetFactory

DEV = "gate-1"


def artifact_key(fleet: Fleet) -> dict[str, str]:
    r = fleet.client.get("/api/v1/keys/artifacts")
    assert r.status_code == 200, r.text
    body: dict[str, str] = r.json()
    return body


def test_key_is_made_private_on_first_start_and_kept_across_restarts(
    make_fleet: FleetFactory, tmp_path: Path
) -> None:
    first = make_fleet()
    key = artifact_key(first)
    assert key["algorithm"] == "ed25519" and len(key["key_id"]) == 16
    path = tmp_path / "data" / KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first.close()

    second = make_fleet()
    assert artifact_key(second) == key, "a restarted controller signs with the same key"


def test_enrollment_hands_out_the_artifact_public_key(fleet: Fleet) -> None:
    r = fleet.client.post("/api/v1/devices", json={"id": DEV})
    assert r.status_code == 201, r.text
    key = artifact_key(fleet)
    assert r.json()["artifact_public_key"] == key["public_key"]
    assert r.json()["artifact_key_id"] == key["key_id"]


def test_desired_state_refs_are_signed_and_verify_with_the_published_key(fleet: Fleet) -> None:
    fleet.client.post("/api/v1/devices", json={"id": DEV})
    for cam in ("cam1", "cam2"):
        r = fleet.client.put(
            f"/api/v1/devices/{DEV}/cameras/{cam}/model", json={"model": "tiny", "version": "1"}
        )
        assert r.status_code == 200, r.text
    public = load_public_key(artifact_key(fleet)["public_key"])

    pubs = fleet.transport.on_topic(fleet.topics.device(DEV, TopicKind.TWIN_DESIRED))
    desired = decode(TopicKind.TWIN_DESIRED, pubs[-1].payload)
    assert isinstance(desired, DesiredState) and set(desired.cameras) == {"cam1", "cam2"}
    for cam in desired.cameras.values():
        assert cam.model is not None and cam.model.key_id == artifact_key(fleet)["key_id"]
        verify(cam.model, public)  # raises if it does not check out

    # What went out is what the controller signed: change a label and it no longer verifies.
    ref = desired.cameras["cam1"].model
    assert ref is not None
    forged = ref.model_copy(update={"manifest": ref.manifest.model_copy(update={"labels": ["car"]})})
    with pytest.raises(SignatureError, match="tampered"):
        verify(forged, public)


def test_key_file_readable_by_others_is_refused_naming_the_file(
    make_fleet: FleetFactory, tmp_path: Path
) -> None:
    make_fleet().close()
    path = tmp_path / "data" / KEY_FILE
    path.chmod(0o644)
    with pytest.raises(KeyFileError, match=r"readable by others \(mode 0644\)") as err:
        make_fleet()
    assert str(path) in str(err.value) and "chmod 600" in str(err.value)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644, "the operator decides, not the controller"
