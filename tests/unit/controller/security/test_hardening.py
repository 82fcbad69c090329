"""What an attacker or a careless operator could reach: reserved device ids and
broker users that are not devices, what the production profile requires of the broker link,
log redaction under uvicorn's access formatter, device values in snapshot headers, device
ids with a trailing newline and the permissions of the controller's data."""

from __future__ import annotations

import base64
import io
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import certifi
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from pydantic import SecretStr, ValidationError
from starlette.testclient import WebSocketTestSession
from starlette.websockets import WebSocketDisconnect
from typer.testing import CliRunner
from uvicorn.logging import AccessFormatter

from controller import app as app_module
from controller.api import detections as detections_api
from controller.cli import app as cli_app
from controller.db.tables import ApiToken, DeviceCreate, utcnow
from controller.link.broker_auth import (
    DynsecAdmin,
    NotADeviceClientError,
    ReservedIdError,
    check_device_id,
    reserved_id_reason,
)
from controller.runtime import ControllerRuntime
from controller.security.files import secure_data_dir
from controller.security.tokens import RedactTokens, install_log_redaction
from controller.settings import ControllerSettings
from fleet_protocol import TopicKind, Topics
from fleet_protocol.endpoint import MqttEndpoint
from fleet_protocol.messages import Availability, Capabilities, CommandResult
from fleet_protocol.topics import valid_device_id
from tests.support.controller_app import Fleet
from tests.support.processes import bearer
from tests.support.waiting import wait_for

STRONG = "S3cure-" + "abcdefghijklmnopqrstuvwxyz0123456789"

# --------------------------------------------------------------------------- reserved ids


def test_reserved_device_ids_name_why() -> None:
    own = {"ctl-user": "the controller's MQTT user name", "dynsec-admin": "the broker admin's user name"}
    assert reserved_id_reason("ctl-user", own) == "it is the controller's MQTT user name"
    assert reserved_id_reason("DYNSEC-ADMIN", own) == "it is the broker admin's user name"
    for name in ("edgefleet-controller", "Edgefleet-Controller", "admin", "mosquitto", "root"):
        assert reserved_id_reason(name, own) is not None, name
    # The controller's own client ids (bridge and broker admin) cannot be taken over by a device.
    assert reserved_id_reason("edgefleet-controller-1a2b3c4d") is not None
    assert reserved_id_reason("edgefleet-broker-admin-1a2b3c4d") is not None
    for ok in ("devA", "site-a-cam-1", "edgefleet-pi-1", "administrator-room"):
        assert reserved_id_reason(ok, own) is None, ok
    with pytest.raises(ReservedIdError, match="reserved: it is the controller's MQTT user name"):
        check_device_id("ctl-user", own)


def test_settings_list_this_deployments_broker_names() -> None:
    s = ControllerSettings(
        mqtt_url="mqtt://ctl:pw@127.0.0.1:1883",
        mqtt_admin_username="boss",
        mqtt_client_id="ctl-bridge",
        mqtt_broker_auth="dynsec",
    )
    assert set(s.reserved_broker_names()) == {"ctl", "boss", "ctl-bridge"}
    assert ControllerSettings(mqtt_url="mqtt://127.0.0.1:1883").reserved_broker_names() == {}


