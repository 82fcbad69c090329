"""What the operator commands print of agent updates, from a real controller's API answers: the agent
version and update state in ``devices ls`` / ``devices show``, agent versions in ``rollouts show`` of
an agent deployment, and ``--follow``'s progress line ended before the summary."""

from __future__ import annotations

import io
import time
from typing import Any

import pytest

from controller.cli.devices import agent_update, print_device, print_devices
from controller.cli.rollouts import follow_rollout, print_rollout
from fleet_protocol import TopicKind
from fleet_protocol.messages import AgentReported, AgentUpdateState, Availability, Capabilities, ReportedState
from tests.support.agent_packages import make_package
from tests.support.controller_app import Fleet
from tests.support.waiting import wait_for

BROKEN = "exit code 1: ImportError: boom"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _online(fleet: Fleet, device: str, version: str) -> None:
    fleet.client.post("/api/v1/devices", json={"id": device, "labels": {"site": "a"}}).raise_for_status()
    caps = Capabilities(hostname=device, cpu_count=2, cameras=["cam1"])
    fleet.send(
        device, TopicKind.AVAILABILITY, Availability(state="online", agent_version=version, capabilities=caps)
    )
    _report(fleet, device, version)


def _report(
    fleet: Fleet, device: str, version: str, state: AgentUpdateState = AgentUpdateState.IDLE, **kw: Any
) -> None:
    rep = ReportedState(
        ts=time.time(),
        desired_version=fleet.device(device)["desired_version"],
        agent_version=version,
        agent=AgentReported(version=version, slot=version, state=state, **kw),
    )
    fleet.send(device, TopicKind.TWIN_REPORTED, rep)
    wait_for(
        lambda: (fleet.device(device)["agent"] or {}).get("state") == state.value,
        timeout=10,
        what=f"{device} reported agent {version} {state.value}",
    )


def _deployment(fleet: Fleet, name: str) -> dict[str, Any]:
    body: dict[str, Any] = fleet.client.get(f"/api/v1/deployments/{name}").json()
    return body


@pytest.fixture
def failed_canary(fleet: Fleet) -> tuple[Fleet, dict[str, Any]]:
    """An agent rollout of 1.1 whose canary d1 rolled it back, and the deployment as it started."""
    for v in ("1.0", "1.1"):
        r = fleet.client.post(
            "/api/v1/agent-packages", files={"file": (f"edgefleet-agent-{v}.tar.gz", make_package(v))}
        )
        assert r.status_code == 201, r.text
    for d in ("d1", "d2"):
        _online(fleet, d, "1.0")
    r = fleet.client.post(
        "/api/v1/agent-deployments",
        json={
            "name": "agent-11",
            "version": "1.1",
            "selector": "site=a",
            "waves": [1, "100%"],
            "gate": {"soak_s": 0, "step_timeout_s": 30, "offline_timeout_s": 30},
        },
    )
    assert r.status_code == 201, r.text
    started: dict[str, Any] = r.json()
    wait_for(
        lambda: (fleet.device("d1")["agent"] or {}).get("desired") == "1.1", timeout=15, what="d1 sent 1.1"
    )
    _report(fleet, "d1", "1.0", AgentUpdateState.ROLLED_BACK, target="1.1", previous="1.1", error=BROKEN)
    wait_for(
        lambda: _deployment(fleet, "agent-11")["rollout"]["state"] == "failed", timeout=15, what="gate failed"
    )
    return fleet, started


def test_rollouts_show_of_an_agent_deployment_names_agent_versions(
    failed_canary: tuple[Fleet, dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fleet, _ = failed_canary
    monkeypatch.setenv("COLUMNS", "220")
    print_rollout(_deployment(fleet, "agent-11"))
    out = capsys.readouterr().out
    assert "agent 1.1" in out and "deployment failed" in out and "rollout failed" in out, out
    (row,) = [line for line in out.splitlines() if line.startswith("│ d1 ")]
    cells = [c.strip() for c in row.split("│") if c.strip()]
    assert cells[:6] == ["d1", "1", "rolled_back", "1.1", "1.0", "rolled_back"], cells
    assert not any(c.startswith("v") and c[1:].isdigit() for c in cells), cells


def test_devices_ls_and_show_print_the_agent_and_keep_the_failed_update_after_it_moves_on(
    failed_canary: tuple[Fleet, dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fleet, _ = failed_canary
    monkeypatch.setenv("COLUMNS", "220")
    wait_for(
        lambda: (fleet.device("d1")["agent"] or {}).get("desired") == "1.0",
        timeout=15,
        what="d1 sent 1.0 again",
    )
    assert agent_update(fleet.device("d1")["agent"]) == "1.0 (1.1 rolled_back)"
    # Asked for 1.0 again, the agent reports idle, without the error: the view keeps it.
    _report(fleet, "d1", "1.0")
    view = fleet.device("d1")
    assert agent_update(view["agent"]) == "1.0"

    print_devices(fleet.client.get("/api/v1/devices").json())
    listed = capsys.readouterr().out
    assert any("agent" in line and "cameras" in line for line in listed.splitlines()), listed
    (d1,) = [line for line in listed.splitlines() if "│ d1" in line]
    assert "1.0" in d1

    print_device(view)
    shown = capsys.readouterr().out
    assert "agent 1.0" in shown and "update idle" in shown, shown
    assert "last failed update: 1.1 rolled_back" in shown and BROKEN in shown, shown

    # Mid-update: the target and the progress.
    fleet.client.put("/api/v1/devices/d2/agent", json={"version": "1.1"}).raise_for_status()
    _report(fleet, "d2", "1.0", AgentUpdateState.FETCHING, target="1.1", progress_pct=40.0)
    assert agent_update(fleet.device("d2")["agent"]) == "1.0 -> 1.1 fetching 40%"


def test_follow_ends_its_progress_line_before_the_summary(
    failed_canary: tuple[Fleet, dict[str, Any]],
) -> None:
    fleet, started = failed_canary
    answers = iter([started, _deployment(fleet, "agent-11")])

    def get(path: str) -> Any:
        assert path == f"/api/v1/deployments/{started['id']}"
        return next(answers)

    term = _Terminal()
    ended = follow_rollout("http://unused", started, get=get, out=term, interval_s=0.0)
    assert ended["rollout"]["state"] == "failed"
    text = term.getvalue()
    assert text.startswith("\rrollout running") and text.endswith("\n") and text.count("\n") == 1, repr(text)
    assert "\rrollout failed" in text

    answers = iter([started, _deployment(fleet, "agent-11")])
    piped = io.StringIO()
    follow_rollout("http://unused", started, get=get, out=piped, interval_s=0.0)
    lines = piped.getvalue().split("\n")
    assert (
        lines[-1] == "" and lines[0].startswith("rollout running") and lines[1].startswith("rollout failed")
    )
    assert "\r" not in piped.getvalue()
