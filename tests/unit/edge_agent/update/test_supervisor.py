"""The supervisor (edge_agent/update/supervisor.py): which slot runs, promotion, roll-back, backoff, stop.

Scripted children on a fake clock (every decision, no waiting), and one real process for the stderr
tail that roll-back reasons quote.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from edge_agent.update.slots import BASE, EXIT_UPDATE, PendingSlot, SlotRef, SlotState, SlotStore
from edge_agent.update.supervisor import ProcessChild, Supervisor, SupervisorConfig


@dataclass
class Script:
    """What one started child does, in seconds after its start on the fake clock."""

    exit_at: float | None = None  # None: runs until terminated
    code: int = 0
    healthy_at: float | None = None
    stderr: str = ""
    ignores_term: bool = False


class FakeChild:
    def __init__(self, sim: Sim, ref: SlotRef, script: Script) -> None:
        self.sim, self.ref, self.script = sim, ref, script
        self.started = sim.now
        self.code: int | None = None
        self.terminated = False
        self.killed = False

    def tick(self) -> None:
        if self.code is not None:
            return
        age = self.sim.now - self.started
        s = self.script
        if s.healthy_at is not None and age >= s.healthy_at and self.sim.store.read_healthy() is None:
            self.sim.store.write_healthy(self.ref.version, self.ref.slot)
        if s.exit_at is not None and age >= s.exit_at:
            self.code = s.code

    def poll(self) -> int | None:
        self.tick()
        return self.code

    def terminate(self) -> None:
        self.terminated = True
        if not self.script.ignores_term and self.code is None:
            self.code = -15

    def kill(self) -> None:
        self.killed = True
        self.code = -9

    def wait(self, timeout: float) -> int | None:
        if self.code is None:
            self.sim.now += timeout
        return self.code

    def stderr_tail(self) -> str:
        return self.script.stderr


class Sim:
    """Fake clock + starter: each start takes the next script; when none is left, stop."""

    def __init__(self, store: SlotStore, scripts: list[Script]) -> None:
        self.store = store
        self.scripts = list(scripts)
        self.now = 0.0
        self.children: list[FakeChild] = []
        self.sleeps: list[float] = []
        self.stop = threading.Event()

    def start(self, ref: SlotRef) -> FakeChild:
        if not self.scripts:
            self.stop.set()
            script = Script()
        else:
            script = self.scripts.pop(0)
        child = FakeChild(self, ref, script)
        self.children.append(child)
        return child

    def sleep(self, s: float) -> bool:
        if s > 0.5:
            self.sleeps.append(s)
        self.now += s
        if self.now > 100_000:
            self.stop.set()  # a runaway loop fails the test instead of hanging it
        return self.stop.is_set()

    def run(self) -> Supervisor:
        sup = Supervisor(
            self.store,
            self.start,
            stop=self.stop,
            config=SupervisorConfig(),
            clock=lambda: self.now,
            wall=lambda: 1000.0 + self.now,
            sleep=self.sleep,
        )
        assert sup.run() == 0
        return sup


def store_with(tmp_path: Path, state: SlotState | None = None, slots: tuple[str, ...] = ()) -> SlotStore:
    store = SlotStore(tmp_path, base_version="1.0")
    for slot in slots:
        site = store.site(slot)
        assert site is not None
        (site / "edge_agent").mkdir(parents=True)
        (site / "edge_agent" / "__init__.py").write_text("")
    if state is not None:
        store.save(state)
    return store


BASE_REF = SlotRef("1.0", BASE)
PENDING = PendingSlot("1.1", "1.1", "a" * 64, 0.0, 120.0)


def test_a_pending_version_that_becomes_healthy_is_promoted_and_keeps_running(tmp_path: Path) -> None:
    store = store_with(tmp_path, SlotState(current=BASE_REF, pending=PENDING), slots=("1.1",))
    sim = Sim(store, [Script(healthy_at=5.0)])
    sup = sim.run()
    state = store.load()
    assert state.current == SlotRef("1.1", "1.1", "a" * 64)
    assert state.previous == BASE_REF and state.pending is None
    assert state.last_outcome is not None
    assert (state.last_outcome.outcome, state.last_outcome.version, state.last_outcome.previous) == (
        "updated",
        "1.1",
        "1.0",
    )
    assert sup.starts[0].slot == "1.1"
    # The supervisor stopped: the promoted child got its TERM and was not restarted from elsewhere.
    assert sim.children[0].terminated


def test_a_pending_version_that_crashes_at_start_is_rolled_back_with_its_exit_code_and_stderr(
    tmp_path: Path,
) -> None:
    store = store_with(tmp_path, SlotState(current=BASE_REF, pending=PENDING), slots=("1.1",))
    sim = Sim(
        store, [Script(exit_at=1.0, code=1, stderr="Traceback\nRuntimeError: boom"), Script(healthy_at=2)]
    )
    sup = sim.run()
    assert [s.slot for s in sup.starts[:2]] == ["1.1", BASE]
    state = store.load()
    assert state.current == BASE_REF and state.pending is None
    last = state.last_outcome
    assert last is not None and last.outcome == "rolled_back" and last.version == "1.1"
    assert "code 1" in last.reason and "RuntimeError: boom" in last.reason
    assert last.sha256 == "a" * 64 and not last.reported
    assert not (store.slots_dir / "1.1").exists()  # the failed slot is removed


def test_a_pending_version_never_healthy_is_stopped_and_rolled_back_after_its_bound(tmp_path: Path) -> None:
    pending = PendingSlot("1.1", "1.1", "a" * 64, 0.0, 30.0)
    store = store_with(tmp_path, SlotState(current=BASE_REF, pending=pending), slots=("1.1",))
    sim = Sim(store, [Script(ignores_term=True), Script()])
    sim.run()
    first = sim.children[0]
    assert first.terminated and first.killed  # TERM ignored: KILL after the stop timeout
    assert sim.now >= 30.0
    last = store.load().last_outcome
    assert last is not None and last.outcome == "rolled_back"
    assert last.reason == "not healthy within 30 s"
    assert sim.children[1].ref == BASE_REF


def test_exit_75_starts_the_pending_slot_at_once(tmp_path: Path) -> None:
    store = store_with(tmp_path, SlotState(current=BASE_REF))

    sim = Sim(store, [Script(exit_at=3.0, code=EXIT_UPDATE, healthy_at=1.0), Script(healthy_at=1.0)])
    real_start = sim.start

    def start(ref: SlotRef) -> FakeChild:
        child = real_start(ref)
        if len(sim.children) == 1:  # the running agent installs, writes pending, then exits with 75
            store_with(tmp_path, slots=("1.1",))
            store.update(lambda s: SlotState(current=s.current, pending=PENDING))
        return child

    sim.start = start  # type: ignore[method-assign]
    sup = sim.run()
    assert [s.slot for s in sup.starts[:2]] == [BASE, "1.1"]
    assert sim.sleeps == []  # no backoff before the switch
    assert store.load().current.version == "1.1"


def test_a_new_current_version_crashing_three_times_before_healthy_falls_back(tmp_path: Path) -> None:
    state = SlotState(current=SlotRef("1.1", "1.1", "a" * 64), previous=BASE_REF)
    store = store_with(tmp_path, state, slots=("1.1",))
    crash = Script(exit_at=2.0, code=4, stderr="sticky CUDA error")
    sim = Sim(store, [crash, crash, crash, Script(healthy_at=1.0)])
    sup = sim.run()
    assert [s.slot for s in sup.starts[:4]] == ["1.1", "1.1", "1.1", BASE]
    assert sim.sleeps == [1.0, 2.0]  # backoff between the crashes
    state = store.load()
    assert state.current == BASE_REF
    last = state.last_outcome
    assert last is not None and last.outcome == "rolled_back" and "crashed 3 times" in last.reason
    assert "sticky CUDA error" in last.reason


def test_the_base_install_is_restarted_with_a_bounded_backoff_and_never_given_up(tmp_path: Path) -> None:
    store = store_with(tmp_path)
    sim = Sim(store, [Script(exit_at=0.5, code=1)] * 9)
    sup = sim.run()
    assert all(s.slot == BASE for s in sup.starts)
    assert sim.sleeps == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    assert store.load().last_outcome is None


def test_a_run_that_was_healthy_resets_the_backoff(tmp_path: Path) -> None:
    store = store_with(tmp_path)
    sim = Sim(
        store,
        [
            Script(exit_at=0.5, code=1),
            Script(exit_at=0.5, code=1),
            Script(healthy_at=1, exit_at=5, code=4),
            Script(exit_at=0.5, code=1),
        ],
    )
    sim.run()
    assert sim.sleeps == [1.0, 2.0, 1.0, 2.0]


def test_a_missing_current_slot_falls_back_to_the_base_install(tmp_path: Path) -> None:
    store = store_with(tmp_path, SlotState(current=SlotRef("1.1", "1.1")))
    sim = Sim(store, [Script(healthy_at=1.0)])
    sup = sim.run()
    assert sup.starts[0] == BASE_REF
    last = store.load().last_outcome
    assert last is not None and "missing" in last.reason


def test_a_stop_request_terminates_the_child_and_returns_0(tmp_path: Path) -> None:
    store = store_with(tmp_path)
    stop = threading.Event()
    started = threading.Event()
    children: list[FakeChild] = []
    sim = Sim(store, [])

    def start(ref: SlotRef) -> FakeChild:
        child = FakeChild(sim, ref, Script())
        children.append(child)
        started.set()
        return child

    sup = Supervisor(store, start, stop=stop, config=SupervisorConfig(poll_s=0.01))
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(sup.run()))
    t.start()
    assert started.wait(10)
    stop.set()
    t.join(10)
    assert result == [0] and children[0].terminated and len(children) == 1


def test_a_real_child_s_stderr_tail_is_kept_for_the_reason(tmp_path: Path) -> None:
    code = "import sys; print('line one', file=sys.stderr); print('RuntimeError: boom', file=sys.stderr); sys.exit(3)"
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    child = ProcessChild(proc)
    assert child.wait(30) == 3
    assert child.stderr_tail().splitlines()[-2:] == ["line one", "RuntimeError: boom"]


def test_a_supervisor_starting_after_a_kill_keeps_the_named_slots_and_clears_what_was_half_done(
    tmp_path: Path,
) -> None:
    state = SlotState(current=SlotRef("1.0", "1.0"), previous=BASE_REF, pending=PENDING)
    store = store_with(tmp_path, state, slots=("1.0", "1.1", "0.9"))
    (store.slots_dir / ".install-1.2-x" / "package").mkdir(parents=True)  # an install cut short
    (store.root / "slots.json.tmp77.1").write_text("{")  # a write that never reached its rename
    (store.root / "healthy.tmp77.1").write_text("{")
    sim = Sim(store, [Script(healthy_at=1.0, exit_at=2.0)])  # then no script left: the run ends
    sup = sim.run()
    assert sup.starts[0] == SlotRef("1.1", "1.1", "a" * 64)  # the pending slot gets its trial
    assert sorted(p.name for p in store.slots_dir.iterdir()) == ["1.0", "1.1"]
    assert not list(store.root.glob("*.tmp*"))


def test_a_supervisor_starting_on_an_unreadable_state_runs_the_base_and_deletes_no_slot(
    tmp_path: Path,
) -> None:
    store = store_with(tmp_path, slots=("1.1",))
    store.root.mkdir(parents=True, exist_ok=True)
    store.path.write_text('{"current": {"version": "1.1", "sl')
    sim = Sim(store, [Script(healthy_at=1.0, exit_at=2.0)])
    sup = sim.run()
    assert sup.starts[0] == BASE_REF
    assert store.exists("1.1")  # what an operator may still recover
