"""bench/pipeline.py --source rtsp runs end to end (GStreamer's RTSP server, broker, controller, an
agent reading the stream) and prints its latency figures and ratio; CI catches a broken bench. The
figures themselves are BENCHMARKS.md's business, not a test's."""

from __future__ import annotations

import re

import pytest

from tests.support.benches import run_bench

pytestmark = pytest.mark.e2e


def test_pipeline_bench_on_rtsp_prints_capture_to_detection_latency_and_its_ratio() -> None:
    proc = run_bench("pipeline", "--source", "rtsp", "--smoke", timeout=240)
    out = proc.stdout + proc.stderr
    lat = r"p50 +\d+\.\d+ ms, p99 +\d+\.\d+ ms"
    assert re.search(rf"^  raw [12]: capture -> detection {lat} \(\d+ frames;", proc.stdout, re.M), out
    # Frames reached the subscriber from the live stream, each after its capture.
    assert re.search(
        rf"^  pipeline 1: capture -> detection at a subscriber {lat} \([1-9]\d* frames, ", proc.stdout, re.M
    ), out
    assert re.search(
        r"^ratio raw / pipeline latency: p50 median \d+\.\d+, range \d+\.\d+-\d+\.\d+; p99 median \d+\.\d+ "
        r"over 1 run",
        proc.stdout,
        re.M,
    ), out
