"""Agent packages: an uploaded ``edgefleet-agent-<version>.tar.gz`` checked, then stored by sha256.

A package (README "Upgrading the fleet", PROTOCOL.md) is a gzip tarball holding ``agent-package.json``
(format, version, python, pinned ``requires``, the path of the agent's wheel) and ``wheels/`` with the
agent's wheel and optional dependency wheels. Everything is checked here before the package is
registered, so a device is never sent bytes the controller could have told were unusable: the
tarball's members (no absolute or ``..`` paths, no links, bounded count), the manifest's fields, and
the wheel itself (a zip whose ``*.dist-info/METADATA`` names ``edgefleet`` at the package's version).

The file goes to ``<store>/<sha256>.agent.tar.gz``: beside the models, served by the artifact channel by
its sha256 (``controller.link.artifacts.artifact_file``), and outside the model store's garbage
collection (which only knows ``<sha256>.onnx`` files); deleting the package deletes it.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import tarfile
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path, PurePosixPath
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from controller.db.engine import session_scope
from controller.db.states import DeploymentState
from controller.db.tables import AgentPackage, Deployment, Device
from controller.errors import ConflictError, NotFoundError
from controller.registry.store import ArtifactStore, IncomingFile
from controller.registry.uploads import UploadConflictError, UploadInvalidError, UploadMalformedError
from fleet_protocol.messages import AgentPackageRef

log = logging.getLogger(__name__)

MANIFEST = "agent-package.json"
FORMAT = 1
SUFFIX = ".agent.tar.gz"
MAX_MEMBERS = 200  # a package holds a manifest and a few wheels
MAX_MANIFEST_BYTES = 256 * 1024
MAX_REQUIRES = 200
MAX_NOTES = 2000
WHEEL_PREFIX = "wheels/"
DIST = "edgefleet"
# ``name==version`` as pip freeze writes it (a pin, not a range: the installer checks it exactly).
_PIN = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?==[A-Za-z0-9][A-Za-z0-9.+!_-]*$")
# AgentPackageRef.version's rule: a package the wire contract could not name is refused at upload.
_VERSION = re.compile(
    next(str(m.pattern) for m in AgentPackageRef.model_fields["version"].metadata if hasattr(m, "pattern"))
)


@dataclass(frozen=True)
class PackageInfo:
    """What a valid package says about itself."""

    version: str
    python: str
    requires: list[str]
    wheel: str


def _norm_version(v: str) -> str:
    """A version as PEP 440 normalises it ("1.0-rc1" and "1.0rc1" are one), else as given."""
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # pragma: no cover - pip and every venv we build with carry packaging
        return v.strip().lower()
    try:
        return str(Version(v))
    except InvalidVersion:
        return v.strip().lower()


def _safe_name(name: str) -> str | None:
    """The member's path when it stays inside the package, else None."""
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or "\\" in name or "\x00" in name:
        return None
    return str(p)


