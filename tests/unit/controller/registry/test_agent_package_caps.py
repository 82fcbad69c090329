"""Agent packages are unpacked within caps: per file, in total, and for tar headers; nothing whole in memory."""

from __future__ import annotations

import gzip
import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from controller.registry.agent_packages import MAX_HEADER_BYTES, inspect_package
from controller.registry.uploads import UploadMalformedError, UploadOverLimitError
from tests.support.agent_packages import make_package, make_wheel, wheel_name
from tests.support.upload_bombs import write_gzip_bomb_package

MiB = 1024**2


def _write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "pkg.tar.gz"
    path.write_bytes(data)
    return path


def _leftovers(folder: Path) -> list[str]:
    return sorted(
        p.name for p in folder.iterdir() if p.name != "pkg.tar.gz" and not p.name.startswith("bomb")
    )


def test_a_valid_package_passes_and_leaves_no_unpacked_wheel_behind(tmp_path: Path) -> None:
    info = inspect_package(
        _write(tmp_path, make_package("1.2.0")), max_member_bytes=MiB, max_unpacked_bytes=MiB
    )
    assert info.version == "1.2.0" and info.wheel == f"wheels/{wheel_name('1.2.0')}"
    assert _leftovers(tmp_path) == []


def test_a_gzip_bomb_member_is_refused_by_its_declared_size(tmp_path: Path) -> None:
    bomb = write_gzip_bomb_package(tmp_path / "bomb.tar.gz", "1.0.0", 64 * MiB)
    assert bomb.stat().st_size < MiB  # a small upload
    with pytest.raises(UploadOverLimitError, match=r"unpacks to 67108864 bytes.*max_package_member_bytes"):
        inspect_package(bomb, max_member_bytes=16 * MiB, max_unpacked_bytes=256 * MiB)
    assert _leftovers(tmp_path) == []


def test_files_each_under_the_member_cap_are_refused_past_the_total(tmp_path: Path) -> None:
    zeros = bytes(3 * MiB)
    pkg = make_package("1.0.0", extra={f"wheels/dep{i}-1.0-py3-none-any.whl": zeros for i in range(4)})
    with pytest.raises(UploadOverLimitError, match="max_package_unpacked_bytes"):
        inspect_package(_write(tmp_path, pkg), max_member_bytes=4 * MiB, max_unpacked_bytes=8 * MiB)


def test_a_zip_bomb_inside_the_wheel_is_refused_before_it_is_inflated(tmp_path: Path) -> None:
    buf = io.BytesIO(make_wheel("1.0.0"))
    with zipfile.ZipFile(buf, "a", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("edge_agent/zeros.bin", bytes(64 * MiB))
    wheel = buf.getvalue()
    assert len(wheel) < MiB
    pkg = make_package("1.0.0", wheel=wheel)
    with pytest.raises(
        UploadOverLimitError, match=r"zeros\.bin unpacks to 67108864 bytes.*max_package_member_bytes"
    ):
        inspect_package(_write(tmp_path, pkg), max_member_bytes=16 * MiB, max_unpacked_bytes=256 * MiB)
    with pytest.raises(UploadOverLimitError, match="max_package_unpacked_bytes"):
        inspect_package(_write(tmp_path, pkg), max_member_bytes=128 * MiB, max_unpacked_bytes=32 * MiB)
    assert _leftovers(tmp_path) == []


def test_a_huge_tar_header_is_refused_before_tarfile_reads_it_whole(tmp_path: Path) -> None:
    # A GNU long name (or a pax record) is read by tarfile in one piece: 8 MiB of name here.
    buf = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar,
    ):
        m = tarfile.TarInfo("wheels/" + "x" * (8 * MiB) + ".whl")
        m.size = 0
        tar.addfile(m, io.BytesIO(b""))
    with pytest.raises(UploadMalformedError, match=f"tar headers .* over {MAX_HEADER_BYTES} bytes"):
        inspect_package(_write(tmp_path, buf.getvalue()), max_member_bytes=MiB, max_unpacked_bytes=64 * MiB)


def test_a_wheel_listing_more_files_than_a_wheel_holds_is_refused_before_zipfile_parses_it(
    tmp_path: Path,
) -> None:
    buf = io.BytesIO(make_wheel("1.0.0"))
    with zipfile.ZipFile(buf, "a", zipfile.ZIP_STORED) as zf:
        for i in range(30_000):
            zf.writestr(f"f/{i}", b"")
    pkg = make_package("1.0.0", wheel=buf.getvalue())
    with pytest.raises(UploadOverLimitError, match=r"files in .* bytes of zip directory"):
        inspect_package(_write(tmp_path, pkg), max_member_bytes=64 * MiB, max_unpacked_bytes=64 * MiB)
