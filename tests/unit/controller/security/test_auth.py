"""API security: bearer tokens stored hashed, the roles (viewer, operator, release, admin), the live
WebSocket, the bootstrap admin token, production's refusal of default secrets, and secrets kept out of
logs and answers."""

from __future__ import annotations

import base64
import logging
import re
import stat
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from pydantic import ValidationError
from starlette.testclient import WebSocketDenialResponse
from typer.testing import CliRunner

from controller.cli import app as cli_app
from controller.security.tokens import RedactTokens, Role, hash_token, install_log_redaction, required_role
from controller.settings import ControllerSettings
from tests.support.controller_app import Fleet, FleetFactory
from tests.support.processes import ADMIN_TOKEN, bearer

STRONG = "S3cure-" + "abcdefghijklmnopqrstuvwxyz0123456789"


def _anon(fleet: Fleet) -> TestClient:
    """A client of the same running app that sends no token."""
    return TestClient(fleet.client.app)


def _token(fleet: Fleet, role: str, name: str | None = None) -> str:
    r = fleet.client.post("/api/v1/tokens", json={"name": name or f"t-{role}", "role": role})
    assert r.status_code == 201, r.text
    token: str = r.json()["token"]
    return token


def _get(fleet: Fleet, path: str, token: str, **kw: Any) -> Any:
    return fleet.client.get(path, headers=bearer(token), **kw)


def _post(fleet: Fleet, path: str, token: str, **kw: Any) -> Any:
    return fleet.client.post(path, headers=bearer(token), **kw)


def test_no_token_or_a_bad_one_is_401_with_a_bearer_challenge(fleet: Fleet) -> None:
    anon = _anon(fleet)
    r = anon.get("/api/v1/devices")
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert "Authorization: Bearer" in r.json()["detail"]
    for bad in ("Bearer nope", "Bearer ", "Basic dXNlcjpwYXNz", f"Bearer {ADMIN_TOKEN}x"):
        r = anon.get("/api/v1/devices", headers={"Authorization": bad})
        assert r.status_code == 401, bad
        assert r.headers["www-authenticate"].startswith("Bearer")
    # Liveness and the dashboard's static pages stay open; their data does not.
    assert anon.get("/healthz").status_code == 200
    assert anon.get("/").status_code == 200
    assert anon.get("/devices/anything").status_code == 200
    assert anon.get("/pools/anything").status_code == 200
    assert anon.get("/metrics").status_code == 401


def test_every_route_refuses_anonymous_calls_except_the_public_ones(fleet: Fleet) -> None:
    """Routes added later by anyone are covered: the guard is app-wide, by method and path."""
    anon = _anon(fleet)
    checked = 0
    for template, ops in fleet.client.get("/openapi.json").json()["paths"].items():
        path = re.sub(r"\{[^}]+\}", "x1", template)
        for method in ops:
            needed = required_role(method.upper(), path)
            r = anon.request(method.upper(), path)
            if needed is None:
                assert r.status_code != 401, (method, template)
            else:
                assert r.status_code == 401, (method, template, r.status_code, r.text[:200])
                assert r.headers["www-authenticate"].startswith("Bearer")
                checked += 1
    assert checked > 30
    assert required_role("GET", "/devices/x1") is None  # the technician page (HTML only)
    assert required_role("GET", "/api/v1/devices/x1") is Role.VIEWER
    assert required_role("GET", "/pools/x1") is None  # the pool page (HTML only)
    assert required_role("GET", "/api/v1/pools/x1") is Role.VIEWER
    assert required_role("GET", "/pools/x1/devices") is Role.VIEWER
    assert required_role(None, "/api/v1/detections/live") is Role.VIEWER
    assert required_role("DELETE", "/api/v1/deployments/x1") is Role.OPERATOR
    assert required_role("GET", "/api/v1/tokens") is Role.ADMIN
    # A device's log and diagnostics are asked of the device and carry its configuration: operators only.
    assert required_role("GET", "/api/v1/devices/x1/logs") is Role.OPERATOR
    assert required_role("GET", "/api/v1/devices/x1/diagnostics") is Role.OPERATOR
    assert required_role("POST", "/api/v1/devices/x1/restart") is Role.OPERATOR
    assert required_role("GET", "/some/new/route") is Role.VIEWER


