"""The agent's data disk full: reported while it lasts, nothing lost silently, recovered on its own.

Each test gives the agent a disk of its own (a tmpfs mounted on its data folder) and fills it with a
filler file down to the last byte, mid-stream or while the agent is down; then makes room again. The
agent must stay up (same process, no restart), say so by an ERROR event the controller stores
(``data["check"] == "storage"``, ``state`` ``failing`` then ``recovered``), and account for every
detection batch: each seq it published is stored once, and each batch made while the disk was full was
either written (and stored) once the disk took writes, or dropped from memory and counted in the
recovered event.

Mounting needs root and mount(2) (CAP_SYS_ADMIN), as on CI: a machine without them fails these tests
with a message saying so, it does not skip them. Each test prints its ``FAULT …`` line (``-s``).
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from fleet_protocol.codec import decode_as
from fleet_protocol.messages import DesiredState
from tests.support.faults import FaultStack, Figures
from tests.support.processes import AgentProcess
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e  # real broker, controller, agent, model and footage

# The model (12 MB) and the fetcher's free-space margin (16 MB) fit, with room to spare.
DISK_MB = 64


class AgentDisk:
    """A tmpfs of the test's own: the agent's data folder, and fillers that take its free space."""

    def __init__(self, mount: Path) -> None:
        self.mount = mount
        self.data = mount / "data"
        self.fillers: list[Path] = []

    def fill(self) -> int:
        """Take every free byte at once; returns how many. One allocation, not a write loop: the room
        the agent frees afterwards (its reserve, to report the full disk) stays free for it."""
        for _ in range(20):
            free = self.free()
            if free == 0:
                return 0
            path = self.mount / f"filler-{len(self.fillers)}"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, free)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                path.unlink()  # the agent wrote meanwhile: measure again
                continue
            finally:
                os.close(fd)
            self.fillers.append(path)
            return free
        raise AssertionError("the agent kept writing: could not take the disk's free space")

    def free(self) -> int:
        st = os.statvfs(self.mount)
        return st.f_bavail * st.f_frsize

    @property
    def full(self) -> bool:
        return bool(self.fillers)

    def make_room(self) -> None:
        for path in self.fillers:
            path.unlink()
        self.fillers.clear()


@pytest.fixture
def disk(tmp_path: Path, rig: FaultStack) -> Iterator[AgentDisk]:
    mount = tmp_path / "agent-disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "edgefleet-agent-disk", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.fail(
            "the storage fault tests fill a disk of the agent's own, a tmpfs the test mounts: that needs "
            f"root with mount(2) (CAP_SYS_ADMIN), as on CI; mount said: {done.stderr.strip()}"
        )
    try:
        yield AgentDisk(mount)
    finally:
        for agent in rig.agents:  # an agent's open files keep the mount busy
            agent.stop()
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(mount)], capture_output=True, check=False)


def storage_events(rig: FaultStack, device: str, state: str, what: str) -> list[dict[str, Any]]:
    """The storage events of ``device`` the controller stored (``GET /api/v1/events``), oldest first."""
    events = rig.call("GET", "/api/v1/events", params={"device": device, "kind": "error", "limit": 1000})
    found = [
        e
        for e in events
        if e["data"].get("check") == "storage"
        and e["data"].get("state") == state
        and e["data"].get("what") == what
    ]
    return sorted(found, key=lambda e: e["seq"])


def first_report(
    rig: FaultStack, agent: AgentProcess, pid: int, state: str, what: str
) -> dict[str, Any] | None:
    """The first storage report (``state``, ``what``) of ``agent`` stored, or None; the agent must be up."""
    alive(agent, pid)
    found = storage_events(rig, agent.device_id, state, what)
    return found[0] if found else None


def agent_starts(rig: FaultStack, device: str) -> int:
    return len(rig.call("GET", "/api/v1/events", params={"device": device, "kind": "agent_started"}))


def stored_batches_between(rig: FaultStack, device: str, first: int, last: int) -> int:
    """Detection batches stored with a seq strictly between ``first`` and ``last``."""
    return int(
        rig._db_one(
            "SELECT COUNT(*) FROM ingested_seq WHERE device_id = :d AND kind = 'detections' "
            "AND NOT dropped AND seq > :first AND seq < :last",
            device,
            first=first,
            last=last,
        )
    )


def alive(agent: AgentProcess, pid: int | None = None) -> bool:
    """The agent is up (and still the process ``pid``: not restarted); fails at once with its log if not."""
    assert agent.alive(), agent.log.read_text()[-3000:]
    assert agent.proc is not None
    assert pid is None or agent.proc.pid == pid, "the agent process was restarted"
    return True


def streamed_then_stopped(rig: FaultStack, disk: AgentDisk, device: str) -> AgentProcess:
    """An agent of ``device`` on ``disk`` that ran until the controller stored its batches, stopped."""
    rig.deploy(device)
    agent = rig.agent(device, data_dir=str(disk.data))
    agent.start()
    rig.wait_streaming(agent)
    agent.stop()
    return agent


def infers_for_2s(rig: FaultStack, agent: AgentProcess, pid: int, started: float, what: str) -> None:
    """Wait until process ``pid`` of ``agent`` (started at monotonic ``started``) has inferred for two
    seconds by its own clock (batches close every 0.5 s at most), from its heartbeats."""

    def inferring() -> float | None:
        """The uptime of this process's newest heartbeat once it says the model infers, else None."""
        alive(agent, pid)
        health = rig.device(agent.device_id)["last_health"] or {}
        uptime = float(health.get("uptime_s", float("inf")))
        cams = health.get("cameras") or [{}]
        fresh = uptime <= time.monotonic() - started + 1  # a heartbeat of this process, not the last one
        return uptime if fresh and cams[0].get("fps", 0) > 0 else None

    since = wait_for(inferring, timeout=90, what=what)
    wait_for(lambda: (up := inferring()) is not None and up >= since + 2, timeout=60, what=f"{what}, 2 s")


