"""What the twin keeps in the models' store, a desired state that arrives during a download, and the
reported state published last being the newest."""

from __future__ import annotations

import threading

from edge_agent.agent import Agent
from fleet_protocol.messages import ArtifactRequest, CameraReported
from fleet_protocol.topics import TopicKind
from tests.support.edge_twin import (
    FakeTransport,
    Frames,
    Harness,
    desired,
    model_in_store,
    running,
    settings,
)
from tests.support.waiting import wait_for


def test_collection_keeps_the_running_and_the_rollback_model_and_drops_the_rest(harness: Harness) -> None:
    a = model_in_store(harness.data_dir, "a")
    b = model_in_store(harness.data_dir, "b")
    c = model_in_store(harness.data_dir, "c")
    agent, t = harness.agent()
    for version, manifest in ((1, a), (2, b), (3, c)):
        t.deliver(TopicKind.TWIN_DESIRED, desired(version, manifest))
        wait_for(running(t, version, f"{manifest.name}:1"), what=f"v{version} running")
    wait_for(lambda: agent.twin.needed_models() == {b.sha256, c.sha256}, what="c running, b its rollback")

    gone = agent.fetcher.collect(force=True)  # as when a download needs the room

    assert gone.files == (a.sha256,)
    assert agent.fetcher.has(b.sha256) and agent.fetcher.has(c.sha256)
    # Rolling back finds b in the store: nothing is asked of the controller.
    t.deliver(TopicKind.TWIN_DESIRED, desired(4, b))
    wait_for(running(t, 4, "b:1"), what="v4 (rollback to b) running")
    assert t.of(ArtifactRequest) == []


def test_the_rollback_model_is_still_kept_after_a_restart(harness: Harness) -> None:
    a = model_in_store(harness.data_dir, "a")
    b = model_in_store(harness.data_dir, "b")
    agent, t = harness.agent()
    t.deliver(TopicKind.TWIN_DESIRED, desired(1, a))
    wait_for(running(t, 1, "a:1"), what="v1 running")
    t.deliver(TopicKind.TWIN_DESIRED, desired(2, b))
    wait_for(running(t, 2, "b:1"), what="v2 running")
    wait_for(lambda: a.sha256 in agent.twin.needed_models(), what="a kept as b's rollback")
    agent.shutdown()

    agent2, t2 = harness.agent()
    wait_for(running(t2, 2, "b:1"), what="v2 running after the restart")
    agent2.fetcher.collect(force=True)
    assert agent2.fetcher.has(a.sha256) and agent2.fetcher.has(b.sha256)


def test_a_newer_state_back_to_a_stored_model_does_not_wait_for_a_stalled_download(
    harness: Harness,
) -> None:
    a = model_in_store(harness.data_dir, "a")
    b = model_in_store(harness.data_dir, "b")
    agent, t = harness.agent()
    agent.fetcher.path_for(b.sha256).unlink()  # b must come over the link, which never answers
    t.deliver(TopicKind.TWIN_DESIRED, desired(1, a))
    wait_for(running(t, 1, "a:1"), what="v1 running")
    t.deliver(TopicKind.TWIN_DESIRED, desired(2, b))
    wait_for(lambda: t.of(ArtifactRequest), what="b's chunks asked for")

    t.deliver(TopicKind.TWIN_DESIRED, desired(3, a))

    wait_for(running(t, 3, "a:1"), what="v3 (back to a) running while b's transfer is stalled")
    assert not agent.fetcher.has(b.sha256)
    assert harness.loads == ["a"], "a kept serving: no reload, and b never loaded"


class GatedTransport(FakeTransport):
    """Holds the reported-state publishes of the thread named ``gated`` until ``release`` is set, as
    when the link's thread is descheduled between building a report and publishing it."""

    def __init__(self) -> None:
        super().__init__()
        self.gated: str | None = None
        self.entered = threading.Event()
        self.release = threading.Event()

    def publish(self, kind: TopicKind, payload: bytes) -> bool:
        if kind == TopicKind.TWIN_REPORTED and threading.current_thread().name == self.gated:
            self.entered.set()
            self.release.wait(10)
        return super().publish(kind, payload)


def test_a_report_overtaken_by_a_newer_one_does_not_leave_the_older_state_published(
    harness: Harness,
) -> None:
    t = GatedTransport()
    agent = Agent.from_settings(
        settings(harness.data_dir),
        transport=t,
        source_opener=lambda c: Frames(),
        backend_factory=harness.factory,
    )
    harness.agents.append(agent)
    agent.start()
    t.gated = "link"
    link = threading.Thread(target=agent.twin.report, name="link")  # the report of a (re)connect
    link.start()
    assert t.entered.wait(10)

    newer = CameraReported(state="failed", error="the newest word")
    agent.twin.set_reported("cam1", newer)  # the twin thread's report, meanwhile
    t.release.set()
    link.join(10)

    last = t.reported()
    assert last is not None and last.cameras["cam1"] == newer
