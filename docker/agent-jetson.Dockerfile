# edgefleet edge agent, NVIDIA Jetson Orin with JetPack 6.1/6.2 (L4T r36.4: CUDA 12.6, cuDNN 9.3,
# TensorRT 10.3 with bindings for the system Python 3.10 only). The agent needs Python >= 3.11, so, as
# jetson-containers does for JetPack 6: TensorRT and its Python bindings come from NVIDIA's L4T TensorRT
# tar (its python/ folder has a wheel per CPython) and cuda-python is built from source against the
# JetPack's CUDA. The GPU engine is native TensorRT (edge_agent/inference/tensorrt/runtime.py); onnxruntime on the CPU is the
# fallback, since PyPI has no CUDA 12 onnxruntime-gpu for aarch64. Pins: docker/constraints-jetson-jp6.txt.
#
# Build on the Jetson (or an arm64 builder) from the repository root, with the nvidia runtime as Docker's
# default runtime (as jetson-containers' setup does) so the smoke test below can load the libraries:
#   docker build -f docker/agent-jetson.Dockerfile -t edgefleet-agent:jetson .
#   docker run --runtime nvidia -v /data:/data -v $PWD/agent.yaml:/config/agent.yaml edgefleet-agent:jetson
# The L4T release of the image must match the device's (r36.x). Never built in this project's CI.
#
# Its python3.11 is Ubuntu 22.04's (universe, upstream 3.11.0 with Ubuntu's patches), older than 3.11.13,
# where tarfile's extraction-filter bypasses (CVE-2025-4517 and related) were fixed, and than 3.11.4,
# where the filters themselves arrived: treat it as affected. The agent unpacks an agent package itself
# and refuses links, devices and escaping names (edge_agent/update/install.py), so it does not depend
# on tarfile's filters.
ARG L4T_JETPACK=nvcr.io/nvidia/l4t-jetpack:r36.4.0
FROM ${L4T_JETPACK}
ARG TENSORRT_TAR=https://developer.nvidia.com/downloads/compute/machine-learning/tensorrt/10.4.0/tars/TensorRT-10.4.0.26.l4t.aarch64-gnu.cuda-12.6.tar.gz
ARG CUDA_PYTHON=12.6.0
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3.11 python3.11-venv python3.11-dev git wget build-essential libgl1 libglib2.0-0 \
    && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# TensorRT 10.4 for L4T: its libraries replace the JetPack's 10.3 in the image (the bindings must match
# them), and its cp311 wheel gives this Python the `tensorrt` module.
RUN wget -q -O /tmp/tensorrt.tar.gz "${TENSORRT_TAR}" \
    && mkdir -p /opt/tensorrt && tar -xf /tmp/tensorrt.tar.gz -C /opt/tensorrt --strip-components=1 \
    && rm /tmp/tensorrt.tar.gz \
    && cp -a /opt/tensorrt/lib/. /usr/lib/aarch64-linux-gnu/ && ldconfig \
    && pip install --no-cache-dir /opt/tensorrt/python/tensorrt-*-cp311-none-linux_aarch64.whl \
    && rm -rf /opt/tensorrt/data /opt/tensorrt/doc /opt/tensorrt/samples
# cuda-python for the JetPack's CUDA 12.6, built here against /usr/local/cuda (minutes on an Orin);
# 12.6.0 has `cuda.cudart`, which edge_agent/inference/tensorrt/runtime.py falls back to when `cuda.bindings` is absent.
RUN git clone --depth 1 --branch "v${CUDA_PYTHON}" https://github.com/NVIDIA/cuda-python /tmp/cuda-python \
    && CUDA_HOME=/usr/local/cuda PARALLEL_LEVEL="$(nproc)" \
        pip wheel --no-cache-dir --no-deps -w /tmp/wheels /tmp/cuda-python \
    && pip install --no-cache-dir /tmp/wheels/cuda_python-*.whl \
    && rm -rf /tmp/cuda-python /tmp/wheels
WORKDIR /app
COPY docker/constraints-jetson-jp6.txt /etc/edgefleet/constraints.txt
COPY pyproject.toml README.md ./
COPY fleet_protocol fleet_protocol
COPY controller controller
COPY edge_agent edge_agent
RUN pip install --no-cache-dir -c /etc/edgefleet/constraints.txt '.[agent]'
# Packaging smoke test: TensorRT 10 and cuda-python import for this Python, and the agent's own stack
# check finds nothing fatal.
RUN python -c "import tensorrt as t, onnxruntime as o; from cuda import cudart; print('tensorrt', t.__version__, 'onnxruntime', o.__version__)" \
    && python -c "from edge_agent.inference.gpu_stack import probe_stack, check_stack; r = probe_stack(); print(r.summary()); bad = [str(p) for p in check_stack(r) if p.fatal]; assert not bad, bad"
VOLUME /data
# The supervisor runs the agent from its A/B slot (/data/agent/slots), so an agent update deployed from the
# controller installs, restarts into the new version and rolls back on its own; the container's restart
# policy plays systemd's part (docker/systemd/edgefleet-agent.service on a plain host).
ENTRYPOINT ["python", "-m", "edge_agent.supervisor", "--config", "/config/agent.yaml"]