def assert_failing(event: dict[str, Any], path: Path) -> None:
    """A clear report: an error, naming the file, the full disk and its errno."""
    data = event["data"]
    assert event["severity"] == "error", event
    assert data["errno"] == errno.ENOSPC and data["errno_name"] == "ENOSPC", event
    assert data["path"] == str(path), event
    assert "disk full" in event["message"] and str(path) in event["message"], event


def zero_seq_loss(fig: Figures) -> None:
    """Every seq published is stored once; none lost, none dropped by the outbox's bound."""
    assert fig.lost == 0, fig
    assert fig.stored_twice == 0, fig
    assert fig.outbox_dropped_agent == 0, fig
    assert fig.stored + fig.outbox_dropped_controller == fig.published, fig
    assert fig.stored == fig.published, fig


def test_disk_full_mid_stream_holds_reports_and_recovers(rig: FaultStack, disk: AgentDisk) -> None:
    """The disk fills mid-stream: the outbox is refused a write; the agent reports it while the disk is
    still full, holds new batches in memory (at most 3 here, so the bound drops some, counted), and
    once room comes back writes what it held, reports the recovery with its figures, and streams on."""
    device = "fault-disk-full"
    rig.deploy(device)
    agent = rig.agent(device, data_dir=str(disk.data), outbox={"held_max": 3})
    agent.start()
    rig.wait_streaming(agent)
    assert agent.proc is not None
    pid = agent.proc.pid
    reserve = disk.data / "storage.reserve"
    assert reserve.exists(), "the agent keeps room to report a full disk"
    log_mark = len(agent.log.read_text())
    # The outbox's write-ahead log is still growing this early (it is reset after ~1000 pages), so the
    # next write needs room the disk no longer has.
    assert disk.fill() > 0

    failing = wait_for(
        lambda: first_report(rig, agent, pid, "failing", "outbox"),
        timeout=60,
        what="the agent's report that its outbox was refused a write, stored while the disk is full",
    )
    assert_failing(failing, disk.data / "outbox.db")
    assert not reserve.exists(), "the agent released its reserve to report the full disk"
    # Batches keep coming while the disk is full: they wait in memory, until the bound drops the oldest.
    wait_for(
        lambda: alive(agent, pid) and "dropping the oldest" in agent.log.read_text()[log_mark:],
        timeout=90,
        what="more batches made than the 3 held in memory while the disk is full",
    )
    assert disk.full and storage_events(rig, device, "recovered", "outbox") == []

    disk.make_room()
    recovered = wait_for(
        lambda: first_report(rig, agent, pid, "recovered", "outbox"),
        timeout=60,
        what="the agent's report that its outbox takes writes again",
    )
    rig.wait_streaming(agent)
    assert alive(agent, pid)
    assert reserve.exists(), "the reserve is back for the next time"
    assert agent_starts(rig, device) == 1, "no restart"
    assert len(storage_events(rig, device, "failing", "outbox")) == 1, "one failure, reported once"
    figures = recovered["data"]
    # The bound drops the oldest message held, whatever it is: on a loaded machine the agent's own
    # events (a camera falling behind) may be the first to go.
    assert figures["dropped_batches"] + figures["dropped_events"] >= 1, figures
    assert figures["dropped_frames"] >= figures["dropped_batches"], figures
    assert recovered["severity"] == "warning" and "dropped" in recovered["message"], recovered

    fig = rig.converge(agent, "disk full mid-stream (tmpfs ENOSPC, held_max=3)")
    zero_seq_loss(fig)
    # The batches made while the disk was full: each written once room came back (numbered between
    # the two reports, stored), or dropped from memory and declared in the recovered report.
    written = stored_batches_between(rig, device, failing["seq"], recovered["seq"])
    print(
        f"STORAGE disk full mid-stream: held_batches={figures['held_batches']} "
        f"held_frames={figures['held_frames']} written_and_stored={written} "
        f"dropped_batches={figures['dropped_batches']} dropped_frames={figures['dropped_frames']} "
        f"held_events={figures['held_events']} dropped_events={figures['dropped_events']} "
        f"failed_s={figures['failed_s']}"
    )
    assert written == figures["held_batches"] - figures["dropped_batches"], (written, figures)
    assert written >= 1, figures


