"""Agent configuration: a validated model loaded from YAML that rejects unknown keys.

Secrets: the MQTT password may sit in the URL or in ``mqtt_password_file`` (which wins over the URL);
``EDGEFLEET_MQTT_PASSWORD`` in the environment overrides both, so production configs can leave it out
of files. The credentials of pool cameras are files in ``secrets_dir``, read when a camera names one.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from fleet_protocol.endpoint import MqttEndpoint, check_tls_files
from fleet_protocol.ids import CameraId
from fleet_protocol.messages import MAX_CAMERAS, MotionSettings
from fleet_protocol.signing import SignatureError, load_public_key
from fleet_protocol.topics import DEFAULT_PREFIX, valid_device_id

PASSWORD_ENV = "EDGEFLEET_MQTT_PASSWORD"
PUBLIC_KEY_ENV = "EDGEFLEET_ARTIFACT_PUBLIC_KEY"


class SettingsError(Exception):
    """The configuration cannot be used; the message names the offending fields."""


def check_private_file(path: Path, setting: str, holds: str = "the device's broker password") -> None:
    """A secret file must be the owner's alone (mode 0600 or 0400): refuse one group or others may
    access (ValueError naming the fix), as the signing key and admin token are refused on the
    controller. ``holds``: what the file holds, for the message."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return  # reading it says why, with the path
    if mode & 0o077:
        raise ValueError(
            f"{setting} {path} is accessible by group or others (mode {mode:04o}); it holds "
            f"{holds}: run `chmod 600 {path}` (Kubernetes: defaultMode 0400; compose secrets keep "
            "the host file's mode)"
        )


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CameraConfig(_Strict):
    id: CameraId
    source: str = Field(min_length=1)
    """A file path, ``rtsp://``, ``http(s)://`` (MJPEG), or a digit string (USB index)."""
    loop: bool = False
    realtime: bool = True
    """Files only: True paces them at their own FPS like a live camera; False reads recorded footage as
    fast as the pipeline takes frames (no frame dropped), for batch processing and benchmarks."""
    max_fps: float | None = Field(default=None, gt=0.0)
    reconnect_min_s: float = Field(default=0.5, gt=0.0)
    reconnect_max_s: float = Field(default=30.0, gt=0.0)
    decode: Literal["software", "auto", "hardware"] = "software"
    """Video decoding. ``software``: OpenCV's own (FFmpeg in the PyPI wheels), on the CPU. ``auto``: NVIDIA
    hardware decode (NVDEC) through an OpenCV GStreamer pipeline where this device can do it (OpenCV
    built with GStreamer, and the decoder element installed: ``nvh264dec``/``nvh265dec`` on a dGPU,
    ``nvv4l2decoder`` on a Jetson), else software decode, the reason reported once in the camera_up
    event. ``hardware``: hardware decode or the camera stays down with the reason (retried with the
    usual backoff). Hardware decode takes ``rtsp://`` sources and files (mp4/mov, mkv/webm, ts, avi)."""
    codec: Literal["h264", "h265"] = "h264"
    """The stream's codec, for the hardware decode pipeline (which names its depayloader, parser and
    decoder up front); software decode finds it by itself."""
    rtsp_transport: Literal["tcp", "udp"] | None = None
    """How an ``rtsp://`` stream's packets travel: ``tcp`` (interleaved in the RTSP connection: through
    NAT and firewalls, no loss) or ``udp`` (RTP datagrams: lower latency on a clean network, a lost
    packet is a damaged frame). Unset: OpenCV's default, TCP when the camera offers it, else UDP.
    ``rtsps://`` streams take TCP only."""
    open_timeout_s: float = Field(default=10.0, gt=0.0, le=300.0)
    """Network sources (RTSP, HTTP): how long opening may take before the attempt fails (the camera
    goes down and is retried with the backoff)."""
    read_timeout_s: float = Field(default=10.0, gt=0.0, le=300.0)
    """Network sources: how long a read may wait for a frame before the stream counts as lost; what
    notices a camera that stops sending without closing the connection (UDP, a dead link)."""
    motion: MotionSettings = Field(default_factory=MotionSettings)
    """Motion-gated inference (edge_agent/vision/motion.py): the detector runs only on frames where
    something moved, and on a full frame every ``full_frame_every_s``; ``enabled``, ``threshold``
    (grey levels), ``min_area`` (fraction of the frame), ``full_frame_every_s``. Off unless set: a gated
    camera on a quiet scene infers a fraction of its frames, and the heartbeat's ``fps`` (the inferred
    rate) that rollout gates judge against a baseline would read as a slow model. A desired state's
    ``motion`` replaces this whole."""

    @property
    def is_file(self) -> bool:
        return "://" not in self.source and not self.source.isdigit()

    @property
    def is_rtsp(self) -> bool:
        return self.source.lower().startswith(("rtsp://", "rtsps://"))

    @model_validator(mode="after")
    def _backoff_order(self) -> CameraConfig:
        if self.reconnect_max_s < self.reconnect_min_s:
            raise ValueError("reconnect_max_s must be >= reconnect_min_s")
        return self

    @model_validator(mode="after")
    def _rtsp_transport_source(self) -> CameraConfig:
        if self.rtsp_transport is None:
            return self
        if not self.is_rtsp:
            raise ValueError("rtsp_transport applies to rtsp:// and rtsps:// sources only")
        if self.rtsp_transport == "udp" and self.source.lower().startswith("rtsps://"):
            raise ValueError("rtsps:// streams over TCP only: use rtsp_transport: tcp or leave it unset")
        return self

    @model_validator(mode="after")
    def _hardware_decode_source(self) -> CameraConfig:
        if self.decode == "hardware" and not (self.is_rtsp or self.is_file):
            raise ValueError(
                "decode: hardware takes an rtsp:// source or a file; use auto or software for USB and "
                "http(s) cameras"
            )
        return self


