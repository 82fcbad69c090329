"""The camera-pool page and the overview's pool list in headless Chromium (Debian's /usr/bin/chromium
driven by playwright; nothing downloaded), against a real mosquitto and a controller process. The
devices are MQTT clients that send what an agent sends: a birth with its capabilities and heartbeats
with the measured cost of each model variant, which is what a pool is planned with.

What the page shows is compared with the API's answer, value by value (the data-* attributes), and it
follows the operator's drain and a device going offline without a reload."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from fleet_protocol import TopicKind, Topics, encode
from fleet_protocol.messages import Availability, Capabilities, Heartbeat, VariantCost
from tests.support.browser import PHONE, chromium, horizontal_overflow
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.processes import ControllerProcess, start_controller
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

NORTH = "site-north"
NORTH_DEVICES = ("north-1", "north-2", "north-3")
GATES = tuple(f"gate-{i}" for i in range(1, 7))
# A camera of the COCO detector, which these CPU boxes measured at 300 ms a frame: at its minimum of
# 5 FPS it needs 1.5 s of inference a second, more than any one box has.
HEAVY = "yard-1"
SOUTH = "site-south"
SOUTH_DEVICES = ("south-1", "south-2")
# What each box measured a frame of each variant costs (inference lane, CPU), as agents report it.
COSTS = [
    VariantCost(variant="ped_ssdlite/1", infer_ms=20.0, cpu_ms=25.0, busy=0.2, frames=600),
    VariantCost(variant="nanodet_coco/1", infer_ms=300.0, cpu_ms=320.0, busy=0.3, frames=60),
]


def _camera(cam: str, model: str = "ped_ssdlite", **over: Any) -> dict[str, Any]:
    return {
        "id": cam,
        "source": f"rtsp://{{secret:site-cams}}@10.0.0.{cam.rsplit('-', 1)[-1]}/stream1",
        "model": model,
        "version": "1",
        "target_fps": 5,
        "min_fps": 5,
        **over,
    }


class Boxes:
    """Edge devices as one raw MQTT client: for each, a retained birth with its capabilities, and a
    heartbeat with its measured costs every second (the controller takes a silent device offline)."""

    def __init__(self, broker: MosquittoBroker, api: httpx.Client) -> None:
        self.api = api
        self.topics = Topics()
        self.beating: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="pool-page-boxes")
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        self._thread = threading.Thread(target=self._beat_forever, name="pool-page-beats", daemon=True)
        self._thread.start()

    def _publish(self, device: str, kind: TopicKind, msg: Any, *, retain: bool = False) -> None:
        self.client.publish(
            self.topics.device(device, kind), encode(msg), qos=1, retain=retain
        ).wait_for_publish(5)

    def _beat(self, device: str) -> None:
        self._publish(device, TopicKind.HEARTBEAT, Heartbeat(ts=time.time(), cpu_pct=30.0, costs=COSTS))

    def _beat_forever(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                devices = sorted(self.beating)
            for device in devices:
                self._beat(device)

    def add(self, device: str, **labels: str) -> None:
        r = self.api.post("/api/v1/devices", json={"id": device, "labels": labels})
        assert r.status_code in (200, 201), r.text
        caps = Capabilities(
            hostname=device,
            cpu_model="Intel N100",
            cpu_count=2,
            execution_providers=["CPUExecutionProvider"],
        )
        birth = Availability(state="online", ts=time.time(), agent_version="0.1.0", capabilities=caps)
        self._publish(device, TopicKind.AVAILABILITY, birth, retain=True)
        self._beat(device)
        with self._lock:
            self.beating.add(device)

        def measured() -> bool:
            d = self.api.get(f"/api/v1/devices/{device}").json()
            return d["status"] == "online" and bool((d.get("last_health") or {}).get("costs"))

        wait_for(measured, timeout=15, what=f"{device} online with its measured costs")

    def offline(self, device: str) -> None:
        """What the broker sends for a device whose link dropped (its will), and no more heartbeats."""
        with self._lock:
            self.beating.discard(device)
        self._publish(
            device, TopicKind.AVAILABILITY, Availability(state="offline", ts=time.time()), retain=True
        )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.client.loop_stop()
        self.client.disconnect()


@dataclass
class Site:
    controller: ControllerProcess
    api: httpx.Client
    boxes: Boxes
    shots: Path

    def url(self, path: str) -> str:
        return f"{self.controller.url}{path}#token={self.controller.token}"

    def pool(self, name: str) -> dict[str, Any]:
        r = self.api.get(f"/api/v1/pools/{name}")
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, broker: MosquittoBroker) -> Iterator[Site]:
    work = tmp_path_factory.mktemp("pools-page")
    # Replanning only on the operator's changes: a device gone offline then shows as pending moves until
    # a plan is made, instead of for the under two seconds a replan round would leave them visible.
    controller = start_controller(work, broker, EDGEFLEET_POOL_REPLAN_INTERVAL_S="0")
    api = controller.client()
    boxes = Boxes(broker, api)
    try:
        for device in NORTH_DEVICES:
            boxes.add(device, site="north")
        for device in SOUTH_DEVICES:
            boxes.add(device, site="south")
        north = {
            "name": NORTH,
            "selector": "site=north",
            "strategy": "spread",
            "headroom": 0.8,
            "cameras": [_camera(cam) for cam in GATES] + [_camera(HEAVY, model="nanodet_coco")],
        }
        r = api.put(f"/api/v1/pools/{NORTH}", json=north)
        assert r.status_code == 200, r.text
        # No grace: a device gone offline loses its cameras in the next plan.
        south = {
            "name": SOUTH,
            "selector": "site=south",
            "failover_grace_s": 0,
            "cameras": [_camera("dock-1"), _camera("dock-2")],
        }
        r = api.put(f"/api/v1/pools/{SOUTH}", json=south)
        assert r.status_code == 200, r.text
        yield Site(controller, api, boxes, work)
    finally:
        boxes.close()
        api.close()
        controller.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


# ---- the page's values, read from its data-* attributes, and the same from the API's answer

SHOWN = """() => {
  const q = (s, root = document) => [...root.querySelectorAll(s)];
  const num = (v) => (v === "" || v === undefined ? null : Number(v));
  const load = (card, r) => {
    const b = card.querySelector(`.load[data-resource="${r}"]`);
    return b ? [num(b.dataset.value), num(b.dataset.limit), b.querySelector(".load-num").textContent] : null;
  };
  return {
    placements: Object.fromEntries(q("#devices li.placement").map((li) =>
      [li.dataset.camera, [li.dataset.device, num(li.dataset.fps), li.closest(".pool-device").dataset.device]])),
    devices: Object.fromEntries(q("#devices .pool-device").map((c) => [c.dataset.device, {
      status: c.dataset.status, online: c.dataset.online, cordoned: c.dataset.cordoned,
      draining: c.dataset.draining, cameras: num(c.dataset.cameras),
      lane: load(c, "lane"), cpu: load(c, "cpu"),
      util: c.querySelector('[data-field="util"]') ? num(c.querySelector('[data-field="util"]').dataset.value) : null,
    }])),
    unplaced: Object.fromEntries(q("#attention tr.unplaced").map((r) => [r.dataset.camera, r.dataset.reason])),
    degraded: Object.fromEntries(q("#attention tr.degraded").map((r) => [r.dataset.camera, r.dataset.reason])),
    pending: q("#pending tr.pending").map((r) => [r.dataset.camera, r.dataset.source, r.dataset.target, r.dataset.reason]),
    moves: q("#moves tr.move").map((r) => [r.dataset.ts, r.dataset.camera, r.dataset.source, r.dataset.target, r.dataset.reason]),
    placed: [num(document.getElementById("placed").dataset.placed), num(document.getElementById("placed").dataset.declared)],
  };
}"""


def _shown(page: Any) -> dict[str, Any]:
    out: dict[str, Any] = page.evaluate(SHOWN)
    return out


def _load_text(text: str) -> tuple[float, float]:
    """'200 / 800 ms/s' -> (200, 800)."""
    value, limit = text.removesuffix(" ms/s").split(" / ")
    return float(value), float(limit)


def _comparable(shown: dict[str, Any]) -> dict[str, Any]:
    """The page's values without the texts, which are compared on their own (rounded for people)."""
    devices = {
        d: {**v, "lane": v["lane"] and v["lane"][:2], "cpu": v["cpu"] and v["cpu"][:2]}
        for d, v in shown["devices"].items()
    }
    return {**shown, "devices": devices}


