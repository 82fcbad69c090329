"""Desired state: computed, stored and published (retained) per device."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controller.db import crud
from controller.db.engine import session_scope
from controller.db.leader import ALWAYS_LEADER, FencedOut, Leadership
from controller.db.states import DeviceStatus, ModelVersionStatus, SyncState
from controller.db.tables import Device, Event, ModelVariant, ModelVersion, utcnow
from controller.errors import ConflictError, NotFoundError
from controller.fleet.deployments import (
    AGENT_HEALTH_TIMEOUT_S,
    AgentLayer,
    admitted_for,
    agent_layer,
    applied_deployments,
    layers,
)
from controller.fleet.sync import device_sync
from controller.link.artifacts import artifact_file, ref_chunk_size, with_chunk_hashes
from controller.link.bridge import MqttBridge
from controller.registry.agent_packages import get_package
from controller.registry.variants import VariantReport, choose_variant
from controller.security.keys import ArtifactSigner
from fleet_protocol import TopicKind
from fleet_protocol.messages import (
    FETCH_TRANSPORT_ERROR,
    AgentPackageRef,
    ArtifactRef,
    CameraDesired,
    Capabilities,
    DesiredState,
    ModelManifest,
)
from fleet_protocol.signing import sign_agent_package, signed_desired

log = logging.getLogger(__name__)


AUTO = "auto"


@dataclass(frozen=True)
class Choice:
    variant: str
    reason: str
    sha256: str
    size: int


def _reports(rows: list[ModelVariant]) -> list[Any]:
    out = []
    for r in rows:
        if r.variant not in ("fp32", "fp16", "int8"):
            continue
        out.append(
            VariantReport(
                variant=r.variant,  # type: ignore[arg-type]
                path=Path(r.path) if r.path else None,
                sha256=r.sha256,
                size=r.size,
                latency_ms_1t=r.latency_ms_1t,
                latency_ms_2t=r.latency_ms_2t,
                f1=r.f1,
                mean_iou=r.mean_iou,
                detections=r.detections,
                fit=r.fit,
                reason=r.reason,
                target=r.target if r.target in ("cpu", "gpu", "any") else "any",  # type: ignore[arg-type]
                build_s=r.build_s,
                int8_isa=r.int8_isa if r.int8_isa in ("vnni", "no-vnni") else None,  # type: ignore[arg-type]
                reduce_range=r.reduce_range,
            )
        )
    return out


def choose(s: Session, *, mv: ModelVersion, capabilities: dict[str, Any] | None, pin: str = AUTO) -> Choice:
    """The variant of ``mv`` a device with ``capabilities`` runs, and why; ConflictError for a bad pin."""
    assert mv.id is not None
    rows = list(crud.list_variants(s, model_version_id=mv.id))
    by_name = {r.variant: r for r in rows}
    fp32 = Choice("fp32", "", mv.sha256, mv.size)
    if pin != AUTO:
        if pin == "fp32":
            return Choice("fp32", "fp32 pinned by the assignment", mv.sha256, mv.size)
        row = by_name.get(pin)
        if row is None:
            state = f"variant builds {mv.status}" if mv.status != ModelVersionStatus.READY else "not built"
            raise ConflictError(f"variant {pin} of {mv.name}:{mv.version} is not available ({state})")
        if not row.fit or not row.path or not row.sha256 or not row.size:
            raise ConflictError(
                f"variant {pin} of {mv.name}:{mv.version} is unfit: {row.reason or 'no file to ship'}"
            )
        return Choice(pin, f"{pin} pinned by the assignment", row.sha256, row.size)
    if not rows:
        if mv.status == ModelVersionStatus.BUILDING:
            why = f"variants of {mv.name}:{mv.version} are still building ({mv.build_stage or 'queued'})"
        else:
            why = f"{mv.name}:{mv.version} has no optimized variants"
        return Choice("fp32", f"{why}; fp32 runs everywhere", mv.sha256, mv.size)
    try:
        caps = Capabilities.model_validate(capabilities or {})
    except ValueError:
        caps = Capabilities()
    name, reason = choose_variant(_reports(rows), caps)
    row = by_name.get(name)
    if name == "fp32" or row is None or not row.fit or not row.path or not row.sha256 or not row.size:
        return Choice(
            "fp32",
            reason if name == "fp32" else f"{reason}; its file is missing, so fp32",
            fp32.sha256,
            fp32.size,
        )
    return Choice(name, reason, row.sha256, row.size)


def artifact_ref(mv: ModelVersion, choice: Choice, chunk_size: int, path: Path | None = None) -> ArtifactRef:
    """The ref of ``choice``; with the file at ``path``, its manifest carries the chunk hashes (signed
    with it, checked by the agent chunk by chunk) at a chunk size that keeps that list short."""
    manifest = ModelManifest.model_validate(
        {**mv.manifest, "sha256": choice.sha256, "size": choice.size, "chunk_hashes": None}
    )
    ref = ArtifactRef(manifest=manifest, chunk_size=chunk_size, variant=choice.variant)
    return with_chunk_hashes(ref, path)


PUBLISH_TIMEOUT_S = 5.0


class TwinService:
    """Derives, stores and publishes each device's desired state; any replica may serve a change.

    Two locks order it. The device's row (``SELECT … FOR UPDATE``) serialises the read-modify-write
    across replicas, so two of them never issue one version with two contents; the in-process lock does
    the same within one process (SQLite ignores ``FOR UPDATE`` and is one process anyway). The publish
    is a step of its own after the commit: under the row lock again, it sends the latest committed
    state and waits for the broker's PUBACK before letting go, so the retained message ends as the
    database says whichever replica published last. A publish that fails loses nothing: the state is
    committed and the converger (on the leader) sends it again.
    """

    def __init__(
        self,
        engine: Engine,
        bridge: MqttBridge,
        *,
        chunk_size: int,
        signer: ArtifactSigner,
        leadership: Leadership = ALWAYS_LEADER,
        publish_timeout_s: float = PUBLISH_TIMEOUT_S,
    ) -> None:
        self._engine = engine
        self._bridge = bridge
        self._chunk_size = chunk_size
        self._signer = signer
        # Fences the converger's re-sends and gates the republish of the whole fleet; the changes any
        # replica serves (assignments, labels, rollout steps) are not leader work.
        self._leadership = leadership
        self._publish_timeout_s = publish_timeout_s
        self._lock = threading.Lock()

    @staticmethod
    def current(stored: dict[str, object] | None) -> DesiredState:
        if stored is None:
            return DesiredState(version=0, issued_at=time.time(), cameras={})
        return DesiredState.model_validate(stored)

    def assign(
        self,
        *,
        device_id: str,
        camera: str,
        model: str,
        version: str,
        threshold: float | None = None,
        max_fps: float | None = None,
        labels: list[str] | None = None,
        variant: str = AUTO,
    ) -> DesiredState:
        """Set the direct assignment of a camera (the bottom layer; a deployment that applies to the
        camera wins over it) and publish the device's desired state when it changed."""
        with self._lock, session_scope(self._engine) as s:
            dev = _locked(s, device_id)
            if dev is None:
                raise NotFoundError(f"device {device_id!r} is not known")
            mv = crud.get_model_version(s, name=model, version=version)
            if mv is None:
                raise NotFoundError(f"model {model!r} version {version!r} is not registered")
            choose(s, mv=mv, capabilities=dev.capabilities, pin=variant)  # a bad pin is refused here
            direct = dict(dev.direct or {})
            direct[camera] = {
                "model": model,
                "version": version,
                "pin": variant,
                "threshold": threshold,
                "max_fps": max_fps,
                "labels": labels,
            }
            dev.direct = direct
            return self._apply(s, dev) or self.current(dev.desired)

    def remove(self, *, device_id: str, camera: str) -> DesiredState:
        with self._lock, session_scope(self._engine) as s:
            dev = _locked(s, device_id)
            if dev is None:
                raise NotFoundError(f"device {device_id!r} is not known")
            if camera not in (dev.direct or {}):
                raise NotFoundError(f"camera {camera!r} of device {device_id!r} has no model assigned")
            dev.direct = {k: v for k, v in (dev.direct or {}).items() if k != camera}
            return self._apply(s, dev) or self.current(dev.desired)

    def recompute(self, device_id: str) -> DesiredState | None:
        """Derive the device's desired state again from its layers (deployments by priority over the
        direct assignment) and each camera's variant choice; publish it only when it changed.
        Returns the new state, or None when nothing changed."""
        with self._lock, session_scope(self._engine) as s:
            dev = _locked(s, device_id)
            if dev is None or dev.status == DeviceStatus.DECOMMISSIONED:  # retired: nothing to send
                return None
            return self._apply(s, dev)

    def recompute_many(self, device_ids: Iterable[str]) -> int:
        changed = 0
        for d in sorted(set(device_ids)):
            try:
                changed += self.recompute(d) is not None
            except Exception:
                log.exception("recomputing the desired state of %s failed", d)
        return changed

    def _apply(self, s: Session, dev: Device) -> DesiredState | None:
        deployments, admitted = applied_deployments(s), admitted_for(s, dev.id)
        chosen = layers(dev, deployments, admitted)
        cameras: dict[str, CameraDesired] = {}
        assignments: dict[str, Any] = {}
        for cam, layer in sorted(chosen.items()):
            mv = crud.get_model_version(s, name=layer.model, version=layer.version)
            if mv is None:
                continue
            try:
                choice = choose(s, mv=mv, capabilities=dev.capabilities, pin=layer.pin)
            except ConflictError as exc:
                # A pinned variant that is not there: fp32 runs, and the API says why.
                choice = Choice("fp32", f"{exc}; fp32 instead", mv.sha256, mv.size)
            cameras[cam] = CameraDesired(
                model=artifact_ref(mv, choice, self._chunk_size, _artifact_path(s, choice.sha256)),
                threshold=layer.threshold,
                max_fps=layer.max_fps,
                labels=layer.labels,
            )
            assignments[cam] = {
                **_assignment(mv, layer.pin, choice),
                "source": layer.source,
                "deployment": layer.deployment,
            }
        if assignments != (dev.assignments or {}):
            dev.assignments = assignments
        agent = self._agent(s, dev, agent_layer(dev, deployments, admitted))
        s.add(dev)
        old = self.current(dev.desired)
        new = self._signed(old.model_copy(update={"cameras": cameras, "agent": agent}), dev.id)
        same = {k: v.model_dump(mode="json") for k, v in new.cameras.items()} == {
            k: v.model_dump(mode="json") for k, v in old.cameras.items()
        } and _agent_json(new.agent) == _agent_json(old.agent)
        if same:
            s.commit()
            return None
        log.info("desired state of %s changed; publishing", dev.id)
        return self._commit(s, dev.id, old, cameras, agent)

    def _agent(self, s: Session, dev: Device, layer: AgentLayer | None) -> AgentPackageRef | None:
        """The agent ref of ``dev``'s desired state, keeping ``dev.agent_desired`` up to date.

        ``current`` is the ref sent now, ``previous`` the one before the last change of version (or,
        the first time, the package of the version the device reports running, when it was uploaded).
        When the deployment that set ``current`` no longer applies (its rollout failed, was rolled
        back or cancelled before the device was active, it was deleted) and no other layer names a
        version, the device goes back to ``previous``: leaving the agent as it is would not be a roll
        back. Without a ``previous`` there is nothing to go back to, and the agent is left as it is.
        """
        state = dict(dev.agent_desired or {})
        cur: dict[str, Any] | None = state.get("current")
        prev: dict[str, Any] | None = state.get("previous")
        if layer is not None:
            pkg = get_package(s, layer.version)
            if pkg is None:
                # Deleting a package someone needs is refused; a row gone all the same keeps what was sent.
                log.warning("agent %s for %s is not uploaded; desired agent unchanged", layer.version, dev.id)
            else:
                want = {
                    "version": pkg.version,
                    "sha256": pkg.sha256,
                    "size": pkg.size,
                    "chunk_size": ref_chunk_size(pkg.size, self._chunk_size),
                    "health_timeout_s": layer.health_timeout_s,
                    "source": layer.source,
                    "deployment": layer.deployment,
                }
                if cur is None or cur.get("version") != want["version"]:
                    prev = cur if cur is not None else _running_package(s, dev, self._chunk_size)
                cur = want
        elif cur is not None and cur.get("source") == "deployment":
            log.info(
                "agent %s of %s: its deployment %s no longer applies; back to %s",
                cur.get("version"),
                dev.id,
                cur.get("deployment"),
                (prev or {}).get("version") or "what it runs (no earlier package known)",
            )
            cur = {**prev, "source": "rollback", "deployment": None} if prev is not None else None
            prev = None
        state.update(current=cur, previous=prev)
        # A device no agent layer ever named keeps NULL (most of a fleet, most of the time).
        if state != (dev.agent_desired or {}) and (
            dev.agent_desired is not None or any(v is not None for v in state.values())
        ):
            dev.agent_desired = state
        if cur is None:
            return None
        return AgentPackageRef(
            version=cur["version"],
            sha256=cur["sha256"],
            size=cur["size"],
            chunk_size=cur["chunk_size"],
            health_timeout_s=float(cur.get("health_timeout_s") or AGENT_HEALTH_TIMEOUT_S),
        )

    def assign_agent(
        self, *, device_id: str, version: str | None, health_timeout_s: float = AGENT_HEALTH_TIMEOUT_S
    ) -> DesiredState:
        """Set (or with None clear) the device's direct agent version, the layer below every agent
        deployment, and publish its desired state when it changed."""
        with self._lock, session_scope(self._engine) as s:
            dev = _locked(s, device_id)
            if dev is None:
                raise NotFoundError(f"device {device_id!r} is not known")
            if version is not None and get_package(s, version) is None:
                raise NotFoundError(f"agent version {version!r} is not uploaded")
            state = dict(dev.agent_desired or {})
            state.update(direct=version, direct_health_timeout_s=health_timeout_s if version else None)
            if version is None and (state.get("current") or {}).get("source") != "deployment":
                # Cleared: the desired state stops naming a version (the agent runs on as it is) and
                # no longer holds a package; a deployment's version stays.
                state.update(current=None, previous=None)
            dev.agent_desired = state
            return self._apply(s, dev) or self.current(dev.desired)

    def recompute_for_model(self, model_version_id: int) -> int:
        """Recompute every device whose desired state runs this model version; returns how many changed."""
        with Session(self._engine) as s:
            mv = crud.get_model_version_by_id(s, model_version_id=model_version_id)
            if mv is None:
                return 0
            key = (mv.name, mv.version)
            devices = [d.id for d in crud.devices_with_desired(s) if key in uses(d)]
        return sum(self.recompute(d) is not None for d in devices)

    def _commit(
        self,
        s: Session,
        device_id: str,
        old: DesiredState,
        cameras: dict[str, CameraDesired],
        agent: AgentPackageRef | None,
    ) -> DesiredState:
        dev = crud.get_device(s, device_id=device_id)
        assert dev is not None
        new = self._signed(
            DesiredState(
                version=max(old.version, dev.desired_version) + 1,
                issued_at=_issue_time(old),
                cameras=cameras,
                agent=agent,
            ),
            device_id,
        )
        dev.desired = new.model_dump(mode="json")
        dev.desired_version = new.version
        s.add(dev)
        s.commit()
        self.publish_latest(device_id)
        return new

    def publish_latest(self, device_id: str) -> bool:
        """Publish the device's latest committed desired state, holding its row until the broker has it.

        Every publisher of a device's ``twin/desired`` goes through its row lock and reads the state
        under it, so the versions reach the broker in order whichever replica sends them, and the last
        one to reach it is the newest committed. True when the broker confirmed it.
        """
        with Session(self._engine) as s:
            dev = _locked(s, device_id)
            if dev is None or dev.desired is None or dev.status == DeviceStatus.DECOMMISSIONED:
                return False
            state = self._signed(self.current(dev.desired), device_id)
            try:
                ok = self._bridge.publish_confirmed(
                    device_id, TopicKind.TWIN_DESIRED, state, timeout_s=self._publish_timeout_s
                )
            finally:
                s.rollback()  # nothing written: only the lock is let go
        if ok:
            log.info("desired state v%d of %s published", state.version, device_id)
        else:
            # Committed all the same: the converger sends it again once the device does not take it up.
            log.warning("desired state v%d of %s not confirmed by the broker", state.version, device_id)
        return ok

    def _signed(self, state: DesiredState, device_id: str) -> DesiredState:
        """``state`` for ``device_id``, every artifact ref signed by this controller's key, then the
        whole state signed (version, issue time, device id, every camera setting: PROTOCOL.md "What is
        signed"), so the device obeys it only as this controller's word for it.

        Done at every publish, not once at assignment: refs and states stored before signing existed,
        or under a replaced key, then go out signed by the current key. Ed25519 is deterministic, so an
        unchanged state gets the same signature and a republish is byte-identical.
        """
        cameras = {
            cam: cd.model_copy(update={"model": self._signer.sign(cd.model)}) if cd.model is not None else cd
            for cam, cd in state.cameras.items()
        }
        # The agent package is signed on its own too: the agent checks it before fetching a byte.
        agent = sign_agent_package(state.agent, self._signer.private_key) if state.agent is not None else None
        bound = state.model_copy(
            update={
                "cameras": cameras,
                "agent": agent,
                "device_id": device_id,
                "signature": None,
                "key_id": None,
            }
        )
        # Through validation again: a copy is not validated, and what is signed must be what decodes.
        return signed_desired(DesiredState.model_validate(bound.model_dump()), self._signer.private_key)

    def republish_all(self) -> int:
        """Publish every stored desired state again (retained): a broker without persistence forgets.

        Leader work: after a broker blip every replica reconnects, and one republish of the fleet is
        enough. Each device goes through ``publish_latest`` (its row lock, its newest state), so a
        change another replica publishes meanwhile is never overwritten by the older state read here.
        Returns how many the broker confirmed (0 on a replica that does not lead)."""
        if not self._leadership.is_leader():
            return 0
        with Session(self._engine) as s:
            ids = list(
                s.exec(
                    select(Device.id)
                    .where(
                        col(Device.desired).is_not(None), col(Device.status) != DeviceStatus.DECOMMISSIONED
                    )
                    .order_by(col(Device.id))
                )
            )
        done = 0
        for device_id in ids:
            if not self._leadership.is_leader():
                break
            ok = False
            try:
                # The in-process lock too: SQLite ignores the row lock, and this process's own
                # changes must not interleave with the read and the publish.
                with self._lock:
                    ok = self.publish_latest(device_id)
            except Exception:
                log.exception("could not republish desired state of %s", device_id)
            done += ok
            if not ok and not self._bridge.connected:
                log.warning("broker link lost while republishing; the next connect republishes again")
                break
        return done

    def resend(self, device_id: str, *, why: str, attempt: int, next_after_s: float) -> int | None:
        """Publish the device's stored desired state again, under a new version, and record why.

        A new version, not the same message again: the agent ignores a desired version it already
        received, so a device that applied v7 and runs something else only acts on v8 with the same
        content. Above the version the device reports, too, in case it applied more than we know.
        Returns the new version, or None when the device has nothing to re-send or is in sync.
        """
        with self._lock, session_scope(self._engine) as s:
            dev = _locked(s, device_id)
            if dev is None or dev.desired is None or device_sync(dev)[0] == SyncState.IN_SYNC:
                return None  # in sync since the caller looked: nothing to fix
            old = self.current(dev.desired)
            version = max(old.version, dev.desired_version, dev.reported_version or 0) + 1
            new = self._signed(
                DesiredState(
                    version=version, issued_at=_issue_time(old), cameras=old.cameras, agent=old.agent
                ),
                device_id,
            )
            dev.desired = new.model_dump(mode="json")
            dev.desired_version = new.version
            s.add(dev)
            s.add(
                Event(
                    device_id=device_id,
                    ts=utcnow(),
                    kind=EVENT_RESEND,
                    severity="warning",
                    message=(
                        f"desired state v{old.version} re-sent as v{version}: {why} "
                        f"(re-send {attempt}; the next one no sooner than {next_after_s:g}s)"
                    ),
                    data={
                        "previous_version": old.version,
                        "version": version,
                        "reason": why,
                        "attempt": attempt,
                        "next_after_s": next_after_s,
                    },
                )
            )
            # A re-send is the converger's, leader work: a replica that lost the lead must not commit it.
            self._leadership.fence(s)
            s.commit()
            self.publish_latest(device_id)
        log.warning("desired state of %s re-sent as v%d: %s", device_id, version, why)
        return version


