"""Fake builders for :mod:`edge_agent.inference.engine_build`, run inside the real build process.

The build process imports them by ``module:function`` (``BuildRequest.builder``), the seam that puts
a stand-in for TensorRT into the child. ``gil_builder`` behaves like the builds it stands for: it
holds its process's GIL for long stretches (as onnxruntime's session creation does), reports
progress, and writes its engine only at the end (a partial file first, so a kill mid-build would
show up as a half engine if the child's work folder were the cache).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

from edge_agent.inference.engine_build import BuildContext, BuildOutput, BuildRequest

_PATHOLOGICAL = re.compile(r"(a+)+b")


def hold_gil(seconds: float) -> None:
    """Keep the GIL for about ``seconds`` in one C call (the regex engine never releases it)."""
    runs = []
    for _ in range(3):  # the quickest of three: a busy machine only makes the hold longer
        t0 = time.perf_counter()
        _PATHOLOGICAL.match("a" * 18)
        runs.append(time.perf_counter() - t0)
    base = max(min(runs), 1e-4)  # each extra 'a' doubles the time
    n = 18 + max(0, math.ceil(math.log2(seconds / base)))
    _PATHOLOGICAL.match("a" * n)


def gil_builder(request: BuildRequest, ctx: BuildContext) -> BuildOutput:
    p = request.params
    seconds = float(p.get("seconds", 2.0))
    if p.get("ignore_sigterm"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = ctx.workdir / request.engine_file
    out.write_bytes(b"PARTIAL")  # what a half-written engine looks like
    if p.get("pid_file"):
        Path(p["pid_file"]).write_text(str(os.getpid()))
    t0 = time.monotonic()
    ctx.progress("building", 0.0)
    while (elapsed := time.monotonic() - t0) < seconds:
        hold_gil(min(0.25, seconds - elapsed))
        ctx.progress("building", min(99.9, 100.0 * (time.monotonic() - t0) / seconds))
    out.write_bytes(p.get("engine", b"ENGINE:fake"))
    return BuildOutput([request.engine_file], {"seconds": seconds, "pid": os.getpid()})


def failing_builder(request: BuildRequest, ctx: BuildContext) -> BuildOutput:
    ctx.progress("building", 10.0)
    (ctx.workdir / request.engine_file).write_bytes(b"PARTIAL")
    raise RuntimeError(request.params.get("message", "out of GPU memory while building"))


def crashing_builder(request: BuildRequest, ctx: BuildContext) -> BuildOutput:
    ctx.progress("building", 5.0)
    print("about to crash: tactic 42 of 97", flush=True)
    (ctx.workdir / request.engine_file).write_bytes(b"PARTIAL")
    os.kill(os.getpid(), signal.SIGSEGV)
    raise AssertionError("unreachable")


def chatty_builder(request: BuildRequest, ctx: BuildContext) -> BuildOutput:
    """Many progress events (each a new phase, so none is coalesced away), then a small engine."""
    for i in range(int(request.params.get("events", 600))):
        ctx.progress(f"phase-{i}", None)
    (ctx.workdir / request.engine_file).write_bytes(b"ENGINE:chatty")
    return BuildOutput([request.engine_file])


class FakeTrtSession:
    """onnxruntime.InferenceSession as the TensorRT EP would behave: its engine files appear in
    ``trt_engine_cache_path`` at session creation; every run is recorded in ``runs.jsonl``."""

    def __init__(self, path: str, *, sess_options: Any, providers: list[Any]) -> None:
        trt_opts = next(
            p[1] for p in providers if isinstance(p, tuple) and p[0] == "TensorrtExecutionProvider"
        )
        cache = Path(trt_opts["trt_engine_cache_path"])
        self.record = Path(os.environ["FAKE_ORT_RECORD"])
        got = os.environ.get("FAKE_ORT_PROVIDER", "TensorrtExecutionProvider")
        self.providers = [got, "CPUExecutionProvider"] if got != "CPUExecutionProvider" else [got]
        with self.record.open("a") as f:
            f.write(json.dumps({"init": {"path": path, "providers": providers}}) + "\n")
        if got == "TensorrtExecutionProvider":
            name = "TensorrtExecutionProvider_TRTKernel_graph_main_123_0_0_sm87"
            (cache / f"{name}.engine").write_bytes(b"ORT-ENGINE")
            (cache / f"{name}.profile").write_bytes(b"ORT-PROFILE")
            (cache / "TensorrtExecutionProvider_cache_sm87.timing").write_bytes(b"ORT-TIMING")

    def get_providers(self) -> list[str]:
        return self.providers

    def run(self, outputs: Any, feeds: dict[str, Any]) -> list[Any]:
        with self.record.open("a") as f:
            f.write(json.dumps({"run": {k: [list(v.shape), str(v.dtype)] for k, v in feeds.items()}}) + "\n")
        return []