class _ScriptedAdmin(DynsecAdmin):
    """A DynsecAdmin whose broker answers ``getClient`` with ``client`` and records every batch."""

    def __init__(self, client: dict[str, Any] | None) -> None:
        super().__init__(
            MqttEndpoint.parse("mqtt://127.0.0.1:1"),
            Topics(),
            username="dynsec-admin",
            password=SecretStr("x"),
            controller_username="ctl-user",
        )
        self.client_answer = client
        self.batches: list[list[str]] = []

    def _run(self, commands: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.batches.append([c["command"] for c in commands])
        if commands[0]["command"] == "getClient":
            if self.client_answer is None:
                return [{"command": "getClient", "error": "Client not found"}]
            return [{"command": "getClient", "data": {"client": self.client_answer}}]
        return [{"command": c["command"]} for c in commands]


def _device_client(device_id: str, **kw: Any) -> dict[str, Any]:
    return {
        "username": device_id,
        "clientid": device_id,
        "textdescription": "edgefleet device",
        "roles": [{"rolename": f"edgefleet-device-{device_id}"}],
        "groups": [],
        **kw,
    }


def test_issue_creates_a_new_device_and_rotates_an_existing_one() -> None:
    new = _ScriptedAdmin(None)
    new.issue("devA", "pw")
    assert new.batches == [["getClient"], ["deleteClient", "deleteRole", "createRole", "createClient"]]
    again = _ScriptedAdmin(_device_client("devA"))
    again.issue("devA", "pw")
    assert again.batches[-1][0] == "deleteClient"


@pytest.mark.parametrize(
    "client",
    [
        {"username": "grafana", "roles": [], "groups": []},  # another service's user
        _device_client("grafana", roles=[{"rolename": "admin"}]),  # the controller's or admin's shape
        _device_client("grafana", roles=[{"rolename": "edgefleet-device-grafana"}, {"rolename": "x"}]),
        _device_client("grafana", groups=[{"groupname": "ops"}]),
        _device_client("grafana", clientid=None),
    ],
)
def test_issue_and_revoke_never_touch_a_client_that_is_not_exactly_a_device(client: dict[str, Any]) -> None:
    admin = _ScriptedAdmin(client)
    with pytest.raises(NotADeviceClientError, match="not an edgefleet device"):
        admin.issue("grafana", "pw")
    with pytest.raises(NotADeviceClientError):
        admin.revoke("grafana")
    assert admin.batches == [["getClient"], ["getClient"]]  # nothing deleted or created


def test_issue_refuses_the_controllers_and_admins_own_users_before_asking_the_broker() -> None:
    admin = _ScriptedAdmin(None)
    for name in ("ctl-user", "dynsec-admin", "edgefleet-controller"):
        with pytest.raises(ReservedIdError):
            admin.issue(name, "pw")
    assert admin.batches == []


# --------------------------------------------------------------------------- production profile


def _production(**kw: Any) -> dict[str, Any]:
    return {
        "environment": "production",
        "database_url": f"postgresql+psycopg://edgefleet:{STRONG}@db:5432/edgefleet",
        "mqtt_url": f"mqtts://controller:{STRONG}@broker.example:8883",
        "mqtt_broker_auth": "dynsec",
        "admin_token": STRONG,
        **kw,
    }


def test_production_accepts_dynsec_over_tls() -> None:
    assert ControllerSettings(**_production()).environment == "production"


def test_production_refuses_a_broker_without_per_device_acls_unless_told_it_is_external() -> None:
    with pytest.raises(ValidationError) as err:
        ControllerSettings(**_production(mqtt_broker_auth="none"))
    msg = str(err.value)
    assert "EDGEFLEET_MQTT_BROKER_AUTH" in msg and "EDGEFLEET_MQTT_ACL=external" in msg
    s = ControllerSettings(**_production(mqtt_broker_auth="none", mqtt_acl="external"))
    assert s.mqtt_acl == "external"
    # Development keeps its plain local broker.
    assert ControllerSettings(mqtt_url="mqtt://broker.example:1883").mqtt_broker_auth == "none"


@pytest.mark.parametrize("host", ["broker.example", "10.0.0.5", "mosquitto"])
def test_production_refuses_plain_mqtt_to_a_remote_host(host: str) -> None:
    with pytest.raises(ValidationError) as err:
        ControllerSettings(**_production(mqtt_url=f"mqtt://controller:{STRONG}@{host}:1883"))
    msg = str(err.value)
    assert "EDGEFLEET_MQTT_URL" in msg and "mqtts://" in msg and STRONG not in msg


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "127.0.0.2"])
def test_production_allows_plain_mqtt_on_loopback(host: str) -> None:
    ControllerSettings(**_production(mqtt_url=f"mqtt://controller:{STRONG}@{host}:1883"))


def test_production_allows_plain_mqtt_url_with_a_ca_file() -> None:
    ca = Path(certifi.where())  # any readable PEM CA bundle: the CA file alone turns TLS on
    s = ControllerSettings(**_production(mqtt_url=f"mqtt://controller:{STRONG}@broker:8883", mqtt_ca_file=ca))
    assert s.mqtt_target().tls


