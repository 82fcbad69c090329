"""Split from edge_agent.update.self_update."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge_agent import __version__
from edge_agent.update.install import InstallError, PackageFetcher, install_package, package_artifact
from edge_agent.update.slots import (
    BASE,
    EXIT_UPDATE,
    SLOT_ENV,
    LastOutcome,
    PendingSlot,
    SlotState,
    SlotStore,
)
from edge_agent.uplink.artifacts import (
    ArtifactFetcher,
    FetchCancelled,
    FetchError,
    TransferError,
    file_sha256,
)
from fleet_protocol.messages import (
    AgentPackageRef,
    AgentReported,
    AgentUpdateState,
    ArtifactRequest,
    EventKind,
    Severity,
)
from fleet_protocol.signing import SignatureError, verify_agent_package

log = logging.getLogger(__name__)


class EmitEvent(Protocol):
    def __call__(
        self,
        kind: EventKind,
        *,
        message: str = "",
        camera: str | None = None,
        severity: Severity = Severity.INFO,
        data: dict[str, Any] | None = None,
    ) -> int | None: ...


Installer = Callable[[Path, SlotStore, str], str]


@dataclass
class _Work:
    """Where the update to ``ref`` stands (reported as ``ReportedState.agent``)."""

    ref: AgentPackageRef
    state: AgentUpdateState = AgentUpdateState.IDLE
    progress_pct: float | None = None
    error: str | None = None
    retry_at: float | None = None  # monotonic; a failure in transit is tried again then
    retries: int = 0
    refused: bool = False  # for good: this version and sha256 are not tried again


class AgentUpdater:
    """Takes the desired agent version (link thread), updates to it (its own thread, :meth:`run`)."""

    def __init__(
        self,
        *,
        data_dir: Path,
        request: Callable[[ArtifactRequest], bool],
        emit: EmitEvent,
        stop: threading.Event,
        key: Ed25519PublicKey | None,
        require_signed: bool = True,
        running_version: str = __version__,
        running_slot: str | None = None,
        installer: Installer | None = None,
        install_timeout_s: float = 600.0,
        retry_min_s: float = 10.0,
        retry_max_s: float = 300.0,
        fetcher: ArtifactFetcher | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``running_slot``: the slot this process runs, from the supervisor (:data:`SLOT_ENV`); None
        when no supervisor started it, and then no update is tried (nothing would start the new
        version): the reported state says so."""
        self.store = SlotStore(data_dir)
        self.fetcher = fetcher or PackageFetcher(data_dir, request)
        self._emit = emit
        self._stop = stop
        self._key = key
        self._require_signed = require_signed
        self.version = running_version
        self.slot = running_slot
        self._installer: Installer = installer or (
            lambda path, store, version: install_package(path, store, version, timeout_s=install_timeout_s)
        )
        self._retry_min_s = retry_min_s
        self._retry_max_s = retry_max_s
        self._clock = clock
        self.report: Callable[[], None] = lambda: None  # set by the agent: publish the reported state
        self.restart_requested = False
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._wanted: AgentPackageRef | None = None
        self._work: _Work | None = None
        self._state = self.store.load()
        self._connected = False
        self._awaiting_promotion = False
        self._healthy_written = False
        # Downloads no desired state names any more (a superseded version's partial or package) are
        # collected on this thread, between steps.
        self.fetcher.keep = self._downloads_needed

    @classmethod
    def running_slot_from_env(cls) -> str | None:
        return os.environ.get(SLOT_ENV) or None

    # ------------------------------------------------------------------ in (link thread)

    def want(self, ref: AgentPackageRef | None) -> None:
        """The agent version of a desired state just taken (None: leave the agent as it is)."""
        with self._lock:
            if ref == self._wanted:
                return
            self._wanted = ref
        self._wake.set()

    def on_connected(self) -> None:
        """The link is up and the birth and reported state are out: this version works."""
        with self._lock:
            self._connected = True
        self._wake.set()

    def on_chunk(self, payload: bytes) -> None:
        self.fetcher.on_chunk(payload)

    # ------------------------------------------------------------------ out

    def reported(self) -> AgentReported:
        with self._lock:
            wanted, work, state = self._wanted, self._work, self._state
        target = wanted.version if wanted is not None and wanted.version != self.version else None
        previous = state.previous.version if state.previous is not None else None
        out = AgentReported(version=self.version, slot=self.slot or BASE, target=target, previous=previous)
        last = state.last_outcome
        if self._awaiting_promotion:
            # Running, but not yet confirmed by the supervisor (healthy marker -> promotion): idle
            # only once this version is the current one, so a rollout gate never passes early.
            return out.model_copy(update={"state": AgentUpdateState.RESTARTING, "target": self.version})
        if work is not None and target is not None and work.ref == wanted:
            return out.model_copy(
                update={
                    "state": work.state,
                    "progress_pct": work.progress_pct,
                    "error": work.error[:4096] if work.error else None,
                }
            )
        if (
            wanted is not None
            and last is not None
            and last.outcome in ("rolled_back", "refused")
            and last.version == wanted.version
            and last.sha256 == wanted.sha256
            and target is not None
        ):
            rolled = last.outcome == "rolled_back"
            return out.model_copy(
                update={
                    "state": AgentUpdateState.ROLLED_BACK if rolled else AgentUpdateState.FAILED,
                    "error": last.reason[:4096],
                    "previous": last.version if rolled else previous,
                }
            )
        if target is not None and self.slot is None:
            return out.model_copy(update={"state": AgentUpdateState.FAILED, "error": _UNSUPERVISED})
        return out

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """At agent start, before the link: say how the last update ended, once."""
        state = self._state
        pending = state.pending
        if pending is not None and pending.slot == self.slot and pending.version == self.version:
            # This is the new version on trial: the supervisor promotes it once it writes the healthy
            # marker, and the "agent_updated" event follows then.
            self._awaiting_promotion = True
            log.info("agent %s on trial in slot %s", self.version, self.slot)
            return
        self._announce_outcome()

    def run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._step()
            except Exception:
                log.exception("agent update step failed")

    def _downloads_needed(self) -> set[str]:
        # A fetch under way is kept by the fetcher itself, even for a version no longer wanted.
        with self._lock:
            wanted = self._wanted
        return {wanted.sha256} if wanted is not None else set()

    def _step(self) -> None:
        try:
            self.fetcher.collect_if_due()
        except Exception:
            log.exception("collecting the agent's downloads failed")
        with self._lock:
            connected, wanted = self._connected, self._wanted
        if connected and not self._healthy_written:
            self._healthy_written = True
            try:
                self.store.write_healthy(self.version, self.slot or BASE)
            except OSError as exc:
                log.error("cannot write the healthy marker: %s", exc)
        if self._awaiting_promotion:
            state = self.store.load()
            if state.pending is None:
                self._awaiting_promotion = False
                with self._lock:
                    self._state = state
                self._announce_outcome()
                self.report()
        if wanted is None or self.restart_requested or self._awaiting_promotion:
            return  # on trial: a next version waits until this one is promoted (or rolled back)
        work = self._work_for(wanted)
        if work is None or work.refused:
            return
        if work.retry_at is not None and self._clock() < work.retry_at:
            return
        self._update(work)

    def _work_for(self, ref: AgentPackageRef) -> _Work | None:
        """The work toward ``ref``, or None when there is nothing to do."""
        if ref.version == self.version:
            return None
        last = self._state.last_outcome
        if (
            last is not None
            and last.outcome in ("rolled_back", "refused")
            and (last.version, last.sha256) == (ref.version, ref.sha256)
        ):
            return None  # no retry loop: a new sha256 or version is needed
        pending = self._state.pending
        if pending is not None and (pending.version, pending.sha256) == (ref.version, ref.sha256):
            return None
        with self._lock:
            if self._work is None or self._work.ref != ref:
                self._work = _Work(ref)
            return self._work

    # ------------------------------------------------------------------ the steps

    def _set(
        self, work: _Work, state: AgentUpdateState, *, pct: float | None = None, error: str | None = None
    ) -> None:
        with self._lock:
            work.state, work.progress_pct, work.error = state, pct, error
        self.report()

    def _update(self, work: _Work) -> None:
        ref = work.ref
        if self.slot is None:
            self._refuse(work, _UNSUPERVISED, check="supervisor", persist=False)
            return
        problem = self._signature_problem(ref)
        if problem is not None:
            # Not recorded by sha256: the refusal is of this ref's word, and a properly signed ref
            # to the same bytes must still be taken (the same ref again is not: ``_Work.refused``).
            self._refuse(work, problem, check="signature", persist=False)
            return
        self._event(ref, "fetching", f"agent {ref.version}: fetching {ref.size} bytes")
        self._set(work, AgentUpdateState.FETCHING, pct=0.0)
        try:
            path = self._fetch(work)
        except FetchCancelled:
            return
        except TransferError as exc:
            self._transient(work, str(exc))
            return
        except FetchError as exc:
            self._refuse(work, f"fetch failed: {exc}", check="fetch")
            return
        if self._superseded(ref):
            return
        self._set(work, AgentUpdateState.VERIFYING)
        actual = file_sha256(path)
        if actual != ref.sha256:
            path.unlink(missing_ok=True)
            self._refuse(
                work, f"package sha256 is {actual}, the signed ref says {ref.sha256}", check="sha256"
            )
            return
        self._event(ref, "installing", f"agent {ref.version}: sha256 verified; installing")
        self._set(work, AgentUpdateState.INSTALLING)
        try:
            slot = self._installer(path, self.store, ref.version)
        except InstallError as exc:
            if exc.transient:  # the verified file stays for the next try
                self._transient(work, f"install failed: {exc}")
                return
            path.unlink(missing_ok=True)
            self._refuse(work, f"install refused: {exc}", check="install")
            return
        path.unlink(missing_ok=True)  # installed: the slot is what stays
        if self._stop.is_set() or self._superseded(ref):
            return
        now = time.time()
        pending = PendingSlot(ref.version, slot, ref.sha256, now, ref.health_timeout_s)
        state = self.store.update(lambda s: replace(s, pending=pending))
        with self._lock:
            self._state = state
        self._set(work, AgentUpdateState.RESTARTING)
        self._event(
            ref,
            "restarting",
            f"agent {ref.version} installed in slot {slot}; restarting into it",
            health_timeout_s=ref.health_timeout_s,
        )
        log.info("agent %s installed; exiting with %d to restart into it", ref.version, EXIT_UPDATE)
        self.restart_requested = True
        self._stop.set()  # a clean stop: the outbox and state files are closed; run() returns 75

    def _superseded(self, ref: AgentPackageRef) -> bool:
        """A newer desired state no longer names ``ref`` (it came during the fetch or install): the
        update to ``ref`` is dropped, and the next step works toward what is desired now."""
        with self._lock:
            wanted = self._wanted
        if wanted == ref:
            return False
        log.info("agent %s is no longer desired; update dropped", ref.version)
        self._wake.set()
        return True

    def _signature_problem(self, ref: AgentPackageRef) -> str | None:
        if self._key is None:
            if self._require_signed:
                return "no artifact public key configured, so no agent package can be trusted"
            return None
        try:
            verify_agent_package(ref, self._key)
        except SignatureError as exc:
            return f"refused agent package {ref.version}: {exc}"
        return None

    def _fetch(self, work: _Work) -> Path:
        ref = work.ref
        last_step = -1

        def progress(done: int, pct: float) -> None:
            nonlocal last_step
            step = int(pct // 10)
            if step == last_step:
                return  # one report per 10 %
            last_step = step
            self._set(work, AgentUpdateState.FETCHING, pct=round(pct, 1))

        return self.fetcher.fetch(package_artifact(ref), self._stop, progress)

    def _transient(self, work: _Work, reason: str) -> None:
        work.retries += 1
        delay = min(self._retry_max_s, self._retry_min_s * 2 ** (work.retries - 1))
        work.retry_at = self._clock() + delay
        log.warning("agent %s: %s; trying again in %.0f s", work.ref.version, reason, delay)
        self._set(work, AgentUpdateState.FAILED, error=f"{reason}; trying again in {delay:.0f} s")
        self._event(work.ref, "failed", f"agent {work.ref.version}: {reason}", severity=Severity.WARNING)

    def _refuse(self, work: _Work, reason: str, *, check: str, persist: bool = True) -> None:
        """The update to ``work.ref`` will not happen: reported, not tried again for this sha256."""
        ref = work.ref
        log.error("agent update to %s refused: %s", ref.version, reason)
        work.refused = True
        self._set(work, AgentUpdateState.FAILED, error=reason)
        self._event(ref, "refused", reason, severity=Severity.ERROR, check=check)
        if persist:
            outcome = LastOutcome(
                ref.version, "refused", reason[:4096], time.time(), True, ref.sha256, self.version
            )
            try:
                state = self.store.update(lambda s: replace(s, last_outcome=outcome))
            except OSError as exc:
                log.error("cannot record the refusal in %s: %s", self.store.path, exc)
            else:
                with self._lock:
                    self._state = state

    def _event(
        self,
        ref: AgentPackageRef,
        phase: str,
        message: str,
        *,
        severity: Severity = Severity.INFO,
        **data: Any,
    ) -> None:
        self._emit(
            EventKind.AGENT_UPDATE,
            severity=severity,
            message=message[:4096],
            data={
                "phase": phase,
                "version": ref.version,
                "sha256": ref.sha256,
                "running": self.version,
                **data,
            },
        )

    def _announce_outcome(self) -> None:
        """One event for an outcome the supervisor recorded and no agent has reported yet."""
        last = self._state.last_outcome
        if last is None or last.reported or last.outcome == "refused":
            return
        if last.outcome == "updated":
            self._emit(
                EventKind.AGENT_UPDATED,
                message=f"agent updated to {last.version} (from {last.previous or '-'})",
                data={"version": last.version, "previous": last.previous, "sha256": last.sha256},
            )
        else:
            self._emit(
                EventKind.AGENT_ROLLED_BACK,
                severity=Severity.ERROR,
                message=f"agent {last.version} rolled back to {self.version}: {last.reason}"[:4096],
                data={
                    "version": last.version,
                    "running": self.version,
                    "sha256": last.sha256,
                    "reason": last.reason[:1000],
                },
            )

        def mark(s: SlotState) -> SlotState:
            if s.last_outcome is None or s.last_outcome.at != last.at:
                return s  # another outcome came meanwhile; it is announced by itself
            return replace(s, last_outcome=replace(s.last_outcome, reported=True))

        try:
            state = self.store.update(mark)
        except OSError as exc:
            log.error("cannot mark the update outcome reported: %s", exc)
            return
        with self._lock:
            self._state = state


_UNSUPERVISED = (
    "this agent was not started by the supervisor (python -m edge_agent.update.supervisor, the "
    "edgefleet-agent systemd unit), so nothing would start a new version: update refused"
)
