# edgefleet controller: REST API, MQTT bridge, ingest. Not built in CI (no Docker engine there).
# A pinned patch release: tarfile's extraction filters had bypasses (CVE-2025-4517 and others) fixed in
# 3.11.13 and later 3.11 releases.
FROM python:3.11.18-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY fleet_protocol fleet_protocol
COPY controller controller
COPY edge_agent edge_agent
COPY models models
RUN pip install --no-cache-dir '.[postgres]'
ENV EDGEFLEET_DATA_DIR=/data EDGEFLEET_API_HOST=0.0.0.0 EDGEFLEET_MODELS_DIR=/app/models
VOLUME /data
EXPOSE 8000
ENTRYPOINT ["edgefleet", "controller"]
