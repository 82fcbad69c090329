"""The inference watchdog on its own, against a hand-written host instead of a pipeline: a hung run is
abandoned and its late result dropped, a fresh thread runs on a fresh backend, the stuck backend is
closed only once its run returned, and past the restart bound an operator's retry starts it again."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from edge_agent.core.restart_policy import RestartLimiter, WatchdogAction, WatchdogNote
from edge_agent.inference.backend import InferenceBackend
from edge_agent.vision.inference_watchdog import InferenceWatchdog
from tests.support.edge_pipeline import FakeBackend
from tests.support.waiting import wait_for


@dataclass(eq=False)
class Model:
    backend: InferenceBackend = field(default_factory=FakeBackend)
    key: str = "m:1"


class Host:
    """Generation 0 starts a run and hangs in it until ``release``; later generations return at once."""

    def __init__(self) -> None:
        self.wd: InferenceWatchdog[Model] | None = None
        self.model = Model()
        self.release = threading.Event()
        self.started: list[int] = []
        self.late: list[bool] = []
        self.reloaded: list[str] = []
        self.errors: list[str] = []
        self.dropped = 0

    def run_inference(self, gen: int, worker: int = 0) -> None:
        assert self.wd is not None
        self.started.append(gen)
        if gen == 0 and self.wd.run_started(0, self.model, ("c0",)):
            self.release.wait(10)
            self.late.append(self.wd.run_finished(0, ok=True))

    def reload(self, model: Model) -> str | None:
        self.reloaded.append(model.key)
        model.backend = FakeBackend()
        return None

    def backends_in_use(self) -> list[InferenceBackend]:
        return [self.model.backend]

    def drop_prepared(self) -> None:
        self.dropped += 1

    def count_errors(self, cameras: Sequence[str]) -> None:
        self.errors.extend(cameras)

    def cameras_of(self, model: Model | None) -> tuple[str, ...]:
        return ("c0",) if model is self.model else ()


def watchdog(
    host: Host, stop: threading.Event, notes: list[WatchdogNote], limiter: RestartLimiter | None = None
) -> InferenceWatchdog[Model]:
    wd: InferenceWatchdog[Model] = InferenceWatchdog(
        host,
        stop=stop,
        hang_timeout_s=0.2,
        limiter=limiter,
        on_note=notes.append,
    )
    host.wd = wd
    return wd


def test_a_hung_run_is_abandoned_and_a_fresh_thread_runs_on_a_fresh_backend(stop: threading.Event) -> None:
    host = Host()
    notes: list[WatchdogNote] = []
    hung = FakeBackend()
    host.model.backend = hung
    wd = watchdog(host, stop, notes)
    wd.start()
    try:
        wait_for(lambda: notes)
        note = notes[0]
        assert note.action == WatchdogAction.RESTARTED and note.cameras == ("c0",) and note.model == "m:1"
        assert note.stuck_s is not None and note.stuck_s >= 0.2
        wait_for(lambda: host.started == [0, 1])
        assert host.reloaded == ["m:1"] and host.model.backend is not hung
        assert host.errors == ["c0"] and host.dropped == 1
        assert wd.is_current(1) and not wd.is_current(0) and wd.stuck_in(hung)
        assert wd.status()["restarts"] == 1 and wd.status()["stuck_threads"] == 1

        wd.release_returned()
        assert not hung.closed, "never closed under the run still inside it"
        host.release.set()
        wait_for(lambda: host.late == [False])
        assert wd.late_results == 1
        wait_for(lambda: wd.status()["stuck_threads"] == 0)
        wd.release_returned()
        assert hung.closed and not wd.stuck_in(hung)
    finally:
        host.release.set()
        stop.set()
        wd.join(5)


def test_past_the_bound_the_pipeline_fails_until_an_operator_retries(stop: threading.Event) -> None:
    host = Host()
    notes: list[WatchdogNote] = []
    limiter = RestartLimiter(max_restarts=0, window_s=600.0, backoff_min_s=300.0, backoff_max_s=600.0)
    wd = watchdog(host, stop, notes, limiter)
    wd.start()
    try:
        wait_for(lambda: notes)
        assert notes[0].action == WatchdogAction.FAILED and notes[0].retry_in_s == 300.0
        assert wd.status()["failed"] is True and host.started == [0] and host.reloaded == []
        wd.request_retry()  # restart_pipeline: the 300 s wait is cut short
        wait_for(lambda: len(notes) == 2)
        assert notes[1].action == WatchdogAction.RETRY and wd.status()["failed"] is False
        wait_for(lambda: host.started == [0, 1])
        assert host.reloaded == ["m:1"] and wd.status()["restarts"] == 1
    finally:
        host.release.set()
        stop.set()
        wd.join(5)


def test_without_a_hang_timeout_only_the_inference_thread_runs(stop: threading.Event) -> None:
    host = Host()
    host.release.set()
    wd: InferenceWatchdog[Model] = InferenceWatchdog(host, stop=stop)
    host.wd = wd
    wd.start()
    wait_for(lambda: host.late == [True])
    assert wd.late_results == 0 and wd.status() == {
        "failed": False,
        "hang_timeout_s": None,
        "restarts": 0,
        "late_results_dropped": 0,
        "stuck_threads": 0,
    }


class TwoWorkerHost(Host):
    """Worker 1 of generation 0 hangs; worker 0 and every later worker run and return."""

    def __init__(self) -> None:
        super().__init__()
        self.workers: list[tuple[int, int]] = []

    def run_inference(self, gen: int, worker: int = 0) -> None:
        assert self.wd is not None
        with self.release_lock:
            self.workers.append((gen, worker))
        if gen == 0 and worker == 1 and self.wd.run_started(0, self.model, ("c1",), worker=1):
            self.release.wait(10)
            self.late.append(self.wd.run_finished(0, ok=True, worker=1))

    release_lock = threading.Lock()


def test_a_hang_on_one_worker_restarts_every_worker_of_the_generation(stop: threading.Event) -> None:
    host = TwoWorkerHost()
    notes: list[WatchdogNote] = []
    hung = FakeBackend()
    host.model.backend = hung
    wd: InferenceWatchdog[Model] = InferenceWatchdog(
        host, stop=stop, hang_timeout_s=0.2, on_note=notes.append, workers=2
    )
    host.wd = wd
    wd.start()
    try:
        wait_for(lambda: notes)
        assert notes[0].action == WatchdogAction.RESTARTED
        wait_for(lambda: sorted(host.workers) == [(0, 0), (0, 1), (1, 0), (1, 1)])
        assert [t.name for t in wd.inference_threads] == ["inference-1.0", "inference-1.1"]
        assert wd.stuck_in(hung) and host.reloaded == ["m:1"]
        host.release.set()
        wait_for(lambda: host.late == [False])  # the abandoned worker's late result is dropped
    finally:
        host.release.set()
        stop.set()
        wd.join(5)
