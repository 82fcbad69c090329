"""RTSP cameras: the transport each camera's stream takes, and why a stream did not open.

Transport. OpenCV's FFmpeg backend takes demuxer options from nowhere but the environment variable
``OPENCV_FFMPEG_CAPTURE_OPTIONS`` (``key;value|key;value``), which it reads when a capture opens; unset,
it asks for ``rtsp_flags=prefer_tcp`` (TCP when the camera offers it). One variable serves the whole
process, so :class:`FfmpegOptionsGate` lets opens that need the same value run together and makes an
open that needs another wait until they are done, then sets it: two cameras with different transports
in one agent each get their own. The cost: a camera on another transport waits for the opens under way
(each bounded by its camera's ``open_timeout_s``); reads are never held. The variable is set through
``os.environ`` while no capture opens, but any other native code of the process that reads the
environment at that moment (none known in the agent) races with the write, as with any ``setenv``.

Diagnosis. When OpenCV cannot open a stream it says nothing about why. :func:`describe` asks the
camera itself (an RTSP DESCRIBE, with the source's credentials over Basic or Digest as the camera
asks) and turns the answer into a reason: credentials refused, no stream at the path, connection
refused, no answer. Its messages never hold the URL or its credentials.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
import secrets
import socket
import threading
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote, urlsplit, urlunsplit

FFMPEG_OPTIONS_ENV = "OPENCV_FFMPEG_CAPTURE_OPTIONS"

Transport = Literal["tcp", "udp"]

# The FFmpeg options that choose the RTSP transport; a camera's own transport replaces them.
_TRANSPORT_KEYS = ("rtsp_transport", "rtsp_flags")


def ffmpeg_options(base: str | None, transport: Transport | None) -> str | None:
    """The value of ``OPENCV_FFMPEG_CAPTURE_OPTIONS`` for an open over ``transport``: ``base`` (the
    variable as the agent found it) with its transport options replaced by ``rtsp_transport;<transport>``.
    None means the variable unset: no base and no transport, OpenCV's own default."""
    if transport is None:
        return base
    kept = [
        part
        for part in (base or "").split("|")
        if part and part.split(";", 1)[0].strip() not in _TRANSPORT_KEYS
    ]
    return "|".join([*kept, f"rtsp_transport;{transport}"])


class FfmpegOptionsGate:
    """Sets ``OPENCV_FFMPEG_CAPTURE_OPTIONS`` for each capture open without one open changing it under
    another. Opens needing the value in effect enter at once; one needing another value waits for the
    opens inside to leave, and the opens arriving after it wait behind it (no camera waits forever).

    ``environ``: the seam for tests (default the process's). The base value is read from it when the
    gate is made."""

    def __init__(self, environ: MutableMapping[str, str] | None = None) -> None:
        self._environ: MutableMapping[str, str] = os.environ if environ is None else environ
        self._base = self._environ.get(FFMPEG_OPTIONS_ENV)
        self._turnstile = threading.Lock()
        self._cond = threading.Condition()
        self._value = self._base
        self._inside = 0

    @contextlib.contextmanager
    def opening(self, transport: Transport | None) -> Iterator[None]:
        """Hold while the capture opens: the variable says ``transport`` (None: the base value)."""
        value = ffmpeg_options(self._base, transport)
        with self._turnstile, self._cond:
            while self._inside and self._value != value:
                self._cond.wait()
            if value != self._value or self._environ.get(FFMPEG_OPTIONS_ENV) != value:
                if value is None:
                    self._environ.pop(FFMPEG_OPTIONS_ENV, None)
                else:
                    self._environ[FFMPEG_OPTIONS_ENV] = value
                self._value = value
            self._inside += 1
        try:
            yield
        finally:
            with self._cond:
                self._inside -= 1
                self._cond.notify_all()


# Made at import, not on first use: capture threads start together, and two gates would each believe
# they own the variable. The base value is the environment the agent was started with.
_GATE = FfmpegOptionsGate()


def ffmpeg_gate() -> FfmpegOptionsGate:
    """The process's gate: the variable is the process's, so every camera must pass the same one."""
    return _GATE


# --------------------------------------------------------------------------------------- diagnosis

_MAX_HEAD = 64 * 1024
_STATUS = re.compile(r"RTSP/1\.\d (\d{3}) ?(.*)")
_PARAM = re.compile(r'(\w+)\s*=\s*(?:"([^"]*)"|([^,\s]*))')


