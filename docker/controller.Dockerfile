# edgefleet controller: REST API, MQTT bridge, ingest. Not built in CI (no Docker engine there).
FROM python:3.11-slim
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
