"""The agent package builder (edge_agent/update/package.py)."""

from __future__ import annotations

import hashlib
import json
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from edge_agent.update.install import install_package, missing_requirements
from edge_agent.update.package import PackageError, build_package, main, pins, set_version, wheel_requirements
from edge_agent.update.slots import SlotStore
from tests.support.paths import REPO


def test_set_version_changes_the_copy_s_project_version_and_dunder_version(tmp_path: Path) -> None:
    (tmp_path / "edge_agent").mkdir()
    (tmp_path / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\n\n[project]\nname = "edgefleet"\nversion = "0.1.0"\n'
        '[tool.x]\nversion = "9"\n'
    )
    (tmp_path / "edge_agent" / "__init__.py").write_text('"""doc"""\n\n__version__ = "0.1.0"\n')
    set_version(tmp_path, "1.1")
    text = (tmp_path / "pyproject.toml").read_text()
    assert 'version = "1.1"' in text and 'version = "9"' in text  # only the [project] one
    assert (tmp_path / "edge_agent" / "__init__.py").read_text() == '"""doc"""\n\n__version__ = "1.1"\n'


def test_pins_are_the_versions_installed_here_and_a_missing_one_is_named() -> None:
    import pydantic

    assert pins([Requirement("pydantic>=2")]) == [f"pydantic=={pydantic.VERSION}"]
    with pytest.raises(PackageError, match="no-such-package-xyz"):
        pins([Requirement("no-such-package-xyz>=1")])


def test_a_bad_version_or_source_is_refused_before_building(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        build_package("../1.1", tmp_path, source=REPO)
    with pytest.raises(PackageError, match="edgefleet repository"):
        build_package("1.1", tmp_path / "out", source=tmp_path)
    assert main(["build", "--version", "1.1", "--out", str(tmp_path / "out"), "--source", str(tmp_path)]) == 1


def test_a_built_package_holds_the_versioned_wheel_and_pins_and_installs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["build", "--version", "1.1", "--out", str(tmp_path), "--source", str(REPO)]) == 0
    path = tmp_path / "edgefleet-agent-1.1.tar.gz"
    printed = capsys.readouterr().out
    assert str(path) in printed and hashlib.sha256(path.read_bytes()).hexdigest() in printed
    with tarfile.open(path) as tar:
        names = sorted(tar.getnames())
        info_file = tar.extractfile("agent-package.json")
        assert info_file is not None
        info = json.loads(info_file.read())
    assert names == ["agent-package.json", "wheels/edgefleet-1.1-py3-none-any.whl"]
    assert info["format"] == 1 and info["version"] == "1.1"
    assert info["wheel"] == "wheels/edgefleet-1.1-py3-none-any.whl"
    assert any(r.startswith("paho-mqtt==") for r in info["requires"])
    assert missing_requirements(info["requires"], __import__("sys").path) == []  # this venv built it
    # The version is in the shipped code, and the source tree was not touched.
    with tarfile.open(path) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    with zipfile.ZipFile(tmp_path / "x" / info["wheel"]) as z:
        assert '__version__ = "1.1"' in z.read("edge_agent/__init__.py").decode()
        assert {r.name for r in wheel_requirements(tmp_path / "x" / info["wheel"])} >= {"paho-mqtt"}
    assert '__version__ = "1.1"' not in (REPO / "edge_agent" / "__init__.py").read_text()
    store = SlotStore(tmp_path / "data")
    assert install_package(path, store, "1.1") == "1.1"
    site = store.site("1.1")
    assert site is not None and (site / "edge_agent" / "update" / "updater.py").is_file()