def _locked(s: Session, device_id: str) -> Device | None:
    """The device's row, locked until the transaction ends (PostgreSQL; SQLite ignores the clause).

    ``populate_existing``: a row already in the session is read again, as the lock holder left it.
    """
    return s.get(Device, device_id, with_for_update=True, populate_existing=True)


def _issue_time(previous: DesiredState) -> float:
    """Now, but never before the previous state's issue time: an agent refuses a state issued before
    the one it has, so a controller clock stepped back must not lock its devices out."""
    return max(time.time(), previous.issued_at)


def _agent_json(ref: AgentPackageRef | None) -> dict[str, Any] | None:
    """What decides an agent ref's sameness: everything but its signature (made at every publish)."""
    return ref.model_dump(mode="json", exclude={"signature", "key_id"}) if ref is not None else None


def _running_package(s: Session, dev: Device, chunk_size: int) -> dict[str, Any] | None:
    """The uploaded package of the agent version ``dev`` reports running, as a ``current`` entry: what
    a first agent change goes back to. None when that version was never uploaded (a base install)."""
    reported = ((dev.reported or {}).get("agent") or {}).get("version") or dev.agent_version
    pkg = get_package(s, str(reported)) if reported else None
    if pkg is None:
        return None
    return {
        "version": pkg.version,
        "sha256": pkg.sha256,
        "size": pkg.size,
        "chunk_size": ref_chunk_size(pkg.size, chunk_size),
        "health_timeout_s": AGENT_HEALTH_TIMEOUT_S,
        "source": "running",
        "deployment": None,
    }