def _expected(view: dict[str, Any]) -> dict[str, Any]:
    """What the page must show for the API's view of a pool, in :data:`SHOWN`'s shape."""

    def load(d: dict[str, Any], r: str) -> list[float] | None:
        ld = d["load"]
        return None if ld is None else [ld[f"{r}_ms_per_s"], ld[f"{r}_limit"]]

    return {
        "placements": {c: [p["device"], p["fps"], p["device"]] for c, p in view["placements"].items()},
        "devices": {
            d["id"]: {
                "status": d["status"],
                "online": str(d["online"]).lower(),
                "cordoned": str(d["cordoned"]).lower(),
                "draining": str(d["draining"]).lower(),
                "cameras": d["cameras"],
                "lane": load(d, "lane"),
                "cpu": load(d, "cpu"),
                "util": d["load"]["util"] if d["load"] else None,
            }
            for d in view["devices"]
        },
        "unplaced": view["unplaced"],
        "degraded": {c: d["reason"] for c, d in view["degraded"].items()},
        "pending": [[m["camera"], m["source"], m["target"], m["reason"]] for m in view["pending"]],
        "moves": [
            [m["ts"], m["camera"], m["source"], m["target"], m["reason"]] for m in view["recent_moves"]
        ],
        "placed": [len(view["placements"]), len(view["cameras"])],
    }


