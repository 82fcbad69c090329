#!/usr/bin/env bash
# The whole test suite from a fresh clone: installs what it needs, then lint, types and every test.
# Usage: bash tests/run.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

# The tests start their own mosquitto on a free port (tests/support/mqtt_broker.py).
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

# The agent-clock fault tests run the agent under libfaketime (Debian's 'faketime' package).
if ! command -v faketime >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing the 'faketime' package for the clock fault tests"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq faketime >/dev/null
  else
    echo "the clock fault tests need libfaketime: install the Debian package 'faketime' (sudo apt-get install faketime)" >&2
    exit 1
  fi
fi

# The RTSP camera tests stream the footage from GStreamer's RTSP server, run by the Debian python with
# python3-gi (tests/support/rtsp_server.py): x264enc from -ugly, the footage's decoder from -libav.
RTSP_PACKAGES="gir1.2-gst-rtsp-server-1.0 gstreamer1.0-rtsp gstreamer1.0-plugins-base gstreamer1.0-plugins-good gstreamer1.0-plugins-ugly gstreamer1.0-libav python3-gi"
rtsp_ready() {
  [ -x /usr/bin/python3 ] && /usr/bin/python3 -c "
import gi, sys
gi.require_version('Gst', '1.0'); gi.require_version('GstRtspServer', '1.0')
from gi.repository import Gst, GstRtspServer
Gst.init(None)
sys.exit(any(Gst.ElementFactory.find(e) is None for e in ('x264enc', 'avdec_msmpeg4', 'rtph264pay', 'decodebin', 'appsrc')))
" >/dev/null 2>&1
}
if ! rtsp_ready; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing GStreamer's RTSP server packages for the RTSP camera tests"
    # shellcheck disable=SC2086
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $RTSP_PACKAGES >/dev/null
  else
    echo "the RTSP camera tests need GStreamer's RTSP server under /usr/bin/python3: sudo apt-get install $RTSP_PACKAGES" >&2
    exit 1
  fi
fi

# The metrics test scrapes a controller with a real Prometheus and lints with promtool (Debian's 'prometheus').
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing the 'prometheus' package for the metrics test"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
  else
    echo "the metrics test needs prometheus and promtool: install the Debian package 'prometheus' (sudo apt-get install prometheus)" >&2
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
.venv/bin/mypy fleet_protocol controller edge_agent bench
echo "== pytest"
# PostgreSQL-parametrized tests fail instead of skipping when the server is unreachable (tests/support/databases.py).
export EDGEFLEET_REQUIRE_POSTGRES=${EDGEFLEET_REQUIRE_POSTGRES:-1}
# Likewise the browser tests fail instead of skipping without chromium or playwright (tests/browser).
export EDGEFLEET_REQUIRE_BROWSER=${EDGEFLEET_REQUIRE_BROWSER:-1}
# The tests run in a random order (pytest-randomly, in '.[dev]'): pytest's header says
# "Using --randomly-seed=N"; `bash tests/run.sh --randomly-seed=N` replays that order, and
# `bash tests/run.sh -p no:randomly` runs in file order.
# Most tests wait on real processes (brokers, controllers, agents), so they run on several workers
# (pytest-xdist), a test file per worker at a time (module fixtures start processes once); each worker
# takes ports from a range of its own (tests/support/mqtt_broker.py). EDGEFLEET_TEST_WORKERS=0 runs in one process.
WORKERS=${EDGEFLEET_TEST_WORKERS:-3}
XDIST=()
if [ "$WORKERS" != 0 ]; then
  XDIST=(-n "$WORKERS" --dist loadfile)
fi
set +e
.venv/bin/pytest "${XDIST[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  if [ "$#" -gt 0 ]; then
    # Arguments narrowed the run (a -k, a path): collecting nothing is the caller's business.
    echo "pytest collected no tests (the arguments narrowed the run: not a failure)"
    rc=0
  else
    echo "pytest collected no tests from the whole suite: a failure" >&2
  fi
fi
exit "$rc"
