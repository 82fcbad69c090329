"""Database tables and their API-facing shapes, split by role (``XBase / XCreate / XPublic / X``).

The schema itself is created only by the Alembic migrations in ``controller/migrations``; these
classes must stay in step with them (a test compares the two).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from pydantic import field_validator
from sqlalchemy.engine import Dialect
from sqlmodel import JSON, Field, SQLModel

from controller.db.states import DeploymentState, DeviceStatus, MemberState, ModelVersionStatus, RolloutState
from controller.types import check_labels
from fleet_protocol.ids import ID_RULE
from fleet_protocol.topics import valid_device_id


def utcnow() -> datetime:
    return datetime.now(UTC)


def empty_list() -> list[Any]:
    """The default of a list column. Not ``list`` itself: SQLModel asks pydantic, for every row it
    builds, whether the default factory takes the validated data, and pydantic answers with
    ``inspect.signature``, which for a builtin parses its text signature with ``ast.parse``. That is a
    parse per row, in whichever thread builds it, and CPython 3.11.7 keeps the AST converter's
    recursion depth per interpreter, not per thread: two threads parsing at once can fail one of them
    with "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905)."""
    return []


class UtcDateTime(sa.types.TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every dialect.

    SQLite keeps no offset, so values go in as naive UTC and come back tagged UTC; without this the
    API would hand out naive datetimes on SQLite and aware ones on PostgreSQL.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        value = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# SQLite only autoincrements an INTEGER PRIMARY KEY, not a BIGINT one.
BigIntId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


# --------------------------------------------------------------------------- devices


class DeviceBase(SQLModel):
    name: str | None = Field(default=None, max_length=200)
    labels: dict[str, str] = Field(default_factory=dict, sa_type=JSON)


class DeviceCreate(DeviceBase):
    id: str = Field(max_length=64)

    @field_validator("id")
    @classmethod
    def _valid_id(cls, v: str) -> str:
        if not valid_device_id(v):
            raise ValueError(f"device id must match {ID_RULE}")
        return v

    @field_validator("name")
    @classmethod
    def _no_nul(cls, v: str | None) -> str | None:
        # PostgreSQL text cannot hold NUL: a 422 here instead of a 500 at the insert.
        if v is not None and "\x00" in v:
            raise ValueError("name must not contain NUL characters")
        return v

    @field_validator("labels")
    @classmethod
    def _valid_labels(cls, v: dict[str, str]) -> dict[str, str]:
        # The same rules as PUT /labels: labels feed selectors and must be plain keys and values.
        return check_labels(v)


class Device(DeviceBase, table=True):
    __tablename__ = "device"

    id: str = Field(primary_key=True, max_length=64)
    enrolled: bool = Field(default=False)
    status: str = Field(default=DeviceStatus.OFFLINE, max_length=16)  # a DeviceStatus
    online_since: datetime | None = Field(default=None, sa_type=UtcDateTime)
    offline_since: datetime | None = Field(default=None, sa_type=UtcDateTime)
    last_seen: datetime | None = Field(default=None, sa_type=UtcDateTime)
    agent_version: str | None = Field(default=None)
    capabilities: dict[str, Any] | None = Field(default=None, sa_type=JSON)
    last_health: dict[str, Any] | None = Field(default=None, sa_type=JSON)
    desired: dict[str, Any] | None = Field(default=None, sa_type=JSON)
    desired_version: int = Field(default=0)
    reported: dict[str, Any] | None = Field(default=None, sa_type=JSON)
    reported_version: int | None = Field(default=None)
    duplicates: int = Field(default=0, sa_type=sa.BigInteger)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UtcDateTime)
    # Per camera: the assignment as asked (model, version, pin) and the variant chosen, with why.
    assignments: dict[str, Any] | None = Field(default=None, sa_type=JSON)
    # Per camera: the direct assignment (the lowest layer, below every deployment).
    direct: dict[str, Any] | None = Field(default=None, sa_type=JSON)
    # Broker credentials (controller/link/broker_auth.py): only a hash of the password, never the password.
    mqtt_password_hash: str | None = Field(default=None, max_length=200)
    mqtt_issued_at: datetime | None = Field(default=None, sa_type=UtcDateTime)
    mqtt_revoked_at: datetime | None = Field(default=None, sa_type=UtcDateTime)
    # The agent software this device should run (controller/fleet/twin.py ``agent_layer``): the
    # operator's direct version, and the package refs now and before the last change, the one a
    # failed agent rollout sends the device back to.
    agent_desired: dict[str, Any] | None = Field(default=None, sa_type=JSON)
    # The seq space the device's agent sends in now (PROTOCOL.md "Incarnations"); None: none seen yet,
    # or only the legacy space of an agent older than incarnations.
    incarnation: str | None = Field(default=None, max_length=32)
    incarnation_started_at: datetime | None = Field(default=None, sa_type=UtcDateTime)
    # Set by a decommission (status DECOMMISSIONED), cleared by the next enrolment.
    decommissioned_at: datetime | None = Field(default=None, sa_type=UtcDateTime)


