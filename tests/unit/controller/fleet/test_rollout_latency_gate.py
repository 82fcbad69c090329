"""The gate's relative latency check: a model far slower than its predecessor on the same device fails
the wave, whatever the hardware, and the verdict says by how much."""

from __future__ import annotations

from controller.fleet.gate import Advance, Finish, GateConfig, GateResult, step
from tests.support.rollout_views import T0, dev, member, ro, running


def test_latency_ratio_against_the_latency_before() -> None:
    gate = GateConfig(soak_s=0, max_latency_ratio=3)
    r = ro({"d1": member("d1", state="active", settled_at=T0, baseline_latency_ms=25.0)}, gate=gate)
    bad = step(r, {"d1": dev("d1", **running(ms=400.0))}, T0 + 1)
    assert isinstance(bad[0], GateResult) and not bad[0].passed
    assert bad[0].figures["latency_ratio"] == {"d1": 16.0} and bad[0].figures["latency_ratio_max"] == 16.0
    assert bad[0].reason == "inference latency rose above 3x the latency before: d1 16.0x (400.0 ms)"
    assert isinstance(bad[1], Finish) and bad[1].state == "failed" and "16.0x" in bad[1].reason
    good = step(r, {"d1": dev("d1", **running(ms=60.0))}, T0 + 1)
    assert isinstance(good[0], GateResult) and good[0].passed and good[1] == Advance(1)


def test_no_latency_before_means_no_ratio_to_judge() -> None:
    gate = GateConfig(soak_s=0, max_latency_ratio=3)
    r = ro({"d1": member("d1", state="active", settled_at=T0)}, gate=gate)  # it ran nothing before
    out = step(r, {"d1": dev("d1", **running(ms=400.0))}, T0 + 1)
    assert isinstance(out[0], GateResult) and out[0].passed and out[0].figures["latency_ratio"] == {}
