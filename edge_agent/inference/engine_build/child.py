"""The engine build process: ``python -m edge_agent.inference.engine_build.child``.

:func:`main` reads the pickled :class:`~edge_agent.inference.engine_build.BuildRequest`, runs its
builder (a "module:function" resolved here) with a :class:`BuildContext`, publishes the files the
builder wrote into its work folder by atomic rename and reports progress, the result or the error
as JSON lines on the events pipe. It exits by itself when the agent is gone or the build outlives
its bound. The builders the agent uses are here too: :func:`native_builder` (TensorRT) and
:func:`ort_trt_ep_builder` (onnxruntime's TensorRT EP). The agent's side is
:mod:`edge_agent.inference.engine_build`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import pickle
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from edge_agent.core.files import fsync_dir
from edge_agent.inference.engine_build import _CONTROL_FILES, BuildRequest
from edge_agent.inference.tensorrt.errors import TrtError


@dataclass
class BuildOutput:
    """What a builder returns: file names it wrote into the work folder, published in this order
    (the file that makes the result usable last), and anything worth reporting."""

    files: list[str]
    info: dict[str, Any] = field(default_factory=dict)


class BuildContext:
    """What a builder gets in the child: its work folder and a progress reporter."""

    def __init__(self, workdir: Path, emit: Callable[[dict[str, Any]], None]) -> None:
        self.workdir = workdir
        self._emit = emit
        self._lock = threading.Lock()
        self._last: tuple[str, float | None, float] = ("", None, 0.0)

    def progress(self, phase: str, pct: float | None = None, message: str = "") -> None:
        """Report progress; coalesced (a new phase, 100 %, or +1 % after 0.2 s goes through)."""
        now = time.monotonic()
        with self._lock:
            last_phase, last_pct, last_t = self._last
            if phase == last_phase and pct is not None and last_pct is not None and pct < 100.0:
                if pct - last_pct < 1.0 or now - last_t < 0.2:
                    return
            elif phase == last_phase and pct is None and now - last_t < 0.2 and not message:
                return
            self._last = (phase, pct, now)
        msg: dict[str, Any] = {"type": "progress", "phase": phase, "pct": pct}
        if message:
            msg["message"] = message[:500]
        self._emit(msg)


def _resolve(spec: str) -> Callable[..., Any]:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise TrtError(f"builder must be 'module:function', not {spec!r}")
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        raise TrtError(f"{spec} is not callable")
    return fn  # type: ignore[no-any-return]


def _publish(workdir: Path, target: Path, files: Sequence[str]) -> list[str]:
    """Move the builder's outputs into ``target``, one atomic rename each, in the given order."""
    for name in files:
        if not name or "/" in name or os.sep in name or name.startswith(".") or name in _CONTROL_FILES:
            raise TrtError(f"a builder may only publish plain file names, not {name!r}")
        src = workdir / name
        with src.open("rb+") as f:
            os.fsync(f.fileno())
    for name in files:
        os.replace(workdir / name, target / name)
    fsync_dir(target)
    return list(files)


