"""Headless Chromium for the dashboard's browser tests: Debian's /usr/bin/chromium driven by playwright,
nothing downloaded. A test module wraps :func:`chromium` in a module fixture of its own, and
:func:`footage_site` (a controller and one agent on the real footage) in another where its pages need
a real agent."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import httpx
import pytest

from tests.support.mqtt_broker import MosquittoBroker
from tests.support.processes import HEARTBEAT_TIMEOUT_S, ControllerProcess
from tests.support.stack import Stack
from tests.support.waiting import wait_for

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# What the phone-size tests open the pages at (an iPhone 12-14 in CSS pixels).
PHONE = {"viewport": {"width": 390, "height": 844}, "device_scale_factor": 2, "is_mobile": True}
# What the other tests open them at: a laptop's screen.
DESKTOP = {"width": 1280, "height": 900}


def browser_missing(why: str) -> NoReturn:
    """Skip, or fail where a browser is required: tests/run.sh sets EDGEFLEET_REQUIRE_BROWSER=1, so in
    CI a missing chromium or playwright fails the run instead of skipping it quietly."""
    if os.environ.get("EDGEFLEET_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{why} (EDGEFLEET_REQUIRE_BROWSER=1)")
    pytest.skip(why)


@contextmanager
def chromium() -> Iterator[Any]:
    """A launched headless browser (playwright's ``Browser``), closed on exit."""
    if not Path(CHROMIUM).exists():
        browser_missing(
            f"{CHROMIUM} missing: install the Debian package 'chromium' (tests/run.sh does as root)"
        )
    try:
        import playwright.sync_api as sync_api
    except ImportError as exc:
        browser_missing(f"playwright is not installed ({exc}): pip install -e '.[dev]'")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@contextmanager
def desktop_page(browser: Any) -> Iterator[Any]:
    """A new page of ``browser`` at :data:`DESKTOP` size, closed on exit."""
    p = browser.new_page(viewport=DESKTOP)
    try:
        yield p
    finally:
        p.close()


def horizontal_overflow(page: Any) -> str | None:
    """None when the page fits its viewport's width; else what sticks out, to name in a failure."""
    width = page.evaluate("document.documentElement.scrollWidth")
    inner = page.evaluate("window.innerWidth")
    return None if width <= inner else f"page is {width}px wide on a {inner}px screen"


def cut_off(page: Any, selector: str) -> list[str]:
    """What of the elements matching ``selector`` a user cannot see without scrolling sideways: each one
    whose box sticks out of the viewport or out of a scrolling container around it (a table in an
    ``overflow-x: auto`` box passes :func:`horizontal_overflow` while its right-hand columns are cut)."""
    out: list[str] = page.evaluate(
        """(selector) => {
             const out = [];
             for (const node of document.querySelectorAll(selector)) {
               const r = node.getBoundingClientRect();
               if (r.width === 0 && r.height === 0) continue;  // not shown (display: none)
               const name = `${node.tagName.toLowerCase()}[${node.dataset.label || node.textContent.trim().slice(0, 30)}]`;
               if (r.left < -0.5 || r.right > window.innerWidth + 0.5) {
                 out.push(`${name} spans ${r.left.toFixed(0)}..${r.right.toFixed(0)} px of a ${window.innerWidth} px screen`);
                 continue;
               }
               for (let up = node.parentElement; up; up = up.parentElement) {
                 const ox = getComputedStyle(up).overflowX;
                 if (ox === "visible") continue;
                 const box = up.getBoundingClientRect();
                 if (r.right > box.right + 0.5 || up.scrollWidth > up.clientWidth + 1) {
                   out.push(`${name} is cut by a ${up.clientWidth} px box that scrolls to ${up.scrollWidth} px`);
                   break;
                 }
               }
             }
             return out;
           }""",
        selector,
    )
    return out


def script_errors(page: Any) -> list[str]:
    """A list that fills with the page's uncaught exceptions and the errors its scripts log from now on.
    Chromium's own "Failed to load resource" lines are left out: an API's refusal (403, 409) that the
    page shows in words still logs one, and is no fault of the page."""
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))

    def console(msg: Any) -> None:
        if msg.type == "error" and not msg.text.startswith("Failed to load resource"):
            errors.append(f"console: {msg.text}")

    page.on("console", console)
    return errors


@dataclass
class FootageSite:
    """What :func:`footage_site` yields: its controller, the admin's API client (open until the site
    stops) and the folder of the processes' logs, where a test keeps its screenshots too: one folder to
    look at after a run."""

    controller: ControllerProcess
    api: httpx.Client
    shots: Path

    def url(self, path: str) -> str:
        """``path`` on the controller, the admin token in the fragment (the page keeps it out of the URL)."""
        return f"{self.controller.url}{path}#token={self.controller.token}"


@contextmanager
def footage_site(
    workdir: Path,
    broker: MosquittoBroker,
    device: str,
    *,
    labels: dict[str, str],
    ready: Callable[[httpx.Client], bool],
    what: str,
    timeout: float = 90,
    name: str | None = None,
    settings: dict[str, Any] | None = None,
    **env: str,
) -> Iterator[FootageSite]:
    """A controller process on ``broker`` (``env``: more of its environment) and an agent process for
    ``device`` whose cam1 runs the bundled person detector on the looping footage. The device is enrolled
    (``labels``, ``name``) and cam1 assigned (``settings``: lines, zones...) before the agent starts, so
    the agent downloads the model as a new device does. Yielded once ``ready`` holds of the admin's
    client within ``timeout`` s (``what``: what that waits for), failing at once if the agent exits;
    everything is stopped on exit."""
    # Stack's keywords given, so that mypy takes ``env`` for the controller's environment alone.
    stack = Stack(
        workdir, broker, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, camera=None, agent_extra=None, **env
    )
    try:
        stack.start()
        with stack.api() as api:
            enrol = {"id": device, "labels": labels, **({"name": name} if name is not None else {})}
            r = api.post("/api/v1/devices", json=enrol)
            assert r.status_code in (200, 201), r.text
            stack.assign(device, **(settings or {}))
            stack.agent(device).start()

            def running() -> bool:
                stack.alive()
                return ready(api)

            wait_for(running, timeout=timeout, what=what)
            yield FootageSite(stack.controller, api, workdir)
    finally:
        stack.stop()
