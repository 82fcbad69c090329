"""bench/preprocess.py runs and prints its figures (CI catches a broken bench; the figures themselves
are BENCHMARKS.md's business, not a test's)."""

from __future__ import annotations

import re

from tests.support.benches import run_bench


def test_preprocess_bench_smoke_prints_every_case_and_its_ratio() -> None:
    proc = run_bench("preprocess", "--smoke")
    out = proc.stdout + proc.stderr
    for model in ("ped_ssdlite", "nanodet_coco"):
        for size in ("720p", "1080p", "4K"):
            assert re.search(rf"^{model} .* {size}( +\d+\.\d+){{6}}$", proc.stdout, re.M), out
    assert re.search(r"^ratio raw resize / preprocess: median \d+\.\d+, range", proc.stdout, re.M), out
