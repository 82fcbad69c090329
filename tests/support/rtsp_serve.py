"""An RTSP camera for the tests: GStreamer's RTSP server streaming footage as H.264, looped.

Run by the Debian python (``/usr/bin/python3`` with ``python3-gi``), not the project's virtualenv,
which cannot import ``gi``; so this file imports the standard library and GStreamer only, never the
project. ``tests/support/rtsp_server.py`` starts it and checks it answers.

The footage is encoded once (x264enc: zerolatency, no B-frames, a keyframe every ``--key-int`` frames),
each access unit kept as one buffer in ``--cache`` so that a restart on the same port serves at once.
Every client gets its own media (not shared): an ``appsrc`` that hands out the encoded frames in a loop
with their timestamps, which the server's sinks play at the footage's rate like a live camera.

Usage: /usr/bin/python3 rtsp_serve.py --port P --path /cam --footage F --cache C [--frames N]
[--fps R] [--user U [--auth basic|digest]] (password from the environment variable RTSP_SERVE_PASSWORD, kept out of ps).
"""

from __future__ import annotations

import argparse
import os
import signal
import struct
import sys
from pathlib import Path

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtsp", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstRtsp, GstRtspServer  # noqa: E402

PASSWORD_ENV = "RTSP_SERVE_PASSWORD"
_LEN = struct.Struct(">I")


def encode(footage: Path, frames: int, key_int: int) -> list[bytes]:
    """The first ``frames`` frames of ``footage`` as H.264 access units (Annex B)."""
    pipeline = Gst.parse_launch(
        f'filesrc location="{footage}" ! decodebin ! videoconvert ! video/x-raw,format=I420 ! '
        f"x264enc tune=zerolatency speed-preset=ultrafast bframes=0 key-int-max={key_int} ! "
        "video/x-h264,stream-format=byte-stream,alignment=au,profile=constrained-baseline ! "
        "appsink name=sink sync=false"
    )
    sink = pipeline.get_by_name("sink")
    pipeline.set_state(Gst.State.PLAYING)
    units: list[bytes] = []
    try:
        while len(units) < frames:
            sample = sink.emit("try-pull-sample", 30 * Gst.SECOND)
            if sample is None:
                break  # end of the footage
            buf = sample.get_buffer()
            units.append(buf.extract_dup(0, buf.get_size()))
    finally:
        pipeline.set_state(Gst.State.NULL)
    if not units:
        raise SystemExit(f"no frame encoded from {footage}")
    return units


def load_or_encode(cache: Path, footage: Path, frames: int, key_int: int) -> list[bytes]:
    if cache.exists():
        data = cache.read_bytes()
        units, at = [], 0
        while at < len(data):
            (n,) = _LEN.unpack_from(data, at)
            units.append(data[at + _LEN.size : at + _LEN.size + n])
            at += _LEN.size + n
        return units
    units = encode(footage, frames, key_int)
    part = cache.with_name(cache.name + f".{os.getpid()}.part")
    part.write_bytes(b"".join(_LEN.pack(len(u)) + u for u in units))
    part.replace(cache)  # whole or absent: a server killed while writing leaves no half cache
    return units


class LoopFactory(GstRtspServer.RTSPMediaFactory):
    """One appsrc pipeline per client, fed the encoded frames in a loop."""

    def __init__(self, units: list[bytes], fps: int) -> None:
        super().__init__()
        self.units = units
        self.fps = fps
        self.set_launch(
            "( appsrc name=src format=time "
            f"caps=video/x-h264,stream-format=byte-stream,alignment=au,framerate={fps}/1 "
            "! h264parse config-interval=-1 ! rtph264pay name=pay0 pt=96 config-interval=-1 )"
        )
        self.connect("media-configure", self._configure)

    def _configure(self, _factory: object, media: GstRtspServer.RTSPMedia) -> None:
        src = media.get_element().get_child_by_name("src")
        state = {"n": 0}
        duration = Gst.SECOND // self.fps

        def need_data(appsrc: Gst.Element, _length: int) -> None:
            n = state["n"]
            unit = self.units[n % len(self.units)]
            buf = Gst.Buffer.new_wrapped(unit)
            buf.pts = buf.dts = n * duration
            buf.duration = duration
            state["n"] = n + 1
            appsrc.emit("push-buffer", buf)

        src.connect("need-data", need_data)


def _log_setups(_server: object, client: GstRtspServer.RTSPClient) -> None:
    """Each SETUP's path and the transport the client asked for (``SETUP /cam RTP/AVP/TCP;...``), for
    the tests that check which transport a camera took."""

    def on_setup(_client: object, ctx: GstRtspServer.RTSPContext) -> None:
        path = ctx.uri.abspath if ctx.uri is not None else "?"
        found, transport = ctx.request.get_header(GstRtsp.RTSPHeaderField.TRANSPORT, 0)
        print(f"SETUP {path} {transport if found == GstRtsp.RTSPResult.OK else '?'}", flush=True)

    client.connect("setup-request", on_setup)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--path", action="append", help="a mount path (repeatable; default /cam)")
    ap.add_argument("--footage", type=Path, required=True)
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--fps", type=int, default=10)
    ap.add_argument("--key-int", type=int, default=10)
    ap.add_argument("--user")
    ap.add_argument("--auth", choices=("basic", "digest"), default="basic")
    args = ap.parse_args()
    Gst.init(None)
    units = load_or_encode(args.cache, args.footage, args.frames, args.key_int)

    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(str(args.port))
    factory = LoopFactory(units, args.fps)
    password = os.environ.get(PASSWORD_ENV)
    if args.user is not None and password is not None:
        auth = GstRtspServer.RTSPAuth()
        token = GstRtspServer.RTSPToken()
        token.set_string("media.factory.role", "viewer")
        if args.auth == "digest":
            auth.set_supported_methods(GstRtsp.RTSPAuthMethod.DIGEST)
            auth.add_digest(args.user, password, token)
        else:
            auth.add_basic(GstRtspServer.RTSPAuth.make_basic(args.user, password), token)
        server.set_auth(auth)
        permissions = GstRtspServer.RTSPPermissions()
        permissions.add_permission_for_role("viewer", "media.factory.access", True)
        permissions.add_permission_for_role("viewer", "media.factory.construct", True)
        factory.set_permissions(permissions)
    paths = args.path or ["/cam"]
    for path in paths:
        server.get_mount_points().add_factory(path, factory)
    server.connect("client-connected", _log_setups)
    if server.attach(None) == 0:
        raise SystemExit(f"cannot listen on 127.0.0.1:{args.port}")

    loop = GLib.MainLoop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, sig, loop.quit)
    print(f"serving {' '.join(paths)} on 127.0.0.1:{args.port} ({len(units)} frames looped)", flush=True)
    loop.run()


if __name__ == "__main__":
    sys.exit(main())
