"""Agent self-update, the agent's half (PROTOCOL.md "Agent updates"; the supervisor's half is
:mod:`edge_agent.supervisor`).

A desired state may name an agent version (:class:`~fleet_protocol.messages.AgentPackageRef`). When it
names another version than the one running, the update thread (never the inference thread, never
paho's) takes these steps, each reported in ``ReportedState.agent`` and by ``agent_update`` events:

1. the ref's own signature is checked (with the controller's key): unsigned or altered -> refused
   before a byte is fetched;
2. the package comes over the artifact channel by its sha256, in chunks, resumable after a kill -9
   (the same :class:`~edge_agent.artifacts.ArtifactFetcher` as models, its own store);
3. the whole file's sha256 is checked again before anything is unpacked;
4. the wheels are installed by ``pip`` (a subprocess) into an A/B slot folder beside the running
   version, and every pinned dependency of the package is checked against what this device has;
5. the slot is written as ``pending`` in ``slots.json``, the state ``restarting`` is reported, and the
   agent stops cleanly with exit code 75: the supervisor starts the pending slot, promotes it once it
   writes the healthy marker, or rolls it back and says why (``last_outcome``).

A version refused or rolled back with the same sha256 is not tried again (no retry loop); a new sha256
or version is. A failure in transit (the controller did not answer) is retried with a bounded backoff.

Everything the agent keeps (outbox, desired/applied state, model store) is in the data folder, shared
by every slot: an update loses none of it.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edge_agent import __version__
from edge_agent.artifacts import ArtifactFetcher, FetchCancelled, FetchError, TransferError, file_sha256
from fleet_protocol.messages import (
    AgentPackageRef,
    AgentReported,
    AgentUpdateState,
    ArtifactRef,
    ArtifactRequest,
    DecoderKind,
    EventKind,
    InputSpec,
    ModelManifest,
    Severity,
)
from fleet_protocol.signing import SignatureError, verify_agent_package

log = logging.getLogger(__name__)

# Exit code of an agent that installed a new version and wants the supervisor to start it (EX_TEMPFAIL).
EXIT_UPDATE = 75
# Set by the supervisor in the child's environment: the slot it runs, and that a supervisor is there.
SLOT_ENV = "EDGEFLEET_AGENT_SLOT"
BASE = "base"
PACKAGE_INFO = "agent-package.json"
PACKAGE_FORMAT = 1
_INFO_MAX_BYTES = 1 << 20


# --------------------------------------------------------------------------- slot state (slots.json)


@dataclass(frozen=True)
class SlotRef:
    version: str
    slot: str
    sha256: str | None = None


@dataclass(frozen=True)
class Pending:
    version: str
    slot: str
    sha256: str
    since: float
    health_timeout_s: float


Outcome = Literal["updated", "rolled_back", "refused"]


@dataclass(frozen=True)
class LastOutcome:
    version: str
    outcome: Outcome
    reason: str
    at: float
    reported: bool = False
    sha256: str | None = None
    previous: str | None = None  # the version running before (updated) / running again (rolled back)


@dataclass(frozen=True)
class SlotState:
    current: SlotRef
    previous: SlotRef | None = None
    pending: Pending | None = None
    last_outcome: LastOutcome | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SlotState:
        def opt(kind: type[Any], value: Any) -> Any:
            return kind(**value) if isinstance(value, dict) else None

        return cls(
            current=SlotRef(**data["current"]),
            previous=opt(SlotRef, data.get("previous")),
            pending=opt(Pending, data.get("pending")),
            last_outcome=opt(LastOutcome, data.get("last_outcome")),
        )


class SlotStore:
    """``<data_dir>/agent``: ``slots.json``, the ``healthy`` marker and the slot folders.

    Two processes write ``slots.json`` (the supervisor, and the agent when it installs a pending slot
    or marks an outcome reported); every read-modify-write holds an flock, and every write is atomic
    (tmp + fsync + rename), so a power cut leaves the old state or the new one, never half of one.
    """

    def __init__(self, data_dir: Path, *, base_version: str = __version__) -> None:
        self.root = data_dir / "agent"
        self.slots_dir = self.root / "slots"
        self.path = self.root / "slots.json"
        self.healthy_path = self.root / "healthy"
        self.base_version = base_version

    def site(self, slot: str) -> Path | None:
        """The folder a slot's code runs from (PYTHONPATH); None for the base install."""
        return None if slot == BASE else self.slots_dir / slot / "site"

    def exists(self, slot: str) -> bool:
        site = self.site(slot)
        return site is None or (site / "edge_agent" / "__init__.py").is_file()

    def base(self) -> SlotRef:
        return SlotRef(self.base_version, BASE)

    def load(self) -> SlotState:
        """The state on disk; the base slot when there is none or it cannot be read (logged)."""
        try:
            raw = self.path.read_text()
        except FileNotFoundError:
            return SlotState(current=self.base())
        except OSError as exc:
            log.error("cannot read %s (%s): running the base install", self.path, exc)
            return SlotState(current=self.base())
        try:
            state = SlotState.from_json(json.loads(raw))
        except (ValueError, TypeError, KeyError) as exc:
            log.error("%s is unreadable (%s): running the base install", self.path, exc)
            return SlotState(current=self.base())
        if state.current.slot == BASE and state.current.version != self.base_version:
            # The base install was upgraded in place (apt/pip): it is what runs now.
            state = replace(state, current=self.base())
        return state

    def save(self, state: SlotState) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        with tmp.open("w") as f:
            json.dump(state.to_json(), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        with contextlib.suppress(OSError):  # the rename durable too (best effort: not every fs allows it)
            dfd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / "slots.lock").open("a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def update(self, change: Callable[[SlotState], SlotState]) -> SlotState:
        with self.locked():
            state = change(self.load())
            self.save(state)
            return state

    # ------------------------------------------------------------------ healthy marker

    def write_healthy(self, version: str, slot: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.healthy_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": version, "slot": slot, "pid": os.getpid()}))
        os.replace(tmp, self.healthy_path)

    def read_healthy(self) -> SlotRef | None:
        try:
            data = json.loads(self.healthy_path.read_text())
            return SlotRef(str(data["version"]), str(data["slot"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def clear_healthy(self) -> None:
        self.healthy_path.unlink(missing_ok=True)

    def prune(self, keep: Sequence[str]) -> None:
        """Remove slot folders other than ``keep`` (current, previous, pending): disk is bounded."""
        if not self.slots_dir.is_dir():
            return
        for d in self.slots_dir.iterdir():
            if d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- the package


class PackageInfo(BaseModel):
    """``agent-package.json``. Unknown keys are ignored: a newer builder may add some."""

    model_config = ConfigDict(extra="ignore")

    format: Literal[1]
    version: str = Field(min_length=1, max_length=64, pattern=r"^[0-9A-Za-z][0-9A-Za-z.+_-]*$")
    python: str = Field(pattern=r"^\d+\.\d+$")
    requires: list[str] = Field(default_factory=list, max_length=1000)
    wheel: str = Field(pattern=r"^wheels/[^/]+\.whl$")


class InstallError(Exception):
    """The package cannot be installed on this device; the message says why (reported as is).

    ``transient``: the package checked out but pip failed (a full disk, a timeout): tried again later,
    where a bad package or missing pins are refused for good."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


def missing_requirements(requires: Sequence[str], paths: Sequence[str]) -> list[str]:
    """The pins of ``requires`` that the distributions found on ``paths`` do not satisfy, each named
    with what the device has instead (``"onnxruntime==1.20.1 (have 1.19.0)"``, ``"x==1 (missing)"``)."""
    have: dict[str, str] = {}
    for dist in importlib.metadata.distributions(path=list(paths)):
        name = dist.metadata["Name"]
        if name:
            have.setdefault(canonicalize_name(name), dist.version)  # first on the path wins, as import does
    out: list[str] = []
    for spec in requires:
        try:
            req = Requirement(spec)
        except InvalidRequirement:
            out.append(f"{spec} (not a requirement)")
            continue
        if req.marker is not None and not req.marker.evaluate():
            continue
        version = have.get(canonicalize_name(req.name))
        if version is None:
            out.append(f"{spec} (missing)")
        elif not req.specifier.contains(version, prereleases=True):
            out.append(f"{spec} (have {version})")
    return out


PipRunner = Callable[[list[str], float], "subprocess.CompletedProcess[str]"]


def _run_pip(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)


def _safe_extract(tarball: Path, dest: Path) -> None:
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            # "data": no absolute paths, no "..", no links out, no devices (PEP 706).
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise InstallError(f"not a readable gzip tarball: {exc}") from None


def read_package_info(root: Path) -> PackageInfo:
    path = root / PACKAGE_INFO
    try:
        if path.stat().st_size > _INFO_MAX_BYTES:
            raise InstallError(f"{PACKAGE_INFO} is larger than {_INFO_MAX_BYTES} bytes")
        return PackageInfo.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        raise InstallError(f"the package has no {PACKAGE_INFO}") from None
    except ValidationError as exc:
        raise InstallError(f"{PACKAGE_INFO} is invalid: {exc.errors()[0].get('msg', exc)}") from None
    except OSError as exc:
        raise InstallError(f"cannot read {PACKAGE_INFO}: {exc}") from None


def _wheel_version(wheel: str) -> str:
    # edgefleet-<version>-py3-none-any.whl (PEP 427: the name and version fields hold no "-").
    parts = Path(wheel).name[: -len(".whl")].split("-")
    if len(parts) < 5 or parts[0] != "edgefleet":
        raise InstallError(f"{wheel} is not an edgefleet wheel")
    return parts[1]


def _same_version(a: str, b: str) -> bool:
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def install_package(
    tarball: Path,
    store: SlotStore,
    version: str,
    *,
    python: str = sys.executable,
    timeout_s: float = 600.0,
    pip: PipRunner = _run_pip,
    env_paths: Sequence[str] | None = None,
) -> str:
    """Install the package file ``tarball`` (verified already) as slot ``version``; returns the slot.

    Raises :class:`InstallError` naming what is wrong (the package, a pin the device lacks, pip's own
    last lines); a failed install leaves no slot behind. ``env_paths``: where the device's packages
    are (default: this interpreter's path, without any slot folder).
    """
    if version == BASE:
        raise InstallError(f"version {BASE!r} is reserved for the base install")
    store.slots_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".install-{version}-", dir=store.slots_dir))
    try:
        unpacked = work / "package"
        unpacked.mkdir()
        _safe_extract(tarball, unpacked)
        info = read_package_info(unpacked)
        if info.version != version:
            raise InstallError(f"the package holds version {info.version}, the desired state says {version}")
        running = f"{sys.version_info.major}.{sys.version_info.minor}"
        if info.python != running:
            raise InstallError(f"the package is for Python {info.python}, this device runs {running}")
        wheel = unpacked / info.wheel
        if not wheel.is_file():
            raise InstallError(f"the package lacks its wheel {info.wheel}")
        if not _same_version(_wheel_version(info.wheel), info.version):
            raise InstallError(f"wheel {Path(info.wheel).name} is not version {info.version}")
        wheels = sorted(str(p) for p in (unpacked / "wheels").glob("*.whl"))
        site = work / "site"
        cmd = [
            python,
            "-m",
            "pip",
            "install",
            "--no-index",
            "--no-deps",
            "--no-cache-dir",  # a service user's home may be read-only (systemd ProtectHome)
            "--disable-pip-version-check",
            "--no-warn-script-location",
            "--target",
            str(site),
            *wheels,
        ]
        try:
            done = pip(cmd, timeout_s)
        except subprocess.TimeoutExpired:
            raise InstallError(f"pip install did not finish within {timeout_s:g} s", transient=True) from None
        except OSError as exc:
            raise InstallError(f"cannot run pip: {exc}", transient=True) from None
        if done.returncode != 0:
            tail = " | ".join((done.stderr or done.stdout or "").strip().splitlines()[-5:])
            raise InstallError(f"pip install failed ({done.returncode}): {tail}"[:1000], transient=True)
        if env_paths is None:
            env_paths = [p for p in sys.path if not p.startswith(str(store.slots_dir))]
        missing = missing_requirements(info.requires, [str(site), *env_paths])
        if missing:
            raise InstallError("this device lacks dependencies the package needs: " + ", ".join(missing))
        final = store.slots_dir / version
        if final.exists():
            shutil.rmtree(final)  # an earlier install of this version (never the running slot)
        final.mkdir()
        os.replace(site, final / "site")
        (final / PACKAGE_INFO).write_text(info.model_dump_json())
        return version
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------- the update thread


class PackageFetcher(ArtifactFetcher):
    """The model fetcher's transfer machinery, storing agent packages as ``<sha256>.tar.gz`` in
    ``<data_dir>/agent/downloads``."""

    def __init__(self, data_dir: Path, request: Callable[[ArtifactRequest], bool], **options: Any) -> None:
        super().__init__(SlotStore(data_dir).root / "downloads", request, **options)

    def path_for(self, sha256: str) -> Path:
        return self.store / f"{sha256}.tar.gz"


def package_artifact(ref: AgentPackageRef) -> ArtifactRef:
    """The fetcher's view of an agent package: a file of this sha256, size and chunk size. (The
    fetcher speaks model refs; only name, sha256, size and chunk size matter to a transfer.)"""
    manifest = ModelManifest(
        name="edgefleet-agent",
        version=ref.version.replace("+", "_"),
        sha256=ref.sha256,
        size=ref.size,
        decoder=DecoderKind.TF_OD,
        input=InputSpec(name="package", layout="NHWC", dtype="uint8", color="RGB", width=1, height=1),
        labels=["agent"],
    )
    return ArtifactRef(manifest=manifest, chunk_size=ref.chunk_size)


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

    def _step(self) -> None:
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
        pending = Pending(ref.version, slot, ref.sha256, now, ref.health_timeout_s)
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
    "this agent was not started by the supervisor (python -m edge_agent.supervisor, the "
    "edgefleet-agent systemd unit), so nothing would start a new version: update refused"
)
