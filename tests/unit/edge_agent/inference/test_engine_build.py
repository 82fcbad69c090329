"""Engine builds run in a child process: the agent keeps its GIL, cancel and the time bound hold, and a
killed build leaves nothing in the cache.

The build process is real (``python -m edge_agent.inference.engine_build.child``); only the builder inside it
is a fake (``tests/support/fakes/tensorrt.py``), selected by ``BuildRequest.builder``. The
fake holds its own process's GIL for long stretches, like onnxruntime's session creation does.
The 60 s version of the first test is tests/integration/edge_agent/test_engine_build_60s.py.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_agent.inference.engine_build import (
    PROGRESS_QUEUE_MAX,
    BuildBusy,
    BuildFailed,
    BuildProgress,
    BuildRequest,
    BuildTimedOut,
    ChildProcessBuilds,
    ort_engines_ready,
)
from edge_agent.inference.tensorrt.backend import obtain_engine
from edge_agent.inference.tensorrt.build_config import BuildOptions
from edge_agent.inference.tensorrt.cache import EngineCache, EngineKey
from edge_agent.inference.tensorrt.errors import BuildCancelled
from tests.support.fakes.tensorrt import FakeEngine, FakeRuntime, hold_gil

FAKES = "tests.support.fakes.tensorrt"
KEY = EngineKey("c" * 64, "NVIDIA Jetson Orin", "8.7", "10.3.0", "fp16", build="0123456789abcdef")


class Heartbeat:
    """A thread of the agent's process that ticks every 0.5 s, like the MQTT keepalive must."""

    def __init__(self, period: float = 0.5) -> None:
        self.period = period
        self.ticks: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.ticks.append(time.monotonic())
            time.sleep(self.period)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def max_gap(self) -> float:
        return max((b - a for a, b in itertools.pairwise(self.ticks)), default=math.inf)


def request(target: Path, builder: str = "gil_builder", **params: Any) -> BuildRequest:
    return BuildRequest(
        build_id=KEY.file_name(),
        builder=f"{FAKES}:{builder}",
        onnx_path=target / "model.onnx",
        target_dir=target,
        engine_file=KEY.file_name(),
        params=params,
    )


def leftovers(target: Path) -> list[str]:
    """Anything a build could leave behind: engines, temporary files, work folders."""
    if not target.exists():
        return []
    return sorted(p.name for p in target.iterdir())


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


@pytest.fixture
def supervisor() -> Iterator[ChildProcessBuilds]:
    sup = ChildProcessBuilds(timeout_s=120, kill_grace_s=2.0)
    yield sup
    sup.cancel_all(wait_s=15)


def test_a_build_runs_in_its_own_process_while_the_agent_keeps_ticking(
    tmp_path: Path, supervisor: ChildProcessBuilds
) -> None:
    cache = EngineCache(tmp_path / "engines")
    seen: list[BuildProgress] = []
    with Heartbeat() as hb:
        handle = supervisor.start(
            request(cache.dir, seconds=2.0, engine=b"ENGINE:m:fp16"), on_progress=seen.append
        )
        work = 0
        while not handle.done():  # the agent's own work goes on meanwhile (inference, publishing...)
            a = np.random.default_rng(work).random((64, 64))
            work += int((a @ a).sum() > 0)
        result = handle.result(timeout=60)
        time.sleep(0.6)  # one more tick after the build
    assert handle.pid is not None and handle.pid != os.getpid()
    assert work > 10
    assert hb.max_gap() < 1.5, f"the agent's heartbeat stalled {hb.max_gap():.2f} s during the build"
    phases = [e.phase for e in seen]
    assert phases[0] == "spawned" and phases[1] == "starting" and phases[-1] == "succeeded"
    assert "publishing" in phases
    pcts = [e.pct for e in seen if e.phase == "building" and e.pct is not None]
    assert len(pcts) >= 3 and pcts == sorted(pcts) and pcts[-1] > 50
    assert [e.phase for e in handle.progress(timeout=1)] == phases  # the same events, through the queue
    assert result.files == [cache.path(KEY)] and result.info["pid"] == handle.pid
    assert cache.lookup(KEY) == b"ENGINE:m:fp16"
    assert leftovers(cache.dir) == [KEY.file_name()]  # no work folder, no temporary file


