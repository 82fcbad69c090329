"""Reachability of the pool cameras this device could be given (PROTOCOL.md "Pool cameras").

The applied desired state's ``probe`` names, per camera, a source the device does not run. The probe
thread checks each about every ``probe_interval_s``, the first round within seconds of a new set,
without credentials and without decoding: a TCP connection to the source's host and port opened within
2 s, or the file existing for ``file:///path``. No secret is read: the host of
``rtsp://{secret:NAME}@host/path`` is after the reference. :meth:`ReachProbes.reach` is what the
heartbeat reports.

Probes of a round run one after another on the probe thread, never on the twin's or the heartbeat's;
each is bounded by the timeout, name lookup included, and a round by the 64 entries a state may name.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from edge_agent.control.pool import file_url_path
from fleet_protocol.messages import MAX_CAMERAS
from fleet_protocol.sources import SECRET_REF

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0
DEFAULT_PORTS = {"rtsp": 554, "rtsps": 322, "http": 80, "https": 443}
# A new probe set is checked this long after it arrives: the states a restart applies one after
# another (the last one in effect, then the desired one) make one round, not two.
FIRST_ROUND_S = 1.0
# The longest the probe thread waits without looking for a new set (the stop event ends any wait).
_POLL_S = 0.25
# Name lookups have no timeout of their own: each runs on a thread of its own that the probe stops
# waiting for at its deadline; this many at most at once, so a resolver that hangs cannot pile them up.
_LOOKUPS = threading.BoundedSemaphore(4)

Connector = Callable[[str, int, float], bool]
"""Whether a TCP connection to (host, port) opens within the timeout (s)."""


def tcp_connects(host: str, port: int, timeout_s: float) -> bool:
    """Whether a TCP connection to ``host``:``port`` opens within ``timeout_s``, name lookup included.
    The connection is closed at once: nothing is sent."""
    deadline = time.monotonic() + timeout_s
    for family, kind, proto, _, address in _addresses(host, port, deadline):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(left)
                sock.connect(address)
            return True
        except OSError:
            continue  # the host's next address, if any
    return False


def _addresses(host: str, port: int, deadline: float) -> list[tuple[Any, ...]]:
    """The addresses of ``host``, or none if they are not known by ``deadline``."""
    try:
        return list(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST))
    except (OSError, UnicodeError):
        pass  # a name, looked up below
    if not _LOOKUPS.acquire(timeout=max(0.0, deadline - time.monotonic())):
        return []
    found: list[tuple[Any, ...]] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            found.extend(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except (OSError, UnicodeError):
            pass
        finally:
            _LOOKUPS.release()
            done.set()

    threading.Thread(target=lookup, name="reach-lookup", daemon=True).start()
    # Once done is set the list is never written again; before, it is not read.
    return found if done.wait(max(0.0, deadline - time.monotonic())) else []


def _file_exists(path: str) -> bool:
    try:
        return Path(path).is_file()
    except OSError:
        return False


def probe_source(source: str, connect: Connector = tcp_connects, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether this device reaches ``source`` (as the controller sent it, references unexpanded): its
    host and port by TCP for a network source, the file for ``file:///path``. A source of another
    form, or whose host cannot be told without a secret, is not reached."""
    scheme = source.split("://", 1)[0].lower() if "://" in source else ""
    if scheme == "file":
        path = file_url_path(source)
        return path is not None and _file_exists(path)
    default_port = DEFAULT_PORTS.get(scheme)
    if default_port is None:
        return False
    try:
        parts = urlsplit(source)
        host, port = parts.hostname, parts.port or default_port
    except ValueError:  # a port out of range, a malformed IPv6 literal
        return False
    if not host or SECRET_REF.search(host):
        return False
    return connect(host, port, timeout_s)


class ReachProbes:
    """The probe set of the state applied last (twin thread: :meth:`set_probes`), probed on the probe
    thread (:meth:`run`), reported by the heartbeat (:meth:`reach`)."""

    def __init__(
        self,
        *,
        stop: threading.Event,
        interval_s: float,
        first_round_s: float = FIRST_ROUND_S,
        connect: Connector = tcp_connects,
        timeout_s: float = PROBE_TIMEOUT_S,
    ) -> None:
        self._stop = stop
        self.interval_s = interval_s
        self._first_round_s = first_round_s
        self._connect = connect
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._probes: dict[str, str] = {}  # camera id -> source as sent
        # camera id -> (the source probed, reached): reported while that is still the camera's source.
        self._results: dict[str, tuple[str, bool]] = {}
        self._new_set = False

    def set_probes(self, probes: Mapping[str, str]) -> None:
        """The probe set of the state being applied: it replaces the one before. A camera it no
        longer names, or names with another source, has no outcome until probed again."""
        if len(probes) > MAX_CAMERAS:  # the contract bounds it; a round must stay bounded regardless
            log.warning("probing the first %d of %d sources", MAX_CAMERAS, len(probes))
            probes = dict(sorted(probes.items())[:MAX_CAMERAS])
        with self._lock:
            if dict(probes) == self._probes:
                return
            self._probes = dict(probes)
            self._results = {c: r for c, r in self._results.items() if self._probes.get(c) == r[0]}
            self._new_set = True

    def probes(self) -> dict[str, str]:
        """The current probe set: camera id -> source as sent."""
        with self._lock:
            return dict(self._probes)

    def reach(self) -> dict[str, bool]:
        """Camera id -> reached, for the cameras of the current set probed at least once."""
        with self._lock:
            return {c: ok for c, (source, ok) in self._results.items() if self._probes.get(c) == source}

    def run(self) -> None:
        """The probe thread, until the stop event is set."""
        next_round: float | None = None  # time.monotonic() of the next round; None: nothing to probe
        while not self._stop.is_set():
            with self._lock:
                if self._new_set:
                    self._new_set = False
                    first = time.monotonic() + self._first_round_s
                    next_round = first if next_round is None else min(next_round, first)
                if not self._probes:
                    next_round = None
            left = _POLL_S if next_round is None else next_round - time.monotonic()
            if left > 0:
                self._stop.wait(min(left, _POLL_S))
                continue
            try:
                self._round()
            except Exception:
                log.exception("probing pool camera sources failed")
            next_round = time.monotonic() + self.interval_s

    def _round(self) -> None:
        """Probe each source of the set once; a new set ends the round (its own comes soon after)."""
        with self._lock:
            probes = sorted(self._probes.items())
        for camera, source in probes:
            if self._stop.is_set():
                return
            with self._lock:
                if self._new_set:
                    return
            reached = probe_source(source, self._connect, self._timeout_s)
            with self._lock:
                if self._probes.get(camera) != source:
                    continue
                before = self._results.get(camera)
                self._results[camera] = (source, reached)
            if before != (source, reached):
                log.info(
                    "pool camera %s: source %s %s", camera, source, "reached" if reached else "not reached"
                )