def test_the_cli_exits_2_naming_the_broker_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for k, v in {
        "EDGEFLEET_ENVIRONMENT": "production",
        "EDGEFLEET_DATA_DIR": str(tmp_path),
        "EDGEFLEET_DATABASE_URL": f"postgresql+psycopg://edgefleet:{STRONG}@db/edgefleet",
        "EDGEFLEET_MQTT_URL": f"mqtt://controller:{STRONG}@broker.example:1883",
        "EDGEFLEET_ADMIN_TOKEN": STRONG,
    }.items():
        monkeypatch.setenv(k, v)
    result = CliRunner().invoke(cli_app, ["controller", "--validate-config"])
    assert result.exit_code == 2, result.output
    out = result.output
    assert "EDGEFLEET_MQTT_BROKER_AUTH" in out and "EDGEFLEET_MQTT_URL" in out and STRONG not in out
    monkeypatch.setenv("EDGEFLEET_MQTT_URL", f"mqtts://controller:{STRONG}@broker.example:8883")
    monkeypatch.setenv("EDGEFLEET_MQTT_ACL", "external")
    result = CliRunner().invoke(cli_app, ["controller", "--validate-config"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("host", ["broker.localhost", "localhost.localdomain", "localhost.example"])
def test_production_counts_only_literal_loopback_and_localhost_itself_as_loopback(host: str) -> None:
    """A name that only looks local is resolved by whatever resolver the container has, DNS included."""
    with pytest.raises(ValidationError) as err:
        ControllerSettings(**_production(mqtt_url=f"mqtt://controller:{STRONG}@{host}:1883"))
    assert "EDGEFLEET_MQTT_URL" in str(err.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("admin_token", "changeme-changeme-changeme-changeme"),
        ("admin_token", "passwordpasswordpasswordpassword"),
        ("admin_token", "admin_admin.admin-admin_admin.admin"),
        ("mqtt_admin_password", "mqtt-mqtt-mqtt-mqtt"),
    ],
)
def test_production_refuses_a_default_word_repeated(field: str, value: str) -> None:
    with pytest.raises(ValidationError) as err:
        ControllerSettings(**_production(**{field: value}))
    msg = str(err.value)
    assert "default repeated" in msg and value not in msg


def test_a_long_secret_that_only_contains_a_default_word_is_accepted() -> None:
    s = ControllerSettings(**_production(admin_token="changeme-" + STRONG))
    assert s.admin_token is not None


def _production_env_with_token_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, token: str) -> Path:
    token_file = tmp_path / "admin.token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    for k, v in {
        "EDGEFLEET_ENVIRONMENT": "production",
        "EDGEFLEET_DATA_DIR": str(tmp_path / "data"),
        "EDGEFLEET_DATABASE_URL": f"postgresql+psycopg://edgefleet:{STRONG}@db/edgefleet",
        "EDGEFLEET_MQTT_URL": f"mqtts://controller:{STRONG}@broker.example:8883",
        "EDGEFLEET_MQTT_ACL": "external",
        "EDGEFLEET_ADMIN_TOKEN_FILE": str(token_file),
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("EDGEFLEET_ADMIN_TOKEN", raising=False)
    return token_file


def test_validate_config_reads_the_admin_token_file_and_exits_2_on_a_weak_token(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    token_file = _production_env_with_token_file(monkeypatch, tmp_path, "short")
    result = CliRunner().invoke(cli_app, ["controller", "--validate-config"])
    assert result.exit_code == 2, result.output
    assert "admin_token_file" in result.output and str(token_file) in result.output
    assert "shorter than 32" in result.output and "short\n" not in result.output
    # The real start refuses the same way, before anything is opened.
    result = CliRunner().invoke(cli_app, ["controller"])
    assert result.exit_code == 2, result.output
    assert not (tmp_path / "data").exists()


def test_validate_config_names_a_token_file_others_can_read_and_accepts_a_strong_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    token_file = _production_env_with_token_file(monkeypatch, tmp_path, STRONG)
    token_file.chmod(0o644)
    result = CliRunner().invoke(cli_app, ["controller", "--validate-config"])
    assert result.exit_code == 2 and "readable by others" in result.output, result.output
    token_file.chmod(0o600)
    result = CliRunner().invoke(cli_app, ["controller", "--validate-config"])
    assert result.exit_code == 0, result.output
    assert STRONG not in result.output


# --------------------------------------------------------------------------- access-log redaction


def _access_record(path: str) -> logging.LogRecord:
    # What uvicorn's httptools/h11 protocols log: exactly five args, unpacked by AccessFormatter.
    return logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5555", "GET", path, "1.1", 200), None,
    )  # fmt: skip


