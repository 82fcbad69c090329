"""An agent killed (-9) in the middle of a model swap comes back on the new model and loses nothing.

A camera runs an old model (ped_ssdlite:1, already in the agent's store as on a provisioned device);
the controller assigns it a new one. The agent is frozen (SIGSTOP) at a point of the swap picked by
what it reports on the broker, from the watcher's own callback (no sleep), and killed (SIGKILL):

- ``fetching``: the new model's transfer is under way. The controller caps the device's artifact
  bytes (1 MiB/s), so the transfer takes seconds on any machine, and the kill lands at a quarter of it
  or more;
- ``loading``: the new model is on disk, verified, and being loaded and warmed up (its warm-up is heavy
  compute, so the load lasts a while).

Proof that the kill hit the swap: the controller's device API shows the camera fetching or loading the
new model (the device applying, not in sync), the agent's log has no activation of it, and its store
holds a part file with only some chunks on disk (fetching) or the verified file and no part (loading);
the old model's detections kept coming after the transfer began. After a restart the agent must
stay up, serve the old model again from its store (the last state fully applied) while it resumes the
transfer with only the chunks it lacks (or re-checks the stored file's sha256), and end running the
new model, in sync; every seq it published is stored exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
import sqlalchemy as sa
from paho.mqtt.enums import CallbackAPIVersion

from edge_agent.uplink.artifacts import file_sha256
from fleet_protocol.codec import ProtocolError, decode
from fleet_protocol.messages import ArtifactRef, ArtifactRequest, ModelManifest, ReportedState
from fleet_protocol.topics import TopicKind, Topics
from tests.support.faults import FaultStack, outbox_state
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.onnx_models import tf_od_slow
from tests.support.paths import MODELS
from tests.support.processes import AgentProcess
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e  # real broker, controller, agent, models and footage

OLD_KEY = "ped_ssdlite:1"
CHUNK = 64 * 1024
# The controller's cap on what it sends one device: a 15 MB model takes 14 s or more to arrive.
BYTES_PER_S = 2**20
BURST_BYTES = 8 * CHUNK
# The agent keeps that burst in flight, asks again soon for what the cap dropped, and does not give
# up on a link this slow.
ARTIFACTS = {"window": 8, "window_bytes": CHUNK, "request_timeout_s": 0.5, "max_retries": 60}


@dataclass(frozen=True)
class Swap:
    phase: str  # the camera's reported state the agent is frozen and killed in
    model: str
    version: str


SWAPS = [Swap("fetching", "nanodet_coco", "1"), Swap("loading", "ped_slow", "1")]


class DeviceWatch:
    """One device's reported states and artifact requests as they cross the broker, and an action run
    from the client's own callback the moment a condition on them first holds."""

    def __init__(self, broker: MosquittoBroker, device_id: str) -> None:
        self.topics = Topics()
        self._lock = threading.Lock()
        self.reports: list[ReportedState] = []
        self.requests: list[ArtifactRequest] = []
        self._trigger: tuple[Callable[[DeviceWatch], bool], Callable[[], None], threading.Event] | None = None
        self._subscribed = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"swap-watch-{device_id}")
        self.client.on_connect = lambda c, *a: c.subscribe(
            [
                (self.topics.device(device_id, TopicKind.TWIN_REPORTED), 1),
                (self.topics.device(device_id, TopicKind.ARTIFACT_REQUEST), 1),
            ]
        )
        self.client.on_subscribe = lambda *a: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        wait_for(self._subscribed.is_set, timeout=10, what=f"watch on {device_id} subscribed")

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def mark(self) -> tuple[int, int]:
        with self._lock:
            return len(self.reports), len(self.requests)

    def cam(self, camera: str, since: tuple[int, int] = (0, 0)) -> list[dict[str, Any]]:
        """``camera``'s reported entries (model, state, progress) from ``since`` on, in order."""
        with self._lock:
            reports = self.reports[since[0] :]
        return [r.cameras[camera].model_dump() for r in reports if camera in r.cameras]

    def asked(self, sha256: str, since: tuple[int, int] = (0, 0)) -> list[int]:
        with self._lock:
            return [i for r in self.requests[since[1] :] if r.sha256 == sha256 for i in r.chunks]

    def when(self, condition: Callable[[DeviceWatch], bool], action: Callable[[], None]) -> threading.Event:
        fired = threading.Event()
        with self._lock:
            self._trigger = (condition, action, fired)
        return fired

    def _on_message(self, c: mqtt.Client, u: object, m: mqtt.MQTTMessage) -> None:
        topic = self.topics.parse(m.topic)
        if topic is None:
            return
        try:
            msg = decode(topic.kind, bytes(m.payload))
        except ProtocolError:
            return
        with self._lock:
            if isinstance(msg, ReportedState):
                self.reports.append(msg)
            elif isinstance(msg, ArtifactRequest):
                self.requests.append(msg)
            trigger = self._trigger
        if trigger is not None and trigger[0](self):
            with self._lock:
                self._trigger = None
            trigger[1]()
            trigger[2].set()


