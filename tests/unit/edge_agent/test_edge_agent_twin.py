from __future__ import annotations

import base64
import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_agent.agent import Agent
from edge_agent.core.settings import AgentSettings, CameraConfig, parse_settings
from edge_agent.uplink.link import ChunkHandler, MessageHandler
from fleet_protocol.codec import decode, encode
from fleet_protocol.messages import (
    Ack,
    ArtifactRef,
    Availability,
    CameraDesired,
    CameraReported,
    Command,
    CommandResult,
    DesiredState,
    Event,
    EventKind,
    InputSpec,
    Message,
    ModelManifest,
    ReportedState,
)
from fleet_protocol.signing import generate_private_key, public_key_b64, signed, signed_desired
from fleet_protocol.topics import TopicKind

# The controller's key in these tests: the agent trusts its public half, desired() signs with it.
CONTROLLER_KEY = generate_private_key()
PUBLIC_KEY = public_key_b64(CONTROLLER_KEY.public_key())


def wait_for(pred: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


class FakeTransport:
    """Connected at start; records what the agent publishes; tests deliver messages by hand."""

    def __init__(self) -> None:
        self.sent: list[tuple[TopicKind, Message]] = []
        self.handlers: dict[TopicKind, MessageHandler] = {}
        self.lock = threading.Lock()
        self._connected = False

    @property
    def connected(self) -> bool:
        return self._connected

    def publish(self, kind: TopicKind, payload: bytes) -> bool:
        with self.lock:
            self.sent.append((kind, decode(kind, payload)))
        return True

    def on_message(self, kind: TopicKind, handler: MessageHandler) -> None:
        self.handlers[kind] = handler

    def on_chunk(self, handler: ChunkHandler) -> None:
        pass

    def set_callbacks(
        self,
        *,
        birth: Callable[[], Availability],
        on_connected: Callable[[], None],
        on_fatal: Callable[[str], None],
    ) -> None:
        self.birth, self.on_connected = birth, on_connected

    def start(self) -> None:
        self._connected = True
        self.publish(TopicKind.AVAILABILITY, encode(self.birth()))
        self.on_connected()

    def stop(self) -> None:
        self._connected = False

    def deliver(self, kind: TopicKind, msg: Message) -> None:
        self.handlers[kind](msg)

    def of(self, cls: type) -> list:  # type: ignore[type-arg]
        with self.lock:
            return [m for _, m in self.sent if isinstance(m, cls)]

    def reported(self) -> ReportedState | None:
        reps = self.of(ReportedState)
        return reps[-1] if reps else None


class FakeBackend:
    provider = "FakeExecutionProvider"
    input_name = "x"
    input_shape: tuple[int | str | None, ...] = ("N", 16, 16, 3)
    dynamic_batch = True

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        if self.fail:
            raise RuntimeError("CUDA error: out of memory")
        b = batch.shape[0]
        return {
            "num_detections:0": np.ones((b,), np.float32),
            "detection_boxes:0": np.tile(np.array([[[0.1, 0.1, 0.9, 0.9]]], np.float32), (b, 1, 1)),
            "detection_scores:0": np.full((b, 1), 0.9, np.float32),
            "detection_classes:0": np.ones((b, 1), np.float32),
        }

    def close(self) -> None:
        pass


class Frames:
    fps: float | None = None

    def read(self) -> np.ndarray | None:
        time.sleep(0.01)
        return np.full((40, 60, 3), 50, np.uint8)

    def release(self) -> None:
        pass


def model_in_store(data_dir: Path, name: str) -> ModelManifest:
    blob = f"model bytes of {name}".encode() * 100
    sha = hashlib.sha256(blob).hexdigest()
    (data_dir / "models").mkdir(parents=True, exist_ok=True)
    (data_dir / "models" / f"{sha}.onnx").write_bytes(blob)
    return ModelManifest(
        name=name,
        version="1",
        sha256=sha,
        size=len(blob),
        decoder="tf_od",
        input=InputSpec(name="x", layout="NHWC", dtype="uint8", color="RGB", width=16, height=16),
        labels=["person"],
        decoder_params={"class_offset": 1},
    )


def settings(data_dir: Path, **extra: object) -> AgentSettings:
    return parse_settings(
        {
            "device_id": "dev-1",
            "data_dir": str(data_dir),
            "cameras": [CameraConfig(id="cam1", source="rtsp://fake").model_dump()],
            "outbox": {"batch_max_delay_s": 0.05},
            "artifact_public_key": PUBLIC_KEY,
            **extra,
        },
        env={},
    )


def desired(
    version: int,
    manifest: ModelManifest | None,
    *,
    sign: bool = True,
    sign_state: bool = True,
    device: str = "dev-1",
    **kw: object,
) -> DesiredState:
    """A desired state for ``device`` running ``manifest`` on cam1; the ref signed when ``sign``, the
    whole state (as the controller does) when ``sign_state``."""
    cams = {}
    if manifest:
        ref = ArtifactRef(manifest=manifest)
        cams = {"cam1": CameraDesired(model=signed(ref, CONTROLLER_KEY) if sign else ref, **kw)}  # type: ignore[arg-type]
    state = DesiredState(version=version, issued_at=time.time(), device_id=device, cameras=cams)
    return signed_desired(state, CONTROLLER_KEY) if sign_state else state


class Harness:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.loads: list[str] = []
        self.failing: set[str] = set()
        self.agents: list[Agent] = []

    def factory(self, path: Path, manifest: ModelManifest) -> FakeBackend:
        self.loads.append(manifest.name)
        return FakeBackend(fail=manifest.name in self.failing)

    def agent(self, **extra: object) -> tuple[Agent, FakeTransport]:
        t = FakeTransport()
        a = Agent.from_settings(
            settings(self.data_dir, **extra),
            transport=t,
            source_opener=lambda c: Frames(),
            backend_factory=self.factory,
        )
        self.agents.append(a)
        a.start()
        return a, t


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path / "data")
    yield h
    for a in h.agents:
        a.shutdown()


