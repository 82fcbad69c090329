"""Typed messages of the wire contract.

Every message carries a ``type`` tag and a schema version ``v``. Built in-process, a model refuses
unknown fields, so that a typo in this code base is an error, not silently ignored data. Off the wire
(``codec.decode``) a field this build does not know is a newer peer's additive field: the codec drops
it and reports it, except inside a desired state, which keeps it because its signature covers it
(PROTOCOL.md "Versions and compatibility").
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fleet_protocol.ids import CameraId, DeviceId, Name
from fleet_protocol.sources import MAX_SOURCE_LEN

SCHEMA_VERSION = 1

Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
# One sequence space of a device (PROTOCOL.md "Incarnations"): made by the agent when its outbox is
# created (a uuid4 as 32 hex digits), so a reflashed device or a wiped data folder starts a new one
# instead of repeating seqs the controller already holds.
IncarnationId = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]


def _absent(v: object) -> bool:
    # Optional additive fields leave the wire form unchanged when unset: an older peer, and every
    # signature over a canonical form made before the field existed, see the same bytes.
    return v is None


# Bounds on what a peer may send (tests/unit/controller/link/test_fuzz_topics.py pins payloads
# that must be refused, independently of this module). Without them a hostile or broken sender got
# values past decode that no column can hold or no reader should pay for, and each consumer had to
# guard them on its own (or not): a counter of 2**70 or -1, a 70 kB agent version, NaN temperatures.
# The highest integer on the wire: the databases' BIGINT and SQLite's INTEGER (seqs, frame numbers,
# counters); the agent's outbox numbers seqs in the same range.
MAX_WIRE_INT = 2**63 - 1
# The highest desired-state version: the controller stores versions in 32-bit INTEGER columns, so a
# state above it could never be superseded (PROTOCOL.md "Desired and reported state").
MAX_DESIRED_VERSION = 2**31 - 1
# A count or index: never negative, never past what a database column holds.
Count = Annotated[int, Field(ge=0, le=MAX_WIRE_INT)]
# Names, versions, host and GPU descriptions: one line of text.
ShortText = Annotated[str, Field(max_length=256)]
# Free text from a device (error messages): as long as an event's message.
LongText = Annotated[str, Field(max_length=4096)]

# Cameras and GPUs of one device (heartbeat lists, capabilities, the cameras of a desired or reported
# state). A heartbeat is stored whole for every device every few seconds, so its lists are bounded
# where a device reports them; an edge box runs a handful of streams and at most a few GPUs.
MAX_CAMERAS = 64
MAX_GPUS = 64
# Other lists of names a peer reports or a manifest carries (execution providers, model outputs).
MAX_NAMES = 256
# A model's class labels, and a camera's label filter: LVIS, among the largest detection label sets,
# has 1203. A label is as long as a detection's label may be (Detection.label).
MAX_LABELS = 2048
LABEL_CHARS = 64
Label = Annotated[str, Field(max_length=LABEL_CHARS)]
LabelList = Annotated[list[Label], Field(max_length=MAX_LABELS)]


@dataclass(frozen=True)
class FreeFormBounds:
    """What a free-form JSON object of the contract may hold (``Event.data``, ``Command.args``,
    ``CommandResult.result``, a manifest's ``decoder_params``): its fields are the sender's to choose,
    their shape is not. Depth counts the object itself as 1; size is the compact JSON text's length."""

    depth: int = 8
    keys: int = 128
    key_chars: int = 128
    items: int = 1024
    string_chars: int = 4096
    size: int = 16 * 1024


# Event data, command arguments and decoder parameters: small structured facts, never bulk data.
FREE_FORM = FreeFormBounds()
# A command's result may carry a snapshot's JPEG (base64, up to 400 KiB): its one long string and its
# size are bounded by the payload limit (codec.MAX_JSON_BYTES) alone.
RESULT_FREE_FORM = FreeFormBounds(string_chars=512 * 1024, size=512 * 1024)


def _free_form_problem(value: Any, bounds: FreeFormBounds, depth: int, path: str) -> str | None:
    """What in ``value`` is over ``bounds``, or None (walked once; every container level counted)."""
    if isinstance(value, dict):
        if depth > bounds.depth:
            return f"{path or 'value'} is nested deeper than {bounds.depth} levels"
        if len(value) > bounds.keys:
            return f"{path or 'value'} has {len(value)} keys, over {bounds.keys}"
        for key, item in value.items():
            if not isinstance(key, str) or len(key) > bounds.key_chars:
                return f"{path or 'value'} has a key longer than {bounds.key_chars} characters"
            found = _free_form_problem(item, bounds, depth + 1, f"{path}.{key}" if path else key)
            if found is not None:
                return found
        return None
    if isinstance(value, list | tuple):
        if depth > bounds.depth:
            return f"{path or 'value'} is nested deeper than {bounds.depth} levels"
        if len(value) > bounds.items:
            return f"{path or 'value'} has {len(value)} items, over {bounds.items}"
        for i, item in enumerate(value):
            found = _free_form_problem(item, bounds, depth + 1, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
        return None
    if isinstance(value, str) and len(value) > bounds.string_chars:
        return f"{path or 'value'} is a string of {len(value)} characters, over {bounds.string_chars}"
    return None


def _bounded(bounds: FreeFormBounds) -> AfterValidator:
    def check(value: dict[str, Any]) -> dict[str, Any]:
        problem = _free_form_problem(value, bounds, 1, "")
        if problem is None:
            # Walked first, so this costs at most the payload's own size; default=str: a value built
            # in-process (an enum, a path) is measured as the text it is sent as.
            size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str))
            if size > bounds.size:
                problem = f"is {size} characters of JSON, over {bounds.size}"
        if problem is not None:
            raise ValueError(f"free-form object {problem}")
        return value

    return AfterValidator(check)