def _artifact_path(s: Session, sha256: str) -> Path | None:
    found = artifact_file(s, sha256)
    return found[0] if found is not None else None


def _assignment(mv: ModelVersion, pin: str, choice: Choice) -> dict[str, Any]:
    return {
        "model": mv.name,
        "version": mv.version,
        "pin": pin,
        "variant": choice.variant,
        "sha256": choice.sha256,
        "reason": choice.reason,
    }


def uses(dev: Device) -> set[tuple[str, str]]:
    """The (model, version) pairs a device's desired state runs."""
    out: set[tuple[str, str]] = set()
    for cd in ((dev.desired or {}).get("cameras") or {}).values():
        m = ((cd or {}).get("model") or {}).get("manifest") or {}
        if m.get("name") and m.get("version"):
            out.add((str(m["name"]), str(m["version"])))
    return out


# --------------------------------------------------------------------------- convergence

EVENT_RESEND = "twin_resend"
EVENT_CONVERGED = "twin_converged"


@dataclass(frozen=True)
class ResendPolicy:
    """When the controller sends a device its desired state again.

    ``pending_after_s``: how long an online device may report an older desired version than the
    current one (counted from the publish, or from the device coming online, whichever is later)
    before it is treated as having missed it. A device busy applying (fetching, verifying, loading)
    is never hurried. ``backoff_s`` doubles after each re-send up to ``backoff_max_s``, so a device
    that keeps drifting gets at most one re-send (and one event) per ``backoff_max_s``.
    """

    pending_after_s: float = 60.0
    backoff_s: float = 10.0
    backoff_max_s: float = 600.0

    def delay(self, resends: int) -> float:
        """Seconds to wait after the ``resends``-th re-send (0 before the first)."""
        if resends <= 0:
            return 0.0
        return min(self.backoff_max_s, self.backoff_s * 2.0 ** min(resends - 1, 60))

    @property
    def check_every_s(self) -> float:
        return max(0.1, min(5.0, self.backoff_s / 2, self.pending_after_s / 4))


