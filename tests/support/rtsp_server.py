"""A real RTSP camera for the tests: GStreamer's RTSP server streaming the bundled footage as H.264.

The server runs as a child of the Debian python (``/usr/bin/python3`` with ``python3-gi``; the
project's virtualenv cannot import ``gi``) on a free port of 127.0.0.1, executing ``rtsp_serve.py``
beside this file. ``stop()`` kills it under its clients, like a camera losing power; ``start()``
serves again on the same port. It is ready when an RTSP DESCRIBE of its path, with its credentials,
is answered 200 (the media built, the footage encoded): no sleep.

The footage is encoded once per cache file (a few seconds on two cores); pass the same ``cache`` to
servers of one module so only the first pays.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import socket
import subprocess
from pathlib import Path
from typing import Literal

from tests.support.mqtt_broker import free_port, wait_port
from tests.support.paths import FOOTAGE
from tests.support.waiting import wait_for

DEBIAN_PYTHON = Path("/usr/bin/python3")
SERVE_SCRIPT = Path(__file__).with_name("rtsp_serve.py")
PACKAGES = (
    "gir1.2-gst-rtsp-server-1.0 gstreamer1.0-rtsp gstreamer1.0-plugins-base gstreamer1.0-plugins-good "
    "gstreamer1.0-plugins-ugly gstreamer1.0-libav python3-gi"
)
RTSP_HINT = (
    "the RTSP tests need GStreamer's RTSP server under /usr/bin/python3: install the Debian packages "
    f"{PACKAGES} (bash tests/run.sh does as root)"
)


class RtspServer:
    """One RTSP server process serving the footage looped at each of ``paths`` (the first is the
    stream's); with ``user`` and ``password`` it asks for credentials (``auth``: Basic or Digest)."""

    def __init__(
        self,
        workdir: Path,
        *,
        cache: Path | None = None,
        paths: tuple[str, ...] = ("/cam",),
        user: str | None = None,
        password: str | None = None,
        auth: Literal["basic", "digest"] = "basic",
        port: int | None = None,
        frames: int = 200,
        fps: int = 10,
    ) -> None:
        if not DEBIAN_PYTHON.exists():
            raise RuntimeError(RTSP_HINT)
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cache = cache or workdir / "footage.h264au"
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.paths = paths
        self.path = paths[0]
        self.user, self.password, self.auth = user, password, auth
        self.frames, self.fps = frames, fps
        self.log = workdir / "rtsp-server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, *, user: str | None = None, password: str | None = None, path: str | None = None) -> str:
        """The stream's URL; the server's own credentials unless others are given."""
        user = self.user if user is None else user
        password = self.password if password is None else password
        auth = f"{user}:{password}@" if user is not None else ""
        return f"rtsp://{auth}{self.host}:{self.port}{path or self.path}"

    def start(self, timeout: float = 60.0) -> None:
        if self.alive():
            return
        cmd = [
            str(DEBIAN_PYTHON),
            str(SERVE_SCRIPT),
            f"--port={self.port}",
            *(f"--path={p}" for p in self.paths),
            f"--footage={FOOTAGE}",
            f"--cache={self.cache}",
            f"--frames={self.frames}",
            f"--fps={self.fps}",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        if self.user is not None:
            cmd += [f"--user={self.user}", f"--auth={self.auth}"]
            env["RTSP_SERVE_PASSWORD"] = self.password or ""
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        wait_for(self._ready, timeout=timeout, what=f"the RTSP server on port {self.port}", log=self.log)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _ready(self) -> bool:
        if not self.alive():
            tail = self.log.read_text(errors="replace")[-3000:]
            raise AssertionError(f"the RTSP server exited ({RTSP_HINT}):\n{tail}")
        # The footage is encoded before the server listens, so a Digest server's 401 (this check
        # sends no Digest answer) says it serves as well as another's 200 does.
        return self.describe() == (401 if self.user is not None and self.auth == "digest" else 200)

    def setups(self) -> list[tuple[str, str]]:
        """(path, "TCP" or "UDP") of every SETUP the server was sent, in order, across restarts."""
        found = re.findall(
            r"^SETUP (/[^ /]*)\S* RTP/AVP/?(TCP|UDP)?", self.log.read_text(errors="replace"), re.M
        )
        return [(path, transport or "UDP") for path, transport in found]

    def describe(self, path: str | None = None, *, authorized: bool = True) -> int:
        """The status code of an RTSP DESCRIBE of ``path`` (default the stream's), with the server's
        credentials unless ``authorized`` is False (Digest servers: the 401 only)."""
        uri = f"rtsp://{self.host}:{self.port}{path or self.path}"
        lines = [f"DESCRIBE {uri} RTSP/1.0", "CSeq: 1", "Accept: application/sdp"]
        if authorized and self.user is not None and self.auth == "basic":
            token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
            lines.append(f"Authorization: Basic {token}")
        with socket.create_connection((self.host, self.port), timeout=30) as sock:
            sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
            head = b""
            while b"\r\n" not in head:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                head += chunk
        status = head.split(b"\r\n", 1)[0].split()
        return int(status[1]) if len(status) >= 2 and status[0].startswith(b"RTSP/") else 0

    def stop(self) -> None:
        """Kill the server (SIGKILL: a camera that loses power says goodbye to no one) and wait until
        its port is closed, so ``start`` can take it again."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self.proc = None
        wait_port(self.host, self.port, open_=False)

    def __enter__(self) -> RtspServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