# --------------------------------------------------------------------------- health


class HealthSampleBase(SQLModel):
    ts: datetime = Field(sa_type=UtcDateTime)
    payload: dict[str, Any] = Field(default_factory=dict, sa_type=JSON)


class HealthSample(HealthSampleBase, table=True):
    __tablename__ = "health_sample"
    __table_args__ = (sa.Index("ix_health_sample_device_ts", "device_id", "ts"),)

    id: int | None = Field(default=None, primary_key=True, sa_type=BigIntId)
    device_id: str = Field(max_length=64)


class HealthSamplePublic(HealthSampleBase):
    device_id: str


# --------------------------------------------------------------------------- detections


class Detection(SQLModel, table=True):
    __tablename__ = "detection"
    __table_args__ = (
        sa.Index("ix_detection_captured", "captured_at", "id"),
        sa.Index("ix_detection_device_captured", "device_id", "captured_at"),
        sa.Index("ix_detection_device_seq", "device_id", "seq"),
        sa.Index("ix_detection_label", "label"),
        sa.Index("ix_detection_camera", "camera"),
        sa.Index("ix_detection_track", "track_id"),
    )

    id: int | None = Field(default=None, primary_key=True, sa_type=BigIntId)
    device_id: str = Field(max_length=64)
    seq: int = Field(sa_type=sa.BigInteger)
    camera: str
    frame: int = Field(sa_type=sa.BigInteger)
    captured_at: datetime = Field(sa_type=UtcDateTime)
    stored_at: datetime = Field(sa_type=UtcDateTime)
    model: str
    label: str
    class_id: int = Field(sa_type=sa.BigInteger)
    score: float
    x0: float
    y0: float
    x1: float
    y1: float
    # The camera's track (PROTOCOL.md "Tracks"); null from agents before tracking and before a track is
    # confirmed.
    track_id: int | None = Field(default=None, sa_type=sa.BigInteger)


class IngestedSeq(SQLModel, table=True):
    """One row per ``(device, incarnation, seq)`` stored: the dedup record. Seqs declared dropped are
    ``DroppedRange`` rows, one per declared run (``dropped`` stays false here)."""

    __tablename__ = "ingested_seq"

    device_id: str = Field(primary_key=True, max_length=64)
    # '' is the legacy space (an agent older than incarnations): NOT NULL, so it can be in the key.
    incarnation: str = Field(default="", primary_key=True, max_length=32)
    seq: int = Field(primary_key=True, sa_type=sa.BigInteger)
    kind: str = Field(max_length=16)  # "detections", "events" (the topic kind) or "dropped"
    stored_at: datetime = Field(sa_type=UtcDateTime)
    dropped: bool = Field(default=False)


