"""Response and request shapes of the REST API that are not plain table views (shapes only: the
rows become these in ``controller.api.presenters``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from controller.fleet.gate import GateConfig
from controller.fleet.pools import MAX_FAIL
from controller.fleet.sync import SyncState
from controller.types import CAMERA_OR_ANY_PATTERN, ID_MAX, ID_PATTERN, NO_NUL_PATTERN, DeviceId, check_labels
from fleet_protocol.messages import (
    BoxAreaFraction,
    CameraReported,
    CameraStats,
    CountLines,
    LabelList,
    LabelThresholds,
    MotionSettings,
    Name,
    Zones,
)


class IncarnationStats(BaseModel):
    """One sequence space of a device (PROTOCOL.md "Incarnations")."""

    incarnation: str | None = Field(
        description="the agent outbox's id; null: the legacy space of an older agent"
    )
    started_at: datetime | None = Field(description="when the controller first heard of it (null: legacy)")
    stored: int
    duplicates: int
    lost: int
    dropped: int
    acked_upto: int
    max_seq: int


class DeviceStats(BaseModel):
    stored: int = Field(description="detection batches and events stored (every incarnation)")
    duplicates: int = Field(description="messages received again after they were stored (dropped)")
    lost: int = Field(
        description="seqs below the highest seen that are neither stored nor declared dropped, summed over "
        "the device's incarnations (each counts its own)"
    )
    dropped: int = Field(description="seqs the agent declared dropped from its full outbox")
    acked_upto: int = Field(
        description="every seq up to this one is stored or declared dropped (the current incarnation)"
    )
    max_seq: int = Field(description="the highest seq stored or declared dropped (the current incarnation)")
    incarnations: list[IncarnationStats] = Field(
        default_factory=list,
        description="per sequence space the device has sent in, oldest first: the 10 newest at most "
        "(the figures above count every one)",
    )
    incarnation_count: int = Field(
        default=0, description="how many sequence spaces the device has, listed or not"
    )


VariantChoice = Literal["auto", "fp32", "fp16", "int8"]


class CameraAssignment(BaseModel):
    model: str
    version: str
    variant: str = Field(description="the variant this device is sent: fp32, fp16 or int8")
    pin: str = Field(default="auto", description="auto, or the variant the assignment pinned")
    sha256: str | None = None
    reason: str = Field(default="", description="why this variant was chosen")
    source: str = Field(default="direct", description="the layer that won: direct, deployment or pool")
    deployment: str | None = Field(default=None, description="the deployment that won, if one did")
    pool: str | None = Field(
        default=None,
        description="the camera pool whose plan placed this camera here (its source comes from it)",
    )


class AgentFailure(BaseModel):
    """An agent update that did not take: the version tried, how it ended, and why."""

    version: str = Field(description="the agent version the device tried")
    state: str = Field(description="failed (refused or could not install) or rolled_back")
    error: str | None = Field(default=None, description="the agent's reason")
    at: datetime | None = Field(
        default=None, description="when the controller recorded it; null while the agent still reports it"
    )


class DeviceAgent(BaseModel):
    """The agent software of a device: what it runs (its reported state) and what it should run."""

    version: str | None = Field(default=None, description="the agent version running now, as reported")
    slot: str | None = Field(default=None, description="the A/B slot it runs from (base or a version)")
    state: str | None = Field(
        default=None,
        description="update state: idle, fetching, verifying, installing, restarting, failed, rolled_back",
    )
    target: str | None = Field(default=None, description="the version the agent is updating to, if any")
    progress_pct: float | None = None
    error: str | None = Field(default=None, description="why the last update failed or was rolled back")
    previous: str | None = Field(default=None, description="the version rolled back to / from")
    desired: str | None = Field(default=None, description="the agent version its desired state names")
    desired_source: str | None = Field(
        default=None, description="which layer set it: direct, deployment, or rollback (a failed rollout)"
    )
    deployment: str | None = Field(default=None, description="the agent deployment that set it, if one did")
    fallback: str | None = Field(
        default=None,
        description="the version a failed agent rollout sends this device back to: the latest it ran "
        "before, never one it refused or rolled back",
    )
    last_failure: AgentFailure | None = Field(
        default=None,
        description="the last update that failed or was rolled back, kept after the desired version moves on",
    )


class DevicePublic(BaseModel):
    id: str
    name: str | None
    labels: dict[str, str]
    enrolled: bool
    status: Literal["online", "offline", "decommissioned"]
    online_since: datetime | None
    offline_since: datetime | None
    last_seen: datetime | None
    agent_version: str | None
    capabilities: dict[str, Any] | None
    cameras: list[CameraStats] = Field(
        description="per camera, from the last heartbeat: FPS and the model's inference latency, median "
        "(inference_ms) and p99 (inference_p99_ms; null from agents that do not report it), both over the "
        "model running now only"
    )
    models: dict[str, CameraReported] = Field(description="what each camera runs, from the reported state")
    assignments: dict[str, CameraAssignment] = Field(
        default_factory=dict,
        description="per camera: the model version assigned, the variant chosen for this device and why",
    )
    last_health: dict[str, Any] | None
    desired_version: int
    reported_version: int | None
    sync: SyncState = Field(description="does the device run its desired state (twin comparison)")
    sync_reason: str | None = Field(default=None, description="why it is not in sync")
    stats: DeviceStats
    agent: DeviceAgent | None = Field(
        default=None, description="the agent software: running version, update state, desired version"
    )
    incarnation: str | None = Field(
        default=None,
        description="the incarnation (outbox id) the device sends in now; null: none seen, or only the "
        "legacy space of an agent older than incarnations",
    )
    incarnation_started_at: datetime | None = Field(
        default=None, description="when the current incarnation was first heard of (a reset, a reflash)"
    )
    decommissioned_at: datetime | None = Field(
        default=None, description="when the device was decommissioned (status decommissioned)"
    )
    clock_offset_s: float | None = Field(
        default=None,
        description="device clock minus controller clock, estimated from its recent heartbeats (the one that "
        "travelled fastest); null: no heartbeat yet, or in the device list",
    )
    clock_off: bool = Field(
        default=False, description="the estimated offset is beyond the controller's clock_off_threshold_s"
    )
    created_at: datetime


class EnrolledDevice(DevicePublic):
    """The enrollment answer: the device, and the key its agent must trust for artifacts."""

    artifact_public_key: str = Field(
        description="the controller's Ed25519 artifact key, base64 of 32 raw bytes: set it as the agent's "
        "artifact_public_key (or EDGEFLEET_ARTIFACT_PUBLIC_KEY)"
    )
    artifact_key_id: str = Field(description="first 16 hex digits of the sha256 of the public key")
    mqtt_username: str | None = Field(
        default=None,
        description="the device's own broker user (= its id); null when the controller does not manage "
        "broker credentials (EDGEFLEET_MQTT_BROKER_AUTH=none)",
    )
    mqtt_password: str | None = Field(
        default=None,
        description="the device's broker password, shown in this answer only (the controller keeps a hash); "
        "enrolling again issues a new one and disconnects the old",
    )


class RevokedDevice(BaseModel):
    """The answer to revoking a device's broker credentials."""

    id: str
    mqtt_username: str
    revoked_at: datetime


