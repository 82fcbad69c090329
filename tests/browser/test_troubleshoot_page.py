"""The technician page's troubleshooting in headless Chromium (Debian's /usr/bin/chromium driven by
playwright), against a real mosquitto, a controller process and an agent process with one camera on the
real footage and one on an RTSP address where nothing answers: an operator reads the device's log
(narrowed by level), its diagnostics with the clock offset, and probes both cameras; a device that is
offline is said to be so in words; a viewer is shown none of it. The header shows the device's clock
offset from its heartbeats."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from fleet_protocol import TopicKind, Topics, encode
from fleet_protocol.messages import Availability, Heartbeat
from tests.support.browser import PHONE, chromium, cut_off, desktop_page, horizontal_overflow, script_errors
from tests.support.dynsec import Device
from tests.support.mqtt_broker import MosquittoBroker, free_port
from tests.support.paths import FOOTAGE
from tests.support.stack import Stack
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

DEVICE = "ts-gate-1"
# Enrolled, never online: every ask of it is refused with 409.
OFFLINE = "ts-gate-2"
# Its heartbeats say its clock runs this far ahead of the controller's (default threshold: 2 s).
AHEAD = "ts-gate-3"
AHEAD_S = 30.0
DEAD_OPEN_TIMEOUT_S = 2.0
# What the page asks the device to bound a probe by (troubleshoot.js); the API adds its command timeout.
PAGE_PROBE_TIMEOUT_S = 10


@dataclass
class Site:
    stack: Stack
    operator: str
    viewer: str

    def url(self, path: str, token: str) -> str:
        return f"{self.stack.controller.url}{path}#token={token}"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, broker: MosquittoBroker) -> Iterator[Site]:
    s = Stack(tmp_path_factory.mktemp("troubleshoot-page"), broker).start()
    try:
        s.enrol(DEVICE)
        s.enrol(OFFLINE)
        # No model: logs, diagnostics and probes ask the agent and its cameras, not a detector.
        s.agent(
            DEVICE,
            cameras=[
                {"id": "cam1", "source": str(FOOTAGE), "loop": True},
                {
                    "id": "gate",
                    "source": f"rtsp://127.0.0.1:{free_port()}/x",
                    "open_timeout_s": DEAD_OPEN_TIMEOUT_S,
                    "reconnect_max_s": 2,
                },
            ],
        ).start()

        def reporting() -> bool:
            s.alive()
            d = s.device(DEVICE)
            cams = {c["camera"] for c in d["cameras"]}
            return d["status"] == "online" and d["clock_offset_s"] is not None and {"cam1", "gate"} <= cams

        wait_for(reporting, timeout=60, what=f"{DEVICE} online with both cameras and a clock offset")
        operator = s.call("POST", "/api/v1/tokens", json={"name": "tech", "role": "operator"})["token"]
        viewer = s.call("POST", "/api/v1/tokens", json={"name": "wall", "role": "viewer"})["token"]
        yield Site(s, operator, viewer)
    finally:
        s.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    with desktop_page(browser) as p:
        yield p


def _levels(page: Any) -> list[str]:
    levels: list[str] = page.eval_on_selector_all(
        "#ts-logs-out .logline", "ns => ns.map(n => n.dataset.level)"
    )
    return levels


def test_an_operator_reads_the_log_diagnoses_and_probes_from_the_page(site: Site, page: Any) -> None:
    errors = script_errors(page)
    page.goto(site.url(f"/devices/{DEVICE}", site.operator))
    # The header's clock: same machine, same clock, so a small offset and no flag.
    page.wait_for_selector("#clock[data-off]", timeout=15_000)
    assert page.get_attribute("#clock", "data-off") == "false"
    assert page.inner_text("#clock-offset").endswith(" s")

    # The log at info and above, then narrowed to warnings: the dead camera's failures are there.
    page.select_option("#ts-level", "info")
    page.click("#ts-logs")
    page.wait_for_selector('#ts-logs-out[data-state="done"][data-level="info"]', timeout=20_000)
    info = _levels(page)
    assert "info" in info and "warning" in info, info
    assert "gate" in page.inner_text("#ts-logs-out")
    page.select_option("#ts-level", "warning")
    page.click("#ts-logs")
    page.wait_for_selector('#ts-logs-out[data-state="done"][data-level="warning"]', timeout=20_000)
    warnings = _levels(page)
    assert warnings and set(warnings) <= {"warning", "error", "critical"}, warnings
    # The newest line is at the bottom, in view.
    assert page.evaluate(
        """() => { const l = document.querySelector('#ts-logs-out .loglines');
                   return l.scrollHeight - l.scrollTop - l.clientHeight < 2; }"""
    )

    # The bundle's key facts, and the clock measured by the command's four times.
    page.click("#ts-diagnose")
    page.wait_for_selector('#ts-diagnose-out[data-state="done"]', timeout=20_000)
    version = site.stack.device(DEVICE)["agent_version"]
    assert version and version in page.inner_text('#ts-diagnose-out [data-field="agent-version"]')
    assert "CPUExecutionProvider" in page.inner_text('#ts-diagnose-out [data-field="providers"]')
    assert page.inner_text('#ts-diagnose-out [data-field="uplink"]').endswith("connected")
    clock = page.locator('#ts-diagnose-out [data-field="clock"]')
    assert clock.get_attribute("data-off") == "false" and "round trip" in clock.inner_text()

    # The footage opens at its size; the dead camera's error comes within its bound.
    page.click('.probe-btn[data-camera="cam1"]')
    page.wait_for_selector('.probe-out[data-camera="cam1"][data-state="done"]', timeout=30_000)
    assert page.get_attribute('.probe-out[data-camera="cam1"]', "data-ok") == "true"
    assert "768x576" in page.inner_text('.probe-out[data-camera="cam1"]')
    started = time.monotonic()
    page.click('.probe-btn[data-camera="gate"]')
    page.wait_for_selector(
        '.probe-out[data-camera="gate"][data-state="done"]', timeout=(PAGE_PROBE_TIMEOUT_S + 10) * 1000
    )
    assert time.monotonic() - started < PAGE_PROBE_TIMEOUT_S + 10
    gate = page.locator('.probe-out[data-camera="gate"]')
    assert gate.get_attribute("data-ok") == "false"
    assert "no frame after" in gate.inner_text() and "127.0.0.1" in gate.inner_text(), gate.inner_text()
    assert errors == []


def test_on_a_phone_the_log_and_the_probes_fit_the_screen(site: Site, browser: Any) -> None:
    ctx = browser.new_context(**PHONE)
    page = ctx.new_page()
    try:
        page.goto(site.url(f"/devices/{DEVICE}", site.operator))
        page.click("#ts-logs")
        page.wait_for_selector('#ts-logs-out[data-state="done"]', timeout=20_000)
        page.click("#ts-diagnose")
        page.wait_for_selector('#ts-diagnose-out[data-state="done"]', timeout=20_000)
        page.click('.probe-btn[data-camera="cam1"]')
        page.wait_for_selector('.probe-out[data-camera="cam1"][data-state="done"]', timeout=30_000)
        assert (overflow := horizontal_overflow(page)) is None, overflow
        assert page.locator("#ts-logs-out .logline").count() > 0
        assert cut_off(page, "#ts-logs-out .logline span") == []
        assert cut_off(page, "#ts-diagnose-out .kv > div") == []
        assert cut_off(page, ".probe") == []
    finally:
        ctx.close()


def test_asking_an_offline_device_says_so_in_words(site: Site, page: Any) -> None:
    errors = script_errors(page)
    page.goto(site.url(f"/devices/{OFFLINE}", site.operator))
    page.wait_for_selector("#ts-diagnose", timeout=15_000)
    page.click("#ts-diagnose")
    page.wait_for_selector('#ts-diagnose-out[data-state="error"]', timeout=15_000)
    assert page.get_attribute("#ts-diagnose-out", "data-status") == "409"
    assert "the device is offline" in page.inner_text("#ts-diagnose-out")
    # Nothing heard from it, so no clock estimate either.
    assert page.inner_text("#clock-offset") == "not measured"
    assert errors == []


def test_a_viewer_sees_the_device_and_no_troubleshooting_buttons(site: Site, page: Any) -> None:
    page.goto(site.url(f"/devices/{DEVICE}", site.viewer))
    page.wait_for_selector("body[data-troubleshoot]", timeout=15_000)
    page.wait_for_selector('figure.frame[data-camera="cam1"]', timeout=15_000)
    assert page.get_attribute("body", "data-troubleshoot") == "no"
    assert page.locator("#ts-logs, #ts-diagnose, .probe-btn").count() == 0
    # The page itself still serves the viewer: the device and its clock.
    assert page.inner_text("#clock-offset").endswith(" s")


def test_a_device_whose_clock_is_off_is_flagged_in_the_header(
    site: Site, broker: MosquittoBroker, page: Any
) -> None:
    site.stack.enrol(AHEAD)
    topics = Topics()
    dev = Device(broker, None, None, client_id=AHEAD)
    assert dev.connect() == 0
    try:
        now = time.time()
        dev.publish(
            topics.device(AHEAD, TopicKind.AVAILABILITY),
            encode(Availability(state="online", ts=now + AHEAD_S)),
            retain=True,
        )
        dev.publish(topics.device(AHEAD, TopicKind.HEARTBEAT), encode(Heartbeat(ts=now + AHEAD_S)))
        wait_for(
            lambda: site.stack.device(AHEAD)["clock_off"], timeout=15, what="the controller flags the clock"
        )
        page.goto(site.url(f"/devices/{AHEAD}", site.viewer))
        page.wait_for_selector('#clock[data-off="true"]', timeout=15_000)
        assert "clock-off" in (page.get_attribute("#clock", "class") or "")
        shown = page.inner_text("#clock-offset")
        # The heartbeat's ts less its way here: AHEAD_S ahead less a delivery delay (a loaded machine
        # shows +29.9 s).
        assert shown.startswith("+") and "off" in shown, shown
        assert AHEAD_S - 5 < float(shown.split()[0]) <= AHEAD_S, shown
    finally:
        dev.publish(topics.device(AHEAD, TopicKind.AVAILABILITY), b"", retain=True)
        dev.close()