class DroppedRange(SQLModel, table=True):
    """Seqs ``first..last`` of one space an agent declared dropped from its full outbox and that have
    not arrived since: one row per run, whatever its length. Disjoint from each other and from the
    stored seqs (a late arrival splits its run)."""

    __tablename__ = "dropped_range"

    device_id: str = Field(primary_key=True, max_length=64)
    incarnation: str = Field(default="", primary_key=True, max_length=32)
    first: int = Field(primary_key=True, sa_type=sa.BigInteger)
    last: int = Field(sa_type=sa.BigInteger)
    declared_at: datetime = Field(sa_type=UtcDateTime)


# --------------------------------------------------------------------------- events

# Who wrote an event: the device (its events topic) or the controller itself.
SOURCE_DEVICE = "device"
SOURCE_CONTROLLER = "controller"
# The kinds only the controller writes (the decommission, a new incarnation, a command's result and
# who asked for one, the converger's re-sends and their outcome, a pool camera moved by a plan): refused
# when a device sends one, so that the audit trail cannot be forged from a device.
CONTROLLER_EVENT_KINDS = frozenset(
    {
        "decommissioned",
        "device_reset",
        "command_result",
        "remote_command",
        "twin_resend",
        "twin_converged",
        "camera_moved",
    }
)


class EventBase(SQLModel):
    device_id: str = Field(max_length=64)
    seq: int | None = Field(default=None, sa_type=sa.BigInteger)
    ts: datetime = Field(sa_type=UtcDateTime)
    kind: str = Field(max_length=32)
    severity: str = Field(default="info", max_length=16)
    camera: str | None = None
    message: str = ""
    data: dict[str, Any] = Field(default_factory=dict, sa_type=JSON)
    # Ingest writes the device's events; every other writer is the controller.
    source: str = Field(
        default=SOURCE_CONTROLLER,
        max_length=16,
        sa_column_kwargs={"server_default": SOURCE_CONTROLLER},
        description="device: sent by the device on its events topic; controller: written by the controller",
    )


class Event(EventBase, table=True):
    __tablename__ = "event"
    __table_args__ = (
        sa.Index("ix_event_device_ts", "device_id", "ts"),
        sa.Index("ix_event_kind_ts", "kind", "ts"),
        sa.Index("ix_event_ts", "ts", "id"),
    )

    id: int | None = Field(default=None, primary_key=True, sa_type=BigIntId)
    stored_at: datetime = Field(default_factory=utcnow, sa_type=UtcDateTime)


class EventPublic(EventBase):
    id: int
    stored_at: datetime


# --------------------------------------------------------------------------- models


class ModelVersionBase(SQLModel):
    name: str = Field(max_length=64)
    version: str = Field(max_length=64)
    sha256: str = Field(max_length=64)
    size: int = Field(sa_type=sa.BigInteger)
    manifest: dict[str, Any] = Field(default_factory=dict, sa_type=JSON)


class ModelVersion(ModelVersionBase, table=True):
    __tablename__ = "model_version"
    __table_args__ = (
        # Not unique: two versions may share one content-addressed file (the same bytes re-released).
        sa.Index("ix_model_version_sha256", "sha256"),
        sa.UniqueConstraint("name", "version", name="uq_model_version_name_version"),
    )

    id: int | None = Field(default=None, primary_key=True)
    path: str
    created_at: datetime = Field(default_factory=utcnow, sa_type=UtcDateTime)
    # Variant builds, a ModelVersionStatus: building while the worker has it, then ready (fp32 always
    # serves) or failed (the fp32 model itself could not be judged; it still serves).
    status: str = Field(default=ModelVersionStatus.READY, max_length=16)
    build_stage: str | None = Field(default=None, max_length=32)
    build_progress: float = Field(default=0.0)
    build_error: str | None = Field(default=None)
    # The claim on a ``building`` version (controller/registry/build_jobs.py): the replica building it,
    # a token only that build knows (its writes are fenced by it), when the claim was last renewed,
    # and how many claims it has had (a bound ends a build that keeps killing its replica).
    build_owner: str | None = Field(default=None, max_length=64)
    build_token: str | None = Field(default=None, max_length=64)
    build_heartbeat_at: datetime | None = Field(default=None, sa_type=UtcDateTime)
    build_attempts: int = Field(default=0)