def test_the_same_work_in_a_thread_of_the_agent_would_stall_it() -> None:
    """The control: holding the GIL in-process (onnxruntime's session creation) stops every
    thread of the agent; the heartbeat test above would catch it."""
    with Heartbeat() as hb:
        time.sleep(0.6)
        worker = threading.Thread(target=hold_gil, args=(2.0,))
        worker.start()
        worker.join(30)
        time.sleep(0.6)
    assert hb.max_gap() >= 1.2


def test_cancel_stops_the_build_within_its_bound_and_leaves_no_file(
    tmp_path: Path, supervisor: ChildProcessBuilds
) -> None:
    target = tmp_path / "engines"
    handle = supervisor.start(request(target, seconds=60))
    for event in handle.progress(timeout=30):
        if event.phase == "building":
            break
    assert any(p.name.startswith(".build-") for p in target.iterdir()), "the build has its work folder"
    t0 = time.monotonic()
    assert handle.cancel("cancelled by the test") is True
    took = time.monotonic() - t0
    assert took < supervisor.kill_grace_s + 3, f"cancel took {took:.1f} s"
    assert handle.state == "cancelled" and gone(handle.pid or 0)
    with pytest.raises(BuildCancelled, match="cancelled by the test"):
        handle.result(timeout=0)
    assert leftovers(target) == []


def test_cancel_kills_a_build_that_ignores_sigterm(tmp_path: Path) -> None:
    sup = ChildProcessBuilds(kill_grace_s=0.5)
    target = tmp_path / "engines"
    handle = sup.start(request(target, seconds=60, ignore_sigterm=True))
    next(e for e in handle.progress(timeout=30) if e.phase == "building")
    t0 = time.monotonic()
    assert handle.cancel() is True
    assert time.monotonic() - t0 < 5.0
    assert gone(handle.pid or 0) and leftovers(target) == []


def test_the_agents_stop_event_cancels_the_build(tmp_path: Path, supervisor: ChildProcessBuilds) -> None:
    stop = threading.Event()
    target = tmp_path / "engines"
    handle = supervisor.start(request(target, seconds=60), cancel=stop)
    next(e for e in handle.progress(timeout=30) if e.phase == "building")
    stop.set()
    with pytest.raises(BuildCancelled, match="agent is stopping"):
        handle.result(timeout=supervisor.kill_grace_s + 5)
    assert leftovers(target) == []


def test_a_build_past_its_time_bound_fails_with_a_clear_reason(tmp_path: Path) -> None:
    sup = ChildProcessBuilds(timeout_s=2.0, kill_grace_s=1.0)
    target = tmp_path / "engines"
    t0 = time.monotonic()
    handle = sup.start(request(target, seconds=60))
    with pytest.raises(BuildTimedOut, match=r"time bound of 2 s"):
        handle.result(timeout=20)
    assert time.monotonic() - t0 < 8
    assert handle.state == "timed_out" and gone(handle.pid or 0)
    assert leftovers(target) == []
    # A request may carry its own bound (a big INT8 model), above the supervisor's.
    slow = replace(request(target, seconds=3.0), build_id="slow", engine_file="slow.engine", timeout_s=30)
    assert sup.start(slow).result(timeout=40).files == [target / "slow.engine"]


def test_a_builder_error_comes_back_as_the_reason(tmp_path: Path, supervisor: ChildProcessBuilds) -> None:
    target = tmp_path / "engines"
    handle = supervisor.start(request(target, "failing_builder", message="out of GPU memory (tactic 7)"))
    with pytest.raises(BuildFailed, match=r"RuntimeError: out of GPU memory \(tactic 7\)"):
        handle.result(timeout=30)
    assert leftovers(target) == []


def test_a_crashed_build_says_how_it_died_and_what_it_printed_last(
    tmp_path: Path, supervisor: ChildProcessBuilds
) -> None:
    target = tmp_path / "engines"
    handle = supervisor.start(request(target, "crashing_builder"))
    with pytest.raises(BuildFailed) as err:
        handle.result(timeout=30)
    assert "SIGSEGV" in str(err.value) and "tactic 42 of 97" in str(err.value)
    assert leftovers(target) == []


