"""Reachability of pool camera sources (PROTOCOL.md "Pool cameras", "Reachability"): the sources a
desired state asks the device to probe are checked on the probe thread, by TCP connection or file,
without a secret, and the heartbeat reports the cameras probed."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_agent.control.reach import DEFAULT_PORTS, ReachProbes, probe_source, tcp_connects
from fleet_protocol.codec import decode, encode
from fleet_protocol.messages import Heartbeat
from fleet_protocol.topics import TopicKind
from tests.support.edge_twin import FakeTransport, Harness, camera, model_in_store, state
from tests.support.waiting import wait_for


class FakeConnect:
    """The probes' TCP connection: answers per host, records each call; a host in ``held`` answers
    only once released."""

    def __init__(self, down: set[str] | None = None) -> None:
        self.down = down or set()
        self.calls: list[tuple[str, int, float]] = []
        self.at: dict[str, float] = {}  # host -> time.monotonic() of its first probe
        self.held: dict[str, threading.Event] = {}
        self.lock = threading.Lock()

    def __call__(self, host: str, port: int, timeout_s: float) -> bool:
        with self.lock:
            self.calls.append((host, port, timeout_s))
            self.at.setdefault(host, time.monotonic())
            gate = self.held.get(host)
        if gate is not None:
            gate.wait(10.0)
        return host not in self.down

    def hosts(self) -> list[str]:
        with self.lock:
            return [h for h, _, _ in self.calls]


@pytest.fixture
def listener() -> Iterator[int]:
    """The port of a local socket that accepts connections."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A local port that refuses connections: bound (so nothing else takes it), never listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def running(probes: ReachProbes) -> threading.Thread:
    thread = threading.Thread(target=probes.run, name="reach", daemon=True)
    thread.start()
    return thread


# ---------------------------------------------------------------------------- one probe


def test_a_listening_socket_is_reached_and_a_closed_port_is_not(listener: int, closed_port: int) -> None:
    assert tcp_connects("127.0.0.1", listener, 2.0)
    assert tcp_connects("localhost", listener, 2.0), "a name is looked up within the timeout"
    assert not tcp_connects("127.0.0.1", closed_port, 2.0)
    # The real connection behind a source's secret reference: no secret is read or needed.
    assert probe_source(f"rtsp://{{secret:door}}@127.0.0.1:{listener}/stream1")
    assert not probe_source(f"http://127.0.0.1:{closed_port}/mjpeg?token={{secret:door}}")


def test_the_host_and_port_probed_skip_the_userinfo_and_default_by_scheme() -> None:
    connect = FakeConnect()
    for source in (
        "rtsp://{secret:north}@10.0.0.21/stream1",
        "rtsps://cam.example/s",
        "http://cam.example/mjpeg?token={secret:t}",
        "HTTPS://{secret:a}@cam.example:8443/x",
        "rtsp://[fd00::7]:8554/s",
    ):
        assert probe_source(source, connect, 2.0)
    assert connect.calls == [
        ("10.0.0.21", 554, 2.0),
        ("cam.example", 322, 2.0),
        ("cam.example", 80, 2.0),
        ("cam.example", 8443, 2.0),
        ("fd00::7", 8554, 2.0),
    ]
    assert DEFAULT_PORTS == {"rtsp": 554, "rtsps": 322, "http": 80, "https": 443}
    # Not reached, and nothing connected: a scheme the device cannot open, a host that is a secret,
    # a port out of range, no host.
    for source in (
        "ftp://cam.example/x",
        "rtsp://{secret:host}/s",
        "rtsp://cam.example:70000/s",
        "rtsp:///s",
    ):
        assert not probe_source(source, connect, 2.0), source
    assert len(connect.calls) == 5
    assert not probe_source("rtsp://down.example/s", FakeConnect(down={"down.example"}), 2.0)


def test_a_file_source_is_reached_when_the_file_exists(tmp_path: Path) -> None:
    (tmp_path / "dock 2.mp4").write_bytes(b"\0")
    (tmp_path / "clips").mkdir()
    assert probe_source(f"file://{tmp_path}/dock%202.mp4")
    assert probe_source(f"file://localhost{tmp_path}/dock%202.mp4")
    assert not probe_source(f"file://{tmp_path}/gone.mp4")
    assert not probe_source(f"file://{tmp_path}/clips"), "a directory is not a file"
    # The file-URL rules of the pool cameras: no host but localhost, no query.
    assert not probe_source(f"file://nas{tmp_path}/dock%202.mp4")
    assert not probe_source(f"file://{tmp_path}/dock%202.mp4?loop=1")