class ArtifactKey(BaseModel):
    public_key: str = Field(description="Ed25519 public key, base64 of its 32 raw bytes")
    key_id: str = Field(description="first 16 hex digits of the sha256 of the raw public key")
    algorithm: Literal["ed25519"] = "ed25519"


class BoxOut(BaseModel):
    x0: float
    y0: float
    x1: float
    y1: float


class DetectionOut(BaseModel):
    device: str
    camera: str
    seq: int
    frame: int
    captured_at: datetime
    stored_at: datetime
    model: str
    label: str
    class_id: int
    score: float
    box: BoxOut
    track_id: int | None = Field(
        default=None,
        description="the camera's track this detection belongs to (its device's tracking; null before the "
        "track is confirmed and from agents without tracking)",
    )
    superseded: bool = Field(
        default=False,
        description="this device analysed the camera after a camera pool moved it to another device "
        "(partitioned, or handing over): kept, but not counted in the detection stats by default",
    )


class DetectionPage(BaseModel):
    items: list[DetectionOut]
    next_cursor: str | None = Field(description="pass as ?cursor= for the next (older) page; null at the end")


LABEL_THRESHOLDS_HELP = (
    "per label, the score a detection of it needs instead of threshold (lower or higher); null: none"
)
ZONES_HELP = (
    "polygons of normalised [x, y] points (0-1, y down; at most 16 zones of 3-32 points) with an id, "
    "optional labels and anchor (bottom_center by default); tracks entering and leaving them are counted"
)
LINES_HELP = (
    "counting lines a to b (normalised; at most 16); crossing from the left of a->b to its right as seen on "
    "the image is 'in', the other way 'out'"
)
MOTION_HELP = (
    "the camera's motion gate: the detector runs only on frames where the scene moved, and on a full "
    "frame at least every full_frame_every_s; null: the agent's setting (off unless its config turns it on)"
)
MIN_BOX_AREA_HELP = (
    "the smallest box kept, as a fraction of the frame's area (0.001: 0.1 %, about 46x46 px at 1920x1080); "
    "null: no minimum"
)


class AssignModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Name = Field(description="registered model name")
    version: Name = Field(description="registered model version")
    threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    max_fps: float | None = Field(default=None, gt=0.0)
    labels: LabelList | None = Field(default=None, description="keep only these labels; null keeps all")
    label_thresholds: LabelThresholds | None = Field(default=None, description=LABEL_THRESHOLDS_HELP)
    min_box_area: BoxAreaFraction | None = Field(default=None, description=MIN_BOX_AREA_HELP)
    zones: Zones | None = Field(default=None, description=ZONES_HELP)
    lines: CountLines | None = Field(default=None, description=LINES_HELP)
    motion: MotionSettings | None = Field(default=None, description=MOTION_HELP)
    variant: VariantChoice = Field(
        default="auto",
        description="auto: chosen from the device's capabilities; or pin fp32, fp16 or int8 (must be fit)",
    )


class IngestTotals(BaseModel):
    """The fleet's ingest figures, from the database: the same whichever replica answers."""

    devices: int = Field(
        description="devices that have sent detections or events (or a birth naming an incarnation)"
    )
    incarnations: int = Field(description="sequence spaces: one per device incarnation, legacy ones included")
    stored: int = Field(description="detection batches and events stored")
    duplicates: int = Field(description="messages received again after they were stored (dropped)")
    dropped: int = Field(description="seqs the agents declared dropped from their full outboxes")
    lost: int = Field(
        description="seqs below an incarnation's highest, neither stored nor declared dropped (summed)"
    )
    acked: int = Field(description="the sum over incarnations of the seq up to which everything is acked")


class IngestStats(BaseModel):
    counters: dict[str, dict[str, int]] = Field(
        description="topic kind → outcome → count, as seen by the controller process that answers (one "
        "replica's share when there are several; the fleet's figures are in ``fleet``)"
    )
    queue_depth: int
    queue_max: int
    status_queue_depth: int
    mqtt_connected: bool
    fleet: IngestTotals
    over_budget: dict[str, int] = Field(
        default_factory=dict,
        description="device → messages dropped before decoding because the device was over its "
        "per-device budget, since this process started (the 100 devices with the most)",
    )


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    db: bool
    mqtt: bool
    mqtt_error: str | None = Field(
        default=None, description="why the broker link is down or partial (TLS, refused, ACL), if known"
    )
    replica: str = Field(description="this controller replica's id (EDGEFLEET_REPLICA_ID or host-random)")
    leader: bool = Field(
        description="whether this replica does the fleet's run-once work (always true for one process)"
    )
    epoch: int | None = Field(
        default=None, description="the leadership epoch this replica holds, while it leads among replicas"
    )


# --------------------------------------------------------------------------- deployments / rollouts


class LabelsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    labels: dict[str, str]

    @field_validator("labels")
    @classmethod
    def _valid(cls, v: dict[str, str]) -> dict[str, str]:
        return check_labels(v)


class DeploymentCamera(BaseModel):
    model_config = ConfigDict(extra="forbid")
    camera: str = Field(
        default="*", pattern=CAMERA_OR_ANY_PATTERN, description='camera id, or "*" for every camera'
    )
    threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    max_fps: float | None = Field(default=None, gt=0.0)
    labels: LabelList | None = None
    label_thresholds: LabelThresholds | None = Field(default=None, description=LABEL_THRESHOLDS_HELP)
    min_box_area: BoxAreaFraction | None = Field(default=None, description=MIN_BOX_AREA_HELP)
    zones: Zones | None = Field(default=None, description=ZONES_HELP)
    lines: CountLines | None = Field(default=None, description=LINES_HELP)
    motion: MotionSettings | None = Field(default=None, description=MOTION_HELP)


class DeploymentCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(default=None, max_length=ID_MAX, pattern=ID_PATTERN)
    # Names as the registry has them: no path separators or NUL (they reach queries and file paths).
    model: Name = Field(description="registered model name")
    version: Name = Field(description="registered model version")
    variant: VariantChoice = "auto"
    selector: str = Field(
        default="", max_length=2000, pattern=NO_NUL_PATTERN, description="label selector; empty matches all"
    )
    cameras: list[DeploymentCamera] = Field(default_factory=lambda: [DeploymentCamera()])
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)
    waves: list[int | str] | None = Field(default=None, description="default [1, '10%', '50%', '100%']")
    gate: GateConfig | None = None