FreeForm = Annotated[dict[str, Any], _bounded(FREE_FORM)]
ResultFreeForm = Annotated[dict[str, Any], _bounded(RESULT_FREE_FORM)]


class Strict(BaseModel):
    # allow_inf_nan=False: NaN and Infinity are not JSON, PostgreSQL's JSON refuses them, and no figure
    # of the contract (times, percentages, watts, coordinates) is meaningful as one; refused everywhere
    # instead of field by field. Free-form dicts (Event.data, CommandResult.result) are left as they are.
    model_config = ConfigDict(extra="forbid", frozen=False, allow_inf_nan=False)


# The validation context ``codec.decode`` passes: the payload came off the wire, from a peer that may
# be newer than this build (PROTOCOL.md "Versions and compatibility").
WIRE_CONTEXT = "edgefleet_wire"


class Signed(Strict):
    """A model inside the signed desired state: off the wire it KEEPS fields it does not know.

    The controller signs the desired state as it wrote it (``signing.desired_canonical_bytes``), so a
    newer controller's additive field is inside the signed bytes; dropping it here would make every
    such state fail its signature on an older agent. Kept, it is part of the canonical form, of
    ``desired.json`` and of nothing else (no code here reads it). Built in-process, without the wire
    context, an unknown field is refused as everywhere else.
    """

    model_config = ConfigDict(extra="allow", frozen=False, allow_inf_nan=False)

    @model_validator(mode="after")
    def _unknown_only_off_wire(self, info: ValidationInfo) -> Signed:
        if self.model_extra and not (info.context and info.context.get(WIRE_CONTEXT)):
            raise ValueError(f"unknown field(s) {sorted(self.model_extra)}")
        return self


# A value of an open enumeration: a plain name, at most 32 characters (the controller's event kind column).
_OPEN_VALUE = re.compile(r"[a-z][a-z0-9_]{0,31}")


class OpenStrEnum(StrEnum):
    """An enumeration a newer peer may extend (event kinds, command names, camera states).

    A value this build does not know, if it is a plain lower-case name of at most 32 characters, decodes
    as a pseudo-member that carries it (``.value`` is the peer's word, equal to the string; it is no
    member of the class's listing, so ``is_known`` tells), instead of making the whole message
    undecodable. Anything else is still refused.
    """

    @classmethod
    def _missing_(cls, value: object) -> OpenStrEnum | None:
        if isinstance(value, str) and _OPEN_VALUE.fullmatch(value):
            member = str.__new__(cls, value)
            member._name_ = value.upper()
            member._value_ = value
            return member
        return None

    @property
    def is_known(self) -> bool:
        return self._value_ in type(self)._value2member_map_


class Msg(Strict):
    v: int = SCHEMA_VERSION

    @field_validator("v")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != SCHEMA_VERSION:
            raise ValueError(f"unsupported schema version {v} (this build speaks {SCHEMA_VERSION})")
        return v


# --------------------------------------------------------------------------- models / artifacts


class DecoderKind(StrEnum):
    """Output layouts the agent knows how to decode."""

    TF_OD = "tf_od"  # TensorFlow Object Detection API: num/boxes(y0,x0,y1,x1 norm)/scores/classes
    GFL = "gfl"  # NanoDet GFL head: per-stride class maps + distribution box regression
    YOLOV5 = "yolov5"  # [B, N, 5+C]: cx, cy, w, h, objectness, class scores
    YOLOV8 = "yolov8"  # [B, 4+C, N]: cx, cy, w, h, class scores (also YOLO11)


class InputSpec(Signed):
    name: ShortText
    layout: Literal["NHWC", "NCHW"]
    dtype: Literal["uint8", "float32"]
    color: Literal["RGB", "BGR"]
    width: int = Field(gt=0, le=8192)
    height: int = Field(gt=0, le=8192)
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    letterbox: bool = False


# At most this many chunk hashes in a manifest (~34 KB of JSON): the controller picks a larger chunk
# size for a file that would need more (ArtifactRef.chunk_size is at most 4 MiB, so up to 2 GiB).
MAX_CHUNK_HASHES = 512


