"""An embedded MQTT broker (amqtt) for the demo, so it runs with no broker installed.

amqtt speaks MQTT 3.1.1 only and does not queue for offline persistent sessions; the edgefleet
contract does not rely on either (see fleet_protocol/PROTOCOL.md). Production uses Mosquitto.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


class EmbeddedBroker:
    """amqtt running on its own event loop in a named thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 1883) -> None:
        self.host = host
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._broker: Any = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> None:
        self._thread = threading.Thread(target=self._run, name="embedded-broker", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"embedded MQTT broker did not start within {timeout}s")
        if self._error is not None:
            raise RuntimeError(f"embedded MQTT broker failed to start: {self._error}") from self._error
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    log.info("embedded MQTT broker (amqtt) listening on %s", self.url)
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"embedded MQTT broker is not accepting connections on {self.url}")

    def _run(self) -> None:
        from amqtt.broker import Broker

        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        config = {
            "listeners": {
                "default": {"type": "tcp", "bind": f"{self.host}:{self.port}", "max_connections": 0}
            },
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }
        try:
            self._broker = Broker(config, loop=loop)
            loop.run_until_complete(self._broker.start())
        except BaseException as exc:  # surfaced to start() in the caller's thread
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    def stop(self, timeout: float = 10.0) -> None:
        loop, broker = self._loop, self._broker
        if loop is None or broker is None or not loop.is_running():
            return
        fut = asyncio.run_coroutine_threadsafe(broker.shutdown(), loop)
        try:
            fut.result(timeout)
        except Exception:  # a broker that fails to shut down cleanly must not block the demo's exit
            log.warning("embedded broker did not shut down cleanly", exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout)