class AgentDeploymentCreate(BaseModel):
    """An agent version for the devices a selector matches, rolled out in waves with health gates."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(default=None, max_length=ID_MAX, pattern=ID_PATTERN)
    version: Name = Field(description="an uploaded agent version")
    selector: str = Field(
        default="", max_length=2000, pattern=NO_NUL_PATTERN, description="label selector; empty matches all"
    )
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)
    waves: list[int | str] | None = Field(default=None, description="default [1, '10%', '50%', '100%']")
    gate: GateConfig | None = Field(
        default=None,
        description="soak_s, max_failure_ratio, step_timeout_s (fetch + install), offline_timeout_s apply; "
        "the FPS, latency and watchdog bounds are a model's",
    )
    health_timeout_s: float = Field(
        default=120.0,
        gt=0.0,
        le=3600.0,
        description="how long the new agent has to report healthy after its restart before it is rolled back",
    )


class DeviceAgentAssign(BaseModel):
    """The agent version one device runs, below every agent deployment (null clears it)."""

    model_config = ConfigDict(extra="forbid")
    version: Name | None = Field(description="an uploaded agent version; null removes the direct version")
    health_timeout_s: float = Field(default=120.0, gt=0.0, le=3600.0)


class RolloutDevicePublic(BaseModel):
    device_id: str
    wave: int = Field(description="1-based")
    state: str
    cameras: list[str]
    target_version: int | None
    reported_version: int | None
    progress_pct: float | None = Field(description="artifact transfer progress while applying")
    baseline_fps: float | None
    baseline_latency_ms: float | None = Field(
        description="inference latency before the rollout: p99 where the agent reports it, else the median"
    )
    admitted_at: datetime | None
    settled_at: datetime | None
    reason: str | None
    agent_version: str | None = Field(
        default=None, description="an agent rollout: the agent version the device reports running"
    )
    agent_state: str | None = Field(
        default=None, description="an agent rollout: the device's agent update state (idle, fetching, …)"
    )


class RolloutCameraPublic(BaseModel):
    """A pool camera admitted to a rollout: the unit of its waves, wherever the camera runs."""

    pool: str
    camera: str
    device_id: str | None = Field(description="the device that analyses it now; null while none does")
    wave: int = Field(description="1-based")
    state: str
    target_version: int | None = Field(description="the device's desired version that gave it the new model")
    reported_version: int | None
    soak_restarts: int = Field(description="how often a move started its judgement again on another device")
    baseline_fps: float | None
    baseline_latency_ms: float | None
    admitted_at: datetime | None = Field(description="on its current device")
    settled_at: datetime | None
    reason: str | None


class RolloutPublic(BaseModel):
    id: int
    deployment: str
    deployment_id: int
    state: str
    waves: list[int | str]
    plan: list[int] = Field(description="cumulative device count per wave")
    current_wave: int = Field(description="1-based")
    gate: GateConfig
    gates: list[dict[str, Any]] = Field(description="each evaluated wave gate with figures and verdict")
    reason: str | None
    progress: dict[str, int]
    devices: list[RolloutDevicePublic]
    cameras: list[RolloutCameraPublic] = Field(
        default_factory=list, description="pool cameras the deployment names, each a member of its own"
    )
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


class DeploymentPublic(BaseModel):
    id: int
    name: str
    kind: Literal["model", "agent"] = Field(default="model", description="what it deploys")
    model: str = Field(description="the model (empty for an agent deployment)")
    version: str = Field(description="the model version (empty for an agent deployment)")
    agent_version: str | None = Field(default=None, description="the agent version an agent deployment runs")
    variant: str
    selector: str
    cameras: list[dict[str, Any]]
    priority: int
    state: str
    created_at: datetime
    rollout: RolloutPublic | None


# --------------------------------------------------------------------------- API tokens

TokenRole = Literal["viewer", "operator", "release", "admin"]


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9 _.@-]*$", description="who uses it"
    )
    role: TokenRole = Field(
        description="viewer (read only), operator (change the fleet), release (ship agent software) or admin"
    )


class TokenPublic(BaseModel):
    """A token as listed: never the token itself, only its first characters."""

    id: int
    name: str
    role: TokenRole
    prefix: str = Field(description="the token's first characters, to tell tokens apart")
    created_at: datetime
    last_used_at: datetime | None = Field(description="to the minute")
    revoked_at: datetime | None


class TokenCreated(TokenPublic):
    token: str = Field(description="the bearer token: shown in this answer only, keep it now")


# --------------------------------------------------------------------------- pools


class PoolCameraPublic(BaseModel):
    id: str
    source: str = Field(description="as declared: never a password, at most a {secret:NAME} reference")
    model: str
    version: str
    target_fps: float
    min_fps: float
    priority: int
    spread_group: str | None
    prefer: str | None
    pin: str | None = Field(description="the device an operator moved it to (only that device), if any")


class PoolLoad(BaseModel):
    """A device's load in a plan: inference-lane and CPU time a second, against headroom x capacity."""

    lane_ms_per_s: float
    lane_limit: float
    cpu_ms_per_s: float
    cpu_limit: float
    cameras: int
    util: float | None = Field(description="the larger share of the two limits (1.0: at headroom)")