class ModelManifest(Signed):
    """What an agent needs to know to run a model file; travels inside the desired state."""

    name: Name
    version: Name
    sha256: Sha256
    size: int = Field(gt=0, le=MAX_WIRE_INT)
    decoder: DecoderKind
    input: InputSpec
    outputs: list[ShortText] = Field(default_factory=list, max_length=MAX_NAMES)
    labels: list[Label] = Field(min_length=1, max_length=MAX_LABELS)
    default_threshold: float = Field(default=0.5, ge=0.0, le=1.0)
    nms_iou: float = Field(default=0.5, gt=0.0, le=1.0)
    decoder_params: FreeForm = Field(default_factory=dict)
    source: LongText = ""
    licence: LongText = ""
    # sha256 of each chunk of the file at its ref's ``chunk_size``, in order (PROTOCOL.md "Artifacts"):
    # signed with the rest of the manifest, so a chunk is checked against the controller's word before
    # it is written, not against the hash its own frame carries. None (left out of the JSON, so the
    # signed form of a manifest without it is unchanged): the whole-file sha256 alone is checked.
    chunk_hashes: list[Sha256] | None = Field(
        default=None, max_length=MAX_CHUNK_HASHES, exclude_if=lambda v: v is None
    )


class ArtifactRef(Signed):
    """A model version placed on a camera; the bytes are fetched in chunks over MQTT."""

    manifest: ModelManifest
    chunk_size: int = Field(default=256 * 1024, ge=1024, le=4 * 1024 * 1024)
    variant: ShortText = "fp32"
    # Ed25519 over fleet_protocol.signing.canonical_bytes (base64) and the signing key's id. Optional
    # so that messages without them still parse; an agent with a key configured refuses such a ref.
    # Loosely typed on purpose: a malformed signature is refused per camera and reported, instead of
    # making the whole desired state undecodable.
    signature: str | None = Field(default=None, max_length=256)
    key_id: str | None = Field(default=None, max_length=64)

    @property
    def chunk_count(self) -> int:
        return max(1, math.ceil(self.manifest.size / self.chunk_size))


# --------------------------------------------------------------------------- device → controller


class GpuInfo(Strict):
    index: Count
    name: ShortText
    compute_capability: ShortText | None = None
    memory_total_mb: float | None = None


# CPU instruction-set flags that decide how a CPU runs INT8 models, in /proc/cpuinfo's spelling (x86
# ``flags``; ARM ``Features`` mapped: asimd -> neon, asimddp -> dotprod). onnxruntime's u8s8 kernels are
# exact with avx512_vnni / avx_vnni and can saturate on AVX2 without them, so an INT8 variant judged on
# one kind of CPU may score lower on the other.
KNOWN_CPU_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx_vnni",
    "amx_int8",
    "neon",
    "dotprod",
    "i8mm",
)
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni"})
_ARM_FEATURES = {"asimd": "neon", "neon": "neon", "asimddp": "dotprod", "i8mm": "i8mm"}


def cpu_flags_from_cpuinfo(text: str) -> list[str] | None:
    """The :data:`KNOWN_CPU_FLAGS` a ``/proc/cpuinfo`` text names, in that order (pure, for tests).

    Only the first processor's line is read: the cores of one machine share an instruction set. None
    when the text has no flags/Features line at all: unknown, which is not the same as "none of them".
    """
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip().lower()
        if not sep or key not in ("flags", "features"):
            continue
        words = set(value.split())
        found = {w for w in words if w in KNOWN_CPU_FLAGS}
        found |= {_ARM_FEATURES[w] for w in words if w in _ARM_FEATURES}
        return [f for f in KNOWN_CPU_FLAGS if f in found]
    return None


CpuFlag = Annotated[str, Field(max_length=32)]


class Capabilities(Strict):
    hostname: ShortText = ""
    os: ShortText = ""
    arch: ShortText = ""
    cpu_model: ShortText = ""
    cpu_count: Count = 0
    memory_total_mb: float = 0.0
    gpus: list[GpuInfo] = Field(default_factory=list, max_length=MAX_GPUS)
    execution_providers: list[ShortText] = Field(default_factory=list, max_length=MAX_NAMES)
    onnxruntime_version: ShortText | None = None
    tensorrt_version: ShortText | None = None
    cameras: list[CameraId] = Field(default_factory=list, max_length=MAX_CAMERAS)
    # Instruction-set flags from KNOWN_CPU_FLAGS; None = not reported (an agent older than the field),
    # which the controller treats as "ISA unknown", unlike [] (reported: none of the known flags).
    cpu_flags: list[CpuFlag] | None = Field(default=None, max_length=64)

    @field_validator("cpu_flags")
    @classmethod
    def _known_flags(cls, v: list[str] | None) -> list[str] | None:
        # Names outside the known set are dropped, not refused: a newer agent that reports one more flag
        # must not make its whole birth message undecodable for an older controller.
        if v is None:
            return None
        return [f for f in KNOWN_CPU_FLAGS if f in v]

    @property
    def has_vnni(self) -> bool | None:
        """True/False from the reported flags; None when the agent did not report any."""
        if self.cpu_flags is None:
            return None
        return bool(VNNI_FLAGS.intersection(self.cpu_flags))


