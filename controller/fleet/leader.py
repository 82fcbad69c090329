"""Who runs what must run once: the leader among controller replicas, and its fencing token.

Work that must run once across replicas (rollout ticks, twin convergence and desired-state
publishing, the offline sweep, retention and compaction, store GC, republish after a broker
reconnect) asks ``leadership.is_leader()`` before each round and calls ``leadership.fence(session)``
inside every transaction it commits, so a replica that lost the lock cannot commit after another
replica took over (the fencing epoch moved).

One process (SQLite, or PostgreSQL without replicas) is always the leader: ``ALWAYS_LEADER``.
"""

from __future__ import annotations

from typing import Protocol

from sqlmodel import Session

from controller.errors import ControllerError


class FencedOut(ControllerError, RuntimeError):
    """This replica is not the leader at the epoch it thinks it holds: the transaction must not commit."""


class Leadership(Protocol):
    """What leader-only work needs to know: whether to act, and the check that fences its writes."""

    @property
    def replica_id(self) -> str: ...

    def is_leader(self) -> bool: ...

    def fence(self, session: Session) -> None:
        """Raise ``FencedOut`` unless this replica still holds the leadership epoch it acts under."""
        ...


class AlwaysLeader:
    """The one-process controller: always leads, nothing to fence."""

    def __init__(self, replica_id: str = "single") -> None:
        self._replica_id = replica_id

    @property
    def replica_id(self) -> str:
        return self._replica_id

    def is_leader(self) -> bool:
        return True

    def fence(self, session: Session) -> None:
        return None


ALWAYS_LEADER = AlwaysLeader()
