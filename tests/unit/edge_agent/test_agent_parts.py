"""Parts split out of the agent, each without the rest: the twin's engine-build hand-over to the
backend factory, and the command queue's refusal when it is full."""

from __future__ import annotations

import threading
from pathlib import Path

from edge_agent.control.commands import QUEUE_SIZE, CommandRunner
from edge_agent.control.twin import EngineBuilds
from edge_agent.inference.factory import LoadRequest
from fleet_protocol.codec import decode
from fleet_protocol.messages import Command, CommandResult, ModelManifest
from fleet_protocol.topics import TopicKind
from tests.support.edge_pipeline import SHA_A, SHA_B, manifest


class Factory:
    """Records how each backend was asked for."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, LoadRequest | None]] = []

    def __call__(self, path: Path, m: ModelManifest) -> str:
        self.calls.append(("plain", m.name, None))
        return "plain"

    def make(self, path: Path, m: ModelManifest, req: LoadRequest) -> str:
        self.calls.append(("make", m.name, req))
        return "made"


def test_the_announced_load_gets_its_build_request_and_a_reload_repeats_it() -> None:
    factory = Factory()
    builds = EngineBuilds(factory)  # type: ignore[arg-type]
    frames = lambda n: []  # noqa: E731
    req = LoadRequest(variant="int8", calibration_frames=frames)
    with builds.announce(SHA_A, req):
        builds(Path("a.onnx"), manifest("a", SHA_A))
        builds(Path("b.onnx"), manifest("b", SHA_B))  # a model never announced: a plain load
    # After the load, the watchdog reloads the same model: the same variant (so the same precision
    # and engine key), never a default fp32 request, and no calibration in the watchdog's thread.
    builds(Path("a.onnx"), manifest("a", SHA_A))
    assert [(kind, name) for kind, name, _ in factory.calls] == [("make", "a"), ("plain", "b"), ("make", "a")]
    assert factory.calls[0][2] is req
    reload = factory.calls[2][2]
    assert reload is not None and reload.variant == "int8" and reload.calibration_frames is None


class Link:
    connected = True

    def __init__(self) -> None:
        self.sent: list[CommandResult] = []

    def publish(self, kind: TopicKind, payload: bytes) -> bool:
        msg = decode(kind, payload)
        assert isinstance(msg, CommandResult)
        self.sent.append(msg)
        return True


def test_a_full_command_queue_refuses_at_once_with_busy() -> None:
    link = Link()
    runner = CommandRunner(
        device_id="dev-1",
        pipeline=None,  # type: ignore[arg-type]
        publisher=None,  # type: ignore[arg-type]
        transport=link,  # type: ignore[arg-type]
        outbox=None,  # type: ignore[arg-type]
        fetcher=None,  # type: ignore[arg-type]
        health=None,  # type: ignore[arg-type]
        applied_version=lambda: -1,
        stop=threading.Event(),
    )
    for i in range(QUEUE_SIZE + 1):
        runner.on_message(Command(id=f"c{i}", name="diagnostics"))
    (refused,) = link.sent
    assert refused.id == f"c{QUEUE_SIZE}" and not refused.ok and "busy" in (refused.error or "")
