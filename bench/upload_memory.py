"""What an upload costs the controller's memory: its peak RSS around each hostile upload.

It starts its own Mosquitto and a real ``edgefleet controller`` (variants built on upload, 2
calibration and 4 held-out frames: the builds here are about memory, not figures), and for each step
resets the controller's peak RSS (``/proc/PID/clear_refs``), uploads, waits for the build to end and
prints the controller's ``VmHWM`` against its RSS before the step:

* an agent package of about 1 MB whose wheel member is 1 GiB of zeros (gzip ~1000:1);
* a model computing ``ConstantOfShape([134217728]) -> ReduceSum`` (512 MiB of float32 from 5 KB of
  file; under the default dense cap, so it is built);
* a model whose ``ConstantOfShape`` count comes from the pixels (16 GiB; nothing sizes it before it runs).

Then the build child's own peak, from the controller's log. Linux only (``/proc``).

Usage: ``python -m bench.upload_memory [--skip-runtime-bomb]`` from the checkout.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.mqtt_broker import MosquittoBroker
from tests.support.processes import start_controller
from tests.support.upload_bombs import (
    constant_of_shape_bomb,
    data_dependent_bomb,
    write_gzip_bomb_package,
)
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[1]
MiB = 1024**2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--skip-runtime-bomb",
        action="store_true",
        help="leave out the 16 GiB model (for a controller without limits)",
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="upload-memory-"))
    broker = MosquittoBroker(tmp / "mosquitto")
    broker.start()
    c = start_controller(
        tmp,
        broker,
        EDGEFLEET_BUILD_VARIANTS_ON_UPLOAD="true",
        EDGEFLEET_VARIANT_CALIB_FRAMES="2",
        EDGEFLEET_VARIANT_EVAL_FRAMES="4",
    )
    try:
        assert c.proc is not None
        status = Path(f"/proc/{c.proc.pid}/status")

        def field(name: str) -> int:
            line = next(ln for ln in status.read_text().splitlines() if ln.startswith(f"{name}:"))
            return int(line.split()[1]) // 1024

        def reset() -> int:
            Path(f"/proc/{c.proc.pid}/clear_refs").write_text("5")  # type: ignore[union-attr]
            return field("VmRSS")

        print(f"controller RSS after start: {field('VmRSS')} MiB")
        with c.client() as api:
            api.timeout = 120
            bomb = write_gzip_bomb_package(tmp / "edgefleet-agent-9.9.1.tar.gz", "9.9.1", 1024 * MiB)
            before = reset()
            with bomb.open("rb") as fh:
                r = api.post("/api/v1/agent-packages", files={"file": (bomb.name, fh, "application/gzip")})
            print(
                f"agent package of {bomb.stat().st_size} bytes, 1 GiB member: HTTP {r.status_code}; "
                f"controller peak {field('VmHWM')} MiB (from {before} MiB)"
            )
            models = [("cos512m", constant_of_shape_bomb(134_217_728))]
            if not args.skip_runtime_bomb:
                models.append(("pixels16g", data_dependent_bomb(2**32)))
            for name, raw in models:
                before = reset()
                r = api.post(
                    "/api/v1/models", files={"file": ("model.onnx", raw)}, data={"name": name, "version": "1"}
                )
                t0 = time.monotonic()

                def ended(name: str = name) -> dict[str, Any] | None:
                    info: dict[str, Any] = api.get(f"/api/v1/models/{name}/versions/1").json()
                    return info if info.get("status") != "building" else None

                info = wait_for(ended, timeout=600, what=f"{name} built") if r.status_code == 201 else {}
                print(
                    f"model {name} ({len(raw)} bytes): HTTP {r.status_code}, build {info.get('status')} in "
                    f"{time.monotonic() - t0:.0f} s; controller peak {field('VmHWM')} MiB (from {before} MiB)"
                    + (f"; {str(info['build_error'])[:160]}" if info.get("build_error") else "")
                )
    finally:
        c.stop()
        broker.stop()
    for line in c.log.read_text(errors="replace").splitlines():
        if "peak address space" in line:
            print("build child:", line.split("build_child: ", 1)[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
