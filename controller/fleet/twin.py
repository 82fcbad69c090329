"""Desired state: computed, stored and published (retained) per device.

Each device's state is derived from its layers (deployments over the direct assignment) and each
camera's variant choice (``controller.registry.choice``), signed, committed, and published under the
device's row lock. Bringing devices that do not take it up back in line is the converger's
(``controller.fleet.converger``), which re-sends through :meth:`TwinService.resend`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controller.db import crud
from controller.db.engine import session_scope
from controller.db.leader import ALWAYS_LEADER, Leadership
from controller.db.states import DeviceStatus, SyncState
from controller.db.tables import AgentPackage, Device, Event, ModelVersion, utcnow
from controller.errors import ConflictError, InvalidError, NotFoundError
from controller.fleet.deployments import (
    AGENT_HEALTH_TIMEOUT_S,
    AgentLayer,
    Layer,
    admitted_for,
    agent_layer,
    applied_deployments,
    layers,
    pool_camera_ids,
    pool_camera_layers,
)
from controller.fleet.gate import AGENT_TRIAL_STATE, failed_attempt
from controller.fleet.placement import variant_key
from controller.fleet.pools import placed_on, probe_for
from controller.fleet.sync import device_sync
from controller.link.artifacts import artifact_file, ref_chunk_size, with_chunk_hashes
from controller.link.bridge import MqttBridge
from controller.registry.agent_packages import get_package
from controller.registry.choice import AUTO, Choice, choose
from controller.security.keys import ArtifactSigner
from fleet_protocol import TopicKind
from fleet_protocol.messages import (
    MAX_CAMERAS,
    AgentPackageRef,
    ArtifactRef,
    CameraDesired,
    CountLine,
    DesiredState,
    ModelManifest,
    MotionSettings,
    Zone,
)
from fleet_protocol.signing import sign_agent_package, signed_desired

log = logging.getLogger(__name__)

# The event a re-send records (TwinService.resend); the converger records the return to in-sync.
EVENT_RESEND = "twin_resend"


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
        label_thresholds: dict[str, float] | None = None,
        min_box_area: float | None = None,
        zones: list[dict[str, Any]] | None = None,
        lines: list[dict[str, Any]] | None = None,
        motion: dict[str, Any] | None = None,
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
            named = set(direct) | set((dev.desired or {}).get("cameras") or {})
            if camera not in named and len(named) >= MAX_CAMERAS:
                # A desired state names at most this many cameras (the contract's bound, which the
                # agent holds to as well): one more could never be published.
                raise InvalidError(
                    f"device {device_id!r} has {len(named)} cameras with a model already, the most a "
                    f"desired state may name ({MAX_CAMERAS}): remove one first"
                )
            direct[camera] = {
                "model": model,
                "version": version,
                "pin": variant,
                "threshold": threshold,
                "max_fps": max_fps,
                "labels": labels,
                "label_thresholds": label_thresholds,
                "min_box_area": min_box_area,
                "zones": zones,
                "lines": lines,
                "motion": motion,
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
        pooled = placed_on(s, dev.id)
        # A pool camera follows its own rollout, camera by camera, wherever it runs; the device's
        # deployment layers never name it (on a device that does not run it, that would be a camera
        # with no source).
        for cam in pool_camera_ids(s, deployments):
            if chosen.get(cam) is not None and chosen[cam].source == "deployment":
                del chosen[cam]
        wanted = pool_camera_layers(s, deployments, [(pc.pool, cam) for cam, pc in pooled.items()])
        for cam, pc in pooled.items():
            # The pool's model over a direct assignment; a deployment that wants the camera over both,
            # once the pool's plan admitted its version where the camera runs (its cost fits).
            dl = wanted.get((pc.pool, cam))
            if dl is not None and variant_key(dl.model, dl.version) in (
                pc.canary,
                variant_key(pc.model, pc.version),
            ):
                chosen[cam] = dl
            else:
                chosen[cam] = Layer(
                    source="pool",
                    deployment_id=None,
                    deployment=None,
                    model=pc.model,
                    version=pc.version,
                    pin=AUTO,
                    max_fps=pc.fps,
                )
        cameras: dict[str, CameraDesired] = {}
        assignments: dict[str, Any] = {}
        # Looked up once per model version and pin: a device's cameras mostly share a few models.
        found: dict[tuple[str, str, str], tuple[ModelVersion, Choice, ArtifactRef] | None] = {}
        for cam, layer in sorted(chosen.items()):
            key = (layer.model, layer.version, layer.pin)
            if key not in found:
                found[key] = self._resolve(s, dev, layer)
            resolved = found[key]
            if resolved is None:
                continue
            mv, choice, ref = resolved
            placed = pooled.get(cam)
            max_fps = layer.max_fps
            if placed is not None and (max_fps is None or max_fps > placed.fps):
                max_fps = placed.fps  # the rate the plan gave it: its share of the device
            per_label = layer.label_thresholds
            cameras[cam] = CameraDesired(
                model=ref,
                threshold=layer.threshold,
                max_fps=max_fps,
                labels=layer.labels,
                source=placed.source if placed is not None else None,
                # None when empty: a state without them is what agents before them verify. Sorted, as
                # the agent reports them, so the converger's text comparison finds them equal.
                label_thresholds=dict(sorted(per_label.items())) if per_label else None,
                min_box_area=layer.min_box_area or None,
                zones=[Zone.model_validate(z) for z in layer.zones] if layer.zones else None,
                lines=[CountLine.model_validate(ln) for ln in layer.lines] if layer.lines else None,
                motion=MotionSettings.model_validate(layer.motion) if layer.motion else None,
            )
            assignments[cam] = {
                **_assignment(mv, layer.pin, choice),
                "source": layer.source,
                "deployment": layer.deployment,
            }
            if placed is not None:
                assignments[cam]["pool"] = placed.pool
        if assignments != (dev.assignments or {}):
            dev.assignments = assignments
        agent = self._agent(s, dev, agent_layer(dev, deployments, admitted))
        probe = probe_for(s, dev, limit=MAX_CAMERAS)
        s.add(dev)
        old = self.current(dev.desired)
        # Compared with the refs signed (as stored) but without signing the whole state: that is done
        # once, by the commit, only when something changed.
        same = (
            {k: v.model_dump(mode="json") for k, v in self._signed_refs(cameras).items()}
            == {k: v.model_dump(mode="json") for k, v in old.cameras.items()}
            and _agent_json(agent) == _agent_json(old.agent)
            and probe == old.probe
        )
        if same:
            s.commit()
            return None
        log.info("desired state of %s changed; publishing", dev.id)
        return self._commit(s, dev.id, old, cameras, agent, probe)

    def _resolve(
        self, s: Session, dev: Device, layer: Layer
    ) -> tuple[ModelVersion, Choice, ArtifactRef] | None:
        """The model version a layer names, the variant this device gets of it, and its artifact ref;
        None when the version is not registered."""
        mv = crud.get_model_version(s, name=layer.model, version=layer.version)
        if mv is None:
            return None
        try:
            choice = choose(s, mv=mv, capabilities=dev.capabilities, pin=layer.pin)
        except ConflictError as exc:
            # A pinned variant that is not there: fp32 runs, and the API says why.
            choice = Choice("fp32", f"{exc}; fp32 instead", mv.sha256, mv.size)
        return mv, choice, artifact_ref(mv, choice, self._chunk_size, _artifact_path(s, choice.sha256))

    def _agent(self, s: Session, dev: Device, layer: AgentLayer | None) -> AgentPackageRef | None:
        """The agent ref of ``dev``'s desired state, keeping ``dev.agent_desired`` up to date.

        ``current`` is the ref sent now; ``previous`` the version a roll back sends the device to: the
        latest version it was seen running (``ran``) other than ``current``, never one it refused or
        rolled back (``refused``), and only while its package is uploaded. The desired version alone
        proves nothing: a device sent 1.2 that rolled it back, then sent 1.1 again, goes back to what ran
        before 1.1, not to 1.2. When the deployment that set ``current`` no longer applies (its rollout
        failed, was rolled back or cancelled before the device was active, it was deleted) and no other
        layer names a version, the device goes back to that version: leaving the agent as it is would
        not be a roll back. Without one there is nothing to go back to, and the agent is left as it is.

        Every pass also keeps the last failed update (``last_failure``: version, outcome, error), so
        the device view still says why once the desired version has moved on and the agent, no longer
        asked for that version, reports idle.
        """
        state = dict(dev.agent_desired or {})
        cur: dict[str, Any] | None = state.get("current")
        prev: dict[str, Any] | None = state.get("previous")
        if layer is not None or dev.agent_desired is not None:
            _observe(s, dev, state)
        if layer is not None:
            pkg = get_package(s, layer.version)
            if pkg is None:
                # Deleting a package someone needs is refused; a row gone all the same keeps what was sent.
                log.warning("agent %s for %s is not uploaded; desired agent unchanged", layer.version, dev.id)
            else:
                cur = {
                    **_package_entry(pkg, self._chunk_size, layer.health_timeout_s),
                    "source": layer.source,
                    "deployment": layer.deployment,
                }
            prev = _fallback(s, state, cur, prev, self._chunk_size) if cur is not None else None
        elif cur is not None and cur.get("source") == "deployment":
            back = _fallback(s, state, cur, prev, self._chunk_size)
            log.info(
                "agent %s of %s: its deployment %s no longer applies; back to %s",
                cur.get("version"),
                dev.id,
                cur.get("deployment"),
                (back or {}).get("version") or "what it runs (no earlier package known)",
            )
            cur = {**back, "source": "rollback", "deployment": None} if back is not None else None
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
            devices = [d.id for d in crud.devices_with_desired(s) if key in models_in_desired(d)]
        return sum(self.recompute(d) is not None for d in devices)

    def _commit(
        self,
        s: Session,
        device_id: str,
        old: DesiredState,
        cameras: dict[str, CameraDesired],
        agent: AgentPackageRef | None,
        probe: dict[str, str],
    ) -> DesiredState:
        dev = crud.get_device(s, device_id=device_id)
        assert dev is not None
        new = self._signed(
            DesiredState(
                version=max(old.version, dev.desired_version) + 1,
                issued_at=_issue_time(old),
                cameras=cameras,
                agent=agent,
                probe=probe,
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
            state = self.current(dev.desired)
            if state.signature is None or state.key_id != self._signer.key_id or state.device_id != device_id:
                # Stored before signing existed, or under a replaced key: signed now by the current one.
                state = self._signed(state, device_id)
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

        Done at each commit of a changed state, and at a publish of a state stored unsigned or under
        another key: refs and states stored before signing existed, or under a replaced key, go out
        signed by the current key. Ed25519 is deterministic, so an unchanged state gets the same
        signature and a republish is byte-identical.
        """
        cameras = self._signed_refs(state.cameras)
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

    def _signed_refs(self, cameras: dict[str, CameraDesired]) -> dict[str, CameraDesired]:
        """``cameras`` with every artifact ref signed by this controller's key."""
        return {
            cam: cd.model_copy(update={"model": self._signer.sign(cd.model)}) if cd.model is not None else cd
            for cam, cd in cameras.items()
        }

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
                    version=version,
                    issued_at=_issue_time(old),
                    cameras=old.cameras,
                    agent=old.agent,
                    probe=old.probe,
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


