"""``edgefleet simulate``: its options, declared once in ``OPTIONS``, and the run they start.

``controller/cli/serve.py`` hands the command's arguments to :func:`main` untouched, so the options,
their help and their parsing live here only; an option named after a ``SimConfig`` field takes its
default from that field and its value goes there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sqlite3
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from edge_agent.sim.config import SimConfig, SimulatorError
from edge_agent.sim.enroll import enroll_devices, load_credentials
from edge_agent.sim.loop import FleetSimulator
from fleet_protocol.endpoint import MqttEndpoint, check_tls_files
from fleet_protocol.signing import load_public_key

PROG = "edgefleet simulate"
EXIT_OK, EXIT_NOT_ACKED, EXIT_SETTINGS = 0, 1, 2
_METAVARS: dict[Callable[[str], Any], str] = {int: "INT", float: "FLOAT", str: "TEXT", Path: "PATH"}


@dataclass(frozen=True)
class _Option:
    """One option, ``--name`` (dashes for underscores). With ``config`` it sets the SimConfig field of
    the same name and takes that field's default; otherwise :func:`run` reads it and ``default`` is
    its default. ``env``: an environment variable that, when set and not empty, replaces the default."""

    name: str
    type: Callable[[str], Any]
    help: str
    config: bool = False
    default: Any = None
    env: str | None = None
    required: bool = False
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def declared_default(self) -> Any:
        """The default the help shows: never an environment variable's value (it may be a secret)."""
        if self.config:
            default = SimConfig.__dataclass_fields__[self.name].default
            return None if default is dataclasses.MISSING else default
        return self.default

    def help_text(self) -> str:
        text = self.help
        if self.required:
            text += " [required]"
        if self.env is not None:
            text += f" [env var: {self.env}]"
        default = self.declared_default()
        if isinstance(default, tuple):  # a list option: shown as it is typed
            default = ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in default) or None
        if default is not None:
            text += f" [default: {default}]"
        return text.replace("%", "%%")


def _figures(text: str) -> tuple[float, ...]:
    """``12`` or ``6,9,12``: one figure or several, comma-separated."""
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a figure or comma-separated figures") from None


def _patterns(text: str) -> tuple[str, ...]:
    """Comma-separated patterns; empty ones are left out."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


OPTIONS: tuple[_Option, ...] = (
    _Option("devices", int, "how many simulated devices (one process)", config=True, required=True),
    _Option(
        "mqtt_url",
        str,
        "broker: mqtt[s]://[user:pass@]host:port",
        default="mqtt://127.0.0.1:1883",
        env="EDGEFLEET_MQTT_URL",
    ),
    _Option("prefix", str, "topic prefix (the controller's EDGEFLEET_TOPIC_PREFIX)", config=True),
    _Option("seconds", float, "stop after this long (default: until Ctrl-C / SIGTERM)", config=True),
    _Option("heartbeat_s", float, "heartbeat period per device", config=True),
    _Option("batch_s", float, "one detection batch per device this often", config=True),
    _Option("ack_timeout_s", float, "send an unacked seq again after this long", config=True),
    _Option("drain_s", float, "at stop, wait up to this long for every outbox to be acked", config=True),
    _Option("device_prefix", str, "device ids are PREFIX0001, PREFIX0002, ...", config=True),
    _Option(
        "cameras",
        int,
        "own cameras per device (cam1, cam2, ...), 0 to 16; pool cameras come on top",
        config=True,
    ),
    _Option(
        "infer_ms",
        _figures,
        "inference lane ms a frame of any model (heartbeat costs, within 3 %); several, comma-separated, "
        "are given to the devices in turn (a mixed fleet)",
        config=True,
        metavar="MS[,MS...]",
    ),
    _Option("decode_ms", float, "capture thread CPU ms a frame (per camera decode_ms)", config=True),
    _Option(
        "source_fps",
        float,
        "frames a second every camera source delivers (under its max_fps); default: 2 a batch period",
        config=True,
    ),
    _Option(
        "unreachable",
        _patterns,
        "comma-separated [DEVICE=]HOST shell globs: sources on a matching host are not reached (by the "
        "devices the DEVICE glob matches; by all without it); their probes report false, their cameras are down",
        config=True,
        metavar="[DEVICE=]HOST,...",
    ),
    _Option("credentials", Path, "JSON {device_id: password} for a broker with per-device users"),
    _Option(
        "enroll_url", str, "enroll every device at this controller first (uses its broker passwords and key)"
    ),
    _Option("token", str, "API token for --enroll-url", env="EDGEFLEET_TOKEN"),
    _Option("key", str, "the controller's artifact public key (base64): desired states are checked"),
    _Option("data_dir", Path, "where each device's next seq is kept between runs", config=True),
    _Option("report", Path, "also write the figures as JSON here"),
    _Option("connect_rate", float, "new connections per second at most", config=True),
    _Option("ca_file", Path, "TLS: the broker's CA (PEM) instead of the system's"),
    _Option("cert_file", Path, "TLS: a client certificate (PEM)"),
    _Option("key_file", Path, "TLS: the client certificate's key (PEM)"),
    _Option("log_level", str, "log level", default="warning"),
)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Simulate a fleet against a deployment: N devices on the real contract, in one process; "
            "prints sent/acked/resends and publish->ack latency. Exit status 0 when every seq was "
            "acked and every device connected, 1 when not, 2 for bad settings."
        ),
        allow_abbrev=False,
    )
    for opt in OPTIONS:
        default = opt.declared_default()
        if opt.env is not None:
            default = os.environ.get(opt.env) or default
        parser.add_argument(
            opt.flag,
            dest=opt.name,
            type=opt.type,
            default=default,
            required=opt.required,
            metavar=opt.metavar or _METAVARS.get(opt.type, "VALUE"),
            help=opt.help_text(),
        )
    return parser


def main(argv: Sequence[str] | None = None, *, token: str | None = None, out: TextIO | None = None) -> int:
    """Parse ``argv`` (``sys.argv[1:]`` when None), set up logging and run; the exit status.

    ``token``: the API token for ``--enroll-url`` when neither ``--token`` nor EDGEFLEET_TOKEN gives
    one (``edgefleet --token T simulate ...`` passes the root option's)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse has already printed
        return exc.code if isinstance(exc.code, int) else EXIT_SETTINGS
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)-7s %(name)s: %(message)s"
    )
    return run(args, token=args.token or token, out=out)