def _read_manifest(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UploadMalformedError(f"{MANIFEST} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UploadMalformedError(f"{MANIFEST} must be a JSON object")
    return data


def _check_manifest(data: dict[str, Any]) -> PackageInfo:
    if data.get("format") != FORMAT:
        raise UploadMalformedError(f"{MANIFEST}: format must be {FORMAT} (got {data.get('format')!r})")
    version = data.get("version")
    if not isinstance(version, str) or not 1 <= len(version) <= 64 or not _VERSION.match(version):
        raise UploadMalformedError(
            f"{MANIFEST}: version {version!r} is not valid: 1-64 letters, digits, '.', '+', '_', '-', "
            "starting with a letter or digit"
        )
    python = data.get("python")
    if not isinstance(python, str) or not re.fullmatch(r"3\.\d{1,2}", python):
        raise UploadMalformedError(f'{MANIFEST}: python must be like "3.11" (got {python!r})')
    requires = data.get("requires", [])
    if not isinstance(requires, list) or len(requires) > MAX_REQUIRES:
        raise UploadMalformedError(f"{MANIFEST}: requires must be a list of at most {MAX_REQUIRES} pins")
    bad = [r for r in requires if not isinstance(r, str) or not _PIN.match(r)]
    if bad:
        raise UploadMalformedError(
            f'{MANIFEST}: requires must be pins like "paho-mqtt==2.1.0"; not: {", ".join(map(repr, bad[:5]))}'
        )
    wheel = data.get("wheel")
    if not isinstance(wheel, str) or not wheel.startswith(WHEEL_PREFIX) or not wheel.endswith(".whl"):
        raise UploadMalformedError(f"{MANIFEST}: wheel must name a file under {WHEEL_PREFIX} (got {wheel!r})")
    return PackageInfo(version=version, python=python, requires=list(requires), wheel=wheel)


def _check_wheel(name: str, raw: bytes, version: str) -> None:
    """The agent's wheel: named ``edgefleet-<version>-…whl`` and its METADATA saying the same."""
    parts = PurePosixPath(name).name[: -len(".whl")].split("-")
    if len(parts) < 5 or parts[0].lower().replace("-", "_") != DIST:
        raise UploadMalformedError(f"{name} is not an {DIST} wheel (edgefleet-VERSION-py3-none-any.whl)")
    if _norm_version(parts[1].replace("_", "-")) != _norm_version(version):
        raise UploadMalformedError(f"{name} is version {parts[1]}, the package says {version}")
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as zf:
            metas = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
            if len(metas) != 1:
                raise UploadMalformedError(f"{name} has no single *.dist-info/METADATA: not a wheel")
            meta = HeaderParser().parsestr(zf.read(metas[0]).decode("utf-8", "replace"))
            bad = zf.testzip()
    except zipfile.BadZipFile as exc:
        raise UploadMalformedError(f"{name} is not a wheel (zip): {exc}") from None
    if bad is not None:
        raise UploadMalformedError(f"{name} is corrupt: {bad} fails its CRC")
    if (meta.get("Name") or "").strip().lower().replace("_", "-") != DIST:
        raise UploadMalformedError(f"{name}: its METADATA names {meta.get('Name')!r}, not {DIST}")
    if _norm_version(meta.get("Version") or "") != _norm_version(version):
        raise UploadMalformedError(
            f"{name}: its METADATA says version {meta.get('Version')!r}, the package says {version}"
        )


def inspect_package(path: Path) -> PackageInfo:
    """Check the tarball at ``path``; its manifest's word, or an UploadMalformedError saying why not."""
    try:
        # Closed by the ``with`` below; opened apart so that its errors read as "not a tarball".
        tf = tarfile.open(path, mode="r:gz")  # noqa: SIM115
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise UploadMalformedError(f"not a gzip tarball (edgefleet-agent-VERSION.tar.gz): {exc}") from None
    with tf:
        files: dict[str, tarfile.TarInfo] = {}
        try:
            for n, m in enumerate(tf):
                if n >= MAX_MEMBERS:
                    raise UploadMalformedError(f"more than {MAX_MEMBERS} files in the package")
                safe = _safe_name(m.name)
                if safe is None:
                    raise UploadMalformedError(f"member {m.name!r} would land outside the package folder")
                if m.isdir():
                    continue
                if not m.isreg():
                    raise UploadMalformedError(f"member {m.name!r} is not a regular file (links are refused)")
                files[safe] = m
        except (tarfile.TarError, OSError, EOFError, zipfile.BadZipFile) as exc:
            raise UploadMalformedError(f"the tarball is truncated or corrupt: {exc}") from None
        if MANIFEST not in files:
            raise UploadMalformedError(f"no {MANIFEST} at the top of the package")
        if files[MANIFEST].size > MAX_MANIFEST_BYTES:
            raise UploadMalformedError(f"{MANIFEST} is over {MAX_MANIFEST_BYTES} bytes")
        info = _check_manifest(_read_manifest(_member(tf, files[MANIFEST])))
        if info.wheel not in files:
            raise UploadMalformedError(f"{MANIFEST} names {info.wheel}, which is not in the package")
        _check_wheel(info.wheel, _member(tf, files[info.wheel]), info.version)
        for other in sorted(n for n in files if n not in (MANIFEST, info.wheel)):
            if not other.startswith(WHEEL_PREFIX) or not other.endswith(".whl"):
                raise UploadMalformedError(
                    f"unexpected file {other!r}: a package holds {MANIFEST} and wheels/"
                )
        return info


def _member(tf: tarfile.TarFile, m: tarfile.TarInfo) -> bytes:
    try:
        fh = tf.extractfile(m)
        if fh is None:
            raise UploadMalformedError(f"cannot read {m.name} from the package")
        return fh.read()
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise UploadMalformedError(f"the tarball is truncated or corrupt at {m.name}: {exc}") from None


def package_path(store: ArtifactStore, sha256: str) -> Path:
    return store.root / f"{sha256}{SUFFIX}"


def register_package(
    engine: Engine, store: ArtifactStore, incoming: IncomingFile | None, *, notes: str | None = None
) -> AgentPackage:
    """Check the received file and register it (a worker thread: it reads the whole package).

    The temp file is always consumed: moved into the store, or deleted. A version uploaded before is a
    conflict (409) whatever its bytes: an agent version names one package for ever, like a model version.
    """
    try:
        if incoming is None or incoming.size == 0:
            raise UploadInvalidError(
                "form field 'file' (the agent package) is required and must not be empty"
            )
        if notes is not None and (len(notes) > MAX_NOTES or "\x00" in notes):
            raise UploadInvalidError(f"notes must be at most {MAX_NOTES} characters, without NUL")
        incoming.close()
        info = inspect_package(incoming.path)
        sha, size = incoming.sha256, incoming.size
        with Session(engine) as s:
            existing = s.exec(select(AgentPackage).where(col(AgentPackage.version) == info.version)).first()
        if existing is not None:
            same = " (the same bytes)" if existing.sha256 == sha else f" (sha256 {existing.sha256[:12]}…)"
            raise UploadConflictError(
                f"agent version {info.version} was already uploaded{same}; versions are immutable: "
                "build and upload a new version"
            )
        dst = package_path(store, sha)
        try:
            os.replace(incoming.path, dst)
        except OSError:
            shutil.copyfile(incoming.path, dst)
            incoming.discard()
        incoming = None
        pkg = AgentPackage(
            version=info.version,
            sha256=sha,
            size=size,
            requires=info.requires,
            notes=notes or None,
            path=str(dst.resolve()),
        )
        try:
            with session_scope(engine) as s:
                s.add(pkg)
                s.commit()
                s.refresh(pkg)
        except IntegrityError:
            raise UploadConflictError(f"agent version {info.version} was uploaded concurrently") from None
        log.info("agent package %s uploaded (sha256 %s, %d bytes)", info.version, sha[:12], size)
        return pkg
    finally:
        if incoming is not None:
            incoming.discard()


# --------------------------------------------------------------------------- lookups


def get_package(s: Session, version: str) -> AgentPackage | None:
    return s.exec(select(AgentPackage).where(col(AgentPackage.version) == version)).first()


def package_by_sha(s: Session, sha256: str) -> AgentPackage | None:
    return s.exec(select(AgentPackage).where(col(AgentPackage.sha256) == sha256)).first()


def list_packages(s: Session) -> list[AgentPackage]:
    return list(s.exec(select(AgentPackage).order_by(col(AgentPackage.uploaded_at), col(AgentPackage.id))))


def package_users(s: Session, version: str) -> tuple[list[str], list[str]]:
    """Who needs the package: deployments that apply it, and devices whose desired state names it
    (now or as the version a failed rollout sends them back to)."""
    applied = (DeploymentState.ACTIVE, DeploymentState.ROLLING_OUT, DeploymentState.CANCELLED)
    deps = list(
        s.exec(
            select(Deployment.name).where(
                col(Deployment.kind) == "agent",
                col(Deployment.agent_version) == version,
                col(Deployment.state).in_(applied),
            )
        )
    )
    devices: list[str] = []
    for dev in s.exec(select(Device).where(col(Device.agent_desired).is_not(None)).order_by(col(Device.id))):
        a = dev.agent_desired or {}
        named = {
            a.get("direct"),
            (a.get("current") or {}).get("version"),
            (a.get("previous") or {}).get("version"),
        }
        if version in named:
            devices.append(dev.id)
    return deps, devices


def delete_package(engine: Engine, version: str) -> None:
    """Remove a package no deployment or device needs (ConflictError naming who does)."""
    with session_scope(engine) as s:
        pkg = get_package(s, version)
        if pkg is None:
            raise NotFoundError(f"agent version {version!r} is not uploaded")
        deps, devices = package_users(s, version)
        if deps:
            raise ConflictError(f"agent {version} is deployed by {', '.join(deps[:10])}; roll it back first")
        if devices:
            raise ConflictError(
                f"agent {version} is desired by devices {', '.join(devices[:10])}"
                + (f" and {len(devices) - 10} more" if len(devices) > 10 else "")
                + "; assign them another version first"
            )
        path = Path(pkg.path)
        s.delete(pkg)
        s.commit()
    path.unlink(missing_ok=True)
    log.info("agent package %s deleted", version)
