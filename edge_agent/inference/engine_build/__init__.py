"""TensorRT engine builds out of the agent's process, the agent's side: they never stall a device.

A build (native TensorRT, or onnxruntime's TensorRT EP creating its engines) takes minutes on a
Jetson. In the agent's process it would sit on the inference or twin thread, and onnxruntime's
session creation even holds the GIL the whole time (microsoft/onnxruntime#27063): MQTT keepalive,
heartbeats, capture and the watchdog would all stop. So every build runs in a child process
(``python -m edge_agent.inference.engine_build.child``, :mod:`.child`), supervised from a thread of
the agent:

    builds = ChildProcessBuilds(timeout_s=20 * 60)
    handle = builds.start(BuildRequest.native(...), on_progress=..., cancel=stop_event)
    for event in handle.progress(): ...        # BuildProgress(phase, pct, message, elapsed_s)
    handle.result(timeout=None)                # BuildResult, or BuildCancelled / BuildTimedOut / BuildFailed
    handle.cancel()                            # SIGTERM, then SIGKILL after the grace period

* Progress comes back over a pipe as JSON lines (the child coalesces them); the parent keeps the
  newest :data:`PROGRESS_QUEUE_MAX` events for :meth:`BuildHandle.progress` and drops the oldest,
  counted in ``events_dropped``.
* Cancel and the time bound kill the child's whole process group and delete its work folder.
* The child writes every output into a private work folder beside the target (same filesystem)
  and publishes it by ``os.replace``: a killed build never leaves half an engine in the cache.
* The child also dies on its own when the agent does (its parent changes) or when it outlives the
  time bound, so no orphan keeps the GPU busy.

What to build is a "module:function" (``BuildRequest.builder``), resolved in the child: the seam
tests use to put a fake builder in the child.

This package's ``__init__`` holds the agent's side (requests, results, :class:`ChildProcessBuilds`
and its :class:`BuildHandle`) and :mod:`.child` the build process. The child imports this module for
:class:`BuildRequest` (Python imports a package before its sub-module anyway), so the classes a
request is pickled with have one home, and nothing here imports the child.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import pickle
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from edge_agent.inference.tensorrt.build_config import BuildOptions, Calibration, Precision
from edge_agent.inference.tensorrt.cache import EngineCache, EngineKey, timing_cache_path
from edge_agent.inference.tensorrt.errors import BuildCancelled, TrtError

log = logging.getLogger(__name__)

DEFAULT_BUILD_TIMEOUT_S = 20 * 60.0
"""A first FP16 build of a detector on an 8 GB Orin Nano takes minutes; INT8 with calibration longer."""
DEFAULT_KILL_GRACE_S = 5.0
PROGRESS_QUEUE_MAX = 256
WORKDIR_PREFIX = ".build-"
NATIVE_BUILDER = "edge_agent.inference.engine_build.child:native_builder"
ORT_TRT_EP_BUILDER = "edge_agent.inference.engine_build.child:ort_trt_ep_builder"
_REQUEST_FILE = "request.pkl"
_LOG_FILE = "child.log"
_CONTROL_FILES = frozenset({_REQUEST_FILE, _LOG_FILE})

BuildState = Literal["running", "succeeded", "failed", "cancelled", "timed_out"]


class BuildFailed(TrtError):
    """The build process failed, crashed or was killed; the message says why (and its last output)."""


class BuildTimedOut(TrtError):
    """The build ran past its time bound and was stopped."""


class BuildBusy(TrtError):
    """As many builds as allowed are running already."""


@dataclass(frozen=True)
class BuildProgress:
    phase: str
    """``spawned``, ``starting``, ``building``, ``warmup``, ``publishing``, then ``succeeded``,
    ``failed``, ``cancelled`` or ``timed_out`` (the last event of every build)."""
    pct: float | None = None
    message: str = ""
    elapsed_s: float = 0.0


@dataclass(frozen=True)
class BuildRequest:
    """What to build, picklable: it crosses into the build process."""

    build_id: str
    """What the build produces (the engine file name): one build per id at a time."""
    builder: str
    """``module:function`` run in the child: ``(request, BuildContext) -> BuildOutput``."""
    onnx_path: Path
    target_dir: Path
    """Where outputs are published; the work folder is created inside it, so renames are atomic."""
    precision: Precision = "fp32"
    options: BuildOptions = field(default_factory=BuildOptions)
    calibration: Calibration | None = None
    device: int = 0
    engine_file: str = ""
    expect_runtime: tuple[str, str, str] | None = None
    """(GPU name, compute capability, TensorRT version) the engine key was made for: checked in the child."""
    ort_providers: tuple[Any, ...] = ()
    """onnxruntime providers exactly as the agent's session will get them (cache paths are rewritten)."""
    ort_graph_optimization_level: str = "ORT_ENABLE_ALL"
    input_name: str = ""
    input_dtype: str = "float32"
    sample_shape: tuple[int, ...] = ()
    warmup_batches: tuple[int, ...] = ()
    marker: str = ""
    """Written last into ``target_dir`` by a successful onnxruntime build: "these engines are there"."""
    timeout_s: float | None = None
    """Overrides the time bound :class:`ChildProcessBuilds` was given, for this build."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """For custom builders (tests' fakes; ``session_factory`` for the onnxruntime builder)."""

    @classmethod
    def native(
        cls,
        *,
        onnx_path: Path,
        cache: EngineCache,
        key: EngineKey,
        options: BuildOptions,
        calibration: Calibration | None = None,
        device: int = 0,
        timing_cache: bool = True,
        timeout_s: float | None = None,
    ) -> BuildRequest:
        """A native TensorRT build of ``key`` into ``cache`` (progress and cancel are the handle's)."""
        opts = replace(options, progress=None, cancel=None)
        if timing_cache and opts.timing_cache is None:
            opts = replace(opts, timing_cache=timing_cache_path(cache.dir, key))
        return cls(
            build_id=key.file_name(),
            builder=NATIVE_BUILDER,
            onnx_path=onnx_path,
            target_dir=cache.dir,
            precision=key.precision,
            options=opts,
            calibration=calibration,
            device=device,
            engine_file=key.file_name(),
            expect_runtime=(key.gpu_name, key.compute_capability, key.trt_version),
            timeout_s=timeout_s,
        )

    @classmethod
    def ort_trt_ep(
        cls,
        *,
        onnx_path: Path,
        model_sha256: str,
        cache_dir: Path,
        providers: Sequence[Any],
        input_name: str,
        input_dtype: str,
        sample_shape: Sequence[int],
        warmup_batches: Sequence[int] = (),
        graph_optimization_level: str = "ORT_ENABLE_ALL",
        timeout_s: float | None = None,
    ) -> BuildRequest:
        """onnxruntime's TensorRT EP builds its engines (session creation, then one run per
        ``warmup_batches``: ``(1, max_batch)`` for a dynamic batch without explicit profiles widens
        onnxruntime's implicit profile so no batch size rebuilds later) into ``cache_dir``."""
        provs = tuple((p[0], dict(p[1])) if isinstance(p, tuple) else p for p in providers)
        marker = ort_build_marker(model_sha256, provs, tuple(warmup_batches), graph_optimization_level)
        return cls(
            build_id=marker,
            builder=ORT_TRT_EP_BUILDER,
            onnx_path=onnx_path,
            target_dir=cache_dir,
            ort_providers=provs,
            ort_graph_optimization_level=graph_optimization_level,
            input_name=input_name,
            input_dtype=input_dtype,
            sample_shape=tuple(int(d) for d in sample_shape),
            warmup_batches=tuple(int(b) for b in warmup_batches),
            marker=marker,
            timeout_s=timeout_s,
        )


def ort_build_marker(
    model_sha256: str, providers: Sequence[Any], warmup_batches: Sequence[int], graph_optimization_level: str
) -> str:
    """The marker file name of an onnxruntime TensorRT EP build: model plus every option that changes
    which engines onnxruntime makes (its own engine names hash the model file name and graph)."""
    canonical = json.dumps(
        [
            model_sha256,
            [list(p) if isinstance(p, tuple) else p for p in providers],
            list(warmup_batches),
            graph_optimization_level,
        ],
        sort_keys=True,
        default=str,
    )
    return f"{model_sha256[:16]}-{hashlib.sha256(canonical.encode()).hexdigest()[:16]}.built"


def ort_engines_ready(request: BuildRequest) -> bool:
    """True when an earlier onnxruntime build of exactly this request left its engines in place:
    the in-process session will only deserialize them (seconds), no build process needed."""
    return bool(request.marker) and (request.target_dir / request.marker).is_file()


@dataclass(frozen=True)
class BuildResult:
    build_id: str
    files: list[Path]
    """The published outputs, in the order they were published."""
    duration_s: float
    info: dict[str, Any]
    events_dropped: int = 0
    exit_code: int | None = None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exited with code {rc}"


class BuildHandle:
    """One running build: its progress, result and cancel. Made by :meth:`ChildProcessBuilds.start`."""

    def __init__(
        self,
        request: BuildRequest,
        *,
        timeout_s: float,
        kill_grace_s: float,
        on_progress: Callable[[BuildProgress], None] | None,
        cancel_event: threading.Event | None,
    ) -> None:
        self.request = request
        self.timeout_s = timeout_s
        self.kill_grace_s = kill_grace_s
        self._on_progress = on_progress
        self._cancel_event = cancel_event
        self._cond = threading.Condition()
        self._events: collections.deque[BuildProgress] = collections.deque(maxlen=PROGRESS_QUEUE_MAX)
        self.events_dropped = 0
        self._done = threading.Event()
        self._cancel_reason: str | None = None
        self.state: BuildState = "running"
        self.reason = ""
        self._result: BuildResult | None = None
        self._t0 = time.monotonic()
        self.pid: int | None = None
        self.workdir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._fd: int | None = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- public

    @property
    def build_id(self) -> str:
        return self.request.build_id

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def progress(self, timeout: float | None = None) -> Iterator[BuildProgress]:
        """Progress events as they come, until the build ends (or ``timeout`` s pass); one consumer."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                while not self._events and not self._done.is_set():
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return
                    self._cond.wait(0.5 if remaining is None else min(0.5, remaining))
                if not self._events:
                    return  # done and drained
                event = self._events.popleft()
            yield event

    def cancel(self, reason: str = "cancelled", wait_s: float | None = None) -> bool:
        """Stop the build (SIGTERM, SIGKILL after the grace period) and delete its work folder.
        Returns once it is stopped (True) or after ``wait_s`` s (default: grace + 10 s)."""
        with self._cond:
            if not self._done.is_set() and self._cancel_reason is None:
                self._cancel_reason = reason
        return self._done.wait(self.kill_grace_s + 10.0 if wait_s is None else wait_s)

    def result(self, timeout: float | None = None) -> BuildResult:
        """The result once the build ends; raises :class:`BuildCancelled`, :class:`BuildTimedOut` or
        :class:`BuildFailed` for a build that did not succeed, and :class:`TimeoutError` when it is
        still running after ``timeout`` s (the build goes on)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"engine build {self.build_id} still running after {timeout} s")
        if self.state == "succeeded" and self._result is not None:
            return self._result
        if self.state == "cancelled":
            raise BuildCancelled(self.reason)
        if self.state == "timed_out":
            raise BuildTimedOut(self.reason)
        raise BuildFailed(self.reason)

    # ---------------------------------------------------------------- start

    def _spawn(
        self, python: str, env: Mapping[str, str], niceness: int, sweep: Callable[[Path], None]
    ) -> None:
        req = self.request
        req.target_dir.mkdir(parents=True, exist_ok=True)
        sweep(req.target_dir)
        workdir = req.target_dir / f"{WORKDIR_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        workdir.mkdir()
        self.workdir = workdir
        child_cfg = {
            # The child's own backstop: it exits if it outlives the bound by far (parent gone astray).
            "deadline_s": self.timeout_s + 2 * self.kill_grace_s + 30.0,
            "niceness": niceness,
            "parent_pid": os.getpid(),
        }
        r = w = -1
        try:
            (workdir / _REQUEST_FILE).write_bytes(pickle.dumps((req, child_cfg)))
            r, w = os.pipe()
            with (workdir / _LOG_FILE).open("wb") as log_file:
                self._proc = subprocess.Popen(
                    [
                        python,
                        "-m",
                        "edge_agent.inference.engine_build.child",
                        "--request",
                        str(workdir / _REQUEST_FILE),
                        "--events-fd",
                        str(w),
                    ],
                    pass_fds=(w,),
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=dict(env),
                    cwd=str(Path.cwd()),
                    start_new_session=True,  # its own process group: cancel kills all of it
                )
        except Exception as exc:
            for fd in (r, w):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            shutil.rmtree(workdir, ignore_errors=True)
            raise BuildFailed(f"could not start the engine build process: {exc}") from exc
        os.close(w)
        self._fd = r
        self.pid = self._proc.pid
        self._emit(BuildProgress("spawned", None, f"build process {self.pid}", 0.0))
        self._thread = threading.Thread(target=self._monitor, name=f"engine-build-{self.pid}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- the monitor thread

    def _emit(self, event: BuildProgress) -> None:
        with self._cond:
            if len(self._events) == self._events.maxlen:
                self.events_dropped += 1  # drop oldest
            self._events.append(event)
            self._cond.notify_all()
        if self._on_progress is not None:
            try:
                self._on_progress(event)
            except Exception:
                log.exception("engine build progress callback failed")

    def _monitor(self) -> None:
        assert self._proc is not None and self._fd is not None
        proc, fd = self._proc, self._fd
        deadline = self._t0 + self.timeout_s
        buf = b""
        eof = False
        result_msg: dict[str, Any] | None = None
        error_msg: dict[str, Any] | None = None
        state: BuildState = "failed"
        reason = ""
        exited_at: float | None = None

        def take(data: bytes) -> None:
            nonlocal buf, result_msg, error_msg
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                kind = msg.get("type")
                if kind == "progress":
                    self._emit(
                        BuildProgress(
                            str(msg.get("phase", "")),
                            msg.get("pct"),
                            str(msg.get("message", "")),
                            time.monotonic() - self._t0,
                        )
                    )
                elif kind == "result":
                    result_msg = msg
                elif kind == "error":
                    error_msg = msg

        try:
            while True:
                if not eof:
                    ready, _, _ = select.select([fd], [], [], 0.1)
                    if ready:
                        chunk = os.read(fd, 65536)
                        if chunk:
                            take(chunk)
                        else:
                            eof = True
                else:
                    time.sleep(0.05)
                with self._cond:
                    cancel_reason = self._cancel_reason
                if cancel_reason is None and self._cancel_event is not None and self._cancel_event.is_set():
                    cancel_reason = "cancelled: the agent is stopping"
                if cancel_reason is not None:
                    self._kill()
                    state, reason = "cancelled", f"engine build {cancel_reason}"
                    break
                if time.monotonic() >= deadline:
                    self._kill()
                    state = "timed_out"
                    reason = (
                        f"engine build exceeded its time bound of {self.timeout_s:.0f} s and was stopped "
                        "(raise inference.trt_build_timeout_s for slow devices)"
                    )
                    break
                rc = proc.poll()
                if rc is not None and eof:
                    if result_msg is not None:
                        state = "succeeded"
                        if rc != 0:  # CUDA/TensorRT teardown can crash after the outputs are published
                            log.warning(
                                "engine build %s published, then %s", self.build_id, _describe_exit(rc)
                            )
                    elif error_msg is not None:
                        reason = f"{error_msg.get('error', 'Error')}: {error_msg.get('message', '')}"
                    else:
                        reason = f"the engine build process {_describe_exit(rc)}"
                        tail = self._log_tail()
                        if tail:
                            reason += f"; its last output: {tail}"
                    break
                if rc is not None and not eof:
                    exited_at = exited_at or time.monotonic()
                    if time.monotonic() - exited_at > 2.0:
                        eof = True  # something else holds the pipe open; the build process is gone
                    continue  # drain what it wrote before it exited
        except Exception as exc:  # never leave a build unsupervised
            log.exception("engine build monitor failed")
            self._kill()
            state, reason = "failed", f"engine build supervision failed: {exc}"
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
        if state != "succeeded" and not reason:
            reason = "engine build failed"
        if state == "failed":
            log.warning("engine build %s failed: %s", self.build_id, reason)
        elif state != "succeeded":
            log.info("engine build %s: %s", self.build_id, reason)
        result = None
        if state == "succeeded" and result_msg is not None:
            result = BuildResult(
                build_id=self.build_id,
                files=[self.request.target_dir / f for f in result_msg.get("files", [])],
                duration_s=time.monotonic() - self._t0,
                info=dict(result_msg.get("info") or {}),
                events_dropped=self.events_dropped,
                exit_code=proc.returncode,
            )
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        final = BuildProgress(
            state, 100.0 if state == "succeeded" else None, reason, time.monotonic() - self._t0
        )
        with self._cond:
            self.state, self.reason, self._result = state, reason, result
        self._emit(final)
        with self._cond:
            self._done.set()
            self._cond.notify_all()

    def _kill(self) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(self.kill_grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10.0)

    def _log_tail(self, limit: int = 1500) -> str:
        if self.workdir is None:
            return ""
        try:
            data = (self.workdir / _LOG_FILE).read_bytes()[-limit:]
        except OSError:
            return ""
        return " | ".join(
            line.strip() for line in data.decode("utf-8", "replace").splitlines() if line.strip()
        )


class ChildProcessBuilds:
    """Starts engine builds in child processes and keeps track of them.

    ``timeout_s``: the time bound of one build (default 20 min, a Jetson's worst first build);
    ``kill_grace_s``: SIGTERM-to-SIGKILL on cancel or timeout; ``niceness``: the build's CPU priority
    below the agent's (capture and publishing keep their cores); ``max_concurrent``: builds at once
    (one: two builds on an 8 GB Orin compete for the same unified memory).
    """

    def __init__(
        self,
        *,
        timeout_s: float = DEFAULT_BUILD_TIMEOUT_S,
        kill_grace_s: float = DEFAULT_KILL_GRACE_S,
        niceness: int = 10,
        max_concurrent: int = 1,
        python: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if timeout_s <= 0 or kill_grace_s < 0 or max_concurrent < 1:
            raise ValueError("timeout_s > 0, kill_grace_s >= 0 and max_concurrent >= 1 are required")
        self.timeout_s = timeout_s
        self.kill_grace_s = kill_grace_s
        self.niceness = niceness
        self.max_concurrent = max_concurrent
        self.python = python or sys.executable
        self._env = dict(env) if env is not None else None
        self._lock = threading.Lock()
        self._active: dict[str, BuildHandle] = {}

    def _child_env(self) -> dict[str, str]:
        env = dict(self._env) if self._env is not None else dict(os.environ)
        root = str(Path(__file__).resolve().parents[3])  # where the edge_agent package is
        paths = [root, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        return env

    def start(
        self,
        request: BuildRequest,
        *,
        on_progress: Callable[[BuildProgress], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> BuildHandle:
        """Start ``request`` in a build process (or join the running build of the same id: its
        handle is returned as it is, with the first caller's ``on_progress`` and ``cancel``).

        ``on_progress`` is called from the supervising thread for every event; ``cancel``: an event
        that, once set, cancels the build (the agent's stop event). Raises :class:`BuildBusy` when
        ``max_concurrent`` other builds run, :class:`BuildFailed` when no process could be started.
        """
        with self._lock:
            self._active = {k: h for k, h in self._active.items() if not h.done()}
            running = self._active.get(request.build_id)
            if running is not None:
                return running
            if len(self._active) >= self.max_concurrent:
                busy = ", ".join(self._active)
                raise BuildBusy(f"{len(self._active)} engine build(s) already running ({busy})")
            handle = BuildHandle(
                request,
                timeout_s=request.timeout_s or self.timeout_s,
                kill_grace_s=self.kill_grace_s,
                on_progress=on_progress,
                cancel_event=cancel,
            )
            handle._spawn(self.python, self._child_env(), self.niceness, self._sweep)
            self._active[request.build_id] = handle
            return handle

    def active(self) -> list[BuildHandle]:
        with self._lock:
            return [h for h in self._active.values() if not h.done()]

    def cancel_all(
        self, reason: str = "cancelled: the agent is stopping", wait_s: float | None = None
    ) -> None:
        for handle in self.active():
            handle.cancel(reason, wait_s=0)
        for handle in self.active():
            handle.wait(self.kill_grace_s + 10.0 if wait_s is None else wait_s)

    def _sweep(self, target: Path) -> None:
        """Delete work folders left by builds that no longer run (an agent killed mid-build)."""
        mine = {h.workdir for h in self._active.values() if h.workdir is not None}
        for d in target.glob(f"{WORKDIR_PREFIX}*"):
            if d in mine or not d.is_dir():
                continue
            try:
                pid = int(d.name[len(WORKDIR_PREFIX) :].split("-", 1)[0])
            except ValueError:
                continue
            if pid == os.getpid() or not _pid_alive(pid):
                shutil.rmtree(d, ignore_errors=True)