def running(t: FakeTransport, version: int, model: str) -> Callable[[], bool]:
    def check() -> bool:
        rep = t.reported()
        return bool(
            rep
            and rep.desired_version == version
            and rep.cameras["cam1"].state == "running"
            and rep.cameras["cam1"].model == model
        )

    return check


def test_only_newer_desired_versions_are_applied(harness: Harness) -> None:
    a_model = model_in_store(harness.data_dir, "a")
    b_model = model_in_store(harness.data_dir, "b")
    agent, t = harness.agent()
    t.deliver(TopicKind.TWIN_DESIRED, desired(2, a_model))
    wait_for(running(t, 2, "a:1"), what="v2 running")
    t.deliver(TopicKind.TWIN_DESIRED, desired(1, b_model))  # older: ignored
    t.deliver(TopicKind.TWIN_DESIRED, desired(2, b_model))  # same version (retained redelivery): ignored
    t.deliver(TopicKind.TWIN_DESIRED, desired(3, a_model, threshold=0.95))  # params only: no reload
    wait_for(lambda: (r := t.reported()) is not None and r.desired_version == 3, what="v3 applied")
    assert harness.loads == ["a"]
    assert agent.pipeline.model_of("cam1") is not None
    # Threshold 0.95 is above the fake's 0.9 scores: frames keep coming, empty.
    wait_for(lambda: (r := agent.pipeline.last_result("cam1")) is not None and r.detections == [])


def test_persisted_desired_is_reapplied_on_an_offline_restart(harness: Harness) -> None:
    manifest = model_in_store(harness.data_dir, "a")
    agent, t = harness.agent()
    v5 = desired(5, manifest)
    t.deliver(TopicKind.TWIN_DESIRED, v5)
    wait_for(running(t, 5, "a:1"), what="v5 running")
    agent.shutdown()

    agent2, t2 = harness.agent()  # nothing delivered: the broker is unreachable
    wait_for(running(t2, 5, "a:1"), what="v5 running from disk")
    wait_for(lambda: agent2.pipeline.last_result("cam1") is not None, what="detections after restart")
    t2.deliver(TopicKind.TWIN_DESIRED, v5)  # the retained copy arrives later: the same, ignored quietly
    assert harness.loads == ["a", "a"]
    assert agent2.twin.refused == {}


def test_a_model_that_fails_warm_up_leaves_the_old_one_serving(harness: Harness) -> None:
    good = model_in_store(harness.data_dir, "good")
    bad = model_in_store(harness.data_dir, "bad")
    harness.failing.add("bad")
    agent, t = harness.agent()
    t.deliver(TopicKind.TWIN_DESIRED, desired(1, good))
    wait_for(running(t, 1, "good:1"))
    t.deliver(TopicKind.TWIN_DESIRED, desired(2, bad))

    def failed() -> bool:
        rep = t.reported()
        return bool(rep and rep.desired_version == 2 and rep.cameras["cam1"].state == "failed")

    wait_for(failed, what="v2 reported failed")
    cam = t.reported().cameras["cam1"]  # type: ignore[union-attr]
    assert cam.model == "good:1" and "out of memory" in (cam.error or "")
    # Events go through the outbox and the publisher thread.
    wait_for(lambda: any(e.kind == "model_failed" for e in t.of(Event)), what="MODEL_FAILED event")
    failure = next(e for e in t.of(Event) if e.kind == "model_failed")
    assert failure.data["kept"] == "good:1" and failure.camera == "cam1"
    model = agent.pipeline.model_of("cam1")
    assert model is not None and model.key == "good:1"