class Availability(Msg):
    """Birth (``online``) on connect; the same topic carries the Last Will (``offline``)."""

    type: Literal["availability"] = "availability"
    state: Literal["online", "offline"]
    ts: float | None = None
    agent_version: ShortText | None = None
    capabilities: Capabilities | None = None
    incarnation: IncarnationId | None = Field(default=None, exclude_if=_absent)


class GpuStats(Strict):
    index: Count
    name: ShortText
    utilization_pct: float | None = None
    memory_used_mb: float | None = None
    memory_total_mb: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None


# --------------------------------------------------------------------------- zones and lines

# Per camera (PROTOCOL.md "Zones and lines"): a handful is what a scene needs, and every inferred frame
# tests each track against each of them.
MAX_ZONES = 16
MAX_LINES = 16
MAX_ZONE_POINTS = 32
# A zone's or line's id: an event field, a query parameter and a dashboard label.
ZoneId = Annotated[str, Field(min_length=1, max_length=32, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]
# A coordinate as a fraction of the frame's width or height, so that one deployment's zones fit every
# camera's resolution (and a stream that changes resolution keeps its zones).
Coordinate = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
NormPoint = tuple[Coordinate, Coordinate]


class Anchor(StrEnum):
    """The point of a box that is in a zone or crosses a line."""

    BOTTOM_CENTER = "bottom_center"  # the feet of a person, the wheels of a car: where it stands
    CENTER = "center"  # for views from above, where the bottom edge is no nearer the ground


class Zone(Signed):
    """A polygon of the frame (normalised [x, y] points, in order, closed implicitly)."""

    id: ZoneId
    points: list[NormPoint] = Field(min_length=3, max_length=MAX_ZONE_POINTS)
    labels: LabelList | None = Field(default=None, exclude_if=_absent)  # None: every label
    anchor: Anchor | None = Field(default=None, exclude_if=_absent)  # None: bottom_center


class CountLine(Signed):
    """A segment of the frame from ``a`` to ``b`` (normalised). Crossing it from the left of a→b to
    its right, as seen on the image (y down), is ``in``; the other way ``out``."""

    id: ZoneId
    a: NormPoint
    b: NormPoint
    labels: LabelList | None = Field(default=None, exclude_if=_absent)
    anchor: Anchor | None = Field(default=None, exclude_if=_absent)

    @model_validator(mode="after")
    def _a_segment(self) -> CountLine:
        if self.a == self.b:
            raise ValueError("a line's two points must differ")
        return self


def _unique_ids(items: list[Any]) -> list[Any]:
    ids = [item.id for item in items]
    if len(set(ids)) != len(ids):
        raise ValueError(f"ids must be unique within a camera: {sorted(ids)}")
    return items


Zones = Annotated[list[Zone], Field(max_length=MAX_ZONES), AfterValidator(_unique_ids)]
CountLines = Annotated[list[CountLine], Field(max_length=MAX_LINES), AfterValidator(_unique_ids)]
# Per zone, per label: the confirmed tracks whose anchor is in it now.
Occupancy = Annotated[
    dict[ZoneId, Annotated[dict[Label, Count], Field(max_length=MAX_LABELS)]], Field(max_length=MAX_ZONES)
]


class CrossDirection(StrEnum):
    IN = "in"
    OUT = "out"


class ZoneTransit(Strict):
    """``Event.data`` of ``zone_entered`` and ``zone_left``: which track, at the capture time of the
    frame that decided it."""

    zone: ZoneId
    track_id: Count
    label: Label
    at: float = Field(ge=0.0)


class LineCrossing(Strict):
    """``Event.data`` of ``line_crossed``."""

    line: ZoneId
    track_id: Count
    label: Label
    direction: CrossDirection
    at: float = Field(ge=0.0)


class CameraState(OpenStrEnum):
    STARTING = "starting"
    UP = "up"
    DOWN = "down"
    STOPPED = "stopped"


class CameraStats(Strict):
    camera: CameraId
    state: CameraState
    fps: float = 0.0
    frames: Count = 0
    dropped: Count = 0
    # Frames the camera's motion gate kept from the detector (nothing moved); absent while the camera
    # has no gate, so a heartbeat without it is what agents before it sent.
    frames_skipped: Count | None = Field(default=None, exclude_if=_absent)
    # Median of the last 50 inference times of the model running now (fresh window at every swap).
    inference_ms: float | None = None
    model: ShortText | None = None
    # p99 of the last 200 inference times of the model running now (same fresh window). Optional and
    # last: agents before it send none, and a receiver falls back to ``inference_ms``.
    inference_p99_ms: float | None = None
    # What placing this camera on this device costs and allows (PROTOCOL.md "Heartbeat"): the capture
    # thread's CPU ms per frame read and decoded (EWMA), the rate the source delivers, and when a frame
    # of it was last inferred (unix seconds, with or without detections). Left out of the JSON while
    # unset, so a heartbeat without them is what agents before them sent.
    decode_ms: float | None = Field(default=None, ge=0.0, exclude_if=_absent)
    source_fps: float | None = Field(default=None, ge=0.0, exclude_if=_absent)
    last_inferred_at: float | None = Field(default=None, ge=0.0, exclude_if=_absent)
    # Per zone of the camera, the confirmed tracks inside it now, per label (PROTOCOL.md "Zones and
    # lines"); absent while the camera has no zone, so a heartbeat without zones is what it was.
    occupancy: Occupancy | None = Field(default=None, exclude_if=_absent)


# The weight of a new run in the smoothed costs of VariantCost (an EWMA; the first 1 / alpha runs are
# averaged instead, so the first run, often the slowest, is not the figure for long).
COST_EWMA_ALPHA = 0.1


class VariantCost(Strict):
    """The measured cost per frame of one model variant on the reporting device (PROTOCOL.md
    "Heartbeat"): what the controller places cameras by."""

    variant: ShortText = Field(min_length=1)  # "<model>/<version>", the manifest's name and version
    # Inference-lane wall time of a run divided by its frames, smoothed over production runs.
    infer_ms: float = Field(ge=0.0)
    # CPU time per frame: preprocessing, output decoding and, on the CPU provider, the run on every
    # thread of it; None when not measured. Always sent (null when None): readers key on it.
    cpu_ms: float | None = Field(default=None, ge=0.0)
    # Share of the last heartbeat interval its inference lanes spent running this variant (PROTOCOL.md).
    busy: float | None = Field(default=None, ge=0.0, le=1.0)
    frames: Count = 0  # production frames the figures are made of


def _one_per_variant(costs: list[VariantCost]) -> list[VariantCost]:
    seen: set[str] = set()
    for cost in costs:
        if cost.variant in seen:
            raise ValueError(f"variant {cost.variant!r} is reported twice")
        seen.add(cost.variant)
    return costs


def _empty(v: object) -> bool:
    return v == []


def _no_entries(v: object) -> bool:
    return v == {}


class Heartbeat(Msg):
    type: Literal["heartbeat"] = "heartbeat"
    ts: float
    uptime_s: float = 0.0
    cpu_pct: float | None = None
    memory_pct: float | None = None
    memory_used_mb: float | None = None
    disk_free_mb: float | None = None
    disk_pct: float | None = None
    gpus: list[GpuStats] = Field(default_factory=list, max_length=MAX_GPUS)
    cameras: list[CameraStats] = Field(default_factory=list, max_length=MAX_CAMERAS)
    inference_ms: float | None = None  # the highest per-camera median
    # CPU package energy from RAPL, cumulative joules since the agent started (None: not measured).
    cpu_energy_j: float | None = None
    outbox_pending: Count = 0
    outbox_dropped: Count = 0
    queue_dropped: Count = 0
    inference_p99_ms: float | None = None  # the highest per-camera p99 (None: none reported)
    # One per model variant running here, with frames measured. Left out of the JSON while empty.
    costs: Annotated[list[VariantCost], AfterValidator(_one_per_variant)] = Field(
        default_factory=list, max_length=MAX_CAMERAS, exclude_if=_empty
    )
    # Per camera of DesiredState.probe: whether this device reached its source at its last probe.
    reach: dict[CameraId, bool] = Field(default_factory=dict, max_length=MAX_CAMERAS, exclude_if=_no_entries)


Coord = Annotated[float, Field(allow_inf_nan=False)]


class Box(Strict):
    """Pixel coordinates in the original frame: left, top, right, bottom (ordering is checked once per
    batch in :class:`DetectionBatch`, not per box: this is the ingest hot path)."""

    x0: Coord
    y0: Coord
    x1: Coord
    y1: Coord

    @property
    def ordered(self) -> bool:
        return self.x0 <= self.x1 and self.y0 <= self.y1


class Detection(Strict):
    label: str = Field(max_length=64)
    class_id: Count
    score: float = Field(ge=0.0, le=1.0)
    box: Box
    # The camera's track this detection belongs to (PROTOCOL.md "Tracks"), once the track is confirmed;
    # left out of the JSON while unset, so a detection without one is what agents before tracks sent.
    track_id: Count | None = Field(default=None, exclude_if=_absent)


class FrameDetections(Strict):
    camera: CameraId
    frame: Count
    captured_at: float
    width: int = Field(gt=0, le=MAX_WIRE_INT)
    height: int = Field(gt=0, le=MAX_WIRE_INT)
    model: ShortText
    inference_ms: float = Field(ge=0.0)
    detections: list[Detection] = Field(default_factory=list, max_length=1000)


class DetectionBatch(Msg):
    type: Literal["detections"] = "detections"
    seq: int = Field(ge=1, le=MAX_WIRE_INT)
    # The sequence space seq belongs to; None from an agent older than incarnations (one legacy space).
    incarnation: IncarnationId | None = Field(default=None, exclude_if=_absent)
    sent_at: float
    frames: list[FrameDetections] = Field(min_length=1, max_length=500)

    @model_validator(mode="after")
    def _boxes_ordered(self) -> DetectionBatch:
        for fi, frame in enumerate(self.frames):
            for di, det in enumerate(frame.detections):
                if not det.box.ordered:
                    raise ValueError(f"frames.{fi}.detections.{di}.box must satisfy x0 <= x1 and y0 <= y1")
        return self


class EventKind(OpenStrEnum):
    CAMERA_UP = "camera_up"
    CAMERA_DOWN = "camera_down"
    MODEL_DOWNLOAD = "model_download"
    MODEL_VERIFY = "model_verify"
    MODEL_BUILD = "model_build"
    MODEL_ACTIVATE = "model_activate"
    MODEL_FAILED = "model_failed"
    DISK_LOW = "disk_low"
    WATCHDOG_RESTART = "watchdog_restart"
    OUTBOX_DROPPED = "outbox_dropped"
    AGENT_STARTED = "agent_started"
    AGENT_UPDATE = "agent_update"  # an agent update's progress: fetching, installing, restarting
    AGENT_UPDATED = "agent_updated"  # the new version runs and passed its health check
    AGENT_ROLLED_BACK = "agent_rolled_back"  # the new version failed; the previous one runs again
    TRACK_STARTED = "track_started"  # a camera's track was confirmed: its first sighting (TrackSighting)
    TRACK_ENDED = "track_ended"  # a confirmed track was lost long enough to end: its last sighting
    ZONE_ENTERED = "zone_entered"  # a track's anchor came into a zone (ZoneTransit)
    ZONE_LEFT = "zone_left"  # it left the zone, or its track ended inside it (ZoneTransit)
    LINE_CROSSED = "line_crossed"  # a track's anchor crossed a counting line (LineCrossing)
    DEVICE_RESET = "device_reset"  # controller-made: a new incarnation (seq space) began
    DECOMMISSIONED = "decommissioned"  # controller-made: the operator retired the device
    ERROR = "error"


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class Event(Msg):
    type: Literal["event"] = "event"
    seq: int = Field(ge=1, le=MAX_WIRE_INT)
    incarnation: IncarnationId | None = Field(default=None, exclude_if=_absent)
    ts: float
    kind: EventKind
    severity: Severity = Severity.INFO
    camera: CameraId | None = None
    message: str = Field(default="", max_length=4096)
    data: FreeForm = Field(default_factory=dict)


class TrackSighting(Strict):
    """``Event.data`` of ``track_started`` and ``track_ended`` (PROTOCOL.md "Tracks"): one track of the
    event's camera, its first and last sighting (unix seconds, the frames' capture times) and its box
    at the sighting the event is about (the first for a start, the last for an end)."""

    track_id: Count
    label: Label
    class_id: Count
    first_seen: float = Field(ge=0.0)
    last_seen: float = Field(ge=0.0)
    box: Box
    frames: Count = 0  # detections matched to the track so far

    @model_validator(mode="after")
    def _in_order(self) -> TrackSighting:
        if self.last_seen < self.first_seen:
            raise ValueError("last_seen must not be before first_seen")
        if not self.box.ordered:
            raise ValueError("box must satisfy x0 <= x1 and y0 <= y1")
        return self


Score = Annotated[float, Field(ge=0.0, le=1.0)]
# A camera's per-label score thresholds: at most one per label a model may have.
LabelThresholds = Annotated[dict[Label, Score], Field(max_length=MAX_LABELS)]
# The smallest box a camera keeps, as a fraction of its frame's area (0 keeps every box).
BoxAreaFraction = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]


