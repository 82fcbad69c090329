"""Version skew (PROTOCOL.md "Versions and compatibility"): what a newer peer adds decodes here, is
reported to the caller, and never reaches anything this build sends; bad input stays refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError

from fleet_protocol import ProtocolError, TopicKind, decode, encode
from fleet_protocol.codec import MAX_JSON_BYTES, MESSAGE_FOR_TOPIC, decode_as
from fleet_protocol.messages import (
    ArtifactRef,
    CameraDesired,
    Command,
    CommandName,
    DesiredState,
    Event,
    EventKind,
    Heartbeat,
)
from fleet_protocol.signing import (
    SignatureError,
    generate_private_key,
    signed,
    signed_desired,
    verify_desired,
)
from tests.support.message_samples import MANIFEST, SAMPLES

KEY = generate_private_key()
NEW = "zz_added_later"


def _decode(kind: TopicKind, doc: Any) -> tuple[Any, list[tuple[str, ...]]]:
    heard: list[tuple[str, ...]] = []
    return decode(kind, json.dumps(doc).encode(), heard.append), heard


def _objects(doc: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path of every JSON object inside ``doc``, itself included."""
    if isinstance(doc, dict):
        yield path
        for k, v in doc.items():
            yield from _objects(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _objects(v, (*path, i))


def _at(doc: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        doc = doc[step]
    return doc


@pytest.mark.parametrize("kind", list(MESSAGE_FOR_TOPIC), ids=lambda k: k.value)
def test_a_top_level_field_from_a_newer_peer_decodes_and_is_reported(kind: TopicKind) -> None:
    doc = {**json.loads(encode(SAMPLES[kind])), NEW: {"any": [1, "json"]}}
    msg, heard = _decode(kind, doc)
    assert heard == [(NEW,)]
    if kind == TopicKind.TWIN_DESIRED:  # kept: the signature covers it (see below)
        assert msg.model_extra == {NEW: {"any": [1, "json"]}}
    else:
        assert msg == SAMPLES[kind]
        assert NEW.encode() not in encode(msg), "an unknown field must never be sent on"


@pytest.mark.parametrize("kind", list(MESSAGE_FOR_TOPIC), ids=lambda k: k.value)
def test_a_field_added_in_any_nested_object_is_reported_or_kept_never_lost_silently(kind: TopicKind) -> None:
    """A new key in every object of the message: either an unknown field (reported, by its path) or
    data of a free-form object or a new map key (kept, in what the message encodes to)."""
    base = json.loads(encode(SAMPLES[kind]))
    paths = list(_objects(base))
    assert len(paths) >= 1
    reported = 0
    for path in paths:
        doc = json.loads(json.dumps(base))
        _at(doc, path)[NEW] = {}
        msg, heard = _decode(kind, doc)
        where = ".".join(map(str, (*path, NEW)))
        if heard:
            assert heard == [(where,)], (path, heard)
            reported += 1
            kept = kind == TopicKind.TWIN_DESIRED
            assert (NEW.encode() in encode(msg)) == kept, where
        else:  # Event.data, Command.args, decoder_params, a new camera id in a map...
            assert NEW.encode() in encode(msg), f"{where} was dropped without a word"
    assert reported >= 1


def test_the_unknown_fields_of_a_newer_controllers_desired_state_are_inside_its_signature() -> None:
    """A newer controller signs the fields it adds; this build keeps them, so the signature verifies,
    and a change to one of them after signing is caught like a change to any other field."""
    ref = json.loads(encode(signed(ArtifactRef(manifest=MANIFEST), KEY)))
    ref["manifest"]["quantised"] = {"scheme": "qdq"}
    ref["manifest"]["input"]["gamma"] = 2.2
    ref["precision_hint"] = "int8"
    doc = {
        "v": 1,
        "type": "desired",
        "version": 3,
        "issued_at": 1.7e9,
        "device_id": "dev-1",
        "cameras": {"cam1": {"model": ref, "roi": [0, 0, 1, 1]}},
        "rollout_wave": 2,
    }
    # What the newer controller holds and signs (its own model would have these fields typed).
    newer = decode_as(DesiredState, json.dumps(doc).encode())
    model = newer.cameras["cam1"].model
    assert model is not None
    newer.cameras["cam1"].model = signed(model, KEY)
    wire = encode(signed_desired(newer, KEY))

    heard: list[tuple[str, ...]] = []
    state = decode(TopicKind.TWIN_DESIRED, wire, heard.append)
    assert isinstance(state, DesiredState)
    verify_desired(state, KEY.public_key())  # raises if the unknown fields had been dropped
    assert sorted(heard[0]) == sorted(
        (
            "rollout_wave",
            "cameras.cam1.roi",
            "cameras.cam1.model.precision_hint",
            "cameras.cam1.model.manifest.quantised",
            "cameras.cam1.model.manifest.input.gamma",
        )
    )
    # Written to desired.json and read back (encode/decode_as): still the controller's word.
    verify_desired(decode_as(DesiredState, encode(state)), KEY.public_key())

    altered = wire.replace(b'"rollout_wave":2', b'"rollout_wave":3')
    assert altered != wire
    with pytest.raises(SignatureError):
        verify_desired(decode_as(DesiredState, altered), KEY.public_key())


def test_built_in_process_an_unknown_field_is_still_an_error() -> None:
    """Only the wire is lenient: a typo in this code base fails where it is made."""
    with pytest.raises(ValidationError):
        Heartbeat(ts=1.0, cpu_pc=5.0)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="unknown field"):
        DesiredState(version=1, issued_at=1.0, rollout_wave=2)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="unknown field"):
        CameraDesired.model_validate({"threshold": 0.5, "treshold": 0.4})
    with pytest.raises(ValidationError, match="unknown field"):
        type(MANIFEST).model_validate({**MANIFEST.model_dump(), "licence_url": "x"})


