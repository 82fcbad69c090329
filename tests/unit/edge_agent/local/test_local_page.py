"""The local page's status document and API: what a technician reads with the uplink down, behind the
device-local token (the parts it reads are hand-written stand-ins, the outbox a real one)."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from edge_agent.core.settings import LocalPageConfig
from edge_agent.local.server import LocalPage, TokenError, load_or_create_token, open_local_page
from edge_agent.local.status import StatusParts, StatusReader, status_document
from edge_agent.uplink.outbox import Outbox
from fleet_protocol.messages import AgentReported, CameraReported, CameraState, CameraStats, ReportedState
from tests.support.mqtt_broker import free_port

TOKEN = "a-local-token-of-enough-length"
TLS_ERROR = "TLS: certificate of broker.example not trusted (self-signed certificate in certificate chain)"


class Link:
    connected = False
    last_error = TLS_ERROR
    connect_errors = [(1.0, "broker refused: bad user name or password"), (2.0, TLS_ERROR)]


class Pipeline:
    def stats(self) -> list[CameraStats]:
        return [
            CameraStats(camera="gate", state=CameraState.UP, fps=9.96, frames=120, model="ped:1"),
            CameraStats(camera="yard", state=CameraState.DOWN),
        ]

    def watchdog_status(self) -> dict[str, Any]:
        return {"failed": False, "restarts": 0}


class Twin:
    def reported_state(self) -> ReportedState:
        return ReportedState(
            ts=0.0,
            desired_version=3,
            cameras={
                "gate": CameraReported(model="ped:1", state="running"),
                "yard": CameraReported(model="ped:2", state="fetching", progress_pct=42.0),
            },
        )


class Health:
    def system(self) -> dict[str, Any]:
        return {"uptime_s": 5.0, "cpu_pct": 12.5, "disk_free_mb": 2048.0, "disk_pct": 40.0, "gpus": []}


class Updater:
    def reported(self) -> AgentReported:
        return AgentReported(version="1.2.3", slot="a")


@pytest.fixture
def outbox(tmp_path: Path) -> Iterator[Outbox]:
    box = Outbox(tmp_path / "outbox.db")
    yield box
    box.close()


def parts(outbox: Outbox) -> StatusParts:
    return StatusParts(
        device_id="dev-1",
        link=Link(),
        outbox=outbox,
        pipeline=Pipeline(),
        twin=Twin(),
        health=Health(),
        updater=Updater(),
        camera_errors=lambda: {"gate": None, "yard": "cannot open rtsp://***@10.0.0.9/stream"},
        slot_state=lambda: {"current": {"version": "1.2.3", "slot": "a"}},
    )


def test_the_status_document_says_what_is_wrong_in_words(outbox: Outbox) -> None:
    outbox.append("events", lambda seq: b"x", now=time.time() - 90)
    outbox.append("events", lambda seq: b"y", now=time.time() - 10)
    doc = status_document(parts(outbox), time.time())

    assert doc["uplink"]["connected"] is False
    assert doc["uplink"]["last_error"] == TLS_ERROR
    assert [e["error"] for e in doc["uplink"]["connect_errors"]] == [
        "broker refused: bad user name or password",
        TLS_ERROR,
    ]
    assert doc["outbox"]["pending"] == 2 and 89 <= doc["outbox"]["oldest_pending_age_s"] <= 100
    gate, yard = doc["cameras"]
    assert (gate["id"], gate["state"], gate["fps"], gate["model_state"]) == ("gate", "up", 10.0, "running")
    assert (yard["state"], yard["last_error"]) == ("down", "cannot open rtsp://***@10.0.0.9/stream")
    assert (yard["model"], yard["model_state"], yard["progress_pct"]) == ("ped:2", "fetching", 42.0)
    assert doc["system"]["disk_free_mb"] == 2048.0 and doc["system"]["cpu_pct"] == 12.5
    assert doc["update"]["version"] == "1.2.3" and doc["slots"]["current"]["slot"] == "a"
    assert doc["watchdog"]["failed"] is False


def test_an_empty_outbox_has_no_oldest_age(outbox: Outbox) -> None:
    assert status_document(parts(outbox), time.time())["outbox"] == {
        "pending": 0,
        "oldest_pending_age_s": None,
        "dropped": 0,
    }


@pytest.fixture
def served(outbox: Outbox) -> Iterator[tuple[str, LocalPage]]:
    frame = np.full((48, 64, 3), 128, np.uint8)
    cfg = LocalPageConfig(port=free_port())
    page = LocalPage(
        cfg,
        token=TOKEN,
        status=StatusReader(parts(outbox)),
        frame_of=lambda c: frame if c == "gate" else None,
    )
    assert page.start()
    yield f"http://127.0.0.1:{cfg.port}", page
    page.close()


def test_every_api_call_needs_the_token_and_the_page_does_not(served: tuple[str, LocalPage]) -> None:
    url, _ = served
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and "Device token" in page.text
    for path in ("/api/status", "/api/cameras/gate/snapshot.jpg"):
        assert httpx.get(url + path).status_code == 401
        assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = httpx.get(f"{url}/api/status", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and r.json()["uplink"]["last_error"] == TLS_ERROR
    assert r.headers["cache-control"] == "no-store"


def test_a_snapshot_is_a_jpeg_and_a_camera_without_a_frame_a_clear_404(served: tuple[str, LocalPage]) -> None:
    url, _ = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.get(f"{url}/api/cameras/gate/snapshot.jpg", headers=auth)
    assert (
        r.status_code == 200
        and r.content.startswith(b"\xff\xd8")
        and r.headers["content-type"] == "image/jpeg"
    )
    r = httpx.get(f"{url}/api/cameras/yard/snapshot.jpg", headers=auth)
    assert r.status_code == 404 and "no frame" in r.json()["error"]
    assert httpx.get(f"{url}/api/cameras/../../etc/passwd", headers=auth).status_code == 404
    assert httpx.post(f"{url}/api/status", headers=auth).status_code == 405


def test_a_taken_port_leaves_the_agent_running_without_the_page(
    served: tuple[str, LocalPage], outbox: Outbox, tmp_path: Path
) -> None:
    _, first = served
    assert first.address is not None
    cfg = LocalPageConfig(port=first.address[1])
    assert open_local_page(cfg, tmp_path, status=StatusReader(parts(outbox)), frame_of=lambda c: None) is None


def test_the_token_is_generated_once_owner_only_and_a_shared_one_refused(tmp_path: Path) -> None:
    token = load_or_create_token(LocalPageConfig(), tmp_path)
    path = tmp_path / "local_page.token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_token(LocalPageConfig(), tmp_path) == token  # kept across starts
    given = tmp_path / "given.token"
    given.write_text("short\n")
    os.chmod(given, 0o600)
    with pytest.raises(TokenError, match="at least 16"):
        load_or_create_token(LocalPageConfig(token_file=given), tmp_path)
    given.write_text(TOKEN + "\n")
    os.chmod(given, 0o644)
    with pytest.raises(TokenError, match="chmod 600"):
        load_or_create_token(LocalPageConfig(token_file=given), tmp_path)
    os.chmod(given, 0o600)
    assert load_or_create_token(LocalPageConfig(token_file=given), tmp_path) == TOKEN