class MotionSettings(Signed):
    """A camera's motion gate (PROTOCOL.md "Motion-gated inference"): the detector runs on a frame only
    when the scene moved, and on a full frame at least every ``full_frame_every_s``, so that an object
    standing still is seen again before its track is lost. The defaults are the agent's."""

    enabled: bool = False
    # The grey-level change (0-255, on the blurred, downscaled frame) from the running-average
    # background that counts a pixel as changed: above sensor noise and compression artefacts.
    threshold: int = Field(default=25, ge=1, le=255)
    # The smallest changed region that is motion, as a fraction of the frame's area (like
    # ``min_box_area``, so one setting fits cameras of any resolution).
    min_area: float = Field(default=0.001, gt=0.0, le=1.0)
    full_frame_every_s: float = Field(default=1.0, gt=0.0, le=3600.0)


class CameraReported(Strict):
    model: ShortText | None = None  # "name:version"
    sha256: Sha256 | None = None
    state: Literal["idle", "fetching", "verifying", "loading", "running", "failed"] = "idle"
    error: LongText | None = None
    progress_pct: float | None = None
    # The motion gate in effect; reported while a model runs by an agent that knows it, so None means an
    # agent before it and the controller does not compare it.
    motion: MotionSettings | None = Field(default=None, exclude_if=_absent)
    # The settings the camera's running model applies now (PROTOCOL.md "Desired and reported state"):
    # the threshold in effect (the desired one, else the manifest's default), the FPS cap and the label
    # filter (None: none). An agent that reports them always reports ``threshold`` while a model runs;
    # None there means "not reported" (an agent before these fields), and the controller then does not
    # compare settings.
    threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    max_fps: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    labels: LabelList | None = None
    # The per-label thresholds and the minimum box area in effect. An agent that knows them reports
    # both while a model runs ({} and 0.0 when none), so None means an agent before them and the
    # controller does not compare them. Left out of the JSON while unset.
    label_thresholds: LabelThresholds | None = Field(default=None, exclude_if=_absent)
    min_box_area: BoxAreaFraction | None = Field(default=None, exclude_if=_absent)
    # The zones and counting lines in effect; reported ([] when none) by an agent that knows them, so
    # None means an agent before them and the controller does not compare them.
    zones: Zones | None = Field(default=None, exclude_if=_absent)
    lines: CountLines | None = Field(default=None, exclude_if=_absent)


