"""What a simulator run measured: per device and in total, as a table for the terminal and as JSON.

``SimReport.ok`` is the run's verdict: every seq sent was acked, every device connected and none was
refused by the broker.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def in_ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds rounded to 0.01, for the report; None stays None."""
    return None if seconds is None else round(seconds * 1000.0, 2)


@dataclass
class DeviceFigures:
    device: str
    sent: int
    acked: int
    resends: int
    in_flight: int
    unsent: int
    carried: int
    skipped_full: int
    p50_ms: float | None
    p99_ms: float | None
    desired_versions: list[int]
    refused: dict[str, int]
    connects: int
    disconnects: int
    start_seq: int  # the first seq numbered in this run; this run numbered start_seq .. next_seq - 1
    next_seq: int
    error: str | None

    @property
    def not_acked(self) -> int:
        return self.in_flight + self.unsent


@dataclass
class TotalFigures:
    devices: int
    connected_at_stop: int
    never_connected: int
    refused_by_broker: int
    sent: int
    acked: int
    resends: int
    in_flight: int
    unsent: int
    not_acked: int
    carried: int
    skipped_full: int
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    desired_applied: int
    devices_with_desired: int
    refused_desired: int
    heartbeats: int
    protocol_errors: dict[str, int]  # messages to the devices that did not decode, per topic kind
    wall_s: float
    cpu_s: float
    cpu_per_s: float


@dataclass
class SimReport:
    total: TotalFigures
    devices: list[DeviceFigures]
    config: dict[str, Any]

    @property
    def ok(self) -> bool:
        t = self.total
        return t.not_acked == 0 and t.never_connected == 0 and t.refused_by_broker == 0

    def verdict(self) -> str:
        t = self.total
        problems = []
        if t.not_acked:
            worst = sum(1 for d in self.devices if d.not_acked)
            problems.append(
                f"{t.not_acked} seqs NOT acked on {worst} devices ({t.in_flight} sent, {t.unsent} never sent)"
            )
        if t.never_connected:
            problems.append(f"{t.never_connected} devices never connected")
        if t.refused_by_broker:
            problems.append(f"{t.refused_by_broker} devices refused by the broker (credentials / ACL)")
        if problems:
            return "FAILED: " + "; ".join(problems)
        return f"OK: all {t.sent} seqs sent were acked ({t.carried} carried over from an earlier run)"

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "verdict": self.verdict(),
            "config": self.config,
            "total": asdict(self.total),
            "devices": [{**asdict(d), "not_acked": d.not_acked} for d in self.devices],
        }

    def table(self, max_rows: int = 20) -> str:
        """The per-device figures (every device up to ``max_rows``; else those with the most not
        acked, then the highest p99) and the total."""
        rows = self.devices
        note = ""
        if len(rows) > max_rows:
            rows = sorted(rows, key=lambda d: (-d.not_acked, -(d.p99_ms or 0.0)))[:10]
            note = f"(the 10 devices with the most not acked / highest p99 of {len(self.devices)}; all in --report)\n"
        head = (
            f"{'device':<20} {'sent':>8} {'acked':>8} {'resends':>8} {'in-flight':>9} {'unsent':>7} "
            f"{'p50 ms':>8} {'p99 ms':>8}  desired versions"
        )
        lines = [note + head, "-" * len(head)]

        def num(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}"

        for d in rows:
            versions = ",".join(map(str, d.desired_versions[-5:])) or "-"
            lines.append(
                f"{d.device:<20} {d.sent:>8} {d.acked:>8} {d.resends:>8} {d.in_flight:>9} {d.unsent:>7} "
                f"{num(d.p50_ms):>8} {num(d.p99_ms):>8}  {versions}"
            )
        t = self.total
        lines.append("-" * len(head))
        lines.append(
            f"{'TOTAL (' + str(t.devices) + ' devices)':<20} {t.sent:>8} {t.acked:>8} {t.resends:>8} "
            f"{t.in_flight:>9} {t.unsent:>7} {num(t.p50_ms):>8} {num(t.p99_ms):>8}  "
            f"{t.desired_applied} applied on {t.devices_with_desired} devices"
        )
        lines.append(
            f"connected at stop {t.connected_at_stop}/{t.devices}, never connected {t.never_connected}, "
            f"refused by the broker {t.refused_by_broker}; heartbeats {t.heartbeats}; desired states "
            f"refused {t.refused_desired}; batches skipped (outbox full) {t.skipped_full}; "
            f"max publish->ack {num(t.max_ms)} ms"
        )
        lines.append(f"simulator CPU {t.cpu_s:.1f} s over {t.wall_s:.1f} s wall = {t.cpu_per_s:.3f} CPU-s/s")
        lines.append(self.verdict())
        return "\n".join(lines)
