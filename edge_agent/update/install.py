"""An agent package: its format, its checks and its installation into a slot folder.

PROTOCOL.md "Agent updates" describes the package; :mod:`.updater` drives these steps.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edge_agent.update.slots import BASE, SlotStore
from edge_agent.uplink.artifacts import (
    ArtifactFetcher,
)
from fleet_protocol.messages import (
    AgentPackageRef,
    ArtifactRef,
    ArtifactRequest,
    DecoderKind,
    InputSpec,
    ModelManifest,
)

PACKAGE_INFO = "agent-package.json"


PACKAGE_FORMAT = 1


_INFO_MAX_BYTES = 1 << 20


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


# An agent package holds a JSON file and a few wheels; these bound what a hostile one may unpack.
_MAX_MEMBERS = 1000
_MAX_UNPACKED_BYTES = 1 << 30


def _member_parts(name: str) -> tuple[str, ...]:
    """The path of a member as parts below the target, or InstallError: no absolute path, no "..",
    nothing that is not a plain relative name."""
    if not name or name.startswith("/") or "\\" in name or "\0" in name:
        raise InstallError(f"the package holds a member with an unsafe name: {name!r}")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if not parts or ".." in parts:
        raise InstallError(f"the package holds a member with an unsafe name: {name!r}")
    return parts


def _safe_extract(tarball: Path, dest: Path) -> None:
    """Unpack regular files and folders only, each written by this function below ``dest``.

    Every member is checked before anything is written: a symlink, a hardlink, a device, a FIFO, an
    absolute name or one with ".." refuses the whole package. The files are then written with
    ``O_EXCL | O_NOFOLLOW`` rather than by ``TarFile.extractall``: its ``filter="data"`` has had
    bypasses in some Python patch releases, and a package has no use for links at all.
    """
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            members: list[tuple[tarfile.TarInfo, tuple[str, ...]]] = []
            total = 0
            for m in tar:
                if len(members) >= _MAX_MEMBERS:
                    raise InstallError(f"the package holds more than {_MAX_MEMBERS} members")
                parts = _member_parts(m.name)
                if m.issym() or m.islnk():
                    raise InstallError(
                        f"the package holds a link ({m.name!r} -> {m.linkname!r}); links are refused"
                    )
                if not (m.isreg() or m.isdir()):
                    raise InstallError(
                        f"the package holds {m.name!r}, which is neither a file nor a folder; refused"
                    )
                total += m.size if m.isreg() else 0
                if total > _MAX_UNPACKED_BYTES:
                    raise InstallError(f"the package unpacks to more than {_MAX_UNPACKED_BYTES} bytes")
                members.append((m, parts))
            for m, parts in members:
                target = dest.joinpath(*parts)
                if m.isdir():
                    target.mkdir(mode=0o755, parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
                src = tar.extractfile(m)
                if src is None:
                    raise InstallError(f"cannot read {m.name!r} from the package")
                try:
                    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                except FileExistsError:
                    raise InstallError(f"the package holds {m.name!r} twice (or as a folder too)") from None
                with os.fdopen(fd, "wb") as out:
                    shutil.copyfileobj(src, out)
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