def resend_reason(
    sync: str,
    reason: str | None,
    *,
    online: bool,
    published_at: float,
    online_since: float | None,
    now: float,
    policy: ResendPolicy,
    transport_failed: bool = False,
) -> str | None:
    """Why a device must get its desired state again, or None. Pure.

    Drifted (it applied the current version but runs something else): at once. Pending (it reports an
    older version) only after ``policy.pending_after_s``. Failed only when ``transport_failed`` (a
    camera's fetch failed in transit, :func:`transport_failure`: another try may well succeed); never
    for any other failure (sending the same state again fails the same way; the failure and its reason
    are shown and a rollout acts on them), applying, or an offline device (the retained message is
    waiting for it on the broker).
    """
    if not online:
        return None
    if sync == SyncState.FAILED and transport_failed:
        return f"model transfer failed: {reason or 'failed'}"
    if sync == SyncState.DRIFTED:
        return f"drifted: {reason or 'runs something else'}"
    if sync == SyncState.PENDING:
        waited = now - max(published_at, online_since or 0.0)
        if waited >= policy.pending_after_s:
            return f"still on an older version {waited:.0f}s after the publish ({reason or 'pending'})"
    return None


def transport_failure(dev: Device) -> bool:
    """Whether a camera of ``dev`` reports a failed model fetch whose reason is a transport error
    (:data:`FETCH_TRANSPORT_ERROR`): one worth re-sending the desired state for."""
    for rep in ((dev.reported or {}).get("cameras") or {}).values():
        if not isinstance(rep, dict) or rep.get("state") != "failed":
            continue
        error = rep.get("error")
        if isinstance(error, str) and error.startswith(FETCH_TRANSPORT_ERROR):
            return True
    return False


