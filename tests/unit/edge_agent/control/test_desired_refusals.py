"""The agent obeys only a desired state the controller signed for it: each refusal, as a whole, with an
event naming why; nothing of a refused state is stored or applied, and the agent keeps running.

The agent is real (pipeline, outbox, twin thread); the transport is the fake of the twin tests.
"""

from __future__ import annotations

import time
from pathlib import Path

from fleet_protocol.codec import encode
from fleet_protocol.desired import (
    REFUSED_CONFLICT,
    REFUSED_DEVICE,
    REFUSED_ISSUED_AT,
    REFUSED_SIGNATURE,
    REFUSED_STALE,
)
from fleet_protocol.messages import DesiredState, Event, EventKind, ModelManifest
from fleet_protocol.signing import generate_private_key, signed_desired
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


def refusal(t: FakeTransport, reason: str) -> Event:
    def find() -> Event | None:
        for e in t.of(Event):
            if (
                e.kind == EventKind.ERROR
                and e.data.get("check") == "desired_state"
                and e.data["reason"] == reason
            ):
                return e
        return None

    wait_for(find, what=f"a refusal event ({reason})")
    event = find()
    assert event is not None
    return event


def persisted_version(data_dir: Path) -> int:
    return DesiredState.model_validate_json((data_dir / "desired.json").read_bytes()).version


def running_a(harness: Harness) -> tuple[FakeTransport, ModelManifest, ModelManifest, DesiredState]:
    a = model_in_store(harness.data_dir, "a")
    b = model_in_store(harness.data_dir, "b")
    _agent, t = harness.agent()
    v2 = desired(2, a, threshold=0.3)
    t.deliver(TopicKind.TWIN_DESIRED, v2)
    wait_for(running(t, 2, "a:1"), what="v2 running a")
    return t, a, b, v2


def still_runs_a(harness: Harness, t: FakeTransport, version: int = 2) -> None:
    agent = harness.agents[-1]
    model = agent.pipeline.model_of("cam1")
    assert model is not None and model.key == "a:1"
    params = agent.pipeline.params_of("cam1")
    assert params is not None and params.threshold == 0.3
    assert agent.twin.applied_version == version
    assert persisted_version(harness.data_dir) == version
    assert harness.loads == ["a"]


def test_unsigned_state_is_refused_as_a_whole(harness: Harness) -> None:
    t, _a, b, _ = running_a(harness)
    t.deliver(TopicKind.TWIN_DESIRED, desired(3, b, sign_state=False))
    event = refusal(t, REFUSED_SIGNATURE)
    assert (
        "unsigned desired state" in event.message and event.severity == "error" and event.data["version"] == 3
    )
    still_runs_a(harness, t)


def test_state_signed_by_another_key_is_refused(harness: Harness) -> None:
    t, _a, b, _ = running_a(harness)
    other = desired(3, b, sign_state=False)
    t.deliver(TopicKind.TWIN_DESIRED, signed_desired(other, generate_private_key()))
    event = refusal(t, REFUSED_SIGNATURE)
    assert "signed with key" in event.message
    still_runs_a(harness, t)


def test_altered_threshold_is_refused(harness: Harness) -> None:
    """the per-camera settings are signed; blinding a camera breaks the signature."""
    t, a, _b, _ = running_a(harness)
    good = desired(3, a, threshold=0.3)
    cams = {"cam1": good.cameras["cam1"].model_copy(update={"threshold": 1.0, "labels": ["__nothing__"]})}
    t.deliver(TopicKind.TWIN_DESIRED, good.model_copy(update={"cameras": cams}))
    event = refusal(t, REFUSED_SIGNATURE)
    assert "desired state altered" in event.message
    still_runs_a(harness, t)


def test_state_signed_for_another_device_is_refused(harness: Harness) -> None:
    t, _a, b, _ = running_a(harness)
    t.deliver(TopicKind.TWIN_DESIRED, desired(3, b, device="dev-2"))
    event = refusal(t, REFUSED_DEVICE)
    assert "'dev-2'" in event.message and event.data["device_id"] == "dev-2"
    t.deliver(
        TopicKind.TWIN_DESIRED,
        signed_desired(
            desired(4, b, sign_state=False).model_copy(update={"device_id": None}), CONTROLLER_KEY
        ),
    )
    wait_for(lambda: harness.agents[-1].twin.refused.get(REFUSED_DEVICE) == 2, what="no device refused")
    still_runs_a(harness, t)


def test_older_version_is_refused_and_same_version_other_content_too(harness: Harness) -> None:
    """an old, validly signed state replayed under its own version changes nothing."""
    a = model_in_store(harness.data_dir, "a")
    b = model_in_store(harness.data_dir, "b")
    agent, t = harness.agent()
    old_b = desired(1, b)
    t.deliver(TopicKind.TWIN_DESIRED, old_b)
    wait_for(running(t, 1, "b:1"), what="v1 running b")
    v2 = desired(2, a, threshold=0.3)
    t.deliver(TopicKind.TWIN_DESIRED, v2)
    wait_for(running(t, 2, "a:1"), what="v2 running a")
    harness.loads.clear()
    harness.loads.append("a")

    t.deliver(TopicKind.TWIN_DESIRED, old_b)  # replayed
    event = refusal(t, REFUSED_STALE)
    assert event.data == {**event.data, "version": 1, "have": 2} and event.severity == "warning"
    t.deliver(TopicKind.TWIN_DESIRED, desired(2, b))  # same version, other content
    refusal(t, REFUSED_CONFLICT)
    t.deliver(TopicKind.TWIN_DESIRED, v2)  # the retained copy: quietly ignored
    time.sleep(0.2)
    assert agent.twin.refused == {REFUSED_STALE: 1, REFUSED_CONFLICT: 1}
    still_runs_a(harness, t)


