"""A Jetson without NVML reports itself as a Jetson with telemetry, not as a CPU-only device.
The sysfs trees here are built from the documented layout: the kernel's INA3221 hwmon ABI
(``in[123]_label``, ``in[123]_input`` mV, ``curr[123]_input`` mA, ``in7_label`` "sum of shunt
voltages"), Jetson Linux r36's rail names per module, the GPU's devfreq node with ``load`` in
per-mille, and thermal zones in milli-degC (-256 degC when offline)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from edge_agent.device.health import Health, Nvml
from edge_agent.device.jetson import TegraSensors, detect_jetson, parse_tegra_release
from edge_agent.inference.providers import ProviderProbe
from fleet_protocol.codec import decode_as, encode
from fleet_protocol.messages import Availability, Heartbeat

RELEASE = "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, DATE: Wed Jan  8 01:49:37 UTC 2025\n"


def put(root: Path, rel: str, text: str | bytes) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def hwmon(root: Path, device: str, channels: dict[int, tuple[str, float, float]], n: int = 1) -> Path:
    """An INA3221 under the JetPack 6 path: {channel: (label, mV, mA)}; in7 = sum of shunt voltages."""
    base = f"sys/bus/i2c/drivers/ina3221/{device}/hwmon/hwmon{n}"
    for ch, (label, mv, ma) in channels.items():
        put(root, f"{base}/in{ch}_label", label + "\n")
        put(root, f"{base}/in{ch}_input", f"{mv:.0f}\n")
        put(root, f"{base}/curr{ch}_input", f"{ma:.0f}\n")
        put(root, f"{base}/curr{ch}_crit", "5000\n")
    put(root, f"{base}/in7_label", "sum of shunt voltages\n")
    put(root, f"{base}/in7_input", "1234\n")
    put(root, f"{base}/in4_input", "880\n")  # shunt voltage uV of channel 1: no label, no curr4
    return root / base


def orin_nano(root: Path) -> Path:
    """Jetson Orin Nano (tegra234) on JetPack 6: one INA3221 at 1-0040 with VDD_IN first."""
    put(root, "etc/nv_tegra_release", RELEASE)
    put(root, "proc/device-tree/compatible", b"nvidia,p3768-0000+p3767-0005\x00nvidia,tegra234\x00")
    put(root, "proc/device-tree/model", b"NVIDIA Jetson Orin Nano Developer Kit\x00")
    hwmon(
        root,
        "1-0040",
        {1: ("VDD_IN", 5000, 1200), 2: ("VDD_CPU_GPU_CV", 5000, 400), 3: ("VDD_SOC", 5000, 300)},
    )
    gpu = "sys/devices/platform/bus@0/17000000.gpu"
    put(root, f"{gpu}/load", "437\n")  # per-mille
    put(root, f"{gpu}/of_node/name", "gpu\n")
    # /sys/class/devfreq/17000000.gpu/device -> the GPU platform device (a directory in the fake tree)
    put(root, "sys/class/devfreq/17000000.gpu/device/of_node/name", b"gpu\x00")
    put(root, "sys/class/devfreq/17000000.gpu/device/load", "437\n")
    put(root, "sys/class/devfreq/17000000.gpu/cur_freq", "624750000\n")
    zones = [
        ("cpu-thermal", "48500"),
        ("gpu-thermal", "46250"),
        ("cv0-thermal", "-256000"),
        ("tj-thermal", "49000"),
    ]
    for i, (kind, temp) in enumerate(zones):
        put(root, f"sys/class/thermal/thermal_zone{i}/type", kind + "\n")
        put(root, f"sys/class/thermal/thermal_zone{i}/temp", temp + "\n")
    return root


def agx_orin(root: Path) -> Path:
    """Jetson AGX Orin: two INA3221s, no whole-module rail, NC channels."""
    put(root, "proc/device-tree/compatible", b"nvidia,p3737-0000+p3701-0000\x00nvidia,tegra234\x00")
    put(root, "proc/device-tree/model", b"Jetson AGX Orin\x00")
    hwmon(
        root,
        "1-0040",
        {1: ("VDD_GPU_SOC", 5000, 2000), 2: ("VDD_CPU_CV", 5000, 600), 3: ("VIN_SYS_5V0", 5000, 900)},
    )
    hwmon(root, "1-0041", {1: ("NC", 0, 0), 2: ("VDDQ_VDD2_1V8AO", 5000, 200), 3: ("NC", 0, 0)}, n=2)
    put(root, "sys/devices/platform/gpu.0/load", "1000\n")
    put(root, "sys/class/thermal/thermal_zone0/type", "gpu-thermal\n")
    put(root, "sys/class/thermal/thermal_zone0/temp", "51000\n")
    return root


class NoNvml:
    """pynvml installed but no driver (what a JetPack 6 Jetson gives)."""

    class NVMLError(Exception):
        pass

    def nvmlInit(self) -> None:
        raise self.NVMLError("NVML Shared Library Not Found")


def health(
    root: Path, tmp_path: Path, clock: Any = None, usable: tuple[str, ...] = ("CPUExecutionProvider",)
) -> Health:
    kw: dict[str, Any] = {"clock": clock} if clock is not None else {}
    nvml = Nvml(NoNvml, **kw)
    return Health(
        tmp_path,
        cpuinfo=tmp_path / "absent",
        sysfs_root=root,
        nvml=nvml,
        provider_probe=lambda: ProviderProbe(usable, usable),
        jetson_sample_hz=0,
        **kw,
    )


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# --------------------------------------------------------------------------- detection


def test_a_jetson_is_recognised_by_any_documented_marker(tmp_path: Path) -> None:
    info = detect_jetson(orin_nano(tmp_path / "nano"))
    assert info is not None
    assert (info.soc, info.l4t, info.evidence) == ("tegra234", "R36.4.3", "/etc/nv_tegra_release")
    assert info.gpu_name == "Jetson Orin Nano Developer Kit (integrated GPU)"
    assert info.compute_capability == "8.7"

    only_dt = agx_orin(tmp_path / "agx")
    info = detect_jetson(only_dt)
    assert info is not None and info.evidence == "/proc/device-tree/compatible" and info.l4t is None

    soc0 = tmp_path / "soc0"
    put(soc0, "sys/devices/soc0/family", "Tegra\n")
    info = detect_jetson(soc0)
    assert info is not None and info.evidence == "/sys/devices/soc0/family"
    assert info.gpu_name.startswith("Jetson")

    pc = tmp_path / "pc"
    put(pc, "proc/device-tree/compatible", b"raspberrypi,4-model-b\x00brcm,bcm2711\x00")
    put(pc, "sys/devices/soc0/family", "BCM2835\n")
    assert detect_jetson(pc) is None
    assert detect_jetson(tmp_path / "empty") is None


def test_release_line_parses() -> None:
    assert parse_tegra_release(RELEASE) == "R36.4.3"
    assert parse_tegra_release("# R35 (release), REVISION: 6.0, GCID: 1") == "R35.6.0"
    assert parse_tegra_release("garbage") is None


# --------------------------------------------------------------------------- sensors


def test_rails_gpu_load_and_temperatures_from_the_documented_nodes(tmp_path: Path) -> None:
    reading = TegraSensors(orin_nano(tmp_path)).read()
    # mV x mA: VDD_IN 5.0 V x 1.2 A = 6 W; the sum-of-shunts channel and the unlabeled shunt inputs are not rails.
    assert reading.rails == pytest.approx({"VDD_IN": 6.0, "VDD_CPU_GPU_CV": 2.0, "VDD_SOC": 1.5})
    assert (reading.module_power_w, reading.module_power_source) == (pytest.approx(6.0), "VDD_IN")
    assert reading.gpu_load_pct == pytest.approx(43.7)  # 437 per-mille
    assert reading.gpu_temperature_c == pytest.approx(46.25)
    assert "cv0-thermal" not in reading.temperatures_c, "an offline zone (-256 degC) is dropped"


def test_a_module_without_vdd_in_sums_its_rails_and_skips_nc_channels(tmp_path: Path) -> None:
    reading = TegraSensors(agx_orin(tmp_path)).read()
    assert set(reading.rails) == {"VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0", "VDDQ_VDD2_1V8AO"}
    assert reading.module_power_w == pytest.approx(10.0 + 3.0 + 4.5 + 1.0)
    assert reading.module_power_source is not None and reading.module_power_source.startswith("sum of rails")
    assert reading.gpu_load_pct == 100.0  # the fixed gpu.0/load path when there is no devfreq GPU node


def test_missing_or_unreadable_nodes_degrade_to_none(tmp_path: Path) -> None:
    root = tmp_path / "bare"
    put(root, "etc/nv_tegra_release", RELEASE)
    put(root, "sys/class/thermal/thermal_zone0/type", "gpu-thermal\n")
    put(root, "sys/class/thermal/thermal_zone0/temp", "not a number\n")
    reading = TegraSensors(root).read()
    assert reading.rails == {} and reading.module_power_w is None
    assert reading.gpu_load_pct is None and reading.gpu_temperature_c is None


# --------------------------------------------------------------------------- what the device reports


def test_a_jetson_without_nvml_reports_its_gpu_and_a_cpu_device_does_not(tmp_path: Path) -> None:
    jetson = health(orin_nano(tmp_path / "root"), tmp_path, usable=("CPUExecutionProvider",))
    caps = jetson.capabilities(["cam1"])
    (gpu,) = caps.gpus
    assert gpu.name.startswith("Jetson ") and gpu.compute_capability == "8.7"
    assert gpu.memory_total_mb and gpu.memory_total_mb > 0  # unified memory: the system RAM
    back = decode_as(Availability, encode(Availability(state="online", capabilities=caps)))
    assert isinstance(back, Availability) and back.capabilities is not None
    assert back.capabilities.gpus[0].name == gpu.name

    cpu = health(tmp_path / "not-a-jetson", tmp_path)
    assert cpu.capabilities([]).gpus == []
    assert cpu.system()["gpu_platform"] is None and cpu.system()["gpus"] == []


def test_heartbeat_carries_jetson_load_temperature_and_integrated_module_power(tmp_path: Path) -> None:
    root = orin_nano(tmp_path / "root")
    clock = Clock()
    h = health(root, tmp_path, clock=clock)  # first sample at t=1000: 6 W
    vdd_in = next(root.glob("sys/bus/i2c/drivers/ina3221/*/hwmon/hwmon*/curr1_input"))
    clock.t += 2.0
    vdd_in.write_text("2000\n")  # 10 W
    sysinfo = h.system()
    assert sysinfo["gpu_platform"] == "jetson"
    (st,) = sysinfo["gpus"]
    assert st.name.startswith("Jetson") and st.utilization_pct == pytest.approx(43.7)
    assert st.temperature_c == pytest.approx(46.25)
    # trapezoid over 2 s between 6 W and 10 W = 16 J; the average over what was measured = 8 W
    assert sysinfo["gpu_energy_j"] == pytest.approx(16.0)
    assert st.power_w == pytest.approx(8.0)
    assert sysinfo["gpu_energy_method"] == "jetson_ina3221 VDD_IN x time"
    assert sysinfo["jetson"]["rails_w"]["VDD_IN"] == pytest.approx(10.0)
    assert sysinfo["cpu_energy_j"] is None, "no RAPL on the fake ARM tree"
    hb = Heartbeat(ts=0.0, gpus=sysinfo["gpus"])
    back = decode_as(Heartbeat, encode(hb))
    assert isinstance(back, Heartbeat) and back.gpus[0].power_w == pytest.approx(8.0)


def test_the_sampling_thread_integrates_between_heartbeats_and_stops(tmp_path: Path) -> None:
    root = orin_nano(tmp_path / "root")
    h = Health(
        tmp_path,
        cpuinfo=tmp_path / "absent",
        sysfs_root=root,
        nvml=Nvml(NoNvml),
        provider_probe=lambda: ProviderProbe((), ()),
        jetson_sample_hz=50.0,
    )
    assert h.jetson is not None
    thread = h.jetson._thread
    assert thread is not None and thread.name == "jetson-power" and thread.is_alive()
    deadline = 200
    while not h.jetson.meter.total_j and deadline:
        thread.join(0.02)
        deadline -= 1
    assert h.jetson.meter.total_j > 0.0
    h.close()
    assert not thread.is_alive()