def _page_agrees(site: Site, page: Any, pool: str, what: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Waits until the page, refreshing itself, shows what the API says of ``pool``; (shown, view)."""
    seen: list[Any] = []

    def agrees() -> tuple[dict[str, Any], dict[str, Any]] | None:
        view, shown = site.pool(pool), _shown(page)
        seen[:] = [_comparable(shown), _expected(view)]
        return (shown, view) if seen[0] == seen[1] else None

    try:
        return wait_for(agrees, timeout=20, interval=0.5, what=what)
    except AssertionError:
        assert seen and seen[0] == seen[1], what  # pytest shows the difference, key by key
        raise


def _keep(shot: Path, site: Site) -> None:
    """Screenshots also land next to the controller's log, one folder to look at after a run."""
    shutil.copy(shot, site.shots / shot.name)


def test_pool_page_shows_where_each_camera_runs_and_follows_a_drain(
    site: Site, browser: Any, tmp_path: Path
) -> None:
    before = site.pool(NORTH)
    # What the planner made of it: six cameras on three boxes, the COCO camera nowhere, and why.
    assert sorted(before["placements"]) == sorted(GATES)
    assert {p["device"] for p in before["placements"].values()} == set(NORTH_DEVICES)
    assert list(before["unplaced"]) == [HEAVY]
    assert before["unplaced"][HEAVY].startswith("no room at min FPS 5 on 3 candidate device(s)")

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(site.url(f"/pools/{NORTH}"))
        shown, view = _page_agrees(site, page, NORTH, "the pool page shows the API's placements and loads")
        for device in view["devices"]:
            load = device["load"]
            value, limit = _load_text(shown["devices"][device["id"]]["lane"][2])
            assert abs(value - load["lane_ms_per_s"]) <= 0.5 and abs(limit - load["lane_limit"]) <= 0.5
            value, limit = _load_text(shown["devices"][device["id"]]["cpu"][2])
            assert abs(value - load["cpu_ms_per_s"]) <= 0.5 and abs(limit - load["cpu_limit"]) <= 0.5
            assert load["lane_ms_per_s"] > 0  # two cameras of measured cost, not an empty box
        reason = page.locator(f'#attention tr.unplaced[data-camera="{HEAVY}"] td.why').inner_text()
        assert reason == view["unplaced"][HEAVY]
        assert page.locator(f'#cameras tr[data-camera="{HEAVY}"]').inner_text().count("unplaced") == 1
        page.screenshot(path=str(tmp_path / "pool.png"), full_page=True)
        _keep(tmp_path / "pool.png", site)

        # Drain the box that runs gate-1: its cameras go to the others, each move with its reason.
        drained = view["placements"]["gate-1"]["device"]
        leaving = {c for c, p in view["placements"].items() if p["device"] == drained}
        r = site.api.post(f"/api/v1/pools/{NORTH}/devices/{drained}/drain")
        assert r.status_code == 200, r.text
        shown, view = _page_agrees(site, page, NORTH, f"the pool page shows {drained} drained")
        card = shown["devices"][drained]
        assert card["draining"] == "true" and card["cameras"] == 0 and card["lane"] is None
        assert page.locator(f'.pool-device[data-device="{drained}"] li.placement').count() == 0
        assert "draining" in page.locator(f'.pool-device[data-device="{drained}"] h3').inner_text()
        others = set(NORTH_DEVICES) - {drained}
        assert {shown["placements"][c][0] for c in leaving} <= others
        assert sorted(shown["placements"]) == sorted(GATES)
        moved = {m[1]: m for m in shown["moves"] if m[4] == "cordoned"}
        assert set(moved) == leaving
        for cam, (_, _, source, target, _) in moved.items():
            assert source == drained and target == view["placements"][cam]["device"]
            row = page.locator(f'#moves tr.move[data-camera="{cam}"]').inner_text()
            assert f"{drained} → {target}" in row and "cordoned" in row
        page.screenshot(path=str(tmp_path / "pool-drained.png"), full_page=True)
        _keep(tmp_path / "pool-drained.png", site)
    finally:
        page.close()


def test_a_device_gone_offline_shows_as_the_moves_the_next_plan_makes(
    site: Site, browser: Any, tmp_path: Path
) -> None:
    view = site.pool(SOUTH)
    gone = view["placements"]["dock-1"]["device"]
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(site.url(f"/pools/{SOUTH}"))
        _page_agrees(site, page, SOUTH, "the pool page shows the API's placements")
        site.boxes.offline(gone)
        wait_for(lambda: site.pool(SOUTH)["pending"], timeout=15, what=f"moves pending off {gone}")
        shown, view = _page_agrees(site, page, SOUTH, f"the pool page shows {gone} offline, moves pending")
        assert shown["devices"][gone]["status"] == "offline"
        away = {c for c, p in view["placements"].items() if p["device"] == gone}
        assert away and {m[0] for m in shown["pending"]} == away
        assert {m[3] for m in shown["pending"]} == {"device_offline"}
        for cam in away:
            # The camera still listed where it runs, with where it is about to go.
            item = page.locator(f'.pool-device[data-device="{gone}"] li.placement[data-camera="{cam}"]')
            assert "device_offline" in item.inner_text()
        page.screenshot(path=str(tmp_path / "pool-pending.png"), full_page=True)
        _keep(tmp_path / "pool-pending.png", site)
    finally:
        page.close()


def test_overview_lists_the_pools_with_a_link_to_each(site: Site, browser: Any, tmp_path: Path) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(site.url("/"))
        page.wait_for_selector(f'#pools tr[data-pool="{NORTH}"]', timeout=15_000)

        def rows_agree() -> bool:
            shown = page.evaluate(
                """() => [...document.querySelectorAll('#pools tr[data-pool]')].map((r) =>
                     [r.dataset.pool, Number(r.dataset.devices), Number(r.dataset.placed), Number(r.dataset.cameras)])"""
            )
            api = [
                [p["name"], p["devices"], p["placed"], p["cameras"]]
                for p in site.api.get("/api/v1/pools").json()
            ]
            return bool(shown == api)

        wait_for(rows_agree, timeout=20, interval=0.5, what="the overview lists the API's pools")
        row = page.locator(f'#pools tr[data-pool="{NORTH}"]')
        assert "6 / 7" in row.inner_text()  # the COCO camera has no room anywhere
        page.screenshot(path=str(tmp_path / "overview-pools.png"), full_page=True)
        _keep(tmp_path / "overview-pools.png", site)
        row.locator("a").click()
        page.wait_for_url(f"**/pools/{NORTH}")
        page.wait_for_selector("#devices .pool-device", timeout=15_000)
        assert page.locator("#pool-name").inner_text() == NORTH
    finally:
        page.close()


@pytest.mark.parametrize("path", [f"/pools/{NORTH}", "/"])
def test_phone_viewport_has_no_horizontal_overflow(
    site: Site, browser: Any, tmp_path: Path, path: str
) -> None:
    ctx = browser.new_context(**PHONE)
    page = ctx.new_page()
    try:
        page.goto(site.url(path))
        if path == "/":
            page.wait_for_selector(f'#pools tr[data-pool="{NORTH}"]', timeout=15_000)
        else:
            page.wait_for_selector("#devices .pool-device .load", timeout=15_000)
            page.wait_for_selector("#moves tr", timeout=15_000)
        page.wait_for_timeout(500)
        assert (overflow := horizontal_overflow(page)) is None, f"{path}: {overflow}"
        name = "phone-pool.png" if path != "/" else "phone-overview-pools.png"
        page.screenshot(path=str(tmp_path / name), full_page=True)
        _keep(tmp_path / name, site)
    finally:
        ctx.close()
