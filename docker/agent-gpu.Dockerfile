# edgefleet edge agent, x86_64 NVIDIA GPU build, CUDA 12: onnxruntime-gpu (TensorRT + CUDA execution
# providers), TensorRT 10 (the native engine, edge_agent/inference/tensorrt/runtime.py), cuda-python and NVML, pinned to one
# coherent stack by docker/constraints-gpu-cu12.txt. Build from the repository root
# (docker build -f docker/agent-gpu.Dockerfile .); run with `--gpus all` (NVIDIA Container Toolkit) on
# a host whose driver supports CUDA 12 (r525 or newer). The agent checks the stack at start and refuses
# a mismatched one (edge_agent/inference/gpu_stack.py). Never built or run on a GPU in this project's CI: see
# README "What has run on a GPU".
#
# Base: CUDA 12.8 runtime + cuDNN 9 (what onnxruntime-gpu 1.26's CUDA provider links) on Ubuntu 24.04,
# whose Python 3.12 meets requires-python >= 3.11 (the NGC 24.xx TensorRT images have Python 3.10).
# That Python is Ubuntu's 3.12.3 with Ubuntu's own security patches, upstream older than 3.12.11, where
# tarfile's extraction-filter bypasses (CVE-2025-4517 and related) were fixed: treat it as affected. The
# agent unpacks an agent package itself and refuses links, devices and escaping names
# (edge_agent/update/install.py), so it does not depend on tarfile's filters.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv libgl1 libglib2.0-0 \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY docker/constraints-gpu-cu12.txt /etc/edgefleet/constraints.txt
COPY pyproject.toml README.md ./
COPY fleet_protocol fleet_protocol
COPY controller controller
COPY edge_agent edge_agent
# TensorRT's wheels come from NVIDIA's index; the constraints keep every package on CUDA 12.
RUN pip install --no-cache-dir --extra-index-url https://pypi.nvidia.com -c /etc/edgefleet/constraints.txt '.[gpu]'
# onnxruntime's TensorRT provider dlopens libnvinfer.so.10: the pip TensorRT libraries on the loader path.
ENV LD_LIBRARY_PATH=/opt/venv/lib/python3.12/site-packages/tensorrt_libs:${LD_LIBRARY_PATH}
# Packaging smoke test (no GPU during a build): a GPU build of onnxruntime, TensorRT 10 importable, and
# the agent's own stack check finds nothing fatal.
RUN python -c "import onnxruntime as o, tensorrt as t; assert o.get_device() == 'GPU', o.get_device(); print('onnxruntime', o.__version__, 'tensorrt', t.__version__)" \
    && python -c "from edge_agent.inference.gpu_stack import probe_stack, check_stack; r = probe_stack(); print(r.summary()); bad = [str(p) for p in check_stack(r) if p.fatal]; assert not bad, bad"
VOLUME /data
# The supervisor runs the agent from its A/B slot (/data/agent/slots), so an agent update deployed from the
# controller installs, restarts into the new version and rolls back on its own; the container's restart
# policy plays systemd's part (docker/systemd/edgefleet-agent.service on a plain host).
ENTRYPOINT ["python", "-m", "edge_agent.supervisor", "--config", "/config/agent.yaml"]
