"""A site link in userspace: a TCP proxy that holds each direction to a rate, with a one-way delay.

This machine's ``tc`` has no netem, so a slow, far link (a camera site's uplink) is emulated here, in
front of a real port (the broker's, or a bare TCP server's). :class:`LinkProxy` is one link: each
``listen(upstream)`` opens a local port that forwards to ``upstream``, and every connection through
every port of one proxy shares the link's two directions, as the connections of one device share its
site link.

One direction is a drop-free bottleneck with a propagation delay:

* bytes read from the sender join the bottleneck queue and leave it at ``rate`` (bits per second) on a
  virtual clock: a read of ``n`` bytes at time ``now`` leaves at ``max(now, previous departure) +
  n * 8 / rate``; the clock is shared by every connection, so they share the bandwidth;
* each read reaches the far end ``one_way_s`` after it left the queue (= ``rtt_s / 2``: the link is
  given by its round-trip time, split evenly), in order;
* the queue holds at most ``queue_bytes`` (default one bandwidth-delay product + 64 KiB, about what a
  site router's queue holds); while it is full the proxy does not read, its small receive buffer
  fills and the sender's TCP stalls, as behind a full router queue. The kernel's buffers of the
  proxy's sockets (about 2 x :data:`SOCKET_BUFFER` each) add to the queue. Nothing is dropped, so TCP's loss
  recovery and slow start are not modelled; the queue's delay and the rate are.

Bytes leave the queue and are delivered in reads of at most about 2 ms of the link's time (so a
delivery is never coarser than that); what the proxy holds in memory per direction is bounded by
the queue plus what is in propagation (``queue_bytes + bdp``), whatever the receiver does.

Usage::

    with LinkProxy(LinkSpec.parse("100mbit:40ms")) as link:
        port = link.listen(("127.0.0.1", broker_port))
        ...  # connect to 127.0.0.1:port instead of the broker
"""

from __future__ import annotations

import collections
import contextlib
import re
import socket
import threading
import time
from dataclasses import dataclass

# The proxy's socket buffers, each way: small, so a full queue stalls the sender soon and delivered
# bytes do not pile up in the kernel on their way to a receiver that stopped reading.
SOCKET_BUFFER = 64 * 1024
QUEUE_EXTRA_BYTES = 64 * 1024
_POLL_S = 0.2  # socket timeouts: how often a blocked thread looks at the stop event

_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class LinkSpec:
    """A symmetric link: ``rate_bps`` each way, ``rtt_s`` round trip (one way is half of it)."""

    rate_bps: float
    rtt_s: float

    def __post_init__(self) -> None:
        if self.rate_bps <= 0 or self.rtt_s < 0:
            raise ValueError(f"a link needs a positive rate and a non-negative RTT, not {self}")

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        """``RATE:RTT`` in tc's units, e.g. ``100mbit:40ms``, ``20mbit:100ms``, ``512kbit:0.6s``."""
        m = re.fullmatch(r"\s*([0-9.]+)\s*(bit|kbit|mbit|gbit)\s*:\s*([0-9.]+)\s*(us|ms|s)\s*", text.lower())
        if m is None:
            raise ValueError(f"expected RATE:RTT such as 100mbit:40ms, not {text!r}")
        return cls(
            rate_bps=float(m[1]) * _RATE_UNITS[m[2]],
            rtt_s=float(m[3]) * _TIME_UNITS[m[4]],
        )

    @property
    def one_way_s(self) -> float:
        return self.rtt_s / 2

    @property
    def bdp_bytes(self) -> int:
        return int(self.rate_bps / 8 * self.rtt_s)

    def __str__(self) -> str:
        return f"{self.rate_bps / 1e6:g} Mbit/s, {self.rtt_s * 1000:g} ms RTT"


class _Direction:
    """The bottleneck of one direction: a virtual clock of departures, shared by all connections."""

    def __init__(self, spec: LinkSpec, queue_bytes: int) -> None:
        self.bytes_per_s = spec.rate_bps / 8
        self.delay_s = spec.one_way_s
        self.queue_s = queue_bytes / self.bytes_per_s  # the queue, as time to drain it
        self.quantum = int(min(64 * 1024, max(1460, self.bytes_per_s * 0.002)))
        self.hold_max = queue_bytes + spec.bdp_bytes + self.quantum  # per connection, in memory
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the last byte queued so far leaves the queue
        self.bytes = 0

    def backlog_s(self, now: float) -> float:
        with self._lock:
            return max(0.0, self._free_at - now)

    def admit(self, n: int, now: float) -> float:
        """Queue ``n`` bytes read at ``now``; returns when they reach the far end."""
        with self._lock:
            self._free_at = max(now, self._free_at) + n / self.bytes_per_s
            self.bytes += n
            return self._free_at + self.delay_s


