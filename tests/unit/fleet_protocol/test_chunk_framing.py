"""Chunk frames: parsed without a copy on the network thread, checked where they are written."""

from __future__ import annotations

import hashlib

import pytest

from fleet_protocol.codec import ProtocolError, check_chunk, decode_chunk, encode_chunk, split_chunk

SHA = hashlib.sha256(b"artifact").hexdigest()
DATA = bytes(range(256)) * 16


def test_split_chunk_returns_a_view_of_the_payload_and_leaves_the_checksum_to_check_chunk() -> None:
    frame = encode_chunk(SHA, 2, 5, DATA)
    header, data = split_chunk(frame)
    assert (header.sha256, header.index, header.total) == (SHA, 2, 5)
    assert isinstance(data, memoryview) and data.obj is frame and data == DATA
    check_chunk(header, data)

    flipped = bytearray(frame)
    flipped[-1] ^= 0x01
    header, data = split_chunk(flipped)  # the frame parses: only the data is wrong
    with pytest.raises(ProtocolError, match="fails its checksum"):
        check_chunk(header, data)
    with pytest.raises(ProtocolError, match="fails its checksum"):
        decode_chunk(bytes(flipped))


@pytest.mark.parametrize(
    "payload, why",
    [
        (b"EFC0" + b"\x00" * 8, "bad magic"),
        (b"EFC1\x00\x00\x20\x00" + b"{}", "out of bounds"),
        (b"EFC1\x00\x00\x00\x02{}", "invalid"),
        (b"", "bad magic"),
    ],
)
def test_split_chunk_refuses_malformed_frames(payload: bytes, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        split_chunk(payload)


def test_split_chunk_refuses_an_index_not_below_total() -> None:
    header = b'{"sha256":"%s","index":5,"total":5,"chunk_sha256":"%s"}' % (
        SHA.encode(),
        hashlib.sha256(b"x").hexdigest().encode(),
    )
    frame = b"EFC1" + len(header).to_bytes(4, "big") + header + b"x"
    with pytest.raises(ProtocolError, match="not below total"):
        split_chunk(frame)


def test_split_chunk_refuses_what_is_not_bytes() -> None:
    with pytest.raises(ProtocolError, match="must be bytes"):
        split_chunk("EFC1")  # type: ignore[arg-type]