def test_missing_model_is_fetched_and_unanswered_fetch_reports_failure(
    harness: Harness, tmp_path: Path
) -> None:
    manifest = model_in_store(tmp_path / "elsewhere", "remote")  # not in the agent's store
    agent, t = harness.agent()
    agent.fetcher.request_timeout_s = 0.05
    agent.fetcher.max_retries = 1
    t.deliver(TopicKind.TWIN_DESIRED, desired(1, manifest))

    def failed() -> bool:
        rep = t.reported()
        return bool(rep and rep.cameras["cam1"].state == "failed")

    wait_for(failed, what="fetch failure reported")
    assert "retries" in (t.reported().cameras["cam1"].error or "")  # type: ignore[union-attr]


def test_commands_answer_by_id(harness: Harness) -> None:
    manifest = model_in_store(harness.data_dir, "a")
    agent, t = harness.agent()
    t.deliver(TopicKind.TWIN_DESIRED, desired(1, manifest))
    wait_for(lambda: agent.pipeline.last_result("cam1") is not None)
    t.deliver(TopicKind.COMMANDS, Command(id="d1", name="diagnostics"))
    t.deliver(TopicKind.COMMANDS, Command(id="s1", name="snapshot", args={"camera": "cam1", "boxes": True}))
    t.deliver(TopicKind.COMMANDS, Command(id="s2", name="snapshot", args={"camera": "nope"}))
    t.deliver(TopicKind.COMMANDS, Command(id="r1", name="restart_pipeline"))
    wait_for(lambda: len(t.of(CommandResult)) == 4, what="4 command results")
    res = {r.id: r for r in t.of(CommandResult)}
    assert res["d1"].ok and res["d1"].result["cameras"][0]["model"] == "a:1"
    assert res["s1"].ok and res["s1"].result["boxes"] == 1
    jpeg = base64.b64decode(res["s1"].result["jpeg_base64"])
    assert jpeg[:2] == b"\xff\xd8"
    assert not res["s2"].ok and "unknown camera" in (res["s2"].error or "")
    # The restart happened: every camera reopened, and said so with a watchdog_restart event.
    assert res["r1"].ok and res["r1"].result == {"restarted": ["cam1"]}
    wait_for(
        lambda: any(
            e.kind == EventKind.WATCHDOG_RESTART and (e.data or {}).get("action") == "command"
            for e in t.of(Event)
        ),
        what="the pipeline restart reported as an event",
    )


def test_birth_heartbeat_and_acks(harness: Harness) -> None:
    manifest = model_in_store(harness.data_dir, "a")
    agent, t = harness.agent()
    birth = t.of(Availability)[0]
    assert (
        birth.state == "online" and birth.capabilities is not None and birth.capabilities.cameras == ["cam1"]
    )
    t.deliver(TopicKind.TWIN_DESIRED, desired(1, manifest))
    wait_for(lambda: agent.outbox.next_seq > 5, what="batches and events in the outbox")
    hb = agent.heartbeats.heartbeat()
    # Nothing acked yet: the heartbeat counts at least the 5 rows appended (and never more than exist).
    assert hb.cameras[0].camera == "cam1" and 5 <= hb.outbox_pending <= agent.outbox.next_seq - 1
    top = agent.outbox.next_seq - 1
    t.deliver(TopicKind.ACKS, Ack(upto=top))
    assert all(r.seq > top for r in agent.outbox.due(time.time() + 3600, 0, 10_000))
    # Only rows appended after the ack are still pending.
    assert agent.outbox.pending() <= agent.outbox.next_seq - 1 - top
    assert agent.heartbeats.heartbeat().outbox_pending <= agent.outbox.next_seq - 1 - top


def failed_with(t: FakeTransport, version: int) -> Callable[[], CameraReported | None]:
    def check() -> CameraReported | None:
        rep = t.reported()
        if rep and rep.desired_version == version and rep.cameras["cam1"].state == "failed":
            return rep.cameras["cam1"]
        return None

    return check


