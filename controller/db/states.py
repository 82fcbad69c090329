"""The controller's state machines: the allowed values of every state column, once.

Each is a ``StrEnum``: a member *is* its string, so the columns stay ``VARCHAR`` holding the same
values as before (no migration), rows read back as plain ``str`` compare equal to the members, and
the API serialises a member as its value. The wire contract's own states (a camera's ``running`` /
``failed``, an agent's availability, watchdog actions) are ``fleet_protocol``'s, not these.
"""

from __future__ import annotations

from enum import StrEnum


class DeploymentState(StrEnum):
    """``Deployment.state``: which devices a deployment applies to (``controller.fleet.deployments``).

    A failed rollout is ``failed`` here as on its rollout, one word for one outcome; ``rolled_back``
    is the operator's roll back alone. Transitions:

    - created ``rolling_out``;
    - ``rolling_out`` → ``active`` (its rollout succeeded), ``failed`` (its rollout failed: a wave's
      gate failed and the devices it reached were sent back) or ``cancelled`` (the operator cancelled
      the rollout);
    - ``rolling_out`` / ``active`` / ``cancelled`` → ``rolled_back`` (the operator rolled it back;
      ``failed`` stays ``failed``, its devices already sent back);
    - any but ``deleted`` → ``deleted`` (the operator deleted it; terminal, the row stays as history).

    Neither ``failed`` nor ``rolled_back`` applies to any device.
    """

    ROLLING_OUT = "rolling_out"
    ACTIVE = "active"
    FAILED = "failed"
    CANCELLED = "cancelled"
    ROLLED_BACK = "rolled_back"
    DELETED = "deleted"


class RolloutState(StrEnum):
    """``Rollout.state``: the staged rollout of one deployment (``controller.fleet.rollouts``).

    Transitions:

    - created ``running``; ``running`` ⇄ ``paused`` (the operator pauses / resumes);
    - ``running`` / ``paused`` → ``succeeded`` (every wave passed its gate, or no device left to
      admit) or ``failed`` (a wave's gate failed; the devices it reached are sent back and the
      deployment is ``failed`` too);
    - ``running`` / ``paused`` → ``cancelled`` (the operator cancelled or deleted the deployment);
    - any but ``failed`` → ``rolled_back`` (the operator rolled it back; ``failed`` stays ``failed``).

    Only ``running`` and ``paused`` are ticked (``LIVE_ROLLOUT_STATES``); the others are final
    (``FINISHED_ROLLOUT_STATES``).
    """

    RUNNING = "running"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    ROLLED_BACK = "rolled_back"


class MemberState(StrEnum):
    """``RolloutDevice.state``: one device admitted to a rollout (``controller.fleet.gate``).

    Transitions:

    - admitted ``applying`` (``pending`` is allowed, treated like ``applying`` by cancel and delete,
      but not written by the controller today);
    - ``applying`` → ``active`` (it runs the new model) or ``failed`` (it reported a failure, went
      offline, crash-looped, stopped matching, or timed out);
    - ``active`` → ``failed`` (it went bad while its wave soaked);
    - any but ``rolled_back`` → ``rolled_back`` (the rollout failed or was rolled back; a cancel or a
      delete reverts only ``pending`` / ``applying`` members).
    """

    PENDING = "pending"
    APPLYING = "applying"
    ACTIVE = "active"
    FAILED = "failed"
    ROLLED_BACK = "rolled_back"


class ModelVersionStatus(StrEnum):
    """``ModelVersion.status``: the variant build of a model version (``controller.registry.builder``).

    fp32 always serves, whatever the status. Transitions:

    - registered ``building`` (an upload that asks for variants) or ``ready``;
    - ``ready`` (never built) → ``building`` (queued at start);
    - ``building`` → ``ready`` (variants recorded, or the build queue was full) or ``failed`` (the
      fp32 model itself could not be judged);
    - a queued build marks its version ``building`` again when it starts; any → ``ready`` when a
      bundled model's bytes change (its variants are dropped).
    """

    BUILDING = "building"
    READY = "ready"
    FAILED = "failed"


class DeviceStatus(StrEnum):
    """``Device.status``: presence (``controller.link.presence``).

    Transitions: created ``offline``; ``offline`` → ``online`` (an ``online`` availability message or
    any heartbeat); ``online`` → ``offline`` (an ``offline`` availability message, the broker's Last
    Will, or nothing received within the timeout); ``online`` or ``offline`` → ``decommissioned`` (the
    operator retired the device: nothing it sends is stored, no desired state is sent);
    ``decommissioned`` → ``offline`` (enrolled again: it comes online with its next birth).
    """

    ONLINE = "online"
    OFFLINE = "offline"
    DECOMMISSIONED = "decommissioned"

    def can_become(self, new: DeviceStatus) -> bool:
        return new in _DEVICE_TRANSITIONS[self]


_DEVICE_TRANSITIONS: dict[DeviceStatus, frozenset[DeviceStatus]] = {
    DeviceStatus.OFFLINE: frozenset({DeviceStatus.ONLINE, DeviceStatus.DECOMMISSIONED}),
    DeviceStatus.ONLINE: frozenset({DeviceStatus.OFFLINE, DeviceStatus.DECOMMISSIONED}),
    DeviceStatus.DECOMMISSIONED: frozenset({DeviceStatus.OFFLINE}),
}


# The API's ``sync`` field: this docstring is its OpenAPI description, so it names no code.
class SyncState(StrEnum):
    """Does a device run its desired state? Derived from its desired and reported state whenever
    asked, never stored.

    - ``in_sync``: it runs what it is asked to (or is asked nothing and runs nothing);
    - ``pending``: it reports an older desired version than the current one;
    - ``applying``: a model is on its way (fetching, verifying, loading);
    - ``failed``: it applied the current version and says a camera failed;
    - ``drifted``: it applied the current version but runs something else.

    A new desired version makes a device ``pending``; from there it goes through ``applying`` to
    ``in_sync``, ``failed`` or ``drifted``; a re-send of a ``drifted`` or long-``pending`` device
    starts again at ``pending``.
    """

    IN_SYNC = "in_sync"
    PENDING = "pending"
    APPLYING = "applying"
    FAILED = "failed"
    DRIFTED = "drifted"


# Rollout states that the runner still ticks, and the final ones.
LIVE_ROLLOUT_STATES = (RolloutState.RUNNING, RolloutState.PAUSED)
FINISHED_ROLLOUT_STATES = (
    RolloutState.SUCCEEDED,
    RolloutState.FAILED,
    RolloutState.CANCELLED,
    RolloutState.ROLLED_BACK,
)