def run(args: argparse.Namespace, *, token: str | None = None, out: TextIO | None = None) -> int:
    """Run the simulator with parsed options until ``--seconds`` or SIGINT/SIGTERM (a second one ends
    the drain); print the table, write ``--report``. EXIT_OK only when every seq was acked and every
    device connected."""
    out = out if out is not None else sys.stdout
    try:
        endpoint = MqttEndpoint.parse(args.mqtt_url).with_tls(args.ca_file, args.cert_file, args.key_file)
        check_tls_files(args.ca_file, args.cert_file, args.key_file)
        passwords = load_credentials(args.credentials) if args.credentials is not None else {}
        public_key = load_public_key(args.key) if args.key else None
        cfg = SimConfig(
            endpoint=endpoint,
            credentials=passwords,
            public_key=public_key,
            **{opt.name: getattr(args, opt.name) for opt in OPTIONS if opt.config},
        )
        if args.enroll_url:
            print(f"enrolling {cfg.devices} devices at {args.enroll_url}", file=out, flush=True)
            enrolled = enroll_devices(args.enroll_url, token, cfg.device_ids)
            updates: dict[str, Any] = {"credentials": {**passwords, **enrolled.passwords}}
            if public_key is None and enrolled.public_key:
                # The key the enrollment answer tells the device to trust, as a real agent is set up.
                updates["public_key"] = load_public_key(enrolled.public_key)
            cfg = dataclasses.replace(cfg, **updates)
    except (SimulatorError, ValueError) as exc:  # SignatureError and pydantic's errors are ValueErrors
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_SETTINGS
    missing = [d for d in cfg.device_ids if d not in cfg.credentials]
    if cfg.credentials and missing:
        print(
            f"warning: {len(missing)} devices have no password (e.g. {missing[0]}); they connect as "
            f"{endpoint.username or 'anonymous'}",
            file=sys.stderr,
        )
    stop, abort = threading.Event(), threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            abort.set()
        stop.set()

    try:
        sim = FleetSimulator(cfg, out=out)
    except (OSError, sqlite3.Error) as exc:
        print(f"{PROG}: --data-dir {cfg.data_dir}: {exc}", file=sys.stderr)
        return EXIT_SETTINGS
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = sim.run(stop, abort)
    except SimulatorError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_SETTINGS
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    print(result.table(), file=out, flush=True)
    report: Path | None = args.report
    if report is not None:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps(result.to_json(), indent=1))
        print(f"report written to {report}", file=out, flush=True)
    return EXIT_OK if result.ok else EXIT_NOT_ACKED