class ModelVariantBase(SQLModel):
    variant: str = Field(max_length=8)
    sha256: str | None = Field(default=None, max_length=64)
    size: int | None = Field(default=None, sa_type=sa.BigInteger)
    latency_ms_1t: float | None = None
    latency_ms_2t: float | None = None
    f1: float | None = None
    mean_iou: float | None = None
    detections: int | None = None
    fit: bool = Field(default=False)
    reason: str | None = None
    target: str = Field(default="any", max_length=8)
    build_s: float = Field(default=0.0)
    # int8: the controller CPU's ISA it was judged on ("vnni" / "no-vnni", None when unknown) and
    # whether its weights are 7-bit (same results on any CPU); the per-device choice reads both.
    int8_isa: str | None = Field(default=None, max_length=8)
    reduce_range: bool = Field(default=False)


class ModelVariant(ModelVariantBase, table=True):
    """One optimized form of a model version, with the figures it was judged by."""

    __tablename__ = "model_variant"
    __table_args__ = (
        sa.UniqueConstraint("model_version_id", "variant", name="uq_model_variant_version_variant"),
        sa.Index("ix_model_variant_sha256", "sha256"),
    )

    id: int | None = Field(default=None, primary_key=True)
    model_version_id: int = Field(foreign_key="model_version.id")
    path: str | None = None  # set only for a file that may be shipped (fit)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UtcDateTime)


class ModelVariantPublic(ModelVariantBase):
    pass


class ModelVersionPublic(ModelVersionBase):
    created_at: datetime
    status: str = ModelVersionStatus.READY
    build_stage: str | None = None
    build_progress: float = 0.0
    build_error: str | None = None
    variants: list[ModelVariantPublic] = []


# --------------------------------------------------------------------------- agent packages


class AgentPackageBase(SQLModel):
    version: str = Field(max_length=64)
    sha256: str = Field(max_length=64)
    size: int = Field(sa_type=sa.BigInteger)
    # Pinned requirement strings of the wheel's dependencies ("paho-mqtt==2.1.0"), from the package.
    requires: list[str] = Field(default_factory=empty_list, sa_type=JSON)
    notes: str | None = Field(default=None)


class AgentPackage(AgentPackageBase, table=True):
    """An uploaded edge agent package (``edgefleet-agent-<version>.tar.gz``), stored by sha256."""

    __tablename__ = "agent_package"
    __table_args__ = (
        sa.UniqueConstraint("version", name="uq_agent_package_version"),
        sa.Index("ix_agent_package_sha256", "sha256"),
    )

    id: int | None = Field(default=None, primary_key=True)
    path: str
    uploaded_at: datetime = Field(default_factory=utcnow, sa_type=UtcDateTime)


class AgentPackagePublic(AgentPackageBase):
    uploaded_at: datetime


# --------------------------------------------------------------------------- deployments / rollouts


