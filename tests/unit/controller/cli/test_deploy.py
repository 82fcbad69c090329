"""``edgefleet deploy`` against a real controller app: the camera settings given inline (thresholds per
label, minimum box area, motion) and from a file (zones and lines) reach the stored deployment as the
API has them; a bad option or file is a usage error naming it, and nothing is created."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import controller.cli.deployments as cli_deployments
from controller.cli import app
from tests.support.controller_app import Fleet, cli_request

CAMERAS_YAML = """\
- camera: gate-1
  zones:
    - id: bay
      points: [[0.1, 0.1], [0.5, 0.1], [0.5, 0.5]]
      labels: [person]
  lines:
    - id: door
      a: [0.2, 0.9]
      b: [0.2, 0.1]
"""


@pytest.fixture
def cli(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    """The deploy command's requests go to this controller."""

    monkeypatch.setattr(cli_deployments, "request", cli_request(fleet))
    monkeypatch.setenv("COLUMNS", "400")  # the error box does not wrap the message
    return CliRunner()


def _deploy(cli: CliRunner, *args: str) -> Any:
    return cli.invoke(
        app, ["deploy", "tiny:1", "--select", "site=north", "--no-follow", "--name", "north", *args]
    )


def test_inline_settings_and_a_cameras_file_reach_the_deployment(
    cli: CliRunner, fleet: Fleet, tmp_path: Path
) -> None:
    path = tmp_path / "cameras.yaml"
    path.write_text(CAMERAS_YAML)
    result = _deploy(
        cli,
        "--cameras",
        "gate-2:thresholds=person:0.6+car:0.4,min_box_area=0.002,motion=on,max_fps=5",
        "--cameras-file",
        str(path),
    )
    assert result.exit_code == 0, result.output
    cams = {c["camera"]: c for c in fleet.client.get("/api/v1/deployments/north").json()["cameras"]}
    gate2, gate1 = cams["gate-2"], cams["gate-1"]
    assert gate2["label_thresholds"] == {"person": 0.6, "car": 0.4}
    assert (gate2["min_box_area"], gate2["max_fps"], gate2["motion"]["enabled"]) == (0.002, 5.0, True)
    assert [z["id"] for z in gate1["zones"]] == ["bay"] and gate1["zones"][0]["labels"] == ["person"]
    assert [(ln["id"], ln["a"], ln["b"]) for ln in gate1["lines"]] == [("door", [0.2, 0.9], [0.2, 0.1])]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--cameras", "gate-1:motion=maybe"], "motion=maybe"),
        (["--cameras", "gate-1:thresholds=person:high"], "not a number"),
        (["--cameras-file", "{file}"], "a list of cameras"),
    ],
)
def test_a_bad_camera_option_or_file_is_a_usage_error_and_creates_nothing(
    cli: CliRunner, fleet: Fleet, tmp_path: Path, args: list[str], said: str
) -> None:
    path = tmp_path / "cameras.yaml"
    path.write_text("camera: gate-1\n")  # a mapping, not a list
    result = _deploy(cli, *(a.format(file=path) for a in args))
    assert result.exit_code == 2, result.output
    assert said in result.output
    assert fleet.client.get("/api/v1/deployments/north").status_code == 404
