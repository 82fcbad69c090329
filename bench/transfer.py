"""Model transfer benchmark: chunked artifact transfer over MQTT against the broker's raw bandwidth.

In one run, on a mosquitto the bench starts (tests/support/mqtt_broker.py, with ``set_tcp_nodelay true`` as
docker/mosquitto.conf has it), it measures
  (a) raw broker bandwidth: a bare paho publisher (its own process, like the controller) sends the
      artifact's byte count in chunks of the same size, QoS 1, to a bare paho subscriber in this process;
  (b) a model push to ONE agent: a real controller process (its artifact server, its chunk size, its
      signed desired state; the fp32 file is pinned so every run moves the same bytes) and, in this
      process, the agent's own MqttLink + ArtifactFetcher behind the agent's signature check (the agent
      minus capture and inference); timed from just before the desired-state PUT (which publishes the
      desired state) to the file verified (whole-file sha256) on the agent; MB/s and the ratio to (a);
      also from the agent's first chunk request, which leaves out the API call and desired-state hop
      (shown on its own: PUT -> first chunk request, in ms);
  (c) the same to N simulated agents at once (default 20: N links, N fetchers, N device ids, all
      fetching the same artifact): aggregate MB/s (N x size / time to the last verified file) and ratio;
  (d) resume: one transfer (8 chunks in flight) stopped at ~50 % (the fetcher is cancelled and its
      link closed), then a fresh link + fetcher on the same store: the chunks asked for and the bytes
      the controller sent after the restart (seen by a spy on the broker), against what the partial
      file's bitmap says is missing.
(b) and (a) alternate (``--runs``, default three times each): raw is the best run (the stricter
limit), the push the median; the ratio's range is each push run against that best raw run.

With ``--link RATE:RTT`` (e.g. ``100mbit:40ms``, ``20mbit:100ms``; tc's units) it measures instead
  (e) a push to ONE agent over a site link: the agent's MQTT connection goes through an emulated link
      (tests/support/linkproxy.py: a userspace TCP proxy, this kernel's tc has no netem) holding each direction
      to RATE with a one-way delay of RTT/2 (RTT is the round trip) and a bottleneck queue of one
      bandwidth-delay product + 64 KiB; the controller talks to the broker directly (the site link is
      between the device and the cloud). Timed as (b): desired-state PUT -> file verified on the agent.
      Its raw limit, in the same run through the same link: a bare TCP transfer of the artifact's byte
      count (a plain socket server on the cloud side sends it on a 1-byte go from the device side;
      timed from the go to the last byte, so it pays one round trip, the push one and a half). Push
      and bare alternate ``--runs`` times; the ratio bare / push per run, its median and range, and the
      1-minute load average before and after each run are printed (and in ``--json``). (a)-(d) are
      not run in this mode.

With ``--cap BYTES_PER_S`` it measures instead
  (f) a push to ONE agent whose device has a byte-rate cap on the controller (``EDGEFLEET_ARTIFACT_DEVICE_
      BYTES_PER_S``, with ``--cap-burst`` bytes at once, default 1 MiB), on localhost: a fresh device
      (a full bucket) per run. A token bucket lets ``size - burst`` bytes through in ``(size - burst) /
      cap`` seconds at best, so the ratio printed is that over the time from the agent's first chunk
      request to the verified file (1.00: the transfer ran at the cap). Also per run: the chunks the
      controller sent (a spy on the broker; the file's chunk count when none went twice), and the
      controller's chunk outcomes (``delayed_bytes_cap``, ``dropped_bytes_cap``, ``already_in_line``,
      from ``/metrics``). (a)-(d) are not run in this mode.

Usage (from the repository root): ``python -m bench.transfer [--chunk-size BYTES] [--agents N] [--window N] [--model NAME] [--runs 3]
[--link RATE:RTT] [--cap BYTES_PER_S [--cap-burst BYTES]] [--smoke] [--json]`` (without ``--chunk-size`` / ``--window`` the controller's chunk size
and the agent's window are used; ``--smoke``: a quick check that it runs, 1 run and 2 agents).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from edge_agent.core.settings import ArtifactConfig, MqttEndpoint
from edge_agent.uplink.artifacts import ArtifactFetcher, FetchCancelled, FetchError
from edge_agent.uplink.link import MqttLink
from fleet_protocol import TopicKind, Topics, encode
from fleet_protocol.messages import (
    ArtifactRef,
    ArtifactRequest,
    Availability,
    DesiredState,
    Message,
)
from fleet_protocol.signing import SignatureError, load_public_key, verify
from tests.support.linkproxy import LinkProxy, LinkSpec
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.processes import ControllerProcess, artifact_public_key, bearer
from tests.support.transfer_helpers import TransferSpy, bitmap_have
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[1]

CAMERA = "cam1"
MB = 1e6
RUNS = 3


# --------------------------------------------------------------------------- (a) raw paho


def raw_publisher(host: str, port: int, topic: str, chunk_size: int, total: int) -> None:
    """The bare publisher (run as its own process): a 1-byte start mark, then ``total`` bytes in chunks."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"raw-pub-{os.getpid()}")
    client.connect(host, port)
    client.loop_start()
    data = os.urandom(chunk_size)
    info = client.publish(topic, b"s", qos=1)
    sent = 0
    while sent < total:
        n = min(chunk_size, total - sent)
        info = client.publish(topic, data[:n], qos=1)
        sent += n
    info.wait_for_publish(120)
    client.disconnect()
    client.loop_stop()


