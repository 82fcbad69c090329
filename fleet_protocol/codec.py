"""Encoding and decoding of wire messages, and the binary framing of artifact chunks.

Everything that comes off the wire goes through :func:`decode` or :func:`decode_chunk` (or its two
halves, :func:`split_chunk` and :func:`check_chunk`); all raise :class:`ProtocolError` with a message
that says what is wrong, never anything else.

A field this build does not know, and a value of an open enumeration it does not know (an event kind,
a command name), is a newer peer's additive change, not an error (PROTOCOL.md "Versions and
compatibility"): the message decodes, the caller's ``on_unknown`` hears what was not understood, and
the field is dropped (kept inside a desired state, whose signature covers it).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, Field, ValidationError
from pydantic_core import PydanticSerializationError

from fleet_protocol import messages
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
    Signed,
    Strict,
)
from fleet_protocol.topics import TopicKind

MAX_JSON_BYTES = 512 * 1024
MAX_CHUNK_BYTES = 4 * 1024 * 1024
CHUNK_MAGIC = b"EFC1"
_HDR_LEN = struct.Struct(">I")

M = TypeVar("M", bound=BaseModel)

# Told, for a message that decoded, what in it this build did not understand: dotted paths of unknown
# fields ("cameras.0.npu_pct") and unknown open-enumeration values ("kind='thermal_throttle'"). Called
# on the receiving thread, before the message is returned: it must be cheap and must not raise.
OnUnknown = Callable[[tuple[str, ...]], None]

_WIRE = {messages.WIRE_CONTEXT: True}
# At most this many unknown things are named per message (a batch of 500 frames with one new field
# each is one finding, not 500).
_MAX_NAMED = 8

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


# A JSON escape of a UTF-16 surrogate. Paired ones (an escaped emoji) are fine; a lone one parses into a
# str that no UTF-8 database, log or JSON response can hold, so it must be refused here, at the edge.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _unicode_checked(msg: M, payload: bytes) -> M:
    # Senders write UTF-8, not escapes: the search is cheap and almost never finds anything to check.
    if _SURROGATE_ESCAPE.search(payload):
        try:
            msg.model_dump_json()
        except PydanticSerializationError:
            raise ProtocolError(
                "payload has a string with a lone UTF-16 surrogate (not valid Unicode)"
            ) from None
    return msg


def encode(msg: BaseModel) -> bytes:
    # A model built here cannot hold an unknown field (Strict refuses it); only a desired state decoded
    # off the wire can, and its unknown fields are part of what the controller signed, so they stay.
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


def decode_as(cls: type[M], payload: bytes, on_unknown: OnUnknown | None = None) -> M:
    """Decode ``payload`` as message class ``cls``.

    One validation decides: pydantic parses the JSON itself, in strict mode, so the wire's types are
    JSON's (``true`` or ``"5"`` is not an integer, ``1`` is not a boolean; an integer is a float). The
    payload must be UTF-8 JSON nested no deeper than that parser allows, and a message must carry its
    ``type`` tag. When validation fails, :func:`_explain` says precisely why; it never accepts.

    Unknown fields are not a failure: when the only thing wrong is fields the models do not define,
    they are removed and the rest is validated again, just as strictly (a payload from a peer of the
    same version never takes that second pass, so the ingest path costs what it did). ``on_unknown``
    hears what was dropped, and unknown values of open enumerations.
    """
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise ProtocolError(f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) > MAX_JSON_BYTES:
        raise ProtocolError(f"payload is {len(payload)} bytes, over the {MAX_JSON_BYTES} byte limit")
    data = bytes(payload)
    unknown: list[str] = []
    try:
        msg = cls.model_validate_json(data, strict=True, context=_WIRE)
    except ValidationError as exc:
        extra = [err["loc"] for err in exc.errors() if err["type"] == "extra_forbidden"]
        if not extra:
            raise ProtocolError(_explain(cls, data, exc)) from None
        data = _without(data, extra)
        unknown.extend(".".join(str(x) for x in loc) for loc in extra)
        try:
            msg = cls.model_validate_json(data, strict=True, context=_WIRE)
        except ValidationError as exc2:
            raise ProtocolError(_explain(cls, data, exc2)) from None
        except (RecursionError, ValueError):
            raise ProtocolError(_explain(cls, data, None)) from None
    except (RecursionError, ValueError):
        raise ProtocolError(_explain(cls, data, None)) from None
    # The tag has a default so that code can build messages without it; on the wire it is required
    # (a payload without it was accepted only when it was otherwise valid, and refused as "expected
    # message type" otherwise).
    if "type" in cls.model_fields and "type" not in msg.model_fields_set:
        expected = cls.model_fields["type"].default
        raise ProtocolError(f"expected message type {expected!r}, got None")
    msg = _unicode_checked(msg, data)
    if on_unknown is not None:
        if isinstance(msg, Signed):
            unknown.extend(_kept_extras(msg, ""))
        unknown.extend(_unknown_values(msg))
        if unknown:
            on_unknown(tuple(unknown[:_MAX_NAMED]))
    return msg


def _without(payload: bytes, locations: list[tuple[int | str, ...]]) -> bytes:
    """``payload`` less the fields at ``locations`` (pydantic's error locations), as JSON again.

    ASCII-escaped on purpose: a lone surrogate the peer escaped stays escaped, so the same check as
    for any payload refuses it. NaN and infinities are refused even inside a field that is dropped:
    they are not JSON, which is bad input from a peer of any version.
    """
    try:
        obj = json.loads(payload, parse_constant=_not_json, parse_float=_finite)
        for loc in locations:
            node: Any = obj
            for step in loc[:-1]:
                node = node[step]
            del node[loc[-1]]
    except ValueError as exc:
        raise ProtocolError(f"invalid payload: {exc}") from None
    except (RecursionError, LookupError, TypeError):
        raise ProtocolError("payload has unknown fields that could not be removed") from None
    return json.dumps(obj).encode()


def _not_json(word: str) -> Any:
    raise ValueError(f"{word} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def _kept_extras(model: BaseModel, prefix: str) -> list[str]:
    """Dotted paths of the unknown fields a desired state kept (it is small and rare: walked in full)."""
    found = [prefix + name for name in model.model_extra or ()]
    for name in type(model).model_fields:
        value = getattr(model, name)
        values = value.items() if isinstance(value, dict) else [(name, value)]
        for key, item in values:
            if isinstance(item, BaseModel):
                where = f"{prefix}{name}.{key}." if isinstance(value, dict) else f"{prefix}{name}."
                found.extend(_kept_extras(item, where))
    return found


def _unknown_values(msg: BaseModel) -> list[str]:
    # The two top-level open enumerations; a camera state inside a heartbeat is not looked for (the
    # heartbeat is the most frequent message, and a new camera state only ever goes to a display).
    if isinstance(msg, Event) and not msg.kind.is_known:
        return [f"kind={msg.kind.value!r}"]
    if isinstance(msg, Command) and not msg.name.is_known:
        return [f"name={msg.name.value!r}"]
    return []


def _explain(cls: type[BaseModel], payload: bytes, exc: ValidationError | None) -> str:
    """Why ``payload`` is not a valid ``cls`` (validation already refused it)."""
    try:
        obj = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"payload is not JSON: {err}"
    except RecursionError:
        return "payload is nested too deeply"
    if not isinstance(obj, dict):
        return f"payload must be a JSON object, got {type(obj).__name__}"
    expected = cls.model_fields["type"].default if "type" in cls.model_fields else None
    got = obj.get("type")
    if expected is not None and got != expected:
        return f"expected message type {expected!r}, got {got!r}"
    if exc is None:
        return f"invalid {expected or cls.__name__}: not a valid message"
    if any(err["type"] == "json_invalid" for err in exc.errors()):
        return "payload is nested too deeply (or is not JSON)"
    return f"invalid {expected or cls.__name__}: {_first_error(exc)}"


def decode(kind: TopicKind, payload: bytes, on_unknown: OnUnknown | None = None) -> Message:
    """Decode a JSON payload received on a topic of ``kind`` (``on_unknown``: see :func:`decode_as`)."""
    cls = MESSAGE_FOR_TOPIC.get(kind)
    if cls is None:
        raise ProtocolError(f"topic kind {kind.value!r} carries binary frames, not JSON")
    return decode_as(cls, payload, on_unknown)  # type: ignore[return-value]


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


def split_chunk(payload: bytes | bytearray | memoryview) -> tuple[ChunkHeader, memoryview]:
    """Parse a chunk frame WITHOUT checking the chunk's checksum; :func:`check_chunk` does that.

    The data comes back as a view into ``payload`` (no copy): the agent's network thread only parses,
    and the fetch thread checks and writes the bytes (a 256 KiB copy and hash per chunk off the thread
    that reads the socket).
    """
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise ProtocolError(f"payload must be bytes, got {type(payload).__name__}")
    view = memoryview(payload).cast("B")
    if len(view) < len(CHUNK_MAGIC) + _HDR_LEN.size or view[: len(CHUNK_MAGIC)] != CHUNK_MAGIC:
        raise ProtocolError("not an artifact chunk frame (bad magic)")
    (hlen,) = _HDR_LEN.unpack_from(view, len(CHUNK_MAGIC))
    start = len(CHUNK_MAGIC) + _HDR_LEN.size
    if hlen > 4096 or start + hlen > len(view):
        raise ProtocolError("chunk frame header length is out of bounds")
    header = decode_as(_HeaderProbe, bytes(view[start : start + hlen])).to_header()
    data = view[start + hlen :]
    if len(data) > MAX_CHUNK_BYTES:
        raise ProtocolError(f"chunk is {len(data)} bytes, over the {MAX_CHUNK_BYTES} byte limit")
    if header.index >= header.total:
        raise ProtocolError(f"chunk index {header.index} is not below total {header.total}")
    return header, data


def check_chunk(header: ChunkHeader, data: bytes | memoryview) -> None:
    """Raise ProtocolError unless ``data`` matches the chunk sha256 its frame carries."""
    if hashlib.sha256(data).hexdigest() != header.chunk_sha256:
        raise ProtocolError(f"chunk {header.index} of {header.sha256[:12]} fails its checksum")


def decode_chunk(payload: bytes | bytearray | memoryview) -> tuple[ChunkHeader, bytes]:
    """Parse a chunk frame and check the chunk's own checksum."""
    header, data = split_chunk(payload)
    check_chunk(header, data)
    return header, bytes(data)


class _HeaderProbe(ChunkHeader):
    """ChunkHeader has no ``type`` tag; this lets :func:`decode_as` parse it with the same checks."""

    def to_header(self) -> ChunkHeader:
        return ChunkHeader.model_validate(self.model_dump())
