"""Agent self-update on real processes: the supervisor (``python -m edge_agent.supervisor``) runs the real
agent from the base install (this repository, version 0.1.0); packages are built from a temporary copy
of this repository by ``edge_agent.update.package`` (once per session); a stand-in controller on a real
mosquitto publishes signed desired states naming an agent version and serves the package's chunks
over the artifact channel, as the controller does (PROTOCOL.md "Agent updates").

- 0.1.0 -> 1.1 succeeds, and the outbox, the applied desired state and the model store survive: the
  model is not fetched again, detections go on, no seq is lost;
- a 1.1 that crashes at start is rolled back to 0.1.0 with an ``agent_rolled_back`` event naming
  the reason, and is not tried again;
- an update whose agent is killed with kill -9 halfway through the download resumes with only the
  missing chunks;
- an unsigned package and tampered bytes are refused before install: nothing in ``slots/``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from edge_agent import __version__ as BASE_VERSION
from edge_agent.update.package import BuiltPackage, build_package
from fleet_protocol.codec import encode_chunk
from fleet_protocol.messages import AgentPackageRef, AgentUpdateState, EventKind, ReportedState
from fleet_protocol.signing import sign_agent_package
from tests.support.edge_standin import (
    CONTROLLER_KEY,
    PUBLIC_KEY,
    StandInController,
    camera_with,
    desired,
    load_manifest,
)
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import FOOTAGE, MODELS, REPO
from tests.support.processes import AgentProcess, ControllerProcess, start_controller
from tests.support.transfer_helpers import TransferSpy, bitmap_have
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

PED = MODELS / "ped_ssdlite"


# --------------------------------------------------------------------------- packages (once per session)


def crash_at_start(source: Path) -> None:
    """Test helper, not a product flag: the built version dies at start, before it connects."""
    main = source / "edge_agent" / "__main__.py"
    text = main.read_text()
    main.write_text(
        text.replace(
            "def main(argv: list[str] | None = None) -> int:\n",
            "def main(argv: list[str] | None = None) -> int:\n"
            '    raise RuntimeError("injected crash: this build fails at start")\n',
        )
    )
    assert "injected crash" in main.read_text()


@dataclass(frozen=True)
class Packages:
    good: BuiltPackage
    crashing: BuiltPackage


@pytest.fixture(scope="session")
def packages(tmp_path_factory: pytest.TempPathFactory) -> Packages:
    out = tmp_path_factory.mktemp("agent-packages")
    good = build_package("1.1", out / "good", source=REPO)
    crashing = build_package("1.1", out / "crashing", source=REPO, prepare=crash_at_start)
    assert good.sha256 != crashing.sha256
    return Packages(good, crashing)


def package_ref(pkg: BuiltPackage, *, chunk_size: int = 64 * 1024, sign: bool = True) -> AgentPackageRef:
    ref = AgentPackageRef(
        version=pkg.info.version,
        sha256=pkg.sha256,
        size=pkg.size,
        chunk_size=chunk_size,
        health_timeout_s=90.0,
    )
    return sign_agent_package(ref, CONTROLLER_KEY) if sign else ref


# --------------------------------------------------------------------------- the supervised agent


def child_pid(agent: AgentProcess) -> int | None:
    """The supervisor's child: the agent process it runs."""
    if agent.proc is None:
        return None
    try:
        kids = psutil.Process(agent.proc.pid).children()
    except psutil.NoSuchProcess:
        return None
    return kids[0].pid if kids else None


def supervised(
    tmp_path: Path,
    broker: MosquittoBroker,
    device: str,
    *,
    controller: ControllerProcess | None = None,
    **extra: Any,
) -> AgentProcess:
    """The agent as systemd runs it (``python -m edge_agent.supervisor --config FILE``), trusting the
    stand-in's key, or the real ``controller``'s."""
    return AgentProcess(
        tmp_path,
        device,
        broker.url,
        cameras=extra.pop("cameras", []),
        public_key=PUBLIC_KEY if controller is None else None,
        controller=controller,
        module="edge_agent.supervisor",
        cwd=REPO,  # the supervisor's children must not import the repository's code from here
        mqtt_reconnect_max_s=1,
        outbox={"ack_timeout_s": 2, "batch_max_frames": 5, "batch_max_delay_s": 0.3},
        artifacts={"request_timeout_s": 2, **extra.pop("artifacts", {})},
        update={"retry_min_s": 60},
        **extra,
    )


def agent_report(ctl: StandInController) -> ReportedState | None:
    rep = ctl.latest_reported()
    return rep if rep is not None and rep.agent is not None else None


