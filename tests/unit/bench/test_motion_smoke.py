"""bench/motion.py runs and prints its figures and a verdict per target (CI catches a broken bench; the
figures themselves are BENCHMARKS.md's business, not a test's)."""

from __future__ import annotations

import re

from tests.support.benches import run_bench


def test_motion_bench_smoke_prints_the_share_inferred_cpu_recall_and_verdicts() -> None:
    proc = run_bench("motion", "--smoke", timeout=600)
    out = proc.stdout
    assert len(re.findall(r"^frames inferred: ungated \d+, gated \d+ \(share [01]\.\d{3}", out, re.M)) == 2, (
        out
    )
    assert len(re.findall(r"^CPU s per camera-hour: ungated \d+, gated \d+", out, re.M)) == 2, out
    assert (
        len(re.findall(r"^track recall against ungated: \d+/\d+ = [01]\.\d{3} .*: (PASS|FAIL)$", out, re.M))
        == 2
    )
    assert re.search(r"^fewer inferences: \d+\.\d+x .*: (PASS|FAIL)$", out, re.M), out
    assert re.search(r"^overall: (PASS|FAIL)$", out, re.M), out
