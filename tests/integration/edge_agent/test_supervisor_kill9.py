"""The supervisor survives its own ``kill -9`` as systemd's unit runs it (docker/systemd/edgefleet-agent.service:
``KillMode=mixed``, ``Restart=always``), without systemd.

The stand-in does what the unit says: the supervisor (``python -m edge_agent.supervisor --config FILE``,
the real one) is started in a process group of its own, as systemd starts a unit's main process; it is
killed with SIGKILL; the rest of the group (the agent it ran) gets SIGTERM, then SIGKILL after the stop
timeout, as ``KillMode=mixed`` sends them; only when the group is empty is the supervisor started again,
as ``Restart=`` does. The agent is a stand-in installed in the slots (a real slot folder whose
``edge_agent`` package records its starts and stops and writes the healthy marker), since what is judged
here is the supervisor and the state on disk, not what the agent does between.

After each restart the agent must run again on the slot the state on disk names, exactly one of it,
with no process of the killed generation left and nothing stale in the slots folder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from edge_agent.update.slots import PendingSlot, SlotRef, SlotState, SlotStore
from tests.support.paths import REPO
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

# systemd's TimeoutStopSec in the unit; the stand-in agent stops at once on SIGTERM, so it is never reached.
STOP_TIMEOUT_S = 30.0

FAKE_MAIN = '''\
"""Stand-in agent: records its life in $FAKE_AGENT_LOG, writes the healthy marker when allowed."""
import json, os, signal, time
from pathlib import Path
from edge_agent import __version__

slot = os.environ["EDGEFLEET_AGENT_SLOT"]
root = Path(os.environ["FAKE_AGENT_ROOT"])
stopping = []
signal.signal(signal.SIGTERM, lambda *a: stopping.append(1))


def record(event):
    line = {"pid": os.getpid(), "pgid": os.getpgid(0), "version": __version__, "slot": slot, "event": event}
    with open(os.environ["FAKE_AGENT_LOG"], "a") as f:
        f.write(json.dumps(line) + "\\n")


record("started")
healthy = False
while not stopping:
    if not healthy and not (root / f"hold-{__version__}").exists():
        tmp = root / f"healthy.tmp{os.getpid()}"
        tmp.write_text(json.dumps({"version": __version__, "slot": slot, "pid": os.getpid()}))
        os.replace(tmp, root / "healthy")
        healthy = True
    time.sleep(0.05)
record("stopped")
'''


def install_fake_slot(store: SlotStore, version: str) -> None:
    site = store.slots_dir / version / "site" / "edge_agent"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (site / "__main__.py").write_text(FAKE_MAIN)


class SupervisorUnit:
    """``python -m edge_agent.supervisor`` as the unit runs it, in a process group of its own."""

    def __init__(self, workdir: Path, store: SlotStore) -> None:
        self.workdir = workdir
        self.store = store
        self.config = workdir / "agent.yaml"
        self.config.write_text(
            json.dumps(
                {"device_id": "kill9-1", "mqtt_url": "mqtt://127.0.0.1:1", "data_dir": str(store.root.parent)}
            )
        )
        self.events = workdir / "agent-events.jsonl"
        self.log = workdir / "supervisor.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.generations: list[int] = []  # the process group of each start

    def start(self) -> None:
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "FAKE_AGENT_LOG": str(self.events),
            "FAKE_AGENT_ROOT": str(self.store.root),
        }
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "edge_agent.supervisor", "--config", str(self.config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
                start_new_session=True,  # systemd: the main process leads the unit's processes
            )
        self.generations.append(self.proc.pid)

    def group(self, pgid: int) -> list[psutil.Process]:
        """The live processes of a start's group (the unit's cgroup, as far as this test is concerned)."""
        out = []
        for p in psutil.process_iter(["pid", "status"]):
            try:
                if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except (ProcessLookupError, psutil.Error):
                continue
        return out

    def kill9_as_the_unit_sees_it(self) -> None:
        """SIGKILL to the supervisor; then ``KillMode=mixed``: SIGTERM to the rest of the group, SIGKILL
        after the stop timeout; back only when the group is empty (``Restart=`` waits for that)."""
        assert self.proc is not None
        pgid = self.proc.pid
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.proc = None
        for p in self.group(pgid):
            p.send_signal(signal.SIGTERM)
        try:
            wait_for(
                lambda: not self.group(pgid), timeout=STOP_TIMEOUT_S, what="the unit's processes to stop"
            )
        except AssertionError:
            for p in self.group(pgid):
                p.kill()
            raise

    def stop(self) -> int | None:
        """``systemctl stop``: SIGTERM to the supervisor only; it stops the agent and exits."""
        if self.proc is None:
            return None
        pgid = self.proc.pid
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        for p in self.group(pgid):
            p.kill()
        self.proc = None
        return code

    def agent_events(self) -> list[dict[str, Any]]:
        if not self.events.exists():
            return []
        return [json.loads(line) for line in self.events.read_text().splitlines() if line.strip()]

    def running_agents(self) -> list[dict[str, Any]]:
        """Agents started and not stopped, whose process is still alive."""
        stopped = {e["pid"] for e in self.agent_events() if e["event"] == "stopped"}
        out = []
        for e in self.agent_events():
            if e["event"] == "started" and e["pid"] not in stopped and psutil.pid_exists(e["pid"]):
                try:
                    if psutil.Process(e["pid"]).status() != psutil.STATUS_ZOMBIE:
                        out.append(e)
                except psutil.NoSuchProcess:
                    continue
        return out

    def agent_on(self, version: str) -> dict[str, Any] | None:
        """The one live agent of the current generation, if it runs ``version``."""
        assert self.proc is not None, "the supervisor is not running"
        assert self.proc.poll() is None, f"the supervisor exited with {self.proc.returncode}"
        live = self.running_agents()
        if len(live) == 1 and live[0]["version"] == version and live[0]["pgid"] == self.proc.pid:
            return live[0]
        return None


@pytest.fixture
def store(tmp_path: Path) -> SlotStore:
    s = SlotStore(tmp_path / "data")
    install_fake_slot(s, "1.0")
    install_fake_slot(s, "1.1")
    s.save(SlotState(current=SlotRef("1.0", "1.0", "a" * 64), previous=s.base()))
    return s


@pytest.fixture
def unit(tmp_path: Path, store: SlotStore) -> Iterator[SupervisorUnit]:
    u = SupervisorUnit(tmp_path, store)
    yield u
    u.stop()
    for pgid in u.generations:
        for p in u.group(pgid):
            p.kill()


def healthy_is(store: SlotStore, version: str) -> bool:
    seen = store.read_healthy()
    return seen is not None and seen.version == version


def test_a_running_agent_comes_back_on_its_slot_after_the_supervisor_is_killed(
    unit: SupervisorUnit, store: SlotStore
) -> None:
    unit.start()
    first = wait_for(lambda: unit.agent_on("1.0"), timeout=30, what="agent 1.0 running", log=unit.log)
    wait_for(lambda: healthy_is(store, "1.0"), timeout=10, what="agent 1.0 healthy", log=unit.log)
    before = store.load()

    unit.kill9_as_the_unit_sees_it()
    # KillMode=mixed's SIGTERM reached the orphaned agent, which stopped cleanly.
    assert any(e["pid"] == first["pid"] and e["event"] == "stopped" for e in unit.agent_events())

    unit.start()
    again = wait_for(lambda: unit.agent_on("1.0"), timeout=30, what="agent 1.0 running again", log=unit.log)
    assert again["pid"] != first["pid"] and again["slot"] == "1.0"
    wait_for(lambda: healthy_is(store, "1.0"), timeout=10, what="agent 1.0 healthy again", log=unit.log)
    assert store.load() == before  # nothing rolled back, nothing lost
    assert unit.stop() == 0
    assert unit.running_agents() == []


def test_a_kill_during_an_update_s_health_trial_gives_the_new_version_its_trial_again(
    unit: SupervisorUnit, store: SlotStore
) -> None:
    # An update installed and waiting for its trial: the agent of 1.0 exits 75 for it in real life;
    # here the state is on disk before the supervisor starts, as after a kill in between.
    hold = store.root / "hold-1.1"
    hold.touch()  # 1.1 is not healthy until the test says so
    store.update(
        lambda s: SlotState(
            current=s.current,
            previous=s.previous,
            pending=PendingSlot("1.1", "1.1", "b" * 64, time.time(), 60.0),
        )
    )
    unit.start()
    trial = wait_for(lambda: unit.agent_on("1.1"), timeout=30, what="agent 1.1 on trial", log=unit.log)

    unit.kill9_as_the_unit_sees_it()  # in the middle of the trial: 1.1 not healthy, not promoted
    assert store.load().pending is not None

    unit.start()
    again = wait_for(lambda: unit.agent_on("1.1"), timeout=30, what="agent 1.1 on trial again", log=unit.log)
    assert again["pid"] != trial["pid"]
    hold.unlink()
    wait_for(lambda: store.load().pending is None, timeout=30, what="1.1 promoted", log=unit.log)
    state = store.load()
    assert state.current == SlotRef("1.1", "1.1", "b" * 64)
    assert state.previous is not None and state.previous.version == "1.0"
    assert state.last_outcome is not None and state.last_outcome.outcome == "updated"
    assert unit.agent_on("1.1") is not None


def test_a_kill_right_after_promotion_keeps_the_new_version_and_clears_what_was_left_half_done(
    unit: SupervisorUnit, store: SlotStore
) -> None:
    store.update(
        lambda s: SlotState(
            current=s.current,
            previous=s.previous,
            pending=PendingSlot("1.1", "1.1", "b" * 64, time.time(), 60.0),
        )
    )
    unit.start()
    wait_for(lambda: store.load().pending is None, timeout=30, what="1.1 promoted", log=unit.log)
    wait_for(lambda: unit.agent_on("1.1"), timeout=30, what="agent 1.1 running", log=unit.log)

    unit.kill9_as_the_unit_sees_it()
    # What a kill can leave besides: a marker cut short, a state file's temporary, an install that an
    # agent (killed with the unit) had half done, and a slot that no state names any more.
    store.healthy_path.write_text('{"version": "1.')
    (store.root / "slots.json.tmp4242.1").write_text("{")
    (store.slots_dir / ".install-1.2-abc" / "package").mkdir(parents=True)
    install_fake_slot(store, "0.9")

    unit.start()
    wait_for(lambda: unit.agent_on("1.1"), timeout=30, what="agent 1.1 running again", log=unit.log)
    wait_for(lambda: healthy_is(store, "1.1"), timeout=10, what="agent 1.1 healthy again", log=unit.log)
    state = store.load()
    assert state.current.version == "1.1" and state.pending is None
    assert state.previous is not None and state.previous.version == "1.0"
    assert sorted(p.name for p in store.slots_dir.iterdir()) == ["1.0", "1.1"]
    assert not list(store.root.glob("*.tmp*"))