class InferenceConfig(_Strict):
    threads: int = Field(default=2, ge=1, le=256)
    """onnxruntime intra-op threads of each session run."""
    workers: int = Field(default=1, ge=1, le=16)
    """Inference threads, each running its share of the cameras (camera i: worker i mod workers, so a
    camera's frames stay in order). On a CPU-only device with several cameras, ``workers: 2`` with
    ``threads: 1`` ran 1.2x the frames of one worker with two threads on 2 cores (BENCHMARKS.md): one
    thread per run has no per-operator barrier for capture and publishing to stall. Backends that
    cannot take concurrent runs (GPU with IOBinding, TensorRT) run one batch at a time whatever this."""
    providers: list[str] = Field(
        default_factory=lambda: [
            "TensorrtExecutionProvider",
            "CUDAExecutionProvider",
            "CPUExecutionProvider",
        ],
        min_length=1,
    )
    max_batch: int = Field(default=4, ge=1, le=64)
    spin: bool = False
    """onnxruntime intra-op thread spinning: a little faster alone, slower when capture and publishing
    share the cores (see BENCHMARKS.md)."""
    trt_cache_dir: Path | None = None
    """TensorRT engine cache; default ``<data_dir>/trt_cache`` (native engines in ``engines/``,
    onnxruntime's TensorRT EP engines in ``ort/``)."""
    engine: Literal["auto", "onnxruntime", "tensorrt"] = "auto"
    """``auto``: a native TensorRT engine where the ``tensorrt`` package and a GPU are usable, else
    onnxruntime; ``tensorrt``: the same, but a device without TensorRT reports it on every model;
    ``onnxruntime``: never native TensorRT (onnxruntime's TensorRT EP may still be in ``providers``)."""
    trt_precision: Literal["auto", "fp32", "fp16", "int8"] = "auto"
    """Native engine precision; ``auto`` follows the variant (fp32 -> FP32, fp16 -> FP16, int8 ->
    INT8). INT8 from a non-quantized variant is calibrated on frames from the camera."""
    trt_build_timeout_s: float = Field(default=1200.0, gt=0.0)
    """Time bound of one TensorRT engine build (its own process); a build past it is stopped and the
    model runs on onnxruntime without TensorRT instead."""
    trt_cache_max_mb: int = Field(default=4096, ge=16)
    """Bound on native engines kept; the least recently used go first."""
    trt_workspace_mb: int = Field(default=1024, ge=16)
    trt_calibration_frames: int = Field(default=32, ge=1, le=1024)
    hang_timeout_s: float = Field(default=30.0, gt=0.0)
    """Watchdog: an inference call that has not returned after this long is a hang; the stuck call
    is abandoned, the model reloaded and inference restarted (reported as a ``watchdog_restart``)."""
    max_restarts: int = Field(default=3, ge=1)
    restart_window_s: float = Field(default=600.0, gt=0.0)
    """At most ``max_restarts`` watchdog restarts in this window; past that the pipeline is marked
    failed (reported, cameras ``failed``) and retried after a backoff instead of restarting in a loop."""
    restart_backoff_min_s: float = Field(default=10.0, gt=0.0)
    restart_backoff_max_s: float = Field(default=600.0, gt=0.0)
    """The wait before retrying a failed pipeline: min, doubling with each failure, capped at max."""

    @model_validator(mode="after")
    def _restart_backoff_order(self) -> InferenceConfig:
        if self.restart_backoff_max_s < self.restart_backoff_min_s:
            raise ValueError("restart_backoff_max_s must be >= restart_backoff_min_s")
        return self


