"""Domain errors and their HTTP answers: every refusal the controller's services raise is a kind of
``ControllerError`` without an HTTP code of its own, and the API's one handler answers each kind with
its status and the message as ``detail``."""

from __future__ import annotations

import pytest

from controller.api.errors import status_of
from controller.errors import ControllerError
from controller.fleet.rollouts import (
    DeploymentConflictError,
    DeploymentInvalidError,
    DeploymentModelNotFoundError,
)
from controller.fleet.selectors import SelectorError
from controller.link.broker_auth import BrokerAdminError
from controller.link.commands import (
    CommandError,
    CommandFailedError,
    CommandTimeoutError,
    DeviceNotReadyError,
    UnknownCameraError,
)
from controller.registry.bundled import ModelRejectedError
from controller.registry.uploads import (
    UploadConflictError,
    UploadInvalidError,
    UploadMalformedError,
    UploadOverLimitError,
)
from tests.support.controller_app import Fleet

DEV = "dev-1"


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (SelectorError("unbalanced '('"), 422),
        (DeploymentInvalidError("waves: at least one wave"), 422),
        (DeploymentModelNotFoundError("model 'x' version '1' is not registered"), 404),
        (DeploymentConflictError("a deployment named 'x' exists"), 409),
        (UploadInvalidError("form field 'name' is required"), 422),
        (UploadMalformedError("manifest is not JSON"), 400),
        (ModelRejectedError("not an ONNX model"), 400),
        (UploadOverLimitError("upload exceeds the size limit"), 413),
        (UploadConflictError("versions are immutable"), 409),
        (BrokerAdminError("not connected to the broker's dynamic-security admin"), 503),
        (CommandError("busy", "too many commands in flight (256)"), 503),
        (CommandError("stopping", "the controller is shutting down"), 503),
        (CommandTimeoutError("device d did not answer the snapshot command within 1 s"), 504),
        (UnknownCameraError("device d: unknown camera 'x'", error="unknown camera 'x'"), 404),
        (DeviceNotReadyError("device d: camera c has no frame yet", error="camera c has no frame yet"), 503),
        (CommandFailedError("device d could not take a snapshot: boom", error="boom"), 502),
    ],
)
def test_each_kind_of_refusal_has_its_status(error: ControllerError, status: int) -> None:
    assert status_of(error) == status


def _kinds(cls: type[ControllerError]) -> set[type[ControllerError]]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _kinds(sub)
    return out


def test_no_domain_error_carries_an_http_code() -> None:
    kinds = _kinds(ControllerError)
    assert len(kinds) > 20  # the modules above are imported: their kinds are all here
    for kind in kinds:
        if not kind.__subclasses__():  # the kinds raised (DeploymentError, UploadError only group theirs)
            assert status_of(kind.__new__(kind)) != 500, kind
        assert not {"status", "status_code", "http_status"} & set(vars(kind)), kind


@pytest.mark.parametrize(
    ("device_says", "kind", "status", "detail"),
    [
        ("unknown camera 'cam9'", UnknownCameraError, 404, "device d1: unknown camera 'cam9'"),
        ("camera cam1 has no frame yet", DeviceNotReadyError, 503, "device d1: camera cam1 has no frame yet"),
        ("busy: try later", DeviceNotReadyError, 503, "device d1: busy: try later"),
        ("exploded", CommandFailedError, 502, "device d1 could not take a snapshot: exploded"),
        (None, CommandFailedError, 502, "device d1 could not take a snapshot: unknown error"),
    ],
)
def test_a_devices_refusal_becomes_its_kind_of_error(
    device_says: str | None, kind: type[CommandFailedError], status: int, detail: str
) -> None:
    err = CommandFailedError.of("d1", device_says, doing="take a snapshot")
    assert type(err) is kind and status_of(err) == status and str(err) == detail


class _RefusingBroker:
    """A broker admin whose broker is gone: every change is refused."""

    def issue(self, device_id: str, password: str) -> None:
        raise BrokerAdminError("not connected to the broker's dynamic-security admin at mqtt://broker")

    def revoke(self, device_id: str) -> None:
        raise BrokerAdminError("the broker refused deleteClient: timeout")


def test_a_refusing_broker_is_a_503_and_the_device_keeps_its_state(fleet: Fleet) -> None:
    assert fleet.client.post("/api/v1/devices", json={"id": DEV, "name": "before"}).status_code == 201
    runtime = fleet.client.app.state.runtime  # type: ignore[attr-defined]
    runtime.broker_admin = _RefusingBroker()
    try:
        r = fleet.client.post("/api/v1/devices", json={"id": DEV, "name": "after"})
        assert r.status_code == 503
        assert r.json() == {"detail": "not connected to the broker's dynamic-security admin at mqtt://broker"}
        # Nothing was committed: the broker comes first.
        assert fleet.client.get(f"/api/v1/devices/{DEV}").json()["name"] == "before"
        r = fleet.client.post(f"/api/v1/devices/{DEV}/revoke")
        assert r.status_code == 503 and r.json() == {"detail": "the broker refused deleteClient: timeout"}
    finally:
        runtime.broker_admin = None