def raw_bandwidth(broker: MosquittoBroker, chunk_size: int, total: int) -> float:
    """MB/s from the start mark's arrival to the last byte's, at a bare QoS 1 subscriber."""
    topic = f"bench/raw/{os.getpid()}"
    got = {"bytes": 0, "t0": 0.0, "t1": 0.0}
    done = threading.Event()
    subscribed = threading.Event()

    def on_message(_c: Any, _u: Any, m: mqtt.MQTTMessage) -> None:
        if len(m.payload) == 1 and got["t0"] == 0.0:
            got["t0"] = time.perf_counter()
            return
        got["bytes"] += len(m.payload)
        if got["bytes"] >= total:
            got["t1"] = time.perf_counter()
            done.set()

    sub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"raw-sub-{os.getpid()}")
    sub.on_message = on_message
    sub.on_subscribe = lambda *a: subscribed.set()
    sub.connect(broker.host, broker.port)
    sub.loop_start()
    sub.subscribe(topic, qos=1)
    try:
        if not subscribed.wait(10):
            raise RuntimeError("raw subscriber did not subscribe")
        pub = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.transfer",
                "--raw-publisher",
                broker.host,
                str(broker.port),
                topic,
                str(chunk_size),
                str(total),
            ],
            timeout=120,
            check=True,
            cwd=REPO,
        )
        assert pub.returncode == 0
        if not done.wait(60):
            raise RuntimeError(f"raw subscriber got {got['bytes']} of {total} bytes")
    finally:
        sub.disconnect()
        sub.loop_stop()
    return total / MB / (got["t1"] - got["t0"])


# --------------------------------------------------------------------------- simulated agents