class Deployment(SQLModel, table=True):
    """A model version for the devices a selector matches, on some cameras, at a priority (layered)."""

    __tablename__ = "deployment"
    __table_args__ = (sa.UniqueConstraint("name", name="uq_deployment_name"),)

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=64)
    model: str = Field(max_length=64)
    version: str = Field(max_length=64)
    variant: str = Field(default="auto", max_length=8)
    selector: str = Field(default="")
    # [{"camera": id or "*", "threshold": …, "max_fps": …, "labels": […], "label_thresholds": {label: score},
    #   "min_box_area": fraction}] (api/schemas.py DeploymentCamera validates them)
    cameras: list[dict[str, Any]] = Field(default_factory=empty_list, sa_type=JSON)
    priority: int = Field(default=0)
    # A DeploymentState (controller/db/states.py, with its transitions); the column is a plain string.
    state: str = Field(default=DeploymentState.ROLLING_OUT, max_length=16)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UtcDateTime)
    # "model" (the fields above) or "agent": the agent software version ``agent_version`` for the
    # matching devices, rolled out through the same waves and gates (model and version are empty).
    kind: str = Field(default="model", max_length=8)
    agent_version: str | None = Field(default=None, max_length=64)
    agent_health_timeout_s: float | None = Field(default=None)


class Rollout(SQLModel, table=True):
    """The staged rollout of one deployment: waves, the current one, gate config and results."""

    __tablename__ = "rollout"
    __table_args__ = (sa.UniqueConstraint("deployment_id", name="uq_rollout_deployment"),)

    id: int | None = Field(default=None, primary_key=True)
    deployment_id: int = Field(foreign_key="deployment.id")
    waves: list[Any] = Field(default_factory=empty_list, sa_type=JSON)  # as asked: 1, "10%", …
    plan: list[int] = Field(default_factory=empty_list, sa_type=JSON)  # cumulative device counts per wave
    current_wave: int = Field(default=0)  # index of the wave being admitted/soaked
    # A RolloutState (controller/db/states.py, with its transitions); the column is a plain string.
    state: str = Field(default=RolloutState.RUNNING, max_length=16)
    gate: dict[str, Any] = Field(default_factory=dict, sa_type=JSON)
    gates: list[dict[str, Any]] = Field(default_factory=empty_list, sa_type=JSON)  # evaluations per wave
    reason: str | None = None
    created_at: datetime = Field(default_factory=utcnow, sa_type=UtcDateTime)
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UtcDateTime)
    finished_at: datetime | None = Field(default=None, sa_type=UtcDateTime)


class RolloutDevice(SQLModel, table=True):
    __tablename__ = "rollout_device"

    rollout_id: int = Field(foreign_key="rollout.id", primary_key=True)
    device_id: str = Field(primary_key=True, max_length=64)
    wave: int
    # A MemberState (controller/db/states.py, with its transitions); the column is a plain string.
    state: str = Field(default=MemberState.APPLYING, max_length=16)
    cameras: list[str] = Field(default_factory=empty_list, sa_type=JSON)
    target_version: int | None = None
    baseline_fps: float | None = None
    baseline_latency_ms: float | None = None
    admitted_at: datetime | None = Field(default=None, sa_type=UtcDateTime)
    settled_at: datetime | None = Field(default=None, sa_type=UtcDateTime)
    reason: str | None = None


class RolloutCamera(SQLModel, table=True):
    """A pool camera admitted to a rollout: the unit of its waves for cameras that move between devices
    (``controller/fleet/gate.py``). ``device_id`` is the device that analyses it now ("" none); a move
    while it is judged starts its judgement again there (``soak_restarts``)."""

    __tablename__ = "rollout_camera"

    rollout_id: int = Field(foreign_key="rollout.id", primary_key=True)
    pool: str = Field(primary_key=True, max_length=64)
    camera: str = Field(primary_key=True, max_length=64)
    device_id: str = Field(default="", max_length=64)
    wave: int
    # A MemberState, as RolloutDevice.state.
    state: str = Field(default=MemberState.APPLYING, max_length=16)
    target_version: int | None = None
    baseline_fps: float | None = None
    baseline_latency_ms: float | None = None
    admitted_at: datetime | None = Field(default=None, sa_type=UtcDateTime)
    settled_at: datetime | None = Field(default=None, sa_type=UtcDateTime)
    soak_restarts: int = Field(default=0)
    reason: str | None = None


# --------------------------------------------------------------------------- API tokens


