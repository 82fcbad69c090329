"""The agent's inference-stack check: what it reads, what it refuses, and what it tells to install.

Versions come in through the seams of :func:`probe_stack` (metadata lookup, module import, build info,
driver version, L4T release) or as hand-built reports; nothing here needs a GPU, TensorRT or CUDA.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from edge_agent.cli import run
from edge_agent.inference import gpu_stack
from edge_agent.inference.gpu_stack import (
    ALLOW_ENV,
    STACKS,
    StackProblem,
    StackReport,
    check_stack,
    probe_stack,
    startup_check,
)

CU12 = {
    "onnxruntime-gpu": "1.26.0",
    "tensorrt-cu12": "10.16.1.11",
    "tensorrt-cu12-bindings": "10.16.1.11",
    "tensorrt-cu12-libs": "10.16.1.11",
    "cuda-python": "12.9.10",
    "cuda-bindings": "12.9.10",
    "nvidia-ml-py": "12.575.51",
}
CU13 = {
    "onnxruntime-gpu": "1.31.1",
    "tensorrt-cu13": "10.16.1.11",
    "tensorrt-cu13-bindings": "10.16.1.11",
    "cuda-python": "13.4.4",
    "cuda-bindings": "13.4.4",
}
TRT_CU12 = ("tensorrt-cu12", "tensorrt-cu12-bindings", "tensorrt-cu12-libs")


def report(packages: dict[str, str], **kw: Any) -> StackReport:
    """A report as probe_stack would make it from these installed versions."""
    trt = next((packages[n] for n in packages if n.startswith("tensorrt") and "libs" not in n), None)
    kw.setdefault("tensorrt_version", trt)
    kw.setdefault("driver_cuda", "12.8")
    if "onnxruntime-gpu" in packages:
        kw.setdefault("onnxruntime_cuda", f"{gpu_stack.ort_gpu_cuda_major(packages['onnxruntime-gpu'])}.8")
    return StackReport(packages=packages, python="3.12.3", machine="x86_64", **kw)


def fatal(problems: list[StackProblem]) -> list[StackProblem]:
    return [p for p in problems if p.fatal]


# --------------------------------------------------------------------------- probing


def fake_ort(version: str, device: str, providers: list[str]) -> SimpleNamespace:
    return SimpleNamespace(
        __version__=version, get_device=lambda: device, get_available_providers=lambda: providers
    )


def test_probe_reads_versions_providers_build_info_and_the_driver_through_its_seams() -> None:
    installed = {**CU12, "pynvml": "13.0.1"}
    imported: list[str] = []
    providers = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]

    def import_module(name: str) -> Any:
        imported.append(name)
        assert name == "onnxruntime"  # tensorrt has metadata: its version needs no import
        return fake_ort("1.26.0", "GPU", providers)

    r = probe_stack(
        version_of=installed.get,
        import_module=import_module,
        build_info=lambda: {
            "package_name": "onnxruntime-gpu",
            "__version__": "1.26.0",
            "cuda_version": "12.8",
        },
        driver_version=lambda: 12040,
        l4t_release=lambda: None,
    )
    assert imported == ["onnxruntime"]
    assert r.packages == installed
    assert (r.onnxruntime_version, r.onnxruntime_device, r.onnxruntime_cuda) == ("1.26.0", "GPU", "12.8")
    assert r.onnxruntime_providers == tuple(providers)
    assert (r.tensorrt_version, r.tensorrt_cuda_major, r.cuda_python_major) == ("10.16.1.11", 12, 12)
    assert (r.driver_cuda, r.jetson, r.notes) == ("12.4", None, ())
    summary = r.summary()
    for part in ("onnxruntime-gpu 1.26.0 (CUDA 12.8", "Tensorrt/CUDA/CPU", "tensorrt 10.16.1.11 (cu12)"):
        assert part in summary
    assert "cuda-python 12.9.10" in summary and "driver CUDA 12.4" in summary
    assert r.as_dict()["cuda_majors"] == {
        "onnxruntime-gpu 1.26.0": 12,
        "tensorrt-cu12 10.16.1.11": 12,
        "cuda-bindings 12.9.10": 12,
    }


def test_probe_without_imports_and_on_a_cpu_machine_reports_what_is_missing() -> None:
    r = probe_stack(
        version_of={"onnxruntime": "1.32.0"}.get,
        import_module=None,
        build_info=lambda: {"package_name": "onnxruntime", "__version__": "1.32.0"},
        driver_version=lambda: None,
        l4t_release=lambda: None,
    )
    assert r.onnxruntime_version == "1.32.0" and r.onnxruntime_device is None and r.onnxruntime_cuda is None
    assert "tensorrt: not installed" in r.summary() and "no NVIDIA driver" in r.summary()
    assert check_stack(r) == []


def test_an_onnxruntime_that_does_not_import_is_a_note_not_a_crash() -> None:
    def broken(name: str) -> Any:
        raise ImportError("libcublasLt.so.12: cannot open shared object file")

    r = probe_stack(
        version_of={"onnxruntime-gpu": "1.26.0"}.get,
        import_module=broken,
        build_info=dict,
        driver_version=lambda: None,
        l4t_release=lambda: None,
    )
    assert r.onnxruntime_providers == () and r.ort_gpu_cuda_major == 12  # from the version when no build info
    assert any("libcublasLt.so.12" in n for n in r.notes)


def test_tensorrt_without_metadata_is_imported_for_its_version() -> None:
    # JetPack's Debian bindings: an importable `tensorrt` module without pip metadata.
    modules = {"tensorrt": SimpleNamespace(__version__="10.3.0")}
    r = probe_stack(
        version_of={"onnxruntime": "1.26.0", "cuda-python": "12.6.0"}.get,
        import_module=lambda name: modules.get(name) or fake_ort("1.26.0", "CPU", ["CPUExecutionProvider"]),
        build_info=dict,
        driver_version=lambda: 12060,
        l4t_release=lambda: "R36.4.0",
        has_module=lambda name: name in modules,
    )
    assert r.tensorrt_version == "10.3.0" and r.jetson == "R36.4.0" and r.driver_cuda == "12.6"
    assert check_stack(r) == []


def test_real_probes_on_this_machine_never_raise(tmp_path: Path) -> None:
    info = gpu_stack.ort_build_info()  # the onnxruntime of this environment, read without importing it
    import onnxruntime

    assert info.get("__version__") == onnxruntime.__version__
    assert gpu_stack.cuda_driver_version("libno-such-cuda.so.1") is None
    assert gpu_stack.cuda_version_text(12040) == "12.4" and gpu_stack.cuda_version_text(13000) == "13.0"
    release = tmp_path / "nv_tegra_release"
    release.write_text(
        "# R36 (release), REVISION: 4.0, GCID: 37537400, BOARD: generic, EABI: aarch64, DATE: x\n"
    )
    assert gpu_stack.jetson_release(release) == "R36.4.0"
    assert gpu_stack.jetson_release(tmp_path / "absent") is None
    probe_stack().summary()


@pytest.mark.parametrize(
    ("version", "cuda"),
    [("1.17.1", 11), ("1.18.1", 11), ("1.19.0", 12), ("1.26.0", 12), ("1.27.0", 13), ("1.31.1", 13)],
)
def test_onnxruntime_gpu_versions_map_to_the_cuda_major_of_pypis_builds(version: str, cuda: int) -> None:
    assert gpu_stack.ort_gpu_cuda_major(version) == cuda


# --------------------------------------------------------------------------- what is accepted


@pytest.mark.parametrize(("packages", "driver"), [(CU12, "12.8"), (CU12, "13.0"), (CU13, "13.0")])
def test_a_tested_stack_passes(packages: dict[str, str], driver: str) -> None:
    assert check_stack(report(packages, driver_cuda=driver)) == []


def test_the_jetson_stack_passes() -> None:
    jetson = {"tensorrt": "10.4.0", "cuda-python": "12.6.0", "onnxruntime": "1.26.0"}
    assert check_stack(report(jetson, driver_cuda="12.6", jetson="R36.4.0")) == []


# --------------------------------------------------------------------------- what is refused, and the fix


def test_both_onnxruntime_packages_are_refused_naming_the_one_to_keep() -> None:
    (p,) = fatal(check_stack(report({**CU12, "onnxruntime": "1.32.0"})))
    assert "onnxruntime 1.32.0, onnxruntime-gpu 1.26.0" in p.what and "shadows" in p.what
    assert p.fix == "pip uninstall -y onnxruntime onnxruntime-gpu && pip install onnxruntime-gpu==1.26.0"


def test_tensorrt_11_is_refused_with_the_tensorrt_10_to_install() -> None:
    packages = {**CU12, **dict.fromkeys(TRT_CU12, "11.4.0.106")}
    (p,) = fatal(check_stack(report(packages)))
    assert "TensorRT 11.4.0.106" in p.what and "BuilderFlag.FP16/INT8" in p.what
    assert p.fix == (
        "pip uninstall -y tensorrt-cu12 tensorrt-cu12-bindings tensorrt-cu12-libs && "
        "pip install --extra-index-url https://pypi.nvidia.com tensorrt-cu12==10.16.1.11 "
        "(docker/constraints-gpu-cu12.txt)"
    )


def test_tensorrt_8_on_a_jetson_points_at_jetpack_6_1_or_the_jetson_image() -> None:
    packages = {"tensorrt": "8.6.2", "cuda-python": "12.2.0", "onnxruntime": "1.26.0"}
    (p,) = fatal(check_stack(report(packages, driver_cuda="12.2", jetson="R36.2.0")))
    assert "older than the TensorRT 10 API" in p.what
    assert "JetPack 6.1" in p.fix and "docker/agent-jetson.Dockerfile" in p.fix


def test_cuda_python_of_another_cuda_major_is_refused_naming_the_right_one() -> None:
    packages = {**CU12, "cuda-python": "13.4.4", "cuda-bindings": "13.4.4"}
    (p,) = fatal(check_stack(report(packages, driver_cuda="13.0")))
    assert "cuda-bindings 13.4.4 (CUDA 13)" in p.what and "onnxruntime-gpu 1.26.0 (CUDA 12)" in p.what
    assert (
        p.fix
        == "install the CUDA 12 stack: pip install cuda-python==12.9.10 (docker/constraints-gpu-cu12.txt)"
    )


def test_the_newest_onnxruntime_gpu_on_a_cuda12_stack_is_refused() -> None:
    # `pip install onnxruntime-gpu` today: a CUDA 13 build beside CUDA 12 TensorRT and cuda-python.
    packages = {**CU12, "onnxruntime-gpu": "1.31.1"}
    (p,) = fatal(check_stack(report(packages, onnxruntime_cuda="13.0", driver_cuda="13.0")))
    assert "onnxruntime-gpu 1.31.1 (CUDA 13)" in p.what
    # The driver takes either: onnxruntime-gpu's major leads, so TensorRT and cuda-python move to 13.
    assert (
        "pip install --extra-index-url https://pypi.nvidia.com tensorrt-cu13==10.16.1.11 cuda-python==13.4.4"
        in p.fix
    )
    assert p.fix.startswith("install the CUDA 13 stack: pip uninstall -y tensorrt-cu12 ")


def test_a_stack_newer_than_the_driver_is_refused_with_the_stack_the_driver_runs() -> None:
    (p,) = fatal(check_stack(report(CU13, driver_cuda="12.4")))
    assert "supports CUDA up to 12.4" in p.what
    assert "onnxruntime-gpu==1.26.0 tensorrt-cu12==10.16.1.11 cuda-python==12.9.10" in p.fix
    assert "update the NVIDIA driver" in p.fix


def test_mixed_majors_with_an_old_driver_keep_what_the_driver_runs() -> None:
    packages = {**CU12, "onnxruntime-gpu": "1.31.1"}
    (p,) = fatal(check_stack(report(packages, onnxruntime_cuda="13.0", driver_cuda="12.4")))
    assert "different CUDA major versions" in p.what and "too old for onnxruntime-gpu 1.31.1" in p.what
    assert "pip install onnxruntime-gpu==1.26.0 (docker/constraints-gpu-cu12.txt)" in p.fix


def test_two_tensorrt_builds_are_refused() -> None:
    packages = {**CU12, "tensorrt-cu13": "11.4.0.106", "tensorrt-cu13-bindings": "11.4.0.106"}
    problems = fatal(check_stack(report(packages, tensorrt_version="11.4.0.106")))
    assert any("share the `tensorrt` module" in p.what for p in problems)


def test_warnings_that_do_not_stop_the_agent() -> None:
    no_cuda_python = {k: v for k, v in CU12.items() if not k.startswith("cuda")}
    problems = check_stack(report({**no_cuda_python, "pynvml": "11.5.3"}, driver_cuda=None))
    assert fatal(problems) == []
    text = "\n".join(map(str, problems))
    assert "without cuda-python" in text and "pip install cuda-python==12.9.10" in text
    assert "both install the `pynvml` module" in text
    assert "no NVIDIA driver was found" in text


# --------------------------------------------------------------------------- at agent start


def test_startup_logs_the_stack_and_returns_the_refusal(caplog: pytest.LogCaptureFixture) -> None:
    bad = report({**CU12, "onnxruntime": "1.32.0"})
    with caplog.at_level(logging.INFO, logger="edge_agent.inference.gpu_stack"):
        message = startup_check(report=bad, env={})
    assert message is not None and message.startswith("the GPU inference stack does not fit together:")
    assert "fix: pip uninstall -y onnxruntime onnxruntime-gpu" in message and ALLOW_ENV in message
    assert "inference stack: onnxruntime 1.32.0" in caplog.text
    assert startup_check(report=report(CU12), env={}) is None


def test_the_override_starts_anyway_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    bad = report({**CU12, "onnxruntime": "1.32.0"})
    with caplog.at_level(logging.WARNING, logger="edge_agent.inference.gpu_stack"):
        assert startup_check(report=bad, env={ALLOW_ENV: "1"}) is None
    assert f"{ALLOW_ENV} is set" in caplog.text and "shadows" in caplog.text


def test_the_agent_command_exits_2_with_the_message_on_a_mismatched_stack(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text(
        f"device_id: site-1\nmqtt_url: mqtt://broker.local:1883\ndata_dir: {tmp_path / 'data'}\n"
    )
    message = startup_check(report=report({**CU12, "onnxruntime": "1.32.0"}), env={})
    seen: list[logging.Logger] = []

    def check(logger: logging.Logger) -> str | None:
        seen.append(logger)
        return message

    assert run(config, stack_check=check) == 2
    assert seen and "pip uninstall -y onnxruntime onnxruntime-gpu" in capsys.readouterr().err


def test_the_pins_the_fixes_name_are_the_tested_stacks() -> None:
    assert gpu_stack.pins(12) == " ".join(f"{n}=={v}" for n, v in STACKS[12].items())
    assert set(STACKS) == {12, 13}
    for cuda, stack in STACKS.items():
        assert gpu_stack.ort_gpu_cuda_major(stack["onnxruntime-gpu"]) == cuda
        assert gpu_stack.major(stack[f"tensorrt-cu{cuda}"]) == gpu_stack.TENSORRT_MAJOR
        assert gpu_stack.major(stack["cuda-python"]) == cuda


def test_a_driver_older_than_every_stack_asks_for_a_driver_update() -> None:
    (p,) = fatal(check_stack(report(CU12, driver_cuda="11.8")))
    assert "supports CUDA up to 11.8" in p.what
    assert p.fix == "update the NVIDIA driver to one for CUDA 12 (driver r525 or newer)"