def test_agent_restarted_on_a_full_disk_runs_reports_and_recovers(rig: FaultStack, disk: AgentDisk) -> None:
    """The agent starts on a disk already full (its outbox cannot even open: SQLite cannot size its
    shared-memory file). It must not die at every start (a crash loop); it must run its
    model from its own disk, report the full disk through the room it kept, and catch up once there
    is room."""
    device = "fault-disk-restart"
    agent = streamed_then_stopped(rig, disk, device)
    assert disk.fill() > 0 and disk.free() == 0
    agent.start()
    started = time.monotonic()
    assert agent.proc is not None
    pid = agent.proc.pid

    failing = wait_for(
        lambda: first_report(rig, agent, pid, "failing", "outbox"),
        timeout=90,
        what="the restarted agent's report that its outbox was refused, stored while the disk is full",
    )
    assert_failing(failing, disk.data / "outbox.db")

    # It runs: its model comes from its own disk and infers on its camera, the disk still full.
    infers_for_2s(rig, agent, pid, started, "the restarted agent inferring while the disk is full")
    assert disk.full and storage_events(rig, device, "recovered", "outbox") == []

    disk.make_room()
    recovered = wait_for(
        lambda: first_report(rig, agent, pid, "recovered", "outbox"),
        timeout=60,
        what="the agent's report that its outbox takes writes again",
    )
    figures = recovered["data"]
    # At least its start, and the batches made meanwhile (the default bound drops none of them here).
    assert figures["held_events"] >= 1 and figures["held_batches"] >= 1, recovered
    assert figures["dropped_batches"] == 0 and figures["dropped_events"] == 0, recovered
    rig.wait_streaming(agent)
    assert alive(agent, pid)
    assert agent_starts(rig, device) == 2, "started twice (the test's two starts), never crashed"

    fig = rig.converge(agent, "agent restarted on a full disk (tmpfs ENOSPC)")
    zero_seq_loss(fig)
    written = stored_batches_between(rig, device, failing["seq"], recovered["seq"])
    print(
        f"STORAGE restart on a full disk: held_batches={figures['held_batches']} written_and_stored="
        f"{written} held_events={figures['held_events']} failed_s={figures['failed_s']}"
    )
    assert written == figures["held_batches"], (written, figures)


def _version_on_disk(disk: AgentDisk) -> int:
    return decode_as(DesiredState, (disk.data / "desired.json").read_bytes()).version


