"""What ``edgefleet pools`` prints, from a real controller's answers: the pool list, a pool with its
devices, placements and recent moves, a dry-run plan with what would move, be degraded or be unplaced
and why; and ``pools apply`` reading a YAML declaration (its requests sent to the same controller)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import controller.cli.pools as cli_pools
from controller.cli import app
from controller.cli.pools import print_plan, print_pool, print_pools
from tests.support.controller_app import Fleet, cli_request, enroll_measured

POOL = "site-north"
BOXES = ("box-1", "box-2", "box-3")
DECLARATION = """\
name: site-north
selector: site=north
strategy: spread
failback: preferred
cameras:
{cameras}
"""
CAMERA = """\
  - id: door-{i}
    source: rtsp://{{secret:north-cams}}@10.0.0.{i}/stream1
    model: tiny
    version: "1"
    target_fps: {fps}
    min_fps: 4
    priority: {priority}
"""


def _yaml(cameras: int, fps: float = 10, priority: int = 0) -> str:
    body = "".join(CAMERA.format(i=i, fps=fps, priority=priority) for i in range(1, cameras + 1))
    return DECLARATION.format(cameras=body.rstrip("\n"))


@pytest.fixture
def cli(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    """The three devices of site north; the pool commands' requests go to this controller."""
    for box in BOXES:
        enroll_measured(fleet, box, site="north")

    monkeypatch.setattr(cli_pools, "request", cli_request(fleet))
    monkeypatch.setenv("COLUMNS", "220")
    return CliRunner()


def _apply(cli: CliRunner, tmp_path: Path, text: str) -> Any:
    path = tmp_path / "pool.yaml"
    path.write_text(text)
    return cli.invoke(app, ["pools", "apply", str(path)])


def _rows(out: str, first: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.split("│") if c.strip()]
        for line in out.splitlines()
        if line.startswith(f"│ {first}")
    ]


def test_apply_reads_a_yaml_declaration_and_shows_where_each_camera_runs(
    cli: CliRunner, fleet: Fleet, tmp_path: Path
) -> None:
    result = _apply(cli, tmp_path, _yaml(cameras=6))
    assert result.exit_code == 0, result.output
    assert "site-north  select 'site=north'  strategy spread" in result.output
    placed = {row[0]: row[2] for row in _rows(result.output, "door-")}
    assert sorted(placed) == [f"door-{i}" for i in range(1, 7)]
    assert sorted(placed.values()) == ["box-1", "box-1", "box-2", "box-2", "box-3", "box-3"]
    devices = {row[0]: row for row in _rows(result.output, "box-")}
    assert devices["box-1"][1:3] == ["online", "2"] and "(lane 180/800" in devices["box-1"][3]
    assert "N+1: holds" in result.output
    assert fleet.client.get(f"/api/v1/pools/{POOL}").json()["failback"] == "preferred"


def test_apply_refuses_a_file_without_a_name_and_shows_the_apis_refusal(
    cli: CliRunner, fleet: Fleet, tmp_path: Path
) -> None:
    result = _apply(cli, tmp_path, "selector: site=north\ncameras: []\n")
    assert result.exit_code == 2 and "name" in result.output, result.output
    leaky = _yaml(cameras=1).replace("{secret:north-cams}", "admin:pw-123")
    result = _apply(cli, tmp_path, leaky)
    assert result.exit_code == 1, result.output
    assert "HTTP 422" in result.output and "never stored" in result.output and "pw-123" not in result.output
    assert fleet.client.get("/api/v1/pools").json() == []


def test_ls_show_after_a_drain_and_a_move(
    cli: CliRunner, fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _apply(cli, tmp_path, _yaml(cameras=6)).exit_code == 0
    print_pools(fleet.client.get("/api/v1/pools").json())
    (row,) = _rows(capsys.readouterr().out, POOL)
    assert row[:6] == [POOL, "site=north", "spread", "3", "6", "6"]

    before = fleet.client.get(f"/api/v1/pools/{POOL}").json()
    on_2 = sorted(c for c, p in before["placements"].items() if p["device"] == "box-2")
    result = cli.invoke(app, ["pools", "drain", POOL, "box-2"])
    assert result.exit_code == 0, result.output
    drained = fleet.client.get(f"/api/v1/pools/{POOL}").json()["placements"]["door-1"]["device"]
    result = cli.invoke(app, ["pools", "move", POOL, "door-1", "box-3"])
    assert result.exit_code == 0, result.output

    print_pool(fleet.client.get(f"/api/v1/pools/{POOL}").json())
    out = capsys.readouterr().out
    devices = {row[0]: row for row in _rows(out, "box-")}
    assert devices["box-2"][1:4] == ["online", "draining", "0"] and devices["box-2"][4] == "-"
    door1 = {row[0]: row for row in _rows(out, "door-")}["door-1"]
    assert door1[2] == "box-3" and "box-3" in door1[6:], door1
    moves = [line.strip() for line in out.splitlines() if "->" in line]
    for cam in on_2:
        assert any(m.endswith("(cordoned)") and f"{cam}: box-2 -> " in m for m in moves), moves
    if drained != "box-3":
        assert any("door-1:" in m and m.endswith("-> box-3 at 10 FPS (manual)") for m in moves), moves

    result = cli.invoke(app, ["pools", "move", POOL, "door-1", "box-2"])
    assert result.exit_code == 1 and "HTTP 409" in result.output and "draining" in result.output


def test_plan_prints_what_would_move_be_degraded_or_unplaced_and_why(
    cli: CliRunner, fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _apply(cli, tmp_path, _yaml(cameras=6)).exit_code == 0
    view = fleet.client.get(f"/api/v1/pools/{POOL}").json()
    on_1 = sorted(c for c, p in view["placements"].items() if p["device"] == "box-1")

    print_plan(fleet.client.post(f"/api/v1/pools/{POOL}/plan", json={"fail": ["box-1"]}).json())
    out = capsys.readouterr().out
    assert "devices taken as offline: box-1 (nothing is stored)" in out
    moves = [line for line in out.splitlines() if line.startswith("move ")]
    assert sorted(m.split()[1].rstrip(":") for m in moves) == on_1
    assert all("box-1 -> box-" in m and m.endswith("(device_offline)") for m in moves), moves
    assert {row[0] for row in _rows(out, "box-")} == {"box-2", "box-3"}

    print_plan(fleet.client.post(f"/api/v1/pools/{POOL}/plan", json={}).json())
    assert "no camera moves" in capsys.readouterr().out

    # Heavier cameras: losing two devices leaves some degraded and the rest unplaced, each with why.
    assert _apply(cli, tmp_path, _yaml(cameras=6, fps=20)).exit_code == 0
    print_plan(fleet.client.post(f"/api/v1/pools/{POOL}/plan", json={"fail": ["box-1", "box-2"]}).json())
    out = capsys.readouterr().out
    unplaced = [line for line in out.splitlines() if line.startswith("unplaced ")]
    degraded = [line for line in out.splitlines() if line.startswith("degraded ")]
    assert unplaced and all("no room at min FPS 4" in line for line in unplaced), out
    assert degraded and all(" of 20 FPS: " in line for line in degraded), out
    assert "N+1: does NOT hold" in out

    # The same through the command, with --fail repeated.
    result = cli.invoke(app, ["pools", "plan", POOL, "--fail", "box-1", "--fail", "box-2"])
    assert result.exit_code == 0 and "unplaced " in result.output, result.output
