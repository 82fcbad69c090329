# edgefleet edge agent, CPU build (onnxruntime CPU execution provider).
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends libgl1 libglib2.0-0 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY fleet_protocol fleet_protocol
COPY controller controller
COPY edge_agent edge_agent
RUN pip install --no-cache-dir '.[agent]'
VOLUME /data
ENTRYPOINT ["edgefleet", "agent", "--config", "/config/agent.yaml"]
