"""The dashboard in headless Chromium (Debian's /usr/bin/chromium driven by playwright; nothing downloaded),
against a real mosquitto, a controller process and an agent process running the person detector on the
real footage. Also the snapshot API on that real agent."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cv2
import httpx
import numpy as np
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from fleet_protocol import TopicKind, Topics, encode
from fleet_protocol.messages import Availability, CameraReported, ReportedState
from tests.support.browser import PHONE, FootageSite, chromium, footage_site, horizontal_overflow
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

DEVICE = "web-site-1"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, broker: MosquittoBroker) -> Iterator[FootageSite]:
    def running(api: httpx.Client) -> bool:
        dev = api.get(f"/api/v1/devices/{DEVICE}").json()
        return dev["status"] == "online" and any((c.get("fps") or 0) > 0 for c in dev["cameras"])

    with footage_site(
        tmp_path_factory.mktemp("dashboard"),
        broker,
        DEVICE,
        name="Gate 1",
        labels={"site": "north-gate"},
        ready=running,
        what="agent online with the camera running",
        # Every heartbeat kept as a health sample: the page shows the latest heartbeat, and the tests
        # look that very heartbeat up in the history to compare what the page shows with what the API has.
        EDGEFLEET_HEALTH_SAMPLE_INTERVAL_S="0",
    ) as site:
        yield site


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


def test_snapshot_of_the_real_camera_is_a_jpeg_of_the_footage_size(fleet: FootageSite) -> None:
    r = fleet.api.get(f"/api/v1/devices/{DEVICE}/cameras/cam1/snapshot", params={"boxes": "true"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "image/jpeg"
    img = cv2.imdecode(np.frombuffer(r.content, np.uint8), cv2.IMREAD_COLOR)
    assert img is not None and img.shape[:2] == (576, 768)
    r = fleet.api.get(f"/api/v1/devices/{DEVICE}/cameras/nope/snapshot")
    assert r.status_code == 404 and "unknown camera" in r.json()["detail"]


def test_overview_lists_the_device_online_and_live_detections_arrive(
    fleet: FootageSite, browser: Any, tmp_path: Path
) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(f"{fleet.controller.url}/#token={fleet.controller.token}")
        row = page.locator(f'tr[data-device="{DEVICE}"]')
        row.wait_for(timeout=15_000)
        page.wait_for_selector(f'tr[data-device="{DEVICE}"][data-status="online"]', timeout=15_000)
        # Other tests of this module may add devices of other sites: north-gate is one of the groups.
        assert any("north-gate" in t for t in page.locator(".site h3").all_inner_texts())
        assert "ped_ssdlite" in row.inner_text()
        # No pool in this fleet: the overview keeps no empty "Camera pools" box.
        page.wait_for_selector('#pools-section[data-pools="0"]', state="attached", timeout=15_000)
        assert page.locator("#pools-section").is_hidden()
        page.wait_for_selector('#feed li.det[data-label="person"]', timeout=30_000)
        assert page.locator("#feed-state").text_content() == "live"
        page.wait_for_timeout(1500)  # a few more detections and one chart redraw for the screenshot
        page.screenshot(path=str(tmp_path / "overview.png"), full_page=True)
        _keep(tmp_path / "overview.png", fleet)
    finally:
        page.close()


def test_device_page_matches_the_api_and_the_snapshot_button_shows_an_image(
    fleet: FootageSite, browser: Any, tmp_path: Path
) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(f"{fleet.controller.url}/devices/{DEVICE}#token={fleet.controller.token}")
        page.wait_for_selector('#status[data-status="online"]', timeout=15_000)
        page.wait_for_selector('#cpu[data-hb-ts]:not([data-hb-ts=""])', timeout=15_000)
        # The seq space the agent sends in (its outbox's incarnation), as the API has it.
        shown_incarnation = page.locator("#incarnation").get_attribute("data-incarnation")
        api_incarnation = fleet.api.get(f"/api/v1/devices/{DEVICE}").json()["incarnation"]
        assert shown_incarnation and shown_incarnation == api_incarnation
        # The values shown belong to one heartbeat; the same heartbeat through the API must agree.
        shown = page.evaluate(
            """() => Object.fromEntries(['cpu', 'memory', 'disk'].map(
                 (k) => [k, [document.getElementById(k).dataset.value, document.getElementById(k).dataset.hbTs,
                             document.getElementById(k).innerText]]))"""
        )
        hb_ts = float(shown["cpu"][1])
        samples = fleet.api.get(f"/api/v1/devices/{DEVICE}/health", params={"limit": 200}).json()
        (payload,) = [s["payload"] for s in samples if s["payload"]["ts"] == hb_ts]
        for key, field in (("cpu", "cpu_pct"), ("memory", "memory_pct"), ("disk", "disk_pct")):
            value, ts, text = shown[key]
            assert float(ts) == hb_ts
            assert float(value) == payload[field], (key, value, payload[field])
            assert text == f"{payload[field]:.1f} %"
        cam = page.locator('#cameras tr[data-camera="cam1"]')
        assert "up" in cam.inner_text() and "ped_ssdlite" in cam.inner_text()
        # The p99 beside the median: the agent reports one once it has run inferences; the cell says
        # which heartbeat it shows, and that heartbeat through the API must agree.
        p99_cell = '#cameras tr[data-camera="cam1"] td[data-field="p99"]'
        page.wait_for_selector(f'{p99_cell}[data-value]:not([data-value=""])', timeout=15_000)
        value, ts, text = page.evaluate(
            f"""() => {{ const c = document.querySelector('{p99_cell}');
                 return [c.dataset.value, c.dataset.hbTs, c.innerText]; }}"""
        )
        samples = fleet.api.get(f"/api/v1/devices/{DEVICE}/health", params={"limit": 200}).json()
        (payload,) = [s["payload"] for s in samples if s["payload"]["ts"] == float(ts)]
        (stats,) = [c for c in payload["cameras"] if c["camera"] == "cam1"]
        assert stats["inference_p99_ms"] is not None and float(value) == stats["inference_p99_ms"]
        # Compared as numbers: JS and Python round an exact tie (41.25) differently.
        assert text.endswith(" ms") and abs(float(text[:-3]) - stats["inference_p99_ms"]) <= 0.05 + 1e-9
        gpus_text = page.locator("#gpus").inner_text()
        if payload.get("gpus"):  # a GPU host (NVML): the panel shows what the heartbeat reported
            assert "no GPU reported" not in gpus_text
            assert page.locator("#gpus tr[data-gpu]").count() == len(payload["gpus"])
        else:  # no GPU here: said, not invented
            assert "not measured" in gpus_text
        page.wait_for_selector("#events tr[data-kind]", timeout=15_000)

        page.locator('button.snap[data-camera="cam1"]').click()
        page.wait_for_function(
            "() => { const i = document.getElementById('snapshot-img'); return i && i.complete && i.naturalWidth > 0; }",
            timeout=30_000,
        )
        assert page.evaluate("document.getElementById('snapshot-img').naturalWidth") == 768
        page.wait_for_timeout(300)
        page.screenshot(path=str(tmp_path / "device.png"), full_page=True)
        _keep(tmp_path / "device.png", fleet)
    finally:
        page.close()


def test_device_page_shows_how_far_a_model_on_its_way_has_come(
    fleet: FootageSite, broker: MosquittoBroker, browser: Any
) -> None:
    # A second device that says, as an agent does while its TensorRT engine builds, that cam1 is
    # loading a model at 40 %: the technician's page shows the state and how far it has come.
    device = "web-site-building"
    r = fleet.api.post(
        "/api/v1/devices", json={"id": device, "name": "Gate 2", "labels": {"site": "south-yard"}}
    )
    assert r.status_code in (200, 201), r.text
    rep = ReportedState(
        ts=time.time(),
        desired_version=0,
        cameras={"cam1": CameraReported(model="ped_ssdlite:1", state="loading", progress_pct=40.0)},
    )
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="dashboard-test-building")
    client.connect(broker.host, broker.port)
    client.loop_start()
    try:
        for kind, msg in (
            (TopicKind.AVAILABILITY, Availability(state="online", ts=time.time())),
            (TopicKind.TWIN_REPORTED, rep),
        ):
            client.publish(Topics().device(device, kind), encode(msg), qos=1, retain=True).wait_for_publish(5)
    finally:
        client.loop_stop()
        client.disconnect()
    wait_for(
        lambda: (fleet.api.get(f"/api/v1/devices/{device}").json().get("models") or {}).get("cam1"),
        timeout=15,
        what="the controller stored the reported state",
    )
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(f"{fleet.controller.url}/devices/{device}#token={fleet.controller.token}")
        shown = page.locator('#cameras tr[data-camera="cam1"] [data-field="progress"]')
        shown.wait_for(timeout=15_000)
        assert shown.get_attribute("data-value") == "40"
        row = page.locator('#cameras tr[data-camera="cam1"]').inner_text()
        assert "loading" in row and "40%" in row
    finally:
        page.close()


@pytest.mark.parametrize("path", ["/", f"/devices/{DEVICE}"])
def test_phone_viewport_has_no_horizontal_overflow(
    fleet: FootageSite, browser: Any, tmp_path: Path, path: str
) -> None:
    ctx = browser.new_context(**PHONE)
    page = ctx.new_page()
    try:
        page.goto(f"{fleet.controller.url}{path}#token={fleet.controller.token}")
        if path == "/":
            page.wait_for_selector(f'tr[data-device="{DEVICE}"]', timeout=15_000)
        else:
            page.wait_for_selector('#cameras tr[data-camera="cam1"]', timeout=15_000)
        page.wait_for_timeout(500)
        assert (overflow := horizontal_overflow(page)) is None, f"{path}: {overflow}"
        name = "phone-overview.png" if path == "/" else "phone-device.png"
        page.screenshot(path=str(tmp_path / name), full_page=True)
        _keep(tmp_path / name, fleet)
    finally:
        ctx.close()


def test_without_a_token_the_dashboard_asks_for_one_and_keeps_it_out_of_the_url(
    fleet: FootageSite, browser: Any, tmp_path: Path
) -> None:
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    page = ctx.new_page()
    try:
        page.goto(f"{fleet.controller.url}/")
        prompt = page.locator("#token-prompt")
        prompt.wait_for(timeout=15_000)
        assert "API token is needed" in prompt.inner_text()
        assert page.locator(f'tr[data-device="{DEVICE}"]').count() == 0
        page.screenshot(path=str(tmp_path / "token-prompt.png"), full_page=True)
        _keep(tmp_path / "token-prompt.png", fleet)
        # Pasted once, kept in this browser: the page reloads and shows the fleet, live feed included.
        page.fill("#token-input", fleet.controller.token)
        page.click("#token-save")
        page.wait_for_selector(f'tr[data-device="{DEVICE}"][data-status="online"]', timeout=15_000)
        page.wait_for_selector('#feed li.det[data-label="person"]', timeout=30_000)
        assert page.locator("#token-prompt").count() == 0
        # A token given in the fragment replaces it and leaves the address bar at once.
        page.goto(f"{fleet.controller.url}/devices/{DEVICE}#token=not-a-token")
        page.locator("#token-prompt").wait_for(timeout=15_000)
        assert "refused" in page.locator("#token-prompt").inner_text()
        assert "#" not in page.url and "not-a-token" not in page.url
    finally:
        ctx.close()


def _keep(shot: Path, fleet: FootageSite) -> None:
    """Screenshots also land next to the fleet's logs, one folder to look at after a run."""
    shutil.copy(shot, fleet.shots / shot.name)
