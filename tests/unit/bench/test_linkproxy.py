"""The emulated site link (tests/support/linkproxy.py) that bench/transfer.py --link puts between an agent and
the broker: it must hold each direction to its rate, add its delay, keep the bytes intact and in order,
and hold a bounded number of bytes whatever the receiver does. Bounds are generous: these are
correctness checks of the emulation, not speed targets (a 2-core machine shared with other work)."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from tests.support.linkproxy import LinkProxy, LinkSpec
from tests.support.waiting import wait_for


class Server:
    """A bare TCP server on the far side of the link; ``handle`` runs per connection on its thread."""

    def __init__(self, handle: Callable[[socket.socket], None]) -> None:
        self._handle = handle
        self._srv = socket.create_server(("127.0.0.1", 0))
        self._srv.settimeout(0.2)
        self.port = int(self._srv.getsockname()[1])
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accepter = threading.Thread(target=self._accept, name="far-server", daemon=True)
        self._accepter.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), name="far-conn", daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            self._handle(conn)

    def close(self) -> None:
        self._stop.set()
        self._srv.close()
        self._accepter.join(5)
        for t in self._threads:
            t.join(5)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(min(1 << 20, n - len(buf)))
        if not part:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += part
    return bytes(buf)


@pytest.fixture
def link() -> Iterator[LinkProxy]:
    with LinkProxy(LinkSpec.parse("20mbit:60ms")) as proxy:
        yield proxy


def test_link_spec_reads_rate_and_round_trip_time_in_tc_units() -> None:
    spec = LinkSpec.parse("100mbit:40ms")
    assert (spec.rate_bps, spec.rtt_s, spec.one_way_s) == (100e6, 0.04, 0.02)
    assert spec.bdp_bytes == 500_000
    assert LinkSpec.parse("512kbit:0.6s") == LinkSpec(512e3, 0.6)
    with pytest.raises(ValueError):
        LinkSpec.parse("100mbps")


def test_a_small_request_and_its_answer_take_at_least_the_round_trip_time(link: LinkProxy) -> None:
    def echo(conn: socket.socket) -> None:
        conn.sendall(recv_exactly(conn, 5))

    server = Server(echo)
    try:
        port = link.listen(("127.0.0.1", server.port))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.monotonic()
            c.sendall(b"hello")
            assert recv_exactly(c, 5) == b"hello"
            elapsed = time.monotonic() - t0
    finally:
        server.close()
    assert elapsed >= link.spec.rtt_s
    assert elapsed < link.spec.rtt_s + 0.5  # delayed by the link, not stuck


def test_a_bulk_transfer_takes_its_size_over_the_rate_and_arrives_intact(link: LinkProxy) -> None:
    size = 2_500_000  # 1 s at 20 Mbit/s
    data = os.urandom(size)

    def send_on_go(conn: socket.socket) -> None:
        recv_exactly(conn, 1)
        conn.sendall(data)

    server = Server(send_on_go)
    try:
        port = link.listen(("127.0.0.1", server.port))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            t0 = time.monotonic()
            c.sendall(b"g")
            got = recv_exactly(c, size)
            elapsed = time.monotonic() - t0
    finally:
        server.close()
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    ideal = link.spec.rtt_s + size * 8 / link.spec.rate_bps
    assert elapsed >= 0.98 * ideal, f"{elapsed:.3f} s: faster than the link ({ideal:.3f} s)"
    assert elapsed <= 1.15 * ideal, f"{elapsed:.3f} s for an ideal {ideal:.3f} s"


def test_each_direction_has_the_whole_rate_while_the_other_is_busy(link: LinkProxy) -> None:
    size = 1_250_000  # 0.5 s at 20 Mbit/s, each way at once
    down = os.urandom(size)
    got_up: list[bytes] = []

    def both_ways(conn: socket.socket) -> None:
        recv_exactly(conn, 1)
        sender = threading.Thread(target=conn.sendall, args=(down,), daemon=True)
        sender.start()
        got_up.append(recv_exactly(conn, size))
        sender.join(10)

    server = Server(both_ways)
    up = os.urandom(size)
    try:
        port = link.listen(("127.0.0.1", server.port))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.sendall(b"g")
            t0 = time.monotonic()
            sender = threading.Thread(target=c.sendall, args=(up,), daemon=True)
            sender.start()
            got_down = recv_exactly(c, size)
            sender.join(10)
            wait_for(lambda: got_up, timeout=10, what="the upload to arrive")
            elapsed = time.monotonic() - t0
    finally:
        server.close()
    assert got_down == down and got_up[0] == up
    one_way = size * 8 / link.spec.rate_bps
    # Shaped independently: both finish in about the time of one, not of two back to back.
    assert one_way <= elapsed <= 1.5 * one_way + link.spec.rtt_s, f"{elapsed:.3f} s, {one_way:.3f} s each"


def test_a_receiver_that_stops_reading_stalls_the_sender_not_the_proxy_memory(link: LinkProxy) -> None:
    release = threading.Event()
    stalled = threading.Event()

    def flood(conn: socket.socket) -> None:
        block = b"x" * 65536
        conn.settimeout(0.5)
        while not release.is_set():
            try:
                conn.send(block)
            except TimeoutError:
                stalled.set()  # nothing taken for 0.5 s: the link pushes back
            except OSError:
                return

    server = Server(flood)
    try:
        port = link.listen(("127.0.0.1", server.port))
        with socket.socket() as c:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            c.connect(("127.0.0.1", port))
            # Never read: past the kernel's buffers and the proxy's bound, the sender must stall; a
            # proxy that kept reading would hold ever more and never stall it.
            wait_for(stalled.is_set, timeout=20, what="the sender to stall")
            assert 0 < link.max_held() <= link.hold_max
            release.set()
    finally:
        release.set()
        server.close()