def test_viewer_reads_but_cannot_change_anything(fleet: Fleet) -> None:
    viewer = _token(fleet, "viewer", "tech-anna")
    assert fleet.client.post("/api/v1/devices", json={"id": "dev-1"}).status_code == 201
    assert _get(fleet, "/api/v1/devices", viewer).status_code == 200
    assert _get(fleet, "/api/v1/devices/dev-1", viewer).status_code == 200
    assert _get(fleet, "/api/v1/models", viewer).status_code == 200
    assert _get(fleet, "/metrics", viewer).status_code == 200
    # A snapshot is a read: refused for being offline (409), not for the role.
    assert _get(fleet, "/api/v1/devices/dev-1/cameras/cam1/snapshot", viewer).status_code == 409
    r = _post(fleet, "/api/v1/deployments", viewer, json={"model": "tiny", "version": "1"})
    assert r.status_code == 403
    assert "operator" in r.json()["detail"] and "tech-anna" in r.json()["detail"]
    assert _post(fleet, "/api/v1/devices", viewer, json={"id": "dev-2"}).status_code == 403
    r = fleet.client.put("/api/v1/devices/dev-1/labels", headers=bearer(viewer), json={"labels": {"a": "b"}})
    assert r.status_code == 403
    assert _get(fleet, "/api/v1/tokens", viewer).status_code == 403


def test_operator_deploys_but_cannot_manage_tokens(fleet: Fleet) -> None:
    operator = _token(fleet, "operator", "ci-deployer")
    assert (
        _post(fleet, "/api/v1/devices", operator, json={"id": "dev-1", "labels": {"site": "a"}}).status_code
        == 201
    )
    r = _post(
        fleet, "/api/v1/deployments", operator, json={"model": "tiny", "version": "1", "selector": "site=a"}
    )
    assert r.status_code == 201, r.text
    r = _get(fleet, "/api/v1/tokens", operator)
    assert r.status_code == 403 and "admin" in r.json()["detail"]
    r = _post(fleet, "/api/v1/tokens", operator, json={"name": "mine", "role": "admin"})
    assert r.status_code == 403 and "admin" in r.json()["detail"]
    assert fleet.client.delete("/api/v1/tokens/1", headers=bearer(operator)).status_code == 403


def test_admin_manages_tokens_and_a_revoked_token_is_refused_at_once(fleet: Fleet) -> None:
    admin = _token(fleet, "admin", "second-admin")
    created = _post(fleet, "/api/v1/tokens", admin, json={"name": "grafana", "role": "viewer"})
    assert created.status_code == 201
    body = created.json()
    token = body["token"]
    assert body["role"] == "viewer" and token.startswith(body["prefix"]) and len(token) > 40
    assert created.headers["cache-control"] == "no-store"
    assert _get(fleet, "/api/v1/devices", token).status_code == 200
    listed = {t["id"]: t for t in _get(fleet, "/api/v1/tokens", admin).json()}
    assert listed[body["id"]]["last_used_at"] is not None
    assert all("token" not in t and "token_hash" not in t for t in listed.values())

    assert fleet.client.delete(f"/api/v1/tokens/{body['id']}", headers=bearer(admin)).status_code == 204
    r = _get(fleet, "/api/v1/devices", token)
    assert r.status_code == 401 and "revoked" in r.json()["detail"]
    assert _get(fleet, "/api/v1/tokens", admin).json()[-1]["revoked_at"] is not None
    assert fleet.client.delete(f"/api/v1/tokens/{body['id']}").status_code == 204  # idempotent
    assert fleet.client.delete("/api/v1/tokens/999").status_code == 404
    r = fleet.client.post("/api/v1/tokens", json={"name": "x", "role": "root"})
    assert r.status_code == 422


