"""The deployment files for controller replicas (``docker/compose.scale.yaml``, ``docker/haproxy.cfg``,
``docker/k8s/``): they parse, start the replicas the way the controller needs (schema migrated first,
one signing key, one admin token, one artifact store, one database, unique replica ids, readiness on
``/healthz``, no sticky routing), name only real ``EDGEFLEET_*`` settings, and the EMQX ACL is the wire
contract's.

Linters that are no dependency of the project run where they are installed and are skipped, naming
the tool, where they are not: ``haproxy -c``, ``kubectl kustomize``, ``yamllint``,
``kubernetes-validate`` and ``docker compose config``. Nothing here starts a container or a cluster.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import posixpath
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from controller.settings import ControllerSettings
from fleet_protocol import DEFAULT_PREFIX
from fleet_protocol.topics import SPECS

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.scale.yaml"
HAPROXY = DOCKER / "haproxy.cfg"
K8S = DOCKER / "k8s"
OUR_YAML = [COMPOSE, *sorted(K8S.glob("*.yaml"))]

Doc = dict[str, Any]


@cache
def load_all(path: Path) -> tuple[Doc, ...]:
    return tuple(d for d in yaml.safe_load_all(path.read_text()) if d is not None)


def compose() -> Doc:
    (doc,) = load_all(COMPOSE)
    return doc


def service(name: str) -> Doc:
    svc: Doc = compose()["services"][name]
    return svc


def k8s(kind: str, name: str | None = None) -> Doc:
    found = [
        d
        for path in sorted(K8S.glob("*.yaml"))
        for d in load_all(path)
        if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"{kind} {name or ''}: {len(found)} found"
    return found[0]


def controller_pod() -> Doc:
    spec: Doc = k8s("Deployment", "edgefleet-controller")["spec"]["template"]["spec"]
    return spec


def container(pod: Doc, name: str, *, init: bool = False) -> Doc:
    (c,) = [c for c in pod["initContainers" if init else "containers"] if c["name"] == name]
    return c


def setting_names() -> set[str]:
    return {f"EDGEFLEET_{name.upper()}" for name in ControllerSettings.model_fields}


def haproxy_lines() -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in HAPROXY.read_text().splitlines())
    return [line for line in lines if line]


def haproxy_seconds(value: str) -> float:
    """HAProxy's time format: a number and a unit (``us``, ``ms``, ``s``, ``m``, ``h``, ``d``; ms alone)."""
    match = re.fullmatch(r"(\d+)(us|ms|s|m|h|d)?", value)
    assert match, value
    unit = {"us": 1e-6, "ms": 1e-3, None: 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]
    return int(match[1]) * unit


def haproxy_section(header: str) -> list[str]:
    """The lines of one section (``backend controllers``), without the header."""
    lines = haproxy_lines()
    start = lines.index(header) + 1
    keywords = ("global", "defaults", "frontend ", "backend ", "listen ", "resolvers ")
    end = next((i for i in range(start, len(lines)) if lines[i].startswith(keywords)), len(lines))
    return lines[start:end]


# --- every file parses ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", OUR_YAML, ids=lambda p: str(p.relative_to(DOCKER)))
def test_every_yaml_file_parses_into_mappings(path: Path) -> None:
    docs = load_all(path)
    assert docs, f"{path} holds no document"
    assert all(isinstance(d, dict) for d in docs)
    if path.parent == K8S and path.name != "kustomization.yaml":
        assert all({"apiVersion", "kind", "metadata"} <= d.keys() for d in docs)


# --- compose -----------------------------------------------------------------------------------------