def test_redaction_keeps_uvicorns_access_formatter_working() -> None:
    record = _access_record("/healthz?a=1&token=eft_s3cret-value&b=2")
    assert RedactTokens().filter(record)
    assert isinstance(record.args, tuple) and len(record.args) == 5
    line = AccessFormatter(fmt="%(client_addr)s - %(request_line)s %(status_code)s").format(record)
    assert "token=***" in line and "s3cret" not in line and "a=1" in line and "b=2" in line
    assert line.startswith("127.0.0.1:5555 - GET /healthz?") and line.endswith(" 200 OK")


def test_redaction_through_a_real_handler_logs_no_error(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    errors = io.StringIO()
    monkeypatch.setattr("sys.stderr", errors)  # where logging prints "--- Logging error ---"
    handler = logging.StreamHandler(stream)
    handler.setFormatter(AccessFormatter(fmt='%(client_addr)s - "%(request_line)s" %(status_code)s'))
    logger = logging.getLogger("uvicorn.access")
    logger.addHandler(handler)
    old_level, old_propagate = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        install_log_redaction()
        logger.info(
            '%s - "%s %s HTTP/%s" %d',
            "10.0.0.9:4000",
            "GET",
            "/api/v1/detections/live?token=eft_abc",
            "1.1",
            101,
        )
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        logger.propagate = old_propagate
    assert "Logging error" not in errors.getvalue()
    out = stream.getvalue()
    assert "/api/v1/detections/live?token=***" in out and "eft_abc" not in out and "101" in out


def test_redaction_of_a_non_string_argument_and_a_mapping() -> None:
    class Url:
        def __str__(self) -> str:
            return "/x?token=t0ken"

    record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "%s %d", (Url(), 3), None)
    RedactTokens().filter(record)
    assert record.getMessage() == "/x?token=*** 3"
    record = logging.LogRecord(
        "uvicorn.error", logging.INFO, __file__, 1, "%(p)s", ({"p": "/y?token=z"},), None
    )
    RedactTokens().filter(record)
    assert record.getMessage() == "/y?token=***"


# --------------------------------------------------------------------------- revoked live sockets


def _viewer(fleet: Fleet) -> tuple[int, str]:
    r = fleet.client.post("/api/v1/tokens", json={"name": "wall-screen", "role": "viewer"})
    assert r.status_code == 201, r.text
    return int(r.json()["id"]), str(r.json()["token"])


def _close_code_within(ws: WebSocketTestSession, seconds: float) -> int | None:
    """The close code the server sends within ``seconds`` (None: the socket stayed open)."""
    got: list[int] = []

    def read() -> None:
        try:
            while True:
                ws.receive_json()
        except WebSocketDisconnect as exc:
            got.append(exc.code)
        except Exception:  # the test closed the socket itself after the wait
            return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(seconds)
    return got[0] if got else None


def test_revoking_a_token_closes_its_live_socket_at_once(fleet: Fleet) -> None:
    token_id, token = _viewer(fleet)
    _, other = _viewer(fleet)
    anon = TestClient(fleet.client.app)
    with (
        anon.websocket_connect("/api/v1/detections/live", headers=bearer(token)) as ws,
        anon.websocket_connect("/api/v1/detections/live", headers=bearer(other)) as kept,
    ):
        assert ws.receive_json()["type"] == "hello" and kept.receive_json()["type"] == "hello"
        started = time.monotonic()
        assert fleet.client.delete(f"/api/v1/tokens/{token_id}").status_code == 204
        assert _close_code_within(ws, 3.0) == 1008
        assert time.monotonic() - started < 3.0
        # Only that token's sockets: another viewer's stays.
        wait_for(lambda: len(fleet.client.get("/api/v1/detections/live/clients").json()) == 1, timeout=5,
                 what="one live client left")  # fmt: skip


