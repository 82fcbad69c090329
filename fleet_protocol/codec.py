"""Encoding and decoding of wire messages, and the binary framing of artifact chunks.

Everything that comes off the wire goes through :func:`decode` or :func:`decode_chunk`; both raise
:class:`ProtocolError` with a message that says what is wrong, never anything else.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import TypeVar

from pydantic import BaseModel, Field, ValidationError

from fleet_protocol.messages import (
    Ack,
    ArtifactRequest,
    Availability,
    Command,
    CommandResult,
    DesiredState,
    DetectionBatch,
    Event,
    Heartbeat,
    Message,
    ReportedState,
    Sha256,
    Strict,
)
from fleet_protocol.topics import TopicKind

MAX_JSON_BYTES = 512 * 1024
MAX_CHUNK_BYTES = 4 * 1024 * 1024
CHUNK_MAGIC = b"EFC1"
_HDR_LEN = struct.Struct(">I")

M = TypeVar("M", bound=BaseModel)

MESSAGE_FOR_TOPIC: dict[TopicKind, type[BaseModel]] = {
    TopicKind.AVAILABILITY: Availability,
    TopicKind.HEARTBEAT: Heartbeat,
    TopicKind.DETECTIONS: DetectionBatch,
    TopicKind.EVENTS: Event,
    TopicKind.TWIN_DESIRED: DesiredState,
    TopicKind.TWIN_REPORTED: ReportedState,
    TopicKind.COMMANDS: Command,
    TopicKind.COMMAND_RESULT: CommandResult,
    TopicKind.ARTIFACT_REQUEST: ArtifactRequest,
    TopicKind.ACKS: Ack,
}


class ProtocolError(ValueError):
    """A payload that does not follow the contract. The message says what is wrong."""


def encode(msg: BaseModel) -> bytes:
    data = msg.model_dump_json(exclude_none=False).encode()
    if len(data) > MAX_JSON_BYTES:
        raise ProtocolError(
            f"{type(msg).__name__} is {len(data)} bytes, over the {MAX_JSON_BYTES} byte limit"
        )
    return data


def _first_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(x) for x in err["loc"]) or "<root>"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def decode_as(cls: type[M], payload: bytes) -> M:
    """Decode ``payload`` as message class ``cls``."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise ProtocolError(f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) > MAX_JSON_BYTES:
        raise ProtocolError(f"payload is {len(payload)} bytes, over the {MAX_JSON_BYTES} byte limit")
    # Fast path (pydantic parses the JSON itself); a payload it refuses goes the slow way below, which
    # says precisely what is wrong.
    try:
        return cls.model_validate_json(bytes(payload))
    except (ValidationError, RecursionError, ValueError):
        pass
    try:
        obj = json.loads(bytes(payload))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"payload is not JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError("payload is nested too deeply") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"payload must be a JSON object, got {type(obj).__name__}")
    expected = cls.model_fields["type"].default if "type" in cls.model_fields else None
    got = obj.get("type")
    if expected is not None and got != expected:
        raise ProtocolError(f"expected message type {expected!r}, got {got!r}")
    try:
        return cls.model_validate(obj)
    except ValidationError as exc:
        raise ProtocolError(f"invalid {expected or cls.__name__}: {_first_error(exc)}") from None
    except RecursionError:
        raise ProtocolError("payload is nested too deeply") from None


def decode(kind: TopicKind, payload: bytes) -> Message:
    """Decode a JSON payload received on a topic of ``kind``."""
    cls = MESSAGE_FOR_TOPIC.get(kind)
    if cls is None:
        raise ProtocolError(f"topic kind {kind.value!r} carries binary frames, not JSON")
    return decode_as(cls, payload)  # type: ignore[return-value]


# --------------------------------------------------------------------------- artifact chunks


class ChunkHeader(Strict):
    sha256: Sha256  # of the whole artifact
    index: int = Field(ge=0)
    total: int = Field(ge=1)
    chunk_sha256: Sha256


def encode_chunk(artifact_sha256: str, index: int, total: int, data: bytes) -> bytes:
    if len(data) > MAX_CHUNK_BYTES:
        raise ProtocolError(f"chunk is {len(data)} bytes, over the {MAX_CHUNK_BYTES} byte limit")
    header = (
        ChunkHeader(
            sha256=artifact_sha256, index=index, total=total, chunk_sha256=hashlib.sha256(data).hexdigest()
        )
        .model_dump_json()
        .encode()
    )
    return CHUNK_MAGIC + _HDR_LEN.pack(len(header)) + header + data


def decode_chunk(payload: bytes) -> tuple[ChunkHeader, bytes]:
    """Parse a chunk frame and check the chunk's own checksum."""
    payload = bytes(payload)
    if len(payload) < len(CHUNK_MAGIC) + _HDR_LEN.size or not payload.startswith(CHUNK_MAGIC):
        raise ProtocolError("not an artifact chunk frame (bad magic)")
    (hlen,) = _HDR_LEN.unpack_from(payload, len(CHUNK_MAGIC))
    start = len(CHUNK_MAGIC) + _HDR_LEN.size
    if hlen > 4096 or start + hlen > len(payload):
        raise ProtocolError("chunk frame header length is out of bounds")
    header = decode_as(_HeaderProbe, payload[start : start + hlen]).to_header()
    data = payload[start + hlen :]
    if len(data) > MAX_CHUNK_BYTES:
        raise ProtocolError(f"chunk is {len(data)} bytes, over the {MAX_CHUNK_BYTES} byte limit")
    if header.index >= header.total:
        raise ProtocolError(f"chunk index {header.index} is not below total {header.total}")
    if hashlib.sha256(data).hexdigest() != header.chunk_sha256:
        raise ProtocolError(f"chunk {header.index} of {header.sha256[:12]} fails its checksum")
    return header, data


class _HeaderProbe(ChunkHeader):
    """ChunkHeader has no ``type`` tag; this lets :func:`decode_as` parse it with the same checks."""

    def to_header(self) -> ChunkHeader:
        return ChunkHeader.model_validate(self.model_dump())
