"""The technician's device page in headless Chromium (Debian's /usr/bin/chromium driven by playwright;
nothing downloaded), against a real mosquitto, a controller process and an agent process running the
person detector on the real footage: each camera's latest frame with its stored detections' boxes
drawn over it, the camera table readable on a phone, and a model download as one row that updates
rather than ten rows that push the errors off the list."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from fleet_protocol import TopicKind, Topics, encode
from fleet_protocol.messages import Availability, Event, EventKind, Severity
from tests.support.browser import PHONE, FootageSite, chromium, cut_off, footage_site, horizontal_overflow
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

DEVICE = "frames-gate-1"
MODEL = "ped_ssdlite:1"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, broker: MosquittoBroker) -> Iterator[FootageSite]:
    def detecting(api: httpx.Client) -> bool:
        dev = api.get(f"/api/v1/devices/{DEVICE}").json()
        found = api.get("/api/v1/detections", params={"device": DEVICE, "limit": 1}).json()
        return dev["status"] == "online" and bool(found["items"])

    # The agent starts without the model: it downloads it in chunks, one event per 10 %.
    with footage_site(
        tmp_path_factory.mktemp("device-frames"),
        broker,
        DEVICE,
        name="Gate 1",
        labels={"site": "yard"},
        ready=detecting,
        what="agent online and its detections stored",
        timeout=120,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


def _shot(page: Any, site: FootageSite, tmp_path: Path, name: str) -> None:
    page.screenshot(path=str(tmp_path / name), full_page=True)
    shutil.copy(tmp_path / name, site.shots / name)


def test_each_camera_shows_its_latest_frame_with_the_stored_boxes_drawn(
    site: FootageSite, browser: Any, tmp_path: Path
) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(site.url(f"/devices/{DEVICE}"))
        # No click: the frame loads by itself, and boxes come once a frame with people is stored.
        page.wait_for_selector(
            'figure.frame[data-camera="cam1"][data-boxes]:not([data-boxes="0"])', timeout=60_000
        )
        shown = page.evaluate(
            """() => { const f = document.querySelector('figure.frame[data-camera="cam1"]');
                 const img = f.querySelector('img'), svg = f.querySelector('svg');
                 return { frame: f.dataset.detFrame, captured: f.dataset.detCaptured, boxes: f.dataset.boxes,
                          rects: [...svg.querySelectorAll('rect')].map((r) => ['x', 'y', 'width', 'height'].map((k) => Number(r.getAttribute(k)))),
                          labels: [...svg.querySelectorAll('g')].map((g) => g.dataset.label),
                          viewBox: svg.getAttribute('viewBox'), natural: [img.naturalWidth, img.naturalHeight],
                          shownWidth: img.getBoundingClientRect().width, svgWidth: svg.getBoundingClientRect().width }; }"""
        )
        # The real camera's frame, at its own size; the overlay covers exactly the image.
        assert shown["natural"] == [768, 576]
        assert shown["viewBox"] == "0 0 768 576"
        assert abs(shown["shownWidth"] - shown["svgWidth"]) < 1
        # One box per detection the API stored for that frame, where the detector put it.
        captured = datetime.fromisoformat(shown["captured"])
        items = site.api.get(
            "/api/v1/detections",
            params={"device": DEVICE, "camera": "cam1", "since": shown["captured"], "limit": 1000},
        ).json()["items"]
        stored = [
            d
            for d in items
            if d["frame"] == int(shown["frame"]) and datetime.fromisoformat(d["captured_at"]) == captured
        ]
        assert stored and len(shown["rects"]) == len(stored) == int(shown["boxes"])
        expected = sorted(
            [d["box"]["x0"], d["box"]["y0"], d["box"]["x1"] - d["box"]["x0"], d["box"]["y1"] - d["box"]["y0"]]
            for d in stored
        )
        drawn = [v for rect in sorted(shown["rects"]) for v in rect]
        assert drawn == pytest.approx([v for rect in expected for v in rect], abs=1e-3)
        assert sorted(shown["labels"]) == sorted(d["label"] for d in stored)
        _shot(page, site, tmp_path, "device-frames.png")
    finally:
        page.close()


def test_on_a_phone_no_camera_column_is_cut_off(site: FootageSite, browser: Any, tmp_path: Path) -> None:
    ctx = browser.new_context(**PHONE)
    page = ctx.new_page()
    try:
        page.goto(site.url(f"/devices/{DEVICE}"))
        page.wait_for_selector('#cameras tr[data-camera="cam1"] td[data-field="p99"]', timeout=15_000)
        page.wait_for_selector('figure.frame[data-camera="cam1"][data-boxes]', timeout=60_000)
        page.wait_for_selector("#events tr[data-kind]", timeout=15_000)
        assert (overflow := horizontal_overflow(page)) is None, overflow
        cells = '#cameras tr[data-camera="cam1"] td'
        assert cut_off(page, cells) == []
        assert cut_off(page, "#events td") == []
        assert cut_off(page, 'figure.frame[data-camera="cam1"]') == []
        # Each value still says which column it is: the technician reads the latency and the model.
        row = page.locator('#cameras tr[data-camera="cam1"]')
        assert row.locator('td[data-label="p99"]').is_visible()
        assert MODEL.split(":")[0] in row.locator('td[data-label="active model"]').inner_text()
        _shot(page, site, tmp_path, "phone-device-frames.png")
    finally:
        ctx.close()


def test_a_model_download_is_one_row_that_shows_how_far_it_came(site: FootageSite, browser: Any) -> None:
    reports = site.api.get(
        "/api/v1/events", params={"device": DEVICE, "kind": "model_download", "limit": 200}
    ).json()
    assert len(reports) >= 3, reports  # the agent reported its download every 10 %
    newest = reports[0]["data"]
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(site.url(f"/devices/{DEVICE}"))
        page.wait_for_selector("#events tr[data-kind]", timeout=15_000)
        rows = page.locator('#events tr[data-kind="model_download"]')
        assert rows.count() == 1
        shown = rows.locator('[data-field="download"]')
        assert shown.get_attribute("data-model") == MODEL
        assert shown.get_attribute("data-reports") == str(len(reports))
        assert float(shown.get_attribute("data-value") or "nan") == pytest.approx(newest["pct"])
    finally:
        page.close()


def test_an_error_stays_on_the_list_under_many_download_reports(
    site: FootageSite, broker: MosquittoBroker, browser: Any
) -> None:
    # A device that failed to load one model, then downloaded three others, 11 reports each (0 to
    # 100 %): 33 rows before, more than the list shows, where the failure would be cut off.
    device = "frames-downloads"
    r = site.api.post("/api/v1/devices", json={"id": device, "labels": {"site": "yard"}})
    assert r.status_code in (200, 201), r.text
    t0 = time.time() - 60
    events = [
        Event(
            seq=1,
            ts=t0,
            kind=EventKind.MODEL_FAILED,
            severity=Severity.ERROR,
            camera="cam1",
            message="ped_ssdlite:0: warm-up inference failed",
        )
    ]
    for m, model in enumerate(("ped_ssdlite:1", "nanodet_coco:1", "ped_ssdlite:2")):
        cam = f"cam{m + 1}"
        for step in range(11):
            events.append(
                Event(
                    seq=len(events) + 1,
                    ts=t0 + 1 + m * 11 + step,
                    kind=EventKind.MODEL_DOWNLOAD,
                    camera=cam,
                    message=f"{model}: {step * 10} %",
                    data={"model": model, "pct": float(step * 10)},
                )
            )
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="frames-downloads")
    client.connect(broker.host, broker.port)
    client.loop_start()
    topics = Topics()
    try:
        birth = Availability(state="online", ts=time.time())
        client.publish(
            topics.device(device, TopicKind.AVAILABILITY), encode(birth), qos=1, retain=True
        ).wait_for_publish(5)
        for e in events:
            client.publish(topics.device(device, TopicKind.EVENTS), encode(e), qos=1).wait_for_publish(5)
    finally:
        client.loop_stop()
        client.disconnect()
    wait_for(
        lambda: (
            len(site.api.get("/api/v1/events", params={"device": device, "limit": 200}).json()) == len(events)
        ),
        timeout=15,
        what="the controller stored every event",
    )
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(site.url(f"/devices/{device}"))
        page.wait_for_selector("#events tr[data-kind]", timeout=15_000)
        downloads = page.locator('#events tr[data-kind="model_download"] [data-field="download"]')
        assert downloads.count() == 3
        for i in range(3):
            assert downloads.nth(i).get_attribute("data-reports") == "11"
            assert downloads.nth(i).get_attribute("data-value") == "100"
        failed = page.locator('#events tr[data-kind="model_failed"][data-severity="error"]')
        assert failed.count() == 1 and "warm-up inference failed" in failed.inner_text()
    finally:
        page.close()
