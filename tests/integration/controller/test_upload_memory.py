"""What an upload can cost a real controller process: its peak resident memory, read from the kernel.

A small agent package that unpacks to a gigabyte, a model that computes gigabytes from a few hundred
bytes, and one whose size depends on the pixels: each is refused with a 4xx or fails its variant build
with the reason, the controller's peak RSS (``VmHWM``, reset through ``/proc/PID/clear_refs`` before each
step) stays within :data:`RSS_GROWTH_BOUND` of where it was, and the API and a good upload work on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.agent_packages import make_package
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.onnx_models import yolov8_like
from tests.support.processes import ControllerProcess, start_controller
from tests.support.upload_bombs import constant_of_shape_bomb, data_dependent_bomb, write_gzip_bomb_package
from tests.support.waiting import wait_for

pytest.importorskip("onnxruntime.quantization")
pytest.importorskip("cv2")

MiB = 1024**2
# The controller's peak may grow by this much over a step: the upload's buffers, the onnx checks. The
# payloads here would cost 512 MiB to 16 GiB if they reached its memory.
RSS_GROWTH_BOUND = 128 * MiB


@pytest.fixture(scope="module")
def controller(
    tmp_path_factory: pytest.TempPathFactory, broker: MosquittoBroker
) -> Iterator[ControllerProcess]:
    c = start_controller(
        tmp_path_factory.mktemp("upload-memory"),
        broker,
        EDGEFLEET_BUILD_VARIANTS_ON_UPLOAD="true",
        # Few frames: the builds here are about memory, not figures.
        EDGEFLEET_VARIANT_CALIB_FRAMES="2",
        EDGEFLEET_VARIANT_EVAL_FRAMES="4",
    )
    yield c
    c.stop()


class PeakRss:
    """The controller's peak resident size since :meth:`reset`, from ``/proc/PID/status``."""

    def __init__(self, c: ControllerProcess) -> None:
        assert c.proc is not None
        self.pid = c.proc.pid
        self.start = 0

    def _field(self, name: str) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(f"{name}:"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no {name} in /proc/{self.pid}/status")

    def reset(self) -> None:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # 5: reset the peak RSS to the current RSS
        self.start = self._field("VmRSS")

    def growth(self) -> int:
        return self._field("VmHWM") - self.start


def _upload_model(api: httpx.Client, raw: bytes, name: str) -> httpx.Response:
    return api.post(
        "/api/v1/models", files={"file": ("model.onnx", raw)}, data={"name": name, "version": "1"}, timeout=60
    )


def _settled(api: httpx.Client, name: str, codes: list[int]) -> dict[str, object] | None:
    """The version once its build has ended; every poll also asks the API something else."""
    codes.append(api.get("/healthz").status_code)
    codes.append(api.get("/api/v1/devices").status_code)
    info: dict[str, object] = api.get(f"/api/v1/models/{name}/versions/1").json()
    return info if info["status"] != "building" else None


def _good_model_builds(api: httpx.Client, name: str) -> None:
    assert _upload_model(api, yolov8_like(), name).status_code == 201
    codes: list[int] = []
    info = wait_for(lambda: _settled(api, name, codes), timeout=300, what=f"{name} built")
    assert info["status"] == "ready", info
    assert {v["variant"] for v in info["variants"]} == {"fp32", "fp16", "int8"}  # type: ignore[attr-defined]


def test_a_gzip_bomb_package_is_refused_without_unpacking_it(
    controller: ControllerProcess, tmp_path: Path
) -> None:
    bomb = write_gzip_bomb_package(tmp_path / "edgefleet-agent-9.9.1.tar.gz", "9.9.1", 1024 * MiB)
    assert bomb.stat().st_size < 2 * MiB
    rss = PeakRss(controller)
    with controller.client() as api:
        rss.reset()
        with bomb.open("rb") as fh:
            r = api.post(
                "/api/v1/agent-packages", files={"file": (bomb.name, fh, "application/gzip")}, timeout=60
            )
        assert r.status_code == 413, r.text
        assert "max_package_member_bytes" in r.json()["detail"]
        assert rss.growth() < RSS_GROWTH_BOUND
        assert (
            api.post(
                "/api/v1/agent-packages", files={"file": ("p.tar.gz", make_package("9.9.2"))}
            ).status_code
            == 201
        )


def test_a_model_computing_more_than_the_dense_cap_is_refused_at_upload(
    controller: ControllerProcess,
) -> None:
    rss = PeakRss(controller)
    with controller.client() as api:
        rss.reset()
        r = _upload_model(api, constant_of_shape_bomb(2**30), "bomb4g")  # 4 GiB of float32, 2 GiB allowed
        assert r.status_code == 413, r.text
        assert "'big' of shape [1073741824]" in r.json()["detail"]
        assert "max_model_dense_bytes" in r.json()["detail"]
        assert rss.growth() < RSS_GROWTH_BOUND
        assert api.get("/api/v1/models/bomb4g/versions/1").status_code == 404


def test_the_half_gigabyte_constant_of_shape_model_is_built_outside_the_controller(
    controller: ControllerProcess,
) -> None:
    # Under the default dense cap, as uploaded in the study of this case: its build materialises it.
    rss = PeakRss(controller)
    with controller.client() as api:
        rss.reset()
        assert _upload_model(api, constant_of_shape_bomb(134_217_728), "bomb512m").status_code == 201
        codes: list[int] = []
        info = wait_for(lambda: _settled(api, "bomb512m", codes), timeout=300, what="the build ended")
        assert info["status"] in ("ready", "failed"), info
        assert set(codes) == {200}
        assert rss.growth() < RSS_GROWTH_BOUND


def test_a_model_outgrowing_the_build_limit_fails_its_build_and_nothing_else(
    controller: ControllerProcess,
) -> None:
    rss = PeakRss(controller)
    with controller.client() as api:
        rss.reset()
        # 16 GiB of float32 whose count comes from the pixels: only the build's child can meet it.
        assert _upload_model(api, data_dependent_bomb(2**32), "bomb16g").status_code == 201
        codes: list[int] = []
        info = wait_for(lambda: _settled(api, "bomb16g", codes), timeout=300, what="the build ended")
        assert info["status"] == "failed", info
        error = str(info["build_error"])
        assert "ran out of its memory limit of 4096 MiB (variant_build_memory_bytes)" in error, error
        assert set(codes) == {200}
        assert rss.growth() < RSS_GROWTH_BOUND
        assert controller.proc is not None and controller.proc.poll() is None
        _good_model_builds(api, "good")
