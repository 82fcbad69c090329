"""bench/ingest.py, bench/transfer.py, bench/variants.py and bench/fleet.py (on the machine's PostgreSQL) run end to end in their ``--smoke``
configuration and print their ratio lines; CI catches a broken bench (and ingest's exit code catches
batches that were not stored). The figures themselves are BENCHMARKS.md's business, not a test's.
Each run takes ~10-20 s on 2 cores."""

from __future__ import annotations

import re

import pytest

from tests.support.benches import run_bench

pytestmark = pytest.mark.e2e


def _smoke(bench: str, timeout: float = 120) -> str:
    return run_bench(bench, "--smoke", timeout=timeout).stdout


def test_ingest_bench_smoke_alternates_raw_and_controller_and_stores_every_batch() -> None:
    out = _smoke("ingest")
    # Raw alone first (before the controller exists), then controller and raw alternate.
    assert re.search(r"^  raw 1 +: +\d+\.\d+ batches/s +\(before the controller started\)", out, re.M), out
    assert re.search(r"^  controller 1: +\d+\.\d+ batches/s .*stored per the API 100 of 100\)$", out, re.M), (
        out
    )
    assert re.search(r"^  raw 2 +: +\d+\.\d+ batches/s", out, re.M), out
    assert re.search(
        r"^ratio controller / raw: median \d+\.\d+, range \d+\.\d+-\d+\.\d+ over 1 run", out, re.M
    ), out
    assert re.search(r"^stored per the API: 100 of 100 per run$", out, re.M), out


def test_transfer_bench_smoke_prints_its_ratios_and_resume_figure() -> None:
    out = _smoke("transfer")
    assert re.search(
        r"^    ratio 1 agent / raw +\d+\.\d+ +\(median; range \d+\.\d+-\d+\.\d+ over 1 run", out, re.M
    ), out
    assert re.search(r"^    ratio 2 agents aggregate / raw +\d+\.\d+", out, re.M), out
    assert re.search(r"^    re-sent / missing bytes +\d+\.\d+", out, re.M), out


def test_variants_bench_smoke_reports_figures_on_frames_not_used_to_choose() -> None:
    out = _smoke("variants")
    assert "4 choose among the INT8 candidates, the other 4 give F1/IoU" in out, out
    for variant in ("fp32", "fp16", "int8"):
        assert re.search(rf"^\| {variant} \| \d+\.\d+ \|", out, re.M), out
    assert re.search(r"chosen on 4 held-out frames, figures from 4 other held-out frames", out), out
    # The ratio line: INT8's speed against FP32 measured in the same run, with its F1.
    assert re.search(
        r"^nanodet_coco: (PASS|FAIL) +int8 1T \d+\.\d+x faster than fp32 .*F1 \d\.\d{3}", out, re.M
    ), out


def test_fleet_bench_smoke_runs_a_replica_against_a_simulated_fleet_and_a_bare_subscriber() -> None:
    out = _smoke("fleet", timeout=240)
    assert re.search(r"^  raw +20 devices: +\d+\.\d+ batches/s delivered to a bare subscriber", out, re.M), (
        out
    )
    assert re.search(
        r"^  1 replica\(s\) +20 devices: +\d+\.\d+ batches/s \(\d+\.\d+ of raw\), p99 \d+ ms, .* ms/batch .* "
        r"ms/heartbeat, .*OK",
        out,
        re.M,
    ), out
    assert re.search(r"^  1 replica\(s\): 20 \([\d,]+ devices per replica-core\)$", out, re.M), out