def test_compose_migrates_once_before_any_replica_starts() -> None:
    migrate, ctl = service("migrate"), service("controller")
    assert migrate["entrypoint"] == ["edgefleet", "migrate"]
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "healthcheck" in service("postgres"), "service_healthy needs the database's healthcheck"
    # service_started would let a replica race the migration; completed_successfully waits for exit 0.
    assert ctl["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert migrate["image"] == ctl["image"], "the schema is migrated by the code the replicas run"
    assert migrate.get("restart", "no") == "no"


def test_compose_runs_several_identical_replicas_sharing_what_they_must() -> None:
    doc, ctl, migrate = compose(), service("controller"), service("migrate")
    env: dict[str, str] = ctl["environment"]
    assert ctl["deploy"]["replicas"] >= 2
    # One value here would be every replica's; the default is unique per process.
    assert "EDGEFLEET_REPLICA_ID" not in env
    assert "container_name" not in ctl, "a fixed container name allows one replica only"
    assert not ctl.get("ports"), "replicas are reached through the load balancer only"
    assert env["EDGEFLEET_MQTT_SHARE_GROUP"].strip()
    assert env["EDGEFLEET_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert env["EDGEFLEET_DATABASE_URL"] == migrate["environment"]["EDGEFLEET_DATABASE_URL"]
    # The artifact store is one named volume mounted at the same path in every replica.
    mounts = dict(v.split(":")[1::-1] for v in ctl["volumes"])  # target -> source
    assert mounts[env["EDGEFLEET_STORE_DIR"]] in doc["volumes"]
    # The signing key and the admin token are files of compose secrets, the same for every replica.
    for setting in ("EDGEFLEET_SIGNING_KEY_FILE", "EDGEFLEET_ADMIN_TOKEN_FILE"):
        folder, name = posixpath.split(env[setting])
        assert folder == "/run/secrets" and name in ctl["secrets"] and name in doc["secrets"], setting
    assert "EDGEFLEET_ADMIN_TOKEN" not in env, "one token: from the secret file, not also inline"


def test_compose_load_balancer_is_the_only_forwarder_the_replicas_trust() -> None:
    ctl, lb, doc = service("controller"), service("lb"), compose()
    assert any(v.startswith("./haproxy.cfg:") for v in lb["volumes"])
    assert [p.split(":")[-1] for p in lb["ports"]] == ["8000"]
    lb_address = lb["networks"]["api"]["ipv4_address"]
    assert ctl["environment"]["FORWARDED_ALLOW_IPS"] == lb_address
    assert "api" in ctl["networks"]
    subnet = ipaddress.ip_network(doc["networks"]["api"]["ipam"]["config"][0]["subnet"])
    assert ipaddress.ip_address(lb_address) in subnet


def test_compose_controller_environment_is_valid_controller_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [n for n in os.environ if n.startswith("EDGEFLEET_")]:
        monkeypatch.delenv(name)  # only the file's settings count
    env = service("controller")["environment"]
    # Compose's ${VAR} interpolations stand for secrets: any strong value will do here.
    values: dict[str, Any] = {
        k.removeprefix("EDGEFLEET_").lower(): re.sub(r"\$\{[^}]*\}", "Xq7-strong-dummy-secret-9", v)
        for k, v in env.items()
        if k.startswith("EDGEFLEET_")
    }
    # Validation refuses a share group on SQLite or without one admin token for every replica.
    settings = ControllerSettings(**values)
    assert settings.mqtt_share_group == env["EDGEFLEET_MQTT_SHARE_GROUP"]
    assert settings.resolved_database_url().startswith("postgresql+psycopg://")
    assert settings.mqtt_target().host == "mosquitto" and "mosquitto" in compose()["services"]


# --- haproxy -------------------------------------------------------------------------------------


def test_haproxy_checks_healthz_and_is_not_sticky() -> None:
    backend = haproxy_section("backend controllers")
    assert "option httpchk" in backend
    assert "http-check send meth GET uri /healthz" in backend
    assert "http-check expect status 200" in backend
    sticky = [line for line in backend if line.split()[0] in ("cookie", "stick", "stick-table", "hash-type")]
    assert not sticky and "balance source" not in backend
    (template,) = [line for line in backend if line.startswith("server-template ")]
    _, _, slots, target = template.split()
    host, port = target.split(":")
    assert host == "controller" and host in compose()["services"]
    assert int(port) == ControllerSettings.model_fields["api_port"].default
    assert int(slots) >= service("controller")["deploy"]["replicas"]


def test_haproxy_keeps_a_quiet_websocket_open() -> None:
    # The live view is a WebSocket; after the upgrade HAProxy applies "timeout tunnel", and without
    # it "timeout client/server" (seconds) would cut a live view that has had nothing to say.
    defaults = haproxy_section("defaults")
    assert "mode http" in defaults
    (tunnel,) = [line for line in defaults if line.startswith("timeout tunnel ")]
    assert haproxy_seconds(tunnel.split()[-1]) >= 600


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed (Debian: haproxy)")
def test_haproxy_accepts_the_config() -> None:
    done = subprocess.run(["haproxy", "-c", "-f", str(HAPROXY)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr


# --- kubernetes ----------------------------------------------------------------------------------


def test_k8s_replicas_are_ready_on_healthz_and_live_on_their_port() -> None:
    assert k8s("Deployment", "edgefleet-controller")["spec"]["replicas"] >= 2
    ctl = container(controller_pod(), "controller")
    ports = {p["name"]: p["containerPort"] for p in ctl["ports"]}
    assert ports["http"] == ControllerSettings.model_fields["api_port"].default
    probe = ctl["readinessProbe"]["httpGet"]
    assert probe["path"] == "/healthz" and probe["port"] in ("http", ports["http"])
    # /healthz is 503 while the database is down: as liveness it would restart every replica at once.
    assert ctl["livenessProbe"].get("httpGet", {}).get("path") != "/healthz"


def test_k8s_replica_id_is_the_pod_name() -> None:
    env = {e["name"]: e for e in container(controller_pod(), "controller")["env"]}
    assert env["EDGEFLEET_REPLICA_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "EDGEFLEET_REPLICA_ID" not in k8s("ConfigMap", "edgefleet-controller")["data"]


def test_k8s_signing_key_and_admin_token_come_from_a_secret_as_private_files() -> None:
    pod = controller_pod()
    config = k8s("ConfigMap", "edgefleet-controller")["data"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    copier = container(pod, "secret-files", init=True)
    source = {m["name"]: m["mountPath"] for m in copier["volumeMounts"]}
    (secret_volume,) = [n for n in source if "secret" in volumes[n]]
    items = {i["key"]: i["path"] for i in volumes[secret_volume]["secret"]["items"]}
    script = " ".join(copier["command"])
    ctl_mounts = {m["mountPath"]: m["name"] for m in container(pod, "controller")["volumeMounts"]}
    for setting, key in (
        ("EDGEFLEET_SIGNING_KEY_FILE", "artifact_signing_key.pem"),
        ("EDGEFLEET_ADMIN_TOKEN_FILE", "admin.token"),
    ):
        target = config[setting]
        folder = posixpath.dirname(target)
        # Copied as 0600 into a memory-backed folder the controller container mounts.
        assert f"install -m 0600 {source[secret_volume]}/{items[key]} {target}" in script, setting
        assert volumes[ctl_mounts[folder]]["emptyDir"]["medium"] == "Memory"
        assert source[ctl_mounts[folder]] == folder
    # Secrets reach the process through secretKeyRef, never as literal values.
    env = {e["name"]: e for e in container(pod, "controller")["env"]}
    for name in ("EDGEFLEET_DATABASE_URL", "EDGEFLEET_MQTT_PASSWORD"):
        assert "value" not in env[name] and env[name]["valueFrom"]["secretKeyRef"]["name"]
    assert not {"EDGEFLEET_DATABASE_URL", "EDGEFLEET_MQTT_PASSWORD", "EDGEFLEET_ADMIN_TOKEN"} & config.keys()


def test_k8s_migrates_with_the_replicas_image_before_serving() -> None:
    pod = controller_pod()
    migrate = container(pod, "migrate", init=True)
    assert migrate["command"] == ["edgefleet", "migrate"]
    assert migrate["image"] == container(pod, "controller")["image"]
    env = {e["name"]: e for e in migrate["env"]}
    assert env["EDGEFLEET_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"]


def test_k8s_artifact_store_is_shared_by_every_replica() -> None:
    pod = controller_pod()
    store = k8s("ConfigMap", "edgefleet-controller")["data"]["EDGEFLEET_STORE_DIR"]
    mounts = {m["mountPath"]: m["name"] for m in container(pod, "controller")["volumeMounts"]}
    volume = {v["name"]: v for v in pod["volumes"]}[mounts[store]]
    claim = k8s("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_k8s_routing_is_not_sticky_and_passes_the_live_websocket() -> None:
    svc = k8s("Service", "edgefleet-controller")
    assert svc["spec"].get("sessionAffinity", "None") == "None"
    ingress = k8s("Ingress", "edgefleet-controller")
    annotations: dict[str, str] = ingress["metadata"].get("annotations", {})
    assert not [k for k in annotations if "affinity" in k or "session-cookie" in k]
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 600
    (rule,) = ingress["spec"]["rules"]
    (path,) = rule["http"]["paths"]
    assert path["path"] == "/" and path["backend"]["service"]["name"] == svc["metadata"]["name"]


def test_k8s_controller_setting_values_fit_the_settings() -> None:
    config = k8s("ConfigMap", "edgefleet-controller")["data"]
    fields = ControllerSettings.model_fields
    assert config["EDGEFLEET_MQTT_BROKER_AUTH"] in ("none", "dynsec")
    assert config["EDGEFLEET_MQTT_ACL"] in ("none", "external")
    assert config["EDGEFLEET_ENVIRONMENT"] == "production"
    # Production refuses plain mqtt:// to another host: the URL must be TLS.
    assert urlsplit(config["EDGEFLEET_MQTT_URL"]).scheme == "mqtts"
    for key in config:
        assert key.removeprefix("EDGEFLEET_").lower() in fields, key


# --- EMQX ----------------------------------------------------------------------------------------


def emqx() -> Doc:
    return k8s("EMQX")


def emqx_config_lines() -> list[str]:
    return [line.strip() for line in emqx()["spec"]["config"]["data"].splitlines()]


def test_emqx_cluster_routes_each_device_to_one_replica() -> None:
    doc = emqx()
    assert doc["apiVersion"] == "apps.emqx.io/v2beta1"
    assert "mqtt.shared_subscription_strategy = hash_clientid" in emqx_config_lines()
    assert doc["spec"]["coreTemplate"]["spec"]["replicas"] >= 3
    assert doc["spec"]["replicantTemplate"]["spec"]["replicas"] >= 1


def test_emqx_cluster_is_on_the_apache_line_or_carries_a_licence() -> None:
    # EMQX 5.9+ is BSL 1.1: free in production on one node only. More than one node on 5.9+ needs
    # a licence key; 5.8.x is the last Apache-2.0 line.
    spec = emqx()["spec"]
    nodes = spec["coreTemplate"]["spec"]["replicas"] + spec["replicantTemplate"]["spec"]["replicas"]
    image, _, tag = spec["image"].rpartition(":")
    assert image == "emqx/emqx", "emqx/emqx-enterprise always needs a licence"
    version = tuple(int(part) for part in tag.split(".")[:2])
    licensed = any(line.startswith("license") for line in emqx_config_lines())
    assert nodes == 1 or version < (5, 9) or licensed, f"{nodes} nodes of EMQX {tag} need a licence"


def test_emqx_acl_is_the_wire_contract() -> None:
    acl = k8s("ConfigMap", "emqx-edgefleet-acl")["data"]["acl.conf"]
    rules = re.findall(r"\{(allow|deny),\s*([^,]+|\{[^}]*\}),\s*(\w+),\s*\[([^\]]*)\]\}\.", acl)
    device = f"{DEFAULT_PREFIX}/devices/${{username}}"
    granted: dict[str, set[str]] = {"publish": set(), "subscribe": set()}
    for permission, who, action, topics in rules:
        if permission == "allow" and who.strip() == "all":
            granted[action] |= set(re.findall(r'"([^"]+)"', topics))
    assert granted["publish"] == {f"{device}/{k.value}" for k, s in SPECS.items() if s.from_agent}
    assert granted["subscribe"] == {f"{device}/{k.value}" for k, s in SPECS.items() if not s.from_agent}
    assert acl.rstrip().endswith("{deny, all}."), "anything not granted is refused"
    assert "authorization" in emqx()["spec"]["config"]["data"] and "no_match = deny" in emqx_config_lines()
    # The controller's user may subscribe through the replicas' shared-subscription group.
    group = k8s("ConfigMap", "edgefleet-controller")["data"]["EDGEFLEET_MQTT_SHARE_GROUP"]
    assert f'"$share/{group}/{DEFAULT_PREFIX}/#"' in acl


def test_controller_points_at_the_emqx_listeners_over_tls() -> None:
    url = urlsplit(k8s("ConfigMap", "edgefleet-controller")["data"]["EDGEFLEET_MQTT_URL"])
    # The EMQX operator names the listeners Service "<name>-listeners".
    assert url.hostname == f"{emqx()['metadata']['name']}-listeners"
    assert f'bind = "0.0.0.0:{url.port}"' in emqx_config_lines()
    assert "listeners.tcp.default.enable = false" in emqx_config_lines()


# --- settings named by the files -----------------------------------------------------------------


def deployment_env_names() -> set[str]:
    names: set[str] = set()
    for svc in compose()["services"].values():
        env = svc.get("environment", {})
        names |= set(env if isinstance(env, dict) else (e.split("=", 1)[0] for e in env))
    names |= set(k8s("ConfigMap", "edgefleet-controller")["data"])
    pod = controller_pod()
    for c in [*pod["initContainers"], *pod["containers"]]:
        names |= {e["name"] for e in c.get("env", [])}
    return {n for n in names if n.startswith("EDGEFLEET_")}


def test_every_edgefleet_variable_is_a_controller_setting() -> None:
    # mosquitto-init's EDGEFLEET_MQTT_PASSWORD is the same secret under the controller's name.
    used = deployment_env_names()
    assert {"EDGEFLEET_DATABASE_URL", "EDGEFLEET_MQTT_URL", "EDGEFLEET_STORE_DIR"} <= used
    unknown = used - setting_names()
    assert not unknown, f"not ControllerSettings fields: {sorted(unknown)}"


# --- linters that are no project dependency ------------------------------------------------------


def python_tool(module: str, script: str) -> list[str] | None:
    """How to run a Python linter: from this interpreter, else a script on PATH (pipx), else None."""
    if importlib.util.find_spec(module) is not None:
        return [sys.executable, "-m", module]
    found = shutil.which(script)
    return [found] if found else None


YAMLLINT = python_tool("yamllint", "yamllint")
KUBERNETES_VALIDATE = python_tool("kubernetes_validate", "kubernetes-validate")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_builds_the_manifests() -> None:
    done = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    kinds = {d["kind"] for d in yaml.safe_load_all(done.stdout) if d}
    assert {"Deployment", "Service", "ConfigMap", "PersistentVolumeClaim", "Ingress"} <= kinds


@pytest.mark.skipif(YAMLLINT is None, reason="yamllint is not installed (pip install yamllint)")
def test_yamllint_finds_nothing() -> None:
    assert YAMLLINT is not None
    config = (
        "{extends: default, rules: {line-length: {max: 140}, document-start: disable, "
        "truthy: {check-keys: false}}}"
    )
    done = subprocess.run(
        [*YAMLLINT, "-f", "parsable", "-d", config, *map(str, OUR_YAML)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(
    KUBERNETES_VALIDATE is None,
    reason="kubernetes-validate is not installed (pip install kubernetes-validate; it bundles the schemas)",
)
def test_kubernetes_validate_accepts_the_manifests() -> None:
    # Strict: a misspelt field is an error. The EMQX resource has no bundled schema (a warning only).
    assert KUBERNETES_VALIDATE is not None
    manifests = [p for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml"]
    done = subprocess.run(
        [*KUBERNETES_VALIDATE, "--strict", "--quiet", *map(str, manifests)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def docker_compose_missing() -> bool:
    if shutil.which("docker") is None:
        return True
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    return probe.returncode != 0


@pytest.mark.skipif(docker_compose_missing(), reason="docker compose is not installed")
def test_docker_compose_accepts_the_file() -> None:
    env = os.environ | {"EDGEFLEET_MQTT_PASSWORD": "x" * 24, "EDGEFLEET_DB_PASSWORD": "y" * 24}
    done = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr


# The first releases whose tarfile extraction filters have the known bypasses fixed (CVE-2025-4517 and
# related): an image on an older patch release, or on a floating tag, may ship an affected one.
PATCHED_PYTHON = {(3, 11): 13, (3, 12): 11, (3, 13): 4}


@pytest.mark.parametrize("dockerfile", ["agent.Dockerfile", "controller.Dockerfile"])
def test_python_base_images_pin_a_patch_release_with_tarfile_filter_fixes(dockerfile: str) -> None:
    froms = re.findall(r"^FROM\s+(\S+)", (DOCKER / dockerfile).read_text(), re.MULTILINE)
    pythons = [f for f in froms if f.startswith("python:")]
    assert pythons, f"{dockerfile} is not built on a python image"
    for image in pythons:
        m = re.fullmatch(r"python:(\d+)\.(\d+)\.(\d+)(-[a-z0-9-]+)?", image)
        assert m, f"{dockerfile}: {image} does not pin a patch release"
        major, minor, patch = int(m[1]), int(m[2]), int(m[3])
        assert (major, minor) in PATCHED_PYTHON, f"{dockerfile}: {image}: no known patched release"
        assert patch >= PATCHED_PYTHON[(major, minor)], (
            f"{dockerfile}: {image} predates {major}.{minor}.{PATCHED_PYTHON[(major, minor)]}"
        )
