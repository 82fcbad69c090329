"""Bad input on every device topic, fuzzed: random bytes, random JSON, and valid messages made wrong
field by field (wrong types, NaN/inf, huge ints, missing and extra fields, deep nesting, odd unicode,
huge strings). Nothing may escape the bridge or kill a worker; every payload the contract refuses is
counted as ``invalid`` for its topic kind (in the stats API and in /metrics); afterwards valid
messages on every topic are still handled and stored.

Fed through the FakeTransport, on SQLite and on PostgreSQL (the ``fleet`` fixture).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from fleet_protocol import ProtocolError, TopicKind, decode
from fleet_protocol.codec import MAX_JSON_BYTES, decode_chunk, encode
from fleet_protocol.messages import (
    ArtifactRequest,
    Availability,
    CameraReported,
    CameraStats,
    Capabilities,
    CommandResult,
    Detection,
    DetectionBatch,
    Event,
    FrameDetections,
    GpuInfo,
    GpuStats,
    Heartbeat,
    ReportedState,
)
from fleet_protocol.messages import Box as WireBox
from fleet_protocol.topics import SPECS
from tests.unit.controller.conftest import MODEL_BYTES, Fleet
from tests.waiting import wait_for

# Imported at collection rather than lazily by hypothesis mid-test: pytest rewrites plugin modules via
# ast.parse, which CPython 3.11.7 can fail while other threads run (python/cpython#106905).
importlib.import_module("hypothesis.internal.conjecture.optimiser")

FUZZ_DEV = "fuzz-dev"
GOOD_DEV = "fuzz-good"
TINY_SHA = hashlib.sha256(MODEL_BYTES).hexdigest()

CONSUMED = [k for k, s in SPECS.items() if s.from_agent]  # the controller subscribes to these
NOT_CONSUMED = [k for k, s in SPECS.items() if not s.from_agent]  # it publishes these; never reads them

FUZZ = settings(
    max_examples=60,
    deadline=None,
    database=None,  # no .hypothesis/ folder in the work tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


def valid_message(kind: TopicKind, seq: int = 1) -> BaseModel:
    """A well-formed message of ``kind`` with most optional fields filled, so that there is much to break."""
    now = time.time()
    if kind == TopicKind.AVAILABILITY:
        return Availability(
            state="online",
            ts=now,
            agent_version="1.0",
            capabilities=Capabilities(
                hostname="h",
                cpu_count=2,
                gpus=[GpuInfo(index=0, name="gpu", compute_capability="8.6", memory_total_mb=1.0)],
                execution_providers=["CPUExecutionProvider"],
                cameras=["cam1"],
            ),
        )
    if kind == TopicKind.HEARTBEAT:
        return Heartbeat(
            ts=now,
            cpu_pct=10.0,
            memory_pct=20.0,
            gpus=[GpuStats(index=0, name="gpu", utilization_pct=5.0, temperature_c=50.0, power_w=30.0)],
            cameras=[
                CameraStats(camera="cam1", state="up", fps=5.0, frames=10, inference_ms=3.0, model="m:1")
            ],
            inference_ms=3.0,
            cpu_energy_j=1.0,
        )
    if kind == TopicKind.DETECTIONS:
        det = Detection(label="person", class_id=1, score=0.9, box=WireBox(x0=1, y0=2, x1=3, y1=4))
        frame = FrameDetections(
            camera="cam1", frame=7, captured_at=now, width=640, height=480, model="m:1", inference_ms=2.5,
            detections=[det],
        )  # fmt: skip
        return DetectionBatch(seq=seq, sent_at=now, frames=[frame])
    if kind == TopicKind.EVENTS:
        return Event(seq=seq, ts=now, kind="camera_up", camera="cam1", message="up", data={"a": [1, "b"]})
    if kind == TopicKind.TWIN_REPORTED:
        return ReportedState(
            ts=now,
            desired_version=0,
            cameras={"cam1": CameraReported(model="m:1", sha256="a" * 64, state="running", progress_pct=1.0)},
            agent_version="1.0",
        )
    if kind == TopicKind.COMMAND_RESULT:
        return CommandResult(id="cmd-1", ok=False, result={"k": "v"}, error="boom")
    if kind == TopicKind.ARTIFACT_REQUEST:
        return ArtifactRequest(sha256=TINY_SHA, chunks=[0, 1], chunk_size=256 * 1024)
    raise AssertionError(f"the controller does not consume {kind}")


# --------------------------------------------------------------------------- bad values

NASTY: list[Any] = [
    None,
    True,
    "",
    "x",
    "\x00",
    "\ud800",  # a lone surrogate: not encodable as UTF-8
    "\u202e\u200b\ufeffé\U0001f600",  # right-to-left override, zero width, BOM, emoji
    "../../etc/passwd",
    "a/+/#",
    "y" * 70_000,  # over every max_length, under the payload limit
    0,
    -1,
    2**31,
    2**63,
    2**70,
    -(2**70),
    10**400,  # an integer no float can hold
    0.5,
    -0.0,
    1e308,
    math.nan,
    math.inf,
    -math.inf,
    [],
    [None],
    {},
    {"type": "x"},
]


DEEP = "\u2063deep\u2063"  # a marker replaced, after dumping, by nesting too deep for json.dumps


def with_deep(payload: bytes, depth: int = 5000) -> bytes:
    """Replace the marker by ``depth`` nested lists: deeper than any parser's recursion limit."""
    return payload.replace(json.dumps(DEEP).encode(), b"[" * depth + b"0" + b"]" * depth)


def paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path to a value inside a JSON document (dict keys and list indices)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield (*prefix, k)
            yield from paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield (*prefix, i)
            yield from paths(v, (*prefix, i))


def _with(obj: Any, path: tuple[Any, ...], op: Callable[[Any, Any], None]) -> Any:
    doc = json.loads(json.dumps(obj))
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    op(parent, path[-1])
    return doc


def set_at(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    def put(parent: Any, key: Any) -> None:
        parent[key] = value

    return _with(obj, path, put)


def drop_at(obj: Any, path: tuple[Any, ...]) -> Any:
    def drop(parent: Any, key: Any) -> None:
        del parent[key]

    return _with(obj, path, drop)


def dump(doc: Any) -> bytes:
    """JSON as a careless or hostile sender writes it: NaN/Infinity allowed, surrogates escaped."""
    try:
        return json.dumps(doc, allow_nan=True).encode()
    except ValueError:  # an integer too long to print (10**400 is fine; guard anyway)
        return b"{}"


def mutations(kind: TopicKind) -> Iterator[bytes]:
    """The valid message of ``kind`` broken in every place, one way at a time."""
    base = json.loads(encode(valid_message(kind)))
    for path in paths(base):
        for value in NASTY:
            yield dump(set_at(base, path, value))
        yield with_deep(dump(set_at(base, path, DEEP)))
        yield dump(drop_at(base, path))
    for extra in ({"unexpected": 1}, {"v": 2}, {"v": "1"}, {"type": "heartbeat"}, {"type": None}):
        yield dump({**base, **extra})
    yield dump({k: v for k, v in base.items() if k == "type"})
    yield dump({**base, "pad": "z" * (MAX_JSON_BYTES + 1)})  # over the payload limit
    yield encode(valid_message(kind))[:-1]  # truncated


FIXED_GARBAGE: list[bytes] = [
    b"",
    b"\x00",
    b"\xff\xfe\xfd",
    b"null",
    b"[]",
    b'"online"',
    b"{" * 100_000,
    b"[" * 100_000 + b"]" * 100_000,
    b"x" * (MAX_JSON_BYTES + 10),
    b'{"type": "detections", "seq": "many"}',
    b'{"type": "availability", "state": "online", "ts": NaN}',
]


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    # A named function, not a lambda: hypothesis describes a lambda by parsing its source.
    return st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=50),
    _containers,
    max_leaves=30,
)