def test_live_websocket_needs_a_token_by_header_subprotocol_or_query(fleet: Fleet) -> None:
    anon = _anon(fleet)
    assert _ws_refusal(anon, "/api/v1/detections/live") == 401
    assert _ws_refusal(anon, "/api/v1/detections/live?token=wrong") == 401

    viewer = _token(fleet, "viewer")
    # Browsers: the token as a base64url subprotocol next to "edgefleet", which the server picks.
    proto = "bearer." + base64.urlsafe_b64encode(viewer.encode()).decode().rstrip("=")
    with anon.websocket_connect("/api/v1/detections/live", subprotocols=["edgefleet", proto]) as ws:
        assert ws.accepted_subprotocol == "edgefleet"
        assert ws.receive_json()["type"] == "hello"
    with anon.websocket_connect(f"/api/v1/detections/live?token={viewer}") as ws:
        assert ws.receive_json()["type"] == "hello"
    with anon.websocket_connect("/api/v1/detections/live", headers=bearer(viewer)) as ws:
        assert ws.receive_json()["type"] == "hello"


def _ws_refusal(client: TestClient, url: str) -> int:
    """The HTTP status a refused WebSocket handshake was answered with."""
    try:
        client.websocket_connect(url).__enter__()
    except WebSocketDenialResponse as denied:
        return denied.status_code
    raise AssertionError(f"{url}: the WebSocket was accepted")


def test_the_raw_token_is_never_stored(fleet: Fleet) -> None:
    token = _token(fleet, "operator")
    rt = fleet.client.app.state.runtime  # type: ignore[attr-defined]
    dump: list[str] = []
    with rt.engine.connect() as conn:
        for table in sa.inspect(conn).get_table_names():
            dump += [repr(tuple(row)) for row in conn.execute(sa.text(f'SELECT * FROM "{table}"'))]
    text = "\n".join(dump)
    assert token not in text and ADMIN_TOKEN not in text
    assert hash_token(token) in text  # what is kept instead


def test_tokens_never_appear_in_logs_or_in_any_answer_but_the_creation(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    created = fleet.client.post("/api/v1/tokens", json={"name": "ops", "role": "operator"})
    token = created.json()["token"]
    answers = [
        _get(fleet, "/api/v1/tokens", token),  # 403
        _get(fleet, "/api/v1/tokens", ADMIN_TOKEN),
        _post(fleet, "/api/v1/devices", token, json={"id": "dev-1"}),
        _get(fleet, "/api/v1/devices", token),
        _get(fleet, "/metrics", token),
        fleet.client.get("/openapi.json"),
        fleet.client.delete(f"/api/v1/tokens/{created.json()['id']}"),
        _get(fleet, "/api/v1/devices", token),  # 401, revoked
    ]
    with _anon(fleet).websocket_connect(f"/api/v1/detections/live?token={ADMIN_TOKEN}") as ws:
        ws.receive_json()
    # uvicorn writes the path with its query string: the filter on its loggers takes the token out.
    install_log_redaction()
    logging.getLogger("uvicorn.error").info(
        '%s - "WebSocket %s" [accepted]', "127.0.0.1:5555", f"/api/v1/detections/live?label=x&token={token}"
    )
    logging.getLogger("uvicorn.access").info(
        '%s - "%s %s HTTP/%s" %d', "127.0.0.1:5555", "GET", f"/x?token={ADMIN_TOKEN}", "1.1", 200
    )
    for secret in (token, ADMIN_TOKEN):
        assert secret not in caplog.text
        for r in answers:
            assert secret not in r.text and secret not in str(r.headers)
    assert "token=***" in caplog.text
    assert any("API token #" in m for m in caplog.messages)  # creation is logged, by id and prefix


def test_redaction_keeps_other_query_parameters() -> None:
    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1, "%s", ("/a?b=1&token=s3&c=2",), None
    )
    RedactTokens().filter(record)
    assert record.getMessage() == "/a?b=1&token=***&c=2"


