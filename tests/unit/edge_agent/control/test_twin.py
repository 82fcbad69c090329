from __future__ import annotations

import base64
import time
from collections.abc import Callable
from pathlib import Path

from fleet_protocol.messages import (
    Ack,
    Availability,
    CameraReported,
    Command,
    CommandResult,
    Event,
    EventKind,
)
from fleet_protocol.signing import signed_desired
from fleet_protocol.topics import TopicKind
from tests.support.edge_twin import (
    CONTROLLER_KEY,
    FakeTransport,
    Harness,
    desired,
    model_in_store,
    running,
)
from tests.support.waiting import wait_for


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
    cam = wait_for(failed_with(t, 2), what="v2 refused")
    assert cam.model == "good:1" and "manifest tampered" in (cam.error or "")

    t.deliver(TopicKind.TWIN_DESIRED, desired(3, remote, sign=False))
    cam = wait_for(failed_with(t, 3), what="v3 refused")
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
    wait_for(failed_with(t, 2), what="unsigned v2 refused")
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
    cam = wait_for(failed_with(t, 1), what="refused without a key")
    assert "no artifact public key configured" in (cam.error or "")
    assert "EDGEFLEET_ARTIFACT_PUBLIC_KEY" in (cam.error or "")
    assert harness.loads == []


def test_development_mode_runs_unsigned_models_only_when_no_key_is_set(harness: Harness) -> None:
    manifest = model_in_store(harness.data_dir, "a")
    _agent, t = harness.agent(artifact_public_key=None, require_signed_artifacts=False)
    t.deliver(TopicKind.TWIN_DESIRED, desired(1, manifest, sign=False))
    wait_for(running(t, 1, "a:1"), what="unsigned model running in development mode")
