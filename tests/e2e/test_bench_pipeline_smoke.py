"""bench/pipeline.py runs end to end (broker, controller, an agent with two cameras on the footage)
and prints its ratio; CI catches a broken bench. The figures are BENCHMARKS.md's business."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_pipeline_bench_smoke_with_two_cameras_prints_its_ratio() -> None:
    # Two cameras: the agent batches frames across cameras, as the multi-camera figures need.
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "pipeline.py"), "--smoke", "--cameras", "2"],
        capture_output=True,
        text=True,
        timeout=270,
        cwd=REPO,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(
        r"^  raw 1: +\d+\.\d+ FPS +\(spin off \d+\.\d+, spin on \d+\.\d+\);", proc.stdout, re.M
    ), out
    assert re.search(r"^  pipeline 1: +\d+\.\d+ FPS", proc.stdout, re.M), out
    assert re.search(
        r"^ratio pipeline / raw: median \d+\.\d+, range \d+\.\d+-\d+\.\d+ over 1 run", proc.stdout, re.M
    ), out