class PoolDevicePublic(BaseModel):
    id: str
    online: bool
    status: Literal["online", "offline", "decommissioned"]
    in_grace: bool = Field(
        description="offline for less than failover_grace_s: keeps its cameras, takes no new"
    )
    cordoned: bool = Field(description="takes no new camera (draining implies it)")
    draining: bool = Field(description="its cameras are planned elsewhere")
    cameras: int = Field(description="cameras placed on it in the stored plan")
    load: PoolLoad | None = Field(description="in a plan made now; null when it cannot take cameras")


class PoolPlacementPublic(BaseModel):
    device: str
    fps: float
    since: datetime = Field(description="when the camera was placed on this device")
    handover_from: str | None = Field(
        default=None,
        description="make-before-break: the device the camera left, which runs it until this one reports "
        "it running",
    )
    canary: str | None = Field(
        default=None, description="the model/version a rollout wants for it, admitted here (its cost fits)"
    )
    canary_held: str | None = Field(
        default=None, description="why the plan did not admit the version a rollout wants for it here"
    )


class PoolMove(BaseModel):
    camera: str
    source: str = Field(description="the device it leaves")
    target: str = Field(description="the device it goes to")
    fps: float
    reason: str = Field(
        description="device_offline, device_gone, cordoned, unreachable, unfit, overload (failures, never "
        "held back), failback or manual"
    )


class PoolHeld(PoolMove):
    why: str = Field(description="what holds the move back: the rate limit, no room, the target unusable")


class PoolDegraded(BaseModel):
    fps: float
    target_fps: float
    reason: str


class PoolMoveEvent(PoolMove):
    ts: datetime


class PoolSummaryPublic(BaseModel):
    name: str
    selector: str
    strategy: str
    cameras: int
    placed: int = Field(description="cameras with a placement in the stored plan")
    devices: int = Field(description="enrolled devices the selector matches")
    updated_at: datetime


class PoolPublic(BaseModel):
    """A pool: its declaration, its devices, where its cameras run (the stored plan) and what a plan
    made now says about it."""

    name: str
    selector: str
    strategy: str
    headroom: float
    reserve_n1: bool
    failover_grace_s: float
    failback: str
    max_moves_per_min: int
    min_dwell_s: float
    cameras: list[PoolCameraPublic]
    devices: list[PoolDevicePublic]
    placements: dict[str, PoolPlacementPublic] = Field(description="camera -> where it runs (stored plan)")
    unplaced: dict[str, str] = Field(description="camera -> why no device can take it now")
    degraded: dict[str, PoolDegraded] = Field(description="camera -> running below its target FPS, and why")
    pending: list[PoolMove] = Field(
        description="what the next replan would move (a device went offline since the last one)"
    )
    held: list[PoolHeld] = Field(description="moves asked for (pins, failback) that cannot be made now")
    n_plus_one: bool = Field(description="any one device's cameras fit in the room left on the others")
    canary_held: dict[str, str] = Field(
        default_factory=dict,
        description="camera -> why the version a rollout wants for it is not admitted where it runs, now",
    )
    recent_moves: list[PoolMoveEvent] = Field(description="the newest camera_moved events, newest first")
    created_at: datetime
    updated_at: datetime


class PoolPlanRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fail: list[DeviceId] = Field(
        default_factory=list, max_length=MAX_FAIL, description="devices of the pool to take as offline"
    )


class PoolPlan(BaseModel):
    """A dry run: the plan with the ``fail`` devices taken as offline. Nothing is stored."""

    pool: str
    fail: list[str]
    moves: list[PoolMove]
    held: list[PoolHeld]
    unplaced: dict[str, str]
    degraded: dict[str, PoolDegraded]
    loads: dict[str, PoolLoad] = Field(description="every device that could take cameras in this plan")
    n_plus_one: bool
    placements: dict[str, PoolPlacementPublic]
    canary_held: dict[str, str] = Field(
        default_factory=dict, description="camera -> why the version a rollout wants for it is not admitted"
    )


class PoolMoveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: DeviceId = Field(description="the device of the pool to run the camera on")