class AgentUpdateState(OpenStrEnum):
    IDLE = "idle"  # running the version desired (or none is desired)
    FETCHING = "fetching"
    VERIFYING = "verifying"
    INSTALLING = "installing"
    RESTARTING = "restarting"  # installed beside the running one; the supervisor switches to it
    FAILED = "failed"  # refused or could not install; the running version goes on (error says why)
    ROLLED_BACK = "rolled_back"  # the new version started but failed its health check; back on previous


class AgentReported(Strict):
    """The agent software as the device runs it, and where an update to ``target`` stands."""

    version: ShortText  # the running agent's version
    slot: ShortText | None = None  # the A/B slot it runs from
    target: ShortText | None = None  # the version desired, when it differs or is under way
    state: AgentUpdateState = AgentUpdateState.IDLE
    progress_pct: float | None = Field(default=None, ge=0.0, le=100.0)
    error: LongText | None = None
    previous: ShortText | None = None  # the version rolled back to / from


class ReportedState(Msg):
    type: Literal["reported"] = "reported"
    ts: float
    # A version the controller issued (DesiredState.version), so within the same bound.
    desired_version: int = Field(ge=0, le=MAX_DESIRED_VERSION)
    cameras: dict[CameraId, CameraReported] = Field(default_factory=dict, max_length=MAX_CAMERAS)
    agent_version: ShortText | None = None
    agent: AgentReported | None = Field(default=None, exclude_if=_absent)