@dataclass
class _Resends:
    count: int
    last_at: float


def _epoch(dt: datetime | None) -> float | None:
    return dt.timestamp() if dt is not None else None


# Same version applied, yet maybe not running it: a cheap superset in SQL of ``twin_sync``'s drifted and
# failed verdicts at ``reported_version == desired_version`` (a desired camera the device does not
# report running with the desired sha256 and, where it reports them, the same settings; or a camera that
# runs a model no desired camera assigns). Python (``device_sync``) decides on the few rows it yields;
# a row it yields in excess only costs its load.
_MAYBE_DRIFT_PG = """
EXISTS (
  SELECT 1 FROM json_each(CASE WHEN json_typeof(device.desired -> 'cameras') = 'object'
                               THEN device.desired -> 'cameras' END) AS d(cam, want)
  WHERE json_typeof(d.want -> 'model') = 'object'
    AND NOT EXISTS (
      SELECT 1 FROM json_each(CASE WHEN json_typeof(device.reported -> 'cameras') = 'object'
                                   THEN device.reported -> 'cameras' END) AS r(cam, got)
      WHERE r.cam = d.cam
        AND r.got ->> 'state' = 'running'
        AND r.got ->> 'sha256' = d.want -> 'model' -> 'manifest' ->> 'sha256'
        AND (json_typeof(r.got -> 'threshold') IS DISTINCT FROM 'number' OR (
          (CASE WHEN json_typeof(r.got -> 'threshold') = 'number' THEN (r.got ->> 'threshold')::float8 END)
            = COALESCE((d.want ->> 'threshold')::float8,
                       (d.want -> 'model' -> 'manifest' ->> 'default_threshold')::float8, 0.5)
          AND (CASE WHEN json_typeof(r.got -> 'max_fps') = 'number' THEN (r.got ->> 'max_fps')::float8 END)
            IS NOT DISTINCT FROM (d.want ->> 'max_fps')::float8
          AND COALESCE(r.got -> 'labels', 'null'::json)::text = COALESCE(d.want -> 'labels', 'null'::json)::text))))
OR EXISTS (
  SELECT 1 FROM json_each(CASE WHEN json_typeof(device.reported -> 'cameras') = 'object'
                               THEN device.reported -> 'cameras' END) AS r(cam, got)
  WHERE r.got ->> 'state' = 'running' AND COALESCE(r.got ->> 'model', '') <> ''
    AND json_typeof(device.desired -> 'cameras' -> r.cam -> 'model') IS DISTINCT FROM 'object')
"""
_MAYBE_DRIFT_SQLITE = """
EXISTS (
  SELECT 1 FROM json_each(device.desired, '$.cameras') AS d
  WHERE json_type(d.value, '$.model') = 'object'
    AND NOT EXISTS (
      SELECT 1 FROM json_each(device.reported, '$.cameras') AS r
      WHERE r.key = d.key
        AND json_extract(r.value, '$.state') = 'running'
        AND json_extract(r.value, '$.sha256') = json_extract(d.value, '$.model.manifest.sha256')
        AND (COALESCE(json_type(r.value, '$.threshold'), 'null') NOT IN ('real', 'integer') OR (
          json_extract(r.value, '$.threshold') = COALESCE(json_extract(d.value, '$.threshold'),
            json_extract(d.value, '$.model.manifest.default_threshold'), 0.5)
          AND json_extract(r.value, '$.max_fps') IS json_extract(d.value, '$.max_fps')
          AND COALESCE(json_extract(r.value, '$.labels'), 'null')
              = COALESCE(json_extract(d.value, '$.labels'), 'null')))))
OR EXISTS (
  SELECT 1 FROM json_each(device.reported, '$.cameras') AS r
  WHERE json_extract(r.value, '$.state') = 'running' AND COALESCE(json_extract(r.value, '$.model'), '') <> ''
    AND COALESCE(json_type(device.desired, '$.cameras."' || r.key || '".model'), '') <> 'object')
"""


