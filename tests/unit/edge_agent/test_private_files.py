"""The agent's secrets and data are the owner's alone: a broker password file
others may read is refused with the fix named (README promises "mode 0600"), and the data folder the
agent runs in is made 0700 with its outbox and desired state 0600."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from edge_agent import cli as agent_cli
from edge_agent.core.settings import SettingsError, parse_settings


def _config(tmp_path: Path, password_file: Path) -> dict[str, object]:
    return {
        "device_id": "dev-1",
        "mqtt_url": "mqtt://127.0.0.1:1883",
        "mqtt_username": "dev-1",
        "mqtt_password_file": str(password_file),
        "data_dir": str(tmp_path / "data"),
    }


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_password_file_others_may_access_is_refused(tmp_path: Path, mode: int) -> None:
    pw = tmp_path / "mqtt-password"
    pw.write_text("s3cret-from-enrollment\n")
    pw.chmod(mode)
    with pytest.raises(SettingsError) as err:
        parse_settings(_config(tmp_path, pw), env={})
    msg = str(err.value)
    assert "mqtt_password_file" in msg and f"{mode:04o}" in msg and "chmod 600" in msg
    assert "s3cret" not in msg


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_an_owner_only_password_file_is_read(tmp_path: Path, mode: int) -> None:
    pw = tmp_path / "mqtt-password"
    pw.write_text("s3cret-from-enrollment\n")
    pw.chmod(mode)
    settings = parse_settings(_config(tmp_path, pw), env={})
    assert settings.mqtt_url.password is not None
    assert settings.mqtt_url.password.get_secret_value() == "s3cret-from-enrollment"


def test_the_data_folder_is_made_private(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o755)
    for name in ("outbox.db", "outbox.db-wal", "desired.json"):
        (data / name).write_text("x")
        (data / name).chmod(0o644)
    agent_cli.make_data_dir_private(data)
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    for name in ("outbox.db", "outbox.db-wal", "desired.json"):
        assert stat.S_IMODE((data / name).stat().st_mode) == 0o600, name
    fresh = tmp_path / "fresh" / "data"
    agent_cli.make_data_dir_private(fresh)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700


def test_the_agent_runs_with_an_owner_only_umask(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``run`` sets the umask before the agent makes anything (its models, outbox, desired state)."""
    import edge_agent.agent as agent_module

    seen: list[int] = []

    class StopHere(Exception):
        pass

    def fake_from_settings(_settings: object) -> object:
        current = os.umask(0o022)
        os.umask(current)
        seen.append(current)
        raise StopHere

    monkeypatch.setattr(agent_module.Agent, "from_settings", staticmethod(fake_from_settings))
    config = tmp_path / "agent.yaml"
    config.write_text(f"device_id: dev-1\ndata_dir: {tmp_path / 'data'}\n")
    previous = os.umask(0o022)
    try:
        with pytest.raises(StopHere):
            agent_cli.run(config, stack_check=lambda _log: None)
    finally:
        os.umask(previous)
    assert seen == [0o077]
    assert stat.S_IMODE((tmp_path / "data").stat().st_mode) == 0o700
