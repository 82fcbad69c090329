"""Bad input on every device topic, fuzzed: random bytes, random JSON, and valid messages made wrong
field by field (wrong types, NaN/inf, huge ints, missing and extra fields, deep nesting, odd unicode,
huge strings). Nothing may escape the bridge or kill a worker; every payload the contract refuses is
counted as ``invalid`` for its topic kind (in the stats API and in /metrics); afterwards valid
messages on every topic are still handled and stored. Those tests take decode() as the judge of what
the contract refuses; ``test_pinned_payloads_...`` writes the verdicts out by hand instead (what must
be refused and leave no trace, what must be accepted and stored).

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
from collections.abc import Iterator
from functools import partial
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
from tests.support.controller_app import MODEL_BYTES, Fleet, FleetFactory
from tests.support.json_mutations import (
    DEEP,
    DROP,
    LONG,
    NASTY,
    Verdicts,
    drop_at,
    dump,
    field_verdicts,
    json_values,
    paths,
    set_at,
    with_deep,
)
from tests.support.waiting import wait_for

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


# Thousands of payloads from a few devices within seconds: far over any device's budget, which these
# tests are not about (test_ingest_bounds.py is): every payload must reach the decoder here.
UNBUDGETED = {
    f"{lane}_device_{what}": 10**9
    for lane in ("ingest", "status")
    for what in ("messages_per_s", "message_burst", "bytes_per_s", "burst_bytes")
}


@pytest.fixture
def fleet(make_fleet: FleetFactory) -> Fleet:
    return make_fleet(**UNBUDGETED)


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


def test_a_nul_in_event_data_does_not_break_the_devices_later_messages(
    fleet: Fleet, quiet_errors: pytest.LogCaptureFixture
) -> None:
    """Found by the random test above on PostgreSQL: an event whose data had a NUL in a key was stored
    in the ``json`` column as ``\\u0000``, and every later ``->>`` over that device's events failed, so
    its command results were lost. NUL is stored as U+FFFD, as in text columns."""
    device = "nul-dev"
    event = json.loads(encode(valid_message(TopicKind.EVENTS, seq=1)))
    event["data"] = {"\x00key": "v\x00", "id": "cmd-nul"}
    Sender(fleet).send(TopicKind.EVENTS, json.dumps(event).encode(), device=device)
    _still_works(fleet, device, seq=2)
    stored = fleet.client.get("/api/v1/events", params={"device": device, "limit": 100}).json()
    first = next(e for e in stored if e.get("seq") == 1)
    assert first["data"] == {"\ufffdkey": "v\ufffd", "id": "cmd-nul"}
    assert _worker_failures(quiet_errors) == []


# --------------------------------------------------------------------------- pinned verdicts
# The fuzz tests above judge each payload by the production decode(): they prove counting and that
# nothing crashes, not WHAT is refused. Here the verdicts are written out by hand, per topic kind,
# without decode: each payload in REFUSE must be counted ``invalid`` and leave no trace; each in
# ACCEPT must be handled and stored.

NAN, INF = math.nan, math.inf
NOW = 1.7e9
BAD_UTF8 = "\u2063utf8\u2063"  # replaced, after dumping, by a JSON string holding bytes that are not UTF-8


# A string field of each kind, for the encoding cases (bytes that are not UTF-8, a lone surrogate).
TEXT_FIELD: dict[TopicKind, tuple[Any, ...]] = {
    TopicKind.AVAILABILITY: ("agent_version",),
    TopicKind.HEARTBEAT: ("cameras", 0, "model"),
    TopicKind.DETECTIONS: ("frames", 0, "detections", 0, "label"),
    TopicKind.EVENTS: ("message",),
    TopicKind.TWIN_REPORTED: ("agent_version",),
    TopicKind.COMMAND_RESULT: ("error",),
    TopicKind.ARTIFACT_REQUEST: ("sha256",),
}

# The free-form fields (dict[str, Any]) of the kinds that have one.
FREE_FORM: dict[TopicKind, tuple[Any, ...]] = {
    TopicKind.EVENTS: ("data", "a"),
    TopicKind.COMMAND_RESULT: ("result", "k"),
}

# Field by field: (path in the valid message, value), or (path, DROP) for a required field left out.
FIELD_REFUSALS: dict[TopicKind, list[tuple[tuple[Any, ...], Any]]] = {
    TopicKind.AVAILABILITY: [
        (("state",), "maybe"),
        (("state",), None),
        (("state",), DROP),
        (("ts",), NAN),
        (("ts",), INF),
        (("ts",), -INF),
        (("ts",), "now"),
        (("ts",), True),
        (("agent_version",), LONG),
        (("agent_version",), 5),
        (("capabilities",), []),
        (("capabilities", "hostname"), LONG),
        (("capabilities", "os"), LONG),
        (("capabilities", "cpu_model"), LONG),
        (("capabilities", "cpu_count"), -1),
        (("capabilities", "cpu_count"), 2**70),
        (("capabilities", "cpu_count"), True),
        (("capabilities", "cpu_count"), "2"),
        (("capabilities", "cpu_count"), 2.5),
        (("capabilities", "memory_total_mb"), NAN),
        (("capabilities", "gpus"), {}),
        (("capabilities", "gpus", 0, "index"), -1),
        (("capabilities", "gpus", 0, "index"), 2**70),
        (("capabilities", "gpus", 0, "name"), LONG),
        (("capabilities", "gpus", 0, "name"), DROP),
        (("capabilities", "gpus", 0, "compute_capability"), LONG),
        (("capabilities", "gpus", 0, "memory_total_mb"), INF),
        (("capabilities", "execution_providers", 0), LONG),
        (("capabilities", "cameras", 0), "../cam"),
        (("capabilities", "cameras", 0), LONG),
    ],
    TopicKind.HEARTBEAT: [
        (("ts",), DROP),
        (("ts",), None),
        (("ts",), NAN),
        (("ts",), INF),
        (("ts",), "now"),
        (("cpu_pct",), NAN),
        (("cpu_pct",), "10"),
        (("memory_pct",), -INF),
        (("inference_ms",), INF),
        (("cpu_energy_j",), NAN),
        (("outbox_pending",), -1),
        (("outbox_pending",), 2**70),
        (("outbox_dropped",), 2**70),
        (("queue_dropped",), -1),
        (("queue_dropped",), 1.5),
        (("gpus",), "gpu"),
        (("gpus",), [{"index": i, "name": "g"} for i in range(65)]),
        (("cameras",), [{"camera": f"cam{i}", "state": "up"} for i in range(65)]),
        (("gpus", 0, "index"), -1),
        (("gpus", 0, "index"), 2**70),
        (("gpus", 0, "name"), LONG),
        (("gpus", 0, "temperature_c"), NAN),
        (("gpus", 0, "power_w"), INF),
        (("cameras",), {}),
        (("cameras", 0, "camera"), DROP),
        (("cameras", 0, "camera"), LONG),
        (("cameras", 0, "state"), "Exploded!"),
        (("cameras", 0, "state"), 5),
        (("cameras", 0, "fps"), NAN),
        (("cameras", 0, "frames"), -1),
        (("cameras", 0, "frames"), 2**70),
        (("cameras", 0, "dropped"), -1),
        (("cameras", 0, "model"), LONG),
    ],
    TopicKind.DETECTIONS: [
        (("seq",), DROP),
        (("seq",), 0),
        (("seq",), -1),
        (("seq",), 2**63),  # one past the highest seq a database holds
        (("seq",), 2**70),
        (("seq",), True),
        (("seq",), "5"),
        (("seq",), 1.5),
        (("seq",), None),
        (("sent_at",), DROP),
        (("sent_at",), NAN),
        (("frames",), DROP),
        (("frames",), []),
        (("frames",), {}),
        (("frames", 0, "camera"), LONG),
        (("frames", 0, "camera"), "a/b"),
        (("frames", 0, "frame"), -1),
        (("frames", 0, "frame"), 2**70),
        (("frames", 0, "captured_at"), INF),
        (("frames", 0, "width"), 0),
        (("frames", 0, "width"), 2**70),
        (("frames", 0, "height"), -1),
        (("frames", 0, "model"), LONG),
        (("frames", 0, "inference_ms"), NAN),
        (("frames", 0, "inference_ms"), -1.0),
        (("frames", 0, "detections", 0, "label"), LONG),
        (("frames", 0, "detections", 0, "class_id"), -1),
        (("frames", 0, "detections", 0, "class_id"), 2**70),
        (("frames", 0, "detections", 0, "score"), NAN),
        (("frames", 0, "detections", 0, "score"), 1.5),
        (("frames", 0, "detections", 0, "box"), DROP),
        (("frames", 0, "detections", 0, "box", "x0"), NAN),
        (("frames", 0, "detections", 0, "box", "y1"), INF),
        (("frames", 0, "detections", 0, "box", "x0"), 1e6),  # right of x1
    ],
    TopicKind.EVENTS: [
        (("seq",), DROP),
        (("seq",), 0),
        (("seq",), -1),
        (("seq",), 2**70),
        (("seq",), "1"),
        (("ts",), DROP),
        (("ts",), NAN),
        (("kind",), DROP),
        (("kind",), "Meltdown!"),
        (("kind",), "m" * 33),
        (("kind",), 5),
        (("severity",), "apocalyptic"),
        (("camera",), LONG),
        (("camera",), "../cam"),
        (("message",), LONG),
        (("message",), 5),
        (("data",), []),
        (("data",), "x"),
        # Free-form, yet bounded (PROTOCOL.md "Payloads"): nesting, keys, string length.
        (("data",), {"deep": json.loads("[" * 8 + "1" + "]" * 8)}),
        (("data",), {f"k{i}": i for i in range(129)}),
        (("data",), {"text": LONG}),
    ],
    TopicKind.TWIN_REPORTED: [
        (("ts",), DROP),
        (("ts",), NAN),
        (("desired_version",), DROP),
        (("desired_version",), -1),
        (("desired_version",), 2**31),  # above the schema's bound, 2**31 - 1
        (("desired_version",), 2**70),
        (("desired_version",), "0"),
        (("desired_version",), True),
        (("agent_version",), LONG),
        (("cameras",), []),
        (("cameras", "../cam"), {}),
        (("cameras", "cam1", "model"), LONG),
        (("cameras", "cam1", "sha256"), "not-hex"),
        (("cameras", "cam1", "state"), "dancing"),
        (("cameras", "cam1", "error"), LONG),
        (("cameras", "cam1", "progress_pct"), NAN),
        (("cameras", "cam1", "threshold"), 1.5),
        (("cameras", "cam1", "max_fps"), INF),
    ],
    TopicKind.COMMAND_RESULT: [
        (("id",), DROP),
        (("id",), ""),
        (("id",), LONG),
        (("id",), 5),
        (("ok",), DROP),
        (("ok",), "true"),
        (("ok",), 1),
        (("ok",), None),
        (("result",), []),
        (("result",), "x"),
        (("result",), {"deep": json.loads("[" * 8 + "1" + "]" * 8)}),
        (("error",), LONG),
        (("error",), 5),
    ],
    TopicKind.ARTIFACT_REQUEST: [
        (("sha256",), DROP),
        (("sha256",), "x" * 64),
        (("sha256",), TINY_SHA.upper()),
        (("sha256",), LONG),
        (("chunks",), DROP),
        (("chunks",), []),
        (("chunks",), list(range(65))),
        (("chunks", 0), -1),
        (("chunks", 0), 2**70),
        (("chunks", 0), "0"),
        (("chunks", 0), 1.5),
        (("chunk_size",), DROP),
        (("chunk_size",), 1023),
        (("chunk_size",), -1),
        (("chunk_size",), 2**70),
    ],
}


def _dump_utf8_broken(doc: Any) -> bytes:
    return dump(doc).replace(json.dumps(BAD_UTF8).encode(), b'"ok\xff\xfeok"')


def must_refuse(kind: TopicKind) -> Verdicts:
    """Payloads the contract must refuse on a topic of ``kind``, written out, not derived from decode."""
    good = encode(valid_message(kind))
    doc = json.loads(good)
    other_tag = "heartbeat" if kind != TopicKind.HEARTBEAT else "event"
    text = TEXT_FIELD[kind]
    out: Verdicts = [
        ("empty payload", b""),
        ("bytes that are not UTF-8", b"\xff\xfe\xfd"),
        ("not UTF-8 inside a string", _dump_utf8_broken(set_at(doc, text, BAD_UTF8))),
        ("a lone surrogate", dump(set_at(doc, text, "\ud800"))),
        ("the message in UTF-16", good.decode().encode("utf-16")),
        ("a JSON array holding the message", b"[" + good + b"]"),
        ("JSON null", b"null"),
        ("a JSON string", b'"online"'),
        ("a JSON number", b"1"),
        ("5000 nested arrays", b"[" * 5000 + b"]" * 5000),
        ("a field nested 5000 deep", with_deep(dump(set_at(doc, text, DEEP)), depth=5000)),
        ("no type tag", dump({k: v for k, v in doc.items() if k != "type"})),
        ("another kind's type tag", dump({**doc, "type": other_tag})),
        ("the tag alone", dump({"type": doc["type"]})),
        ("schema version 2", dump({**doc, "v": 2})),
        ('schema version "1"', dump({**doc, "v": "1"})),
        ("truncated", good[:-1]),
        ("trailing garbage", good + b"}"),
        ("over the size limit", good + b" " * MAX_JSON_BYTES),
    ]
    if kind in FREE_FORM:  # any JSON object, but not nested past the parser's depth (about 200)
        deep = with_deep(dump(set_at(doc, FREE_FORM[kind], DEEP)), depth=250)
        out.append((f"{'.'.join(map(str, FREE_FORM[kind]))} nested 250 deep", deep))
    return out + field_verdicts(doc, FIELD_REFUSALS[kind])


def must_accept(kind: TopicKind) -> Verdicts:
    """Payloads the contract must accept: the full message, the least one, and values at the bounds."""
    good = encode(valid_message(kind))
    doc = json.loads(good)
    pretty = json.dumps(doc, indent=2, sort_keys=True).encode()
    least: dict[TopicKind, dict[str, Any]] = {
        TopicKind.AVAILABILITY: {"type": "availability", "state": "online"},
        TopicKind.HEARTBEAT: {"type": "heartbeat", "ts": 1_700_000_000},  # an integer is a number
        TopicKind.DETECTIONS: {
            "type": "detections",
            "seq": 1,
            "sent_at": NOW,
            "frames": [
                {
                    "camera": "cam1",
                    "frame": 0,
                    "captured_at": NOW,
                    "width": 1,
                    "height": 1,
                    "model": "m",
                    "inference_ms": 0,
                }
            ],
        },
        TopicKind.EVENTS: {"type": "event", "seq": 1, "ts": NOW, "kind": "disk_low"},
        TopicKind.TWIN_REPORTED: {"type": "reported", "ts": NOW, "desired_version": 0},
        TopicKind.COMMAND_RESULT: {"type": "command_result", "id": "c", "ok": True},
        TopicKind.ARTIFACT_REQUEST: {
            "type": "artifact_request",
            "sha256": TINY_SHA,
            "chunks": [0],
            "chunk_size": 1024,
        },
    }
    at_bounds: dict[TopicKind, list[tuple[tuple[Any, ...], Any]]] = {
        TopicKind.AVAILABILITY: [
            (("agent_version",), "v" * 256),
            (("capabilities", "hostname"), "caméra-站点-\U0001f600"),
            (("capabilities", "cpu_count"), 0),
        ],
        TopicKind.HEARTBEAT: [
            (("outbox_pending",), 2**63 - 1),
            (("cameras", 0, "frames"), 2**63 - 1),
            (("cpu_pct",), 0),
            (("cameras",), [{"camera": f"cam{i}", "state": "up"} for i in range(64)]),
        ],
        TopicKind.DETECTIONS: [
            (("seq",), 2**63 - 1),
            (("frames", 0, "detections", 0, "label"), "piéton-\U0001f6b6" + "x" * 55),
            (("frames", 0, "detections", 0, "box"), {"x0": 5, "y0": 5, "x1": 5, "y1": 5}),
            (("frames", 0, "detections", 0, "score"), 1),
        ],
        TopicKind.EVENTS: [
            (("message",), "é" * 4096),
            (("data",), {"deep": json.loads("[" * 7 + "1" + "]" * 7), "big": 2**70, "text": "t" * 4096}),
        ],
        TopicKind.TWIN_REPORTED: [
            (("desired_version",), 2**31 - 1),
            (("cameras", "cam1", "error"), "e" * 4096),
        ],
        TopicKind.COMMAND_RESULT: [
            (("error",), "e" * 4096),
            (("result",), {"log": LONG}),  # free-form: a snapshot's image is far larger
        ],
        TopicKind.ARTIFACT_REQUEST: [
            (("chunks",), list(range(64))),
            (("chunk_size",), 4 * 1024 * 1024),
        ],
    }
    out: Verdicts = [
        ("the valid message", good),
        ("the valid message, pretty-printed with its keys sorted", pretty),
        ("only the required fields", json.dumps(least[kind]).encode()),
    ]
    for path, value in at_bounds[kind]:
        out.append((f"{'.'.join(map(str, path))} at its bound", dump(set_at(doc, path, value))))
    return out + [(why, payload) for why, payload, _ in newer_peer(kind)]


# What a newer agent may send (PROTOCOL.md "Versions and compatibility"): a field this build does not
# know, at the top and inside nested objects, and new values of the open enumerations. Accepted, and
# each counted once as ``unknown_fields`` (a camera state inside a heartbeat is accepted, not counted).
NEWER_PEER: dict[TopicKind, list[tuple[tuple[Any, ...], Any]]] = {
    TopicKind.AVAILABILITY: [
        (("surprise",), 1),
        (("capabilities", "surprise"), {"npu": ["x"]}),
        (("capabilities", "gpus", 0, "surprise"), None),
    ],
    TopicKind.HEARTBEAT: [
        (("surprise",), 1),
        (("gpus", 0, "surprise"), 1.5),
        (("cameras", 0, "surprise"), "x"),
        (("cameras", 0, "state"), "throttled"),
    ],
    TopicKind.DETECTIONS: [
        (("surprise",), 1),
        (("frames", 0, "surprise"), [1, 2]),
        (("frames", 0, "detections", 0, "surprise"), 1),
        (("frames", 0, "detections", 0, "box", "surprise"), 1),
    ],
    TopicKind.EVENTS: [
        (("surprise",), 1),
        (("kind",), "meltdown"),
        (("kind",), "m" * 32),
    ],
    TopicKind.TWIN_REPORTED: [
        (("surprise",), 1),
        (("cameras", "cam1", "surprise"), 1),
    ],
    TopicKind.COMMAND_RESULT: [
        (("surprise",), {"a": 1}),
    ],
    TopicKind.ARTIFACT_REQUEST: [
        (("surprise",), 1),
    ],
}
NOT_COUNTED = {(TopicKind.HEARTBEAT, ("cameras", 0, "state"))}


def newer_peer(kind: TopicKind) -> list[tuple[str, bytes, bool]]:
    """(why, payload, counted as unknown_fields) for what a newer agent may send on ``kind``."""
    doc = json.loads(encode(valid_message(kind)))
    return [
        (f"newer peer: {why}", payload, (kind, path) not in NOT_COUNTED)
        for (why, payload), (path, _) in zip(
            field_verdicts(doc, NEWER_PEER[kind]), NEWER_PEER[kind], strict=True
        )
    ]


def _api_items(fleet: Fleet, what: str, device: str) -> list[dict[str, Any]]:
    r = fleet.client.get(f"/api/v1/{what}", params={"device": device, "limit": 1000})
    assert r.status_code == 200, r.text
    body = r.json()
    items: list[dict[str, Any]] = body["items"] if isinstance(body, dict) else body
    return items


def _stored(fleet: Fleet, kind: TopicKind, device: str) -> bool:
    """What ``kind`` leaves behind once handled, seen through the API."""
    if kind == TopicKind.DETECTIONS:  # a batch of frames without detections stores no rows: count it
        dev = fleet.device_or_none(device)
        return dev is not None and dev["stats"]["stored"] == 1
    if kind == TopicKind.EVENTS:
        return bool(_api_items(fleet, "events", device))
    if kind == TopicKind.COMMAND_RESULT:
        return any(e["kind"] == "command_result" for e in _api_items(fleet, "events", device))
    dev = fleet.device_or_none(device)
    if dev is None:
        return False
    if kind == TopicKind.AVAILABILITY:
        return bool(dev["status"] == "online")
    if kind == TopicKind.HEARTBEAT:
        return dev["last_health"] is not None
    if kind == TopicKind.TWIN_REPORTED:
        return dev["reported_version"] is not None
    raise AssertionError(kind)


def _outcomes(fleet: Fleet, kind: TopicKind) -> dict[str, int]:
    return dict(fleet.counters().get(kind.value, {}))


def _handled(fleet: Fleet, kind: TopicKind, n: int) -> bool:
    """``n`` payloads of ``kind`` handled with any outcome but ``invalid`` (``unknown_fields`` is counted
    besides the handler's outcome, not instead of it)."""
    return sum(v for k, v in _outcomes(fleet, kind).items() if k not in ("invalid", "unknown_fields")) == n


def test_pinned_payloads_are_refused_or_accepted_as_the_contract_says(
    fleet: Fleet, quiet_errors: pytest.LogCaptureFixture
) -> None:
    bridge = fleet.client.app.state.runtime.bridge  # type: ignore[attr-defined]
    refused: dict[TopicKind, list[tuple[str, str]]] = {}  # kind -> [(device, why)]
    accepted: dict[TopicKind, list[tuple[str, str]]] = {}
    wrong: list[str] = []
    for kind in CONSUMED:
        slug = kind.name.lower().replace("_", "-")
        for i, (why, payload) in enumerate(must_refuse(kind)):
            device = f"pin-{slug}-r{i}"
            before = bridge.counters.get(kind.value, "invalid")
            fleet.transport.inject(fleet.topics.device(device, kind), payload)
            if bridge.counters.get(kind.value, "invalid") - before != 1:
                wrong.append(f"{kind.value}: {why}: not counted invalid once")
            refused.setdefault(kind, []).append((device, why))
        counted = {why: c for why, _, c in newer_peer(kind)}
        for i, (why, payload) in enumerate(must_accept(kind)):
            device = f"pin-{slug}-a{i}"
            before = bridge.counters.get(kind.value, "invalid")
            newer = bridge.counters.get(kind.value, "unknown_fields")
            fleet.transport.inject(fleet.topics.device(device, kind), payload)
            if bridge.counters.get(kind.value, "invalid") != before:
                wrong.append(f"{kind.value}: {why}: counted invalid")
            grew = bridge.counters.get(kind.value, "unknown_fields") - newer
            if grew != int(counted.get(why, False)):
                wrong.append(f"{kind.value}: {why}: counted {grew} times as unknown_fields")
            accepted.setdefault(kind, []).append((device, why))
    assert wrong == [], "\n".join(wrong)

    # Every accepted payload handled (ingest and artifacts count once their worker is done) and stored.
    for kind in CONSUMED:
        n_ok = len(accepted[kind])
        wait_for(
            partial(_handled, fleet, kind, n_ok),
            timeout=20,
            what=f"{n_ok} accepted {kind.value} payloads handled",
            interval=0.05,
        )
        if kind == TopicKind.ARTIFACT_REQUEST:
            continue  # not stored: answered from the device's desired state (none here)
        for device, why in accepted[kind]:
            wait_for(
                partial(_stored, fleet, kind, device),
                timeout=20,
                what=f"{kind.value} {why!r} stored",
                interval=0.05,
            )
    # A newer agent's event kind is stored as it was sent, not mapped to another kind.
    newer_kinds = {
        device: [e["kind"] for e in _api_items(fleet, "events", device)]
        for device, why in accepted[TopicKind.EVENTS]
        if why.startswith("newer peer: kind")
    }
    assert sorted(newer_kinds.values()) == [["meltdown"], ["m" * 32]], newer_kinds
    # The workers are FIFO and the accepted payloads came after the refused ones: had a refused payload
    # been queued, it would be stored by now. None left a trace, and each was counted exactly once.
    for kind in CONSUMED:
        counts = _outcomes(fleet, kind)
        assert counts.get("invalid") == len(refused[kind]), (kind, counts)
        assert "error" not in counts and "store_failed" not in counts, (kind, counts)
        for device, why in refused[kind]:
            assert fleet.device_or_none(device) is None, f"{kind.value} {why!r} registered {device}"
            assert _api_items(fleet, "detections", device) == [], f"{kind.value} {why!r}"
            assert _api_items(fleet, "events", device) == [], f"{kind.value} {why!r}"
            assert not [p for p in fleet.transport.published if f"/devices/{device}/" in p.topic], why
    assert _worker_failures(quiet_errors) == []