def test_a_ref_that_fails_its_signature_is_refused_before_anything_is_fetched(
    harness: Harness, tmp_path: Path
) -> None:
    good = model_in_store(harness.data_dir, "good")
    remote = model_in_store(tmp_path / "elsewhere", "remote")  # would have to be fetched
    agent, t = harness.agent()
    t.deliver(TopicKind.TWIN_DESIRED, desired(1, good))
    wait_for(running(t, 1, "good:1"))

    # A ref that does not check out inside a state that does (say, a ref signed under a key since
    # replaced): the ref's own signature is still checked, per camera.
    forged = desired(2, remote, sign_state=False)
    ref = forged.cameras["cam1"].model
    assert ref is not None
    forged.cameras["cam1"].model = ref.model_copy(
        update={"manifest": ref.manifest.model_copy(update={"labels": ["person", "car"]})}
    )
    t.deliver(TopicKind.TWIN_DESIRED, signed_desired(forged, CONTROLLER_KEY))
    cam = wait_for_value(failed_with(t, 2), "v2 refused")
    assert cam.model == "good:1" and "manifest tampered" in (cam.error or "")

    t.deliver(TopicKind.TWIN_DESIRED, desired(3, remote, sign=False))
    cam = wait_for_value(failed_with(t, 3), "v3 refused")
    assert cam.model == "good:1" and "unsigned artifact" in (cam.error or "")

    wait_for(
        lambda: sum(1 for e in t.of(Event) if e.kind == "model_failed") == 2, what="two MODEL_FAILED events"
    )
    events = [e for e in t.of(Event) if e.kind == "model_failed"]
    assert [e.data["check"] for e in events] == ["signature", "signature"]
    assert all(e.data["kept"] == "good:1" for e in events)
    assert not agent.fetcher.path_for(remote.sha256).exists()
    assert not any(k == TopicKind.ARTIFACT_REQUEST for k, _ in t.sent), "nothing was asked for"
    model = agent.pipeline.model_of("cam1")
    assert model is not None and model.key == "good:1"
    assert harness.loads == ["good"]


def test_signed_params_change_of_the_running_model_applies_but_an_unsigned_one_does_not(
    harness: Harness,
) -> None:
    manifest = model_in_store(harness.data_dir, "a")
    agent, t = harness.agent()
    t.deliver(TopicKind.TWIN_DESIRED, desired(1, manifest))
    wait_for(running(t, 1, "a:1"))
    t.deliver(TopicKind.TWIN_DESIRED, desired(2, manifest, sign=False, threshold=0.95))
    wait_for_value(failed_with(t, 2), "unsigned v2 refused")
    last = agent.pipeline.last_result("cam1")
    after = last.frame if last else -1
    # The refused state's threshold (above the fake's 0.9 scores) was not applied: newer frames still
    # carry detections.
    wait_for(
        lambda: (r := agent.pipeline.last_result("cam1")) is not None and r.frame > after and r.detections,
        what="detections on frames after the refusal",
    )
    t.deliver(TopicKind.TWIN_DESIRED, desired(3, manifest, threshold=0.95))
    wait_for(running(t, 3, "a:1"), what="signed v3 applied")
    wait_for(
        lambda: (r := agent.pipeline.last_result("cam1")) is not None and r.detections == [],
        what="the signed threshold applied",
    )


def test_without_a_key_every_model_is_refused_with_the_way_out(harness: Harness) -> None:
    manifest = model_in_store(harness.data_dir, "a")
    _agent, t = harness.agent(artifact_public_key=None)
    t.deliver(TopicKind.TWIN_DESIRED, desired(1, manifest))
    cam = wait_for_value(failed_with(t, 1), "refused without a key")
    assert "no artifact public key configured" in (cam.error or "")
    assert "EDGEFLEET_ARTIFACT_PUBLIC_KEY" in (cam.error or "")
    assert harness.loads == []


def test_development_mode_runs_unsigned_models_only_when_no_key_is_set(harness: Harness) -> None:
    manifest = model_in_store(harness.data_dir, "a")
    _agent, t = harness.agent(artifact_public_key=None, require_signed_artifacts=False)
    t.deliver(TopicKind.TWIN_DESIRED, desired(1, manifest, sign=False))
    wait_for(running(t, 1, "a:1"), what="unsigned model running in development mode")


def wait_for_value(check: Callable[[], CameraReported | None], what: str) -> CameraReported:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        value = check()
        if value is not None:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")