@dataclass(frozen=True, slots=True)
class _Answer:
    code: int
    reason: str
    challenges: list[str]  # the WWW-Authenticate headers


def _request(host: str, port: int, uri: str, authorization: str | None, timeout_s: float) -> _Answer:
    lines = [f"DESCRIBE {uri} RTSP/1.0", "CSeq: 1", "Accept: application/sdp", "User-Agent: edgefleet-agent"]
    if authorization is not None:
        lines.append(f"Authorization: {authorization}")
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = b""
        while b"\r\n\r\n" not in data and len(data) < _MAX_HEAD:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    status = _STATUS.fullmatch(head[0].strip())
    if status is None:
        raise ValueError("the answer is not RTSP")
    challenges = [
        v.strip()
        for k, _, v in (h.partition(":") for h in head[1:])
        if k.strip().lower() == "www-authenticate"
    ]
    return _Answer(int(status.group(1)), status.group(2).strip(), challenges)


def _md5(text: str) -> str:
    return hashlib.md5(text.encode(), usedforsecurity=False).hexdigest()


def _authorization(challenges: list[str], user: str, password: str, uri: str) -> str | None:
    """The Authorization header answering the camera's challenges (Digest preferred, as cameras use
    it; else Basic); None for a scheme not known here."""
    for challenge in challenges:
        scheme, _, rest = challenge.partition(" ")
        if scheme.lower() != "digest":
            continue
        params = {
            m.group(1).lower(): m.group(2) if m.group(2) is not None else m.group(3)
            for m in _PARAM.finditer(rest)
        }
        realm, nonce = params.get("realm", ""), params.get("nonce", "")
        ha1 = _md5(f"{user}:{realm}:{password}")
        ha2 = _md5(f"DESCRIBE:{uri}")
        fields = [f'username="{user}"', f'realm="{realm}"', f'nonce="{nonce}"', f'uri="{uri}"']
        if "auth" in [q.strip() for q in params.get("qop", "").split(",")]:
            cnonce, nc = secrets.token_hex(8), "00000001"
            response = _md5(f"{ha1}:{nonce}:{nc}:{cnonce}:auth:{ha2}")
            fields += ["qop=auth", f"nc={nc}", f'cnonce="{cnonce}"']
        else:
            response = _md5(f"{ha1}:{nonce}:{ha2}")
        fields.append(f'response="{response}"')
        if "opaque" in params:
            fields.append(f'opaque="{params["opaque"]}"')
        return "Digest " + ", ".join(fields)
    if any(c.partition(" ")[0].lower() == "basic" for c in challenges):
        return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    return None


def describe(url: str, timeout_s: float = 5.0) -> str | None:
    """Why the camera at ``url`` (``rtsp://``) does not serve a stream, from its answer to an RTSP
    DESCRIBE; None when it serves one (status 200). The reason never holds the URL or its credentials."""
    parts = urlsplit(url)
    host = parts.hostname
    if parts.scheme.lower() != "rtsp" or not host:
        return None
    try:
        port = parts.port or 554
    except ValueError:
        return "the URL's port is not a number"
    netloc = f"[{host}]" if ":" in host else host
    uri = urlunsplit(("rtsp", f"{netloc}:{port}", parts.path or "/", parts.query, ""))
    user = unquote(parts.username) if parts.username is not None else None
    password = unquote(parts.password or "")
    try:
        answer = _request(host, port, uri, None, timeout_s)
        if answer.code == 401 and user is not None:
            authorization = _authorization(answer.challenges, user, password, uri)
            if authorization is None:
                schemes = ", ".join(c.partition(" ")[0] for c in answer.challenges) or "none named"
                return f"the camera asks for an authentication scheme not supported here ({schemes})"
            answer = _request(host, port, uri, authorization, timeout_s)
    except ConnectionRefusedError:
        return "connection refused"
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as exc:
        return f"cannot reach the camera: {exc.strerror or type(exc).__name__}"
    except ValueError as exc:
        return str(exc)
    status = f"RTSP {answer.code} {answer.reason}".rstrip()
    if answer.code == 200:
        return None
    if answer.code == 401:
        if user is None:
            return f"the camera asks for credentials and the source gives none ({status})"
        return f"the camera refused the credentials ({status})"
    if answer.code == 403:
        return f"the camera refused access ({status})"
    if answer.code == 404:
        return f"no stream at this path ({status})"
    return f"the camera answered {status}"