class SimAgent:
    """The agent's transfer path alone: its MqttLink and ArtifactFetcher, configured like the agent.

    On a desired state naming a model for ``cam1`` it fetches that artifact; ``verified_at`` is when
    the fetcher returned the verified file (whole-file sha256 checked).
    """

    def __init__(
        self,
        broker: MosquittoBroker,
        device_id: str,
        store: Path,
        config: ArtifactConfig,
        public_key: str,
        *,
        stop_at_pct: float = 101.0,
        url: str | None = None,
    ) -> None:
        self.device_id = device_id
        self._key = load_public_key(public_key)
        self.stop = threading.Event()
        self.stop_at_pct = stop_at_pct
        endpoint = MqttEndpoint.parse(url or broker.url)  # url: the site link in front of the broker
        self.link = MqttLink(endpoint, device_id=device_id, topics=Topics())
        self.fetcher = ArtifactFetcher(
            store,
            self._request,
            window=config.window,
            window_bytes=config.window_bytes,
            request_timeout_s=config.request_timeout_s,
            max_retries=config.max_retries,
        )
        self.link.set_callbacks(
            birth=lambda: Availability(state="online", ts=time.time()),
            on_connected=lambda: None,
            on_fatal=lambda why: self.stop.set(),
        )
        self.link.on_chunk(self.fetcher.on_chunk)
        self.link.on_message(TopicKind.TWIN_DESIRED, self._on_desired)
        self._refs: queue.Queue[ArtifactRef] = queue.Queue()
        self.ref: ArtifactRef | None = None
        self.first_request_at: float | None = None
        self.verified_at: float | None = None
        self.cancelled = False
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"sim-{device_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self.link.start()
        if not self.link.wait_connected(10):
            raise RuntimeError(f"{self.device_id} did not connect")

    def close(self) -> None:
        self.stop.set()
        self._thread.join(10)
        self.link.stop()

    @property
    def finished(self) -> bool:
        return self.verified_at is not None or self.cancelled or self.error is not None

    def _request(self, req: ArtifactRequest) -> bool:
        if self.first_request_at is None:
            self.first_request_at = time.perf_counter()
        return self.link.publish(TopicKind.ARTIFACT_REQUEST, encode(req))

    def _on_desired(self, msg: Message) -> None:
        if isinstance(msg, DesiredState):
            cam = msg.cameras.get(CAMERA)
            if cam is not None and cam.model is not None:
                self.ref = cam.model
                self._refs.put(cam.model)

    def _progress(self, done: int, pct: float) -> None:
        if pct >= self.stop_at_pct:
            self.stop.set()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                ref = self._refs.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                verify(ref, self._key)  # as the agent does before it fetches anything
                self.fetcher.fetch(ref, self.stop, self._progress)
                self.verified_at = time.perf_counter()
            except FetchCancelled:
                self.cancelled = True
            except (FetchError, SignatureError) as exc:
                self.error = str(exc)
            return


@dataclass(frozen=True)
class Push:
    seconds: float  # first desired-state PUT -> last file verified
    transfer_seconds: float  # first chunk request -> last file verified
    chunk_size: int
    size: int  # bytes of the artifact the controller chose (the fp32 file: the assignment pins it)


def assign(api: Any, device: str, model: str) -> ArtifactRef:
    """PUT the model on the device's camera (fp32 pinned: the bench moves the original file)."""
    r = api.put(
        f"/api/v1/devices/{device}/cameras/{CAMERA}/model",
        json={"model": model, "version": "1", "variant": "fp32"},
    )
    r.raise_for_status()
    return ArtifactRef.model_validate(r.json()["cameras"][CAMERA]["model"])


def push(
    broker: MosquittoBroker,
    api: Any,
    model: str,
    workdir: Path,
    device_ids: list[str],
    config: ArtifactConfig,
    key: str,
    *,
    url: str | None = None,
    timeout: float = 150,
) -> Push:
    """Assign ``model`` to every device at once and wait until every device has verified it."""
    agents: list[SimAgent] = []
    try:
        for d in device_ids:
            api.post("/api/v1/devices", json={"id": d}).raise_for_status()
            a = SimAgent(broker, d, workdir / d / "models", config, key, url=url)
            agents.append(a)
            a.start()
        t0 = time.perf_counter()
        for d in device_ids:
            assign(api, d, model)
        wait_for(
            lambda: all(a.finished for a in agents),
            timeout=timeout,
            what="every transfer to finish",
            interval=0.01,
        )
        errors = [f"{a.device_id}: {a.error}" for a in agents if a.verified_at is None]
        if errors:
            raise RuntimeError("; ".join(errors[:3]))
        end = max(a.verified_at or 0.0 for a in agents)
        first = min(a.first_request_at or t0 for a in agents)
        ref = agents[0].ref
        assert ref is not None
        return Push(
            seconds=end - t0,
            transfer_seconds=end - first,
            chunk_size=ref.chunk_size,
            size=ref.manifest.size,
        )
    finally:
        for a in agents:
            a.close()


