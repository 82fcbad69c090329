"""A real Mosquitto broker per test session, on a free port, with its own config.

Tests never use the machine's broker on 1883: it may be shared with other programs, and fault tests
must be able to stop and start theirs.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

MOSQUITTO_HINT = "mosquitto is not installed: install the Debian/Ubuntu package 'mosquitto'"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(host: str, port: int, timeout: float = 10.0, *, open_: bool = True) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                if open_:
                    return
        except OSError:
            if not open_:
                return
        time.sleep(0.05)
    raise TimeoutError(f"port {host}:{port} did not {'open' if open_ else 'close'} within {timeout}s")


class MosquittoBroker:
    """One mosquitto process; can be stopped, killed and started again on the same port."""

    def __init__(self, workdir: Path, port: int | None = None, extra_conf: str = "") -> None:
        binary = shutil.which("mosquitto") or (
            "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None
        )
        if binary is None:
            raise RuntimeError(MOSQUITTO_HINT)
        self.binary = binary
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.conf = self.workdir / "mosquitto.conf"
        self.log = self.workdir / "mosquitto.log"
        self.conf.write_text(
            f"listener {self.port} {self.host}\n"
            "allow_anonymous true\n"
            "persistence false\n"
            "max_queued_messages 100000\n"
            "max_inflight_messages 0\n"
            "message_size_limit 0\n"
            f"log_dest file {self.log}\n"
            "log_type error\nlog_type warning\nlog_type notice\n" + extra_conf
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.proc = subprocess.Popen(
            [self.binary, "-c", str(self.conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_port(self.host, self.port)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None
        wait_port(self.host, self.port, open_=False)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.proc = None
