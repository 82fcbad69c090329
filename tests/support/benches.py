"""Running a bench as the README does: ``python -m bench.NAME`` from the repository root (the benches
on the test harness import ``tests.support``), for the smoke tests that keep each bench working."""

from __future__ import annotations

import subprocess
import sys

from tests.support.paths import REPO


def run_bench(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``bench.NAME`` with ``args``; a non-zero exit fails the calling test with the output's tail."""
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc
