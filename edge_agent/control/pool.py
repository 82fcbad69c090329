"""Pool cameras on this device (PROTOCOL.md "Pool cameras"): a camera the desired state gives the device
with a ``source`` it opens itself, started and stopped by the twin as states come and go.

This module turns a desired camera into the :class:`CameraConfig` of its capture: the source's scheme
checked, its ``{secret:NAME}`` references filled in from the device's secret files (``secrets_dir``),
a ``file:///path`` made a looping local file. Every error message is built from the source as the
controller sent it (references, never their values), so a report or log never carries a secret.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

from pydantic import ValidationError

from edge_agent.core.settings import CameraConfig, check_private_file
from edge_agent.vision.capture import CameraWorker
from fleet_protocol.messages import CameraDesired
from fleet_protocol.sources import SOURCE_SCHEMES, SecretMissing, expand

SecretReader = Callable[[str], str]
"""The text of the device's secret NAME; SecretMissing (naming it, never its value) when it has none."""

WorkerFactory = Callable[[CameraConfig], CameraWorker]
"""A capture worker for a pool camera, not started (the pipeline starts it)."""


class PoolCameraError(Exception):
    """A pool camera that cannot run on this device; the message says why and holds no secret."""


class SecretFiles:
    """The device's secrets: one file per name in ``directory``, owner-only (0600 or 0400), its text
    without the trailing newline an editor leaves. Read each time a camera needs it."""

    def __init__(self, directory: Path, on_read: Callable[[str], None] | None = None) -> None:
        """``on_read(text)``: told each secret's text as it is read (the log ring, so that the secret
        never leaves the device in a log line)."""
        self.directory = directory
        self._on_read = on_read

    def __call__(self, name: str) -> str:
        path = self.directory / name  # names are [A-Za-z0-9][A-Za-z0-9_.-]*: never a path of their own
        try:
            check_private_file(path, "secret file", holds=f"the secret {name}")
        except ValueError as exc:
            raise SecretMissing(str(exc)) from None
        try:
            text = path.read_text(encoding="utf-8").rstrip("\r\n")
        except FileNotFoundError:
            raise SecretMissing(f"secret {name} is not on this device (no file {path})") from None
        except UnicodeDecodeError:
            raise SecretMissing(f"secret file {path} is not UTF-8 text") from None
        except OSError as exc:
            raise SecretMissing(
                f"secret file {path} cannot be read: {exc.strerror or type(exc).__name__}"
            ) from None
        if not text:
            raise SecretMissing(f"secret file {path} is empty")
        if self._on_read is not None:
            self._on_read(text)
        return text


class PoolCameras:
    """What the twin needs to run pool cameras: the device's secrets and a way to make capture workers.

    ``make_worker`` builds a worker as the agent builds its configured cameras' (the agent's also has
    its camera_up/down events sent); ``removed`` is told each camera the twin stopped, so whatever
    ``make_worker`` registered is let go."""

    def __init__(
        self,
        *,
        make_worker: WorkerFactory,
        read_secret: SecretReader,
        removed: Callable[[str], None] | None = None,
    ) -> None:
        self._make_worker = make_worker
        self._read_secret = read_secret
        self._removed = removed

    def config(self, camera: str, desired: CameraDesired) -> CameraConfig:
        """The capture settings of pool camera ``camera``; PoolCameraError when it cannot run here."""
        if desired.source is None:
            raise PoolCameraError(f"camera {camera} has no source")
        return pool_camera_config(camera, desired.source, desired.max_fps, self._read_secret)

    def worker(self, config: CameraConfig) -> CameraWorker:
        return self._make_worker(config)

    def removed(self, camera: str) -> None:
        if self._removed is not None:
            self._removed(camera)


def file_url_path(url: str) -> str | None:
    """The local path a ``file:///path`` URL names (no host but ``localhost``, no query or fragment),
    percent-decoded; None when ``url`` is no such URL."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or not parts.path or parts.query or parts.fragment:
        return None
    return unquote(parts.path)


def pool_camera_config(
    camera: str, source: str, max_fps: float | None, read_secret: SecretReader
) -> CameraConfig:
    """The CameraConfig of a pool camera whose desired source is ``source`` (with its references):
    ``rtsp``/``rtsps``/``http``/``https`` opened as given once expanded, ``file:///path`` the local file,
    looped. PoolCameraError for a scheme this device cannot open or a secret it does not have."""
    scheme = source.split("://", 1)[0].lower() if "://" in source else ""
    if scheme not in SOURCE_SCHEMES:
        shown = f"scheme {scheme!r}" if scheme else "no scheme"
        raise PoolCameraError(
            f"source {source} cannot be opened on this device ({shown}; it opens "
            f"{', '.join(f'{s}://' for s in SOURCE_SCHEMES)})"
        )
    try:
        url = expand(source, read_secret)
    except SecretMissing as exc:
        raise PoolCameraError(f"source {source}: {exc}") from None
    fields: dict[str, object] = {"id": camera, "max_fps": max_fps}
    if scheme == "file":
        path = file_url_path(url)
        if path is None:
            raise PoolCameraError(f"source {source} is not a local file URL (file:///path)")
        # A file stands for a live camera: it loops, paced at its own rate.
        fields |= {"source": path, "loop": True}
    else:
        fields["source"] = url
    try:
        return CameraConfig.model_validate(fields)
    except ValidationError as exc:
        # Field names only: the input values hold the expanded source.
        bad = ", ".join(sorted({".".join(str(p) for p in e["loc"]) or "camera" for e in exc.errors()}))
        raise PoolCameraError(f"camera {camera} from source {source}: invalid {bad}") from None
