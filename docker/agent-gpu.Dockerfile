# edgefleet edge agent, NVIDIA GPU build: onnxruntime-gpu (TensorRT + CUDA execution providers),
# tensorrt and NVML. Run with `--gpus all` (NVIDIA Container Toolkit). Never built or run on a GPU
# in this project's CI: see README "What has run on a GPU".
FROM nvcr.io/nvidia/tensorrt:24.08-py3
WORKDIR /app
COPY pyproject.toml README.md ./
COPY fleet_protocol fleet_protocol
COPY controller controller
COPY edge_agent edge_agent
RUN pip install --no-cache-dir '.[gpu]'
VOLUME /data
ENTRYPOINT ["edgefleet", "agent", "--config", "/config/agent.yaml"]
