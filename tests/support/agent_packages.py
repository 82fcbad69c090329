"""Agent packages for tests, made in memory in a second: the tarball format of ``edge_agent.update.package``
(``agent-package.json`` + ``wheels/edgefleet-<version>-py3-none-any.whl``) around a tiny but valid
wheel (a zip with ``*.dist-info/METADATA``, ``WHEEL`` and ``RECORD``).

For the controller's checks and the artifact channel this is all that matters; tests that install and
run the agent build a real one with ``edge_agent.update.package.build_package`` (seconds per version).
Every keyword lets a test break one thing: a manifest field, the wheel's name or metadata, an extra
member.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
import zipfile
from typing import Any

MANIFEST = "agent-package.json"
REQUIRES = ["paho-mqtt==2.1.0", "pydantic==2.11.7"]


def wheel_name(version: str) -> str:
    return f"edgefleet-{version}-py3-none-any.whl"


def make_wheel(version: str, *, name: str = "edgefleet", metadata_version: str | None = None) -> bytes:
    """A minimal wheel of ``name`` whose METADATA says ``metadata_version`` (default ``version``)."""
    dist = f"{name}-{version}.dist-info"
    files = {
        "edge_agent/__init__.py": f'__version__ = "{version}"\n'.encode(),
        f"{dist}/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {metadata_version or version}\n"
        ).encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{p},sha256={hashlib.sha256(b).hexdigest()},{len(b)}\n" for p, b in files.items())
    files[f"{dist}/RECORD"] = (record + f"{dist}/RECORD,,\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(zipfile.ZipInfo(path, date_time=(1980, 1, 1, 0, 0, 0)), data, zipfile.ZIP_DEFLATED)
    return buf.getvalue()


def make_package(
    version: str,
    *,
    manifest: dict[str, Any] | None = None,
    wheel: bytes | None = None,
    wheel_path: str | None = None,
    extra: dict[str, bytes] | None = None,
    omit_manifest: bool = False,
) -> bytes:
    """``edgefleet-agent-<version>.tar.gz`` as bytes; ``manifest`` entries override the valid ones."""
    path = wheel_path or f"wheels/{wheel_name(version)}"
    info: dict[str, Any] = {
        "format": 1,
        "version": version,
        "python": "3.11",
        "requires": list(REQUIRES),
        "wheel": f"wheels/{wheel_name(version)}",
        **(manifest or {}),
    }
    members: dict[str, bytes] = {} if omit_manifest else {MANIFEST: json.dumps(info).encode()}
    members[path] = wheel if wheel is not None else make_wheel(version)
    members.update(extra or {})
    buf = io.BytesIO()
    # gzip's header holds a time: 0 makes the same arguments give the same bytes (and sha256).
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for name, data in members.items():
            m = tarfile.TarInfo(name)
            m.size, m.mode = len(data), 0o644
            tar.addfile(m, io.BytesIO(data))
    return buf.getvalue()
