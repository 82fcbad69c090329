# edgefleet edge agent, CPU build (onnxruntime CPU execution provider).
# A pinned patch release: tarfile's extraction filters had bypasses (CVE-2025-4517 and others) fixed in
# 3.11.13 and later 3.11 releases. The agent does not rely on them (it refuses links in a package itself).
FROM python:3.11.18-slim
RUN apt-get update && apt-get install -y --no-install-recommends libgl1 libglib2.0-0 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY fleet_protocol fleet_protocol
COPY controller controller
COPY edge_agent edge_agent
RUN pip install --no-cache-dir '.[agent]'
VOLUME /data
# The supervisor runs the agent from its A/B slot (/data/agent/slots), so an agent update deployed from the
# controller installs, restarts into the new version and rolls back on its own; the container's restart
# policy plays systemd's part (docker/systemd/edgefleet-agent.service on a plain host).
ENTRYPOINT ["python", "-m", "edge_agent.supervisor", "--config", "/config/agent.yaml"]