class OutboxConfig(_Strict):
    max_messages: int = Field(default=100_000, ge=10)
    ack_timeout_s: float = Field(default=10.0, gt=0.0)
    resend_batch: int = Field(default=100, ge=1)
    batch_max_frames: int = Field(default=10, ge=1, le=500)
    batch_max_delay_s: float = Field(default=0.5, gt=0.0)
    held_max: int = Field(default=1000, ge=1)
    """Messages (detection batches, events) held in memory while the disk refuses the outbox's writes
    (full, read-only); beyond, the oldest is dropped, counted and reported once the disk takes writes."""


class ArtifactConfig(_Strict):
    window: int = Field(default=8, ge=1, le=64)
    """The most chunks asked for and not yet arrived: ``window``, or more when chunks are small, up to
    ``window_bytes`` (and 64). Within it the fetcher keeps what the link delivers in half a second, or
    twice its bandwidth-delay product on a far link, as measured during the transfer
    (edge_agent/uplink/artifacts.py ``_Pace``); it asks for the whole of it before the first chunk arrives."""
    window_bytes: int = Field(default=8 * 2**20, ge=64 * 1024, le=256 * 2**20)
    request_timeout_s: float = Field(default=5.0, gt=0.0)
    """Chunks asked for are asked again when nothing at all has arrived for this long (or for four
    chunks' time at the measured rate, when that is longer): while chunks keep arriving the others are
    queued on the link, not lost."""
    max_retries: int = Field(default=6, ge=0)
    unused_grace_s: float = Field(default=86_400.0, ge=0.0)
    """A verified model (or agent package) that is neither desired, nor running, nor the one the last
    swap replaced (what a rollback goes back to) is deleted from the agent's store once it has been
    unneeded this long; at once when a download needs the disk room."""
    partial_grace_s: float = Field(default=86_400.0, ge=0.0)
    """A partial download (``.part`` and ``.bitmap``) that nothing fetches any more and no desired state
    names is deleted once it was last written this long ago; at once when a download needs the room.
    Until then asking for it again resumes it."""
    collect_interval_s: float = Field(default=600.0, gt=0.0)
    """How often the stores of models and agent packages are looked over for what may be deleted."""


class UpdateConfig(_Strict):
    """Agent self-update (edge_agent/update/self_update.py; the package comes over the artifact channel with
    the ``artifacts`` settings)."""

    install_timeout_s: float = Field(default=600.0, gt=0.0, le=7200.0)
    """How long ``pip install`` of a new version into its slot may take before it is refused."""
    retry_min_s: float = Field(default=10.0, gt=0.0)
    """A package that did not arrive (the controller did not answer) is asked again after this long,
    doubling up to ``retry_max_s``; a package refused (signature, sha256, pins) is never retried."""
    retry_max_s: float = Field(default=300.0, gt=0.0)


class LocalPageConfig(_Strict):
    """The agent's local status page and API (edge_agent/local/), for a technician on site with no
    controller and no internet.

    On by default, bound to 127.0.0.1: it is then already running when the uplink fails, which is when
    it is needed and when the configuration can no longer be changed from afar (and restarting the agent
    to turn it on may clear the very state to look at), while nothing off the device can reach it (an
    SSH tunnel can). Serving the site's LAN, for a phone, is a choice made at provisioning:
    ``bind: 0.0.0.0``. Every API call needs the device-local token either way.
    """

    enabled: bool = True
    bind: str = Field(default="127.0.0.1", min_length=1)
    """The address it listens on: 127.0.0.1 (this device only), 0.0.0.0 (every interface: the LAN)."""
    port: int = Field(default=8090, ge=1, le=65535)
    token_file: Path | None = None
    """A file holding the token (mode 0600 or 0400), e.g. written at provisioning; None:
    ``<data_dir>/local_page.token``, generated at the first start (its path is logged, not the token)."""
    max_clients: int = Field(default=8, ge=1, le=64)
    """Requests served at once; one more is refused with 503, so a busy page never takes more threads."""


