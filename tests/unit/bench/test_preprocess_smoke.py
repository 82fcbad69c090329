"""bench/preprocess.py runs and prints its figures (CI catches a broken bench; the figures themselves
are BENCHMARKS.md's business, not a test's)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_preprocess_bench_smoke_prints_every_case_and_its_ratio() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.preprocess", "--smoke"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for model in ("ped_ssdlite", "nanodet_coco"):
        for size in ("720p", "1080p", "4K"):
            assert re.search(rf"^{model} .* {size}( +\d+\.\d+){{6}}$", proc.stdout, re.M), out
    assert re.search(r"^ratio raw resize / preprocess: median \d+\.\d+, range", proc.stdout, re.M), out