def resume(
    broker: MosquittoBroker,
    api: Any,
    model: str,
    workdir: Path,
    config: ArtifactConfig,
    key: str,
) -> dict[str, Any]:
    """Stop one transfer at 50 %, start a fresh link + fetcher on the same store, count what is re-sent."""
    device = "bench-resume"
    store = workdir / device / "models"
    api.post("/api/v1/devices", json={"id": device}).raise_for_status()
    spy = TransferSpy(broker.host, broker.port, device)
    try:
        # The stopped transfer asks 8 chunks at a time: with the full window everything left after 50 % is
        # already asked for, arrives while the fetcher stops, and is kept, leaving nothing to resume.
        narrow = config.model_copy(update={"window": 8, "window_bytes": 64 * 1024})
        first = SimAgent(broker, device, store, narrow, key, stop_at_pct=50.0)
        first.start()
        ref = assign(api, device, model)
        chunk_size, size, sha256 = ref.chunk_size, ref.manifest.size, ref.manifest.sha256
        wait_for(lambda: first.finished, timeout=60, what="the first transfer to stop at 50 %")
        assert first.cancelled, first.error
        # The controller answers what was still outstanding; those chunks reach no transfer and are lost.
        wait_for(spy.all_requests_answered, timeout=30, what="outstanding requests answered")
        first.close()
        have = bitmap_have(store, sha256)
        assert have is not None
        missing = [i for i, c in enumerate(have) if c == "0"]
        missing_bytes = sum(min(chunk_size, size - i * chunk_size) for i in missing)
        mark = spy.mark()

        second = SimAgent(broker, device, store, config, key)  # the retained desired state restarts the fetch
        t0 = time.perf_counter()
        second.start()
        try:
            wait_for(lambda: second.finished, timeout=60, what="the resumed transfer")
            assert second.verified_at is not None, second.error
            seconds = second.verified_at - t0
        finally:
            second.close()
        asked = spy.requested_since(mark)
        resent = spy.served_since(mark)
        return {
            "chunk_size": chunk_size,
            "total_chunks": len(have),
            "missing_chunks": len(missing),
            "missing_bytes": missing_bytes,
            "asked_chunks": len(asked),
            "asked_not_missing": len(set(asked) - set(missing)),
            "resent_chunks": len(resent),
            "resent_bytes": sum(n for _, n in resent),
            "seconds": seconds,
        }
    finally:
        spy.close()


# --------------------------------------------------------------------------- (e) over a site link


class BareSender:
    """The raw limit of a site link: a plain TCP server that sends ``size`` bytes on a 1-byte go."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._data = os.urandom(size)
        self._srv = socket.create_server(("127.0.0.1", 0))
        self._srv.settimeout(0.2)
        self.address = ("127.0.0.1", int(self._srv.getsockname()[1]))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="bare-sender", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(60)
                if conn.recv(1):
                    conn.sendall(self._data)

    def receive(self, port: int) -> float:
        """Seconds from the go byte sent to the last byte received, through the link's ``port``."""
        with socket.create_connection(("127.0.0.1", port), timeout=60) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            got = 0
            t0 = time.perf_counter()
            c.sendall(b"g")
            while got < self.size:
                n = len(c.recv(1 << 20))
                if n == 0:
                    raise RuntimeError(f"bare transfer closed after {got} of {self.size} bytes")
                got += n
            return time.perf_counter() - t0

    def close(self) -> None:
        self._stop.set()
        self._srv.close()
        self._thread.join(5)