# Versions a device was seen running, kept per device (oldest first): enough to go back past a few
# failed attempts, small enough to rewrite with the row.
RAN_KEPT = 8


def _observe(s: Session, dev: Device, state: dict[str, Any]) -> None:
    """Fold what ``dev`` reports of its agent into ``state`` (its ``agent_desired``, being rewritten).

    The version it runs joins ``ran`` unless it is on trial (``restarting``: not confirmed healthy);
    a failed update puts its version in ``refused`` and becomes ``last_failure``; a version seen running
    is no longer refused, nor the last failure. New lists and dicts throughout: ``state`` is compared with the stored row.
    """
    got = (dev.reported or {}).get("agent")
    rep: dict[str, Any] = got if isinstance(got, dict) else {}
    running = rep.get("version") or dev.agent_version
    refused: dict[str, Any] = dict(state.get("refused") or {})
    attempt = failed_attempt(rep)
    if attempt is not None:
        cur = state.get("current") or {}
        if cur.get("version") == attempt.version:
            sha = cur.get("sha256")
        else:
            pkg = get_package(s, attempt.version)
            sha = pkg.sha256 if pkg is not None else None
        refused[attempt.version] = sha
        last = state.get("last_failure") or {}
        if (last.get("version"), last.get("state"), last.get("error")) != (
            attempt.version,
            attempt.state,
            attempt.error,
        ):
            state["last_failure"] = {
                "version": attempt.version,
                "state": attempt.state,
                "error": attempt.error,
                "at": utcnow().isoformat(),
            }
    if isinstance(running, str) and running and rep.get("state") != AGENT_TRIAL_STATE:
        ran = [v for v in state.get("ran") or [] if v != running]
        state["ran"] = [*ran, running][-RAN_KEPT:]
        refused.pop(running, None)
        if (state.get("last_failure") or {}).get("version") == running:
            # It runs now (a transfer retried, a new package of the version): the failure is over.
            state["last_failure"] = None
    if refused or "refused" in state:
        state["refused"] = refused


