"""The controller's metrics as an operator's Prometheus and Grafana see them: a real Prometheus scrapes a
controller whose agent runs the real detector on the footage, ``promtool`` lints the exposition, and
every query of the bundled Grafana dashboard is evaluated by that Prometheus."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import REPO
from tests.support.prometheus import PrometheusServer, promtool_check_metrics
from tests.support.stack import Stack
from tests.support.waiting import wait_for

DASHBOARD = REPO / "docker" / "grafana-dashboard.json"
DEVICE = "prom-1"
# Series that a CPU-only device without a power meter does not have: their queries must be valid,
# and answer nothing rather than a made-up figure.
UNMEASURED = ("edgefleet_gpu_", "edgefleet_device_energy_")


def dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


@pytest.fixture
def site(tmp_path: Path, broker: MosquittoBroker) -> Iterator[Stack]:
    s = Stack(tmp_path, broker).start()
    try:
        s.agent(DEVICE).start()
        s.deploy(DEVICE)
        s.in_sync(DEVICE, timeout=120)
        yield s
    finally:
        s.stop()


def test_promtool_passes_and_every_dashboard_query_answers_from_a_real_prometheus(
    tmp_path: Path, site: Stack
) -> None:
    viewer = site.call("POST", "/api/v1/tokens", json={"name": "prometheus", "role": "viewer"})["token"]
    with site.controller.client(viewer) as api:
        # Heartbeats carry the camera figures; wait for one that has the running model's latency.
        wait_for(
            lambda: "edgefleet_inference_latency_seconds{" in api.get("/metrics").text,
            timeout=30,
            what="a heartbeat with inference latency",
        )
        text = api.get("/metrics").text
    lint = promtool_check_metrics(text)
    assert lint.returncode == 0 and not (lint.stdout + lint.stderr).strip(), lint.stdout + lint.stderr
    # Base units only: no metric named in milliseconds, percent or bytes-with-prefix.
    names = set(re.findall(r"^# TYPE (\S+)", text, re.MULTILINE))
    assert not [n for n in names if re.search(r"_(ms|milliseconds|percent|pct|kb|mb|mib)(_|$)", n)], names

    prom = PrometheusServer(tmp_path, site.controller.url, viewer).start()
    try:
        wait_for(
            lambda: (
                prom.query('up{job="edgefleet"} == 1')
                and prom.query("count_over_time(edgefleet_camera_fps[1m]) >= 3")
                and prom.query("rate(edgefleet_mqtt_messages_total[1m]) > 0")
            ),
            timeout=60,
            what="prometheus scraped the controller several times",
            log=prom.log,
        )
        queries = dashboard_queries()
        assert len(queries) >= 10
        empty = []
        for title, expr in queries:
            result = prom.query(expr)  # a query Prometheus refuses fails here with its reason
            if not result and not any(prefix in expr for prefix in UNMEASURED):
                empty.append((title, expr))
        assert not empty, f"dashboard panels with no data: {empty}"
        (p50,) = prom.query(f'edgefleet_inference_latency_seconds{{device="{DEVICE}"}}')
        # The detector's median on a CPU, in seconds: a figure in milliseconds would be above 1.
        assert 0.0 < float(p50["value"][1]) < 1.0, p50
    finally:
        prom.stop()