def run_link(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """(e): push to one agent behind the emulated site link, against a bare TCP transfer of the same
    bytes through the same link, alternating, ``args.runs`` times each."""
    spec = LinkSpec.parse(args.link)
    config = ArtifactConfig(window=args.window) if args.window else ArtifactConfig()
    broker = MosquittoBroker(workdir / "mosquitto", extra_conf="set_tcp_nodelay true\n")
    broker.start()
    env = {"EDGEFLEET_CHUNK_SIZE": str(args.chunk_size)} if args.chunk_size else {}
    controller = ControllerProcess(workdir, broker.url, EDGEFLEET_HEARTBEAT_TIMEOUT_S="120", **env)
    load = [os.getloadavg()[0]]
    runs: list[dict[str, float]] = []
    bare: BareSender | None = None
    link = LinkProxy(spec)
    try:
        controller.start()
        key = artifact_public_key(controller.url, controller.token)
        agent_url = f"mqtt://127.0.0.1:{link.listen((broker.host, broker.port))}"
        # Seconds per transfer at the link's rate, at least: a generous deadline for each push.
        with controller.client() as api:
            for i in range(args.runs):
                down_before = link.bytes_down
                p = push(
                    broker,
                    api,
                    args.model,
                    workdir,
                    [f"bench-link-{i}"],
                    config,
                    key,
                    url=agent_url,
                    timeout=600,
                )
                link_bytes = link.bytes_down - down_before
                if bare is None:  # the first push says how many bytes the artifact has
                    bare = BareSender(p.size)
                    bare_port = link.listen(bare.address)
                bare_s = bare.receive(bare_port)
                runs.append(
                    {
                        "push_s": p.seconds,
                        "transfer_s": p.transfer_seconds,
                        "bare_s": bare_s,
                        "ratio": bare_s / p.seconds,
                        "link_bytes_down": link_bytes,
                    }
                )
                load.append(os.getloadavg()[0])
    finally:
        link.close()
        if bare is not None:
            bare.close()
        controller.stop()
        broker.stop()
    assert bare is not None
    size = bare.size
    ratios = [r["ratio"] for r in runs]
    return {
        "link": args.link,
        "rate_bps": spec.rate_bps,
        "rtt_s": spec.rtt_s,
        "queue_bytes": link.queue_bytes,
        "model": args.model,
        "size_bytes": size,
        "chunk_size": p.chunk_size,
        "window": config.window,
        "window_bytes": config.window_bytes,
        "ideal_s": size * 8 / spec.rate_bps,
        "runs": runs,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "push_mb_s": statistics.median(size / MB / r["push_s"] for r in runs),
        "bare_mb_s": statistics.median(size / MB / r["bare_s"] for r in runs),
        "loadavg_1m": load,
    }


def print_link(r: dict[str, Any]) -> None:
    size_mb = r["size_bytes"] / MB
    print(
        f"{r['model']}: {size_mb:.1f} MB in chunks of {r['chunk_size'] // 1024} KiB over a site link of "
        f"{r['rate_bps'] / 1e6:g} Mbit/s and {r['rtt_s'] * 1000:g} ms RTT (queue {r['queue_bytes'] // 1000} kB; "
        f"{r['ideal_s']:.2f} s at the rate), agent window {r['window']} / {r['window_bytes'] // 2**20} MiB, "
        f"{os.cpu_count()} CPUs"
    )
    for i, run in enumerate(r["runs"]):
        print(
            f"  run {i + 1}: bare TCP {run['bare_s']:.3f} s, push {run['push_s']:.3f} s "
            f"(PUT -> first request {1000 * (run['push_s'] - run['transfer_s']):.0f} ms, first request -> "
            f"verified {run['transfer_s']:.3f} s, {run['link_bytes_down'] / MB:.2f} MB down the link), "
            f"ratio {run['ratio']:.3f}"
        )
    load = ", ".join(f"{x:.2f}" for x in r["loadavg_1m"])
    print(
        f"(e) push desired -> verified / bare TCP, same link     {r['ratio']:8.3f}       (median; range "
        f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f} over {len(r['runs'])} runs; push {r['push_mb_s']:.2f} MB/s, "
        f"bare {r['bare_mb_s']:.2f} MB/s; load average {load})"
    )


# --------------------------------------------------------------------------- (f) a capped device