def test_one_build_per_engine_and_a_bounded_number_at_once(
    tmp_path: Path, supervisor: ChildProcessBuilds
) -> None:
    target = tmp_path / "engines"
    first = supervisor.start(request(target, seconds=60))
    assert supervisor.start(request(target, seconds=60)) is first  # the same engine: join it
    other = replace(request(target, seconds=1), build_id="other", engine_file="other.engine")
    with pytest.raises(BuildBusy, match="already running"):
        supervisor.start(other)
    first.cancel()
    assert supervisor.start(other).result(timeout=30).files == [target / "other.engine"]


def test_the_progress_queue_is_bounded_and_drops_the_oldest(
    tmp_path: Path, supervisor: ChildProcessBuilds
) -> None:
    handle = supervisor.start(request(tmp_path / "engines", "chatty_builder", events=600))
    handle.wait(30)
    events = list(handle.progress(timeout=1))
    assert len(events) == PROGRESS_QUEUE_MAX
    assert handle.events_dropped > 300
    assert events[-1].phase == "succeeded" and events[-2].phase == "publishing"
    assert handle.result().events_dropped > 300  # as counted when the result was made


def test_work_folders_of_dead_builds_are_swept(tmp_path: Path, supervisor: ChildProcessBuilds) -> None:
    target = tmp_path / "engines"
    dead = target / ".build-999999999-deadbeef"  # an agent killed mid-build
    dead.mkdir(parents=True)
    (dead / "half.engine").write_bytes(b"PARTIAL")
    supervisor.start(request(target, seconds=0.2)).result(timeout=30)
    assert leftovers(target) == [KEY.file_name()]