def events_of(ctl: StandInController, kind: EventKind) -> list[Any]:
    """The events of ``kind`` the stand-in stored, once each (an outbox resend repeats one), by seq."""
    with ctl.lock:
        by_seq = {e.seq: e for e in ctl.events if e.kind == kind}
    return [by_seq[s] for s in sorted(by_seq)]


def reported_agent(ctl: StandInController, version: str, state: AgentUpdateState) -> ReportedState | None:
    rep = agent_report(ctl)
    if rep is None or rep.agent is None:
        return None
    return rep if (rep.agent.version, rep.agent.state) == (version, state) else None


@pytest.fixture
def stand_in(own_broker: MosquittoBroker, request: pytest.FixtureRequest) -> Iterator[StandInController]:
    device = "upd-" + hashlib.sha256(request.node.name.encode()).hexdigest()[:8]
    ctl = StandInController(own_broker.host, own_broker.port, device, {})
    yield ctl
    ctl.close()


# --------------------------------------------------------------------------- tests


def test_an_update_to_1_1_succeeds_and_keeps_outbox_desired_state_and_models(
    tmp_path: Path, own_broker: MosquittoBroker, stand_in: StandInController, packages: Packages
) -> None:
    ctl = stand_in
    manifest = load_manifest(PED)
    pkg = packages.good
    ctl.artifacts.update({manifest.sha256: PED / "model.onnx", pkg.sha256: pkg.path})
    cameras = {"cam1": camera_with(manifest)}
    agent = supervised(
        tmp_path, own_broker, ctl.device_id, cameras=[{"id": "cam1", "source": str(FOOTAGE), "loop": True}]
    )
    ctl.publish_desired(desired(1, cameras))
    agent.start()
    try:
        wait_for(
            lambda: len(ctl.frames()) >= 10,
            timeout=90,
            what="detections from the base version",
            log=agent.log,
        )
        rep = wait_for(
            lambda: reported_agent(ctl, BASE_VERSION, AgentUpdateState.IDLE),
            timeout=30,
            what="0.1.0 idle",
            log=agent.log,
        )
        assert rep.agent is not None and rep.agent.slot == "base"
        model_requests = len([r for r in ctl.requests if r.sha256 == manifest.sha256])
        before_update = len(ctl.batches)

        ctl.publish_desired(desired(2, cameras).model_copy(update={"agent": package_ref(pkg)}))
        rep = wait_for(
            lambda: reported_agent(ctl, "1.1", AgentUpdateState.IDLE),
            timeout=180,
            what="the device reporting agent 1.1, idle",
            log=agent.log,
        )
        assert rep.agent is not None
        assert (rep.agent.slot, rep.agent.target, rep.agent.previous) == ("1.1", None, BASE_VERSION)
        assert rep.desired_version == 2
        updated = wait_for(
            lambda: events_of(ctl, EventKind.AGENT_UPDATED), timeout=30, what="agent_updated", log=agent.log
        )
        assert len(updated) == 1 and updated[0].data["version"] == "1.1"
        phases = [e.data["phase"] for e in events_of(ctl, EventKind.AGENT_UPDATE)]
        assert phases == ["fetching", "installing", "restarting"]
        assert ctl.availability[-1].agent_version == "1.1"
        assert events_of(ctl, EventKind.AGENT_ROLLED_BACK) == []

        # Detections go on from the new version, on the model from the store (not fetched again).
        after = len(ctl.batches)
        wait_for(
            lambda: len(ctl.batches) >= after + 5, timeout=60, what="detections from agent 1.1", log=agent.log
        )
        assert len(ctl.batches) > before_update
        assert len([r for r in ctl.requests if r.sha256 == manifest.sha256]) == model_requests
        last = ctl.latest_reported()
        assert last is not None and last.cameras["cam1"].state == "running"
        assert last.cameras["cam1"].sha256 == manifest.sha256

        # One sequence space across the update (the outbox survived): no seq missing, none restarted.
        def contiguous() -> bool:
            with ctl.lock:
                seqs = set(ctl.stored)
            return seqs == set(range(1, max(seqs) + 1))

        wait_for(contiguous, timeout=30, what="every seq from 1 to the last stored", log=agent.log)
        with ctl.lock:
            seqs_in_order = [b.seq for b in ctl.batches]
            incarnations = {getattr(b, "incarnation", None) for b in ctl.batches}
        assert max(seqs_in_order) > before_update
        assert len(incarnations) == 1, incarnations
        store = agent.data / "models"
        assert (store / f"{manifest.sha256}.onnx").exists()
        assert (agent.data / "applied.json").exists()
        # The supervisor's state: 1.1 current, the base install kept as the way back.
        slots = json.loads((agent.data / "agent" / "slots.json").read_text())
        assert slots["current"]["version"] == "1.1" and slots["previous"]["slot"] == "base"
    finally:
        agent.stop()
    assert agent.proc is None


