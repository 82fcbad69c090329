"""What an operator asks of a device from afar: its recent log, a diagnostics bundle, a camera probe.

Each is a plain function of the agent's parts, run on the commands thread (``commands.py``), so a
probe of a dead camera never holds up capture or the link. Everything that leaves the device here is
redacted: log lines when they are recorded (``core/logring.py``), the configuration by field (every
password, token or secret field dropped, URLs through :func:`fleet_protocol.sources.redact_url`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edge_agent.core.logring import LogRing, level_number
from edge_agent.core.settings import AgentSettings, CameraConfig
from edge_agent.inference.gpu_stack import probe_stack
from edge_agent.inference.providers import cached_provider_probe
from edge_agent.vision.capture import SourceError, VideoSource, open_cv_source
from fleet_protocol.sources import redact_text, redact_url

log = logging.getLogger(__name__)

# A logs answer holds at most this many lines (the result must fit one MQTT payload).
MAX_LOG_LINES = 500
DEFAULT_LOG_LINES = 200
PROBE_TIMEOUT_S = 10.0
MAX_PROBE_TIMEOUT_S = 60.0
# Field names whose values are never sent: matched as a part of the name (mqtt_password_file too).
_SECRET_FIELDS = ("password", "secret", "token", "private", "credential")


class ArgError(ValueError):
    """A command's arguments are wrong: the message says which and what is allowed."""


def log_lines(ring: LogRing | None, args: dict[str, Any]) -> dict[str, Any]:
    """The ``logs`` command: ``lines`` (1..500, default 200), ``level`` (default ``debug``), ``since``
    (unix seconds: only newer lines, for following)."""
    if ring is None:
        raise ArgError("this agent keeps no log lines in memory")
    lines = args.get("lines", DEFAULT_LOG_LINES)
    if isinstance(lines, bool) or not isinstance(lines, int) or not 1 <= lines <= MAX_LOG_LINES:
        raise ArgError(f"lines must be an integer from 1 to {MAX_LOG_LINES}")
    level = args.get("level", "debug")
    since = args.get("since")
    if since is not None and (isinstance(since, bool) or not isinstance(since, int | float)):
        raise ArgError("since must be unix seconds")
    try:
        level_number(str(level))
    except ValueError as exc:
        raise ArgError(str(exc)) from None
    picked, lost = ring.lines(limit=lines, min_level=str(level), since=since)
    return {"lines": [ln.as_dict() for ln in picked], "lost": lost, "level": str(level).lower()}


def inference_stack() -> dict[str, Any]:
    """What this device can infer with: installed inference packages, the onnxruntime build, and
    the execution providers that really open a session here (with why each other one does not)."""
    report = probe_stack()
    probe = cached_provider_probe()
    return {
        "packages": dict(report.packages),
        "python": report.python,
        "onnxruntime": report.onnxruntime_version,
        "onnxruntime_device": report.onnxruntime_device,
        "tensorrt": report.tensorrt_version,
        "driver_cuda": report.driver_cuda,
        "jetson": report.jetson,
        "providers_available": list(probe.available),
        "providers_usable": list(probe.usable),
        "provider_problems": dict(probe.problems),
        "notes": list(report.notes),
    }


def redacted_config(settings: AgentSettings) -> dict[str, Any]:
    """The settings as JSON, without a secret: secret-named fields dropped, URLs and texts redacted."""
    raw = json.loads(settings.model_dump_json())
    return _redact_value(raw)


def _redact_value(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: ("***" if any(s in k.lower() for s in _SECRET_FIELDS) else _redact_value(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_redact_value(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def clock(args: dict[str, Any], received_at: float) -> dict[str, Any]:
    """The device's side of a clock reading: when the command arrived and when it was answered, with
    the controller's send time echoed, so the controller can take offset and round trip (NTP's four
    times)."""
    sent_at = args.get("sent_at")
    out: dict[str, Any] = {"received_at": received_at, "answered_at": time.time()}
    if isinstance(sent_at, int | float) and not isinstance(sent_at, bool):
        out["controller_sent_at"] = float(sent_at)
    return out


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    elapsed_s: float
    error: str | None = None
    width: int | None = None
    height: int | None = None
    fps: float | None = None
    codec: str | None = None
    decode: str | None = None
    first_frame_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The fields that hold something (``ok`` and ``elapsed_s`` always)."""
        keys = ("ok", "elapsed_s", "error", "width", "height", "fps", "codec", "decode", "first_frame_s")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


def probe_source(
    config: CameraConfig,
    *,
    timeout_s: float = PROBE_TIMEOUT_S,
    opener: Callable[[CameraConfig], VideoSource] = open_cv_source,
    stop: threading.Event | None = None,
) -> ProbeResult:
    """Open ``config``'s source on a connection of its own and read one frame, within ``timeout_s``.

    The running camera is not touched. The open runs on a thread of its own: OpenCV's open and read
    cannot be interrupted, and a camera that never answers must not hold the commands thread past
    the timeout (the thread is left to finish its own timeout and release what it opened).
    """
    cfg = config.model_copy(
        update={"open_timeout_s": min(config.open_timeout_s, timeout_s), "read_timeout_s": timeout_s}
    )
    started = time.monotonic()
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def attempt() -> None:
        src: VideoSource | None = None
        try:
            src = opener(cfg)
            outcome["opened_s"] = time.monotonic() - started
            frame = src.read()
            if frame is None:
                outcome["error"] = "opened, but no frame arrived"
            else:
                outcome["first_frame_s"] = time.monotonic() - started
                outcome["height"], outcome["width"] = int(frame.shape[0]), int(frame.shape[1])
            outcome["fps"] = src.fps
            outcome["codec"] = getattr(src, "codec", None)
            outcome["decode"] = getattr(src, "decode", None)
        except SourceError as exc:
            outcome["error"] = str(exc)
        except Exception as exc:  # whatever the source library raises is the probe's answer
            outcome["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            if src is not None:
                try:
                    src.release()
                except Exception:
                    log.debug("probe: release failed", exc_info=True)
            done.set()

    threading.Thread(target=attempt, name=f"probe-{config.id}", daemon=True).start()
    deadline = started + timeout_s
    while not done.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
            break
    elapsed = round(time.monotonic() - started, 3)
    if not done.is_set():
        return ProbeResult(
            ok=False,
            elapsed_s=elapsed,
            error=f"no frame within {timeout_s:g} s from {redact_url(config.source)}",
        )
    error = outcome.get("error")
    return ProbeResult(
        ok=error is None,
        elapsed_s=elapsed,
        error=redact_text(str(error).replace(config.source, redact_url(config.source))) if error else None,
        width=outcome.get("width"),
        height=outcome.get("height"),
        fps=outcome.get("fps"),
        codec=outcome.get("codec"),
        decode=outcome.get("decode"),
        first_frame_s=round(outcome["first_frame_s"], 3) if "first_frame_s" in outcome else None,
    )
