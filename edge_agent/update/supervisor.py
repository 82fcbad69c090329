"""``python -m edge_agent.supervisor --config FILE``: runs the agent from its A/B slot, switches to a
new version, and rolls it back when it does not come up (PROTOCOL.md "Agent updates").

Runs under systemd (``docker/systemd/edgefleet-agent.service``, ``Restart=always``); it is the base
install's code and stays so (a new agent version never replaces the supervisor that judges it).

- It starts the pending slot if ``slots.json`` has one, else the current slot, as
  ``PYTHONPATH=<slot>/site python -P -m edge_agent <args>`` (the base slot without PYTHONPATH).
- An agent that installed a new version exits with 75: the pending slot is started.
- A pending slot must write the healthy marker within its ``health_timeout_s``; then it becomes
  current (the one before, previous). If it exits first or the bound passes, it is stopped (TERM, then
  KILL), the outcome ``rolled_back`` is recorded with the reason (its exit code and last stderr lines,
  or "not healthy within N s"), and the current slot is started again.
- The current slot is restarted after a crash with an exponential backoff (1 s .. 60 s). A slot other
  than the base that crashes 3 times within 10 minutes without ever becoming healthy is given up:
  the previous slot (or the base install) becomes current, ``rolled_back`` recorded.
- SIGTERM/SIGINT is passed to the agent; the supervisor waits for it and exits 0.
- Killed itself (SIGKILL under the unit's ``KillMode=mixed``: systemd then stops the agent and starts
  the supervisor again), it starts from what is on disk: the pending slot gets its trial again, else
  the current slot runs; slot folders no state names and temporary files are removed first.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import IO, Protocol

from edge_agent.update.slots import (
    BASE,
    EXIT_RESTART,
    EXIT_UPDATE,
    SLOT_ENV,
    LastOutcome,
    PendingSlot,
    SlotRef,
    SlotState,
    SlotStore,
)

log = logging.getLogger("edge_agent.update.supervisor")

EXIT_CONFIG = 2
STDERR_TAIL_LINES = 20


class Child(Protocol):
    """A started agent process."""

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None when it is still running after ``timeout``."""
        ...

    def stderr_tail(self) -> str: ...


Starter = Callable[[SlotRef], Child]


