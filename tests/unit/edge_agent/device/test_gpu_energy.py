"""GPU energy from NVML's cumulative counter, the GPU the agent really uses, and NVML recovery,
on a hand-written fake of the pynvml module. The fake mirrors nvidia-ml-py's API: handles
by index / UUID / PCI bus id, ``nvmlDeviceGetTotalEnergyConsumption`` in mJ (Volta+; NOT_SUPPORTED
before), ``nvmlDeviceGetPowerUsage`` in mW, ``NVMLError.value`` carrying the NVML return code."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from edge_agent.device.health import EnergyMeter, Health, Nvml, visible_devices
from edge_agent.inference.providers import ProviderProbe


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class FakeGpu:
    name: str
    uuid: str
    bus_id: str
    energy_mj: int | None = 0  # None: NOT_SUPPORTED (pre-Volta)
    power_mw: int = 100_000
    lost: bool = False


class FakeNvml:
    NVML_TEMPERATURE_GPU = 0
    NVML_ERROR_UNINITIALIZED = 1
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_GPU_IS_LOST = 15
    NVMLError = NVMLError

    def __init__(self, gpus: list[FakeGpu], init_failures: int = 0) -> None:
        self.gpus = gpus
        self.init_failures = init_failures
        self.inits = 0
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.init_failures:
            self.init_failures -= 1
            raise NVMLError(9)  # DRIVER_NOT_LOADED

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeGpu:
        return self.gpus[i]

    def nvmlDeviceGetHandleByPciBusId(self, bus: bytes) -> FakeGpu:
        return next(g for g in self.gpus if g.bus_id.encode() == bus)

    def nvmlDeviceGetIndex(self, h: FakeGpu) -> int:
        return self.gpus.index(h)

    def nvmlDeviceGetName(self, h: FakeGpu) -> bytes:
        return h.name.encode()

    def nvmlDeviceGetUUID(self, h: FakeGpu) -> str:
        return h.uuid

    def nvmlDeviceGetCudaComputeCapability(self, h: FakeGpu) -> tuple[int, int]:
        return (9, 0)

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu) -> Any:
        return SimpleNamespace(total=80 * 2**30, used=2**30)

    def nvmlDeviceGetUtilizationRates(self, h: FakeGpu) -> Any:
        return SimpleNamespace(gpu=50)

    def nvmlDeviceGetTemperature(self, h: FakeGpu, sensor: int) -> int:
        return 60

    def _check(self, h: FakeGpu) -> None:
        if h.lost:
            raise NVMLError(self.NVML_ERROR_GPU_IS_LOST)

    def nvmlDeviceGetPowerUsage(self, h: FakeGpu) -> int:
        self._check(h)
        return h.power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, h: FakeGpu) -> int:
        self._check(h)
        if h.energy_mj is None:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return h.energy_mj


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def gpus(n: int = 2) -> list[FakeGpu]:
    return [FakeGpu(f"NVIDIA H100 #{i}", f"GPU-{i}aaaa-bbbb", f"00000000:{i + 1:02x}:00.0") for i in range(n)]


def nvml(fake: FakeNvml, clock: Clock, **kw: Any) -> Nvml:
    kw.setdefault("env", {})
    return Nvml(lambda: fake, clock=clock, window_s=5.0, **kw)


# --------------------------------------------------------------------------- energy


def test_energy_comes_from_the_cumulative_counter_and_power_is_its_window_average() -> None:
    clock = Clock()
    fake = FakeNvml(gpus(1))
    nv = nvml(fake, clock)
    gpu = fake.gpus[0]
    gpu.energy_mj = 5_000_000  # 5 kJ since the driver loaded: not the agent's
    first = nv.stats()[0]
    assert first.power_w == pytest.approx(100.0), "no window yet: the NVML power sample"
    # 5 s at 300 W of bursty inference: the counter saw 1500 J whatever the sample said at the heartbeat.
    clock.t += 5.0
    gpu.energy_mj += 1_500_000
    gpu.power_mw = 40_000  # a sample taken between bursts: would alias
    st = nv.stats()[0]
    assert st.power_w == pytest.approx(300.0)
    assert nv.energy() == (pytest.approx(1500.0), "nvml_energy_counter")


def test_without_a_counter_energy_is_power_samples_times_time_and_says_so() -> None:
    clock = Clock()
    fake = FakeNvml(gpus(1))
    fake.gpus[0].energy_mj = None  # pre-Volta: NVML_ERROR_NOT_SUPPORTED
    nv = nvml(fake, clock)
    nv.stats()
    clock.t += 5.0
    fake.gpus[0].power_mw = 200_000
    st = nv.stats()[0]
    assert nv.energy() == (pytest.approx((100 + 200) / 2 * 5.0), "nvml_power_samples")
    assert st.power_w == pytest.approx(150.0)


def test_a_counter_that_restarts_with_the_driver_is_not_counted_negative() -> None:
    meter = EnergyMeter(5.0)
    meter.add_counter(1000.0, 0.0)
    meter.add_counter(1010.0, 5.0)
    meter.add_counter(3.0, 10.0)  # driver reloaded: counts from zero
    assert meter.total_j == pytest.approx(13.0)


def test_health_reports_gpu_energy_and_method_beside_the_heartbeat_figures(tmp_path: Path) -> None:
    clock = Clock()
    fake = FakeNvml(gpus(1))
    h = Health(
        tmp_path,
        cpuinfo=tmp_path / "absent",
        sysfs_root=tmp_path / "no-sysfs",
        nvml=nvml(fake, clock),
        provider_probe=lambda: ProviderProbe(("CUDAExecutionProvider",), ("CUDAExecutionProvider",)),
        clock=clock,
    )
    h.system()
    clock.t += 5.0
    fake.gpus[0].energy_mj = 1_000_000
    sysinfo = h.system()
    assert sysinfo["gpu_platform"] == "nvml"
    assert sysinfo["gpu_energy_j"] == pytest.approx(1000.0)
    assert sysinfo["gpu_energy_method"] == "nvml_energy_counter"
    assert sysinfo["gpus"][0].power_w == pytest.approx(200.0)
    caps = h.capabilities([])
    assert [g.name for g in caps.gpus] == ["NVIDIA H100 #0"]
    assert caps.execution_providers == ["CUDAExecutionProvider"]


# --------------------------------------------------------------------------- which GPU


def test_cuda_visible_devices_parses_like_cuda() -> None:
    assert visible_devices({}) is None
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "0,1,x,2"}) == ["0", "1"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "GPU-12ab, 1"}) == ["GPU-12ab", "1"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "-1"}) == []


def test_a_uuid_in_cuda_visible_devices_selects_that_gpu_only() -> None:
    fake = FakeNvml(gpus(3))
    nv = nvml(fake, Clock(), env={"CUDA_VISIBLE_DEVICES": "GPU-2aaaa"})  # a UUID prefix, as CUDA allows
    assert [(g.index, g.name) for g in nv.info()] == [(2, "NVIDIA H100 #2")]
    assert [s.index for s in nv.stats()] == [2], "energy counts only the GPU the agent can use"
    assert nv.mapping_note is None


def test_indices_follow_pci_order_and_the_inference_gpu_comes_first() -> None:
    fake = FakeNvml(gpus(3))
    env = {"CUDA_VISIBLE_DEVICES": "2,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert [g.index for g in nvml(fake, Clock(), env=env).info()] == [2, 0]
    nv = nvml(fake, Clock(), env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, device_id=1)
    assert [g.index for g in nv.info()] == [1, 0, 2]
    assert nvml(fake, Clock(), env={"CUDA_VISIBLE_DEVICES": ""}).info() == []


def test_without_pci_bus_order_the_mapping_is_flagged_unless_the_cuda_bus_id_is_known() -> None:
    fake = FakeNvml(gpus(2))
    nv = nvml(fake, Clock())
    assert [g.index for g in nv.info()] == [0, 1]
    assert nv.mapping_note is not None and "PCI_BUS_ID" in nv.mapping_note
    # The CUDA runtime says device 0 is the GPU on bus 02: that is NVML's index 1.
    exact = nvml(fake, Clock(), cuda_pci_bus_id=lambda dev: "00000000:02:00.0")
    assert [g.index for g in exact.info()] == [1, 0]
    assert exact.mapping_note is None
    single = nvml(FakeNvml(gpus(1)), Clock())
    single.info()
    assert single.mapping_note is None


# --------------------------------------------------------------------------- recovery


def test_a_lost_gpu_makes_nvml_reinitialise_after_a_backoff() -> None:
    clock = Clock()
    fake = FakeNvml(gpus(1))
    nv = nvml(fake, clock, retry_s=30.0)
    nv.stats()
    fake.gpus[0].lost = True  # Xid / driver reset: the handles are stale
    st = nv.stats()[0]
    assert st.power_w is None
    assert fake.shutdowns == 1 and nv.stats() == [], "not retried before the backoff"
    fake.gpus[0].lost = False
    clock.t += 31.0
    assert [s.index for s in nv.stats()] == [0]
    assert fake.inits == 2


def test_nvml_init_is_retried_with_backoff_but_a_missing_pynvml_is_final() -> None:
    clock = Clock()
    fake = FakeNvml(gpus(1), init_failures=2)
    nv = nvml(fake, clock, retry_s=10.0)
    assert nv.info() == []
    clock.t += 11.0
    assert nv.info() == [] and fake.inits == 2
    clock.t += 11.0
    assert nv.info() == [], "the second backoff is 20 s"
    clock.t += 10.0
    assert [g.index for g in nv.info()] == [0] and fake.inits == 3

    calls: list[int] = []

    def missing() -> Any:
        calls.append(1)
        raise ImportError("No module named 'pynvml'")

    gone = Nvml(missing, clock=clock, env={})
    assert gone.info() == [] and gone.stats() == []
    clock.t += 10_000.0
    assert gone.info() == [] and calls == [1]
