"""Hang detection for the inference thread, and the supervision that restarts it.

A run that takes longer than ``hang_timeout_s`` is a hang. A hung thread cannot be killed in Python,
so it is abandoned: the generation moves on, the stuck (daemon) thread exits when its run ever
returns and its late result is dropped, and its backend is never closed under it. A fresh backend is
made for the model and a new inference thread started. :class:`~edge_agent.core.restart_policy.RestartLimiter`
bounds the restarts; past the bound the pipeline is marked failed and retried with capped backoff.
Every step goes to ``on_note`` for the agent to report.

A :class:`~edge_agent.inference.backend.CudaFatalError` (a sticky CUDA error: the GPU context of this process
is dead) is the exception to all of this: nothing is retried or reloaded after it. :meth:`fatal`
marks the watchdog fatal (no restart, retry or reload from then on), hands the error to ``on_fatal``
once (the agent publishes a final event and exits with ``exc.exit_code`` so the service manager
restarts the process) and sets the stop event.

The pipeline keeps its models, slots and stats. It tells the watchdog when a run starts and ends
(:meth:`InferenceWatchdog.run_started`, :meth:`InferenceWatchdog.run_finished`) and offers the few
operations a restart needs (:class:`InferenceHost`). The watchdog's lock is a leaf: nothing is
called while it is held, so it can never deadlock with the pipeline's own lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from edge_agent.core.restart_policy import RestartLimiter, WatchdogAction, WatchdogNote
from edge_agent.inference.backend import CudaFatalError, InferenceBackend

log = logging.getLogger(__name__)

WatchdogCallback = Callable[[WatchdogNote], None]
# (the error, where it surfaced: "run", "load", "warm-up", "reload"); called once per process.
FatalCallback = Callable[[CudaFatalError, str], None]

# Abandoned inference threads still stuck, beyond which no new one is started: each may hold a
# session and its buffers; past this the pipeline stays failed and says why.
MAX_STUCK_THREADS = 8


class WatchedModel(Protocol):
    """What the watchdog needs of a model: its name for reports, and the backend a run is in."""

    backend: InferenceBackend  # replaced by the host when a run on it hung

    @property
    def key(self) -> str: ...


M = TypeVar("M", bound=WatchedModel)
M_contra = TypeVar("M_contra", bound=WatchedModel, contravariant=True)


class InferenceHost(Protocol[M_contra]):
    """The pipeline, as the watchdog sees it."""

    def run_inference(self, gen: int, worker: int) -> None:
        """The body of inference thread ``worker`` of generation ``gen``; returns once ``gen`` is not
        current."""

    def reload(self, model: M_contra) -> str | None:
        """A fresh backend for ``model`` if it still serves a camera; why not, or None."""

    def backends_in_use(self) -> list[InferenceBackend]: ...

    def drop_prepared(self) -> None:
        """Drop the batches prepared before a hang: newer frames are waiting upstream."""

    def count_errors(self, cameras: Sequence[str]) -> None: ...

    def cameras_of(self, model: M_contra | None) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class _Busy(Generic[M]):
    """The run in progress on one inference thread of generation ``gen``."""

    gen: int
    since: float  # time.monotonic()
    model: M
    cameras: tuple[str, ...]  # one entry per frame of the batch


class InferenceWatchdog(Generic[M]):
    """Owns the inference threads (``workers`` of them, one generation): starts them, abandons the
    whole generation when a run on any of them hangs, starts a fresh one.

    ``hang_timeout_s`` None: hangs are not watched (the inference threads still run here).
    ``limiter`` default: 3 restarts in 10 min, then retries 10 s doubling to 10 min.
    """

    def __init__(
        self,
        host: InferenceHost[M],
        *,
        stop: threading.Event,
        hang_timeout_s: float | None = None,
        limiter: RestartLimiter | None = None,
        on_note: WatchdogCallback | None = None,
        on_fatal: FatalCallback | None = None,
        workers: int = 1,
    ) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self._host = host
        self.workers = workers
        self._stop = stop
        self.hang_timeout_s = hang_timeout_s
        self._limiter = limiter or RestartLimiter(
            max_restarts=3, window_s=600.0, backoff_min_s=10.0, backoff_max_s=600.0
        )
        # Set before start; the agent wires it once the parts that report exist.
        self.on_note = on_note
        self.on_fatal = on_fatal
        self._fatal: CudaFatalError | None = None  # set once; from then on nothing restarts
        self._lock = threading.Lock()
        # ``_gen`` names the live inference thread; a thread of an older generation was abandoned
        # and must not touch anything shared when (if ever) its run returns.
        self._gen = 0
        self._busy: dict[int, _Busy[M]] = {}  # per worker of the live generation
        self._ok_gen = -1  # the generation of the last run that completed
        # Abandoned threads with the backend each was stuck in: such a backend is closed only once
        # its thread has returned (closing a session under a running call could crash the process).
        # Changed by the watchdog thread only (and by release_returned once every thread stopped).
        self._stuck: list[tuple[threading.Thread | None, InferenceBackend]] = []
        self.late_results = 0  # results of abandoned runs that came back anyway, dropped
        self.restarts = 0
        self._state: dict[str, Any] = {"failed": False}
        self._retry_now = False
        self._failed_model: M | None = None  # the model whose run hung last
        self._threads: list[threading.Thread] = self._inference_threads(0)
        self._watch_thread = threading.Thread(target=self._watch_loop, name="watchdog", daemon=True)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        for t in self._threads:
            t.start()
        if self.hang_timeout_s is not None:
            self._watch_thread.start()

    def join(self, timeout: float) -> None:
        """Wait for the watchdog thread; the inference threads are the caller's (:attr:`inference_threads`)."""
        if self._watch_thread.is_alive():
            self._watch_thread.join(timeout)

    @property
    def inference_threads(self) -> list[threading.Thread]:
        """The live inference threads; abandoned (stuck) ones are daemons and are not waited for."""
        return list(self._threads)

    # ------------------------------------------------------------------ the inference thread's side

    def is_current(self, gen: int) -> bool:
        return self._gen == gen

    def run_started(self, gen: int, model: M, cameras: tuple[str, ...], worker: int = 0) -> bool:
        """A run begins on thread ``worker`` of ``gen``; False when that thread was abandoned meanwhile."""
        with self._lock:
            if self._gen != gen:
                return False
            self._busy[worker] = _Busy(gen, time.monotonic(), model, cameras)
            return True

    def run_finished(self, gen: int, *, ok: bool, worker: int = 0) -> bool:
        """The run of thread ``worker`` of ``gen`` returned; False when it was abandoned (its result
        is stale: drop it)."""
        with self._lock:
            if self._gen != gen:
                self.late_results += 1
                return False
            self._busy.pop(worker, None)
            if ok:
                self._ok_gen = gen
            return True

    def stuck_in(self, backend: InferenceBackend) -> bool:
        """Whether an abandoned run may still be inside ``backend`` (so it must not be closed)."""
        return any(backend is b for _, b in list(self._stuck))

    def request_retry(self) -> None:
        """An operator asked for a restart: a pipeline marked failed is tried again at once (never
        after a sticky CUDA error)."""
        with self._lock:
            self._retry_now = self._fatal is None

    @property
    def is_fatal(self) -> bool:
        return self._fatal is not None

    def fatal(self, exc: CudaFatalError, where: str) -> None:
        """A sticky CUDA error surfaced at ``where``: never restart, retry or reload again; report it
        once to ``on_fatal`` and stop everything (the process must be relaunched)."""
        with self._lock:
            first = self._fatal is None
            if first:
                self._fatal = exc
                self._retry_now = False
                self._state = {"failed": True, "last_action": "cuda_fatal", "reason": str(exc)[:1000]}
        if not first:
            return
        log.critical("sticky CUDA error during %s: %s; the process must restart", where, exc)
        try:
            if self.on_fatal is not None:
                self.on_fatal(exc, where)
        except Exception:
            log.exception("fatal-error callback failed")
        finally:
            self._stop.set()

    def release_returned(self) -> None:
        """Close the backends whose stuck run has returned since, unless a model still uses one."""
        in_use = self._host.backends_in_use()
        keep: list[tuple[threading.Thread | None, InferenceBackend]] = []
        done: list[InferenceBackend] = []
        for t, b in self._stuck:
            if (t is None or not t.is_alive()) and all(b is not u for u in in_use):
                done.append(b)
            else:
                keep.append((t, b))
        self._stuck = keep
        for b in done:
            try:
                b.close()
            except Exception:
                log.exception("closing an abandoned backend failed")

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                **self._state,
                "hang_timeout_s": self.hang_timeout_s,
                "restarts": self.restarts,
                "late_results_dropped": self.late_results,
                "stuck_threads": sum(1 for t, _ in list(self._stuck) if t is not None and t.is_alive()),
            }

    # ------------------------------------------------------------------ the watchdog thread

    def _inference_threads(self, gen: int) -> list[threading.Thread]:
        out = []
        for w in range(self.workers):
            name = "inference" if gen == 0 else f"inference-{gen}"
            if self.workers > 1:
                name = f"{name}.{w}"
            out.append(
                threading.Thread(target=self._host.run_inference, args=(gen, w), name=name, daemon=True)
            )
        return out

    def _watch_loop(self) -> None:
        assert self.hang_timeout_s is not None
        interval = min(1.0, self.hang_timeout_s / 4)
        while not self._stop.wait(interval):
            if self._fatal is not None:
                return
            try:
                self._watch_once()
            except CudaFatalError as exc:
                # From the reload in a restart: a fresh backend cannot be made in this process.
                self.fatal(exc, "reload")
                return
            except Exception:
                # The watchdog must outlive whatever it watches.
                log.exception("watchdog round failed")

    def _watch_once(self) -> None:
        assert self.hang_timeout_s is not None
        now = time.monotonic()
        stuck: threading.Thread | None = None
        with self._lock:
            hung = [
                (w, b)
                for w, b in self._busy.items()
                if b.gen == self._gen and now - b.since > self.hang_timeout_s
            ]
            busy: _Busy[M] | None = None
            if hung:
                # Abandon the generation: from here on the stuck thread's generation is not the live
                # one. Its other workers finish their runs (results dropped as late) and exit.
                worker, busy = min(hung, key=lambda wb: wb[1].since)
                self._gen += 1
                others = [(w, b) for w, b in self._busy.items() if w != worker]
                self._busy = {}
                threads, self._threads = self._threads, []
                stuck = threads[worker] if worker < len(threads) else None
                # A run still under way on another worker may be inside the same backend: it must not
                # be closed under that one either.
                for w, b in others:
                    self._stuck.append((threads[w] if w < len(threads) else None, b.model.backend))
            retry_now, self._retry_now = self._retry_now, False
            ran_ok = self._ok_gen == self._gen
        if busy is not None:
            self._on_hang(busy, now - busy.since, stuck)
            return
        if retry_now:
            self._limiter.retry_now()
        if self._limiter.retry_due():
            self._retry()
        elif ran_ok and self._limiter.healthy():
            model = self._failed_model
            self._failed_model = None
            self._note(
                WatchdogAction.RECOVERED,
                f"inference on {model.key if model else 'the pipeline'} completes again",
                model,
            )

    def _on_hang(self, busy: _Busy[M], stuck_s: float, thread: threading.Thread | None) -> None:
        model = busy.model
        self._stuck.append((thread, model.backend))
        self._host.count_errors(busy.cameras)
        reason = (
            f"inference on {model.key} ({model.backend.provider}) hung: no result after {stuck_s:.1f} s "
            f"(bound {self.hang_timeout_s:g} s)"
        )
        self._failed_model = model
        decision = self._limiter.on_hang()
        if decision.action == WatchdogAction.RESTARTED:
            problem = self._restart(model)
            if problem is None:
                self._note(WatchdogAction.RESTARTED, reason, model, stuck_s=stuck_s)
                return
            reason = f"{reason}; restart failed: {problem}"
            delay = self._limiter.fail()
        else:
            reason = (
                f"{reason}; {decision.restarts_in_window} restarts in the last "
                f"{self._limiter.window_s:g} s already"
            )
            delay = decision.retry_in_s or 0.0
        self._note(WatchdogAction.FAILED, reason, model, stuck_s=stuck_s, retry_in_s=delay)

    def _retry(self) -> None:
        self._limiter.retrying()
        model = self._failed_model
        problem = self._restart(model)
        if problem is None:
            self._note(WatchdogAction.RETRY, "starting inference again after a failure", model)
            return
        delay = self._limiter.fail()
        self._note(WatchdogAction.FAILED, f"retry failed: {problem}", model, retry_in_s=delay)

    def _restart(self, model: M | None) -> str | None:
        """A fresh backend for ``model`` if it still serves and hung, and a new inference thread;
        why not, or None. Raises CudaFatalError from the reload."""
        if self._fatal is not None:
            return "a sticky CUDA error: the process must restart"
        stuck = sum(1 for t, _ in self._stuck if t is not None and t.is_alive())
        if stuck >= MAX_STUCK_THREADS:
            return f"{stuck} abandoned inference threads are still stuck"
        if model is not None and self.stuck_in(model.backend):
            problem = self._host.reload(model)
            if problem is not None:
                return problem
        self.release_returned()
        self._host.drop_prepared()
        with self._lock:
            threads = self._inference_threads(self._gen)
            self._threads = threads
            self.restarts += 1
        for t in threads:
            t.start()
        return None

    def _note(
        self,
        action: WatchdogAction,
        reason: str,
        model: M | None,
        *,
        stuck_s: float | None = None,
        retry_in_s: float | None = None,
    ) -> None:
        lim = self._limiter
        note = WatchdogNote(
            action=action,
            reason=reason,
            model=model.key if model else None,
            cameras=self._host.cameras_of(model),
            stuck_s=round(stuck_s, 3) if stuck_s is not None else None,
            restarts_in_window=lim.restarts_in_window(),
            max_restarts=lim.max_restarts,
            window_s=lim.window_s,
            retry_in_s=retry_in_s,
        )
        failed = action == WatchdogAction.FAILED
        with self._lock:
            self._state = {
                "failed": failed,
                "last_action": action.value,
                "reason": reason,
                "retry_in_s": retry_in_s,
            }
        if failed:
            log.error("watchdog: pipeline failed: %s; next try in %.1f s", reason, retry_in_s or 0.0)
        elif action == WatchdogAction.RESTARTED:
            log.error("watchdog: %s; restarted", reason)
        else:
            log.info("watchdog: %s: %s", action.value, reason)
        if self.on_note is not None:
            try:
                self.on_note(note)
            except Exception:
                log.exception("watchdog callback failed")