class _Pipe:
    """One direction of one connection: a reader that queues, a writer that delivers on time."""

    def __init__(self, conn: _Connection, src: socket.socket, dst: socket.socket, way: _Direction, name: str):
        self._conn = conn
        self._src, self._dst, self._way = src, dst, way
        self._cond = threading.Condition()
        # (deliver at, bytes; b"" = the sender's EOF); bounded by way.hold_max bytes.
        self._items: collections.deque[tuple[float, bytes]] = collections.deque()
        self.held = 0
        self.max_held = 0
        self.threads = [
            threading.Thread(target=self._read, name=f"{name}-read", daemon=True),
            threading.Thread(target=self._write, name=f"{name}-write", daemon=True),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _read(self) -> None:
        stop, way = self._conn.stop, self._way
        try:
            while not stop.is_set():
                # A full queue (or a receiver that stopped reading): leave the bytes in the socket.
                backlog = way.backlog_s(time.monotonic())
                if backlog > way.queue_s:
                    stop.wait(backlog - way.queue_s)
                    continue
                with self._cond:
                    if self.held + way.quantum > way.hold_max:
                        self._cond.wait(_POLL_S)
                        continue
                try:
                    data = self._src.recv(way.quantum)
                except TimeoutError:
                    continue
                deliver_at = way.admit(len(data), time.monotonic())
                with self._cond:
                    self._items.append((deliver_at, data))
                    self.held += len(data)
                    self.max_held = max(self.max_held, self.held)
                    self._cond.notify_all()
                if not data:
                    return  # EOF: the writer passes it on when it arrives
        except OSError:
            self._conn.abort()

    def _write(self) -> None:
        stop = self._conn.stop
        try:
            while not stop.is_set():
                with self._cond:
                    if not self._items:
                        self._cond.wait(_POLL_S)
                        continue
                    deliver_at, data = self._items[0]
                wait = deliver_at - time.monotonic()
                if wait > 0:
                    stop.wait(wait)
                    continue
                if not data:
                    self._dst.shutdown(socket.SHUT_WR)
                    self._conn.pipe_done()
                    return
                view = memoryview(data)
                while view and not stop.is_set():
                    try:
                        view = view[self._dst.send(view) :]
                    except TimeoutError:
                        continue  # nothing sent: the receiver is not reading; look at stop, try again
                with self._cond:
                    self._items.popleft()
                    self.held -= len(data)
                    self._cond.notify_all()
        except OSError:
            self._conn.abort()


class _Connection:
    def __init__(self, client: socket.socket, upstream: socket.socket, link: LinkProxy, n: int) -> None:
        self.stop = threading.Event()
        self._socks = (client, upstream)
        self._lock = threading.Lock()
        self._done = 0
        self.up = _Pipe(self, client, upstream, link._up, f"link-{n}-up")
        self.down = _Pipe(self, upstream, client, link._down, f"link-{n}-down")

    def start(self) -> None:
        self.up.start()
        self.down.start()

    def pipe_done(self) -> None:
        with self._lock:
            self._done += 1
            both = self._done == 2
        if both:
            self.close()

    def abort(self) -> None:
        # A reset or error on either side ends both: a broken link is broken both ways.
        self.close()

    def close(self) -> None:
        self.stop.set()
        for s in self._socks:
            with contextlib.suppress(OSError):  # already closed by the other side
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        self.up.wake()
        self.down.wake()

    def join(self, timeout: float) -> None:
        for t in (*self.up.threads, *self.down.threads):
            if t is not threading.current_thread():
                t.join(timeout)


class LinkProxy:
    """One emulated site link; see the module docstring. Stop it with :meth:`close` (or ``with``)."""

    def __init__(self, spec: LinkSpec, *, queue_bytes: int | None = None, host: str = "127.0.0.1") -> None:
        self.spec = spec
        self.host = host
        self.queue_bytes = queue_bytes if queue_bytes is not None else spec.bdp_bytes + QUEUE_EXTRA_BYTES
        self._up = _Direction(spec, self.queue_bytes)  # client -> upstream (device -> cloud)
        self._down = _Direction(spec, self.queue_bytes)  # upstream -> client (cloud -> device)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._listeners: list[tuple[socket.socket, threading.Thread]] = []
        self._conns: list[_Connection] = []
        self._n = 0

    def __enter__(self) -> LinkProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def bytes_up(self) -> int:
        return self._up.bytes

    @property
    def bytes_down(self) -> int:
        return self._down.bytes

    def max_held(self) -> int:
        """The most bytes one direction of one connection held in memory so far (tests: the bound)."""
        with self._lock:
            return max((max(c.up.max_held, c.down.max_held) for c in self._conns), default=0)

    @property
    def hold_max(self) -> int:
        return self._down.hold_max

    def listen(self, upstream: tuple[str, int]) -> int:
        """A new local port whose connections go to ``upstream`` over this link; returns the port."""
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):  # inherited by accepted sockets
            srv.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        srv.bind((self.host, 0))
        srv.listen(64)
        srv.settimeout(_POLL_S)
        port = int(srv.getsockname()[1])
        t = threading.Thread(
            target=self._accept, args=(srv, upstream), name=f"link-accept-{port}", daemon=True
        )
        with self._lock:
            self._listeners.append((srv, t))
        t.start()
        return port

    def _accept(self, srv: socket.socket, upstream: tuple[str, int]) -> None:
        while not self._stop.is_set():
            try:
                client, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            try:
                up = socket.create_connection(upstream, timeout=5)
            except OSError:
                client.close()  # upstream down: the client sees its connection closed
                continue
            for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                up.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
            for s in (client, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the link model sets the pace
                s.settimeout(_POLL_S)
            with self._lock:
                self._n += 1
                conn = _Connection(client, up, self, self._n)
                self._conns = [c for c in self._conns if not c.stop.is_set()] + [conn]
            conn.start()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._lock:
            listeners, conns = list(self._listeners), list(self._conns)
        for srv, _ in listeners:
            srv.close()
        for c in conns:
            c.close()
        for _, t in listeners:
            t.join(timeout)
        for c in conns:
            c.join(timeout)