def _is_refused(state: dict[str, Any], version: str, sha256: str) -> bool:
    refused = state.get("refused") or {}
    # A version refused under another sha256 (deleted, uploaded again) is a new package.
    return version in refused and refused[version] in (None, sha256)


def _fallback(
    s: Session,
    state: dict[str, Any],
    cur: dict[str, Any],
    stored: dict[str, Any] | None,
    chunk_size: int,
) -> dict[str, Any] | None:
    """Where a roll back from ``cur`` sends the device, as a ``current`` entry: the latest version it
    was seen running other than ``cur``, never a refused one, whose package is uploaded; else the
    ``previous`` stored before the device's versions were watched, under the same rules; else None."""
    for version in reversed(state.get("ran") or []):
        if version == cur.get("version"):
            continue
        pkg = get_package(s, version)
        if pkg is not None and not _is_refused(state, pkg.version, pkg.sha256):
            return {
                **_package_entry(pkg, chunk_size, AGENT_HEALTH_TIMEOUT_S),
                "source": "running",
                "deployment": None,
            }
    if (
        stored is not None
        and stored.get("version") != cur.get("version")
        and not _is_refused(state, str(stored.get("version")), str(stored.get("sha256")))
        and get_package(s, str(stored.get("version"))) is not None
    ):
        return stored
    return None


def _package_entry(pkg: AgentPackage, chunk_size: int, health_timeout_s: float) -> dict[str, Any]:
    return {
        "version": pkg.version,
        "sha256": pkg.sha256,
        "size": pkg.size,
        "chunk_size": ref_chunk_size(pkg.size, chunk_size),
        "health_timeout_s": health_timeout_s,
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


def models_in_desired(dev: Device) -> set[tuple[str, str]]:
    """The (model, version) pairs a device's desired state runs."""
    out: set[tuple[str, str]] = set()
    for cd in ((dev.desired or {}).get("cameras") or {}).values():
        m = ((cd or {}).get("model") or {}).get("manifest") or {}
        if m.get("name") and m.get("version"):
            out.add((str(m["name"]), str(m["version"])))
    return out