def test_state_issued_before_the_one_it_has_is_refused(harness: Harness) -> None:
    t, _a, b, v2 = running_a(harness)
    earlier = desired(3, b, sign_state=False).model_copy(update={"issued_at": v2.issued_at - 10})
    t.deliver(TopicKind.TWIN_DESIRED, signed_desired(earlier, CONTROLLER_KEY))
    refusal(t, REFUSED_ISSUED_AT)
    still_runs_a(harness, t)


def test_a_refusal_repeated_is_reported_once_and_the_next_real_state_applies(harness: Harness) -> None:
    t, _a, b, _ = running_a(harness)
    forged = desired(3, b, sign_state=False)
    for _ in range(5):  # a refused retained state comes back on every reconnect
        t.deliver(TopicKind.TWIN_DESIRED, forged)
    refusal(t, REFUSED_SIGNATURE)
    agent = harness.agents[-1]
    assert agent.twin.refused[REFUSED_SIGNATURE] == 5
    assert sum(1 for e in t.of(Event) if e.data.get("check") == "desired_state") == 1
    t.deliver(TopicKind.TWIN_DESIRED, desired(3, b))  # the controller's real v3
    wait_for(running(t, 3, "b:1"), what="the real v3 applied")
    assert persisted_version(harness.data_dir) == 3


def test_two_different_forgeries_of_one_signed_state_are_each_reported(harness: Harness) -> None:
    """Same version, issue time, signature and reason, different altered settings: two attacks, two
    events (a once-a-minute repeat filter keyed on the signature alone hid the second)."""
    t, a, _b, _ = running_a(harness)
    good = desired(3, a, threshold=0.3)
    for change in ({"threshold": 1.0}, {"threshold": 1.0, "labels": ["__nothing__"]}):
        cams = {"cam1": good.cameras["cam1"].model_copy(update=change)}
        t.deliver(TopicKind.TWIN_DESIRED, good.model_copy(update={"cameras": cams}))
    wait_for(
        lambda: sum(1 for e in t.of(Event) if e.data.get("reason") == REFUSED_SIGNATURE) == 2 or None,
        what="two signature refusal events",
    )
    still_runs_a(harness, t)


def test_a_desired_json_altered_on_disk_is_refused_at_start(harness: Harness) -> None:
    """what is on disk is checked again; an altered file is not run."""
    _t, _a, _b, v2 = running_a(harness)
    harness.agents[-1].shutdown()
    path = harness.data_dir / "desired.json"
    cams = {"cam1": v2.cameras["cam1"].model_copy(update={"threshold": 1.0})}
    path.write_bytes(encode(v2.model_copy(update={"cameras": cams})))

    agent2, t2 = harness.agent()
    event = refusal(t2, REFUSED_SIGNATURE)
    assert "desired.json on disk" in event.message
    assert agent2.pipeline.model_of("cam1") is None
    t2.deliver(TopicKind.TWIN_DESIRED, v2)  # the controller's retained state still applies
    wait_for(running(t2, 2, "a:1"), what="v2 from the broker")
    params = agent2.pipeline.params_of("cam1")
    assert params is not None and params.threshold == 0.3


def test_reported_state_carries_the_effective_settings(harness: Harness) -> None:
    a = model_in_store(harness.data_dir, "a")
    _agent, t = harness.agent()
    t.deliver(TopicKind.TWIN_DESIRED, desired(1, a))
    wait_for(running(t, 1, "a:1"))
    cam = t.reported().cameras["cam1"]  # type: ignore[union-attr]
    assert (cam.threshold, cam.max_fps, cam.labels) == (a.default_threshold, None, None)
    t.deliver(TopicKind.TWIN_DESIRED, desired(2, a, threshold=0.7, max_fps=3.0, labels=["person", "car"]))
    wait_for(running(t, 2, "a:1"))
    cam = t.reported().cameras["cam1"]  # type: ignore[union-attr]
    assert (cam.threshold, cam.max_fps, cam.labels) == (0.7, 3.0, ["car", "person"])


def test_without_a_key_in_development_mode_unsigned_states_still_run(harness: Harness) -> None:
    a = model_in_store(harness.data_dir, "a")
    agent, t = harness.agent(artifact_public_key=None, require_signed_artifacts=False)
    t.deliver(TopicKind.TWIN_DESIRED, desired(1, a, sign=False, sign_state=False))
    wait_for(running(t, 1, "a:1"), what="unsigned state running in development mode")
    t.deliver(TopicKind.TWIN_DESIRED, desired(2, a, sign=False, sign_state=False, device="dev-2"))
    refusal(t, REFUSED_DEVICE)  # a state naming another device is still not for this one
    assert agent.twin.applied_version == 1
