"""API tokens through the real pieces: the ``edgefleet tokens`` CLI against a controller process, the
live WebSocket with a token in its query string, and uvicorn's own logs, which must not show a token."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from websockets.sync.client import connect as ws_connect

from tests.support.mqtt_broker import MosquittoBroker
from tests.support.processes import ControllerProcess

pytestmark = pytest.mark.integration


def _cli(
    controller: ControllerProcess, cwd: Path, *args: str, token: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("EDGEFLEET_TOKEN", "EDGEFLEET_DATA_DIR")}
    base.update({"EDGEFLEET_API_URL": controller.url, "COLUMNS": "200", **env})
    if token is not None:
        base["EDGEFLEET_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "controller", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=base,
    )


def test_tokens_cli_roles_and_uvicorn_logs_without_secrets(tmp_path: Path, broker: MosquittoBroker) -> None:
    controller = ControllerProcess(tmp_path, broker.url)
    controller.start()
    try:
        made = _cli(controller, tmp_path, "tokens", "create", "--role", "viewer", "--name", "tech-anna",
                    token=controller.token)  # fmt: skip
        assert made.returncode == 0, made.stderr
        viewer = made.stdout.strip()
        assert viewer.startswith("eft_") and "shown this once" in made.stderr

        listed = _cli(controller, tmp_path, "tokens", "ls", token=controller.token)
        assert listed.returncode == 0, listed.stderr
        assert "tech-anna" in listed.stdout and viewer[:12] in listed.stdout and viewer not in listed.stdout

        assert _cli(controller, tmp_path, "devices", "ls", token=viewer).returncode == 0
        refused = _cli(controller, tmp_path, "--token", viewer, "tokens", "ls")
        assert refused.returncode == 1 and "403" in refused.stderr and "admin role" in refused.stderr
        anonymous = _cli(controller, tmp_path, "devices", "ls")
        assert (
            anonymous.returncode == 1 and "401" in anonymous.stderr and "EDGEFLEET_TOKEN" in anonymous.stderr
        )

        # The live WebSocket with the token in the query (tools) and as a subprotocol (browsers).
        ws_url = controller.url.replace("http://", "ws://") + "/api/v1/detections/live"
        with ws_connect(f"{ws_url}?label=person&token={viewer}", open_timeout=10) as ws:
            assert json.loads(ws.recv(timeout=10))["type"] == "hello"
        proto = "bearer." + base64.urlsafe_b64encode(viewer.encode()).decode().rstrip("=")
        with ws_connect(ws_url, subprotocols=["edgefleet", proto], open_timeout=10) as ws:  # type: ignore[list-item]
            assert ws.subprotocol == "edgefleet"
            assert json.loads(ws.recv(timeout=10))["type"] == "hello"
        with pytest.raises(Exception, match="401"):
            ws_connect(f"{ws_url}?token=not-a-token", open_timeout=10)

        token_id = next(
            line.split()[1] for line in listed.stdout.splitlines() if "tech-anna" in line
        )  # the table row: │ id │ name │ …
        revoked = _cli(controller, tmp_path, "tokens", "revoke", token_id, token=controller.token)
        assert revoked.returncode == 0, revoked.stderr
        after = _cli(controller, tmp_path, "devices", "ls", token=viewer)
        assert after.returncode == 1 and "401" in after.stderr
    finally:
        controller.stop()
    log = controller.log.read_text()
    assert "/api/v1/detections/live?label=person&token=***" in log  # uvicorn logged the path, redacted
    for secret in (viewer, controller.token):
        assert secret not in log


def test_without_a_configured_token_the_cli_uses_the_admin_token_file_next_to_it(
    tmp_path: Path, broker: MosquittoBroker
) -> None:
    controller = ControllerProcess(tmp_path, broker.url, EDGEFLEET_ADMIN_TOKEN="")
    controller.start()
    try:
        token_file = tmp_path / "controller" / "admin.token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        data_dir = str(tmp_path / "controller")
        made = _cli(controller, tmp_path, "tokens", "create", "--role", "operator", "--name", "ci",
                    EDGEFLEET_DATA_DIR=data_dir)  # fmt: skip
        assert made.returncode == 0, made.stderr
        assert token_file.read_text().strip() not in controller.log.read_text()
    finally:
        controller.stop()
