"""Command results kept in the agent's outbox until the broker has them.

The commands thread runs a real command (a snapshot of a fake camera, encoded by OpenCV) and keeps the
result in a real outbox on disk; the link is a fake whose connection and PUBACKs the test decides.
After the command, the thread is stopped and the test drives the resend passes itself
(:meth:`CommandRunner.deliver`), so "not sent again" is a fact, not a wait.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_agent.control.commands import RESEND_S, CommandRunner
from edge_agent.uplink.outbox import Outbox
from fleet_protocol.codec import decode, encode
from fleet_protocol.messages import Command, CommandResult, EventKind
from fleet_protocol.topics import TopicKind
from tests.support.waiting import wait_for


class Delivery:
    def __init__(self) -> None:
        self.acked = False  # the broker's PUBACK

    def is_published(self) -> bool:
        return self.acked


class Link:
    """A transport whose connection and PUBACKs the test decides; records every result published."""

    def __init__(self, *, connected: bool) -> None:
        self.connected = connected
        self.lock = threading.Lock()
        self.sent: list[tuple[CommandResult, Delivery]] = []

    def publish(self, kind: TopicKind, payload: bytes) -> bool:
        return self.publish_tracked(kind, payload) is not None

    def publish_tracked(self, kind: TopicKind, payload: bytes) -> Delivery | None:
        if not self.connected:
            return None
        msg = decode(kind, payload)
        assert kind == TopicKind.COMMAND_RESULT and isinstance(msg, CommandResult)
        d = Delivery()
        with self.lock:
            self.sent.append((msg, d))
        return d

    def ids(self) -> list[str]:
        with self.lock:
            return [m.id for m, _ in self.sent]


@dataclass
class Frame:
    image: np.ndarray
    index: int = 7
    captured_at: float = 1.0


class Pipeline:
    """One camera with a noisy frame (a JPEG of a few kB), or none."""

    def __init__(self, *, frame: bool = True) -> None:
        self.cameras = ("cam1",)
        rng = np.random.default_rng(0)
        self._frame = Frame(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)) if frame else None

    def latest_frame(self, camera: str) -> Frame | None:
        return self._frame

    def last_result(self, camera: str) -> None:
        return None


@dataclass
class Publisher:
    events: list[tuple[EventKind, dict[str, Any]]] = field(default_factory=list)

    def emit_event(self, kind: EventKind, **kw: Any) -> int:
        self.events.append((kind, kw))
        return len(self.events)


@dataclass
class RunnerRig:
    """One CommandRunner in process on a fake link, pipeline and publisher, with a real outbox: a unit
    rig, not a tests.support.stack.Stack of processes."""

    runner: CommandRunner
    link: Link
    outbox: Outbox
    publisher: Publisher
    stop: threading.Event
    thread: threading.Thread

    def command(self, cmd_id: str, camera: str = "cam1") -> None:
        """Hand a snapshot command to the runner, as the link does, and wait until it is answered."""
        self.runner.on_message(Command(id=cmd_id, name="snapshot", args={"camera": camera}))
        wait_for(
            lambda: cmd_id in self.outbox.result_ids() or cmd_id in self.link.ids(), timeout=10, what=cmd_id
        )

    def stop_thread(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


@pytest.fixture
def make_rig(tmp_path: Path) -> Iterator[Any]:
    rigs: list[RunnerRig] = []

    def make(
        *, connected: bool, outbox: Outbox | None = None, frame: bool = True, resend_s: float = 0.0
    ) -> RunnerRig:
        link = Link(connected=connected)
        ob = outbox or Outbox(tmp_path / "outbox.db")
        publisher = Publisher()
        stop = threading.Event()
        runner = CommandRunner(
            device_id="dev-1",
            pipeline=Pipeline(frame=frame),  # type: ignore[arg-type]
            publisher=publisher,  # type: ignore[arg-type]
            transport=link,  # type: ignore[arg-type]
            outbox=ob,
            fetcher=None,  # type: ignore[arg-type]
            health=None,  # type: ignore[arg-type]
            applied_version=lambda: -1,
            stop=stop,
            resend_s=resend_s,  # 0: every pass may resend, so only what is in flight must not go again
        )
        thread = threading.Thread(target=runner.run, name="commands", daemon=True)
        thread.start()
        rig = RunnerRig(runner, link, ob, publisher, stop, thread)
        rigs.append(rig)
        return rig

    yield make
    for r in rigs:
        r.stop.set()
        r.thread.join(10)
        r.outbox.close()


def test_a_result_made_while_the_link_is_down_is_sent_once_it_is_back(make_rig: Any) -> None:
    rig: RunnerRig = make_rig(connected=False)
    rig.command("s1")
    rig.stop_thread()
    # Produced offline: on disk, nothing published.
    assert rig.outbox.result_ids() == ["s1"] and rig.link.sent == []

    rig.link.connected = True
    rig.runner.on_connected()
    rig.runner.deliver()
    ((msg, delivery),) = rig.link.sent
    assert msg.id == "s1" and msg.ok and msg.result["jpeg_base64"]
    # In flight on this connection: kept until the broker has it, and not sent again meanwhile.
    rig.runner.deliver()
    rig.runner.deliver()
    assert rig.link.ids() == ["s1"] and rig.outbox.result_ids() == ["s1"]

    delivery.acked = True
    rig.runner.deliver()
    assert rig.outbox.result_ids() == [] and rig.outbox.results_figures()["pending"] == 0
    # A later reconnect has nothing left to send.
    rig.runner.on_connected()
    rig.runner.deliver()
    assert rig.link.ids() == ["s1"]


def test_a_result_whose_puback_the_cut_took_is_sent_again_after_the_reconnect(make_rig: Any) -> None:
    rig: RunnerRig = make_rig(connected=True)
    rig.command("s1")
    rig.stop_thread()
    assert rig.link.ids() == ["s1"] and rig.outbox.result_ids() == ["s1"]  # published, no PUBACK yet

    rig.runner.on_connected()  # the link broke and came back: that PUBACK will never come
    rig.runner.deliver()
    assert rig.link.ids() == ["s1", "s1"]
    assert rig.link.sent[0][0] == rig.link.sent[1][0]  # the same result, not a second run

    rig.link.sent[1][1].acked = True
    rig.runner.deliver()
    assert rig.outbox.result_ids() == []


def test_a_puback_that_came_before_the_cut_counts(make_rig: Any) -> None:
    rig: RunnerRig = make_rig(connected=True)
    rig.command("s1")
    rig.stop_thread()
    rig.link.sent[0][1].acked = True  # acknowledged, then the link broke before the next pass
    rig.runner.on_connected()
    rig.runner.deliver()
    assert rig.link.ids() == ["s1"] and rig.outbox.result_ids() == []


def test_results_kept_before_a_restart_are_sent_by_the_next_agent(make_rig: Any, tmp_path: Path) -> None:
    first: RunnerRig = make_rig(connected=False)
    first.command("s1")
    first.stop_thread()
    first.outbox.close()

    # No reconnect and no resend timer (the default, 60 s): the first pass sends what was kept.
    again: RunnerRig = make_rig(connected=True, outbox=Outbox(tmp_path / "outbox.db"), resend_s=RESEND_S)
    again.stop_thread()  # its first pass may already have sent it; the pass below then adds nothing
    again.runner.deliver()
    assert again.link.ids() == ["s1"]
    again.link.sent[0][1].acked = True
    again.runner.deliver()
    assert again.outbox.result_ids() == []


def test_a_full_results_outbox_drops_pictures_first_then_whole_results_and_says_so(
    make_rig: Any, tmp_path: Path
) -> None:
    # Room for less than one picture, and for two results.
    ob = Outbox(tmp_path / "bounded.db", max_results=2, max_result_bytes=1500)
    rig: RunnerRig = make_rig(connected=False, outbox=ob)
    rig.command("s1")
    kept = decode(TopicKind.COMMAND_RESULT, ob.result_payload("s1") or b"")
    assert isinstance(kept, CommandResult)
    # The picture went, the result stayed and says why the picture is missing.
    assert kept.id == "s1" and not kept.ok and "picture dropped" in (kept.error or "")
    assert kept.result["jpeg_dropped"] is True and "jpeg_base64" not in kept.result
    assert kept.result["camera"] == "cam1" and kept.result["frame"] == 7
    assert rig.publisher.events == []  # nothing lost whole yet

    rig.command("s2")
    rig.command("s3")
    assert ob.result_ids() == ["s2", "s3"]
    assert ob.results_figures() == {"pending": 2, "dropped": 1, "pictures_dropped": 3}
    # The result lost whole is told through the seq outbox (the publisher), by id.
    ((kind, event),) = rig.publisher.events
    assert kind == EventKind.ERROR and event["data"] == {"error": "command_results_dropped", "ids": ["s1"]}


def _result(cmd_id: str, size: int) -> bytes:
    return encode(CommandResult(id=cmd_id, ok=True, result={"pad": "x" * size}))


def test_the_results_bound_takes_the_oldest_pictures_then_the_oldest_results(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "o.db", max_results=3, max_result_bytes=2500)
    big = {c: _result(c, 1000) for c in "abcd"}
    slim = {c: _result(c, 10) for c in "abcd"}
    for c in "ab":
        assert not ob.put_result(c, big[c], slim=slim[c], now=0.0)
    dropped = ob.put_result("c", big["c"], slim=slim["c"], now=0.0)
    # Over the bytes: only the oldest picture goes, and that is enough.
    assert dropped.pictures == ["a"] and dropped.results == []
    assert [ob.result_payload(c) for c in "abc"] == [slim["a"], big["b"], big["c"]]
    # Over the count: the oldest result goes whole, its picture already gone.
    dropped = ob.put_result("d", big["d"], slim=None, now=0.0)
    assert dropped.results == ["a"] and ob.result_ids() == ["b", "c", "d"]
    assert dropped.pictures == ["b"]  # b + c + d whole would be over the bytes again
    # A second result for a command already answered (a command delivered twice) is not kept.
    ob.put_result("c", _result("c", 5), slim=None, now=0.0)
    assert ob.result_payload("c") == big["c"]
    assert ob.results_delivered(["b", "zz"]) == 1 and ob.result_ids() == ["c", "d"]
    assert ob.results_figures() == {"pending": 2, "dropped": 1, "pictures_dropped": 2}
    ob.close()
    # The counts are on disk.
    assert Outbox(tmp_path / "o.db").results_figures() == {"pending": 2, "dropped": 1, "pictures_dropped": 2}