def test_a_1_1_that_crashes_at_start_is_rolled_back_with_the_reason(
    tmp_path: Path, own_broker: MosquittoBroker, stand_in: StandInController, packages: Packages
) -> None:
    ctl = stand_in
    pkg = packages.crashing
    ctl.artifacts[pkg.sha256] = pkg.path
    agent = supervised(tmp_path, own_broker, ctl.device_id)
    agent.start()
    try:
        wait_for(
            lambda: reported_agent(ctl, BASE_VERSION, AgentUpdateState.IDLE),
            timeout=60,
            what="base up",
            log=agent.log,
        )
        ctl.publish_desired(desired(1, {}).model_copy(update={"agent": package_ref(pkg)}))
        rolled = wait_for(
            lambda: events_of(ctl, EventKind.AGENT_ROLLED_BACK),
            timeout=180,
            what="agent_rolled_back",
            log=agent.log,
        )
        assert len(rolled) == 1
        reason = rolled[0].data["reason"]
        assert "injected crash" in reason and "code 1" in reason, reason
        assert rolled[0].data["version"] == "1.1" and rolled[0].data["running"] == BASE_VERSION
        rep = wait_for(
            lambda: reported_agent(ctl, BASE_VERSION, AgentUpdateState.ROLLED_BACK),
            timeout=30,
            what="the device reporting the roll-back",
            log=agent.log,
        )
        assert rep.agent is not None
        assert (
            rep.agent.target == "1.1" and rep.agent.error is not None and "injected crash" in rep.agent.error
        )
        assert not (agent.data / "agent" / "slots" / "1.1").exists()
        assert agent.alive()
        # Not tried again: one install, one restart, whatever the retained desired state says.
        ctl.publish_desired(desired(2, {}).model_copy(update={"agent": package_ref(pkg)}))
        wait_for(
            lambda: (r := ctl.latest_reported()) is not None and r.desired_version == 2,
            timeout=30,
            what="desired v2 applied",
            log=agent.log,
        )
        restarts = [e for e in events_of(ctl, EventKind.AGENT_UPDATE) if e.data["phase"] == "restarting"]
        assert len(restarts) == 1
    finally:
        agent.stop()