# How an agent's reported fetch failure (``CameraReported.error``) starts when the transfer failed (no
# valid answer in time, or the whole file did not match after its retries), not the model: the controller
# then sends the desired state again, with its usual backoff; other failures it does not.
FETCH_TRANSPORT_ERROR = "transfer failed: "


class ArtifactRequest(Msg):
    """The agent asks for the chunks of an artifact it lacks (flow control: at most a window)."""

    type: Literal["artifact_request"] = "artifact_request"
    sha256: Sha256
    chunks: list[Count] = Field(min_length=1, max_length=64)
    chunk_size: int = Field(ge=1024, le=4 * 1024 * 1024)

    @field_validator("chunks")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(i < 0 for i in v):
            raise ValueError("chunk indices must be >= 0")
        return v


class CommandResult(Msg):
    type: Literal["command_result"] = "command_result"
    id: str = Field(min_length=1, max_length=64)
    ok: bool
    result: ResultFreeForm = Field(default_factory=dict)
    error: LongText | None = None


# --------------------------------------------------------------------------- controller → device


class CameraDesired(Signed):
    model: ArtifactRef | None = None
    threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    max_fps: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    labels: LabelList | None = None  # keep only these labels; None keeps all
    # Per label, the score a detection of it needs instead of ``threshold`` (PROTOCOL.md "Desired and
    # reported state"); and the smallest box kept, as a fraction of the frame's area. Left out of the
    # JSON (and so of the signed bytes) while unset, so a state without them is what older agents get.
    label_thresholds: LabelThresholds | None = Field(default=None, exclude_if=_absent)
    min_box_area: BoxAreaFraction | None = Field(default=None, exclude_if=_absent)
    # Zones and counting lines (PROTOCOL.md "Zones and lines"), applied without a model reload; left
    # out of the JSON (and the signed bytes) while unset.
    zones: Zones | None = Field(default=None, exclude_if=_absent)
    lines: CountLines | None = Field(default=None, exclude_if=_absent)
    # A pool camera (PROTOCOL.md "Pool cameras"): the device opens this source itself, and stops it
    # when a later state no longer names the camera. Credentials only as {secret:NAME} references,
    # resolved on the device. Absent for the cameras of the device's own configuration.
    source: str | None = Field(default=None, min_length=1, max_length=MAX_SOURCE_LEN, exclude_if=_absent)
    # The camera's motion gate (PROTOCOL.md "Motion-gated inference"), the whole of it; unset: the
    # agent's own configuration. Left out of the JSON (and the signed bytes) while unset.
    motion: MotionSettings | None = Field(default=None, exclude_if=_absent)