def test_a_live_socket_rechecks_its_token(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    # A revoke the hook never heard of (another controller process on the same database).
    monkeypatch.setattr(detections_api, "LIVE_REAUTH_S", 0.2)
    token_id, token = _viewer(fleet)
    runtime: ControllerRuntime = fleet.client.app.state.runtime  # type: ignore[attr-defined]
    with TestClient(fleet.client.app).websocket_connect(f"/api/v1/detections/live?token={token}") as ws:
        assert ws.receive_json()["type"] == "hello"
        with runtime.engine.begin() as conn:
            t = ApiToken.__table__  # type: ignore[attr-defined]
            conn.execute(sa.update(t).where(t.c.id == token_id).values(revoked_at=utcnow()))
        assert _close_code_within(ws, 3.0) == 1008


def test_the_bootstrap_admin_tokens_socket_is_not_rechecked_away(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(detections_api, "LIVE_REAUTH_S", 0.1)
    with fleet.client.websocket_connect("/api/v1/detections/live") as ws:
        assert ws.receive_json()["type"] == "hello"
        assert _close_code_within(ws, 0.6) is None


# --------------------------------------------------------------------------- snapshot headers

JPEG = base64.b64encode(b"\xff\xd8\xff\xe0 not really a picture").decode()


def _online_with_answer(fleet: Fleet, monkeypatch: pytest.MonkeyPatch, result: dict[str, Any]) -> None:
    caps = Capabilities(
        hostname="h", cpu_count=1, cameras=["cam1"], execution_providers=["CPUExecutionProvider"]
    )
    fleet.send(
        "snap-1",
        TopicKind.AVAILABILITY,
        Availability(state="online", agent_version="0.1.0", capabilities=caps),
    )
    wait_for(
        lambda: (d := fleet.device_or_none("snap-1")) and d["status"] == "online", timeout=10, what="online"
    )
    runtime: ControllerRuntime = fleet.client.app.state.runtime  # type: ignore[attr-defined]
    answer = CommandResult(id="c1", ok=True, result={"jpeg_base64": JPEG, **result})
    monkeypatch.setattr(runtime.commands, "request", lambda *_a, **_k: answer)


def test_snapshot_headers_carry_coerced_numbers(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    _online_with_answer(
        fleet,
        monkeypatch,
        {"frame": 42, "width": 640, "height": 480, "boxes": 3, "captured_at": 1712345678.25},
    )
    r = fleet.client.get("/api/v1/devices/snap-1/cameras/cam1/snapshot")
    assert r.status_code == 200, r.text
    h = r.headers
    assert (h["X-Snapshot-Frame"], h["X-Snapshot-Width"], h["X-Snapshot-Height"]) == ("42", "640", "480")
    assert h["X-Snapshot-Boxes"] == "3" and h["X-Snapshot-Captured-At"] == "1712345678.25"


@pytest.mark.parametrize(
    "bad",
    [
        {"frame": "1\r\nSet-Cookie: x=1"},
        {"width": "640\u2028"},
        {"captured_at": "caf\u00e9\u4e2d"},
        {"height": -1},
        {"boxes": 1.5},
        {"frame": 2**70},
        {"captured_at": "nan"},
        {"captured_at": None},
    ],
)
def test_snapshot_with_device_text_in_a_header_field_is_a_clean_502(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, bad: dict[str, Any]
) -> None:
    _online_with_answer(fleet, monkeypatch, bad)
    r = fleet.client.get("/api/v1/devices/snap-1/cameras/cam1/snapshot")
    assert r.status_code == 502, r.text
    assert "snapshot whose" in r.json()["detail"] and "Set-Cookie" not in r.text


# --------------------------------------------------------------------------- trailing newline


def test_a_device_id_with_a_trailing_newline_is_refused(fleet: Fleet) -> None:
    assert valid_device_id("devC") and not valid_device_id("devC\n") and not valid_device_id("devC\r\n")
    with pytest.raises(ValidationError):
        DeviceCreate(id="devC\n")
    r = fleet.client.post("/api/v1/devices", json={"id": "devC\n"})
    assert r.status_code == 422, r.text
    assert fleet.client.get("/api/v1/devices").json() == []


# --------------------------------------------------------------------------- private data


def test_the_data_folder_and_database_files_are_made_private(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    for name in ("edgefleet.db", "edgefleet.db-wal", "edgefleet.db-shm"):
        (data / name).write_bytes(b"x")
        (data / name).chmod(0o644)
    secure_data_dir(data)
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    for name in ("edgefleet.db", "edgefleet.db-wal", "edgefleet.db-shm"):
        assert stat.S_IMODE((data / name).stat().st_mode) == 0o600, name
    fresh = tmp_path / "new" / "data"
    secure_data_dir(fresh)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700


def test_run_controller_sets_an_owner_only_umask(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []

    def fake_run(_self: Any) -> None:
        current = os.umask(0o022)
        os.umask(current)
        seen.append(current)

    monkeypatch.setattr(app_module.uvicorn.Server, "run", fake_run)
    previous = os.umask(0o022)
    try:
        app_module.run_controller(ControllerSettings(data_dir=tmp_path / "d", mqtt_url="mqtt://127.0.0.1:1"))
    finally:
        os.umask(previous)
    assert seen == [0o077]
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o700
