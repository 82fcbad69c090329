"""bench/tracking.py runs and prints its figures (CI catches a broken bench; the figures themselves
are BENCHMARKS.md's business, not a test's)."""

from __future__ import annotations

import re

from tests.support.benches import run_bench


def test_tracking_bench_smoke_prints_both_costs_and_their_ratio() -> None:
    proc = run_bench("tracking", "--smoke")
    out = proc.stdout + proc.stderr
    assert re.search(r"^raw ByteTrackTracker: \d+\.\d+ ms/frame, 20 ids$", proc.stdout, re.M), out
    assert re.search(r"^edgefleet CameraTracking: \d+\.\d+ ms/frame, 20 ids$", proc.stdout, re.M), out
    assert re.search(r"^ratio raw / ours: \d+\.\d+$", proc.stdout, re.M), out