@pytest.fixture
def swap_rig(tmp_path: Path, fault_broker: MosquittoBroker) -> Iterator[FaultStack]:
    r = FaultStack(tmp_path, fault_broker)
    r.controller.env.update(
        EDGEFLEET_CHUNK_SIZE=str(CHUNK),
        EDGEFLEET_ARTIFACT_DEVICE_BYTES_PER_S=str(BYTES_PER_S),
        EDGEFLEET_ARTIFACT_DEVICE_BURST_BYTES=str(BURST_BYTES),
        # The new model is served as uploaded (fp32, pinned below), no variants built meanwhile.
        EDGEFLEET_BUILD_VARIANTS_ON_UPLOAD="false",
    )
    r.controller.start()
    yield r
    r.close()


def _upload_slow(rig: FaultStack, swap: Swap) -> None:
    """ped_ssdlite with a heavy branch whose result is multiplied by zero: the same detections, and a
    warm-up (part of every load) of hundreds of milliseconds of compute."""
    fields = json.loads((MODELS / "ped_ssdlite" / "manifest.json").read_text())
    for server_owned in ("name", "version", "sha256", "size"):
        fields.pop(server_owned)
    data = tf_od_slow((MODELS / "ped_ssdlite" / "model.onnx").read_bytes(), steps=32)
    with rig.controller.client() as c:
        r = c.post(
            "/api/v1/models",
            data={"name": swap.model, "version": swap.version, "manifest": json.dumps(fields)},
            files={"file": ("model.onnx", data, "application/octet-stream")},
        )
    assert r.status_code in (200, 201), r.text


def _seed_old_model(agent: AgentProcess) -> None:
    """The old model in the agent's store before its first start, as on a provisioned device: only the
    swap's transfer goes through the byte cap. The agent still checks its sha256 before loading it."""
    old = ModelManifest.model_validate_json((MODELS / "ped_ssdlite" / "manifest.json").read_text())
    store = Path(agent.cfg["data_dir"]) / "models"
    store.mkdir(parents=True, mode=0o700)
    (store / f"{old.sha256}.onnx").write_bytes((MODELS / "ped_ssdlite" / "model.onnx").read_bytes())


def _log(agent: AgentProcess, since: int = 0) -> str:
    return agent.log.read_bytes()[since:].decode(errors="replace")


@pytest.mark.parametrize("swap", SWAPS, ids=[s.phase for s in SWAPS])
def test_agent_killed_mid_model_swap_resumes_onto_the_new_model(swap_rig: FaultStack, swap: Swap) -> None:
    rig = swap_rig
    device = f"fault-swap-{swap.phase}"
    new_key = f"{swap.model}:{swap.version}"
    rig.deploy(device)
    agent = rig.agent(device, artifacts=ARTIFACTS)
    _seed_old_model(agent)
    agent.start()
    rig.wait_streaming(agent)
    assert rig.device(device)["models"]["cam1"]["model"] == OLD_KEY
    if swap.phase == "loading":
        _upload_slow(rig, swap)
    watch = DeviceWatch(rig.broker, device)
    try:
        _swap_killed_and_restarted(rig, agent, watch, swap, new_key)
    finally:
        watch.close()


