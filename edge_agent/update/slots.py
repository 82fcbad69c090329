"""The A/B slots on disk (``slots.json`` and the healthy marker).

The contract between the supervisor of the base install and every agent version it runs (PROTOCOL.md
"Agent updates"): an old supervisor reads what a new agent writes, so the format only grows.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from edge_agent import __version__
from edge_agent.core.files import atomic_write

log = logging.getLogger(__name__)


# Exit code of an agent that installed a new version and wants the supervisor to start it (EX_TEMPFAIL).
EXIT_UPDATE = 75
# Exit code of an agent restarting on an operator's command: started again at once, not a crash.
EXIT_RESTART = 76


# Set by the supervisor in the child's environment: the slot it runs, and that a supervisor is there.
SLOT_ENV = "EDGEFLEET_AGENT_SLOT"


BASE = "base"


@dataclass(frozen=True)
class SlotRef:
    version: str
    slot: str
    sha256: str | None = None


@dataclass(frozen=True)
class PendingSlot:
    version: str
    slot: str
    sha256: str
    since: float
    health_timeout_s: float


Outcome = Literal["updated", "rolled_back", "refused"]


@dataclass(frozen=True)
class LastOutcome:
    version: str
    outcome: Outcome
    reason: str
    at: float
    reported: bool = False
    sha256: str | None = None
    previous: str | None = None  # the version running before (updated) / running again (rolled back)


@dataclass(frozen=True)
class SlotState:
    current: SlotRef
    previous: SlotRef | None = None
    pending: PendingSlot | None = None
    last_outcome: LastOutcome | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SlotState:
        def opt(kind: type[Any], value: Any) -> Any:
            return kind(**value) if isinstance(value, dict) else None

        return cls(
            current=SlotRef(**data["current"]),
            previous=opt(SlotRef, data.get("previous")),
            pending=opt(PendingSlot, data.get("pending")),
            last_outcome=opt(LastOutcome, data.get("last_outcome")),
        )


class SlotStore:
    """``<data_dir>/agent``: ``slots.json``, the ``healthy`` marker and the slot folders.

    Two processes write ``slots.json`` (the supervisor, and the agent when it installs a pending slot
    or marks an outcome reported); every read-modify-write holds an flock, and every write is atomic
    (tmp + fsync + rename), so a power cut leaves the old state or the new one, never half of one.
    """

    def __init__(self, data_dir: Path, *, base_version: str = __version__) -> None:
        self.root = data_dir / "agent"
        self.slots_dir = self.root / "slots"
        self.path = self.root / "slots.json"
        self.healthy_path = self.root / "healthy"
        self.base_version = base_version

    def site(self, slot: str) -> Path | None:
        """The folder a slot's code runs from (PYTHONPATH); None for the base install."""
        return None if slot == BASE else self.slots_dir / slot / "site"

    def exists(self, slot: str) -> bool:
        site = self.site(slot)
        return site is None or (site / "edge_agent" / "__init__.py").is_file()

    def base(self) -> SlotRef:
        return SlotRef(self.base_version, BASE)

    def load(self) -> SlotState:
        """The state on disk; the base slot when there is none or it cannot be read (logged)."""
        try:
            raw = self.path.read_text()
        except FileNotFoundError:
            return SlotState(current=self.base())
        except OSError as exc:
            log.error("cannot read %s (%s): running the base install", self.path, exc)
            return SlotState(current=self.base())
        try:
            state = SlotState.from_json(json.loads(raw))
        except (ValueError, TypeError, KeyError) as exc:
            log.error("%s is unreadable (%s): running the base install", self.path, exc)
            return SlotState(current=self.base())
        if state.current.slot == BASE and state.current.version != self.base_version:
            # The base install was upgraded in place (apt/pip): it is what runs now.
            state = replace(state, current=self.base())
        return state

    def save(self, state: SlotState) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps(state.to_json(), indent=1).encode())

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / "slots.lock").open("a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def update(self, change: Callable[[SlotState], SlotState]) -> SlotState:
        with self.locked():
            state = change(self.load())
            self.save(state)
            return state

    # ------------------------------------------------------------------ healthy marker

    def write_healthy(self, version: str, slot: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        marker = {"version": version, "slot": slot, "pid": os.getpid()}
        atomic_write(self.healthy_path, json.dumps(marker).encode(), durable=False)

    def read_healthy(self) -> SlotRef | None:
        try:
            data = json.loads(self.healthy_path.read_text())
            return SlotRef(str(data["version"]), str(data["slot"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def clear_healthy(self) -> None:
        self.healthy_path.unlink(missing_ok=True)

    def tidy(self) -> SlotState:
        """Clear what a kill can leave half done (only while no agent runs: at the supervisor's start):
        slot folders no state names (an install cut short, a prune not reached) and the temporary files
        of writes that never reached their rename. Returns the state it kept to. With a ``slots.json``
        that cannot be read, the slot folders stay: the state that names them is unknown."""
        with self.locked():
            state = self.load()
            if self._readable():
                keep = [s.slot for s in (state.current, state.previous, state.pending) if s is not None]
                self.prune(keep)
            for name in (self.path.name, self.healthy_path.name):
                for tmp in self.root.glob(f"{name}.tmp*"):
                    tmp.unlink(missing_ok=True)
            return state

    def _readable(self) -> bool:
        """``slots.json`` is absent or holds a state (what :meth:`load` reads without falling back)."""
        try:
            SlotState.from_json(json.loads(self.path.read_text()))
        except FileNotFoundError:
            return True
        except (OSError, ValueError, TypeError, KeyError):
            return False
        return True

    def prune(self, keep: Sequence[str]) -> None:
        """Remove slot folders other than ``keep`` (current, previous, pending): disk is bounded."""
        if not self.slots_dir.is_dir():
            return
        for d in self.slots_dir.iterdir():
            if d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)
