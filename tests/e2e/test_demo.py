"""The README's main command: ``edgefleet demo`` shows person detections from both devices."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.support.mqtt_broker import free_port

pytestmark = pytest.mark.e2e


def test_demo_shows_persons_from_both_devices_and_stops_cleanly(tmp_path: Path) -> None:
    # Embedded amqtt broker, controller on SQLite, two agents on the bundled footage.
    api_port = free_port()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "controller",
            "demo",
            "--seconds",
            "45",
            "--port",
            str(api_port),
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "COLUMNS": "120"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "demo-cam-1: persons seen" in out and "demo-cam-2: persons seen" in out, out[-4000:]
    # Every part stopped: the agents stopped cleanly and said goodbye (their offline availability
    # went out), nothing was left running, the API port is closed.
    for name in ("demo-cam-1", "demo-cam-2"):
        log = (tmp_path / f"{name}.log").read_text()
        assert "Traceback" not in log, log[-3000:]
        assert "agent stopped" in log and "could not publish offline availability" not in log, log[-3000:]
    assert "Traceback" not in (tmp_path / "controller.log").read_text()
    left = [
        p.info
        for p in psutil.process_iter(["pid", "cmdline"])
        if any(str(tmp_path) in arg for arg in (p.info["cmdline"] or []))
    ]
    assert left == [], f"still running after the demo: {left}"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", api_port), timeout=1).close()
