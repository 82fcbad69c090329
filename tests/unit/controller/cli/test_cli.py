"""The ``edgefleet`` command's wiring: every entry point reaches every command, the README's commands
exist, the group modules stay apart from the package that registers them, and the API client's
token and error rules."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.main

from controller.cli import app
from controller.cli import client as cli_client
from tests.support.paths import REPO

ROOT = REPO
CLI_DIR = ROOT / "controller" / "cli"
# `.venv/bin/edgefleet GROUP SUB` or `` `edgefleet GROUP SUB` `` in prose; SUB may be `a|b|c`.
INVOCATION = re.compile(r"(?:\.venv/bin/|`)edgefleet ([a-z]+)(?: ([a-z|]+)\b)?")


def _root() -> Any:
    """The click group typer builds (typer vendors its own click: read it by its attributes)."""
    return typer.main.get_command(app)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    env.pop("EDGEFLEET_TOKEN", None)
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_python_m_controller_cli_reaches_the_commands_registered_last() -> None:
    """`python -m controller.cli deploy --help`: deploy is registered after the server commands."""
    result = _run("-m", "controller.cli", "deploy", "--help")
    assert result.returncode == 0, result.stderr
    deploy = _root().commands["deploy"]
    options = [opt for p in deploy.params if p.param_type_name == "option" for opt in p.opts]
    assert "--select" in options and "--max-watchdog-restarts" in options and "--api" in options
    missing = [opt for opt in options if opt not in result.stdout]
    assert not missing, f"deploy --help does not name {missing}:\n{result.stdout}"


@pytest.mark.parametrize("module", ["controller", "controller.cli"])
def test_both_module_entry_points_list_every_command(module: str) -> None:
    result = _run("-m", module, "--help")
    assert result.returncode == 0, result.stderr
    for name in _root().commands:
        assert re.search(rf"^\W*{name}\b", result.stdout, re.MULTILINE), f"{name} not in --help"


def test_every_command_the_readme_shows_is_registered() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Operator commands", 1)[1].split("\n## ", 1)[0]
    operator_groups = {group for group, _ in INVOCATION.findall(section)}
    assert {"devices", "deploy", "rollouts", "deployments"} <= operator_groups

    root = _root()
    missing = []
    for name, sub in INVOCATION.findall(readme):
        command = root.commands.get(name)
        if command is None:
            missing.append(name)
        elif hasattr(command, "commands"):
            missing += [f"{name} {s}" for s in sub.split("|") if s and s not in command.commands]
    assert not missing, f"the README shows commands edgefleet does not have: {missing}"


def test_group_modules_do_not_import_the_package_that_registers_them() -> None:
    """controller/cli/__init__ imports every group module; a group importing it back is a cycle."""
    bad = []
    for path in sorted(CLI_DIR.glob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = "." * node.level + (node.module or "")
                if target in ("controller.cli", ".", "..cli"):
                    names = {a.name for a in node.names}
                    if names - {p.stem for p in CLI_DIR.glob("*.py")}:
                        bad.append(f"{path.name}:{node.lineno}")
            elif isinstance(node, ast.Import) and any(a.name == "controller.cli" for a in node.names):
                bad.append(f"{path.name}:{node.lineno}")
    assert not bad, bad


def test_importing_the_cli_loads_no_agent_code() -> None:
    """`edgefleet agent` reaches edge_agent only when it runs: the controller installs without it."""
    result = _run(
        "-c",
        "import sys, controller.cli; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'edge_agent'))",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_api_token_comes_from_option_then_env_then_admin_token_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("EDGEFLEET_TOKEN", raising=False)
    monkeypatch.setenv("EDGEFLEET_DATA_DIR", str(tmp_path))
    assert cli_client.api_token() is None
    (tmp_path / "admin.token").write_text("from-file\n")
    assert cli_client.api_token() == "from-file"
    monkeypatch.setenv("EDGEFLEET_TOKEN", "from-env")
    assert cli_client.api_token() == "from-env"
    reset = cli_client.cli_token.set("from-option")
    try:
        assert cli_client.api_token() == "from-option"
        assert cli_client.http_client("http://127.0.0.1:1", 1).headers["Authorization"] == (
            "Bearer from-option"
        )
    finally:
        cli_client.cli_token.reset(reset)


class _Response:
    def __init__(self, status_code: int, body: Any) -> None:
        self.status_code = status_code
        self._body = body
        self.text = str(body)

    def json(self) -> Any:
        if isinstance(self._body, str):
            raise ValueError("not JSON")
        return self._body


def test_a_failed_request_prints_the_apis_message_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit) as exited:
        cli_client.api_error(_Response(404, {"detail": "no such device"}))
    assert exited.value.exit_code == 1
    assert capsys.readouterr().err == "error: HTTP 404: no such device\n"

    with pytest.raises(typer.Exit):
        cli_client.api_error(_Response(401, {"detail": "missing token"}))
    err = capsys.readouterr().err
    assert err.startswith("error: HTTP 401: missing token\n")
    assert "EDGEFLEET_TOKEN" in err and "edgefleet tokens create" in err

    with pytest.raises(typer.Exit):
        cli_client.api_error(_Response(502, "Bad Gateway"))
    assert capsys.readouterr().err == "error: HTTP 502: Bad Gateway\n"