@st.composite
def shaped(draw: st.DrawFn, kind: TopicKind) -> bytes:
    """A valid message with one to three random values, anywhere in it, replaced by random JSON."""
    doc = json.loads(encode(valid_message(kind)))
    all_paths = list(paths(doc))
    for _ in range(draw(st.integers(1, 3))):
        all_paths = list(paths(doc))
        path = draw(st.sampled_from(all_paths))
        doc = set_at(doc, path, draw(json_values | st.sampled_from(NASTY)))
    return dump(doc)


def payloads(kind: TopicKind) -> st.SearchStrategy[bytes]:
    raw = st.binary(max_size=4096)
    any_json = json_values.map(dump)
    if kind in NOT_CONSUMED:
        return st.one_of(raw, any_json)
    type_tag = valid_message(kind).model_dump()["type"]

    def tag(d: dict[str, Any]) -> bytes:
        return dump({**d, "type": type_tag})

    tagged = st.dictionaries(st.text(max_size=12), json_values, max_size=8).map(tag)
    return st.one_of(raw, any_json, tagged, shaped(kind))


# --------------------------------------------------------------------------- the harness


class Sender:
    """Injects payloads and keeps the books: how many of each kind the contract refuses."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.refused: dict[str, int] = {}
        self.sent: dict[str, int] = {}

    def send(self, kind: TopicKind, payload: bytes, device: str = FUZZ_DEV) -> None:
        bridge = self.fleet.client.app.state.runtime.bridge
        invalid_before = bridge.counters.get(kind.value, "invalid")
        self.fleet.transport.inject(self.fleet.topics.device(device, kind), payload)
        self.sent[kind.value] = self.sent.get(kind.value, 0) + 1
        if kind in NOT_CONSUMED:
            return
        if _refused(kind, payload):
            self.refused[kind.value] = self.refused.get(kind.value, 0) + 1
            got = bridge.counters.get(kind.value, "invalid") - invalid_before
            assert got == 1, (
                f"{kind.value}: refused payload counted {got} times as invalid: {payload[:200]!r}"
            )


def _refused(kind: TopicKind, payload: bytes) -> bool:
    try:
        decode(kind, payload)
    except ProtocolError:
        return True
    return False


@pytest.fixture
def quiet_errors(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.WARNING)
    return caplog


def _worker_failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    """ERROR records with a traceback from the controller: a worker or handler that blew up."""
    return [
        f"{r.name}: {r.getMessage()}\n{r.exc_text or ''}"[:3000]
        for r in caplog.records
        if r.levelno >= logging.ERROR and r.name.startswith("controller") and r.exc_info
    ]


def _metric(text: str, kind: str, outcome: str) -> float:
    m = re.search(
        rf'^edgefleet_mqtt_messages_total\{{kind="{re.escape(kind)}",outcome="{outcome}"\}} (\S+)$',
        text,
        re.M,
    )
    return float(m.group(1)) if m else 0.0


def _still_works(fleet: Fleet, device: str, seq: int) -> None:
    """Valid messages on every consumed topic are handled and stored after the fuzzing."""
    for kind in CONSUMED:
        fleet.send(device, kind, valid_message(kind, seq=seq if kind == TopicKind.DETECTIONS else seq + 1))
    api = fleet.client

    def stored() -> bool:
        dets = api.get("/api/v1/detections", params={"device": device, "limit": 1000}).json()["items"]
        events = api.get("/api/v1/events", params={"device": device, "limit": 1000}).json()
        dev = fleet.device_or_none(device)
        return (
            any(d["seq"] == seq for d in dets)
            and any(e.get("seq") == seq + 1 for e in events)
            and any(e.get("kind") == "command_result" for e in events)
            and dev is not None
            and dev["status"] == "online"
            and dev["agent_version"] == "1.0"
            and (dev["last_health"] or {}).get("cpu_pct") == 10.0
            and dev["reported_version"] == 0
            and dev["models"].get("cam1", {}).get("state") == "running"
        )

    wait_for(stored, timeout=20, what=f"valid messages from {device} stored after the fuzzing", interval=0.05)
    # Artifacts are served only from a device's own desired state, within its request cap (which the
    # fuzzing may have spent): assign the model, and ask again until answered, as an agent does.
    r = api.put(f"/api/v1/devices/{device}/cameras/cam1/model", json={"model": "tiny", "version": "1"})
    assert r.status_code == 200, r.text
    chunk_topic = fleet.topics.device(device, TopicKind.ARTIFACT_CHUNK)

    def chunks() -> bool:
        got = {decode_chunk(p.payload)[0].index for p in fleet.transport.on_topic(chunk_topic)}
        if not {0, 1} <= got:
            fleet.send(device, TopicKind.ARTIFACT_REQUEST, valid_message(TopicKind.ARTIFACT_REQUEST, seq=seq))
            return False
        return True

    wait_for(chunks, timeout=20, what=f"artifact chunks served to {device} after the fuzzing", interval=0.05)


# --------------------------------------------------------------------------- tests


def test_every_device_topic_survives_broken_messages(
    fleet: Fleet, quiet_errors: pytest.LogCaptureFixture
) -> None:
    """Systematic: every field of every message broken every way, and known garbage, on every kind."""
    sender = Sender(fleet)
    for kind in TopicKind:
        for payload in FIXED_GARBAGE:
            sender.send(kind, payload)
        if kind in CONSUMED:
            # A device each: the status worker keeps only a device's last state per batch, which would
            # hide a bad value followed by a good one.
            for i, payload in enumerate(mutations(kind)):
                sender.send(kind, payload, device=f"fz-{kind.name.lower().replace('_', '-')}-{i}")
    counters = fleet.counters()
    for kind in CONSUMED:
        assert sender.refused.get(kind.value, 0) >= len(FIXED_GARBAGE), kind
        assert counters[kind.value]["invalid"] >= sender.refused[kind.value], (kind, counters[kind.value])
        assert "error" not in counters[kind.value], (kind, counters[kind.value])
    for kind in NOT_CONSUMED:
        # Controller → device topics: not subscribed, so never decoded; a stray frame is counted, not parsed.
        assert counters[kind.value]["unknown_topic"] == sender.sent[kind.value], (kind, counters)
    metrics = fleet.client.get("/metrics").text
    for kind in CONSUMED:
        assert _metric(metrics, kind.value, "invalid") == counters[kind.value]["invalid"], kind
    _still_works(fleet, FUZZ_DEV, seq=10**12)
    _still_works(fleet, GOOD_DEV, seq=1)
    assert _worker_failures(quiet_errors) == []
    assert fleet.client.get("/healthz").status_code == 200


def test_every_device_topic_survives_random_payloads(
    fleet: Fleet, quiet_errors: pytest.LogCaptureFixture
) -> None:
    """Random: bytes, JSON of any shape, tagged dictionaries, and valid messages with random values."""
    sender = Sender(fleet)

    def fuzz_kind(kind: TopicKind) -> None:
        @FUZZ
        @given(payload=payloads(kind))
        def fuzz(payload: bytes) -> None:
            sender.send(kind, payload)

        fuzz()

    for kind in TopicKind:
        fuzz_kind(kind)
    counters = fleet.counters()
    for kind in CONSUMED:
        assert counters[kind.value].get("invalid", 0) >= sender.refused.get(kind.value, 0), kind
        assert "error" not in counters[kind.value], (kind, counters[kind.value])
    _still_works(fleet, FUZZ_DEV, seq=10**12)
    assert _worker_failures(quiet_errors) == []