CAP_OUTCOMES = ("delayed_bytes_cap", "dropped_bytes_cap", "already_in_line")


def chunk_outcomes(controller: ControllerProcess) -> dict[str, float]:
    """The controller's ``artifacts/chunk`` counters, from its Prometheus text."""
    text = httpx.get(f"{controller.url}/metrics", headers=bearer(controller.token), timeout=10).text
    out: dict[str, float] = {}
    prefix = 'edgefleet_mqtt_messages_total{kind="artifacts/chunk",outcome="'
    for line in text.splitlines():
        if line.startswith(prefix):
            outcome, _, value = line[len(prefix) :].partition('"} ')
            out[outcome] = float(value)
    return out


def run_cap(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """(f): ``args.runs`` pushes to one fresh capped device each, on localhost."""
    config = ArtifactConfig(window=args.window) if args.window else ArtifactConfig()
    broker = MosquittoBroker(workdir / "mosquitto", extra_conf="set_tcp_nodelay true\n")
    broker.start()
    env = {
        "EDGEFLEET_ARTIFACT_DEVICE_BYTES_PER_S": str(args.cap),
        "EDGEFLEET_ARTIFACT_DEVICE_BURST_BYTES": str(args.cap_burst),
        **({"EDGEFLEET_CHUNK_SIZE": str(args.chunk_size)} if args.chunk_size else {}),
    }
    controller = ControllerProcess(workdir, broker.url, EDGEFLEET_HEARTBEAT_TIMEOUT_S="120", **env)
    runs: list[dict[str, Any]] = []
    load = [os.getloadavg()[0]]
    try:
        controller.start()
        key = artifact_public_key(controller.url, controller.token)
        with controller.client() as api:
            for i in range(args.runs):
                device = f"bench-cap-{i}"
                spy = TransferSpy(broker.host, broker.port, device)
                before = chunk_outcomes(controller)
                try:
                    p = push(broker, api, args.model, workdir, [device], config, key, timeout=1800)
                finally:
                    spy.close()
                after = chunk_outcomes(controller)
                best_s = max(0, p.size - args.cap_burst) / args.cap
                runs.append(
                    {
                        "transfer_s": p.transfer_seconds,
                        "push_s": p.seconds,
                        "best_s": best_s,
                        "ratio": best_s / p.transfer_seconds,
                        "chunks_sent": len(spy.served),
                        "chunks": math.ceil(p.size / p.chunk_size),
                        **{k: after.get(k, 0.0) - before.get(k, 0.0) for k in CAP_OUTCOMES},
                    }
                )
                load.append(os.getloadavg()[0])
    finally:
        controller.stop()
        broker.stop()
    ratios = [r["ratio"] for r in runs]
    return {
        "cap_bytes_per_s": args.cap,
        "cap_burst_bytes": args.cap_burst,
        "model": args.model,
        "size_bytes": p.size,
        "chunk_size": p.chunk_size,
        "window": config.window,
        "window_bytes": config.window_bytes,
        "runs": runs,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "loadavg_1m": load,
    }


def print_cap(r: dict[str, Any]) -> None:
    print(
        f"{r['model']}: {r['size_bytes'] / MB:.1f} MB in chunks of {r['chunk_size'] // 1024} KiB to a device "
        f"capped at {r['cap_bytes_per_s'] / 1024:g} KiB/s ({r['cap_burst_bytes'] / 2**20:g} MiB at once), agent "
        f"window {r['window']} / {r['window_bytes'] // 2**20} MiB, mosquitto on localhost, {os.cpu_count()} CPUs"
    )
    for i, run in enumerate(r["runs"]):
        print(
            f"  run {i + 1}: first request -> verified {run['transfer_s']:.2f} s (best at the cap "
            f"{run['best_s']:.2f} s), ratio {run['ratio']:.3f}; chunks sent {run['chunks_sent']} of "
            f"{run['chunks']}; delayed {run['delayed_bytes_cap']:g}, dropped {run['dropped_bytes_cap']:g}, "
            f"asked again while in line {run['already_in_line']:g}"
        )
    load = ", ".join(f"{x:.2f}" for x in r["loadavg_1m"])
    print(
        f"(f) achieved rate / cap                                 {r['ratio']:8.3f}       (median; range "
        f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f} over {len(r['runs'])} runs; load average {load})"
    )