class ProcessChild:
    """A real agent process; its stderr is passed through to ours, the last lines kept for reasons."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self._tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._reader = threading.Thread(target=self._pump, name="agent-stderr", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        stream = self.proc.stderr
        if stream is None:
            return
        out: IO[bytes] = sys.stderr.buffer
        for line in iter(stream.readline, b""):
            self._tail.append(line.decode("utf-8", "replace").rstrip())
            try:
                out.write(line)
                out.flush()
            except (OSError, ValueError):
                pass  # our stderr is gone (journal restarting): the tail is still kept

    def poll(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stderr_tail(self) -> str:
        self._reader.join(1.0)  # the last lines of an exited process
        return "\n".join(self._tail)


def process_starter(store: SlotStore, agent_args: Sequence[str], *, python: str = sys.executable) -> Starter:
    """Starts ``python -P -m edge_agent <agent_args>`` from a slot (``-P``: the working directory
    is not put in front of the slot on the import path)."""

    def start(ref: SlotRef) -> Child:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        site = store.site(ref.slot)
        if site is not None:
            env["PYTHONPATH"] = str(site)
        env[SLOT_ENV] = ref.slot
        log.info("starting agent %s from slot %s", ref.version, ref.slot)
        proc = subprocess.Popen(
            [python, "-P", "-m", "edge_agent", *agent_args], env=env, stderr=subprocess.PIPE
        )
        return ProcessChild(proc)

    return start


@dataclass(frozen=True)
class SupervisorConfig:
    poll_s: float = 0.2
    backoff_min_s: float = 1.0
    backoff_max_s: float = 60.0
    # A run at least this long (or one that wrote the healthy marker) resets the backoff.
    stable_s: float = 60.0
    crash_limit: int = 3
    crash_window_s: float = 600.0
    stop_timeout_s: float = 20.0  # under systemd's TimeoutStopSec (30 s), then KILL


class Supervisor:
    def __init__(
        self,
        store: SlotStore,
        starter: Starter,
        *,
        stop: threading.Event | None = None,
        config: SupervisorConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], bool] | None = None,
    ) -> None:
        """``sleep(s)`` waits up to ``s`` and returns True when the supervisor is to stop (default:
        ``stop.wait``); tests pass one that moves a fake ``clock``."""
        self.store = store
        self.starter = starter
        self.stop = stop or threading.Event()
        self.config = config or SupervisorConfig()
        self._clock = clock
        self._wall = wall
        self._sleep = sleep or self.stop.wait
        self._backoff = self.config.backoff_min_s
        self._crashes: dict[str, list[float]] = {}  # slot -> times of crashes before being healthy
        self.starts: list[SlotRef] = []  # every slot started, in order (tests, diagnostics)

    # ------------------------------------------------------------------ main loop

    def run(self) -> int:
        # A supervisor killed with its agent (kill -9, power cut) may have left an install, a prune or a
        # write half done; no agent runs yet, so nothing else is writing.
        self.store.tidy()
        while not self.stop.is_set():
            state = self.store.load()
            pending = state.pending
            if pending is not None and not self.store.exists(pending.slot):
                state = self._roll_back(pending, f"slot {pending.slot} is not installed")
                continue
            if pending is not None:
                self._run_pending(state, pending)
            else:
                self._run_current(state)
        return 0

    def _start(self, ref: SlotRef) -> Child:
        self.store.clear_healthy()
        self.starts.append(ref)
        return self.starter(ref)

    def _healthy(self, ref: SlotRef) -> bool:
        seen = self.store.read_healthy()
        return seen is not None and (seen.version, seen.slot) == (ref.version, ref.slot)

    def _run_pending(self, state: SlotState, pending: PendingSlot) -> None:
        ref = SlotRef(pending.version, pending.slot, pending.sha256)
        child = self._start(ref)
        deadline = self._clock() + pending.health_timeout_s
        while True:
            if self.stop.is_set():
                self._stop_child(child)
                return
            if self._healthy(ref):
                self._promote(pending)
                self._watch_current(child, ref, healthy=True)
                return
            code = child.poll()
            if code is not None:
                tail = _last_lines(child.stderr_tail())
                reason = f"exited with code {code} before it was healthy"
                self._roll_back(pending, f"{reason}: {tail}" if tail else reason)
                return
            if self._clock() >= deadline:
                self._stop_child(child)
                self._roll_back(pending, f"not healthy within {pending.health_timeout_s:g} s")
                return
            self._sleep(self.config.poll_s)

    def _promote(self, pending: PendingSlot) -> None:
        def change(s: SlotState) -> SlotState:
            new = SlotRef(pending.version, pending.slot, pending.sha256)
            outcome = LastOutcome(
                pending.version, "updated", "healthy", self._wall(), False, pending.sha256, s.current.version
            )
            return SlotState(current=new, previous=s.current, pending=None, last_outcome=outcome)

        state = self.store.update(change)
        log.info("agent %s is healthy: now the current version", pending.version)
        self._backoff = self.config.backoff_min_s
        self._crashes.pop(pending.slot, None)
        self.store.prune([s.slot for s in (state.current, state.previous) if s is not None])

    def _roll_back(self, pending: PendingSlot, reason: str) -> SlotState:
        log.error("agent %s rolled back: %s", pending.version, reason)

        def change(s: SlotState) -> SlotState:
            outcome = LastOutcome(
                pending.version,
                "rolled_back",
                reason[:4096],
                self._wall(),
                False,
                pending.sha256,
                s.current.version,
            )
            return replace(s, pending=None, last_outcome=outcome)

        state = self.store.update(change)
        keep = [s.slot for s in (state.current, state.previous) if s is not None]
        self.store.prune(keep)
        return state

    def _run_current(self, state: SlotState) -> None:
        ref = state.current
        if not self.store.exists(ref.slot):
            self._fall_back(state, f"slot {ref.slot} of version {ref.version} is missing")
            return
        child = self._start(ref)
        self._watch_current(child, ref, healthy=False)

    def _watch_current(self, child: Child, ref: SlotRef, *, healthy: bool) -> None:
        """Until ``child`` exits (or the supervisor stops); then restart, switch or fall back."""
        started = self._clock()
        while True:
            if self.stop.is_set():
                self._stop_child(child)
                return
            code = child.poll()
            if code is not None:
                break
            if not healthy and self._healthy(ref):
                healthy = True
                self._crashes.pop(ref.slot, None)
            self._sleep(self.config.poll_s)
        if code == EXIT_UPDATE:
            log.info("agent %s installed an update: switching to it", ref.version)
            self._backoff = self.config.backoff_min_s
            return
        if code == EXIT_RESTART:
            log.info("agent %s restarts on command", ref.version)
            self._backoff = self.config.backoff_min_s
            return
        ran = self._clock() - started
        tail = _last_lines(child.stderr_tail())
        log.warning("agent %s exited with code %s after %.1f s", ref.version, code, ran)
        if healthy or ran >= self.config.stable_s:
            self._backoff = self.config.backoff_min_s
        else:
            now = self._clock()
            crashes = [t for t in self._crashes.get(ref.slot, []) if now - t < self.config.crash_window_s]
            crashes.append(now)
            self._crashes[ref.slot] = crashes
            if ref.slot != BASE and len(crashes) >= self.config.crash_limit:
                why = (
                    f"crashed {len(crashes)} times within {self.config.crash_window_s:g} s without "
                    f"becoming healthy (last exit code {code})"
                )
                self._fall_back(self.store.load(), f"{why}: {tail}" if tail else why)
                return
        delay = self._backoff
        self._backoff = min(self.config.backoff_max_s, self._backoff * 2)
        log.info("restarting agent %s in %.0f s", ref.version, delay)
        self._sleep(delay)

    def _fall_back(self, state: SlotState, reason: str) -> None:
        bad = state.current
        target = (
            state.previous if state.previous is not None and self.store.exists(state.previous.slot) else None
        )
        target = target or self.store.base()
        log.error("agent %s given up (%s): falling back to %s", bad.version, reason, target.version)

        def change(s: SlotState) -> SlotState:
            outcome = LastOutcome(
                bad.version, "rolled_back", reason[:4096], self._wall(), False, bad.sha256, target.version
            )
            return SlotState(current=target, previous=None, pending=None, last_outcome=outcome)

        self.store.update(change)
        self._crashes.pop(bad.slot, None)
        self._backoff = self.config.backoff_min_s

    def _stop_child(self, child: Child) -> None:
        child.terminate()
        if child.wait(self.config.stop_timeout_s) is None:
            log.warning("agent did not stop within %.0f s: killing it", self.config.stop_timeout_s)
            child.kill()
            child.wait(5.0)


def _last_lines(text: str, n: int = 5) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[:2000]


def _data_dir(config: Path) -> Path:
    from edge_agent.core.settings import load_settings

    return load_settings(config).data_dir


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m edge_agent.supervisor",
        description="run the edgefleet agent from its A/B slot, with update and roll-back",
    )
    parser.add_argument("--config", required=True, type=Path, help="agent YAML configuration")
    args, _ = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s supervisor: %(message)s")
    from edge_agent.core.settings import SettingsError

    try:
        data_dir = _data_dir(args.config)
    except SettingsError as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    store = SlotStore(data_dir)
    stop = threading.Event()
    supervisor = Supervisor(store, process_starter(store, argv), stop=stop)

    def _stop(signum: int, frame: FrameType | None) -> None:
        log.info("signal %s: stopping the agent", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
