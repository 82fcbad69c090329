"""Device ids never collide with a broker user that is not a device, on a real
Mosquitto with the dynamic-security plugin administered by a real controller: enrolling the
controller's own user name, or the name of another service's broker user, is refused and leaves that
user, and the controller's connection, as they were."""

from __future__ import annotations

import stat
import subprocess
import time

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from tests.support.dynsec import ADMIN_PASSWORD, ADMIN_USER, healthz
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.processes import ControllerProcess
from tests.support.waiting import wait_for

SERVICE_PASSWORD = "grafana-password-not-for-production"


def _ctrl(broker: MosquittoBroker, *args: str) -> str:
    """``mosquitto_ctrl dynsec …`` as the broker admin (what an operator does on the broker)."""
    out = subprocess.run(
        ["mosquitto_ctrl", "-h", broker.host, "-p", str(broker.port), "-u", ADMIN_USER, "-P", ADMIN_PASSWORD,
         "dynsec", *args],
        capture_output=True, text=True, timeout=20, check=False,
    )  # fmt: skip
    assert out.returncode == 0, f"mosquitto_ctrl {args}: {out.stdout} {out.stderr}"
    return out.stdout


def _connack(broker: MosquittoBroker, username: str, password: str, client_id: str | None = None) -> int:
    """The CONNACK reason code a client with these credentials gets (0: accepted)."""
    got: list[int] = []
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id or f"probe-{time.monotonic_ns()}")
    client.username_pw_set(username, password)
    client.on_connect = lambda _c, _u, _f, rc, _p: got.append(int(rc.value))
    client.connect(broker.host, broker.port, keepalive=30)
    client.loop_start()
    try:
        wait_for(lambda: bool(got), timeout=10, what="CONNACK")
    finally:
        client.disconnect()
        client.loop_stop()
    return got[0]


def _still_connected(c: ControllerProcess) -> None:
    # A deleted or replaced controller user is disconnected by the broker within a moment.
    time.sleep(1.5)
    health = healthz(c)
    assert health["mqtt"] is True, health


def test_the_controllers_own_user_name_cannot_be_enrolled(
    controller: ControllerProcess, secured_broker: MosquittoBroker
) -> None:
    with controller.client() as api:
        for reserved in (ADMIN_USER, "EDGEFLEET-CONTROLLER", "edgefleet-controller-1a2b3c4d", "admin"):
            r = api.post("/api/v1/devices", json={"id": reserved})
            assert r.status_code == 422, (reserved, r.text)
            assert "reserved" in r.json()["detail"], r.text
        assert "controller's MQTT user name" in api.post("/api/v1/devices", json={"id": ADMIN_USER}).text
        assert api.get(f"/api/v1/devices/{ADMIN_USER}").status_code == 404  # nothing stored
    _still_connected(controller)
    # The controller's broker account is intact: it still holds its role, and still administers.
    assert "edgefleet-controller" in _ctrl(secured_broker, "getClient", ADMIN_USER)
    with controller.client() as api:
        r = api.post("/api/v1/devices", json={"id": "after-refusal"})
        assert r.status_code == 201 and r.json()["mqtt_password"], r.text


def test_a_non_device_broker_user_is_never_replaced(
    controller: ControllerProcess, secured_broker: MosquittoBroker
) -> None:
    # Another service's user on the same broker (made by the operator, not by the controller).
    _ctrl(secured_broker, "createClient", "grafana", "-p", SERVICE_PASSWORD)
    # And one that holds a device-looking role plus another: not exactly an edgefleet device either.
    _ctrl(secured_broker, "createRole", "edgefleet-device-mixed")
    _ctrl(secured_broker, "createRole", "telemetry-reader")
    _ctrl(secured_broker, "createClient", "mixed", "-p", SERVICE_PASSWORD, "-c", "mixed")
    _ctrl(secured_broker, "addClientRole", "mixed", "edgefleet-device-mixed")
    _ctrl(secured_broker, "addClientRole", "mixed", "telemetry-reader")
    with controller.client() as api:
        for name in ("grafana", "mixed"):
            r = api.post("/api/v1/devices", json={"id": name})
            assert r.status_code == 409, (name, r.text)
            assert "not an edgefleet device" in r.json()["detail"], r.text
            assert api.get(f"/api/v1/devices/{name}").status_code == 404  # nothing committed
    # Both users are untouched: their passwords still work, their roles are still theirs.
    assert _connack(secured_broker, "grafana", SERVICE_PASSWORD) == 0
    assert _connack(secured_broker, "mixed", SERVICE_PASSWORD, "mixed") == 0
    assert "telemetry-reader" in _ctrl(secured_broker, "getClient", "mixed")
    _still_connected(controller)
    # A real device is still re-enrolled (its password rotated) as before.
    with controller.client() as api:
        first = api.post("/api/v1/devices", json={"id": "rotating"}).json()["mqtt_password"]
        r = api.post("/api/v1/devices", json={"id": "rotating"})
        assert r.status_code == 201, r.text
        second = r.json()["mqtt_password"]
    assert first != second
    assert _connack(secured_broker, "rotating", second, "rotating") == 0
    assert _connack(secured_broker, "rotating", first, "rotating") != 0


def test_a_running_controllers_data_is_owner_only(controller: ControllerProcess) -> None:
    """the data folder 0700, the database and its WAL 0600 (umask 0o077)."""
    data = controller.workdir / "controller"
    with controller.client() as api:  # something written, so the WAL exists
        assert api.post("/api/v1/devices", json={"id": "perm-1"}).status_code == 201
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    files = [p for p in data.rglob("*") if p.is_file()]
    assert any(p.name == "edgefleet.db" for p in files)
    loose = {
        str(p.relative_to(data)): oct(stat.S_IMODE(p.stat().st_mode))
        for p in files
        if p.stat().st_mode & 0o077
    }
    assert loose == {}