# ---------------------------------------------------------------------------- the probe thread


def test_only_the_cameras_probed_are_reported_and_a_dropped_one_is_forgotten_at_once(
    stop: threading.Event,
) -> None:
    connect = FakeConnect(down={"b.example"})
    connect.held["c.example"] = threading.Event()
    probes = ReachProbes(stop=stop, interval_s=3600.0, first_round_s=0.0, connect=connect)
    thread = running(probes)
    probes.set_probes({"a": "rtsp://a.example/s", "b": "rtsp://b.example/s", "c": "rtsp://c.example/s"})
    wait_for(lambda: "c.example" in connect.hosts(), what="the round reaching c")
    assert probes.reach() == {"a": True, "b": False}, "c is being probed: not reported yet"
    connect.held["c.example"].set()
    wait_for(lambda: probes.reach() == {"a": True, "b": False, "c": True}, what="c probed")

    # a dropped, c given another source: both leave the report before any probe; b stays.
    probes.set_probes({"b": "rtsp://b.example/s", "c": "rtsp://c2.example/s"})
    assert probes.reach() == {"b": False}
    wait_for(lambda: probes.reach() == {"b": False, "c": True}, what="c probed at its new source")
    stop.set()
    thread.join(2.0)
    assert not thread.is_alive()


def test_a_new_set_is_probed_within_the_first_round_delay(stop: threading.Event) -> None:
    connect = FakeConnect()
    first_round_s = 0.3
    # Rounds an hour apart: only a new set's first round can probe within the wait.
    probes = ReachProbes(stop=stop, interval_s=3600.0, first_round_s=first_round_s, connect=connect)
    running(probes)

    def set_and_wait(host: str) -> None:
        given = time.monotonic()
        probes.set_probes({"cam": f"rtsp://{host}/s"})
        wait_for(lambda: host in connect.at, timeout=first_round_s + 1.0, what=f"{host} probed")
        # Not before the delay either: states applied back to back make one round.
        assert connect.at[host] - given >= first_round_s

    set_and_wait("a.example")
    set_and_wait("b.example")  # during the hour's wait


def test_rounds_repeat_and_follow_the_source(stop: threading.Event) -> None:
    connect = FakeConnect()
    probes = ReachProbes(stop=stop, interval_s=0.02, first_round_s=0.0, connect=connect)
    running(probes)
    probes.set_probes({"cam": "rtsp://cam.example/s"})
    wait_for(lambda: probes.reach() == {"cam": True}, what="reached")
    connect.down.add("cam.example")
    wait_for(lambda: probes.reach() == {"cam": False}, what="a later round: not reached any more")
    assert len(connect.calls) >= 2


def test_a_round_is_bounded_to_64_sources(stop: threading.Event) -> None:
    connect = FakeConnect()
    probes = ReachProbes(stop=stop, interval_s=3600.0, first_round_s=0.0, connect=connect)
    running(probes)
    probes.set_probes({f"cam{i:02}": f"rtsp://h{i:02}.example/s" for i in range(70)})
    assert len(probes.probes()) == 64
    wait_for(lambda: len(probes.reach()) == 64, what="the first round")
    assert len(connect.calls) == 64


def test_the_stop_event_ends_the_thread_mid_wait_and_mid_round(stop: threading.Event) -> None:
    idle = ReachProbes(stop=stop, interval_s=3600.0, connect=FakeConnect())
    waiting = ReachProbes(stop=stop, interval_s=3600.0, first_round_s=0.0, connect=FakeConnect())
    slow = FakeConnect()
    slow.held["h00.example"] = threading.Event()
    busy = ReachProbes(stop=stop, interval_s=3600.0, first_round_s=0.0, connect=slow)
    threads = [running(p) for p in (idle, waiting, busy)]
    waiting.set_probes({"cam": "rtsp://cam.example/s"})
    busy.set_probes({f"cam{i:02}": f"rtsp://h{i:02}.example/s" for i in range(10)})
    wait_for(lambda: waiting.reach(), what="a round done, an hour's wait begun")
    wait_for(lambda: slow.hosts() == ["h00.example"], what="a probe under way")
    stopped = time.monotonic()
    stop.set()
    slow.held["h00.example"].set()  # the probe under way ends (its timeout, in the real one)
    for thread in threads:
        thread.join(2.0)
        assert not thread.is_alive(), thread.name
    assert time.monotonic() - stopped < 1.0
    assert slow.hosts() == ["h00.example"], "no probe after the stop"


