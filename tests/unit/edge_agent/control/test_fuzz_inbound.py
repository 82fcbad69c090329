"""Bad input on every topic the agent consumes (desired state with its signed model refs, commands,
acks, artifact chunks), fuzzed through the agent's real inbound path (``MqttLink._handle_message``,
only the network taken away): random bytes, random JSON, valid messages broken field by field, and
chunk frames with broken framing, headers, sizes and checksums in the middle of a transfer.

Each payload is ignored or reported (counted in the link's ``protocol_errors``, the fetcher's
``bad_chunks``, a refused model); nothing crashes a thread, and afterwards the agent still fetches a
model, applies desired state, answers commands and keeps detecting. The fuzz test counts what decode()
refuses; ``test_pinned_inbound_...`` writes the verdicts out by hand: what must be refused and change
nothing (no state applied, no command answered, no outbox row acked), what must be accepted and act.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_agent.agent import Agent
from edge_agent.uplink.link import MqttLink
from fleet_protocol.codec import (
    CHUNK_MAGIC,
    MAX_JSON_BYTES,
    ProtocolError,
    decode,
    decode_as,
    encode,
    encode_chunk,
)
from fleet_protocol.messages import (
    MAX_DESIRED_VERSION,
    Ack,
    ArtifactRef,
    ArtifactRequest,
    CameraDesired,
    Command,
    CommandResult,
    DesiredState,
    InputSpec,
    ModelManifest,
    ReportedState,
)
from fleet_protocol.signing import signed, signed_desired
from fleet_protocol.topics import TopicKind, Topics
from tests.support.edge_twin import CONTROLLER_KEY, FakeBackend, Frames, model_in_store
from tests.support.edge_twin import settings as agent_settings
from tests.support.json_mutations import (
    DEEP,
    DROP,
    LONG,
    NASTY,
    drop_at,
    dump,
    field_verdicts,
    json_values,
    paths,
    set_at,
    with_deep,
)
from tests.support.waiting import wait_for

DEVICE = "dev-1"
JSON_KINDS = [TopicKind.TWIN_DESIRED, TopicKind.COMMANDS, TopicKind.ACKS]
FUZZ = settings(
    max_examples=60,
    deadline=None,
    database=None,  # no .hypothesis/ folder in the work tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


class OfflineLink(MqttLink):
    """The real link with the network taken away: frames are handed to ``_handle_message`` as paho
    would, what the agent publishes is recorded, and artifact requests are answered when ``serve`` is set."""

    def __init__(self, agent_settings_: object, topics: Topics) -> None:
        super().__init__(agent_settings_.mqtt_url, device_id=DEVICE, topics=topics)  # type: ignore[attr-defined]
        self.topics = topics
        self.sent: list[tuple[TopicKind, bytes]] = []
        self.lock = threading.Lock()
        self.serve: dict[str, tuple[bytes, int]] = {}  # sha256 -> (model bytes, chunk size)

    def start(self) -> None:
        self._connected.set()
        if self._on_connected is not None:
            self._on_connected()

    def stop(self) -> None:
        self._connected.clear()

    def publish(self, kind: TopicKind, payload: bytes) -> bool:
        with self.lock:
            self.sent.append((kind, payload))
        if kind == TopicKind.ARTIFACT_REQUEST:
            req = decode(kind, payload)
            assert isinstance(req, ArtifactRequest)
            if req.sha256 in self.serve:
                # Answered from another thread, as the broker would: the fetcher may hold its lock here.
                threading.Thread(target=self._answer, args=(req,), daemon=True).start()
        return True

    def _answer(self, req: ArtifactRequest) -> None:
        blob, size = self.serve[req.sha256]
        total = -(-len(blob) // size)
        for i in req.chunks:
            if i < total:
                self.deliver(
                    TopicKind.ARTIFACT_CHUNK,
                    encode_chunk(req.sha256, i, total, blob[i * size : (i + 1) * size]),
                )

    def deliver(self, kind: TopicKind, payload: bytes, device: str = DEVICE) -> None:
        msg = mqtt.MQTTMessage(topic=self.topics.device(device, kind).encode())
        msg.payload = payload
        self._handle_message(self._client, None, msg)

    def of(self, kind: TopicKind) -> list[bytes]:
        with self.lock:
            return [p for k, p in self.sent if k == kind]

    def reported(self) -> ReportedState | None:
        reps = self.of(TopicKind.TWIN_REPORTED)
        msg = decode(TopicKind.TWIN_REPORTED, reps[-1]) if reps else None
        return msg if isinstance(msg, ReportedState) else None


def _remote_model(name: str) -> tuple[bytes, ModelManifest]:
    """A model the agent does not have: it must fetch it in chunks."""
    blob = (f"remote model {name} ".encode() * 400)[:5000]
    manifest = ModelManifest(
        name=name,
        version="1",
        sha256=hashlib.sha256(blob).hexdigest(),
        size=len(blob),
        decoder="tf_od",
        input=InputSpec(name="x", layout="NHWC", dtype="uint8", color="RGB", width=16, height=16),
        labels=["person"],
        decoder_params={"class_offset": 1},
    )
    return blob, manifest


def _desired(version: int, manifest: ModelManifest, chunk_size: int = 1024) -> DesiredState:
    ref = signed(ArtifactRef(manifest=manifest, chunk_size=chunk_size), CONTROLLER_KEY)
    state = DesiredState(
        version=version, issued_at=time.time(), device_id=DEVICE, cameras={"cam1": CameraDesired(model=ref)}
    )
    return signed_desired(state, CONTROLLER_KEY)


@pytest.fixture
def rig(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Iterator[tuple[Agent, OfflineLink]]:
    caplog.set_level(logging.WARNING)
    data = tmp_path / "data"
    cfg = agent_settings(data, artifacts={"request_timeout_s": 0.5, "max_retries": 10_000})
    link = OfflineLink(cfg, Topics(cfg.topic_prefix))
    agent = Agent.from_settings(
        cfg, transport=link, source_opener=lambda c: Frames(), backend_factory=lambda p, m: FakeBackend()
    )
    agent.start()
    yield agent, link
    agent.shutdown()


def _running(link: OfflineLink, version: int, model: str) -> bool:
    rep = link.reported()
    return bool(
        rep
        and rep.desired_version == version
        and rep.cameras["cam1"].state == "running"
        and rep.cameras["cam1"].model == model
    )


def _crashes(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        f"{r.name}: {r.getMessage()}\n{r.exc_text or ''}"[:3000]
        for r in caplog.records
        if r.levelno >= logging.ERROR and r.exc_info and r.name.startswith("edge_agent")
    ]


def _mutations(msg: object) -> Iterator[bytes]:
    base = json.loads(encode(msg))  # type: ignore[arg-type]
    for path in paths(base):
        for value in NASTY:
            yield dump(set_at(base, path, value))
        yield with_deep(dump(set_at(base, path, DEEP)))
        yield dump(drop_at(base, path))
    yield dump({**base, "extra": 1})
    yield encode(msg)[:-1]  # type: ignore[arg-type]


def _reversioned(payload: bytes, version: int) -> tuple[bytes, int]:
    """``payload`` with ``version`` in place of the base's version 4 (a mutation of the version field
    itself is left alone), and the version after it."""
    try:
        doc = json.loads(payload)
    except (ValueError, RecursionError):
        return payload, version
    if not isinstance(doc, dict) or doc.get("version") != 4 or type(doc.get("version")) is not int:
        return payload, version
    doc["version"] = version
    return dump(doc), version + 1


def _chunk_garbage(sha: str, blob: bytes, size: int) -> Iterator[bytes]:
    total = -(-len(blob) // size)
    good = encode_chunk(sha, 0, total, blob[:size])
    hlen = struct.unpack(">I", good[4:8])[0]
    header = json.loads(good[8 : 8 + hlen])
    body = good[8 + hlen :]
    yield b""
    yield CHUNK_MAGIC
    yield b"EFC2" + good[4:]  # wrong magic
    yield good[:8] + b"{"  # header cut short
    yield CHUNK_MAGIC + struct.pack(">I", 2**32 - 1) + good[8:]  # header length out of bounds
    yield good[:-1]  # chunk bytes cut short: checksum fails
    yield good[:-1] + bytes([good[-1] ^ 1])  # one bit flipped
    yield good + b"extra"
    yield encode_chunk(sha, 0, total + 1, blob[:size])  # another total
    yield encode_chunk(sha, total - 1, total, blob[:size])  # last chunk with a full chunk's length
    yield encode_chunk("0" * 64, 0, 1, b"not ours")  # no such transfer
    for path in paths(header):
        for value in NASTY:
            h = json.dumps(set_at(header, path, value), allow_nan=True).encode()
            yield CHUNK_MAGIC + struct.pack(">I", len(h)) + h + body
        h = json.dumps(drop_at(header, path)).encode()
        yield CHUNK_MAGIC + struct.pack(">I", len(h)) + h + body
    h = json.dumps(
        {"index": 0, "total": total, "sha256": sha, "chunk_sha256": header["chunk_sha256"], "x": 1}
    ).encode()
    yield CHUNK_MAGIC + struct.pack(">I", len(h)) + h + body


def test_the_agent_shrugs_off_bad_input_on_every_inbound_topic(
    rig: tuple[Agent, OfflineLink], caplog: pytest.LogCaptureFixture
) -> None:
    agent, link = rig
    local = model_in_store(agent.data_dir, "local")
    link.deliver(TopicKind.TWIN_DESIRED, encode(_desired(1, local)))
    wait_for(lambda: _running(link, 1, "local:1"), timeout=20, what="v1 running from the store")

    # A transfer in progress while garbage arrives on the chunk topic.
    blob, remote = _remote_model("remote")
    link.deliver(TopicKind.TWIN_DESIRED, encode(_desired(2, remote)))
    wait_for(
        lambda: link.of(TopicKind.ARTIFACT_REQUEST), timeout=20, what="the agent asks for the model's chunks"
    )
    for payload in _chunk_garbage(remote.sha256, blob, 1024):
        link.deliver(TopicKind.ARTIFACT_CHUNK, payload)

    @FUZZ
    @given(payload=st.binary(max_size=2048) | st.binary(max_size=512).map(CHUNK_MAGIC.__add__))
    def random_chunks(payload: bytes) -> None:
        link.deliver(TopicKind.ARTIFACT_CHUNK, payload)

    random_chunks()
    assert agent.fetcher.bad_chunks > 0
    link.serve[remote.sha256] = (blob, 1024)  # now the controller answers

    def settled() -> str | None:
        rep = link.reported()
        cam = rep.cameras["cam1"] if rep else None
        if cam is not None and cam.state == "running" and cam.model == "remote:1":
            return "running"
        if cam is not None and cam.state == "failed" and "remote" in (cam.error or ""):
            return f"failed (still running {cam.model}): {cam.error}"
        return None

    outcome = wait_for(settled, timeout=30, what="the remote model fetched, or refused, after the garbage")
    if outcome != "running":
        # A forged chunk whose own checksum matches (a header naming another index) passes the chunk
        # check; the whole file's sha256 then catches it, the old model keeps serving, and the next
        # desired version fetches from scratch.
        assert "sha256 mismatch" in outcome, outcome
        assert "still running local:1" in outcome, outcome
        link.deliver(TopicKind.TWIN_DESIRED, encode(_desired(3, remote)))
    wait_for(
        lambda: (
            link.reported() is not None
            and link.reported().cameras["cam1"].state == "running"
            and link.reported().cameras["cam1"].model == "remote:1"
        ),
        timeout=30,
        what="the remote model running",
    )

    # Desired state, commands and acks: broken messages, then random ones.
    refused = {k.value: 0 for k in JSON_KINDS}
    counted_before = dict(link.protocol_errors)

    def send(kind: TopicKind, payload: bytes) -> None:
        try:
            decode(kind, payload)
        except ProtocolError:
            refused[kind.value] += 1
        link.deliver(kind, payload)

    valid = {
        TopicKind.TWIN_DESIRED: _desired(4, local),
        TopicKind.COMMANDS: Command(id="c-1", name="diagnostics", args={"camera": "cam1"}),
        TopicKind.ACKS: Ack(upto=1, ranges=[(3, 4)]),
    }
    # Each desired-state mutation carries a version newer than any before it (unless the mutation is
    # of the version itself): otherwise all but the first would stop at the agent's version filter
    # and never reach the camera/ref/threshold handling they are meant to exercise.
    next_version = 5
    for kind, msg in valid.items():
        for payload in _mutations(msg):
            if kind is TopicKind.TWIN_DESIRED:
                payload, next_version = _reversioned(payload, next_version)
            send(kind, payload)

    def fuzz_kind(kind: TopicKind) -> None:
        @FUZZ
        @given(payload=st.binary(max_size=2048) | json_values.map(dump))
        def random_json(payload: bytes) -> None:
            send(kind, payload)

        random_json()

    for kind in JSON_KINDS:
        fuzz_kind(kind)
    for kind in JSON_KINDS:
        got = link.protocol_errors.get(kind.value, 0) - counted_before.get(kind.value, 0)
        assert got == refused[kind.value] > 0, (kind, got, refused[kind.value])
    # Another device's topics and the agent's own outbound kinds: not for it, dropped.
    link.deliver(TopicKind.TWIN_DESIRED, encode(_desired(10**6, local)), device="dev-2")
    link.deliver(TopicKind.HEARTBEAT, b"\x00")

    # Still working: the controller's next version (newer than every legitimate one sent above) is
    # applied: no mutation (a huge version, say) wedged the version filter. A command is answered,
    # detections keep coming.
    version = next_version
    link.deliver(TopicKind.TWIN_DESIRED, encode(_desired(version, local)))
    wait_for(
        lambda: _running(link, version, "local:1"), timeout=20, what=f"v{version} applied after the fuzzing"
    )
    link.deliver(TopicKind.COMMANDS, encode(Command(id="after-fuzz", name="diagnostics")))

    def answered() -> bool:
        for p in link.of(TopicKind.COMMAND_RESULT):
            r = decode(TopicKind.COMMAND_RESULT, p)
            if isinstance(r, CommandResult) and r.id == "after-fuzz":
                return r.ok
        return False

    wait_for(answered, timeout=10, what="a command answered after the fuzzing")
    seen = agent.pipeline.last_result("cam1")
    wait_for(
        lambda: agent.pipeline.last_result("cam1") is not seen,
        timeout=10,
        what="detections after the fuzzing",
    )
    assert all(t.is_alive() for t in agent._threads), [t.name for t in agent._threads if not t.is_alive()]
    assert _crashes(caplog) == []


# --------------------------------------------------------------------------- pinned verdicts
# The fuzz test above counts what decode() refuses, with decode() as its own oracle. Here the verdicts
# are written out by hand (as in the controller's tests/unit/controller/link/test_fuzz_topics.py):
# each payload below must be counted as a protocol error and change nothing, each valid one must act.

NAN, INF = math.nan, math.inf

FIELD_REFUSALS: dict[TopicKind, list[tuple[tuple[object, ...], object]]] = {
    TopicKind.TWIN_DESIRED: [
        (("version",), DROP),
        (("version",), -1),
        (("version",), MAX_DESIRED_VERSION + 1),  # above the schema's bound: it could never be superseded
        (("version",), 2**70),
        (("version",), "2"),
        (("version",), True),
        (("version",), 2.0),
        (("issued_at",), DROP),
        (("issued_at",), NAN),
        (("issued_at",), INF),
        (("issued_at",), "now"),
        (("device_id",), LONG),
        (("device_id",), "../dev-1"),
        (("signature",), LONG),
        (("key_id",), LONG),
        (("cameras",), []),
        (("cameras", "../cam"), {}),
        (("cameras", "cam1", "threshold"), NAN),
        (("cameras", "cam1", "threshold"), 1.5),
        (("cameras", "cam1", "threshold"), "high"),
        (("cameras", "cam1", "max_fps"), INF),
        (("cameras", "cam1", "max_fps"), 0),
        (("cameras", "cam1", "labels"), "person"),
        (("cameras", "cam1", "model", "chunk_size"), -1),
        (("cameras", "cam1", "model", "chunk_size"), 2**70),
        (("cameras", "cam1", "model", "signature"), LONG),
        (("cameras", "cam1", "model", "key_id"), LONG),
        (("cameras", "cam1", "model", "manifest"), DROP),
        (("cameras", "cam1", "model", "manifest", "size"), -1),
        (("cameras", "cam1", "model", "manifest", "size"), 2**70),
        (("cameras", "cam1", "model", "manifest", "sha256"), "x" * 64),
        (("cameras", "cam1", "model", "manifest", "decoder"), "magic"),
        (("cameras", "cam1", "model", "manifest", "labels"), []),
        (("cameras", "cam1", "model", "manifest", "default_threshold"), NAN),
        (("cameras", "cam1", "model", "manifest", "input", "width"), 2**70),
        (("cameras", "cam1", "model", "manifest", "input", "mean"), [NAN, 0.0, 0.0]),
        (("cameras", "cam1", "model", "manifest", "input", "std"), [INF, 1.0, 1.0]),
    ],
    TopicKind.COMMANDS: [
        (("id",), DROP),
        (("id",), ""),
        (("id",), LONG),
        (("id",), 5),
        (("name",), DROP),
        (("name",), "Format disk!"),
        (("name",), 5),
        (("name",), None),
        (("args",), []),
        (("args",), "x"),
    ],
    TopicKind.ACKS: [
        (("upto",), DROP),
        (("upto",), -1),
        (("upto",), 2**70),
        (("upto",), True),
        (("upto",), "5"),
        (("upto",), 1.5),
        (("upto",), NAN),
        (("ranges",), "x"),
        (("ranges",), {}),
        (("ranges",), [[5, 3]]),
        (("ranges",), [[0, 1]]),
        (("ranges",), [[1]]),
        (("ranges",), [[1, 2, 3]]),
        (("ranges",), [[1, 2**70]]),
        (("ranges",), [[True, 2]]),
        (("ranges",), [[1, 2]] * 1001),
    ],
}
TEXT_FIELD = {
    TopicKind.TWIN_DESIRED: ("cameras", "cam1", "model", "variant"),
    TopicKind.COMMANDS: ("id",),
    TopicKind.ACKS: None,
}


def _must_refuse(kind: TopicKind, msg: object) -> list[tuple[str, bytes]]:
    """Payloads the contract must refuse on ``kind``, made from the valid ``msg``, without decode."""
    good = encode(msg)  # type: ignore[arg-type]
    doc = json.loads(good)
    other = "ack" if kind != TopicKind.ACKS else "command"
    out = [
        ("empty payload", b""),
        ("bytes that are not UTF-8", b"\xff\xfe\xfd"),
        ("the message in UTF-16", good.decode().encode("utf-16")),
        ("a JSON array holding the message", b"[" + good + b"]"),
        ("JSON null", b"null"),
        ("a JSON number", b"4"),
        ("5000 nested arrays", b"[" * 5000 + b"]" * 5000),
        ("no type tag", dump({k: v for k, v in doc.items() if k != "type"})),
        ("another kind's type tag", dump({**doc, "type": other})),
        ("schema version 2", dump({**doc, "v": 2})),
        ('schema version "1"', dump({**doc, "v": "1"})),
        ("truncated", good[:-1]),
        ("over the size limit", good + b" " * MAX_JSON_BYTES),
    ]
    text = TEXT_FIELD[kind]
    if text is not None:
        marker = "\u2063utf8\u2063"
        broken = dump(set_at(doc, text, marker)).replace(json.dumps(marker).encode(), b'"a\xff\xfeb"')
        out.append(("not UTF-8 inside a string", broken))
        out.append(("a lone surrogate", dump(set_at(doc, text, "\ud800"))))
        out.append(("a field nested 5000 deep", with_deep(dump(set_at(doc, text, DEEP)), depth=5000)))
    if kind == TopicKind.COMMANDS:  # free-form: any JSON object, but not nested past the parser's depth
        out.append(("args nested 250 deep", with_deep(dump(set_at(doc, ("args", "camera"), DEEP)), 250)))
    return out + field_verdicts(doc, FIELD_REFUSALS[kind])


def _pending_seqs(agent: Agent) -> list[int]:
    return [row.seq for row in agent.outbox.due(time.time() + 1e9, 0.0, 1_000_000)]


def _oldest_of_several(agent: Agent) -> int | None:
    """The oldest pending seq once there are a few."""
    seqs = _pending_seqs(agent)
    return seqs[0] if len(seqs) >= 3 else None


def _answered(link: OfflineLink) -> list[str]:
    ids = []
    for p in link.of(TopicKind.COMMAND_RESULT):
        r = decode(TopicKind.COMMAND_RESULT, p)
        assert isinstance(r, CommandResult)
        ids.append(r.id)
    return ids


def test_pinned_inbound_payloads_are_refused_or_accepted_as_the_contract_says(
    rig: tuple[Agent, OfflineLink], caplog: pytest.LogCaptureFixture
) -> None:
    agent, link = rig
    local = model_in_store(agent.data_dir, "local")
    link.deliver(TopicKind.TWIN_DESIRED, encode(_desired(1, local)))
    wait_for(lambda: _running(link, 1, "local:1"), timeout=20, what="v1 running from the store")
    # Detections wait in the outbox for an ack that never came: an ack wrongly taken would delete them.
    oldest = wait_for(lambda: _oldest_of_several(agent), timeout=20, what="detections in the outbox")

    # Each refusal, if it were taken, would act: a newer signed state, a command to answer, an ack that
    # covers the oldest pending detection.
    bases: dict[TopicKind, Callable[[int], object]] = {
        TopicKind.TWIN_DESIRED: lambda i: _desired(2, local),
        TopicKind.COMMANDS: lambda i: Command(id=f"pin-r{i}", name="diagnostics", args={"camera": "cam1"}),
        TopicKind.ACKS: lambda i: Ack(upto=oldest, ranges=[(oldest, oldest)]),
    }
    wrong: list[str] = []
    sent = 0
    for kind, base in bases.items():
        for i, (why, payload) in enumerate(_must_refuse(kind, base(0))):
            if kind == TopicKind.COMMANDS:  # one id per command, to see which (if any) was answered
                payload = payload.replace(b'"pin-r0"', f'"pin-r{i}"'.encode())
            before = link.protocol_errors.get(kind.value, 0)
            link.deliver(kind, payload)
            sent += 1
            if link.protocol_errors.get(kind.value, 0) - before != 1:
                wrong.append(f"{kind.value}: {why}: not counted as a protocol error once")
    assert wrong == [], "\n".join(wrong)
    assert sent > 100
    n_desired = len(_must_refuse(TopicKind.TWIN_DESIRED, bases[TopicKind.TWIN_DESIRED](0)))
    assert agent.twin.refused == {"undecodable": n_desired}, agent.twin.refused

    # Valid ones, after the refused: each acts, and each proves the same kind's refusals did not.
    errors_before = dict(link.protocol_errors)
    link.deliver(TopicKind.ACKS, encode(Ack(upto=0)))  # accepted, covers nothing
    link.deliver(TopicKind.COMMANDS, encode(Command(id="pin-ok", name="diagnostics", args={"note": "é🙂"})))
    wait_for(lambda: "pin-ok" in _answered(link), timeout=10, what="the valid command answered")
    assert oldest in _pending_seqs(agent), "a refused ack deleted a pending detection"
    assert not [i for i in _answered(link) if i.startswith("pin-r")], "a refused command was answered"
    reported = {decode(TopicKind.TWIN_REPORTED, p).desired_version for p in link.of(TopicKind.TWIN_REPORTED)}  # type: ignore[union-attr]
    assert reported <= {0, 1}, f"a refused desired state was applied: {reported}"
    link.deliver(TopicKind.ACKS, encode(Ack(upto=oldest)))
    wait_for(lambda: oldest not in _pending_seqs(agent), timeout=10, what="the valid ack deletes the oldest")
    link.deliver(TopicKind.TWIN_DESIRED, encode(_desired(2, local)))
    wait_for(lambda: _running(link, 2, "local:1"), timeout=20, what="the valid v2 applied")
    top = MAX_DESIRED_VERSION  # the bound itself is a version
    link.deliver(TopicKind.TWIN_DESIRED, encode(_desired(top, local)))
    wait_for(lambda: _running(link, top, "local:1"), timeout=20, what=f"v{top} applied")
    assert link.protocol_errors == errors_before
    assert _crashes(caplog) == []


def _from_a_newer_controller(version: int, manifest: ModelManifest) -> bytes:
    """A desired state as a newer controller writes it: fields this build does not know at every level
    of the signed tree, all inside the signature (it signs what it sends)."""
    doc = json.loads(encode(_desired(version, manifest)))
    doc["rollout_wave"] = 3
    cam = doc["cameras"]["cam1"]
    cam["roi"] = [[0, 0], [1, 1]]
    cam["model"]["precision_hint"] = "int8"
    cam["model"]["manifest"]["input"]["gamma"] = 1.0
    cam["model"]["manifest"]["quantised"] = {"scheme": "qdq"}
    for k in ("signature", "key_id"):
        doc.pop(k)
    for k in ("signature", "key_id"):
        cam["model"].pop(k)
    state = decode_as(DesiredState, json.dumps(doc).encode())
    ref = signed(state.cameras["cam1"].model, CONTROLLER_KEY)  # type: ignore[arg-type]
    state.cameras["cam1"].model = ref
    return encode(signed_desired(state, CONTROLLER_KEY))


def test_a_newer_controllers_additions_are_ignored_and_counted_not_refused(
    rig: tuple[Agent, OfflineLink],
) -> None:
    """PROTOCOL.md "Versions and compatibility": unknown fields (kept in a signed desired state, whose
    signature covers them), an unknown command (answered, not dropped) and an ack with a new field."""
    agent, link = rig
    local = model_in_store(agent.data_dir, "local")
    newer = _from_a_newer_controller(1, local)
    link.deliver(TopicKind.TWIN_DESIRED, newer)
    wait_for(lambda: _running(link, 1, "local:1"), timeout=20, what="the newer controller's v1 running")
    assert link.unknown_fields == {TopicKind.TWIN_DESIRED.value: 1}
    assert agent.twin.refused == {}
    # Kept as received: desired.json still verifies at the next start, with the unknown fields in it.
    assert b'"rollout_wave":3' in (agent.data_dir / "desired.json").read_bytes()

    # The same state with one unknown field changed after signing: the signature covers it, so refused.
    tampered = newer.replace(b'"rollout_wave":3', b'"rollout_wave":4')
    assert tampered != newer
    link.deliver(TopicKind.TWIN_DESIRED, tampered.replace(b'"version":1', b'"version":2'))
    wait_for(lambda: agent.twin.refused == {"signature": 1}, timeout=10, what="the altered state refused")

    cmd = json.loads(encode(Command(id="newer-1", name="diagnostics")))
    link.deliver(
        TopicKind.COMMANDS, json.dumps({**cmd, "id": "newer-1", "name": "reboot_npu", "ttl_s": 5}).encode()
    )
    link.deliver(TopicKind.COMMANDS, json.dumps({**cmd, "id": "newer-2", "priority": "high"}).encode())

    def results() -> dict[str, CommandResult]:
        out = {}
        for p in link.of(TopicKind.COMMAND_RESULT):
            r = decode(TopicKind.COMMAND_RESULT, p)
            assert isinstance(r, CommandResult)
            out[r.id] = r
        return out

    wait_for(lambda: {"newer-1", "newer-2"} <= results().keys(), timeout=10, what="both commands answered")
    unknown = results()["newer-1"]
    assert not unknown.ok and unknown.error is not None and "reboot_npu" in unknown.error, unknown
    assert results()["newer-2"].ok
    assert link.unknown_fields[TopicKind.COMMANDS.value] == 2

    oldest = wait_for(lambda: _oldest_of_several(agent), timeout=20, what="detections in the outbox")
    link.deliver(TopicKind.ACKS, json.dumps({"v": 1, "type": "ack", "upto": oldest, "window": 9}).encode())
    wait_for(lambda: oldest not in _pending_seqs(agent), timeout=10, what="the ack with a new field taken")
    assert link.unknown_fields[TopicKind.ACKS.value] == 1
    assert link.protocol_errors == {}
