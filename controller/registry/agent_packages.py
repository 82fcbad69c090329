"""Agent packages: an uploaded ``edgefleet-agent-<version>.tar.gz`` checked, then stored by sha256.

A package (README "Upgrading the fleet", PROTOCOL.md) is a gzip tarball holding ``agent-package.json``
(format, version, python, pinned ``requires``, the path of the agent's wheel) and ``wheels/`` with the
agent's wheel and optional dependency wheels. Everything is checked here before the package is
registered, so a device is never sent bytes the controller could have told were unusable: the
tarball's members (no absolute or ``..`` paths, no links, bounded count), the manifest's fields, and
the wheel itself (a zip whose ``*.dist-info/METADATA`` names ``edgefleet`` at the package's version).

A few hundred kilobytes of gzip can unpack to gigabytes, so no member is ever held whole in memory: the
tar stream is read through :class:`_CappedStream`, which refuses a stream that unpacks to more than
``max_unpacked_bytes`` and tar headers (long names, pax records) over :data:`MAX_HEADER_BYTES`; a member
whose header declares more than ``max_member_bytes`` is refused before it is inflated; the wheel is
copied to a temp file in the store in blocks and opened there, its zip directory sized before
``zipfile`` parses it, and its entries held to the same two caps by their declared sizes (which
``zipfile`` enforces while it inflates). Only the manifest (at most :data:`MAX_MANIFEST_BYTES`) is read
whole.

The file goes to ``<store>/<sha256>.agent.tar.gz``: beside the models, served by the artifact channel by
its sha256 (``controller.link.artifacts.artifact_file``), and outside the model store's garbage
collection (which only knows ``<sha256>.onnx`` files); deleting the package deletes it.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import re
import shutil
import struct
import tarfile
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path, PurePosixPath
from typing import IO, Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from controller.db.engine import session_scope
from controller.db.states import DeploymentState
from controller.db.tables import AgentPackage, Deployment, Device
from controller.errors import ConflictError, NotFoundError
from controller.registry.store import TMP_PREFIX, ArtifactStore, IncomingFile
from controller.registry.uploads import (
    UploadConflictError,
    UploadInvalidError,
    UploadMalformedError,
    UploadOverLimitError,
)
from fleet_protocol.messages import AgentPackageRef

log = logging.getLogger(__name__)

MANIFEST = "agent-package.json"
FORMAT = 1
SUFFIX = ".agent.tar.gz"
MAX_MEMBERS = 200  # a package holds a manifest and a few wheels
MAX_MANIFEST_BYTES = 256 * 1024
# The settings' defaults (max_package_member_bytes, max_package_unpacked_bytes): a package's wheels are
# zips already, so a real package unpacks to about its upload size (max_upload_bytes, 512 MiB).
MAX_MEMBER_BYTES = 512 * 1024**2
MAX_UNPACKED_BYTES = 1024**3
# Tar headers of a real package: 512 bytes a member, a few pax records; a GNU long name or pax header of
# megabytes is read whole by tarfile, so it is refused before tarfile asks for it.
MAX_HEADER_BYTES = 1024**2
_BLOCK = 1024**2  # bytes a copy step reads
# The agent's own wheel holds a few hundred files; its zip directory is read before zipfile parses it.
MAX_WHEEL_ENTRIES = 20_000
MAX_WHEEL_DIRECTORY_BYTES = 16 * 1024**2
_EOCD = struct.Struct("<4s4H2LH")  # zip's end of central directory record
_EOCD_SIGNATURE = b"PK\x05\x06"
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


def inspect_package(
    path: Path,
    *,
    max_member_bytes: int = MAX_MEMBER_BYTES,
    max_unpacked_bytes: int = MAX_UNPACKED_BYTES,
) -> PackageInfo:
    """Check the tarball at ``path``; its manifest's word, or an UploadError saying why not
    (:class:`UploadOverLimitError` when a member or the whole unpacks to more than its cap)."""
    # Both closed by the ``with`` below; opened apart so that their errors read as "not a tarball".
    gz = gzip.GzipFile(path, mode="rb")
    stream = _CappedStream(gz, max_unpacked_bytes=max_unpacked_bytes)
    try:
        tf = tarfile.open(fileobj=stream, mode="r:")  # type: ignore[call-overload]  # noqa: SIM115
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        gz.close()
        raise UploadMalformedError(f"not a gzip tarball (edgefleet-agent-VERSION.tar.gz): {exc}") from None
    except BaseException:
        gz.close()
        raise
    with gz, tf:
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
                if not m.isreg() or m.issparse():
                    raise UploadMalformedError(
                        f"member {m.name!r} is not a regular file (links are refused, and so are sparse files)"
                    )
                # Checked before tarfile seeks past it to the next header, which would inflate it all.
                if m.size > max_member_bytes:
                    raise UploadOverLimitError(
                        f"member {m.name!r} unpacks to {m.size} bytes, over the limit of {max_member_bytes} "
                        "bytes a file (max_package_member_bytes)"
                    )
                files[safe] = m
        except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
            raise UploadMalformedError(f"the tarball is truncated or corrupt: {exc}") from None
        if MANIFEST not in files:
            raise UploadMalformedError(f"no {MANIFEST} at the top of the package")
        if files[MANIFEST].size > MAX_MANIFEST_BYTES:
            raise UploadMalformedError(f"{MANIFEST} is over {MAX_MANIFEST_BYTES} bytes")
        info = _check_manifest(_read_manifest(_read_small(tf, stream, files[MANIFEST], MAX_MANIFEST_BYTES)))
        if info.wheel not in files:
            raise UploadMalformedError(f"{MANIFEST} names {info.wheel}, which is not in the package")
        for other in sorted(n for n in files if n not in (MANIFEST, info.wheel)):
            if not other.startswith(WHEEL_PREFIX) or not other.endswith(".whl"):
                raise UploadMalformedError(
                    f"unexpected file {other!r}: a package holds {MANIFEST} and wheels/"
                )
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=".whl", dir=path.parent)
        wheel = Path(tmp)
        try:
            with os.fdopen(fd, "wb") as dst:
                _copy_member(tf, stream, files[info.wheel], dst, max_member_bytes)
            _check_wheel(
                info.wheel,
                wheel,
                info.version,
                max_member_bytes=max_member_bytes,
                max_unpacked_bytes=max_unpacked_bytes,
            )
        finally:
            wheel.unlink(missing_ok=True)
        return info


def _check_wheel(
    name: str, path: Path, version: str, *, max_member_bytes: int, max_unpacked_bytes: int
) -> None:
    """The agent's wheel at ``path``: named ``edgefleet-<version>-…whl`` and its METADATA saying the same."""
    parts = PurePosixPath(name).name[: -len(".whl")].split("-")
    if len(parts) < 5 or parts[0].lower().replace("-", "_") != DIST:
        raise UploadMalformedError(f"{name} is not an {DIST} wheel (edgefleet-VERSION-py3-none-any.whl)")
    if _norm_version(parts[1].replace("_", "-")) != _norm_version(version):
        raise UploadMalformedError(f"{name} is version {parts[1]}, the package says {version}")
    _check_zip_directory(name, path)
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
            # zipfile stops inflating an entry at its declared size, so these sums bound the work.
            biggest = max(infos, key=lambda i: i.file_size, default=None)
            if biggest is not None and biggest.file_size > max_member_bytes:
                raise UploadOverLimitError(
                    f"{name}: {biggest.filename} unpacks to {biggest.file_size} bytes, over the limit of "
                    f"{max_member_bytes} bytes a file (max_package_member_bytes)"
                )
            unpacked = sum(i.file_size for i in infos)
            if unpacked > max_unpacked_bytes:
                raise UploadOverLimitError(
                    f"{name} unpacks to {unpacked} bytes, over the limit of {max_unpacked_bytes} bytes "
                    "(max_package_unpacked_bytes)"
                )
            metas = [i for i in infos if re.fullmatch(r"[^/]+\.dist-info/METADATA", i.filename)]
            if len(metas) != 1:
                raise UploadMalformedError(f"{name} has no single *.dist-info/METADATA: not a wheel")
            with zf.open(metas[0]) as fh:
                raw = fh.read(MAX_MANIFEST_BYTES + 1)
            if len(raw) > MAX_MANIFEST_BYTES:
                raise UploadMalformedError(f"{name}: its METADATA is over {MAX_MANIFEST_BYTES} bytes")
            meta = HeaderParser().parsestr(raw.decode("utf-8", "replace"))
            bad = zf.testzip()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, zlib.error) as exc:
        raise UploadMalformedError(f"{name} is not a wheel (zip): {exc}") from None
    if bad is not None:
        raise UploadMalformedError(f"{name} is corrupt: {bad} fails its CRC")
    if (meta.get("Name") or "").strip().lower().replace("_", "-") != DIST:
        raise UploadMalformedError(f"{name}: its METADATA names {meta.get('Name')!r}, not {DIST}")
    if _norm_version(meta.get("Version") or "") != _norm_version(version):
        raise UploadMalformedError(
            f"{name}: its METADATA says version {meta.get('Version')!r}, the package says {version}"
        )


