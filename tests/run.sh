#!/usr/bin/env bash
# The whole test suite from a fresh clone: installs what it needs, then lint, types and every test.
# Usage: bash tests/run.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

# The tests start their own mosquitto on a free port (tests/mqtt_broker.py).
if ! command -v mosquitto >/dev/null && [ ! -x /usr/sbin/mosquitto ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing the 'mosquitto' package for the MQTT tests"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto >/dev/null
  else
    echo "the tests need the 'mosquitto' binary: install the Debian/Ubuntu package 'mosquitto' (sudo apt-get install mosquitto)" >&2
    exit 1
  fi
fi

# The browser tests drive Debian's chromium through playwright (no browser download).
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing the 'chromium' package for the browser tests"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "the browser tests need /usr/bin/chromium: install the Debian package 'chromium' (sudo apt-get install chromium)" >&2
    exit 1
  fi
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[dev]'

echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy"
.venv/bin/mypy fleet_protocol controller edge_agent
echo "== pytest"
# PostgreSQL-parametrized tests fail instead of skipping when the server is unreachable (tests/databases.py).
export EDGEFLEET_REQUIRE_POSTGRES=${EDGEFLEET_REQUIRE_POSTGRES:-1}
set +e
.venv/bin/pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests"
  rc=0
fi
exit "$rc"