def test_a_new_event_kind_keeps_its_name() -> None:
    doc = json.loads(encode(SAMPLES[TopicKind.EVENTS]))
    msg, heard = _decode(TopicKind.EVENTS, {**doc, "kind": "thermal_throttle"})
    assert isinstance(msg, Event)
    assert msg.kind == "thermal_throttle" and msg.kind.value == "thermal_throttle"
    assert not msg.kind.is_known and EventKind.CAMERA_DOWN.is_known
    assert msg.kind != EventKind.ERROR
    assert heard == [("kind='thermal_throttle'",)]
    assert json.loads(encode(msg))["kind"] == "thermal_throttle"
    assert msg.data == doc["data"] and msg.message == doc["message"]


def test_a_new_command_name_decodes_so_that_it_can_be_answered() -> None:
    doc = json.loads(encode(SAMPLES[TopicKind.COMMANDS]))
    msg, heard = _decode(TopicKind.COMMANDS, {**doc, "name": "reboot_npu"})
    assert isinstance(msg, Command)
    assert msg.name == "reboot_npu" and msg.name not in list(CommandName)
    assert heard == [("name='reboot_npu'",)]


def test_a_new_camera_state_in_a_heartbeat_decodes() -> None:
    doc = json.loads(encode(SAMPLES[TopicKind.HEARTBEAT]))
    doc["cameras"][0]["state"] = "throttled"
    msg, _ = _decode(TopicKind.HEARTBEAT, doc)
    assert isinstance(msg, Heartbeat)
    assert msg.cameras[0].state == "throttled"


def _with(kind: TopicKind, path: tuple[Any, ...], value: Any) -> bytes:
    doc = json.loads(encode(SAMPLES[kind]))
    parent = _at(doc, path[:-1])
    parent[path[-1]] = value
    return json.dumps(doc, allow_nan=True).encode()


STILL_REFUSED = [
    # Not skew but bad input, from a peer of any version.
    ("NaN in a known field", TopicKind.HEARTBEAT, ("cpu_pct",), float("nan")),
    ("NaN in an unknown field", TopicKind.HEARTBEAT, (NEW,), float("nan")),
    ("a wrong type", TopicKind.HEARTBEAT, ("cpu_pct",), "12"),
    ("a count out of bounds", TopicKind.ACKS, ("upto",), 2**70),
    ("an unknown field beside a wrong one", TopicKind.ACKS, ("ranges",), [[5, 3]]),
    ("another schema version", TopicKind.ACKS, ("v",), 2),
    ("an event kind that is no name", TopicKind.EVENTS, ("kind",), "Thermal Throttle!"),
    ("an event kind longer than its column", TopicKind.EVENTS, ("kind",), "k" * 33),
    ("a command name that is no name", TopicKind.COMMANDS, ("name",), 5),
    ("a closed set: severity", TopicKind.EVENTS, ("severity",), "apocalyptic"),
    (
        "a closed set: decoder",
        TopicKind.TWIN_DESIRED,
        ("cameras", "cam1", "model", "manifest", "decoder"),
        "x",
    ),
    ("a closed set: reported camera state", TopicKind.TWIN_REPORTED, ("cameras", "cam1", "state"), "dancing"),
    ("a closed set: availability", TopicKind.AVAILABILITY, ("state",), "sleepy"),
]


@pytest.mark.parametrize(("why", "kind", "path", "value"), STILL_REFUSED, ids=[r[0] for r in STILL_REFUSED])
def test_bad_input_is_still_refused(why: str, kind: TopicKind, path: tuple[Any, ...], value: Any) -> None:
    payload = _with(kind, path, value)
    if why == "an unknown field beside a wrong one":
        payload = _with(kind, (NEW,), 1).replace(b'"ranges": [[12, 14]]', b'"ranges": [[5, 3]]')
        assert b"[[5, 3]]" in payload
    heard: list[tuple[str, ...]] = []
    with pytest.raises(ProtocolError) as err:
        decode(kind, payload, heard.append)
    assert heard == []
    assert NEW not in str(err.value), "the error must name what is wrong, not the unknown field"


def test_no_type_tag_and_oversize_are_still_refused() -> None:
    doc = json.loads(encode(SAMPLES[TopicKind.ACKS]))
    del doc["type"]
    with pytest.raises(ProtocolError, match="expected message type"):
        decode(TopicKind.ACKS, json.dumps({**doc, NEW: 1}).encode())
    big = json.dumps({**json.loads(encode(SAMPLES[TopicKind.ACKS])), NEW: "x" * MAX_JSON_BYTES}).encode()
    with pytest.raises(ProtocolError, match="over the"):
        decode(TopicKind.ACKS, big)