def test_desired_state_on_a_full_disk_is_applied_reported_and_saved_later(
    rig: FaultStack, disk: AgentDisk
) -> None:
    """A new desired state (a threshold) arrives while the disk is full. Saving it is refused: that used
    to end the message handler, and the state was silently ignored. It must be applied all the same,
    the refused save reported, and the file written once there is room (an agent restarted offline
    then runs this state, not an older one)."""
    device = "fault-disk-desired"
    rig.deploy(device)
    agent = rig.agent(device, data_dir=str(disk.data))
    agent.start()
    rig.wait_streaming(agent)
    assert agent.proc is not None
    pid = agent.proc.pid
    saved = _version_on_disk(disk)
    assert disk.fill() > 0
    # The outbox meets the full disk first and reports it through the room it kept; that room is then
    # taken too (as the next writer on a full disk would), so the save below is refused for sure.
    wait_for(
        lambda: first_report(rig, agent, pid, "failing", "outbox"),
        timeout=60,
        what="the agent's report that its outbox was refused a write",
    )
    disk.fill()
    assert disk.free() == 0

    with rig.controller.client() as c:
        r = c.put(
            f"/api/v1/devices/{device}/cameras/cam1/model",
            json={"model": "ped_ssdlite", "version": "1", "threshold": 0.61},
        )
    assert r.status_code == 200, r.text
    version = int(r.json()["version"])
    assert version > saved
    # Applied all the same: the device runs (and reports) the new threshold at the new version.
    wait_for(
        lambda: (
            alive(agent, pid)
            and (dev := rig.device(device))["reported_version"] == version
            and dev["models"]["cam1"]["threshold"] == pytest.approx(0.61)
        ),
        timeout=60,
        what="the new desired state applied and reported while the disk is full",
    )
    # The fault hit the file: the disk still holds the older state, and no partial file.
    assert _version_on_disk(disk) == saved
    assert not (disk.data / "desired.json.tmp").exists()

    room_at = time.time()
    disk.make_room()
    recovered = wait_for(
        lambda: first_report(rig, agent, pid, "recovered", "desired_state"),
        timeout=60,
        what="the agent's report that the desired state is saved",
    )
    assert _version_on_disk(disk) == version
    # The refused save was reported too: held in memory with the rest (the outbox had no room left
    # either), stored once room came back, with the time it happened.
    (failing,) = storage_events(rig, device, "failing", "desired_state")
    assert_failing(failing, disk.data / "desired.json")
    assert datetime.fromisoformat(failing["ts"]).timestamp() < room_at
    assert failing["seq"] < recovered["seq"]
    rig.wait_streaming(agent)
    assert alive(agent, pid)
    assert agent_starts(rig, device) == 1, "no restart"
    zero_seq_loss(rig.converge(agent, "desired state saved on a full disk (tmpfs ENOSPC)"))


def test_agent_started_on_a_read_only_data_folder_runs_and_reports_once_writable(
    rig: FaultStack, disk: AgentDisk
) -> None:
    """The agent's data folder read-only (a remount, as a failing SD card turns itself): the agent must
    not crash-loop; it runs its model from what it can read, holds what it makes in memory, and once the
    folder takes writes again stores a failing report (EROFS, made while read-only) and a recovered one,
    and every batch it made. The failing report cannot reach the controller while nothing can be
    stored: an outbox write is what gives a message its seq."""
    device = "fault-disk-readonly"
    agent = streamed_then_stopped(rig, disk, device)
    subprocess.run(["mount", "-o", "remount,ro", str(disk.mount)], check=True, capture_output=True)
    try:
        with pytest.raises(OSError) as refused:
            (disk.data / "probe").write_bytes(b"x")
        assert refused.value.errno == errno.EROFS
        agent.start()
        started = time.monotonic()
        assert agent.proc is not None
        pid = agent.proc.pid

        infers_for_2s(rig, agent, pid, started, "the agent inferring on a read-only data folder")
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(disk.mount)], check=True, capture_output=True)

    failing = wait_for(
        lambda: first_report(rig, agent, pid, "failing", "outbox"),
        timeout=60,
        what="the read-only report, stored once the folder takes writes",
    )
    data = failing["data"]
    assert failing["severity"] == "error" and data["errno_name"] == "EROFS", failing
    assert "read-only" in failing["message"], failing
    recovered = wait_for(
        lambda: first_report(rig, agent, pid, "recovered", "outbox"),
        timeout=60,
        what="the agent's report that its outbox takes writes again",
    )
    figures = recovered["data"]
    assert figures["held_batches"] >= 1 and figures["dropped_batches"] == 0, recovered
    rig.wait_streaming(agent)
    assert alive(agent, pid)
    fig = rig.converge(agent, "agent started on a read-only data folder (tmpfs remounted ro)")
    zero_seq_loss(fig)
    written = stored_batches_between(rig, device, failing["seq"], recovered["seq"])
    print(f"STORAGE read-only start: held_batches={figures['held_batches']} written_and_stored={written}")
    assert written == figures["held_batches"], (written, figures)
