"""The README's main command: ``edgefleet demo`` shows person detections from both devices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mqtt_broker import free_port

pytestmark = pytest.mark.e2e


def test_demo_shows_persons_from_both_devices_and_stops_cleanly(tmp_path: Path) -> None:
    # Embedded amqtt broker, controller on SQLite, two agents on the bundled footage.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "controller",
            "demo",
            "--seconds",
            "45",
            "--port",
            str(free_port()),
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
    # Every part stopped: the agents said goodbye (graceful offline), nothing was left running.
    for name in ("demo-cam-1", "demo-cam-2"):
        log = (tmp_path / f"{name}.log").read_text()
        assert "Traceback" not in log, log[-3000:]
    assert "Traceback" not in (tmp_path / "controller.log").read_text()
