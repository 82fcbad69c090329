"""The fleet operator's pages in headless Chromium (Debian's /usr/bin/chromium driven by playwright;
nothing downloaded): models with their variants' figures and a build followed live, deployments with
the devices each reaches, a rollout's waves and gates with the actions shown to operator tokens only,
and agent packages with their rollouts. Against a real mosquitto, a controller process that builds
variants of the bundled person detector, and simulated devices (``edgefleet simulate``) that apply
what they are sent, so rollouts pass real gates.

What a page shows is compared with the API's answer (the data-* attributes); a viewer token sees no
button, and the API refuses it when it calls an action anyway."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.agent_packages import make_package
from tests.support.browser import PHONE, chromium, cut_off, horizontal_overflow
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import MODELS
from tests.support.processes import ControllerProcess, SimulatorProcess, bearer, start_controller
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

PREFIX = "op-"
DEVICES = 3
# A canary, then the rest: two gates, judged after a short soak (the simulated devices report their
# FPS every second; their FPS is the same before and after).
QUICK_GATE = {"soak_s": 2, "min_fps_ratio": 0.5, "step_timeout_s": 60, "offline_timeout_s": 30}


@dataclass
class Fleet:
    controller: ControllerProcess
    api: httpx.Client
    viewer: str
    operator: str
    shots: Path

    def url(self, path: str, token: str | None = None) -> str:
        return f"{self.controller.url}{path}#token={token or self.controller.token}"

    def deployment(self, name: str) -> dict[str, Any]:
        r = self.api.get(f"/api/v1/deployments/{name}")
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    def deploy(self, name: str, **over: Any) -> dict[str, Any]:
        body = {"name": name, "model": "ped_ssdlite", "version": "1", "selector": "", "waves": [1, "100%"]}
        r = self.api.post("/api/v1/deployments", json={**body, "gate": QUICK_GATE, **over})
        assert r.status_code == 201, r.text
        out: dict[str, Any] = r.json()
        return out

    def token(self, role: str) -> str:
        r = self.api.post("/api/v1/tokens", json={"name": f"pages-{role}", "role": role})
        assert r.status_code == 201, r.text
        made: str = r.json()["token"]
        return made


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, broker: MosquittoBroker) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("operator-pages")
    controller = start_controller(
        work,
        broker,
        EDGEFLEET_BUILD_VARIANTS_ON_UPLOAD="true",
        # Few frames: the page shows whatever figures the build measured; a full build is minutes.
        EDGEFLEET_VARIANT_CALIB_FRAMES="2",
        EDGEFLEET_VARIANT_EVAL_FRAMES="4",
    )
    sim = SimulatorProcess(
        work / "sim", broker.url, DEVICES, "--device-prefix", PREFIX, "--heartbeat-s", "1", "--drain-s", "20"
    ).start()
    api = controller.client()
    try:

        def online() -> bool:
            sim.alive()
            devices = [d for d in api.get("/api/v1/devices").json() if d["id"].startswith(PREFIX)]
            return len(devices) == DEVICES and all(d["status"] == "online" for d in devices)

        wait_for(online, timeout=60, what=f"{DEVICES} simulated devices online")

        def measured() -> bool:
            devices = [d for d in api.get("/api/v1/devices").json() if d["id"].startswith(PREFIX)]
            return all(any((c.get("fps") or 0) > 0 for c in d["cameras"]) for d in devices)

        # Their FPS before a rollout is each gate's baseline.
        wait_for(measured, timeout=30, what="every simulated device reports its FPS")
        f = Fleet(controller, api, "", "", work)
        f.viewer, f.operator = f.token("viewer"), f.token("operator")
        yield f
    finally:
        api.close()
        sim.stop(timeout=60)
        controller.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    p = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def finished(fleet: Fleet) -> dict[str, Any]:
    """A rollout to every simulated device that passed both its gates."""
    fleet.deploy("ped-all")

    def done() -> dict[str, Any] | None:
        ro: dict[str, Any] = fleet.deployment("ped-all")["rollout"]
        assert ro["state"] in ("running", "succeeded"), ro
        return ro if ro["state"] == "succeeded" else None

    out: dict[str, Any] = wait_for(done, timeout=120, what="rollout ped-all succeeded")
    return out


def _shot(page: Any, fleet: Fleet, tmp_path: Path, name: str) -> None:
    page.screenshot(path=str(tmp_path / name), full_page=True)
    shutil.copy(tmp_path / name, fleet.shots / name)


def test_rollout_page_shows_each_wave_gate_with_its_figures_and_every_device(
    fleet: Fleet, finished: dict[str, Any], page: Any, tmp_path: Path
) -> None:
    page.goto(fleet.url(f"/rollouts/{finished['id']}", fleet.operator))
    page.wait_for_selector('#state[data-state="succeeded"]', timeout=15_000)
    assert [g["wave"] for g in finished["gates"]] == [1, 2]
    for gate in finished["gates"]:
        card = page.locator(f'.wave[data-wave="{gate["wave"]}"]')
        assert card.get_attribute("data-verdict") == "passed"
        assert card.locator('[data-field="gate-reason"]').inner_text() == gate["reason"]
        assert f"{len(gate['failed'])} of {gate['size']}" in card.inner_text()
        shown = card.evaluate(
            "(c) => Object.fromEntries([...c.querySelectorAll('[data-figure]')]"
            ".map((f) => [f.dataset.figure, f.dataset.value]))"
        )
        for key in ("fps_ratio_min", "latency_ms_max"):
            assert shown[key] == ("" if gate[key] is None else str(gate[key]).removesuffix(".0")), key
        assert shown["failed"] == str(len(gate["failed"]))
    # The devices had run a model before: the second wave's gate judged their FPS after / before.
    assert finished["gates"][1]["fps_ratio_min"] is not None
    members = {m["device_id"]: m["state"] for m in finished["devices"]}
    assert len(members) == DEVICES
    shown = page.evaluate(
        "() => Object.fromEntries([...document.querySelectorAll('#members tr[data-device]')]"
        ".map((r) => [r.dataset.device, r.dataset.state]))"
    )
    assert shown == members
    # An operator token: the actions this state allows (a finished rollout: only a roll back).
    enabled = page.evaluate(
        "() => Object.fromEntries([...document.querySelectorAll('#actions button')]"
        ".map((b) => [b.dataset.action, !b.disabled]))"
    )
    assert enabled == {"pause": False, "resume": False, "cancel": False, "rollback": True}
    _shot(page, fleet, tmp_path, "rollout.png")


def test_a_viewer_sees_no_action_and_the_api_refuses_it_the_action_anyway(
    fleet: Fleet, finished: dict[str, Any], page: Any
) -> None:
    page.goto(fleet.url(f"/rollouts/{finished['id']}", fleet.viewer))
    page.wait_for_selector('body[data-operator="false"]', timeout=15_000)
    page.wait_for_selector(".wave[data-wave='2']", timeout=15_000)
    assert page.locator("#actions").count() == 0
    assert page.locator("button[data-action]").count() == 0
    # The same calls a button would make, from the page with the viewer's token.
    codes = page.evaluate(
        """async ([dep, token]) => {
             const out = {};
             for (const a of ['pause', 'resume', 'cancel', 'rollback']) {
               const r = await fetch(`/api/v1/deployments/${dep}/${a}`, {method: 'POST', headers: {Authorization: `Bearer ${token}`}});
               out[a] = r.status;
             }
             return out;
           }""",
        [finished["deployment_id"], fleet.viewer],
    )
    assert codes == {"pause": 403, "resume": 403, "cancel": 403, "rollback": 403}
    assert fleet.deployment("ped-all")["rollout"]["state"] == "succeeded"


def test_an_operator_pauses_resumes_cancels_and_rolls_back_from_the_page(
    fleet: Fleet, page: Any, tmp_path: Path
) -> None:
    # A soak far longer than the test: the canary's gate is still judging while the buttons are used.
    dep = fleet.deploy("ped-hold", priority=10, gate={**QUICK_GATE, "soak_s": 3600})
    page.on("dialog", lambda d: d.accept())  # cancel and roll back ask first
    page.goto(fleet.url(f"/rollouts/{dep['rollout']['id']}", fleet.operator))
    page.wait_for_selector('#state[data-state="running"]', timeout=15_000)
    for action, state in (
        ("pause", "paused"),
        ("resume", "running"),
        ("cancel", "cancelled"),
        ("rollback", "rolled_back"),
    ):
        page.locator(f'button[data-action="{action}"]').click()
        page.wait_for_selector(f'#state[data-state="{state}"]', timeout=15_000)
        assert fleet.deployment("ped-hold")["rollout"]["state"] == state
    assert page.locator("#action-error").count() == 0
    _shot(page, fleet, tmp_path, "rollout-rolled-back.png")


def test_deployments_page_lists_selector_priority_and_the_devices_each_reaches(
    fleet: Fleet, finished: dict[str, Any], page: Any
) -> None:
    page.goto(fleet.url("/deployments", fleet.viewer))
    row = page.locator('#deployments tr[data-deployment="ped-all"]')
    row.wait_for(timeout=15_000)

    def reached_by_api() -> list[str]:
        return sorted(
            d["id"]
            for d in fleet.api.get("/api/v1/devices").json()
            if any(a.get("deployment") == "ped-all" for a in d["assignments"].values())
        )

    def agree() -> bool:
        expected = reached_by_api()
        shown = row.locator('[data-field="reached"] a').all_inner_texts()
        return bool(expected) and sorted(shown) == expected

    wait_for(agree, timeout=15, what="the page lists the devices the API says ped-all reaches")
    assert row.get_attribute("data-reached") == str(len(reached_by_api()))
    assert row.locator('[data-field="priority"]').inner_text() == "0"
    assert "every device" in row.inner_text() and "ped_ssdlite:1" in row.inner_text()
    link = row.locator("a.rollout-link")
    assert link.get_attribute("data-rollout") == str(finished["id"])
    link.click()
    page.wait_for_selector('#state[data-state="succeeded"]', timeout=15_000)


def test_models_page_follows_a_build_and_shows_each_variants_figures_and_why_it_is_unfit(
    fleet: Fleet, page: Any, tmp_path: Path
) -> None:
    page.goto(fleet.url("/models", fleet.viewer))
    bundled = page.locator('.model[data-model="ped_ssdlite:1"]')
    bundled.wait_for(timeout=15_000)
    assert bundled.locator('[data-field="no-variants"]').count() == 1
    manifest = json.loads((MODELS / "ped_ssdlite" / "manifest.json").read_text())
    for server_owned in ("name", "version", "sha256", "size"):
        manifest.pop(server_owned)
    r = fleet.api.post(
        "/api/v1/models",
        data={"name": "ped_ssdlite", "version": "7", "manifest": json.dumps(manifest)},
        files={"file": ("model.onnx", (MODELS / "ped_ssdlite" / "model.onnx").read_bytes())},
        timeout=60,
    )
    assert r.status_code == 201, r.text
    # Followed without a reload: building with its stage and progress, then ready with variants.
    card = page.locator('.model[data-model="ped_ssdlite:7"]')
    page.wait_for_selector(
        '.model[data-model="ped_ssdlite:7"][data-status="building"] [data-field="progress"]',
        timeout=15_000,
    )
    page.wait_for_selector(
        '.model[data-model="ped_ssdlite:7"]:not([data-status="building"])', timeout=400_000
    )
    version = fleet.api.get("/api/v1/models/ped_ssdlite/versions/7").json()
    assert version["status"] == "ready" and card.get_attribute("data-status") == "ready"
    assert {v["variant"] for v in version["variants"]} == {"fp32", "fp16", "int8"}
    for v in version["variants"]:
        row = card.locator(f'tr[data-variant="{v["variant"]}"]')
        assert row.get_attribute("data-fit") == str(v["fit"]).lower()
        for field, key in (("latency_1t", "latency_ms_1t"), ("f1", "f1"), ("mean_iou", "mean_iou")):
            value = row.locator(f'[data-field="{field}"]').get_attribute("data-value")
            assert (float(value) if value else None) == v[key], (v["variant"], field)
        reason = row.locator('[data-field="reason"]').inner_text()
        assert reason == ("" if v["fit"] else v["reason"]), v["variant"]
    # The fp32 model always serves and is judged the reference.
    assert card.locator('tr[data-variant="fp32"]').get_attribute("data-fit") == "true"
    _shot(page, fleet, tmp_path, "models.png")


def test_agent_packages_page_lists_packages_and_their_rollouts(fleet: Fleet, page: Any) -> None:
    files = {"file": ("edgefleet-agent.tar.gz", make_package("9.2.0"), "application/gzip")}
    r = fleet.api.post("/api/v1/agent-packages", files=files)
    assert r.status_code == 201, r.text
    pkg = r.json()
    r = fleet.api.post(
        "/api/v1/agent-deployments", json={"name": "agent-9-2", "version": "9.2.0", "selector": "site=none"}
    )
    assert r.status_code == 201, r.text
    rollout = r.json()["rollout"]
    page.goto(fleet.url("/agent-packages", fleet.viewer))
    row = page.locator('#packages tr[data-package="9.2.0"]')
    row.wait_for(timeout=15_000)
    text = row.inner_text()
    assert pkg["sha256"][:12] in text and all(req in text for req in pkg["requires"])
    assert row.get_attribute("data-running") == "0"
    assert row.locator(f'a.rollout-link[data-rollout="{rollout["id"]}"]').count() == 1
    dep = page.locator('#agent-deployments tr[data-deployment="agent-9-2"]')
    assert "site=none" in dep.inner_text() and dep.get_attribute("data-reached") == "0"


@pytest.mark.parametrize("path", ["/models", "/deployments", "/agent-packages", "/rollouts/{id}"])
def test_phone_viewport_cuts_nothing_off(
    fleet: Fleet, finished: dict[str, Any], browser: Any, tmp_path: Path, path: str
) -> None:
    ctx = browser.new_context(**PHONE)
    page = ctx.new_page()
    try:
        page.goto(fleet.url(path.format(id=finished["id"]), fleet.operator))
        page.wait_for_selector("main .card, main table, #deployments p, #packages p", timeout=15_000)
        page.wait_for_timeout(500)
        assert (overflow := horizontal_overflow(page)) is None, f"{path}: {overflow}"
        assert cut_off(page, "main td, main .card, main button") == [], path
        _shot(page, fleet, tmp_path, f"phone{path.replace('/', '-').replace('{id}', 'rollout')}.png")
    finally:
        ctx.close()


def test_the_pages_are_reached_from_the_overview(fleet: Fleet, page: Any) -> None:
    page.goto(fleet.url("/", fleet.viewer))
    for text, path in (
        ("models", "/models"),
        ("deployments", "/deployments"),
        ("agent packages", "/agent-packages"),
    ):
        page.locator("#nav a", has_text=text).click()
        page.wait_for_url(f"{fleet.controller.url}{path}", timeout=15_000)
        assert page.locator(f'#nav a[aria-current="page"][href="{path}"]').count() == 1
        page.go_back()
    # The pages themselves hold nothing: without a token they load and ask for one.
    assert httpx.get(f"{fleet.controller.url}/models").status_code == 200
    assert httpx.get(f"{fleet.controller.url}/api/v1/models").status_code == 401
    assert (
        httpx.get(f"{fleet.controller.url}/api/v1/whoami", headers=bearer(fleet.viewer)).json()["role"]
        == "viewer"
    )
