"""Controller configuration: one validated model, read from ``EDGEFLEET_*`` environment variables."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fleet_protocol import DEFAULT_PREFIX, Topics


def _default_models_dir() -> Path:
    import controller

    return Path(controller.__file__).resolve().parents[1] / "models"


@dataclass(frozen=True)
class MqttTarget:
    """Where and as whom the bridge connects; parsed from ``mqtt_url``."""

    host: str
    port: int
    tls: bool
    username: str | None
    password: SecretStr | None


class ControllerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EDGEFLEET_", extra="forbid")

    data_dir: Path = Path("./data")
    # SecretStr: a PostgreSQL URL usually carries a password and must never land in a log line.
    database_url: SecretStr | None = None
    mqtt_url: SecretStr = SecretStr("mqtt://127.0.0.1:1883")
    # Overrides a password in mqtt_url, so production can keep the URL in config and the secret in env.
    mqtt_password: SecretStr | None = None
    # None: a unique id per process, so a second controller never kicks the first off the broker.
    mqtt_client_id: str | None = None
    topic_prefix: str = DEFAULT_PREFIX
    models_dir: Path = Field(default_factory=_default_models_dir)
    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8000, ge=0, le=65535)
    heartbeat_timeout_s: float = Field(default=15.0, gt=0)
    ingest_queue_max: int = Field(default=10000, ge=1)
    ingest_batch_max: int = Field(default=500, ge=1)
    status_queue_max: int = Field(default=10000, ge=1)
    artifact_queue_max: int = Field(default=1000, ge=1)
    artifact_workers: int = Field(default=2, ge=1, le=32)
    chunk_size: int = Field(default=256 * 1024, ge=1024, le=4 * 1024 * 1024)
    # Model registry: uploaded files and built variants, named by sha256 (default data_dir/artifacts).
    store_dir: Path | None = None
    max_upload_bytes: int = Field(default=512 * 1024 * 1024, ge=1024)
    # Variant builds (fp16/int8 with figures) on a background worker.
    build_variants_on_start: bool = True
    # False: uploads are registered without variant builds (fp32 everywhere), e.g. for quick tests.
    build_variants_on_upload: bool = True
    calibration_footage: Path | None = None  # default models_dir/footage/vtest.avi
    variant_calib_frames: int = Field(default=100, ge=1, le=10000)
    variant_eval_frames: int = Field(default=40, ge=1, le=10000)
    variant_bar_f1: float = Field(default=0.95, ge=0.0, le=1.0)
    variant_bar_iou: float = Field(default=0.95, ge=0.0, le=1.0)
    variant_queue_max: int = Field(default=64, ge=1)
    # Live view and commands (controller/live.py, controller/commands.py).
    live_queue_max: int = Field(default=256, ge=1, le=100_000)
    command_timeout_s: float = Field(default=10.0, gt=0, le=300)
    # Retention (controller/retention.py): days kept; health history is also thinned with age.
    retention_detections_days: float = Field(default=30.0, gt=0)
    retention_events_days: float = Field(default=90.0, gt=0)
    retention_health_days: float = Field(default=30.0, gt=0)
    retention_interval_s: float = Field(default=300.0, gt=0)
    environment: Literal["development", "production"] = "development"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: object) -> object:
        return v.upper() if isinstance(v, str) else v

    @field_validator("topic_prefix")
    @classmethod
    def _prefix_ok(cls, v: str) -> str:
        Topics(v)  # raises ValueError with the reason
        return v

    @field_validator("mqtt_url")
    @classmethod
    def _mqtt_url_ok(cls, v: SecretStr) -> SecretStr:
        _parse_mqtt_url(v.get_secret_value())
        return v

    @field_validator("database_url")
    @classmethod
    def _db_url_ok(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None:
            scheme = v.get_secret_value().split(":", 1)[0]
            if not scheme.startswith(("sqlite", "postgresql")):
                raise ValueError("database_url must be sqlite:///… or postgresql+psycopg://…")
        return v

    @model_validator(mode="after")
    def _production_needs_explicit_db(self) -> ControllerSettings:
        # A production controller silently writing to ./data/edgefleet.db would lose the fleet's
        # truth on the next container rebuild.
        if self.environment == "production" and self.database_url is None:
            raise ValueError("database_url must be set explicitly when environment is 'production'")
        return self

    def resolved_database_url(self) -> str:
        if self.database_url is not None:
            return self.database_url.get_secret_value()
        return f"sqlite:///{(self.data_dir / 'edgefleet.db').resolve()}"

    def resolved_store_dir(self) -> Path:
        return self.store_dir if self.store_dir is not None else self.data_dir / "artifacts"

    def resolved_footage(self) -> Path:
        if self.calibration_footage is not None:
            return self.calibration_footage
        return self.models_dir / "footage" / "vtest.avi"

    def mqtt_target(self) -> MqttTarget:
        target = _parse_mqtt_url(self.mqtt_url.get_secret_value())
        if self.mqtt_password is not None:
            target = MqttTarget(target.host, target.port, target.tls, target.username, self.mqtt_password)
        return target

    def redacted_mqtt_url(self) -> str:
        t = self.mqtt_target()
        user = f"{t.username}:***@" if t.username else ""
        return f"{'mqtts' if t.tls else 'mqtt'}://{user}{t.host}:{t.port}"


def _parse_mqtt_url(url: str) -> MqttTarget:
    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
        raise ValueError("mqtt_url must look like mqtt://[user:pass@]host:port (or mqtts://)")
    if not parts.hostname:
        raise ValueError("mqtt_url has no host")
    tls = parts.scheme in ("mqtts", "ssl")
    try:
        port = parts.port or (8883 if tls else 1883)
    except ValueError as exc:
        raise ValueError(f"mqtt_url has a bad port: {exc}") from None
    username = unquote(parts.username) if parts.username else None
    password = SecretStr(unquote(parts.password)) if parts.password else None
    return MqttTarget(parts.hostname, port, tls, username, password)