class ApiToken(SQLModel, table=True):
    """A bearer token for the REST API. Only its sha256 is kept: the token itself is shown once, when made."""

    __tablename__ = "api_token"
    __table_args__ = (sa.UniqueConstraint("token_hash", name="uq_api_token_hash"),)

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=64)
    role: str = Field(max_length=16)  # viewer | operator | release | admin
    # The token's first characters, not secret: shown to tell tokens apart, and the lookup key.
    prefix: str = Field(max_length=16, index=True)
    token_hash: str = Field(max_length=64)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UtcDateTime)
    last_used_at: datetime | None = Field(default=None, sa_type=UtcDateTime)
    revoked_at: datetime | None = Field(default=None, sa_type=UtcDateTime)


# --------------------------------------------------------------------------- replicas


class LeaderLease(SQLModel, table=True):
    """The fencing token of the leader among controller replicas (one row per leadership name).

    ``epoch`` grows by one at every takeover; a leader's transactions check it (``controller.db.leader``),
    so a replica that lost its advisory lock cannot commit after another one took over.
    """

    __tablename__ = "leader_lease"

    name: str = Field(primary_key=True, max_length=32)
    epoch: int = Field(default=0, sa_type=sa.BigInteger)
    holder: str | None = Field(default=None, max_length=64)
    acquired_at: datetime | None = Field(default=None, sa_type=UtcDateTime)


class ControllerReplica(SQLModel, table=True):
    """A running controller replica: its id (unique; a duplicate refuses to start) and when it was last alive."""

    __tablename__ = "controller_replica"

    replica_id: str = Field(primary_key=True, max_length=64)
    host: str = Field(default="", max_length=256)
    started_at: datetime = Field(default_factory=utcnow, sa_type=UtcDateTime)
    seen_at: datetime = Field(default_factory=utcnow, sa_type=UtcDateTime)


# --------------------------------------------------------------------------- ingest truth


class DeviceSeq(SQLModel, table=True):
    """One sequence space's ingest truth, shared by every controller replica (``controller/link/ingest.py``).

    A space is a device's incarnation ('' for the legacy space of an agent older than incarnations).
    Every seq ``1..upto`` is stored or declared dropped, so ``ingested_seq`` only needs its rows above
    ``upto`` to build an ack (those below may be compacted). The counters change in the transaction that
    stores what they count, whichever replica ran it: they are the fleet's figures, not one process's.
    """

    __tablename__ = "device_seq"

    device_id: str = Field(primary_key=True, max_length=64)
    incarnation: str = Field(default="", primary_key=True, max_length=32)
    # When the controller first heard of this space (None for the legacy rows migrated in 0010).
    started_at: datetime | None = Field(default=None, sa_type=UtcDateTime)
    upto: int = Field(default=0, sa_type=sa.BigInteger)
    max_seq: int = Field(default=0, sa_type=sa.BigInteger)  # the highest seq stored or declared dropped
    stored: int = Field(default=0, sa_type=sa.BigInteger)  # distinct seqs stored
    dropped: int = Field(default=0, sa_type=sa.BigInteger)  # declared dropped and not arrived since
    duplicates: int = Field(default=0, sa_type=sa.BigInteger)  # messages received again after storing
    # The runs of seqs above ``upto`` already stored or declared dropped, lowest first, as JSON
    # ``[[first, last], ...]``: what an ack's ranges say. Kept on the row so that a commit reads no
    # ``ingested_seq`` row above ``upto``, however many a gap that never fills has let pile up; at most
    # ``ingest_gaps_max`` runs.
    above: str = Field(default="[]", sa_type=sa.Text, sa_column_kwargs={"server_default": "[]"})


# --------------------------------------------------------------------------- pools