def resend_candidates(s: Session, *, now: float, pending_after_s: float) -> sa.ColumnElement[bool]:
    """Online devices with a desired state that may be due a re-send at ``now``, as a SQL predicate:
    one that reports a version above the desired one, one that has not taken up the desired version
    ``pending_after_s`` after its publish and its coming online, or one that applied it but may run
    something else (a superset; ``device_sync`` decides). In sync and merely pending devices, most of
    the fleet, stay in the database."""
    drift = _MAYBE_DRIFT_PG if s.get_bind().dialect.name == "postgresql" else _MAYBE_DRIFT_SQLITE
    reported, desired = col(Device.reported_version), col(Device.desired_version)
    cutoff = now - pending_after_s
    issued_at = sa.func.coalesce(col(Device.desired)["issued_at"].as_float(), 0.0)
    return sa.and_(
        col(Device.desired).is_not(None),
        col(Device.status) == DeviceStatus.ONLINE,
        sa.or_(
            reported > desired,
            sa.and_(
                sa.or_(reported.is_(None), reported < desired),
                issued_at <= cutoff,
                sa.or_(
                    col(Device.online_since).is_(None),
                    col(Device.online_since) <= datetime.fromtimestamp(cutoff, UTC),
                ),
            ),
            sa.and_(reported == desired, sa.text(f"({drift})")),
        ),
    )