# --------------------------------------------------------------------------- main


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    config = ArtifactConfig(window=args.window) if args.window else ArtifactConfig()
    # TCP_NODELAY on the broker's sockets, as docker/mosquitto.conf should have it: with Nagle on, a small
    # message (a desired state, a chunk request) can wait up to 40 ms for the ACK of the previous one.
    broker = MosquittoBroker(workdir / "mosquitto", extra_conf="set_tcp_nodelay true\n")
    broker.start()
    env = {"EDGEFLEET_CHUNK_SIZE": str(args.chunk_size)} if args.chunk_size else {}
    controller = ControllerProcess(workdir, broker.url, EDGEFLEET_HEARTBEAT_TIMEOUT_S="120", **env)
    try:
        controller.start()
        key = artifact_public_key(controller.url, controller.token)  # what an operator gives each agent
        with controller.client() as api:
            # (b) and (a) alternate, so both see the same machine; the first push says which chunk size
            # the controller really uses and how big the artifact is.
            ones: list[Push] = []
            raw_runs: list[float] = []
            for i in range(args.runs):
                ones.append(push(broker, api, args.model, workdir, [f"bench-one-{i}"], config, key))
                raw_runs.append(raw_bandwidth(broker, ones[0].chunk_size, ones[0].size))
            devices = [f"bench-many-{i}" for i in range(args.agents)]
            many = push(broker, api, args.model, workdir, devices, config, key)
            res = resume(broker, api, args.model, workdir, config, key)
    finally:
        controller.stop()
        broker.stop()
    chunk_size, size = ones[0].chunk_size, ones[0].size
    raw = max(raw_runs)
    one_runs = [size / MB / p.seconds for p in ones]
    one = statistics.median(one_runs)
    one_transfer = statistics.median(size / MB / p.transfer_seconds for p in ones)
    # The API call, the desired state's trip to the agent and its signature check: not transfer at all.
    one_lead_ms = statistics.median(1000.0 * (p.seconds - p.transfer_seconds) for p in ones)
    many_mb_s = args.agents * size / MB / many.seconds
    return {
        "model": args.model,
        "size_bytes": size,
        "chunk_size": chunk_size,
        "chunks": math.ceil(size / chunk_size),
        "window": config.window,
        "raw_mb_s": raw,
        "raw_mb_s_runs": raw_runs,
        "one_agent_mb_s": one,
        "one_agent_mb_s_runs": one_runs,
        "one_agent_ratio": one / raw,
        "one_agent_ratio_min": min(one_runs) / raw,
        "one_agent_ratio_max": max(one_runs) / raw,
        "one_agent_transfer_only_mb_s": one_transfer,
        "one_agent_put_to_first_request_ms": one_lead_ms,
        "agents": args.agents,
        "many_seconds": many.seconds,
        "many_aggregate_mb_s": many_mb_s,
        "many_ratio": many_mb_s / raw,
        "resume": res,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk-size", type=int, default=0, help="bytes per chunk (default: the controller's)")
    ap.add_argument("--agents", type=int, default=20, help="simulated agents fetching at once in (c)")
    ap.add_argument(
        "--window", type=int, default=0, help="chunks each agent keeps asked for (default: the agent's)"
    )
    ap.add_argument("--model", default="nanodet_coco", help="bundled model to push (default nanodet_coco)")
    ap.add_argument("--runs", type=int, default=RUNS, help=f"push/raw pairs, alternating (default {RUNS})")
    ap.add_argument("--smoke", action="store_true", help="a quick check that it runs: 1 run, 2 agents")
    ap.add_argument(
        "--link",
        metavar="RATE:RTT",
        help="push over an emulated site link instead (e.g. 100mbit:40ms; RTT = round trip)",
    )
    ap.add_argument(
        "--cap",
        type=float,
        default=0.0,
        metavar="BYTES_PER_S",
        help="push to one device capped at this byte rate on the controller instead",
    )
    ap.add_argument(
        "--cap-burst",
        type=int,
        default=2**20,
        metavar="BYTES",
        help="the capped device's burst (default 1 MiB)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    ap.add_argument("--raw-publisher", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        args.runs, args.agents = 1, 2
    if args.runs < 1 or args.agents < 1:
        ap.error("--runs and --agents must be positive")
    if args.raw_publisher:
        host, port, topic, chunk, total = args.raw_publisher
        raw_publisher(host, int(port), topic, int(chunk), int(total))
        return
    if args.link:
        try:
            LinkSpec.parse(args.link)
        except ValueError as exc:
            ap.error(str(exc))
    if args.cap < 0 or (args.cap and args.link):
        ap.error("--cap takes a positive byte rate, and not with --link")
    # The links' "disconnected" warnings at each simulated agent's close are expected here.
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="edgefleet-bench-transfer-") as tmp:
        if args.cap:
            r = run_cap(args, Path(tmp))
        else:
            r = run_link(args, Path(tmp)) if args.link else run(args, Path(tmp))
    if args.json:
        print(json.dumps(r))
        return
    if args.cap:
        print_cap(r)
        return
    if args.link:
        print_link(r)
        return
    res = r["resume"]
    runs = ", ".join(f"{x:.1f}" for x in r["raw_mb_s_runs"])
    one_runs = ", ".join(f"{x:.1f}" for x in r["one_agent_mb_s_runs"])
    n, size_mb = r["agents"], r["size_bytes"] / MB

    def row(label: str, value: float, unit: str, note: str = "") -> None:
        print(f"{label:<48}{value:8.2f} {unit:<5} {note}".rstrip())

    print(
        f"{r['model']}: {size_mb:.1f} MB in {r['chunks']} chunks of {r['chunk_size'] // 1024} KiB, QoS 1, "
        f"agent window {r['window']}, mosquitto on localhost, {os.cpu_count()} CPUs"
    )
    row("(a) raw broker, bare paho pub -> sub", r["raw_mb_s"], "MB/s", f"(best of {runs})")
    row("(b) push to 1 agent, desired -> verified", r["one_agent_mb_s"], "MB/s", f"(median of {one_runs})")
    row("    of which first request -> verified", r["one_agent_transfer_only_mb_s"], "MB/s", "(median)")
    row(
        "    desired-state PUT -> first chunk request",
        r["one_agent_put_to_first_request_ms"],
        "ms",
        "(median)",
    )
    row(
        "    ratio 1 agent / raw",
        r["one_agent_ratio"],
        "",
        f"(median; range {r['one_agent_ratio_min']:.3f}-{r['one_agent_ratio_max']:.3f} over "
        f"{len(r['one_agent_mb_s_runs'])} run(s); target >= 0.70)",
    )
    row(
        f"(c) push to {n} agents at once, aggregate",
        r["many_aggregate_mb_s"],
        "MB/s",
        f"({n} x {size_mb:.1f} MB, last verified after {r['many_seconds']:.2f} s)",
    )
    row(f"    ratio {n} agents aggregate / raw", r["many_ratio"], "")
    print(
        f"(d) resume after a stop at 50 %: {res['missing_chunks']}/{res['total_chunks']} chunks missing on disk "
        f"= {res['missing_bytes']} B"
    )
    print(
        f"    after the restart: asked for {res['asked_chunks']} chunks ({res['asked_not_missing']} of them "
        f"already on disk); controller re-sent {res['resent_chunks']} chunks = {res['resent_bytes']} B"
    )
    row(
        "    re-sent / missing bytes",
        res["resent_bytes"] / max(1, res["missing_bytes"]),
        "",
        f"(target 1.00: only the missing chunks; resumed transfer took {res['seconds']:.2f} s)",
    )


if __name__ == "__main__":
    main()
