"""bench/transfer.py --link runs end to end (broker, controller, one agent behind the emulated site
link, a bare TCP transfer through the same link) and prints its ratio line; every run moved the
artifact and the bare transfer took at least the link's time for those bytes. The figures themselves
are BENCHMARKS.md's business. ~15 s on 2 cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_transfer_bench_over_a_site_link_compares_the_push_with_bare_tcp_on_the_same_link() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.transfer", "--link", "200mbit:20ms", "--smoke", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (r["rate_bps"], r["rtt_s"]) == (200e6, 0.02)
    (run,) = r["runs"]
    assert run["link_bytes_down"] >= r["size_bytes"]  # the push went through the link
    assert run["bare_s"] >= r["ideal_s"] + r["rtt_s"]  # the bare transfer was held to the link too
    assert 0 < r["ratio"] == run["ratio"]
