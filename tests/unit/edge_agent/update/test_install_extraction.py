"""The agent unpacks an agent package itself and refuses links, devices and names that leave its folder,
without relying on ``tarfile``'s ``filter="data"`` (edge_agent/update/install.py)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from edge_agent.update.install import InstallError, install_package
from edge_agent.update.slots import SlotStore
from tests.support.agent_packages import make_wheel, wheel_name

VERSION = "1.1"
PY = f"{sys.version_info.major}.{sys.version_info.minor}"


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    m = tarfile.TarInfo(name)
    m.size, m.mode = len(data), 0o644
    return m, data


def _link(name: str, target: str, kind: bytes) -> tuple[tarfile.TarInfo, bytes]:
    m = tarfile.TarInfo(name)
    m.type, m.linkname = kind, target
    return m, b""


def _special(name: str, kind: bytes) -> tuple[tarfile.TarInfo, bytes]:
    m = tarfile.TarInfo(name)
    m.type, m.devmajor, m.devminor = kind, 1, 3
    return m, b""


def _package(tmp_path: Path, *members: tuple[tarfile.TarInfo, bytes], before: bool = False) -> Path:
    """A valid package (manifest + wheel) with ``members`` after it (or before it)."""
    info = {
        "format": 1,
        "version": VERSION,
        "python": PY,
        "requires": [],
        "wheel": f"wheels/{wheel_name(VERSION)}",
    }
    valid = [
        _file("agent-package.json", json.dumps(info).encode()),
        _file(f"wheels/{wheel_name(VERSION)}", make_wheel(VERSION)),
    ]
    ordered = [*members, *valid] if before else [*valid, *members]
    path = tmp_path / "pkg.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for m, data in ordered:
            tar.addfile(m, io.BytesIO(data) if m.isreg() else None)
    return path


def _fake_pip(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    # What pip leaves in --target for the wheel: enough for the slot to count as installed.
    site = Path(cmd[cmd.index("--target") + 1])
    (site / "edge_agent").mkdir(parents=True)
    (site / "edge_agent" / "__init__.py").write_text(f'__version__ = "{VERSION}"\n')
    return subprocess.CompletedProcess(cmd, 0, "", "")


def _no_pip(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    raise AssertionError("pip must not run for a refused package")


def _files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if not p.is_dir())


@pytest.mark.parametrize(
    ("member", "why"),
    [
        (_link("wheels/evil", "/etc/passwd", tarfile.SYMTYPE), "holds a link"),
        (_link("wheels/evil", "../../../outside.txt", tarfile.SYMTYPE), "holds a link"),
        (_link("inside", ".", tarfile.SYMTYPE), "holds a link"),
        (_link("wheels/hard", "../../../../outside.txt", tarfile.LNKTYPE), "holds a link"),
        (_link("wheels/hard", "/etc/passwd", tarfile.LNKTYPE), "holds a link"),
        (_link("hard", "agent-package.json", tarfile.LNKTYPE), "holds a link"),
        (_file("../outside.txt", b"x"), "unsafe name"),
        (_file("wheels/../../outside.txt", b"x"), "unsafe name"),
        (_file("/tmp/outside.txt", b"x"), "unsafe name"),
        (_special("dev/null", tarfile.CHRTYPE), "neither a file nor a folder"),
        (_special("dev/sda", tarfile.BLKTYPE), "neither a file nor a folder"),
        (_special("fifo", tarfile.FIFOTYPE), "neither a file nor a folder"),
        (_file("agent-package.json", b"{}"), "twice"),
    ],
    ids=[
        "symlink-absolute",
        "symlink-up",
        "symlink-inside",
        "hardlink-up",
        "hardlink-absolute",
        "hardlink-inside",
        "dotdot",
        "dotdot-nested",
        "absolute",
        "char-device",
        "block-device",
        "fifo",
        "duplicate",
    ],
)
@pytest.mark.parametrize("where", ["after", "before"])
def test_a_package_with_a_link_a_device_or_an_escaping_name_is_refused_and_writes_nothing_outside(
    tmp_path: Path, member: tuple[tarfile.TarInfo, bytes], why: str, where: str
) -> None:
    data = tmp_path / "data"
    store = SlotStore(data)
    (tmp_path / "outside.txt").write_text("the device's own file")
    pkg = _package(tmp_path, member, before=where == "before")
    before = _files_under(tmp_path)

    with pytest.raises(InstallError, match=why):
        install_package(pkg, store, VERSION, pip=_no_pip)

    assert (tmp_path / "outside.txt").read_text() == "the device's own file"
    assert _files_under(tmp_path) == before  # nothing written anywhere, not even inside the store
    assert list(store.slots_dir.iterdir()) == []  # no slot, no install leftovers


def test_links_are_refused_even_before_tarfile_sees_a_member_that_uses_them(tmp_path: Path) -> None:
    # A symlink to a folder outside, then a file written "through" it: refused at the link, so the
    # second member never reaches the disk whatever the interpreter's tarfile would have done.
    outside = tmp_path / "outside"
    outside.mkdir()
    store = SlotStore(tmp_path / "data")
    pkg = _package(
        tmp_path,
        _link("wheels/door", str(outside), tarfile.SYMTYPE),
        _file("wheels/door/planted.txt", b"x"),
    )
    with pytest.raises(InstallError, match="links are refused"):
        install_package(pkg, store, VERSION, pip=_no_pip)
    assert list(outside.iterdir()) == []


def test_a_package_with_folders_and_files_only_installs(tmp_path: Path) -> None:
    folder = tarfile.TarInfo("wheels")
    folder.type, folder.mode = tarfile.DIRTYPE, 0o755
    store = SlotStore(tmp_path / "data")
    pkg = _package(tmp_path, (folder, b""), _file("./docs/NOTICE", b"notice"), before=True)
    assert install_package(pkg, store, VERSION, pip=_fake_pip) == VERSION
    assert store.exists(VERSION)
