"""The local page's HTTP server: the page, ``/api/status`` and each camera's current frame.

stdlib ``http.server`` on a thread of its own (the agent does not depend on a web framework). It never
holds the agent up: it reads the status document (``status.py``) and the newest frame each camera's
capture thread left, and encodes on its own threads. Those are bounded: at most ``max_clients``
requests at once (one more is answered 503 and closed), each connection with a socket timeout, so a
slow or stalled client holds one thread for that long at most.

Every API call needs the device-local token (``Authorization: Bearer``), compared in constant time;
the page itself holds no data and asks for the token.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from edge_agent.core.settings import LocalPageConfig, check_private_file
from edge_agent.local.page import PAGE
from edge_agent.local.status import StatusReader

log = logging.getLogger(__name__)

TOKEN_FILE = "local_page.token"
MIN_TOKEN_CHARS = 16
# A connection that sends or reads nothing for this long is closed.
CLIENT_TIMEOUT_S = 10.0
# Frames wider than this are scaled down for the page: a phone shows no more, and encoding costs less.
SNAPSHOT_MAX_WIDTH = 1280
_SNAPSHOT = re.compile(r"^/api/cameras/([A-Za-z0-9_.-]{1,64})/snapshot\.jpg$")
_SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
_PAGE_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src blob:; "
    "connect-src 'self'; form-action 'none'; base-uri 'none'"
)

FrameOf = Callable[[str], np.ndarray | None]


class TokenError(ValueError):
    """The token file cannot be used: the message says why and what to do."""


def load_or_create_token(config: LocalPageConfig, data_dir: Path) -> str:
    """The device-local token: from ``token_file`` (owner-only), else from ``<data_dir>/local_page.token``,
    generated there (mode 0600) at the first start."""
    path = config.token_file or data_dir / TOKEN_FILE
    if config.token_file is None and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        token = secrets.token_urlsafe(24)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # written meanwhile by another start: read below
        else:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(token + "\n")
            log.warning("local page: a new token was written to %s (read it there to log in)", path)
            return token
    try:
        check_private_file(path, "local_page.token_file", "the local page's token")
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TokenError(f"local page token {path}: {exc}") from None
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenError(f"local page token {path}: at least {MIN_TOKEN_CHARS} characters needed")
    return token


def jpeg_of(image: np.ndarray) -> bytes:
    # OpenCV is imported on first use, as in capture.py: it comes with the `agent` extra only.
    import cv2

    if image.shape[1] > SNAPSHOT_MAX_WIDTH:
        scale = SNAPSHOT_MAX_WIDTH / image.shape[1]
        image = cv2.resize(image, (SNAPSHOT_MAX_WIDTH, max(1, int(image.shape[0] * scale))))
    ok, buf = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 80])
    if not ok:
        raise RuntimeError("JPEG encoding failed")
    return bytes(buf.tobytes())


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Bind failures must say "in use", not be papered over by SO_REUSEADDR stealing a port on some OSes.
    allow_reuse_address = False

    def __init__(self, address: tuple[str, int], page: LocalPage, max_clients: int) -> None:
        self.page = page
        self._slots = threading.BoundedSemaphore(max_clients)
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                )
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = CLIENT_TIMEOUT_S
    server_version = "edgefleet-local"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("local page %s: " + format, self.client_address[0], *args)

    def do_GET(self) -> None:
        page = self.server.page
        path = self.path.split("?", 1)[0]
        if path == "/":
            self._send(
                HTTPStatus.OK,
                PAGE.encode(),
                "text/html; charset=utf-8",
                {"Content-Security-Policy": _PAGE_CSP},
            )
            return
        if not path.startswith("/api/"):
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no page at {path[:100]}"})
            return
        if not page.authorized(self.headers.get("Authorization", "")):
            self._json(HTTPStatus.UNAUTHORIZED, {"error": "the device-local token is missing or wrong"})
            return
        if path == "/api/status":
            self._json(HTTPStatus.OK, page.status.document())
            return
        m = _SNAPSHOT.match(path)
        if m is None:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no API at {path[:100]}"})
            return
        image = page.frame_of(m.group(1))
        if image is None:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"camera {m.group(1)!r} has no frame now"})
            return
        self._send(HTTPStatus.OK, jpeg_of(image), "image/jpeg")

    def do_POST(self) -> None:
        self._json(HTTPStatus.METHOD_NOT_ALLOWED, {"error": "the local page only reads"})

    do_PUT = do_DELETE = do_PATCH = do_POST

    def _json(self, code: HTTPStatus, body: dict[str, Any]) -> None:
        self._send(code, json.dumps(body).encode(), "application/json")

    def _send(self, code: HTTPStatus, body: bytes, ctype: str, extra: dict[str, str] | None = None) -> None:
        try:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            if code == HTTPStatus.UNAUTHORIZED:
                self.send_header("WWW-Authenticate", 'Bearer realm="edgefleet-local"')
            for k, v in {**_SECURITY_HEADERS, **(extra or {})}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # a timeout included
            self.close_connection = True  # the client went away: nothing to tell it


class LocalPage:
    """The server: :meth:`start` binds and serves on the ``local-page`` thread, :meth:`close` stops it."""

    def __init__(
        self, config: LocalPageConfig, *, token: str, status: StatusReader, frame_of: FrameOf
    ) -> None:
        self.config = config
        self.status = status
        self.frame_of = frame_of
        self._token = token.encode()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def authorized(self, header: str) -> bool:
        scheme, _, given = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._token)

    @property
    def address(self) -> tuple[str, int] | None:
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> bool:
        """Bind and serve; False (logged) when the address cannot be bound: the agent runs on without it."""
        try:
            self._server = _Server((self.config.bind, self.config.port), self, self.config.max_clients)
        except OSError as exc:
            log.error(
                "local page not started: cannot listen on %s:%d (%s); set local_page.port to a free port",
                self.config.bind,
                self.config.port,
                exc.strerror or exc,
            )
            return False
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.5,), name="local-page", daemon=True
        )
        self._thread.start()
        log.info("local page on http://%s:%d/", self.config.bind, self.config.port)
        return True

    def close(self, timeout: float = 5.0) -> None:
        if self._server is None:
            return
        self._server.shutdown()  # returns once serve_forever has (within its 0.5 s poll)
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout)
        self._server = None


def open_local_page(
    config: LocalPageConfig, data_dir: Path, *, status: StatusReader, frame_of: FrameOf
) -> LocalPage | None:
    """The page serving, or None (logged) when it is off or cannot start: the agent runs on either way."""
    if not config.enabled:
        return None
    try:
        token = load_or_create_token(config, data_dir)
    except TokenError as exc:
        log.error("local page not started: %s", exc)
        return None
    page = LocalPage(config, token=token, status=status, frame_of=frame_of)
    return page if page.start() else None