class TrackingConfig(_Strict):
    """Tracking per camera (edge_agent/vision/tracking.py; PROTOCOL.md "Tracks")."""

    enabled: bool = True
    confirm_frames: int = Field(default=3, ge=1, le=100)
    """A track is confirmed, and its ``track_started`` sent and its id put on its detections, once it
    was matched in this many inferred frames in a row: a detector that flickers for a frame or two
    makes no event."""
    lost_after_s: float = Field(default=2.0, gt=0.0, le=3600.0)
    """A confirmed track not matched for this long (on the camera's capture clock) ends with
    ``track_ended``; until then it coasts and an object seen again within it keeps its id (an
    occlusion, a missed frame), as does a new track that continues it from near where it was lost."""
    match_iou: float = Field(default=0.1, gt=0.0, le=1.0)
    """The least overlap (IoU) of a detection with a track's predicted box for the two to match."""
    events_per_minute: int = Field(default=600, ge=1, le=60_000)
    """Per camera, at most this many track events a minute (the budget refills continuously); a track
    whose start is over it is tracked but neither its start nor its end is sent (logged, counted)."""


class AgentSettings(_Strict):
    device_id: str
    mqtt_url: MqttEndpoint = Field(default_factory=lambda: MqttEndpoint(host="127.0.0.1"))
    """``mqtt[s]://[user[:password]@]host[:port]`` (fleet_protocol/endpoint.py), with the credential and
    TLS keys below folded in."""
    mqtt_username: str | None = Field(default=None, min_length=1)
    """The device's broker user (from enrollment: its device id); overrides a user in ``mqtt_url``."""
    mqtt_password_file: Path | None = None
    """A file holding the broker password (from enrollment), read at start; trailing newline ignored.
    ``EDGEFLEET_MQTT_PASSWORD`` overrides it."""
    mqtt_ca_file: Path | None = None
    """PEM CA the broker's certificate must chain to (instead of the system's); implies TLS."""
    mqtt_cert_file: Path | None = None
    """Client certificate (PEM) for brokers that require one; with ``mqtt_key_file``."""
    mqtt_key_file: Path | None = None
    mqtt_reconnect_min_s: float = Field(default=1.0, ge=1.0)
    mqtt_reconnect_max_s: float = Field(default=30.0, ge=1.0)
    mqtt_keepalive_s: int = Field(default=15, ge=2, le=3600)
    """MQTT keepalive. It bounds how long a half-open link (writes accepted, nothing delivered) goes
    unnoticed: paho sends PINGREQ after this long without traffic from the broker and drops the
    connection (then reconnects) when nothing arrives for another keepalive, so at most ~2x this."""
    topic_prefix: str = DEFAULT_PREFIX
    data_dir: Path
    secrets_dir: Path | None = None
    """The device's own secrets, one file per name (mode 0600 or 0400), that pool cameras name in
    their sources as ``{secret:NAME}``; default ``<data_dir>/secrets``. A file is read when a camera
    needs it, so a secret added later is found within ``pool_retry_s``."""
    pool_retry_s: float = Field(default=30.0, gt=0.0)
    """How soon a pool camera that could not start (a secret missing or unreadable, a source it cannot
    open) is tried again, without waiting for a new desired state."""
    heartbeat_interval_s: float = Field(default=5.0, gt=0.0)
    probe_interval_s: float = Field(default=30.0, gt=0.0)
    """How often the device checks that it reaches the source of each pool camera it could be given
    (the desired state's ``probe``: a TCP connection, or the file existing; no secret is read), and
    reports it in its heartbeat. The first check comes within seconds of a new desired state."""
    # As many as a heartbeat and a reported state may carry: one more would make both undecodable.
    cameras: list[CameraConfig] = Field(default_factory=list, max_length=MAX_CAMERAS)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    outbox: OutboxConfig = Field(default_factory=OutboxConfig)
    artifacts: ArtifactConfig = Field(default_factory=ArtifactConfig)
    update: UpdateConfig = Field(default_factory=UpdateConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    local_page: LocalPageConfig = Field(default_factory=LocalPageConfig)
    artifact_public_key: str | None = None
    """The controller's Ed25519 artifact key (base64 of 32 bytes), from the enrollment answer or
    ``GET /api/v1/keys/artifacts``; ``EDGEFLEET_ARTIFACT_PUBLIC_KEY`` overrides it. With a key, every
    model reference must carry a valid signature by it."""
    require_signed_artifacts: bool = True
    """Without a key: True refuses every model (and says why); False runs unsigned models (development
    only). With a key, signatures are always checked whatever this says."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @field_validator("device_id")
    @classmethod
    def _device_id(cls, v: str) -> str:
        if not valid_device_id(v):
            raise ValueError(
                "must start with a letter or digit and contain only letters, digits, '_', '.', '-' (max 64)"
            )
        return v

    @field_validator("mqtt_url", mode="before")
    @classmethod
    def _parse_url(cls, v: Any) -> Any:
        return MqttEndpoint.parse(v) if isinstance(v, str) else v

    @field_validator("topic_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not v.strip("/") or "+" in v or "#" in v:
            raise ValueError("must be a non-empty topic without wildcards")
        return v

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v

    @field_validator("artifact_public_key")
    @classmethod
    def _public_key(cls, v: str | None) -> str | None:
        if v is None:
            return None
        try:
            load_public_key(v)
        except SignatureError as exc:
            raise ValueError(
                f"{exc}; expected the controller's artifact_public_key (base64 of 32 bytes) from "
                "enrollment or GET /api/v1/keys/artifacts"
            ) from None
        return v.strip()

    @model_validator(mode="after")
    def _mqtt_auth(self) -> AgentSettings:
        """Fold the credential and TLS keys into ``mqtt_url``, the one thing the link reads."""
        endpoint = self.mqtt_url
        username = self.mqtt_username if self.mqtt_username is not None else endpoint.username
        password = endpoint.password
        if self.mqtt_password_file is not None:
            check_private_file(self.mqtt_password_file, "mqtt_password_file")
            try:
                secret = self.mqtt_password_file.read_text(encoding="utf-8").rstrip("\r\n")
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(
                    f"mqtt_password_file {self.mqtt_password_file}: cannot read: {exc}"
                ) from None
            if not secret:
                raise ValueError(f"mqtt_password_file {self.mqtt_password_file} is empty")
            password = SecretStr(secret)
        check_tls_files(self.mqtt_ca_file, self.mqtt_cert_file, self.mqtt_key_file)
        self.mqtt_url = endpoint.with_credentials(username, password).with_tls(
            self.mqtt_ca_file, self.mqtt_cert_file, self.mqtt_key_file
        )
        return self

    @model_validator(mode="after")
    def _unique_cameras(self) -> AgentSettings:
        ids = [c.id for c in self.cameras]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"camera ids must be unique, repeated: {', '.join(dupes)}")
        return self


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "<root>"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{loc}: {msg}")
    return "\n".join(lines)


def parse_settings(data: Any, *, env: dict[str, str] | None = None) -> AgentSettings:
    """Validate an already-parsed mapping; raises :class:`SettingsError` naming the fields."""
    if not isinstance(data, dict):
        raise SettingsError(f"the configuration must be a mapping, got {type(data).__name__}")
    env = dict(os.environ) if env is None else env
    public_key = env.get(PUBLIC_KEY_ENV)
    if public_key:
        # Before validation, so a bad key in the environment is refused like one in the file.
        data = {**data, "artifact_public_key": public_key}
    try:
        settings = AgentSettings.model_validate(data)
    except ValidationError as exc:
        msg = format_validation_error(exc)
        if public_key and "artifact_public_key" in msg:
            msg += f"\n(artifact_public_key came from {PUBLIC_KEY_ENV})"
        raise SettingsError(msg) from None
    password = env.get(PASSWORD_ENV)
    if password:
        settings.mqtt_url = settings.mqtt_url.with_credentials(
            settings.mqtt_url.username, SecretStr(password)
        )
    return settings


def load_settings(path: Path | str) -> AgentSettings:
    """Load and validate a YAML configuration file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SettingsError(f"{path}: not valid YAML: {exc}") from None
    try:
        return parse_settings(data)
    except SettingsError as exc:
        raise SettingsError(f"{path}:\n{exc}") from None