class AgentPackageRef(Signed):
    """An agent version to run: a package fetched over the artifact channel by its sha256.

    Signed on its own (``signing.sign_agent_package``: version, sha256, size, chunk_size) as well as
    inside the signed desired state, so an agent checks the package's word before fetching it and the
    bytes against ``sha256`` before installing anything.
    """

    version: ShortText = Field(min_length=1, max_length=64, pattern=r"^[0-9A-Za-z][0-9A-Za-z.+_-]*$")
    sha256: Sha256
    size: int = Field(gt=0, le=MAX_WIRE_INT)
    chunk_size: int = Field(default=256 * 1024, ge=1024, le=4 * 1024 * 1024)
    # How long the new version has to report healthy after the switch before it is rolled back.
    health_timeout_s: float = Field(default=120.0, gt=0.0, le=3600.0, allow_inf_nan=False)
    signature: str | None = Field(default=None, max_length=256)
    key_id: str | None = Field(default=None, max_length=64)


class DesiredState(Msg, Signed):
    """The complete desired state of one device; retained, so an offline device converges on return.

    Signed as a whole by the controller (``fleet_protocol.signing.signed_desired``): everything but
    ``signature`` and ``key_id`` is covered, so the version, the issue time, the device it is for and
    every camera setting are the controller's word or the state is refused (PROTOCOL.md "What is
    signed"). The signature fields are optional so that an unsigned state still decodes; an agent with
    a key refuses it, as a whole, with an event.
    """

    # Signed's handling of unknown fields, with Msg's schema version.
    model_config = Signed.model_config

    type: Literal["desired"] = "desired"
    version: int = Field(ge=0, le=MAX_DESIRED_VERSION)
    issued_at: float = Field(allow_inf_nan=False)
    device_id: DeviceId | None = None
    cameras: dict[CameraId, CameraDesired] = Field(default_factory=dict, max_length=MAX_CAMERAS)
    # The agent version this device should run; None leaves the agent as it is.
    agent: AgentPackageRef | None = Field(default=None, exclude_if=_absent)
    # Pool cameras this device could take over: it checks now and then that it reaches each source and
    # says so in Heartbeat.reach (PROTOCOL.md "Pool cameras").
    probe: dict[CameraId, Annotated[str, Field(min_length=1, max_length=MAX_SOURCE_LEN)]] = Field(
        default_factory=dict, max_length=MAX_CAMERAS, exclude_if=_no_entries
    )
    signature: str | None = Field(default=None, max_length=256)
    key_id: str | None = Field(default=None, max_length=64)


class CommandName(OpenStrEnum):
    RESTART_PIPELINE = "restart_pipeline"
    SNAPSHOT = "snapshot"
    DIAGNOSTICS = "diagnostics"
    # Remote troubleshooting (PROTOCOL.md "Commands"): an agent that does not know one answers
    # ``unsupported command``, so a controller may send them to any agent.
    LOGS = "logs"
    PROBE_CAMERA = "probe_camera"
    RESTART_CAMERA = "restart_camera"
    RESTART_AGENT = "restart_agent"


class Command(Msg):
    type: Literal["command"] = "command"
    id: str = Field(min_length=1, max_length=64)
    name: CommandName
    args: FreeForm = Field(default_factory=dict)


class Ack(Msg):
    """End-to-end acknowledgement: these sequence numbers are stored at the controller.

    ``upto``: every seq <= upto is stored (or was declared dropped by the agent); ``ranges``: further
    stored seqs above ``upto`` as inclusive [first, last] pairs.
    """

    type: Literal["ack"] = "ack"
    # The incarnation these seqs belong to (echoed from the batches); an agent ignores an ack for
    # another incarnation. None from a controller older than incarnations, or for legacy batches.
    incarnation: IncarnationId | None = Field(default=None, exclude_if=_absent)
    upto: Count
    ranges: list[tuple[Count, Count]] = Field(default_factory=list, max_length=1000)

    @field_validator("ranges")
    @classmethod
    def _ordered(cls, v: list[tuple[int, int]]) -> list[tuple[int, int]]:
        for a, b in v:
            if a < 1 or b < a:
                raise ValueError(f"bad ack range [{a}, {b}]")
        return v

    def covers(self, seq: int) -> bool:
        return seq <= self.upto or any(a <= seq <= b for a, b in self.ranges)


Message = (
    Availability
    | Heartbeat
    | DetectionBatch
    | Event
    | ReportedState
    | ArtifactRequest
    | CommandResult
    | DesiredState
    | Command
    | Ack
)
