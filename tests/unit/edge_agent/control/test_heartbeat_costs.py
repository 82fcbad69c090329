"""What a heartbeat says a camera costs: an agent's heartbeat carries the measured cost of the variant
it runs and each camera's figures; the busy share per variant is the part of its inference lanes its
runs took since the previous heartbeat, from the pipeline's cumulative lane time."""

from __future__ import annotations

from edge_agent.control.heartbeat import LaneShares, variant_costs
from edge_agent.vision.pipeline import VariantFigures
from fleet_protocol import TopicKind, decode, encode
from fleet_protocol.messages import Heartbeat, VariantCost
from tests.support.edge_twin import Harness, desired, model_in_store
from tests.support.waiting import wait_for


def figures(lanes: int = 1, **lane_ms: float) -> list[VariantFigures]:
    return [
        VariantFigures(v, infer_ms=10.0, cpu_ms=4.0, frames=100, lane_ms=ms, lanes=lanes)
        for v, ms in lane_ms.items()
    ]


def test_the_share_is_of_the_interval_since_the_previous_heartbeat_and_of_every_lane() -> None:
    one, two = LaneShares(), LaneShares()
    assert one.shares(figures(a=1000.0, b=0.0), now=100.0) == {}, "no interval yet"
    two.shares(figures(2, a=1000.0, b=0.0), now=100.0)
    # 2 s later: a ran 500 ms more, b 1500 ms.
    assert one.shares(figures(a=1500.0, b=1500.0), now=102.0) == {"a": 0.25, "b": 0.75}
    # Runs on two workers at once: a share of both lanes.
    assert two.shares(figures(2, a=1500.0, b=1500.0), now=102.0) == {"a": 0.125, "b": 0.375}


def test_a_variant_started_since_counts_from_zero_and_a_count_that_went_back_has_no_share() -> None:
    shares = LaneShares()
    shares.shares(figures(a=5000.0), now=10.0)
    # c started within the second; a's count went back: its share over that second is unknown.
    assert shares.shares(figures(a=200.0, c=300.0), now=11.0) == {"c": 0.3}
    assert shares.shares(figures(a=400.0, c=600.0), now=12.0) == {"a": 0.2, "c": 0.3}


def test_only_variants_that_have_run_a_frame_are_sent() -> None:
    loaded = VariantFigures("new/1", infer_ms=0.0, cpu_ms=0.0, frames=0, lane_ms=0.0)
    assert [c.variant for c in variant_costs([*figures(a=1.0), loaded], {})] == ["a"]


def test_a_run_ending_in_the_interval_but_begun_before_it_cannot_make_a_lane_more_than_busy() -> None:
    shares = LaneShares()
    shares.shares(figures(a=0.0), now=0.0)
    assert shares.shares(figures(a=1300.0), now=1.0) == {"a": 1.0}


def test_the_costs_sent_carry_the_figures_and_the_share() -> None:
    (cost,) = variant_costs(
        [VariantFigures("ped_ssdlite/1", 12.34567, 5.55555, 321, 9.0)], {"ped_ssdlite/1": 0.5}
    )
    assert (cost.variant, cost.infer_ms, cost.cpu_ms, cost.busy, cost.frames) == (
        "ped_ssdlite/1",
        12.346,
        5.556,
        0.5,
        321,
    )


def test_an_agents_heartbeat_carries_the_cost_of_the_model_it_runs(harness: Harness) -> None:
    manifest = model_in_store(harness.data_dir, "a")
    agent, t = harness.agent()
    t.deliver(TopicKind.TWIN_DESIRED, desired(1, manifest))

    def measured() -> list[VariantCost]:
        return agent.heartbeats.heartbeat().costs

    wait_for(measured, what="a variant measured")
    wait_for(lambda: agent.outbox.next_seq > 5, what="more frames inferred")
    hb = decode(TopicKind.HEARTBEAT, encode(agent.heartbeats.heartbeat()))
    assert isinstance(hb, Heartbeat)
    (cost,) = hb.costs
    assert cost.variant == "a/1" and cost.frames > 0 and cost.cpu_ms is not None
    assert cost.busy is not None and 0.0 <= cost.busy <= 1.0
    (cam,) = hb.cameras
    assert cam.model == "a:1" and cam.decode_ms is not None and cam.source_fps is not None
    assert cam.last_inferred_at is not None
