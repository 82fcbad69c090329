"""A real Prometheus server (Debian's ``prometheus`` package) scraping a controller, and ``promtool``.

The tests start their own on a free port with a throwaway TSDB, like the broker: what they assert is
what an operator's Prometheus and Grafana would see, not what a parser in the test thinks of the text.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.support.mqtt_broker import free_port
from tests.support.waiting import wait_for

PROMETHEUS_HINT = "the metrics tests need Debian's 'prometheus' package (prometheus and promtool)"


def tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if path is None:
        raise RuntimeError(PROMETHEUS_HINT)
    return path


def promtool_check_metrics(text: str) -> subprocess.CompletedProcess[str]:
    """``promtool check metrics`` on an exposition: exit 0 and no output when it is clean."""
    return subprocess.run(
        [tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )


class PrometheusServer:
    """Scrapes ``target_url``'s ``/metrics`` every second with ``token`` as a bearer credentials file."""

    def __init__(self, workdir: Path, target_url: str, token: str) -> None:
        self.dir = workdir / "prometheus"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        token_file = self.dir / "edgefleet.token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        target = urlsplit(target_url).netloc
        # The same scrape config as the README's, with a one-second interval so rates have samples soon.
        (self.dir / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: edgefleet\n"
            f"    authorization: {{type: Bearer, credentials_file: {token_file}}}\n"
            f"    static_configs: [{{targets: ['{target}']}}]\n"
        )
        self.log = self.dir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> PrometheusServer:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    tool("prometheus"),
                    f"--config.file={self.dir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.dir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_for(self._ready, timeout=timeout, what="prometheus ready", log=self.log)
        return self

    def _ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, "prometheus exited"
        return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector; an error answer fails with Prometheus's own reason."""
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
