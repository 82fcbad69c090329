"""A small threaded TCP proxy that a test can blackhole: a link cut that never closes.

While blackholed, bytes read from either side are discarded (nothing is forwarded, nothing is
closed), and new connections are accepted and held silent: what a dead router or a pulled cable
looks like to both ends, which keep believing the connection is up until a keepalive says otherwise.
``heal`` forwards again; connections accepted during the cut stay dead (their peer must give up on
them and reconnect, as after a real cut).
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading

log = logging.getLogger(__name__)


class _Pair:
    def __init__(self, client: socket.socket, upstream: socket.socket | None, dead: bool) -> None:
        self.client = client
        self.upstream = upstream
        self.dead = dead  # accepted during a cut: never forwards

    def close(self) -> None:
        for s in (self.client, self.upstream):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.close()


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.host = "127.0.0.1"
        self.port = int(self._listener.getsockname()[1])
        self._blackholed = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pairs: list[_Pair] = []
        self.accepted = 0
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def start(self) -> None:
        t = threading.Thread(target=self._accept_loop, name="proxy-accept", daemon=True)
        t.start()
        self._threads.append(t)

    def blackhole(self) -> None:
        self._blackholed.set()

    def heal(self) -> None:
        self._blackholed.clear()

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for p in self._pairs:
                p.close()
        for t in self._threads:
            t.join(5)

    def _accept_loop(self) -> None:
        self._listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            dead = self._blackholed.is_set()
            upstream: socket.socket | None = None
            if not dead:
                try:
                    upstream = socket.create_connection(self.target, timeout=5)
                except OSError:
                    client.close()
                    continue
            pair = _Pair(client, upstream, dead)
            with self._lock:
                self._pairs.append(pair)
            t = threading.Thread(target=self._pump, args=(pair,), name="proxy-pump", daemon=True)
            t.start()
            self._threads.append(t)

    def _pump(self, pair: _Pair) -> None:
        sel = selectors.DefaultSelector()
        peers = {pair.client: pair.upstream}
        if pair.upstream is not None:
            peers[pair.upstream] = pair.client
        for s in peers:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(timeout=0.2):
                    src: socket.socket = key.fileobj  # type: ignore[assignment]
                    try:
                        data = src.recv(65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        return
                    if not data:
                        return  # a real close travels: close the other side too
                    dst = peers[src]
                    if pair.dead or dst is None or self._blackholed.is_set():
                        continue  # the cut: swallowed, neither side hears anything
                    try:
                        dst.setblocking(True)
                        dst.sendall(data)
                        dst.setblocking(False)
                    except OSError:
                        return
        finally:
            sel.close()
            pair.close()
