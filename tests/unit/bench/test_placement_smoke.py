"""bench/placement.py runs in its ``--smoke`` configuration and prints every figure it promises, with no
collateral move and no move under noise (those two are the planner's promises, not timings), and its
publish section puts every changed desired state on a real mosquitto: each one confirmed, and retained
signed, at the version committed, naming the cameras the plan gives its device. The timings themselves
are BENCHMARKS.md's business, not a test's."""

from __future__ import annotations

import re

from tests.support.benches import run_bench


def test_placement_bench_smoke_prints_its_figures_and_ratio() -> None:
    proc = run_bench("placement", "--smoke")
    out = proc.stdout + proc.stderr
    assert re.search(r"^full plan +: \d+\.\d+ ms for all sites .*placed \d+ of 500", out, re.M), out
    assert re.search(
        r"^ratio plan / raw: median \d+\.\d+, range \d+\.\d+-\d+\.\d+ over 2 runs$", out, re.M
    ), out
    assert re.search(r"^failover +: per site p50 \d+\.\d+ ms, p99 \d+\.\d+ ms over 50 failures", out, re.M), (
        out
    )
    assert re.search(r"moves \+ unplaced != orphans: 0\)$", out, re.M), out
    assert re.search(r"^collateral moves: 0$", out, re.M), out
    assert re.search(r"^noise ±15% +: 0\.0 moves per site-hour", out, re.M), out
    for strategy in ("spread", "pack"):
        assert re.search(
            rf"^energy {strategy} *: \d+ of 50 devices loaded, modelled \d+\.\d+ kW", out, re.M
        ), out
    assert re.search(
        r"^publish time: \d+ ms \(range \d+-\d+\) for 20 changed states over 2 runs, \d+\.\d+ ms per device "
        r".*; 0 not confirmed",
        out,
        re.M,
    ), out
    assert re.search(r"^raw publish : sequential \d+ ms .*; pipelined \d+ ms ", out, re.M), out
    assert re.search(
        r"^ratio publish / raw: sequential median \d+\.\d+ .*pipelined median \d+\.\d+ .* over 2 runs$",
        out,
        re.M,
    ), out
    assert re.search(
        r"^retained +: 20 desired states held by the broker for 20 devices; 20 signed for their device, "
        r"20 at the version committed, 20 naming the cameras the last plan gives them",
        out,
        re.M,
    ), out