def test_without_a_configured_admin_token_one_is_made_in_the_data_dir(
    make_fleet: FleetFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    fleet = make_fleet(admin_token=None, data_dir=tmp_path / "boot")
    path = tmp_path / "boot" / "admin.token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text().strip()
    assert len(token) > 40 and token not in caplog.text
    assert _get(fleet, "/api/v1/tokens", token).status_code == 200
    assert _get(fleet, "/api/v1/tokens", ADMIN_TOKEN).status_code == 401
    fleet.close()
    # Same data dir, next start: the same token; a file others may read is refused.
    again = make_fleet(admin_token=None, data_dir=tmp_path / "boot")
    assert _get(again, "/api/v1/devices", token).status_code == 200
    again.close()
    path.chmod(0o644)
    with pytest.raises(PermissionError, match="readable by others"):
        make_fleet(admin_token=None, data_dir=tmp_path / "boot").client.get("/healthz")


def _production(**kw: Any) -> dict[str, Any]:
    return {
        "environment": "production",
        "database_url": f"postgresql+psycopg://edgefleet:{STRONG}@db:5432/edgefleet",
        "mqtt_url": f"mqtts://controller:{STRONG}@broker:8883",
        "mqtt_acl": "external",
        "admin_token": STRONG,
        **kw,
    }


@pytest.mark.parametrize(
    ("override", "complaint"),
    [
        ({"admin_token": None}, "admin_token (EDGEFLEET_ADMIN_TOKEN) is not set"),
        ({"admin_token": "changeme"}, "well-known default"),
        ({"admin_token": "short-but-random-x7"}, "shorter than 32"),
        ({"admin_token": "a" * 40}, "too few distinct"),
        ({"mqtt_url": "mqtt://broker:1883"}, "anonymous"),
        ({"mqtt_url": "mqtt://controller@broker:1883"}, "MQTT password"),
        ({"mqtt_url": "mqtt://controller:password@broker:1883"}, "well-known default"),
        ({"database_url": "postgresql+psycopg://postgres:postgres@db/edgefleet"}, "database_url"),
    ],
)
def test_production_refuses_default_or_missing_secrets(override: dict[str, Any], complaint: str) -> None:
    with pytest.raises(ValidationError) as err:
        ControllerSettings(**_production(**override))
    assert complaint in str(err.value)
    assert STRONG not in err.value.errors(include_input=False)[0]["msg"]


def test_production_starts_with_strong_secrets_and_development_needs_none() -> None:
    assert ControllerSettings(**_production()).environment == "production"
    assert ControllerSettings(mqtt_url="mqtt://127.0.0.1:1883").admin_token is None


def test_the_cli_refuses_production_defaults_without_printing_secrets(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    weak_mqtt = "mqtt-pass"
    for k, v in {
        "EDGEFLEET_ENVIRONMENT": "production",
        "EDGEFLEET_DATA_DIR": str(tmp_path),
        "EDGEFLEET_DATABASE_URL": f"postgresql+psycopg://edgefleet:{STRONG}@db/edgefleet",
        "EDGEFLEET_MQTT_URL": f"mqtt://controller:{weak_mqtt}@broker:1883",
        "EDGEFLEET_ADMIN_TOKEN": "admin",
    }.items():
        monkeypatch.setenv(k, v)
    result = CliRunner().invoke(cli_app, ["controller", "--validate-config"])
    assert result.exit_code == 2
    out = result.output
    assert "production" in out and "admin_token" in out and "MQTT password" in out
    assert STRONG not in out and weak_mqtt not in out and "admin'" not in out
