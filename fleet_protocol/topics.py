"""Every MQTT topic of the contract, built and parsed in one place.

Nothing else in the code base writes a topic string by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from fleet_protocol.ids import valid_id

DEFAULT_PREFIX = "edgefleet/v1"


class TopicKind(StrEnum):
    AVAILABILITY = "availability"
    HEARTBEAT = "heartbeat"
    DETECTIONS = "detections"
    EVENTS = "events"
    TWIN_DESIRED = "twin/desired"
    TWIN_REPORTED = "twin/reported"
    COMMANDS = "commands"
    COMMAND_RESULT = "commands/result"
    ARTIFACT_REQUEST = "artifacts/request"
    ARTIFACT_CHUNK = "artifacts/chunk"
    ACKS = "acks"


@dataclass(frozen=True)
class TopicSpec:
    qos: int
    retain: bool
    from_agent: bool


SPECS: dict[TopicKind, TopicSpec] = {
    TopicKind.AVAILABILITY: TopicSpec(qos=1, retain=True, from_agent=True),
    TopicKind.HEARTBEAT: TopicSpec(qos=0, retain=False, from_agent=True),
    TopicKind.DETECTIONS: TopicSpec(qos=1, retain=False, from_agent=True),
    TopicKind.EVENTS: TopicSpec(qos=1, retain=False, from_agent=True),
    TopicKind.TWIN_DESIRED: TopicSpec(qos=1, retain=True, from_agent=False),
    TopicKind.TWIN_REPORTED: TopicSpec(qos=1, retain=True, from_agent=True),
    TopicKind.COMMANDS: TopicSpec(qos=1, retain=False, from_agent=False),
    TopicKind.COMMAND_RESULT: TopicSpec(qos=1, retain=False, from_agent=True),
    TopicKind.ARTIFACT_REQUEST: TopicSpec(qos=1, retain=False, from_agent=True),
    TopicKind.ARTIFACT_CHUNK: TopicSpec(qos=1, retain=False, from_agent=False),
    TopicKind.ACKS: TopicSpec(qos=1, retain=False, from_agent=False),
}


def valid_device_id(device_id: str) -> bool:
    return valid_id(device_id)


@dataclass(frozen=True)
class Topic:
    """A parsed device topic."""

    device_id: str
    kind: TopicKind

    @property
    def qos(self) -> int:
        return SPECS[self.kind].qos

    @property
    def retain(self) -> bool:
        return SPECS[self.kind].retain


class Topics:
    """Builds and parses topics under one prefix (default ``edgefleet/v1``)."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        prefix = prefix.strip("/")
        if not prefix or "+" in prefix or "#" in prefix:
            raise ValueError(f"invalid topic prefix {prefix!r}")
        self.prefix = prefix
        self._device_root = f"{prefix}/devices/"

    def device(self, device_id: str, kind: TopicKind) -> str:
        if not valid_device_id(device_id):
            raise ValueError(f"invalid device id {device_id!r}")
        return f"{self._device_root}{device_id}/{kind.value}"

    def all_devices(self, kind: TopicKind) -> str:
        """Subscription filter for one kind of topic across the fleet."""
        return f"{self._device_root}+/{kind.value}"

    def agent_subscriptions(self, device_id: str) -> list[tuple[str, int]]:
        """Topics an agent subscribes to, with their QoS."""
        kinds = [k for k, s in SPECS.items() if not s.from_agent]
        return [(self.device(device_id, k), SPECS[k].qos) for k in kinds]

    def controller_subscriptions(self) -> list[tuple[str, int]]:
        kinds = [k for k, s in SPECS.items() if s.from_agent]
        return [(self.all_devices(k), SPECS[k].qos) for k in kinds]

    def parse(self, topic: str) -> Topic | None:
        """Parse a device topic; ``None`` when it is not one of ours."""
        if not topic.startswith(self._device_root):
            return None
        rest = topic[len(self._device_root) :]
        device_id, sep, kind_s = rest.partition("/")
        if not sep or not valid_device_id(device_id):
            return None
        try:
            kind = TopicKind(kind_s)
        except ValueError:
            return None
        return Topic(device_id=device_id, kind=kind)
