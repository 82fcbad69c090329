"""What a simulator run is set up with (``SimConfig``, checked when made) and the error that stops it
before it starts (``SimulatorError``).

The command line (``cli.py``) takes its defaults from these fields: a default is written once, here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge_agent.sim.device import DEFAULT_DECODE_MS, DEFAULT_INFER_MS
from edge_agent.sim.outbox import DEFAULT_OUTBOX_MAX
from fleet_protocol.endpoint import MqttEndpoint
from fleet_protocol.topics import DEFAULT_PREFIX, Topics, valid_device_id


class SimulatorError(Exception):
    """A setting or an answer that stops the simulator before it starts; the message says why."""


@dataclass(frozen=True)
class SimConfig:
    """One simulator run. The fields with an ``edgefleet simulate`` option of the same name take their
    default from here (cli.OPTIONS); ``endpoint``, ``credentials`` and ``public_key`` are built from
    other options; the rest (keepalive, outbox bound, reconnect backoff) have no option."""

    devices: int
    endpoint: MqttEndpoint
    prefix: str = DEFAULT_PREFIX
    seconds: float | None = None
    heartbeat_s: float = 5.0
    batch_s: float = 1.0
    ack_timeout_s: float = 10.0
    drain_s: float = 30.0
    device_prefix: str = "sim-"
    cameras: int = 1
    # Per device, cycled: device i costs infer_ms[(i - 1) % len] lane ms a frame (a mixed fleet).
    infer_ms: tuple[float, ...] = (DEFAULT_INFER_MS,)
    decode_ms: float = DEFAULT_DECODE_MS
    # None: as fast as the batches carry frames (SimDevice), so --batch-s alone sets the ingest load.
    source_fps: float | None = None
    # "[DEVICE_GLOB=]HOST_GLOB": source hosts that no device reaches, or with a device glob, that the
    # devices it matches do not reach (a test sees the planner keep a camera off them).
    unreachable: tuple[str, ...] = ()
    data_dir: Path = Path("edgefleet-sim")
    credentials: dict[str, str] = field(default_factory=dict)
    public_key: Ed25519PublicKey | None = None
    connect_rate: float = 200.0
    keepalive_s: int = 15
    outbox_max: int = DEFAULT_OUTBOX_MAX
    reconnect_min_s: float = 1.0
    reconnect_max_s: float = 30.0

    def __post_init__(self) -> None:
        checks = [
            (self.devices >= 1, "--devices must be at least 1"),
            (self.seconds is None or self.seconds > 0, "--seconds must be above 0"),
            (self.heartbeat_s > 0, "--heartbeat-s must be above 0"),
            (self.batch_s > 0, "--batch-s must be above 0"),
            (self.ack_timeout_s > 0, "--ack-timeout-s must be above 0"),
            (self.drain_s >= 0, "--drain-s must be 0 or more"),
            (0 <= self.cameras <= 16, "--cameras must be 0 to 16"),
            (
                bool(self.infer_ms) and all(math.isfinite(x) and 0 < x <= 60_000 for x in self.infer_ms),
                "--infer-ms must be one or more figures above 0 and at most 60000",
            ),
            (
                math.isfinite(self.decode_ms) and 0 <= self.decode_ms <= 60_000,
                "--decode-ms must be 0 to 60000",
            ),
            (
                self.source_fps is None or (math.isfinite(self.source_fps) and 0 < self.source_fps <= 240),
                "--source-fps must be above 0, at most 240",
            ),
            (
                all(part for e in self.unreachable for part in e.split("=", 1)),
                "--unreachable takes [DEVICE=]HOST patterns, neither part empty",
            ),
            (self.connect_rate > 0, "--connect-rate must be above 0"),
            (self.outbox_max >= 1, "the outbox bound must be at least 1"),
        ]
        for ok, why in checks:
            if not ok:
                raise SimulatorError(why)
        Topics(self.prefix)  # raises ValueError on a bad prefix
        for d in (self.device_ids[0], self.device_ids[-1]):
            if not valid_device_id(d):
                raise SimulatorError(
                    f"device id {d!r} (from --device-prefix {self.device_prefix!r}) is not a valid id: "
                    "letters, digits and _.- (not first), at most 64 characters"
                )

    @property
    def device_ids(self) -> list[str]:
        width = max(4, len(str(self.devices)))
        return [f"{self.device_prefix}{i:0{width}d}" for i in range(1, self.devices + 1)]

    def infer_ms_of(self, position: int) -> float:
        """The lane ms a frame of the device at ``position`` (0 for the first) in ``device_ids``."""
        return self.infer_ms[position % len(self.infer_ms)]

    def unreachable_of(self, device_id: str) -> tuple[str, ...]:
        """The host patterns ``device_id`` does not reach."""
        out = []
        for entry in self.unreachable:
            device, eq, host = entry.rpartition("=")
            if not eq or fnmatchcase(device_id, device):
                out.append(host)
        return tuple(out)

    @property
    def deployment(self) -> str:
        return f"{self.endpoint.host}:{self.endpoint.port}/{Topics(self.prefix).prefix}"
