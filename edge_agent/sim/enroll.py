"""The simulated devices' broker credentials: read from a JSON file, or got by enrolling each device
at a controller over HTTP (``POST /api/v1/devices``), as a real device is set up.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_agent.sim.config import SimulatorError


def load_credentials(path: Path) -> dict[str, str]:
    """``{device_id: password}`` from a JSON file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SimulatorError(f"--credentials {path}: cannot read it as JSON ({exc})") from None
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in data.items()
    ):
        raise SimulatorError(f"--credentials {path}: must be a JSON object {{device_id: password}}")
    return data


@dataclass
class Enrolled:
    """What enrolling the simulated devices gave: each one's broker password (when the controller
    manages broker users) and the artifact public key every answer named (None when they differ)."""

    passwords: dict[str, str]
    public_key: str | None


def enroll_devices(
    api_url: str, token: str | None, device_ids: Sequence[str], *, workers: int = 8, timeout_s: float = 30.0
) -> Enrolled:
    """Enroll each device through ``POST /api/v1/devices`` (idempotent; with broker credentials managed
    by the controller, each gets a new password, returned once). Raises SimulatorError on a refusal."""
    url = api_url.rstrip("/") + "/api/v1/devices"
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"

    def one(device_id: str) -> dict[str, Any]:
        req = urllib.request.Request(
            url, data=json.dumps({"id": device_id}).encode(), headers=headers, method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                answer: dict[str, Any] = json.loads(resp.read())
                return answer
        except urllib.error.HTTPError as exc:
            body = exc.read()[:500].decode(errors="replace")
            raise SimulatorError(f"enrolling {device_id} at {url}: HTTP {exc.code}: {body}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise SimulatorError(f"enrolling {device_id} at {url}: {exc}") from None

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="sim-enroll") as pool:
        answers = list(pool.map(one, device_ids))
    passwords = {a["id"]: a["mqtt_password"] for a in answers if isinstance(a.get("mqtt_password"), str)}
    keys = {a.get("artifact_public_key") for a in answers}
    key = next(iter(keys)) if len(keys) == 1 else None
    return Enrolled(passwords=passwords, public_key=key if isinstance(key, str) else None)
