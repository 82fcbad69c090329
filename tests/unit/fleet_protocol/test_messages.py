"""Every message of the contract round-trips; bad payloads raise ProtocolError saying what is wrong."""

from __future__ import annotations

import json

import pytest

from fleet_protocol import ProtocolError, TopicKind, decode, decode_chunk, encode, encode_chunk
from fleet_protocol.codec import MAX_JSON_BYTES, MESSAGE_FOR_TOPIC
from fleet_protocol.messages import (
    Ack,
    ArtifactRef,
)
from tests.support.message_samples import MANIFEST, SAMPLES, SHA


def test_every_json_topic_has_a_sample() -> None:
    assert set(SAMPLES) == set(MESSAGE_FOR_TOPIC)


@pytest.mark.parametrize("kind", list(SAMPLES), ids=lambda k: k.value)
def test_round_trip(kind: TopicKind) -> None:
    msg = SAMPLES[kind]
    assert decode(kind, encode(msg)) == msg


def test_message_on_the_wrong_topic_is_refused() -> None:
    with pytest.raises(ProtocolError, match="expected message type 'detections', got 'heartbeat'"):
        decode(TopicKind.DETECTIONS, encode(SAMPLES[TopicKind.HEARTBEAT]))


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (b"\xff\xfe not json", "not JSON"),
        (b"[1, 2, 3]", "JSON object"),
        (b'{"type": "detections", "v": 1, "seq": "x", "sent_at": 1, "frames": []}', "seq"),
        (b'{"type": "detections", "v": 99, "seq": 1, "sent_at": 1, "frames": []}', "schema version 99"),
        (b'{"type": "detections", "v": 1, "seq": 0, "sent_at": 1, "frames": []}', "seq"),
        # An unknown field is no error (a newer peer's): the error is about the field that is wrong.
        (
            json.dumps(
                {**json.loads(encode(SAMPLES[TopicKind.DETECTIONS])), "extra": 1, "seq": "x"}
            ).encode(),
            "invalid detections: seq:",
        ),
    ],
)
def test_malformed_payloads_say_what_is_wrong(payload: bytes, needle: str) -> None:
    with pytest.raises(ProtocolError, match=needle):
        decode(TopicKind.DETECTIONS, payload)


def test_unknown_field_is_named_and_dropped() -> None:
    raw = json.loads(encode(SAMPLES[TopicKind.ACKS]))
    raw["surprise"] = True
    heard: list[tuple[str, ...]] = []
    assert decode(TopicKind.ACKS, json.dumps(raw).encode(), heard.append) == SAMPLES[TopicKind.ACKS]
    assert heard == [("surprise",)]


def test_oversized_payload_refused_before_parsing() -> None:
    with pytest.raises(ProtocolError, match="over the"):
        decode(TopicKind.HEARTBEAT, b" " * (MAX_JSON_BYTES + 1))


def test_deeply_nested_payload_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        decode(
            TopicKind.EVENTS, b'{"type":"event","v":1,"seq":1,"ts":1,"kind":"error","data":' + b"[" * 100_000
        )


def test_box_must_be_finite_and_ordered() -> None:
    frame = json.loads(encode(SAMPLES[TopicKind.DETECTIONS]))
    frame["frames"][0]["detections"][0]["box"]["x1"] = 1
    with pytest.raises(ProtocolError, match="x0 <= x1"):
        decode(TopicKind.DETECTIONS, json.dumps(frame).encode())


def test_ack_covers_upto_and_ranges() -> None:
    ack = Ack(upto=10, ranges=[(12, 14)])
    assert [s for s in range(1, 17) if ack.covers(s)] == [*range(1, 11), 12, 13, 14]
    with pytest.raises(ValueError, match="bad ack range"):
        Ack(upto=1, ranges=[(5, 3)])


def test_artifact_ref_chunk_count() -> None:
    assert ArtifactRef(manifest=MANIFEST, chunk_size=1_000_000).chunk_count == 13


def test_chunk_round_trip_and_tamper() -> None:
    frame = encode_chunk(SHA, 3, 10, b"model bytes")
    header, data = decode_chunk(frame)
    assert (header.sha256, header.index, header.total, data) == (SHA, 3, 10, b"model bytes")
    flipped = bytearray(frame)
    flipped[-1] ^= 0x01
    with pytest.raises(ProtocolError, match="fails its checksum"):
        decode_chunk(bytes(flipped))
    with pytest.raises(ProtocolError, match="bad magic"):
        decode_chunk(b"garbage")
    with pytest.raises(ProtocolError, match="not below total"):
        decode_chunk(encode_chunk(SHA, 10, 10, b"x"))
    with pytest.raises(ProtocolError, match="out of bounds"):
        decode_chunk(frame[:12])


def test_binary_topic_is_not_json() -> None:
    with pytest.raises(ProtocolError, match="binary"):
        decode(TopicKind.ARTIFACT_CHUNK, b"{}")
