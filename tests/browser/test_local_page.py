"""The agent's local status page in headless Chromium (Debian's /usr/bin/chromium driven by playwright),
served by a real agent process on the real footage with its own mosquitto: the page asks for the
device-local token, then shows the uplink connected, the camera and its current picture; with the broker
stopped it says the uplink is not connected and why in words. A wrong token is refused."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.browser import PHONE, chromium, horizontal_overflow
from tests.support.mqtt_broker import MosquittoBroker, free_port
from tests.support.paths import FOOTAGE
from tests.support.processes import AgentProcess
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

DEVICE = "local-page-1"
TOKEN = "site-technician-token-0123456789"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MosquittoBroker, AgentProcess, str]]:
    work = tmp_path_factory.mktemp("local-page")
    token_file = work / "local.token"
    token_file.write_text(TOKEN + "\n")
    os.chmod(token_file, 0o600)
    broker = MosquittoBroker(work / "broker")
    broker.start()
    port = free_port()
    agent = AgentProcess(
        work,
        DEVICE,
        broker.url,
        cameras=[{"id": "cam1", "source": str(FOOTAGE), "loop": True}],
        local_page={"enabled": True, "port": port, "token_file": str(token_file)},
    )
    agent.start()
    url = f"http://127.0.0.1:{port}"
    try:
        yield broker, agent, url
    finally:
        agent.stop()
        broker.stop()


def status(url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/api/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    r.raise_for_status()
    doc: dict[str, Any] = r.json()
    return doc


def test_the_local_page_shows_the_device_with_and_without_its_broker(
    site: tuple[MosquittoBroker, AgentProcess, str],
) -> None:
    broker, _, url = site

    def serving() -> bool:
        try:
            return bool(status(url)["uplink"]["connected"])
        except httpx.HTTPError:
            return False

    wait_for(serving, timeout=60, what="the local page up and the agent connected")
    wrong = httpx.get(f"{url}/api/status", headers={"Authorization": "Bearer not-the-token"}, timeout=5)
    assert wrong.status_code == 401

    with chromium() as browser:
        page = browser.new_page(**PHONE)
        page.goto(url + "/")
        # No token yet: the page asks for it and shows nothing of the device.
        page.wait_for_selector("#token", state="visible")
        assert page.locator("#status").is_hidden()
        page.fill("#token", "a-wrong-token-of-some-length")
        page.click("button[type=submit]")
        page.wait_for_selector("#login-error:has-text('Wrong token')")

        page.fill("#token", TOKEN)
        page.click("button[type=submit]")
        page.wait_for_selector("#uplink-state.ok:has-text('connected')")
        cam = page.locator('.cam[data-cam="cam1"]')
        cam.locator(".cam-state.ok").wait_for()
        assert "up" in cam.locator(".cam-state").inner_text()
        page.wait_for_function(
            "() => { const i = document.querySelector('.cam[data-cam=\"cam1\"] img');"
            " return i && i.complete && i.naturalWidth > 0; }",
            timeout=30_000,
        )
        assert horizontal_overflow(page) is None

        broker.stop()
        # The broker gone, the page says so, and why, in words (the link's own last error).
        page.wait_for_selector("#uplink-state.bad:has-text('not connected')", timeout=60_000)
        page.wait_for_function(
            "() => document.getElementById('uplink-error').textContent.length > 0", timeout=60_000
        )
        said = page.locator("#uplink-error").inner_text()
        assert said == status(url)["uplink"]["last_error"]
        assert "refused" in said.lower() or "unreachable" in said.lower() or "lost" in said.lower(), said
        # The camera runs on meanwhile, its picture still served.
        assert "up" in cam.locator(".cam-state").inner_text()