def test_the_build_dies_with_the_agent(tmp_path: Path) -> None:
    """An agent killed with -9 leaves no orphan build holding the GPU: the build exits by itself."""
    pid_file = tmp_path / "build.pid"
    script = f"""
import os, sys, time
from pathlib import Path
from edge_agent.inference.engine_build import BuildRequest, ChildProcessBuilds
sup = ChildProcessBuilds()
req = BuildRequest(build_id="b", builder="{FAKES}:gil_builder", onnx_path=Path("m.onnx"),
                   target_dir=Path({str(tmp_path / "engines")!r}), engine_file="b.engine",
                   params={{"seconds": 60, "pid_file": {str(pid_file)!r}}})
h = sup.start(req)
next(e for e in h.progress(timeout=30) if e.phase == "building")
os._exit(0)
"""
    agent = subprocess.run([sys.executable, "-c", script], cwd=Path.cwd(), timeout=60)
    assert agent.returncode == 0
    build_pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while not gone(build_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(build_pid), "the build process outlived its agent"
    assert not (tmp_path / "engines" / "b.engine").exists()


# --------------------------------------------------------------------------- wired to obtain_engine


def test_obtain_engine_builds_out_of_process_then_loads_from_the_cache(
    tmp_path: Path, supervisor: ChildProcessBuilds
) -> None:
    rt = FakeRuntime(builds_here=False)
    cache = EngineCache(tmp_path / "engines")
    options = BuildOptions(max_batch=4, sample_shape=(16, 16, 3))
    key = EngineKey.for_build(rt, "d" * 64, "fp16", options)
    notes: list[str] = []

    def build(calibration: object) -> None:
        req = BuildRequest.native(onnx_path=tmp_path / "m.onnx", cache=cache, key=key, options=options)
        assert req.engine_file == key.file_name() and req.options.timing_cache is not None
        fake = replace(req, builder=f"{FAKES}:gil_builder", params={"seconds": 0.5, "engine": b"ENGINE:oop"})
        supervisor.start(fake, on_progress=lambda e: notes.append(e.phase)).result(timeout=60)

    engine, outcome = obtain_engine(rt, cache, tmp_path / "m.onnx", key, options=options, build=build)
    assert isinstance(engine, FakeEngine) and engine.data == b"ENGINE:oop"
    assert not outcome.cache_hit and outcome.build_s is not None and "succeeded" in notes
    again, outcome2 = obtain_engine(rt, cache, tmp_path / "m.onnx", key, options=options, build=build)
    assert outcome2.cache_hit and isinstance(again, FakeEngine) and again.data == b"ENGINE:oop"


def test_a_cancelled_out_of_process_build_surfaces_as_build_cancelled(
    tmp_path: Path, supervisor: ChildProcessBuilds
) -> None:
    rt = FakeRuntime(builds_here=False)
    cache = EngineCache(tmp_path / "engines")
    stop = threading.Event()

    def build(calibration: object) -> None:
        req = replace(request(cache.dir, seconds=60), build_id=KEY.file_name())
        handle = supervisor.start(req, cancel=stop)
        threading.Timer(1.5, stop.set).start()
        handle.result()

    with pytest.raises(BuildCancelled):
        obtain_engine(rt, cache, tmp_path / "m.onnx", KEY, build=build)
    assert cache.entries() == [] and leftovers(cache.dir) == []


# --------------------------------------------------------------------------- onnxruntime's TensorRT EP


def ort_request(tmp_path: Path, warmups: tuple[int, ...] = (1, 4)) -> BuildRequest:
    trt_opts = {
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(tmp_path / "ort"),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(tmp_path / "ort"),
        "trt_fp16_enable": "True",
    }
    req = BuildRequest.ort_trt_ep(
        onnx_path=tmp_path / "m.onnx",
        model_sha256="e" * 64,
        cache_dir=tmp_path / "ort",
        providers=[("TensorrtExecutionProvider", trt_opts), "CUDAExecutionProvider", "CPUExecutionProvider"],
        input_name="image_tensor:0",
        input_dtype="uint8",
        sample_shape=(300, 300, 3),
        warmup_batches=warmups,
    )
    return replace(req, params={"session_factory": "tests.support.fakes.ort:FakeTrtSession"})


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_onnxruntime_builds_its_tensorrt_engines_in_the_build_process(
    tmp_path: Path, supervisor: ChildProcessBuilds, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_ORT_RECORD", str(tmp_path / "runs.jsonl"))
    req = ort_request(tmp_path)
    assert not ort_engines_ready(req)
    result = supervisor.start(req).result(timeout=60)
    ort_dir = tmp_path / "ort"
    names = [p.name for p in result.files]
    assert names[-1] == req.marker and names[-2].endswith(".engine")  # usable only once complete
    assert {n.rsplit(".", 1)[-1] for n in names} == {"timing", "profile", "engine", "built"}
    assert (ort_dir / names[-2]).read_bytes() == b"ORT-ENGINE"
    assert ort_engines_ready(req)
    init, *runs = records(tmp_path / "runs.jsonl")
    trt_opts = init["init"]["providers"][0][1]
    assert trt_opts["trt_engine_cache_path"] != str(ort_dir), "written into the work folder, then published"
    assert Path(trt_opts["trt_engine_cache_path"]).parent == ort_dir
    assert trt_opts["trt_fp16_enable"] == "True"  # the agent's own options otherwise
    assert [r["run"]["image_tensor:0"] for r in runs] == [
        [[1, 300, 300, 3], "uint8"],
        [[4, 300, 300, 3], "uint8"],
    ]
    assert sorted(p.name for p in ort_dir.iterdir() if p.name.startswith(".")) == []
    # The same request again is a different marker only if an option changes.
    assert replace(req, params={}).marker == req.marker
    other = ort_request(tmp_path, warmups=(1, 2))
    assert other.marker != req.marker and not ort_engines_ready(other)


def test_an_onnxruntime_build_without_the_tensorrt_ep_fails_and_publishes_nothing(
    tmp_path: Path, supervisor: ChildProcessBuilds, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_ORT_RECORD", str(tmp_path / "runs.jsonl"))
    monkeypatch.setenv("FAKE_ORT_PROVIDER", "CUDAExecutionProvider")
    req = ort_request(tmp_path)
    with pytest.raises(BuildFailed, match="onnxruntime gave CUDAExecutionProvider, not the TensorRT EP"):
        supervisor.start(req).result(timeout=60)
    assert leftovers(tmp_path / "ort") == [] and not ort_engines_ready(req)
