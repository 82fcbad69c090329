"""The agent's half of self-update (edge_agent/update/self_update.py): slot state, install, the update steps."""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from edge_agent.update.install import InstallError, install_package, missing_requirements
from edge_agent.update.slots import BASE, EXIT_UPDATE, LastOutcome, PendingSlot, SlotRef, SlotState, SlotStore
from edge_agent.update.updater import AgentUpdater
from fleet_protocol.codec import encode_chunk
from fleet_protocol.messages import AgentPackageRef, AgentUpdateState, ArtifactRequest, EventKind, Severity
from fleet_protocol.signing import generate_private_key, sign_agent_package

KEY = generate_private_key()
OTHER_KEY = generate_private_key()
PY = f"{sys.version_info.major}.{sys.version_info.minor}"


# --------------------------------------------------------------------------- builders


def fake_wheel(version: str, *, init: str | None = None) -> tuple[str, bytes]:
    """A minimal, installable edgefleet wheel whose edge_agent says ``version``."""
    dist = f"edgefleet-{version}.dist-info"
    files = {
        "edge_agent/__init__.py": init if init is not None else f'__version__ = "{version}"\n',
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: edgefleet\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{dist}/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, text in {**files, f"{dist}/RECORD": record}.items():
            z.writestr(name, text)
    return f"edgefleet-{version}-py3-none-any.whl", buf.getvalue()


def package_bytes(
    version: str,
    *,
    info: dict[str, Any] | None = None,
    wheel_version: str | None = None,
    extra: dict[str, bytes] | None = None,
) -> bytes:
    name, wheel = fake_wheel(wheel_version or version)
    data = {"format": 1, "version": version, "python": PY, "requires": [], "wheel": f"wheels/{name}"}
    data.update(info or {})
    members = {"agent-package.json": json.dumps(data).encode(), f"wheels/{name}": wheel, **(extra or {})}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path, raw in members.items():
            m = tarfile.TarInfo(path)
            m.size = len(raw)
            tar.addfile(m, io.BytesIO(raw))
    return buf.getvalue()


def ref_for(data: bytes, version: str = "1.1", *, key: Any = KEY, **kw: Any) -> AgentPackageRef:
    ref = AgentPackageRef(
        version=version, sha256=hashlib.sha256(data).hexdigest(), size=len(data), chunk_size=1024, **kw
    )
    return sign_agent_package(ref, key) if key is not None else ref


class ChunkServer:
    """Answers the updater's chunk requests at once, from ``files`` by sha256 (a stand-in controller)."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.requests: list[ArtifactRequest] = []
        self.updater: AgentUpdater | None = None
        self.on_request: Callable[[ArtifactRequest], None] | None = None  # runs before each answer

    def __call__(self, req: ArtifactRequest) -> bool:
        self.requests.append(req)
        if self.on_request is not None:
            self.on_request(req)
        data = self.files.get(req.sha256)
        if data is None or self.updater is None:
            return True
        cs = req.chunk_size
        total = max(1, -(-len(data) // cs))
        for i in req.chunks:
            self.updater.on_chunk(encode_chunk(req.sha256, i, total, data[i * cs : (i + 1) * cs]))
        return True


class Events:
    def __init__(self) -> None:
        self.items: list[tuple[EventKind, Severity, str, dict[str, Any]]] = []

    def __call__(
        self,
        kind: EventKind,
        *,
        message: str = "",
        camera: str | None = None,
        severity: Severity = Severity.INFO,
        data: dict[str, Any] | None = None,
    ) -> int | None:
        self.items.append((kind, severity, message, dict(data or {})))
        return len(self.items)

    def of(self, kind: EventKind) -> list[tuple[EventKind, Severity, str, dict[str, Any]]]:
        return [e for e in self.items if e[0] == kind]


def fake_installer(calls: list[str]) -> Any:
    def install(path: Path, store: SlotStore, version: str) -> str:
        calls.append(version)
        (store.slots_dir / version / "site" / "edge_agent").mkdir(parents=True)
        (store.slots_dir / version / "site" / "edge_agent" / "__init__.py").write_text("")
        return version

    return install


def make_updater(
    tmp_path: Path,
    server: ChunkServer,
    events: Events,
    *,
    slot: str | None = BASE,
    installer: Any = None,
    key: Any = KEY,
    version: str = "1.0",
) -> tuple[AgentUpdater, threading.Event]:
    stop = threading.Event()
    upd = AgentUpdater(
        data_dir=tmp_path,
        request=server,
        emit=events,
        stop=stop,
        key=key.public_key() if key is not None else None,
        running_version=version,
        running_slot=slot,
        installer=installer,
        retry_min_s=60.0,
    )
    server.updater = upd
    return upd, stop


def run_until_quiet(upd: AgentUpdater, steps: int = 3) -> None:
    for _ in range(steps):
        upd._step()


# --------------------------------------------------------------------------- slot state


def test_slot_state_round_trips_and_a_missing_or_broken_file_means_the_base_install(tmp_path: Path) -> None:
    store = SlotStore(tmp_path, base_version="1.0")
    assert store.load() == SlotState(current=SlotRef("1.0", BASE))
    state = SlotState(
        current=SlotRef("1.1", "1.1", "a" * 64),
        previous=SlotRef("1.0", BASE),
        pending=PendingSlot("1.2", "1.2", "b" * 64, 5.0, 120.0),
        last_outcome=LastOutcome("1.1", "updated", "healthy", 4.0, False, "a" * 64, "1.0"),
    )
    store.save(state)
    assert SlotStore(tmp_path, base_version="1.0").load() == state
    store.path.write_text("{not json")
    assert store.load().current == SlotRef("1.0", BASE)


def test_an_upgraded_base_install_is_what_the_base_slot_runs(tmp_path: Path) -> None:
    SlotStore(tmp_path, base_version="1.0").save(SlotState(current=SlotRef("1.0", BASE)))
    assert SlotStore(tmp_path, base_version="2.0").load().current == SlotRef("2.0", BASE)


def test_missing_requirements_names_what_is_missing_or_at_another_version() -> None:
    import pydantic

    have = pydantic.VERSION
    paths = list(sys.path)
    assert missing_requirements([f"pydantic=={have}"], paths) == []
    out = missing_requirements(["pydantic==0.0.1", "no-such-package-xyz==1.0"], paths)
    assert out == [f"pydantic==0.0.1 (have {have})", "no-such-package-xyz==1.0 (missing)"]


# --------------------------------------------------------------------------- install


def write_package(tmp_path: Path, raw: bytes) -> Path:
    path = tmp_path / "pkg.tar.gz"
    path.write_bytes(raw)
    return path


def test_install_puts_the_wheel_in_its_own_slot_beside_the_running_one(tmp_path: Path) -> None:
    store = SlotStore(tmp_path / "data")
    slot = install_package(write_package(tmp_path, package_bytes("1.1")), store, "1.1")
    assert slot == "1.1"
    site = store.site("1.1")
    assert site is not None
    assert (site / "edge_agent" / "__init__.py").read_text() == '__version__ = "1.1"\n'
    assert store.exists("1.1")
    assert [p.name for p in store.slots_dir.iterdir()] == ["1.1"]  # no install leftovers


def test_install_refuses_a_package_whose_pins_the_device_lacks_and_leaves_no_slot(tmp_path: Path) -> None:
    store = SlotStore(tmp_path / "data")
    raw = package_bytes("1.1", info={"requires": ["no-such-package-xyz==1.0", "pydantic==0.0.1"]})
    with pytest.raises(InstallError) as exc:
        install_package(write_package(tmp_path, raw), store, "1.1")
    assert "no-such-package-xyz==1.0 (missing)" in str(exc.value)
    assert "pydantic==0.0.1 (have" in str(exc.value)
    assert list(store.slots_dir.iterdir()) == []


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"not a tarball", "not a readable gzip tarball"),
        (package_bytes("1.2"), "holds version 1.2"),
        (package_bytes("1.1", info={"python": "2.7"}), "for Python 2.7"),
        (package_bytes("1.1", info={"format": 9}), "agent-package.json is invalid"),
        (package_bytes("1.1", wheel_version="1.0"), "is not version 1.1"),
        (package_bytes("1.1", info={"wheel": "wheels/edgefleet-1.1-py3-none-any.whl.x"}), "is invalid"),
    ],
)
def test_install_refuses_a_bad_package_with_a_clear_reason(tmp_path: Path, raw: bytes, why: str) -> None:
    store = SlotStore(tmp_path / "data")

    def no_pip(cmd: list[str], timeout: float) -> Any:
        raise AssertionError("pip must not run for a bad package")

    with pytest.raises(InstallError, match=why):
        install_package(write_package(tmp_path, raw), store, "1.1", pip=no_pip)
    assert list(store.slots_dir.iterdir()) == []


def test_a_tarball_with_a_path_out_of_its_folder_is_refused(tmp_path: Path) -> None:
    store = SlotStore(tmp_path / "data")
    raw = package_bytes("1.1", extra={"../../escape.txt": b"x"})
    with pytest.raises(InstallError):
        install_package(write_package(tmp_path, raw), store, "1.1")
    assert not (tmp_path / "escape.txt").exists()
    assert not (tmp_path / "data" / "escape.txt").exists()


# --------------------------------------------------------------------------- the update steps


def test_an_update_fetches_verifies_installs_marks_pending_and_exits_for_the_supervisor(
    tmp_path: Path,
) -> None:
    raw = package_bytes("1.1")
    server, events, installs = ChunkServer(), Events(), list[str]()
    server.files[hashlib.sha256(raw).hexdigest()] = raw
    upd, stop = make_updater(tmp_path, server, events, installer=fake_installer(installs))
    ref = ref_for(raw, health_timeout_s=30.0)
    upd.want(ref)
    run_until_quiet(upd)
    assert installs == ["1.1"]
    pending = upd.store.load().pending
    assert pending is not None
    assert (pending.version, pending.slot, pending.sha256, pending.health_timeout_s) == (
        "1.1",
        "1.1",
        ref.sha256,
        30.0,
    )
    assert upd.restart_requested and stop.is_set()
    rep = upd.reported()
    assert (rep.version, rep.target, rep.state) == ("1.0", "1.1", AgentUpdateState.RESTARTING)
    phases = [e[3]["phase"] for e in events.of(EventKind.AGENT_UPDATE)]
    assert phases == ["fetching", "installing", "restarting"]
    assert not list((tmp_path / "agent" / "downloads").glob("*.tar.gz"))  # the slot is what stays
    assert EXIT_UPDATE == 75


def test_the_real_installer_makes_a_slot_the_supervisor_can_run(tmp_path: Path) -> None:
    raw = package_bytes("1.1")
    server, events = ChunkServer(), Events()
    server.files[hashlib.sha256(raw).hexdigest()] = raw
    upd, _ = make_updater(tmp_path, server, events)
    upd.want(ref_for(raw))
    run_until_quiet(upd)
    assert upd.restart_requested, events.items
    assert upd.store.exists("1.1")


@pytest.mark.parametrize(
    ("make_ref", "why"),
    [
        (lambda raw: ref_for(raw, key=None), "unsigned agent package"),
        (lambda raw: ref_for(raw, key=OTHER_KEY), "signature does not match"),
        (lambda raw: ref_for(raw).model_copy(update={"version": "6.6"}), "signature does not match"),
        (lambda raw: ref_for(raw).model_copy(update={"size": len(raw) + 1}), "signature does not match"),
    ],
)
def test_an_unsigned_or_altered_ref_is_refused_before_anything_is_fetched(
    tmp_path: Path, make_ref: Any, why: str
) -> None:
    raw = package_bytes("1.1")
    server, events, installs = ChunkServer(), Events(), list[str]()
    server.files[hashlib.sha256(raw).hexdigest()] = raw
    upd, stop = make_updater(tmp_path, server, events, installer=fake_installer(installs))
    ref = make_ref(raw)
    upd.want(ref)
    run_until_quiet(upd)
    assert server.requests == []
    assert installs == [] and not upd.store.slots_dir.exists()
    assert not stop.is_set()
    refused = [e for e in events.of(EventKind.AGENT_UPDATE) if e[3]["phase"] == "refused"]
    assert len(refused) == 1 and why in refused[0][2] and refused[0][3]["check"] == "signature"
    rep = upd.reported()
    assert rep.state == AgentUpdateState.FAILED and rep.error is not None and why in rep.error
    # The same ref again (the retained desired state on every reconnect): no new try, no new event.
    upd.want(None)
    upd.want(ref)
    run_until_quiet(upd)
    assert len([e for e in events.of(EventKind.AGENT_UPDATE) if e[3]["phase"] == "refused"]) == 1
    # The controller's properly signed ref to the same bytes is taken.
    upd.want(ref_for(raw))
    run_until_quiet(upd)
    assert installs == ["1.1"] and upd.restart_requested


def test_tampered_bytes_are_never_installed(tmp_path: Path) -> None:
    raw = package_bytes("1.1")
    server, events, installs = ChunkServer(), Events(), list[str]()
    ref = ref_for(raw)
    server.files[ref.sha256] = raw[:-1] + bytes([raw[-1] ^ 1])  # other bytes served for the signed sha256
    upd, stop = make_updater(tmp_path, server, events, installer=fake_installer(installs))
    upd.want(ref)
    run_until_quiet(upd)
    assert installs == [] and not upd.store.slots_dir.exists() and not stop.is_set()
    rep = upd.reported()
    assert rep.state == AgentUpdateState.FAILED
    assert rep.error is not None and "sha256 mismatch" in rep.error


def test_without_the_supervisor_no_update_is_tried_and_the_reason_is_reported(tmp_path: Path) -> None:
    raw = package_bytes("1.1")
    server, events = ChunkServer(), Events()
    upd, stop = make_updater(tmp_path, server, events, slot=None)
    upd.want(ref_for(raw))
    run_until_quiet(upd)
    assert server.requests == [] and not stop.is_set()
    rep = upd.reported()
    assert rep.state == AgentUpdateState.FAILED and rep.error is not None and "supervisor" in rep.error


def test_the_running_version_desired_is_nothing_to_do(tmp_path: Path) -> None:
    raw = package_bytes("1.0")
    server, events = ChunkServer(), Events()
    upd, _ = make_updater(tmp_path, server, events)
    upd.want(ref_for(raw, "1.0"))
    run_until_quiet(upd)
    assert server.requests == [] and events.items == []
    rep = upd.reported()
    assert (rep.state, rep.target) == (AgentUpdateState.IDLE, None)


def test_a_rolled_back_update_is_announced_once_and_not_retried_until_a_new_sha(tmp_path: Path) -> None:
    raw = package_bytes("1.1")
    ref = ref_for(raw)
    store = SlotStore(tmp_path, base_version="1.0")
    outcome = LastOutcome("1.1", "rolled_back", "exited with code 1: boom", 1.0, False, ref.sha256, "1.0")
    store.save(SlotState(current=SlotRef("1.0", BASE), last_outcome=outcome))
    server, events, installs = ChunkServer(), Events(), list[str]()
    server.files[ref.sha256] = raw
    upd, _ = make_updater(tmp_path, server, events, installer=fake_installer(installs))
    upd.start()
    upd.want(ref)
    run_until_quiet(upd)
    rolled = events.of(EventKind.AGENT_ROLLED_BACK)
    assert len(rolled) == 1 and rolled[0][1] == Severity.ERROR and "boom" in rolled[0][2]
    assert rolled[0][3]["version"] == "1.1"
    assert server.requests == [] and installs == []
    rep = upd.reported()
    assert (rep.state, rep.target, rep.previous) == (AgentUpdateState.ROLLED_BACK, "1.1", "1.1")
    assert rep.error is not None and "boom" in rep.error
    # A restart does not announce it again.
    upd2, _ = make_updater(tmp_path, server, events, installer=fake_installer(installs))
    upd2.start()
    assert len(events.of(EventKind.AGENT_ROLLED_BACK)) == 1
    # A rebuilt 1.1 (another sha256) is tried.
    raw2 = package_bytes("1.1", extra={"notes.txt": b"fixed"})
    ref2 = ref_for(raw2)
    server.files[ref2.sha256] = raw2
    upd2.want(ref2)
    run_until_quiet(upd2)
    assert installs == ["1.1"] and upd2.restart_requested


def test_a_version_on_trial_writes_the_healthy_marker_and_announces_its_promotion(tmp_path: Path) -> None:
    store = SlotStore(tmp_path, base_version="1.0")
    store.save(
        SlotState(current=SlotRef("1.0", BASE), pending=PendingSlot("1.1", "1.1", "c" * 64, 1.0, 60.0))
    )
    server, events = ChunkServer(), Events()
    upd, _ = make_updater(tmp_path, server, events, slot="1.1", version="1.1")
    upd.start()
    run_until_quiet(upd)
    assert store.read_healthy() is None  # not before the link is up
    upd.on_connected()
    run_until_quiet(upd)
    assert store.read_healthy() == SlotRef("1.1", "1.1")
    assert events.of(EventKind.AGENT_UPDATED) == []  # the supervisor has not promoted it yet
    trial = upd.reported()
    assert (trial.version, trial.state, trial.target) == ("1.1", AgentUpdateState.RESTARTING, "1.1")
    store.update(
        lambda s: SlotState(
            current=SlotRef("1.1", "1.1", "c" * 64),
            previous=s.current,
            last_outcome=LastOutcome("1.1", "updated", "healthy", 2.0, False, "c" * 64, "1.0"),
        )
    )
    run_until_quiet(upd)
    updated = events.of(EventKind.AGENT_UPDATED)
    assert len(updated) == 1 and updated[0][3]["previous"] == "1.0"
    last = store.load().last_outcome
    assert last is not None and last.reported
    rep = upd.reported()
    assert (rep.version, rep.state, rep.previous) == ("1.1", AgentUpdateState.IDLE, "1.0")


def test_a_package_the_device_cannot_run_is_refused_for_good_across_restarts(tmp_path: Path) -> None:
    raw = package_bytes("1.1", info={"requires": ["no-such-package-xyz==1.0"]})
    server, events = ChunkServer(), Events()
    ref = ref_for(raw)
    server.files[ref.sha256] = raw
    upd, stop = make_updater(tmp_path, server, events)
    upd.want(ref)
    run_until_quiet(upd)
    rep = upd.reported()
    assert rep.state == AgentUpdateState.FAILED and rep.error is not None
    assert "no-such-package-xyz==1.0 (missing)" in rep.error
    assert not stop.is_set() and list(upd.store.slots_dir.iterdir()) == []
    asked = len(server.requests)
    upd2, _ = make_updater(tmp_path, server, events)  # a restart with the same desired state
    upd2.start()
    upd2.want(ref)
    run_until_quiet(upd2)
    assert len(server.requests) == asked
    assert upd2.reported().state == AgentUpdateState.FAILED


def test_a_failed_pip_run_is_tried_again_after_a_backoff_without_fetching_again(tmp_path: Path) -> None:
    raw = package_bytes("1.1")
    server, events = ChunkServer(), Events()
    ref = ref_for(raw)
    server.files[ref.sha256] = raw
    now = [0.0]
    outcomes: list[InstallError | None] = [
        InstallError("pip install failed (1): No space left", transient=True)
    ]
    installs = list[str]()

    def installer(path: Path, store: SlotStore, version: str) -> str:
        err = outcomes.pop(0) if outcomes else None
        if err is not None:
            raise err
        return fake_installer(installs)(path, store, version)

    stop = threading.Event()
    upd = AgentUpdater(
        data_dir=tmp_path,
        request=server,
        emit=events,
        stop=stop,
        key=KEY.public_key(),
        running_version="1.0",
        running_slot=BASE,
        installer=installer,
        retry_min_s=30.0,
        clock=lambda: now[0],
    )
    server.updater = upd
    upd.want(ref)
    run_until_quiet(upd)
    rep = upd.reported()
    assert (
        rep.state == AgentUpdateState.FAILED and rep.error is not None and "trying again in 30 s" in rep.error
    )
    asked = len(server.requests)
    now[0] = 29.0
    run_until_quiet(upd)
    assert installs == []
    now[0] = 31.0
    run_until_quiet(upd)
    assert installs == ["1.1"] and upd.restart_requested
    assert len(server.requests) == asked  # the verified file was kept


def test_a_version_no_longer_desired_when_its_fetch_ends_is_not_installed(tmp_path: Path) -> None:
    raw = package_bytes("1.1")
    server, events, installs = ChunkServer(), Events(), list[str]()
    ref = ref_for(raw)
    server.files[ref.sha256] = raw
    upd, stop = make_updater(tmp_path, server, events, installer=fake_installer(installs))
    # The operator takes the agent version back out of the desired state while the package comes.
    server.on_request = lambda req: upd.want(None)
    upd.want(ref)
    run_until_quiet(upd)
    assert installs == [] and not stop.is_set() and upd.store.load().pending is None
    assert upd.reported().state == AgentUpdateState.IDLE
