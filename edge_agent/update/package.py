"""``python -m edge_agent.update.package build --version 1.1 --out DIR [--source REPO]``: an agent package.

The package (PROTOCOL.md "Agent updates", README "Upgrading the fleet") is a gzip tarball
``edgefleet-agent-<version>.tar.gz`` holding ``agent-package.json`` and ``wheels/``: the edgefleet wheel
built from the source with this version, and the exact versions of its dependencies in the build
environment as pins. A device installs the wheel beside its running version (``--no-index
--no-deps``: devices may be offline) and refuses a package whose pins its environment does not meet,
naming them: the heavy, architecture-specific dependencies (onnxruntime, OpenCV, CUDA/TensorRT) stay
the device's own, and the package stays about a megabyte.

The source is copied to a temporary folder first; the version is set there (``pyproject.toml`` and
``edge_agent/__init__.py``), never in the source tree.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from edge_agent.update.install import PACKAGE_FORMAT, PACKAGE_INFO, PackageInfo

# What of the repository goes into the wheel's build (the rest, tests and models, is not shipped).
SOURCE_PARTS = ("pyproject.toml", "README.md", "fleet_protocol", "controller", "edge_agent")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
_PROJECT_VERSION = re.compile(r'^(version\s*=\s*)"[^"]*"', re.MULTILINE)
_DUNDER_VERSION = re.compile(r'^__version__\s*=\s*"[^"]*"', re.MULTILINE)


class PackageError(Exception):
    """The package cannot be built; the message says why."""


@dataclass(frozen=True)
class BuiltPackage:
    path: Path
    sha256: str
    size: int
    info: PackageInfo


def set_version(source: Path, version: str) -> None:
    """Write ``version`` into the copy at ``source`` (project metadata and ``__version__``)."""
    pyproject = source / "pyproject.toml"
    text = pyproject.read_text()
    project = text.find("[project]")
    head, tail = text[:project], text[project:]
    tail, n = _PROJECT_VERSION.subn(rf'\g<1>"{version}"', tail, count=1)
    if n != 1:
        raise PackageError(f"no version in the [project] table of {pyproject}")
    pyproject.write_text(head + tail)
    init = source / "edge_agent" / "__init__.py"
    text, n = _DUNDER_VERSION.subn(f'__version__ = "{version}"', init.read_text(), count=1)
    if n != 1:
        raise PackageError(f"no __version__ in {init}")
    init.write_text(text)


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The wheel's unconditional dependencies (its extras are the device's business)."""
    with zipfile.ZipFile(wheel) as z:
        name = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
        if name is None:
            raise PackageError(f"{wheel.name} has no METADATA")
        metadata = z.read(name).decode("utf-8")
    reqs = []
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                reqs.append(req)
    return reqs


def pins(reqs: Sequence[Requirement]) -> list[str]:
    """``name==version`` of each requirement as installed in this environment."""
    out, missing = [], []
    for req in reqs:
        try:
            out.append(f"{canonicalize_name(req.name)}=={importlib.metadata.version(req.name)}")
        except importlib.metadata.PackageNotFoundError:
            missing.append(req.name)
    if missing:
        raise PackageError("the build environment lacks: " + ", ".join(sorted(missing)))
    return sorted(out)


def build_package(
    version: str,
    out: Path,
    *,
    source: Path,
    prepare: Callable[[Path], None] | None = None,
    build_isolation: bool = True,
    python: str = sys.executable,
) -> BuiltPackage:
    """Build ``edgefleet-agent-<version>.tar.gz`` in ``out`` from ``source``.

    ``prepare`` edits the temporary copy before the build (tests: a version that crashes at start).
    ``build_isolation`` False builds with this environment's setuptools (offline build hosts; needs
    setuptools >= 77, for the licence expression in pyproject.toml).
    """
    PackageInfo(format=PACKAGE_FORMAT, version=version, python="3.11", wheel="wheels/x.whl")  # validates
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="edgefleet-package-") as tmp:
        copy = Path(tmp) / "src"
        copy.mkdir()
        for part in SOURCE_PARTS:
            src = source / part
            if src.is_dir():
                shutil.copytree(src, copy / part, ignore=_IGNORE)
            elif src.is_file():
                shutil.copy2(src, copy / part)
            else:
                raise PackageError(f"{src} is missing: --source must be the edgefleet repository")
        set_version(copy, version)
        if prepare is not None:
            prepare(copy)
        wheels = Path(tmp) / "wheels"
        cmd = [
            python,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(wheels),
        ]
        if not build_isolation:
            cmd.append("--no-build-isolation")
        done = subprocess.run([*cmd, str(copy)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise PackageError(f"pip wheel failed: {done.stderr.strip()[-2000:]}")
        built = sorted(wheels.glob("edgefleet-*.whl"))
        if len(built) != 1:
            raise PackageError(f"expected one edgefleet wheel, pip made {[p.name for p in built]}")
        wheel = built[0]
        info = PackageInfo(
            format=PACKAGE_FORMAT,
            version=version,
            python=f"{sys.version_info.major}.{sys.version_info.minor}",
            requires=pins(wheel_requirements(wheel)),
            wheel=f"wheels/{wheel.name}",
        )
        path = out / f"edgefleet-agent-{version}.tar.gz"
        _write_tarball(path, info, wheel)
    data = path.read_bytes()
    return BuiltPackage(path, hashlib.sha256(data).hexdigest(), len(data), info)


def _write_tarball(path: Path, info: PackageInfo, wheel: Path) -> None:
    tmp = path.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        raw = json.dumps(info.model_dump(), indent=1).encode()
        member = tarfile.TarInfo(PACKAGE_INFO)
        member.size, member.mode = len(raw), 0o644
        tar.addfile(member, io.BytesIO(raw))
        tar.add(wheel, arcname=info.wheel, recursive=False)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m edge_agent.update.package", description="edgefleet agent packages"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build edgefleet-agent-<version>.tar.gz")
    b.add_argument("--version", required=True, help="the agent version, e.g. 1.1")
    b.add_argument("--out", required=True, type=Path, help="folder the package is written to")
    b.add_argument("--source", type=Path, default=Path.cwd(), help="the edgefleet repository (default: .)")
    b.add_argument(
        "--no-build-isolation",
        action="store_true",
        help="build with this environment's setuptools (>= 77) instead of fetching one",
    )
    args = parser.parse_args(argv)
    try:
        built = build_package(
            args.version, args.out, source=args.source, build_isolation=not args.no_build_isolation
        )
    except (PackageError, ValueError, OSError) as exc:
        print(f"package build failed: {exc}", file=sys.stderr)
        return 1
    print(built.path)
    print(f"sha256 {built.sha256}  size {built.size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