def test_an_update_killed_halfway_through_the_download_resumes_with_the_missing_chunks(
    tmp_path: Path, own_broker: MosquittoBroker, stand_in: StandInController, packages: Packages
) -> None:
    ctl = stand_in
    pkg = packages.good
    chunk = 8 * 1024
    total = -(-pkg.size // chunk)
    ctl.artifacts[pkg.sha256] = pkg.path

    def paced(sha: str, i: int, n_total: int, data: bytes, n: int) -> bytes:
        time.sleep(0.05)  # a slow site link: the transfer lasts seconds, so chunks are made durable
        return encode_chunk(sha, i, n_total, data)

    ctl.chunk_hook = paced
    spy = TransferSpy(own_broker.host, own_broker.port, ctl.device_id)
    # A fixed window of 8 chunks (no byte budget), so the kill at 3/4 of the asks lands mid-transfer.
    agent = supervised(
        tmp_path, own_broker, ctl.device_id, artifacts={"window": 8, "window_bytes": 64 * 1024}
    )
    downloads = agent.data / "agent" / "downloads"
    try:
        agent.start()
        wait_for(
            lambda: reported_agent(ctl, BASE_VERSION, AgentUpdateState.IDLE),
            timeout=60,
            what="base up",
            log=agent.log,
        )
        victim = child_pid(agent)
        assert victim is not None

        def kill() -> None:
            os.kill(victim, signal.SIGKILL)

        killed = spy.when_distinct_requested(3 * total // 4, kill)
        ctl.publish_desired(desired(1, {}).model_copy(update={"agent": package_ref(pkg, chunk_size=chunk)}))
        wait_for(killed.is_set, timeout=60, what="the agent asking for 3/4 of the chunks", log=agent.log)
        wait_for(
            lambda: not psutil.pid_exists(victim) or psutil.Process(victim).status() == "zombie",
            timeout=10,
            what="the agent child killed",
            log=agent.log,
        )
        have = bitmap_have(downloads, pkg.sha256)
        assert have is not None and len(have) == total, "the partial download's bitmap survives"
        missing = {i for i, c in enumerate(have) if c == "0"}
        assert 0 < len(missing) < total, f"killed halfway: {total - len(missing)}/{total} chunks on disk"
        wait_for(
            spy.all_requests_answered,
            timeout=30,
            what="every request of the dead agent answered",
            log=agent.log,
        )
        mark = spy.mark()

        # The supervisor restarts the killed agent, which resumes and finishes the update.
        rep = wait_for(
            lambda: reported_agent(ctl, "1.1", AgentUpdateState.IDLE),
            timeout=180,
            what="agent 1.1 after the resumed download",
            log=agent.log,
        )
        assert rep.agent is not None and rep.agent.slot == "1.1"
        asked = set(spy.requested_since(mark))
        assert asked <= missing, f"asked again for chunks on disk: {sorted(asked - missing)[:10]}"
        assert len(asked) < total, "never the whole package again"
        assert spy.bad_frames == 0
    finally:
        spy.close()
        agent.stop()


def test_an_unsigned_package_or_tampered_bytes_are_refused_before_install(
    tmp_path: Path, own_broker: MosquittoBroker, stand_in: StandInController, packages: Packages
) -> None:
    ctl = stand_in
    pkg = packages.good
    raw = pkg.path.read_bytes()
    tampered = tmp_path / "tampered.tar.gz"
    tampered.write_bytes(raw[: len(raw) // 2] + bytes([raw[len(raw) // 2] ^ 0xFF]) + raw[len(raw) // 2 + 1 :])
    agent = supervised(tmp_path, own_broker, ctl.device_id)
    agent.start()
    try:
        wait_for(
            lambda: reported_agent(ctl, BASE_VERSION, AgentUpdateState.IDLE),
            timeout=60,
            what="base up",
            log=agent.log,
        )

        # Unsigned: refused before a byte is fetched.
        ctl.artifacts[pkg.sha256] = pkg.path
        ctl.publish_desired(desired(1, {}).model_copy(update={"agent": package_ref(pkg, sign=False)}))
        rep = wait_for(
            lambda: reported_agent(ctl, BASE_VERSION, AgentUpdateState.FAILED),
            timeout=30,
            what="the unsigned package refused",
            log=agent.log,
        )
        assert rep.agent is not None and rep.agent.error is not None and "unsigned" in rep.agent.error
        refused = wait_for(
            lambda: [e for e in events_of(ctl, EventKind.AGENT_UPDATE) if e.data["phase"] == "refused"],
            timeout=30,
            what="the refusal event",
            log=agent.log,
        )
        assert len(refused) == 1 and refused[0].data["check"] == "signature"
        assert [r for r in ctl.requests if r.sha256 == pkg.sha256] == []

        # Signed, but the bytes served are not the signed ones: never installed.
        ctl.artifacts[pkg.sha256] = tampered
        ctl.publish_desired(desired(2, {}).model_copy(update={"agent": package_ref(pkg)}))

        def mismatch() -> bool:
            r = agent_report(ctl)
            return bool(
                r is not None
                and r.desired_version == 2
                and r.agent is not None
                and r.agent.error
                and "sha256 mismatch" in r.agent.error
            )

        wait_for(mismatch, timeout=60, what="the tampered package refused", log=agent.log)
        assert [r for r in ctl.requests if r.sha256 == pkg.sha256]  # it was fetched, then refused
        slots = agent.data / "agent" / "slots"
        assert not slots.exists() or [p.name for p in slots.iterdir()] == []
        assert agent.alive()
        last = agent_report(ctl)
        assert last is not None and last.agent is not None and last.agent.version == BASE_VERSION
    finally:
        agent.stop()


def test_the_supervisor_refuses_an_invalid_config_without_looping(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("device_id: x\nno_such_key: 1\n")
    done = subprocess.run(
        [sys.executable, "-m", "edge_agent.supervisor", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "invalid configuration" in done.stderr


# --------------------------------------------------------------------------- through the real controller


GATE = {"soak_s": 0, "step_timeout_s": 240, "offline_timeout_s": 120}


@pytest.fixture
def controller(tmp_path: Path, own_broker: MosquittoBroker) -> Iterator[ControllerProcess]:
    c = start_controller(tmp_path, own_broker, EDGEFLEET_HEARTBEAT_TIMEOUT_S="60")
    yield c
    c.stop()


def upload(api: Any, pkg: BuiltPackage) -> None:
    r = api.post(
        "/api/v1/agent-packages",
        files={"file": (pkg.path.name, pkg.path.read_bytes(), "application/gzip")},
        timeout=60,
    )
    assert r.status_code == 201, r.text
    assert r.json()["sha256"] == pkg.sha256


def device_agent_view(api: Any, device: str) -> dict[str, Any] | None:
    r = api.get(f"/api/v1/devices/{device}")
    assert r.status_code == 200, r.text
    agent: dict[str, Any] | None = r.json().get("agent")
    return agent


def test_through_the_controller_an_agent_deployment_updates_the_device(
    tmp_path: Path, own_broker: MosquittoBroker, controller: ControllerProcess, packages: Packages
) -> None:
    device = "upd-ctl-ok"
    agent = supervised(tmp_path, own_broker, device, controller=controller)
    with controller.client() as api:
        assert api.post("/api/v1/devices", json={"id": device}).status_code in (200, 201)
        agent.start()
        try:
            wait_for(
                lambda: (v := device_agent_view(api, device)) is not None and v["version"] == BASE_VERSION,
                timeout=60,
                what="the base agent in the device view",
                log=agent.log,
            )
            upload(api, packages.good)
            r = api.post(
                "/api/v1/agent-deployments",
                json={
                    "name": "agent-1-1",
                    "version": "1.1",
                    "waves": [1],
                    "gate": GATE,
                    "health_timeout_s": 90,
                },
            )
            assert r.status_code == 201, r.text

            def done() -> dict[str, Any] | None:
                dep: dict[str, Any] = api.get("/api/v1/deployments/agent-1-1").json()
                ro = dep.get("rollout") or {}
                assert ro.get("state") not in ("failed", "rolled_back"), ro
                return dep if ro.get("state") in ("completed", "succeeded", "done") else None

            wait_for(done, timeout=240, what="the agent rollout completed", log=agent.log)
            view = device_agent_view(api, device)
            assert view is not None
            assert (view["version"], view["state"], view["slot"]) == ("1.1", "idle", "1.1")
            assert view["previous"] == BASE_VERSION
        finally:
            agent.stop()


def test_through_the_controller_a_crashing_canary_is_rolled_back_and_fails_the_gate(
    tmp_path: Path, own_broker: MosquittoBroker, controller: ControllerProcess, packages: Packages
) -> None:
    devices = ["upd-ctl-a", "upd-ctl-b"]
    agents = [supervised(tmp_path, own_broker, d, controller=controller) for d in devices]
    with controller.client() as api:
        for d in devices:
            assert api.post("/api/v1/devices", json={"id": d}).status_code in (200, 201)
        try:
            for a in agents:
                a.start()
            for a, d in zip(agents, devices, strict=True):

                def on_base(d: str = d) -> bool:
                    v = device_agent_view(api, d)
                    return v is not None and v["version"] == BASE_VERSION

                wait_for(on_base, timeout=60, what=f"{d} online on the base agent", log=a.log)
            upload(api, packages.crashing)
            r = api.post(
                "/api/v1/agent-deployments",
                json={
                    "name": "agent-crash",
                    "version": "1.1",
                    "waves": [1, "100%"],
                    "gate": GATE,
                    "health_timeout_s": 90,
                },
            )
            assert r.status_code == 201, r.text

            def failed() -> dict[str, Any] | None:
                ro: dict[str, Any] = api.get("/api/v1/deployments/agent-crash").json().get("rollout") or {}
                return ro if ro.get("state") in ("failed", "rolled_back") else None

            ro = wait_for(failed, timeout=300, what="the canary gate failing the rollout", log=agents[0].log)
            admitted = [x["device_id"] for x in ro["devices"] if x.get("admitted_at")]
            assert len(admitted) == 1, ro["devices"]  # the later wave was never admitted
            canary = admitted[0]
            other = next(d for d in devices if d != canary)
            view = device_agent_view(api, canary)
            assert view is not None and view["version"] == BASE_VERSION
            assert view["state"] in ("rolled_back", "idle"), view
            r = api.get("/api/v1/events", params={"device": canary, "limit": 200})
            assert r.status_code == 200, r.text
            body = r.json()
            items = body["items"] if isinstance(body, dict) else body
            rolled = [e for e in items if e.get("kind") == "agent_rolled_back"]
            assert rolled and "injected crash" in json.dumps(rolled[0]), rolled
            other_view = device_agent_view(api, other)
            assert other_view is not None and other_view["version"] == BASE_VERSION
            assert other_view.get("desired") != "1.1"
        finally:
            for a in agents:
                a.stop()
