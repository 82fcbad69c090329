"""The status document of the local page: what a technician on site needs, read from the agent's parts.

Every figure is read from the parts' own thread-safe accessors, each of which holds its lock only for a
copy; nothing here waits on the link, the pipeline or a camera. The document is built at most once per
``max_age_s`` whatever the number of readers, so a page left open on several phones costs the agent one
read a second.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from edge_agent import __version__
from fleet_protocol.messages import AgentReported, CameraStats, ReportedState

# Connect errors listed on the page (the link keeps more; the newest matter on site).
CONNECT_ERRORS_SHOWN = 10


class Link(Protocol):
    @property
    def connected(self) -> bool: ...


class Backlog(Protocol):
    """The outbox."""

    def pending(self) -> int: ...

    def oldest_pending_at(self) -> float | None: ...

    @property
    def dropped(self) -> int: ...


class Cameras(Protocol):
    """The pipeline."""

    def stats(self) -> list[CameraStats]: ...

    def watchdog_status(self) -> dict[str, Any]: ...


class Reported(Protocol):
    """The twin."""

    def reported_state(self) -> ReportedState: ...


class System(Protocol):
    """The device's health."""

    def system(self) -> dict[str, Any]: ...


class Slots(Protocol):
    """The agent updater."""

    def reported(self) -> AgentReported: ...


@dataclass(frozen=True)
class StatusParts:
    device_id: str
    link: Link
    outbox: Backlog
    pipeline: Cameras
    twin: Reported
    health: System
    updater: Slots | None
    # Per camera, the newest capture failure in words (None: none since it started).
    camera_errors: Callable[[], Mapping[str, str | None]]
    slot_state: Callable[[], dict[str, Any] | None]


def uplink_state(link: Link) -> dict[str, Any]:
    """Connected or not, the last connect error in words and the recent ones (newest last)."""
    errors: Iterable[tuple[float, str]] = getattr(link, "connect_errors", None) or ()
    listed = [{"at": at, "error": err} for at, err in list(errors)[-CONNECT_ERRORS_SHOWN:]]
    return {
        "connected": link.connected,
        "last_error": getattr(link, "last_error", None),
        "connect_errors": listed,
    }


def _cameras(parts: StatusParts) -> list[dict[str, Any]]:
    stats = {c.camera: c for c in parts.pipeline.stats()}
    reported = parts.twin.reported_state().cameras
    errors = parts.camera_errors()
    out = []
    for cam in sorted(set(stats) | set(reported)):
        st, rep = stats.get(cam), reported.get(cam)
        out.append(
            {
                "id": cam,
                "state": st.state.value if st is not None else "stopped",
                "last_error": errors.get(cam),
                "fps": round(st.fps, 1) if st is not None else 0.0,
                "frames": st.frames if st is not None else 0,
                "dropped": st.dropped if st is not None else 0,
                "inference_ms": st.inference_ms if st is not None else None,
                "model": rep.model if rep is not None else None,
                "model_state": rep.state if rep is not None else "idle",
                "progress_pct": rep.progress_pct if rep is not None else None,
                "error": rep.error if rep is not None else None,
            }
        )
    return out


def _system(raw: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("uptime_s", "cpu_pct", "memory_pct", "memory_used_mb", "disk_free_mb", "disk_pct")
    gpus = [g.model_dump(mode="json") if hasattr(g, "model_dump") else g for g in raw.get("gpus") or []]
    return {**{k: raw.get(k) for k in keys}, "gpus": gpus}


def status_document(parts: StatusParts, now: float) -> dict[str, Any]:
    """The page's JSON (``now``: unix seconds, for the outbox's oldest pending age)."""
    oldest = parts.outbox.oldest_pending_at()
    update = parts.updater.reported().model_dump(mode="json") if parts.updater is not None else None
    return {
        "device_id": parts.device_id,
        "agent_version": __version__,
        "at": now,
        "uplink": uplink_state(parts.link),
        "outbox": {
            "pending": parts.outbox.pending(),
            "oldest_pending_age_s": round(max(0.0, now - oldest), 1) if oldest is not None else None,
            "dropped": parts.outbox.dropped,
        },
        "cameras": _cameras(parts),
        "watchdog": parts.pipeline.watchdog_status(),
        "system": _system(parts.health.system()),
        "update": update,
        "slots": parts.slot_state(),
    }


class StatusReader:
    """The status document, built at most once per ``max_age_s`` (readers in between share it)."""

    def __init__(self, parts: StatusParts, *, max_age_s: float = 1.0) -> None:
        self.parts = parts
        self._max_age_s = max_age_s
        self._lock = threading.Lock()
        self._built_at = float("-inf")
        self._doc: dict[str, Any] = {}

    def document(self) -> dict[str, Any]:
        with self._lock:
            if time.monotonic() - self._built_at >= self._max_age_s:
                self._doc = status_document(self.parts, time.time())
                self._built_at = time.monotonic()
            return self._doc
