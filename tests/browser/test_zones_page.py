"""The technician's device page in headless Chromium against a real mosquitto, a controller process and
an agent process counting people on the real footage: the camera's zone and counting line drawn over
its latest frame where the agent counts them, and the counts table under it saying what
``/api/v1/counts`` says for that camera."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from tests.support.browser import DESKTOP, chromium, footage_site, script_errors
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import REPO
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

DEVICE = "zones-gate-1"
# The line and zone counted by hand on this footage: people cross the line and enter the zone within
# the first seconds of each loop.
HAND = json.loads((REPO / "tests" / "data" / "footage_counts.json").read_text())
LINE, ZONE = HAND["line"], HAND["zone"]
FRAME = (768, 576)


@pytest.fixture(scope="module")
def site(
    tmp_path_factory: pytest.TempPathFactory, broker: MosquittoBroker
) -> Iterator[tuple[str, httpx.Client]]:
    def counting(api: httpx.Client) -> bool:
        rep = api.get(f"/api/v1/devices/{DEVICE}").json()["models"].get("cam1", {})
        crossed = _today(api)["totals"]["lines"]
        return [z["id"] for z in rep.get("zones") or []] == [ZONE["id"]] and bool(crossed)

    with footage_site(
        tmp_path_factory.mktemp("zones-page"),
        broker,
        DEVICE,
        labels={"site": "yard"},
        settings={"lines": [LINE], "zones": [ZONE]},
        ready=counting,
        what="the agent running the zone and line, and a crossing counted",
    ) as s:
        yield s.url(f"/devices/{DEVICE}"), s.api


def _today(api: httpx.Client) -> dict[str, Any]:
    # The page's "today" is the browser's day, and the test's browser runs in UTC.
    midnight = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    r = api.get(
        "/api/v1/counts",
        params={"device": DEVICE, "camera": "cam1", "bucket": 86400, "since": midnight.isoformat()},
    )
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


def test_the_zone_and_line_are_drawn_over_the_frame_with_todays_counts(
    site: tuple[str, httpx.Client], browser: Any
) -> None:
    url, api = site
    ctx = browser.new_context(viewport=DESKTOP, timezone_id="UTC")
    page = ctx.new_page()
    errors = script_errors(page)
    try:
        page.goto(url)
        fig = 'figure.frame[data-camera="cam1"]'
        page.wait_for_selector(f'{fig} svg polygon[data-zone="{ZONE["id"]}"]', timeout=30_000)
        drawn = page.evaluate(
            """(fig) => { const svg = document.querySelector(fig + ' svg');
                 const line = svg.querySelector('line[data-line]');
                 return { viewBox: svg.getAttribute('viewBox'),
                          zones: [...svg.querySelectorAll('polygon[data-zone]')].map((p) => [p.dataset.zone,
                                  p.getAttribute('points').split(' ').map((xy) => xy.split(',').map(Number))]),
                          lines: [...svg.querySelectorAll('line[data-line]')].map((l) => [l.dataset.line,
                                  ['x1', 'y1', 'x2', 'y2'].map((k) => Number(l.getAttribute(k)))]),
                          arrow: svg.querySelector('.count-line path').getBBox().x,
                          lineX: Number(line.getAttribute('x1')) }; }""",
            fig,
        )
        w, h = FRAME
        assert drawn["viewBox"] == f"0 0 {w} {h}"
        [(zone_id, points)] = drawn["zones"]
        assert zone_id == ZONE["id"]
        assert [v for p in points for v in p] == pytest.approx(
            [v for x, y in ZONE["points"] for v in (x * w, y * h)], abs=1e-6
        )
        [(line_id, ends)] = drawn["lines"]
        assert line_id == LINE["id"]
        assert ends == pytest.approx([LINE["a"][0] * w, LINE["a"][1] * h, LINE["b"][0] * w, LINE["b"][1] * h])
        # The line runs up the image (a below b), so walking right across it is "in": the mark is
        # on the right.
        assert drawn["arrow"] > drawn["lineX"]

        table = f'{fig} table.zone-counts[data-camera="cam1"]'
        page.wait_for_selector(f'{table} tr[data-line="{LINE["id"]}"]', timeout=15_000)

        def shown_matches_api() -> bool:
            row = page.locator(f'{table} tr[data-line="{LINE["id"]}"]')
            zrow = page.locator(f'{table} tr[data-zone="{ZONE["id"]}"]')
            shown = (
                row.get_attribute("data-in"),
                row.get_attribute("data-out"),
                zrow.get_attribute("data-occupancy"),
            )
            answer = _today(api)
            lines = [r for r in answer["totals"]["lines"] if r["line"] == LINE["id"]]
            inside = [r["count"] for r in answer["occupancy"] if r["zone"] == ZONE["id"]]
            want = (
                str(sum(r["in"] for r in lines)),
                str(sum(r["out"] for r in lines)),
                str(sum(inside)) if inside else "",
            )
            return shown == want and want[0:2] != ("0", "0")

        # The page and the test read the counts a moment apart while the agent keeps counting.
        wait_for(shown_matches_api, timeout=20, what="the counts table saying what /api/v1/counts says")
        assert page.locator(table).is_visible()
        assert errors == []
    finally:
        ctx.close()