def _guard(parent_pid: int, deadline: float) -> None:
    """Exit when the agent is gone (reparented) or the build outlives its bound by far."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(70)
        if time.monotonic() > deadline:
            os._exit(71)


def main(argv: Sequence[str] | None = None) -> int:
    """The build process: ``python -m edge_agent.inference.engine_build.child --request FILE --events-fd N``."""
    ap = argparse.ArgumentParser(prog="python -m edge_agent.inference.engine_build.child")
    ap.add_argument("--request", required=True, type=Path)
    ap.add_argument("--events-fd", required=True, type=int)
    args = ap.parse_args(argv)
    fd = args.events_fd
    write_lock = threading.Lock()

    def emit(msg: dict[str, Any]) -> None:
        data = (json.dumps(msg, default=str) + "\n").encode("utf-8")
        with write_lock:
            try:
                os.write(fd, data)
            except BrokenPipeError:
                os._exit(72)  # the supervisor is gone: nobody wants this engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    request, cfg = pickle.loads(args.request.read_bytes())
    assert isinstance(request, BuildRequest)
    threading.Thread(
        target=_guard,
        args=(int(cfg["parent_pid"]), time.monotonic() + float(cfg["deadline_s"])),
        name="build-guard",
        daemon=True,
    ).start()
    with contextlib.suppress(OSError):
        os.nice(int(cfg.get("niceness", 0)))
    ctx = BuildContext(args.request.parent, emit)
    try:
        ctx.progress("starting", 0.0)
        out = _resolve(request.builder)(request, ctx)
        if not isinstance(out, BuildOutput):
            raise TrtError(f"{request.builder} returned {type(out).__name__}, not a BuildOutput")
        ctx.progress("publishing", None)
        published = _publish(ctx.workdir, request.target_dir, out.files)
        emit({"type": "result", "files": published, "info": out.info})
        return 0
    except BaseException as exc:
        traceback.print_exc()
        emit({"type": "error", "error": type(exc).__name__, "message": str(exc)[:2000]})
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


# --------------------------------------------------------------------------- the builders


def native_builder(request: BuildRequest, ctx: BuildContext) -> BuildOutput:
    """A native TensorRT engine (``TensorRtRuntime.build_engine``), written as ``engine_file``."""
    from edge_agent.inference.tensorrt.runtime import TensorRtRuntime

    rt = TensorRtRuntime(request.device)
    if request.expect_runtime is not None and request.expect_runtime != (
        rt.gpu_name,
        rt.compute_capability,
        rt.version,
    ):
        raise TrtError(
            f"the build process sees {rt.gpu_name} sm{rt.compute_capability} TensorRT {rt.version}; "
            f"the engine key is for {request.expect_runtime}"
        )
    ctx.progress("building", 0.0)
    options = replace(request.options, progress=lambda pct: ctx.progress("building", pct), cancel=None)
    data = rt.build_engine(request.onnx_path, request.precision, request.calibration, options)
    if not data:
        raise TrtError("the TensorRT builder returned no engine")
    (ctx.workdir / request.engine_file).write_bytes(data)
    return BuildOutput(
        [request.engine_file],
        {"bytes": len(data), "gpu": rt.gpu_name, "trt_version": rt.version, "precision": request.precision},
    )


_ORT_CACHE_SUFFIXES = (".timing", ".profile", ".engine")


def ort_trt_ep_builder(request: BuildRequest, ctx: BuildContext) -> BuildOutput:
    """onnxruntime's TensorRT EP builds and caches its engines; the agent's session then loads them.

    The providers are the agent's own, with the engine and timing cache paths pointed at the work
    folder (so a killed build leaves nothing half-written where onnxruntime looks); the session
    must really get the TensorRT EP, else the build fails with what it got instead.
    """
    import onnxruntime as ort

    factory_spec = request.params.get("session_factory")
    factory = _resolve(str(factory_spec)) if factory_spec else ort.InferenceSession
    for existing in request.target_dir.glob("*.timing"):  # earlier tactic timings: faster builds
        shutil.copy2(existing, ctx.workdir / existing.name)
    providers: list[Any] = []
    for p in request.ort_providers:
        if isinstance(p, tuple) and p[0] == "TensorrtExecutionProvider":
            opts = dict(p[1])
            opts["trt_engine_cache_enable"] = "True"
            opts["trt_engine_cache_path"] = str(ctx.workdir)
            if opts.get("trt_timing_cache_enable") == "True":
                opts["trt_timing_cache_path"] = str(ctx.workdir)
            providers.append(("TensorrtExecutionProvider", opts))
        else:
            providers.append(p)
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, request.ort_graph_optimization_level)
    so.log_severity_level = 3
    ctx.progress("building", None, "onnxruntime TensorRT EP: creating the session")
    session = factory(str(request.onnx_path), sess_options=so, providers=providers)
    got = list(session.get_providers())
    if not got or got[0] != "TensorrtExecutionProvider":
        raise TrtError(f"onnxruntime gave {got[0] if got else 'no provider'}, not the TensorRT EP")
    n = len(request.warmup_batches)
    for i, b in enumerate(request.warmup_batches):
        ctx.progress("warmup", 100.0 * i / n, f"batch {b}")
        x = np.zeros((b, *request.sample_shape), dtype=np.dtype(request.input_dtype))
        session.run(None, {request.input_name: x})
    del session
    outputs = [p.name for p in ctx.workdir.iterdir() if p.is_file() and p.name not in _CONTROL_FILES]
    rank = {s: i for i, s in enumerate(_ORT_CACHE_SUFFIXES)}
    outputs.sort(key=lambda name: (rank.get(Path(name).suffix, len(rank) - 1), name))  # engines last
    if not any(name.endswith(".engine") for name in outputs):
        raise TrtError("onnxruntime's TensorRT EP wrote no engine (the graph may not be TensorRT-capable)")
    if request.marker:
        (ctx.workdir / request.marker).write_text(
            json.dumps({"files": outputs, "providers": got}, default=str), encoding="utf-8"
        )
        outputs.append(request.marker)
    return BuildOutput(outputs, {"providers": got, "engines": [o for o in outputs if o.endswith(".engine")]})


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy: builders return
    # edge_agent.inference.engine_build.child.BuildOutput, which main checks for.
    from edge_agent.inference.engine_build.child import main as _main

    sys.exit(_main())