class Pool(SQLModel, table=True):
    """A site's camera pool: cameras shared by the devices its selector matches, and the policy that
    places them (``controller/fleet/pools.py``; the decision itself is ``controller/fleet/placement.py``)."""

    __tablename__ = "pool"

    name: str = Field(primary_key=True, max_length=64)
    selector: str = Field(default="")
    strategy: str = Field(default="spread", max_length=8)  # a placement.Strategy
    headroom: float = Field(default=0.8)
    reserve_n1: bool = Field(default=False)
    failover_grace_s: float = Field(default=10.0)
    failback: str = Field(default="never", max_length=16)  # a placement.Failback
    max_moves_per_min: int = Field(default=5)
    min_dwell_s: float = Field(default=600.0)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UtcDateTime)
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UtcDateTime)


class PoolCamera(SQLModel, table=True):
    """One camera of a pool, as declared, and the operator's pin (a manual move)."""

    __tablename__ = "pool_camera"

    pool: str = Field(primary_key=True, max_length=64, foreign_key="pool.name")
    camera: str = Field(primary_key=True, max_length=64)
    # Never holds a credential: a password is refused, a ``{secret:NAME}`` reference is resolved on the device.
    source: str = Field(max_length=2048)
    model: str = Field(max_length=64)
    version: str = Field(max_length=64)
    target_fps: float
    min_fps: float
    priority: int = Field(default=0)
    spread_group: str | None = Field(default=None, max_length=64)
    prefer: str | None = Field(default=None, max_length=64)
    pin: str | None = Field(default=None, max_length=64)


class PoolDevice(SQLModel, table=True):
    """An operator's hold on one device of a pool: cordoned (no new cameras), draining (none at all)."""

    __tablename__ = "pool_device"

    pool: str = Field(primary_key=True, max_length=64, foreign_key="pool.name")
    device_id: str = Field(primary_key=True, max_length=64)
    cordoned: bool = Field(default=False)
    draining: bool = Field(default=False)
    since: datetime = Field(default_factory=utcnow, sa_type=UtcDateTime)


class SupersededAnalysis(SQLModel, table=True):
    """A span in which ``device_id`` analysed ``camera`` after a move gave it to another device (a
    partitioned device that went on, or the tail of a handover): its detections of the camera
    captured in ``[since, until)`` are superseded (``until`` null: still open)."""

    __tablename__ = "superseded_analysis"
    __table_args__ = (sa.Index("ix_superseded_device_camera", "device_id", "camera"),)

    id: int | None = Field(default=None, primary_key=True, sa_type=BigIntId)
    pool: str = Field(max_length=64)
    device_id: str = Field(max_length=64)
    camera: str = Field(max_length=64)
    since: datetime = Field(sa_type=UtcDateTime)
    until: datetime | None = Field(default=None, sa_type=UtcDateTime)
    reason: str = Field(max_length=32)


class PoolPlacement(SQLModel, table=True):
    """Where each camera of a pool runs in the last stored plan: what the next plan keeps."""

    __tablename__ = "pool_placement"
    # A device's desired state reads its placements (and handovers) by device.
    __table_args__ = (
        sa.Index("ix_pool_placement_device", "device_id"),
        sa.Index("ix_pool_placement_handover", "handover_from"),
    )

    pool: str = Field(primary_key=True, max_length=64, foreign_key="pool.name")
    camera: str = Field(primary_key=True, max_length=64)
    device_id: str = Field(max_length=64)
    fps: float
    since: datetime = Field(sa_type=UtcDateTime)
    # Make-before-break: the live device the camera left, which keeps running it until ``device_id``
    # reports it running (``controller/fleet/pools.py``, handovers).
    handover_from: str | None = Field(default=None, max_length=64)
    handover_since: datetime | None = Field(default=None, sa_type=UtcDateTime)
    # The canary variant ("model/version") a rollout wants for the camera, admitted here because its
    # cost fits; ``canary_held``: why the plan did not admit the one wanted (``placement.Plan``).
    canary: str | None = Field(default=None, max_length=129)
    canary_held: str | None = Field(default=None)
