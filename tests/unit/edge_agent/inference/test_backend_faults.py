"""Backend faults on the inference path.

A sticky CUDA error (CudaFatalError) from a run, a load, a warm-up or the watchdog's reload is never
retried or reloaded: the agent publishes a final ERROR event, stops and exits with 4. A provider that
ORT left silently at run time (ProviderFallback) is a MODEL_BUILD "fallback" event and inference goes
on, with no watchdog restart.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_agent import cli
from edge_agent.agent import Agent
from edge_agent.core.restart_policy import WatchdogNote
from edge_agent.inference.backend import EXIT_CUDA_FATAL, CudaFatalError, ProviderFallback
from edge_agent.vision.pipeline import CameraParams, LoadedModel, ModelLoadError, Pipeline
from fleet_protocol.messages import Event, EventKind, ModelManifest, Severity
from fleet_protocol.topics import TopicKind
from tests.support.edge_pipeline import (
    SHA_A,
    FakeBackend,
    make_pipeline,
    manifest,
)
from tests.support.edge_twin import (
    FakeTransport,
    Frames,
    desired,
    model_in_store,
    settings,
)
from tests.support.waiting import wait_for

STICKY = "CUDA error 700 (cudaErrorIllegalAddress): an illegal memory access was encountered"


class FaultyBackend(FakeBackend):
    """Runs ``ok_runs`` batches (the warm-up is one), then raises ``fault`` ``times`` times (None:
    forever), then runs again."""

    def __init__(self, fault: Exception, ok_runs: int = 1, times: int | None = None) -> None:
        super().__init__()
        self.fault, self.ok_runs, self.times = fault, ok_runs, times
        self.runs = 0
        self.raised = 0

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        self.runs += 1
        if self.runs > self.ok_runs and (self.times is None or self.raised < self.times):
            self.raised += 1
            if isinstance(self.fault, ProviderFallback):
                self.provider = self.fault.provider  # ORT already moved the session
            raise self.fault
        return super().run(batch)


class Factory:
    """Hands out the given backends in turn; raises one that is an exception."""

    def __init__(self, *items: FakeBackend | Exception) -> None:
        self.items = list(items)
        self.calls = 0

    def __call__(self, path: Path, m: ModelManifest) -> FakeBackend:
        item = self.items[min(self.calls, len(self.items) - 1)]
        self.calls += 1
        if isinstance(item, Exception):
            raise item
        return item


def serving(stop: threading.Event, factory: Factory, **kw: Any) -> tuple[Pipeline, list[tuple[str, str]]]:
    """A started pipeline on one camera, with ``factory``; returns it and the fatal reports."""
    fatal: list[tuple[str, str]] = []
    p = make_pipeline(stop, {})
    p._backend_factory = factory
    p.watchdog.on_fatal = lambda exc, where: fatal.append((where, str(exc)))
    for name, value in kw.items():
        setattr(p, name, value)
    return p, fatal


def activate(p: Pipeline) -> LoadedModel:
    model = p.load(Path("a.onnx"), manifest("a", SHA_A))
    p.activate("c0", model, CameraParams(threshold=0.5))
    return model


# ---------------------------------------------------------------------- sticky CUDA errors in the pipeline


def test_a_sticky_cuda_error_in_a_run_stops_the_pipeline_without_a_reload(stop: threading.Event) -> None:
    backend = FaultyBackend(CudaFatalError(STICKY), ok_runs=3)
    factory = Factory(backend)
    p, fatal = serving(stop, factory)
    activate(p)
    wait_for(stop.is_set)
    assert fatal == [("run", STICKY)]
    assert p.watchdog.is_fatal and p.watchdog.status()["failed"]
    assert factory.calls == 1  # the load only: nothing was reloaded
    assert backend.raised == 1  # and nothing was run again
    p.join(2.0)


def test_a_sticky_cuda_error_after_a_hang_is_not_reloaded_into(stop: threading.Event) -> None:
    release = threading.Event()

    class Hangs(FakeBackend):
        def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
            if self.batches:
                release.wait(10)
            return super().run(batch)

    notes: list[WatchdogNote] = []
    factory = Factory(Hangs(), CudaFatalError(STICKY))
    p, fatal = serving(stop, factory)
    p.watchdog.hang_timeout_s = 0.2
    p.watchdog.on_note = notes.append
    p.watchdog._watch_thread.start()  # make_pipeline started it without hang watching
    try:
        activate(p)
        wait_for(stop.is_set)
        assert fatal == [("reload", STICKY)]
        assert factory.calls == 2 and notes == []  # one reload, no restart and no retry after it
        p.watchdog.request_retry()  # an operator's restart_pipeline does not bring it back
        assert p.watchdog.status()["restarts"] == 0
    finally:
        release.set()


@pytest.mark.parametrize("where", ["load", "warm-up"])
def test_a_sticky_cuda_error_while_loading_is_not_a_model_load_error(
    stop: threading.Event, where: str
) -> None:
    item: FakeBackend | Exception = (
        CudaFatalError(STICKY) if where == "load" else FaultyBackend(CudaFatalError(STICKY), ok_runs=0)
    )
    p, fatal = serving(stop, Factory(item))
    with pytest.raises(CudaFatalError):
        try:
            activate(p)
        except ModelLoadError:  # pragma: no cover - the bug this guards against
            pytest.fail("wrapped in ModelLoadError: the twin would report a model failure and go on")
    assert fatal == [(where, STICKY)] and stop.is_set()


# ---------------------------------------------------------------------- provider fallback in the pipeline


def test_a_provider_fallback_loses_one_batch_and_inference_goes_on(stop: threading.Event) -> None:
    fb = ProviderFallback("TensorrtExecutionProvider", "CUDAExecutionProvider", "TensorRT EP failed to build")
    backend = FaultyBackend(fb, ok_runs=2, times=1)
    seen: list[tuple[str, ProviderFallback]] = []
    p, fatal = serving(stop, Factory(backend))
    p.on_provider_fallback = lambda m, f: seen.append((m.key, f))
    activate(p)
    wait_for(lambda: backend.runs >= 6)  # batches after the lost one ran
    assert seen == [("a:1", fb)]
    assert p.providers() == {"a:1": "CUDAExecutionProvider"}
    assert p.inference_errors == 1 and p.watchdog.status()["restarts"] == 0
    assert not stop.is_set() and fatal == []


# ---------------------------------------------------------------------- the agent


class Harness:
    def __init__(self, data_dir: Path, backend: FakeBackend) -> None:
        self.data_dir = data_dir
        self.backend = backend
        self.loads = 0
        self.cancelled = 0
        self.closed = 0

    # The backend factory, with the shutdown hooks AutoBackendFactory has (cancel_all) or may get.
    def __call__(self, path: Path, m: ModelManifest) -> FakeBackend:
        self.loads += 1
        return self.backend

    def cancel_all(self) -> None:
        self.cancelled += 1

    def close(self) -> None:
        self.closed += 1

    def agent(self) -> tuple[Agent, FakeTransport]:
        t = FakeTransport()
        a = Agent.from_settings(
            settings(self.data_dir), transport=t, source_opener=lambda c: Frames(), backend_factory=self
        )
        return a, t


def events(t: FakeTransport, kind: EventKind) -> list[Event]:
    return [e for e in t.of(Event) if e.kind == kind]


def run_in_thread(agent: Agent) -> tuple[threading.Thread, list[int]]:
    code: list[int] = []
    th = threading.Thread(target=lambda: code.append(agent.run()), daemon=True)
    th.start()
    return th, code


def test_the_agent_publishes_a_final_event_and_exits_with_4_on_a_sticky_cuda_error(tmp_path: Path) -> None:
    data = tmp_path / "data"
    backend = FaultyBackend(CudaFatalError(STICKY), ok_runs=3)
    h = Harness(data, backend)
    agent, t = h.agent()
    closed: list[bool] = []
    agent.health.close = lambda: closed.append(True)  # type: ignore[method-assign]
    th, code = run_in_thread(agent)
    wait_for(lambda: t.connected)
    t.deliver(TopicKind.TWIN_DESIRED, desired(1, model_in_store(data, "a")))
    th.join(20)
    assert not th.is_alive() and code == [EXIT_CUDA_FATAL] == [4]
    (final,) = events(t, EventKind.ERROR)
    assert final.severity == Severity.ERROR and STICKY in final.message
    assert final.data["where"] == "run" and final.data["exit_code"] == 4
    assert h.loads == 1 and backend.raised == 1  # no reload, no further run
    assert events(t, EventKind.WATCHDOG_RESTART) == []
    assert closed == [True] and h.cancelled == 1 and h.closed == 1  # shutdown hooks ran once


def test_the_agent_reports_a_run_time_provider_fallback_and_keeps_serving(tmp_path: Path) -> None:
    data = tmp_path / "data"
    fb = ProviderFallback("TensorrtExecutionProvider", "CUDAExecutionProvider", "Failed to Build Engine.")
    backend = FaultyBackend(fb, ok_runs=2, times=1)
    h = Harness(data, backend)
    agent, t = h.agent()
    agent.start()
    try:
        t.deliver(TopicKind.TWIN_DESIRED, desired(1, model_in_store(data, "a")))
        wait_for(lambda: events(t, EventKind.MODEL_BUILD))
        wait_for(lambda: backend.runs >= 6)
        (ev,) = events(t, EventKind.MODEL_BUILD)
        assert ev.severity == Severity.WARNING and ev.camera == "cam1"
        assert ev.data["phase"] == "fallback" and ev.data["reason"] == "Failed to Build Engine."
        assert ev.data["previous"] == "TensorrtExecutionProvider"
        assert ev.data["provider"] == "CUDAExecutionProvider"
        assert not agent.stop_event.is_set() and agent.exit_code == 0 and h.loads == 1
    finally:
        agent.shutdown()


# ---------------------------------------------------------------------- the cli's exit code


@pytest.mark.parametrize("raises", [False, True])
def test_the_cli_returns_4_after_a_sticky_cuda_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raises: bool
) -> None:
    class FakeAgent:
        def request_stop(self) -> None:
            pass

        def run(self) -> int:
            if raises:
                raise CudaFatalError(STICKY)  # one that reaches the main thread
            return EXIT_CUDA_FATAL  # what Agent.run returns after on_fatal

    monkeypatch.setattr(cli, "load_settings", lambda path: settings(tmp_path / "data"))
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)  # keep pytest's own handlers
    monkeypatch.setattr(Agent, "from_settings", classmethod(lambda cls, s: FakeAgent()))
    assert cli.run(tmp_path / "agent.yaml", stack_check=lambda log: None) == 4
