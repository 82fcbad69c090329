"""Controller configuration: one validated model, read from ``EDGEFLEET_*`` environment variables."""

from __future__ import annotations

import ipaddress
import re
import secrets
import socket
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fleet_protocol import DEFAULT_PREFIX, Topics
from fleet_protocol.endpoint import MqttEndpoint, check_tls_files


def _default_models_dir() -> Path:
    # The repository's models/ beside the package (this file is controller/settings.py).
    return Path(__file__).resolve().parents[1] / "models"


# Address space a build of a bundled model takes, with room for larger models (RELIABILITY.md, "What
# an upload can cost the controller").
VARIANT_BUILD_MEMORY_BYTES = 4 * 1024**3


class ControllerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EDGEFLEET_", extra="forbid")

    data_dir: Path = Path("./data")
    # SecretStr: a PostgreSQL URL usually carries a password and must never land in a log line.
    database_url: SecretStr | None = None
    mqtt_url: SecretStr = SecretStr("mqtt://127.0.0.1:1883")
    # Overrides a password in mqtt_url, so production can keep the URL in config and the secret in env.
    mqtt_password: SecretStr | None = None
    # TLS: a CA (PEM) to trust instead of the system's (implies TLS even with mqtt://), and an optional
    # client certificate + key for brokers that require one.
    mqtt_ca_file: Path | None = None
    mqtt_cert_file: Path | None = None
    mqtt_key_file: Path | None = None
    # Per-device broker credentials (controller/link/broker_auth.py): "dynsec" administers Mosquitto's
    # dynamic-security plugin; "none" leaves the broker alone (a plain dev broker).
    mqtt_broker_auth: Literal["none", "dynsec"] = "none"
    # With mqtt_broker_auth "none": "external" states that the broker enforces the ACL of
    # fleet_protocol/PROTOCOL.md by its own configuration (production refuses "none" without it).
    mqtt_acl: Literal["none", "external"] = "none"
    # The dynsec admin user; default the user and password the controller connects with.
    mqtt_admin_username: str | None = None
    mqtt_admin_password: SecretStr | None = None
    # None: a unique id per process, so a second controller never kicks the first off the broker. With
    # replicas (mqtt_share_group) the replica id is appended to it: one compose file, N client ids.
    mqtt_client_id: str | None = None
    # Replicas: N identical controllers on one PostgreSQL share the devices' messages through this
    # Mosquitto shared-subscription group ($share/<group>/...), one leader among them does the work that
    # must run once (controller/db/leader.py). Unset: one process, as before.
    mqtt_share_group: str | None = None
    # This replica's name (controller_replica, /healthz, the MQTT client id); unset: <host>-<random>.
    # Filled in by validation, so every part of one process reads the same id.
    replica_id: str | None = None
    topic_prefix: str = DEFAULT_PREFIX
    models_dir: Path = Field(default_factory=_default_models_dir)
    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8000, ge=0, le=65535)
    heartbeat_timeout_s: float = Field(default=15.0, gt=0)
    # Twin convergence (controller/fleet/converger.py ResendPolicy): a drifted device gets its desired state
    # again at once, one still on an older version after twin_pending_resend_s; then backoff doubling
    # from twin_resend_backoff_s up to twin_resend_backoff_max_s per device.
    twin_pending_resend_s: float = Field(default=60.0, gt=0)
    twin_resend_backoff_s: float = Field(default=10.0, gt=0)
    twin_resend_backoff_max_s: float = Field(default=600.0, gt=0)
    # The leader replans every camera pool this often (controller/fleet/pools.py PoolReplanner), so an
    # offline device's cameras move once its failover grace is over, not at the next operator change.
    # Short because a quiet round only reads; 0 turns it off (plans then follow operator changes only).
    pool_replan_interval_s: float = Field(default=2.0, ge=0, le=3600, allow_inf_nan=False)
    ingest_queue_max: int = Field(default=10000, ge=1)
    ingest_batch_max: int = Field(default=500, ge=1)
    # Group commit (controller/link/batching.py): the ingest and status writers wait this long after a
    # message for more before committing. Costs at most this much latency per message; saves the fixed
    # per-transaction cost at moderate load (bench/fleet.py).
    commit_linger_s: float = Field(default=0.05, ge=0.0, le=1.0)
    status_queue_max: int = Field(default=10000, ge=1)
    # What one device may send (controller/link/budget.py), checked on receipt before decoding; over
    # it a message is dropped and counted (detections and events are sent again by the agent's outbox).
    # ingest: detections and events; status: births, heartbeats, reported state, command results.
    ingest_device_messages_per_s: float = Field(default=300.0, gt=0)
    ingest_device_message_burst: int = Field(default=3000, ge=1)
    ingest_device_bytes_per_s: float = Field(default=4 * 2**20, gt=0)
    ingest_device_burst_bytes: int = Field(default=16 * 2**20, ge=1024)
    status_device_messages_per_s: float = Field(default=5.0, gt=0)
    status_device_message_burst: int = Field(default=50, ge=1)
    status_device_bytes_per_s: float = Field(default=128 * 1024, gt=0)
    status_device_burst_bytes: int = Field(default=2**20, ge=1024)
    # The most messages of one device waiting in the ingest / status queue; unset: a tenth of the queue.
    ingest_device_queue_max: int | None = Field(default=None, ge=1)
    status_device_queue_max: int | None = Field(default=None, ge=1)
    # New incarnations (seq spaces) a device may start in an hour, each only by a birth naming it.
    device_incarnations_per_hour: int = Field(default=6, ge=1)
    # Gaps a sequence space may hold above its acked point (lost messages not yet sent again); a seq
    # that would open one more is not stored and not acked, so the agent sends it again later.
    # At most the ack's 1,000 ranges.
    ingest_gaps_max: int = Field(default=256, ge=1, le=1000)
    # A device's heartbeats are stored as health history at most this often (its current health is
    # always its last heartbeat): a little under the agent's 5 s interval, so no regular one is skipped.
    health_sample_interval_s: float = Field(default=4.0, ge=0)
    # A device whose clock its heartbeats put further than this from the controller's is flagged
    # (clock_off in the device view): detection timestamps and the gates' windows read the device's clock.
    clock_off_threshold_s: float = Field(default=2.0, gt=0)
    artifact_queue_max: int = Field(default=1000, ge=1)
    artifact_workers: int = Field(default=2, ge=1, le=32)
    chunk_size: int = Field(default=256 * 1024, ge=1024, le=4 * 1024 * 1024)
    # Per device, what the artifact server does for it (controller/link/artifacts.py DeviceCaps): chunk
    # requests a second (and at once), and bytes a second (and at once). A request over the request
    # cap is dropped; chunks over the byte cap wait for it in a line per device (DeviceCaps: up to
    # max_wait_bytes, 16 MiB, and max_delay_s, 120 s) and are dropped beyond that. The agent asks again
    # for what it did not get after its request timeout.
    artifact_device_requests_per_s: float = Field(default=50.0, gt=0)
    artifact_device_request_burst: int = Field(default=100, ge=1)
    artifact_device_bytes_per_s: float = Field(default=256 * 2**20, gt=0)
    artifact_device_burst_bytes: int = Field(default=16 * 2**20, ge=1024)
    # Model registry: uploaded files and built variants, named by sha256 (default data_dir/artifacts).
    store_dir: Path | None = None
    max_upload_bytes: int = Field(default=512 * 1024 * 1024, ge=1024)
    # Dense bytes of all of a model's initializers and constants (sparse ones at their dense size): what
    # agents and the variant builder materialise; over it an upload is refused (413).
    max_model_dense_bytes: int = Field(default=2 * 1024**3, ge=1024)
    # Agent packages are unpacked block by block to disk, never into memory: a file inside the package
    # (or inside its wheel) over the first cap, or a package unpacking to more than the second, is
    # refused (413) before it is inflated.
    max_package_member_bytes: int = Field(default=512 * 1024**2, ge=1024)
    max_package_unpacked_bytes: int = Field(default=1024**3, ge=1024)
    # Variant builds (fp16/int8 with figures) on a background worker.
    build_variants_on_start: bool = True
    # False: uploads are registered without variant builds (fp32 everywhere), e.g. for quick tests.
    build_variants_on_upload: bool = True
    # A variant build (fp32 reference, calibration, fidelity, fp16, int8) runs in a child process whose
    # address space (RLIMIT_AS) is capped at this: a model that needs more fails its build with a reason
    # naming this setting, and the controller's own memory is untouched.
    variant_build_memory_bytes: int = Field(default=VARIANT_BUILD_MEMORY_BYTES, ge=256 * 1024**2)
    calibration_footage: Path | None = None  # default models_dir/footage/vtest.avi
    variant_calib_frames: int = Field(default=100, ge=1, le=10000)
    # Held-out frames: half choose among the INT8 candidates, the other half give the figures shown.
    variant_eval_frames: int = Field(default=40, ge=2, le=10000)
    variant_bar_f1: float = Field(default=0.95, ge=0.0, le=1.0)
    variant_bar_iou: float = Field(default=0.95, ge=0.0, le=1.0)
    # Builds waiting or running across all replicas; a version uploaded over it serves fp32 only.
    variant_queue_max: int = Field(default=64, ge=1)
    # Builds are jobs any replica claims (controller/registry/build_jobs.py): each replica polls every
    # poll_s; a claim not renewed for lease_s (renewed every lease_s/3) is taken over; a job whose
    # claim ended without a result max_attempts times is marked failed.
    variant_build_poll_s: float = Field(default=2.0, gt=0, le=300)
    variant_build_lease_s: float = Field(default=60.0, ge=3, le=3600)
    variant_build_max_attempts: int = Field(default=3, ge=1, le=100)
    # Live view and commands (controller/observe/live.py, controller/link/commands.py).
    live_queue_max: int = Field(default=256, ge=1, le=100_000)
    command_timeout_s: float = Field(default=10.0, gt=0, le=300)
    # Retention (controller/observe/retention.py): days kept; health history is also thinned with age.
    retention_detections_days: float = Field(default=30.0, gt=0)
    retention_events_days: float = Field(default=90.0, gt=0)
    retention_health_days: float = Field(default=30.0, gt=0)
    retention_interval_s: float = Field(default=300.0, gt=0)
    environment: Literal["development", "production"] = "development"
    # The bootstrap admin API token. Unset: made on first start in data_dir/admin.token (mode 0600);
    # production refuses to start without a strong one (controller/security/tokens.py).
    admin_token: SecretStr | None = None
    # The same token read from a file (a mounted secret, mode 0600), instead of admin_token.
    admin_token_file: Path | None = None
    # The artifact signing key (Ed25519 PEM, mode 0600). Unset: data_dir/artifact_signing_key.pem, made
    # on first start; with replicas it must exist already, the same key on every replica.
    signing_key_file: Path | None = None
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: object) -> object:
        return v.upper() if isinstance(v, str) else v

    @field_validator("admin_token")
    @classmethod
    def _blank_token_is_unset(cls, v: SecretStr | None) -> SecretStr | None:
        # EDGEFLEET_ADMIN_TOKEN= (empty) must not become an admin token nobody can present.
        return v if v is not None and v.get_secret_value().strip() else None

    @field_validator("mqtt_share_group", mode="before")
    @classmethod
    def _share_group_ok(cls, v: object) -> object:
        if isinstance(v, str):
            v = v.strip()
            if not v:
                return None  # EDGEFLEET_MQTT_SHARE_GROUP= (empty) means one process
            if not SHARE_GROUP.fullmatch(v):
                raise ValueError(
                    "mqtt_share_group must be 1-64 characters of letters, digits, '.', '_' or '-' "
                    "(it becomes a topic level: $share/<group>/...)"
                )
        return v

    @field_validator("replica_id", mode="before")
    @classmethod
    def _replica_id_ok(cls, v: object) -> object:
        if isinstance(v, str):
            v = v.strip()
            if not v:
                return None
            if not REPLICA_ID.fullmatch(v):
                raise ValueError(
                    "replica_id must be 1-64 characters of letters, digits, '.', '_' or '-', starting "
                    "with a letter or digit (it is part of the MQTT client id)"
                )
        return v

    @model_validator(mode="after")
    def _replicas_ok(self) -> ControllerSettings:
        if self.replica_id is None:
            self.replica_id = default_replica_id()
        if self.admin_token is not None and self.admin_token_file is not None:
            raise ValueError("set admin_token (EDGEFLEET_ADMIN_TOKEN) or admin_token_file, not both")
        if self.mqtt_share_group is None:
            return self
        if not self.resolved_database_url().startswith("postgresql"):
            raise ValueError(
                "mqtt_share_group (EDGEFLEET_MQTT_SHARE_GROUP) runs several controller replicas, which "
                "needs PostgreSQL (EDGEFLEET_DATABASE_URL=postgresql+psycopg://...): SQLite serves one "
                "controller process only; unset EDGEFLEET_MQTT_SHARE_GROUP to run one"
            )
        if self.admin_token is None and self.admin_token_file is None:
            raise ValueError(
                "mqtt_share_group (EDGEFLEET_MQTT_SHARE_GROUP) runs several controller replicas, which must "
                "all accept one admin token: set EDGEFLEET_ADMIN_TOKEN or EDGEFLEET_ADMIN_TOKEN_FILE "
                "(a token made per replica would work on one replica only)"
            )
        return self

    @field_validator("topic_prefix")
    @classmethod
    def _prefix_ok(cls, v: str) -> str:
        Topics(v)  # raises ValueError with the reason
        return v

    @field_validator("mqtt_url")
    @classmethod
    def _mqtt_url_ok(cls, v: SecretStr) -> SecretStr:
        MqttEndpoint.parse(v.get_secret_value())  # raises ValueError with the reason, never the URL
        return v

    @model_validator(mode="after")
    def _mqtt_tls_ok(self) -> ControllerSettings:
        check_tls_files(self.mqtt_ca_file, self.mqtt_cert_file, self.mqtt_key_file)
        admin = self.mqtt_admin_username or self.mqtt_target().username
        if self.mqtt_broker_auth == "dynsec" and not admin:
            raise ValueError(
                "mqtt_broker_auth 'dynsec' needs the broker's dynsec admin user: set "
                "mqtt_admin_username/mqtt_admin_password, or a user in mqtt_url"
            )
        return self

    @field_validator("database_url")
    @classmethod
    def _db_url_ok(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None:
            scheme = v.get_secret_value().split(":", 1)[0]
            if not scheme.startswith(("sqlite", "postgresql")):
                raise ValueError("database_url must be sqlite:///… or postgresql+psycopg://…")
        return v

    @model_validator(mode="after")
    def _production_secrets(self) -> ControllerSettings:
        # Names only in the message, never the values: it is printed and may be logged.
        if self.environment != "production":
            return self
        problems: list[str] = []
        # A production controller silently writing to ./data/edgefleet.db would lose the fleet's
        # truth on the next container rebuild.
        if self.database_url is None:
            problems.append("database_url must be set explicitly")
        if self.admin_token is None and self.admin_token_file is None:
            problems.append(
                "admin_token (EDGEFLEET_ADMIN_TOKEN) is not set, nor EDGEFLEET_ADMIN_TOKEN_FILE; make one with "
                "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
            )
        elif self.admin_token is not None and (
            reason := _weak_secret(self.admin_token.get_secret_value(), min_len=32)
        ):
            problems.append(f"admin_token (EDGEFLEET_ADMIN_TOKEN) {reason}")
        target = self.mqtt_target()
        if target.cert_file is None:  # a client certificate authenticates without a password
            if not target.username:
                problems.append("mqtt_url has no user: the broker must not accept anonymous clients")
            if target.password is None or not target.password.get_secret_value():
                problems.append("the MQTT password (in mqtt_url or EDGEFLEET_MQTT_PASSWORD) is empty")
            elif reason := _weak_secret(target.password.get_secret_value(), min_len=12):
                problems.append(f"the MQTT password {reason}")
        if self.mqtt_broker_auth == "none" and self.mqtt_acl != "external":
            problems.append(
                "mqtt_broker_auth (EDGEFLEET_MQTT_BROKER_AUTH) is 'none': without per-device ACLs any "
                "device's credentials can write every device's desired state; set it to 'dynsec', or "
                "set EDGEFLEET_MQTT_ACL=external if the broker itself enforces the ACL of PROTOCOL.md"
            )
        if not target.tls and not _is_loopback(target.host):
            problems.append(
                f"mqtt_url (EDGEFLEET_MQTT_URL) is plain mqtt:// to {target.host}, not a loopback host: "
                "use mqtts:// (or EDGEFLEET_MQTT_CA_FILE) so credentials and models are not sent in clear"
            )
        if self.mqtt_admin_password is not None and (
            reason := _weak_secret(self.mqtt_admin_password.get_secret_value(), min_len=12)
        ):
            problems.append(f"mqtt_admin_password {reason}")
        if self.database_url is not None:
            db_password = urlsplit(self.database_url.get_secret_value()).password
            if db_password is not None and (reason := _weak_secret(unquote(db_password), min_len=12)):
                problems.append(f"the password in database_url {reason}")
        if problems:
            raise ValueError(
                "environment 'production' refuses missing or default settings:"
                + "".join(f"\n    - {p}" for p in problems)
            )
        return self

    def resolved_database_url(self) -> str:
        if self.database_url is not None:
            return self.database_url.get_secret_value()
        return f"sqlite:///{(self.data_dir / 'edgefleet.db').resolve()}"

    def admin_token_file_problem(self, token: str) -> str | None:
        """Why the token read from ``admin_token_file`` is not fit for production (a model validator
        reads no files: the command line asks before it starts anything, and the runtime again once it
        has read it); None when it is, or when not in production."""
        if self.environment != "production":
            return None
        reason = _weak_secret(token, min_len=32)
        return (
            f"the admin token in {self.admin_token_file} (EDGEFLEET_ADMIN_TOKEN_FILE) {reason}"
            if reason
            else None
        )

    def resolved_replica_id(self) -> str:
        """This process's replica id (validation fills in a default when none is configured)."""
        if self.replica_id is None:  # only if a caller cleared it after validation
            self.replica_id = default_replica_id()
        return self.replica_id

    def resolved_signing_key_file(self) -> Path:
        return (
            self.signing_key_file if self.signing_key_file is not None else self.data_dir / SIGNING_KEY_FILE
        )

    def controller_client_id(self) -> str:
        """The bridge's MQTT client id. Replicas append their replica id to the configured base, so one
        setting shared by every replica never makes them kick each other off the broker."""
        if self.mqtt_share_group is None and self.mqtt_client_id:
            return self.mqtt_client_id
        return f"{self.mqtt_client_id or 'edgefleet-controller'}-{self.resolved_replica_id()}"

    def resolved_store_dir(self) -> Path:
        return self.store_dir if self.store_dir is not None else self.data_dir / "artifacts"

    def resolved_footage(self) -> Path:
        if self.calibration_footage is not None:
            return self.calibration_footage
        return self.models_dir / "footage" / "vtest.avi"

    def mqtt_target(self) -> MqttEndpoint:
        """Where and as whom the bridge connects: ``mqtt_url``, its password overridden by
        ``mqtt_password``, TLS on with ``mqtts://`` or a CA / client certificate file."""
        target = MqttEndpoint.parse(self.mqtt_url.get_secret_value())
        if self.mqtt_password is not None:
            target = target.with_credentials(target.username, self.mqtt_password)
        return target.with_tls(self.mqtt_ca_file, self.mqtt_cert_file, self.mqtt_key_file)

    def mqtt_admin(self) -> tuple[str, SecretStr | None]:
        """The dynsec admin user and password (default: those the controller connects with)."""
        target = self.mqtt_target()
        username = self.mqtt_admin_username or target.username
        if username is None:
            raise ValueError("no broker admin user configured")
        password = self.mqtt_admin_password
        if password is None and self.mqtt_admin_username in (None, target.username):
            password = target.password
        return username, password

    def reserved_broker_names(self) -> dict[str, str]:
        """This deployment's non-device broker names (name → what it is); no device id may be one."""
        names: dict[str, str] = {}
        if self.mqtt_client_id:
            names[self.mqtt_client_id] = "the controller's MQTT client id"
        if self.mqtt_share_group is not None:
            names[self.controller_client_id()] = "this controller replica's MQTT client id"
        if self.mqtt_admin_username:
            names[self.mqtt_admin_username] = "the broker admin's user name"
        if user := self.mqtt_target().username:
            names[user] = "the controller's MQTT user name"
        return names

    def redacted_mqtt_url(self) -> str:
        t = self.mqtt_target()
        user = f"{t.username}:***@" if t.username else ""
        return f"{'mqtts' if t.tls else 'mqtt'}://{user}{t.host}:{t.port}"


SIGNING_KEY_FILE = "artifact_signing_key.pem"
SHARE_GROUP = re.compile(r"[A-Za-z0-9._-]{1,64}")
REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def default_replica_id() -> str:
    """``<host>-<6 hex>``: the host names the replica for people, the random part keeps two processes on
    one host (or a restarted one) apart. Fits ``controller_replica.replica_id`` (64)."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip("-._")[:48] or "controller"
    return f"{host}-{secrets.token_hex(3)}"


# Passwords shipped as defaults by brokers, databases, images and tutorials.
KNOWN_DEFAULT_SECRETS = frozenset(
    {
        "admin", "changeme", "change-me", "changeit", "default", "edgefleet", "guest", "letmein",
        "mosquitto", "mqtt", "pass", "passw0rd", "password", "postgres", "public", "root", "secret",
        "test", "token",
    }
)  # fmt: skip


def _is_loopback(host: str) -> bool:
    """A literal loopback address, or ``localhost`` itself. Any other name (``broker.localhost``,
    ``localhost.localdomain``) is up to the resolver, which in a container may ask DNS."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _repeats_a_default(word: str) -> bool:
    return any(
        len(word) % len(default) == 0 and word == default * (len(word) // len(default))
        for default in KNOWN_DEFAULT_SECRETS
    )


def _weak_secret(value: str, *, min_len: int) -> str | None:
    """Why ``value`` is not fit for production, or None."""
    if value.strip().lower() in KNOWN_DEFAULT_SECRETS:
        return "is a well-known default"
    # A default word repeated (``changeme-changeme-…``) is as guessable as the word, whatever its length.
    words = [w for w in re.split(r"[^a-z0-9]+", value.lower()) if w]
    if words and all(_repeats_a_default(w) for w in words):
        return "is a well-known default repeated"
    if len(value) < min_len:
        return f"is shorter than {min_len} characters"
    if len(set(value)) < 8:
        return "has too few distinct characters"
    return None