def _swap_killed_and_restarted(
    rig: FaultStack, agent: AgentProcess, watch: DeviceWatch, swap: Swap, new_key: str
) -> None:
    device = agent.device_id
    store = Path(agent.cfg["data_dir"]) / "models"

    def at_the_point(w: DeviceWatch) -> bool:
        cams = w.cam("cam1")
        if not cams or cams[-1]["model"] != new_key or cams[-1]["state"] != swap.phase:
            return False
        return swap.phase != "fetching" or (cams[-1]["progress_pct"] or 0.0) >= 25.0

    def freeze() -> None:
        assert agent.proc is not None
        os.kill(agent.proc.pid, signal.SIGSTOP)

    frozen = watch.when(at_the_point, freeze)
    with rig.controller.client() as c:
        r = c.put(
            f"/api/v1/devices/{device}/cameras/cam1/model",
            json={"model": swap.model, "version": swap.version, "variant": "fp32"},
        )
    assert r.status_code == 200, r.text
    ref = ArtifactRef.model_validate(r.json()["cameras"]["cam1"]["model"])
    sha, total = ref.manifest.sha256, ref.chunk_count
    assert ref.chunk_size == CHUNK

    def reached() -> bool:
        assert agent.alive(), _log(agent)[-3000:]
        return frozen.is_set()

    wait_for(reached, timeout=120, what=f"the agent {swap.phase} {new_key} (then frozen)")

    # Frozen mid-swap: what the controller shows, and what the agent did so far.
    def shown() -> dict[str, Any] | None:
        d = rig.device(device)
        cam = d["models"].get("cam1") or {}
        return d if cam.get("model") == new_key and cam.get("state") == swap.phase else None

    at_kill = wait_for(shown, timeout=15, what=f"the controller showing cam1 {swap.phase} {new_key}")
    assert at_kill["sync"] == "applying", at_kill["sync_reason"]
    agent.kill9()
    killed_at = outbox_state(agent)["next_seq"] - 1
    log_at_kill = _log(agent)
    assert f"camera cam1 now runs {new_key}" not in log_at_kill, "the swap was over before the kill"
    part, bitmap, final = (store / f"{sha}.{ext}" for ext in ("part", "bitmap", "onnx"))
    on_disk = 0
    if swap.phase == "fetching":
        assert part.exists() and not final.exists()
        have = json.loads(bitmap.read_text())["have"]
        assert len(have) == total
        on_disk = have.count("1")
        assert 0 < on_disk < total, f"{on_disk}/{total} chunks on disk at the kill"
        missing = {i for i, c in enumerate(have) if c == "0"}
        at = f"{at_kill['models']['cam1']['progress_pct']:.0f} %, {on_disk}/{total} chunks on disk"
    else:
        assert final.exists() and not part.exists() and not bitmap.exists()
        assert file_sha256(final) == sha
        loaded = f"model {new_key} ready on" in log_at_kill
        at = f"verified, {'loaded, not activated' if loaded else 'load and warm-up under way'}"

    # Restarted: the persisted desired state (the new model's) is applied again.
    mark = watch.mark()
    log_mark = agent.log.stat().st_size
    agent.start()

    def on_new_model() -> dict[str, Any] | None:
        assert agent.alive(), _log(agent, log_mark)[-3000:]
        d = rig.device(device)
        cam = d["models"].get("cam1") or {}
        done = d["sync"] == "in_sync" and cam.get("state") == "running" and cam.get("sha256") == sha
        return d if done else None

    after = wait_for(on_new_model, timeout=120, what=f"the restarted agent running {new_key}, in sync")
    assert after["reported_version"] == after["desired_version"]
    rig.wait_streaming(agent)
    restarted_log = _log(agent, log_mark)
    assert f"re-applying persisted desired state version {at_kill['desired_version']}" in restarted_log
    states = [c["state"] for c in watch.cam("cam1", mark) if c["model"] == new_key]
    assert "failed" not in states, states
    asked = set(watch.asked(sha, mark))
    if swap.phase == "fetching":
        # Resumed from the chunks on disk: asked only for the others, never the whole file again.
        assert f"resuming {sha[:12]}: {on_disk}/{total} chunks on disk" in restarted_log
        assert asked and asked <= missing, sorted(asked - missing)[:10]
        at += f", {len(asked)} asked after the restart"
    else:
        # The verified file on disk is loaded (its sha256 checked again first); nothing is fetched.
        assert "fetching" not in states, states
        assert not asked, sorted(asked)[:10]
    # The file the agent runs is the controller's, byte for byte; nothing of the transfer is left.
    assert file_sha256(final) == sha
    assert not part.exists() and not bitmap.exists()

    fig = rig.converge(agent, f"agent kill -9 mid-swap, {swap.phase} {new_key} ({at})")
    assert fig.lost == 0, fig
    assert fig.stored_twice == 0, fig
    assert fig.outbox_dropped_agent == 0, fig
    assert fig.stored == fig.published, fig

    events = rig.call("GET", "/api/v1/events", params={"device": device, "limit": 1000})
    assert not [e for e in events if e["kind"] == "model_failed"], "a model failed"
    activated = [e for e in events if e["kind"] == "model_activate" and e["data"].get("sha256") == sha]
    assert len(activated) == 1, activated  # once, by the restarted agent
    download_started = min(
        e["seq"] for e in events if e["kind"] == "model_download" and e["data"].get("sha256") == sha
    )
    # From the start of the transfer up to the kill the old model kept serving (the new one never ran);
    # the new one serves after the restart.
    models = _rows(
        rig,
        "SELECT DISTINCT seq > :b, model FROM detection WHERE device_id = :d AND seq > :a",
        device,
        a=download_started,
        b=killed_at,
    )
    assert {m for late, m in models if not late} == {OLD_KEY}, models
    assert new_key in {m for late, m in models if late}, models
    if swap.phase == "fetching":
        # Restarted mid-transfer: the old model (in the store, last fully applied) serves again while
        # the rest of the new one is fetched, as before the kill; the camera is not dark for the
        # whole resumed transfer.
        assert (
            "serving v" in restarted_log and "from the store until the newer desired state" in restarted_log
        )
        assert OLD_KEY in {m for late, m in models if late}, models


def _rows(rig: FaultStack, sql: str, device: str, **params: Any) -> list[tuple[Any, ...]]:
    with rig._engine.connect() as db:
        return [tuple(r) for r in db.execute(sa.text(sql), {"d": device, **params})]
