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


def test_pipeline_bench_smoke_with_two_cameras_on_two_workers_prints_its_ratio() -> None:
    # Two cameras on two inference workers (one each): the raw limit measures both layouts of the
    # cores, and the agent runs its multi-worker path end to end.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.pipeline",
            "--smoke",
            "--cameras",
            "2",
            "--workers",
            "2",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=270,
        cwd=REPO,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    raw = re.search(r"^  raw 1: +\d+\.\d+ FPS +\((.*)\);", proc.stdout, re.M)
    assert raw, out
    labels = {part.rsplit(" ", 1)[0] for part in raw.group(1).split(", ")}
    # A one-thread layout has no intra-op pool to spin: measured once, spinning off as in the agent.
    assert labels == {"2x1t b1 spin off", "1x2t b2 spin off", "1x2t b2 spin on"}, out
    assert re.search(r"^  pipeline 1: +\d+\.\d+ FPS .*mean batch 1\.\d+/1\)", proc.stdout, re.M), out
    assert re.search(r"^  ratio 1: .*busy \d\.\d+ \(of 2\)", proc.stdout, re.M), out
    assert re.search(
        r"^ratio pipeline / raw: median \d+\.\d+, range \d+\.\d+-\d+\.\d+ over 1 run", proc.stdout, re.M
    ), out