def _check_zip_directory(name: str, path: Path) -> None:
    """Refuse a zip whose central directory is larger than a wheel's before ``zipfile`` parses it:
    ``zipfile`` keeps an object of a few hundred bytes per entry, so a directory of millions of
    46-byte entries would take gigabytes of memory."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        tail_len = min(size, _EOCD.size + 0xFFFF)
        fh.seek(size - tail_len)
        tail = fh.read(tail_len)
    at = tail.rfind(_EOCD_SIGNATURE)
    if at < 0 or len(tail) - at < _EOCD.size:
        raise UploadMalformedError(f"{name} is not a wheel (zip): no end of central directory")
    fields = _EOCD.unpack_from(tail, at)
    entries, directory = fields[4], fields[5]
    if entries == 0xFFFF or directory == 0xFFFFFFFF:
        raise UploadMalformedError(f"{name} is a ZIP64 archive: the agent's wheel is never that large")
    if entries > MAX_WHEEL_ENTRIES or directory > MAX_WHEEL_DIRECTORY_BYTES:
        raise UploadOverLimitError(
            f"{name} lists {entries} files in {directory} bytes of zip directory, over the limit of "
            f"{MAX_WHEEL_ENTRIES} files and {MAX_WHEEL_DIRECTORY_BYTES} bytes"
        )


class _CappedStream:
    """The package's decompressed tar stream, as ``tarfile`` reads it, held to the package's caps.

    ``tarfile`` reads a GNU long name or a pax record whole, and skips a member by seeking past it
    (which inflates everything in between), so the caps must hold at this level: a read or seek past
    ``max_unpacked_bytes`` is refused, and so are tar headers over :data:`MAX_HEADER_BYTES` in all
    (reads while ``payload`` is False: the member copies set it).
    """

    def __init__(self, raw: io.BufferedIOBase, *, max_unpacked_bytes: int) -> None:
        self._raw = raw
        self._max = max_unpacked_bytes
        self._pos = 0
        self._header_bytes = 0
        self.payload = False

    def _over(self) -> UploadOverLimitError:
        return UploadOverLimitError(
            f"the package unpacks to more than {self._max} bytes (max_package_unpacked_bytes)"
        )

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = _BLOCK  # tarfile always asks for a size; never read an unbounded rest at once
        # One byte past the cap is enough to know it is over.
        size = min(size, self._max + 1 - self._pos)
        if not self.payload and self._header_bytes + size > MAX_HEADER_BYTES:
            raise UploadMalformedError(
                f"the package's tar headers (names, pax records) take over {MAX_HEADER_BYTES} bytes"
            )
        data = self._raw.read(size)
        self._pos += len(data)
        if not self.payload:
            self._header_bytes += len(data)
        if self._pos > self._max:
            raise self._over()
        return data

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            target = offset
        elif whence == io.SEEK_CUR:
            target = self._pos + offset
        else:
            raise OSError("the package stream seeks only from its start or its position")
        if target > self._max:
            raise self._over()
        self._raw.seek(target)
        self._pos = target
        return target

    def tell(self) -> int:
        return self._pos


def _member_file(tf: tarfile.TarFile, m: tarfile.TarInfo) -> IO[bytes]:
    fh = tf.extractfile(m)
    if fh is None:
        raise UploadMalformedError(f"cannot read {m.name} from the package")
    return fh


def _read_small(tf: tarfile.TarFile, stream: _CappedStream, m: tarfile.TarInfo, limit: int) -> bytes:
    """A member already known to be at most ``limit`` bytes (the manifest), read in one piece."""
    stream.payload = True
    try:
        with _member_file(tf, m) as fh:
            return fh.read(limit + 1)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise UploadMalformedError(f"the tarball is truncated or corrupt at {m.name}: {exc}") from None
    finally:
        stream.payload = False


def _copy_member(
    tf: tarfile.TarFile, stream: _CappedStream, m: tarfile.TarInfo, dst: IO[bytes], limit: int
) -> None:
    """Copy a member to ``dst`` block by block, refusing it past ``limit`` bytes whatever its header said."""
    stream.payload = True
    copied = 0
    try:
        with _member_file(tf, m) as fh:
            while block := fh.read(_BLOCK):
                copied += len(block)
                if copied > limit:
                    raise UploadOverLimitError(
                        f"member {m.name!r} unpacks to more than {limit} bytes (max_package_member_bytes)"
                    )
                dst.write(block)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise UploadMalformedError(f"the tarball is truncated or corrupt at {m.name}: {exc}") from None
    finally:
        stream.payload = False


def package_path(store: ArtifactStore, sha256: str) -> Path:
    return store.root / f"{sha256}{SUFFIX}"


def register_package(
    engine: Engine,
    store: ArtifactStore,
    incoming: IncomingFile | None,
    *,
    notes: str | None = None,
    max_member_bytes: int = MAX_MEMBER_BYTES,
    max_unpacked_bytes: int = MAX_UNPACKED_BYTES,
) -> AgentPackage:
    """Check the received file and register it (a worker thread: it reads the whole package, in blocks).

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
        info = inspect_package(
            incoming.path, max_member_bytes=max_member_bytes, max_unpacked_bytes=max_unpacked_bytes
        )
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