def test_a_new_set_ends_the_round_under_way(stop: threading.Event) -> None:
    connect = FakeConnect()
    connect.held["a.example"] = threading.Event()
    probes = ReachProbes(stop=stop, interval_s=3600.0, first_round_s=0.0, connect=connect)
    running(probes)
    probes.set_probes({"a": "rtsp://a.example/s", "b": "rtsp://b.example/s"})
    wait_for(lambda: connect.hosts() == ["a.example"], what="a under way")
    probes.set_probes({"d": "rtsp://d.example/s"})
    connect.held["a.example"].set()
    wait_for(lambda: probes.reach() == {"d": True}, what="the new set probed")
    assert connect.hosts() == ["a.example", "d.example"], "b, of the old set, never probed"


# ---------------------------------------------------------------------------- twin and heartbeat


def heartbeat_reach(agent_heartbeat: Heartbeat) -> dict[str, bool]:
    """The reach of a heartbeat as the controller decodes it."""
    hb = decode(TopicKind.HEARTBEAT, encode(agent_heartbeat))
    assert isinstance(hb, Heartbeat)
    return hb.reach


def applied(t: FakeTransport, version: int) -> bool:
    rep = t.reported()
    return rep is not None and rep.desired_version == version


def test_the_probe_set_of_an_applied_state_is_probed_and_its_outcome_sent_in_the_heartbeat(
    harness: Harness, tmp_path: Path
) -> None:
    model = model_in_store(harness.data_dir, "a")
    (tmp_path / "dock.mp4").write_bytes(b"\0")
    dock, yard = f"file://{tmp_path}/dock.mp4", f"file://{tmp_path}/yard.mp4"
    agent, t = harness.agent()
    assert agent.reach is not None and "reach" in [th.name for th in threading.enumerate()]
    t.deliver(
        TopicKind.TWIN_DESIRED,
        # gate runs here: the state gives it, so it is not probed whatever probe says.
        state(
            1,
            {"cam1": camera(model), "gate": camera(model, source=dock)},
            probe={"dock": dock, "yard": yard, "gate": dock},
        ),
    )
    wait_for(lambda: applied(t, 1), what="v1 applied")
    assert agent.reach.probes() == {"dock": dock, "yard": yard}
    wait_for(
        lambda: heartbeat_reach(agent.heartbeats.heartbeat()) == {"dock": True, "yard": False},
        timeout=5.0,
        what="the first round in the heartbeat",
    )

    # yard dropped: gone from the very next heartbeat, before any probe.
    t.deliver(TopicKind.TWIN_DESIRED, state(2, {"cam1": camera(model)}, probe={"dock": dock}))
    wait_for(lambda: applied(t, 2), what="v2 applied")
    assert heartbeat_reach(agent.heartbeats.heartbeat()) == {"dock": True}

    # Nothing to probe: the heartbeat has no reach at all.
    t.deliver(TopicKind.TWIN_DESIRED, state(3, {"cam1": camera(model)}))
    wait_for(lambda: applied(t, 3), what="v3 applied")
    assert agent.reach.probes() == {}
    assert b'"reach"' not in encode(agent.heartbeats.heartbeat())


def test_the_probe_set_comes_back_with_the_persisted_state_after_a_restart(
    harness: Harness, tmp_path: Path
) -> None:
    model = model_in_store(harness.data_dir, "a")
    gone = f"file://{tmp_path}/gone.mp4"
    first, t = harness.agent()
    t.deliver(TopicKind.TWIN_DESIRED, state(1, {"cam1": camera(model)}, probe={"yard": gone}))
    wait_for(lambda: applied(t, 1), what="v1 applied")
    first.shutdown()
    again, _ = harness.agent()  # offline: the persisted state only
    wait_for(lambda: again.reach is not None and again.reach.probes() == {"yard": gone}, what="handed over")
    wait_for(lambda: heartbeat_reach(again.heartbeats.heartbeat()) == {"yard": False}, what="probed")