class TwinConverger:
    """Re-sends the desired state to online devices that do not converge on it (``resend_reason``),
    with a capped exponential backoff per device. Each re-send, and the return to in-sync after
    re-sends, is recorded as an event.

    Leader work: a pass runs only while ``leadership.is_leader()``, and its writes are fenced. A pass
    loads only the candidates SQL finds (``resend_candidates``) and the devices it re-sent to before,
    never the whole fleet.

    The backoff lives in memory: after a controller restart (or a change of leader) a still-drifting
    device gets one re-send at once and the doubling starts again, at most one extra message per device.
    """

    def __init__(
        self,
        engine: Engine,
        twin: TwinService,
        *,
        policy: ResendPolicy,
        stop: threading.Event,
        clock: Callable[[], float] = time.time,
        leadership: Leadership = ALWAYS_LEADER,
    ) -> None:
        self._engine = engine
        self._twin = twin
        self.policy = policy
        self._stop = stop
        self._clock = clock
        self._leadership = leadership
        self._resends: dict[str, _Resends] = {}
        self._fenced = False  # logged once per loss of the lead, not once per pass
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="edgefleet-twin-converge", daemon=True)
        self._thread.start()

    def join(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.policy.check_every_s):
            try:
                self.check()
            except Exception:
                log.exception("twin convergence check failed")

    def check(self, now: float | None = None) -> list[str]:
        """One pass; returns the devices whose desired state was re-sent (none on a replica that does
        not lead, or whose lead was fenced off during the pass)."""
        if not self._leadership.is_leader():
            # Another replica re-sends now; what this one remembers of its backoff would be stale.
            self._resends.clear()
            return []
        try:
            sent = self._check(self._clock() if now is None else now)
        except FencedOut as exc:
            if not self._fenced:
                log.warning("twin convergence stopped: %s", exc)
            self._fenced = True
            self._resends.clear()
            return []
        self._fenced = False
        return sent

    def _candidates(self, s: Session, now: float) -> list[Device]:
        q = select(Device).where(resend_candidates(s, now=now, pending_after_s=self.policy.pending_after_s))
        found = {d.id: d for d in s.exec(q).all()}
        # Devices re-sent to before: to see them converge, and to re-send again after their backoff.
        for d in crud.devices_by_ids(s, device_ids=set(self._resends) - set(found)):
            if d.desired is not None and d.status == DeviceStatus.ONLINE:
                found[d.id] = d
        return [found[k] for k in sorted(found)]

    def _check(self, now: float) -> list[str]:
        due: list[tuple[str, str]] = []
        converged: list[tuple[str, int, int]] = []
        with Session(self._engine) as s:
            for dev in self._candidates(s, now):
                sync, reason = device_sync(dev)
                if sync == SyncState.IN_SYNC:
                    done = self._resends.pop(dev.id, None)
                    if done is not None:
                        converged.append((dev.id, dev.desired_version, done.count))
                    continue
                why = resend_reason(
                    sync,
                    reason,
                    online=True,
                    published_at=float((dev.desired or {}).get("issued_at") or 0.0),
                    online_since=_epoch(dev.online_since),
                    now=now,
                    policy=self.policy,
                    transport_failed=sync == SyncState.FAILED and transport_failure(dev),
                )
                if why is None:
                    continue
                prev = self._resends.get(dev.id)
                if prev is not None and now - prev.last_at < self.policy.delay(prev.count):
                    continue
                due.append((dev.id, why))
            if converged:
                for device_id, at_version, count in converged:
                    s.add(
                        Event(
                            device_id=device_id,
                            ts=utcnow(),
                            kind=EVENT_CONVERGED,
                            message=f"in sync again at v{at_version} after {count} re-send(s)",
                            data={"version": at_version, "resends": count},
                        )
                    )
                    log.info("%s in sync again at v%d after %d re-send(s)", device_id, at_version, count)
                self._leadership.fence(s)
                s.commit()
        sent: list[str] = []
        for device_id, why in due:
            prev = self._resends.get(device_id)
            count = (prev.count if prev else 0) + 1
            version: int | None = None
            try:
                version = self._twin.resend(
                    device_id, why=why, attempt=count, next_after_s=self.policy.delay(count)
                )
            except FencedOut:
                raise
            except Exception:
                log.exception("re-sending the desired state of %s failed", device_id)
            # Counted even when the publish failed: a broken device must not turn into a tight loop.
            self._resends[device_id] = _Resends(count, now)
            if version is not None:
                sent.append(device_id)
        return sent
