"""The fleet's autoscaler (kubestar.operator.autoscaler) and how a fleet's size changes are
reported (rolloutfleet.seen_scale): pure functions, no API server."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from kubestar.api.v1alpha1 import AutoscalingSpec, AutoscalingStatus, RolloutFleetSpec
from kubestar.operator import autoscaler
from kubestar.operator.reconciler import EngineProbe, SchedulerProbe
from kubestar.operator.rolloutfleet import seen_scale
from pydantic import ValidationError

NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)


def spec(**fields: object) -> AutoscalingSpec:
    return AutoscalingSpec.model_validate(
        {"minReplicas": 1, "maxReplicas": 8, "target": 4, **fields}
    )


def probe(queued: int = 0, *usage: float, taken_out: str = "") -> SchedulerProbe:
    engines = {
        f"e{i}": EngineProbe(1000, u, taken_out if i == 0 else "") for i, u in enumerate(usage)
    }
    return SchedulerProbe(engines, 3, "/w", queued)


def test_the_queue_per_ready_engine_adds_engines_at_once() -> None:
    # 2 engines, 20 turns waiting: 10 per engine against a target of 4 -> ceil(2 x 2.5) = 5.
    value = autoscaler.metric_value(spec(), probe(20), ready=2)
    assert value == 10
    decision = autoscaler.decide(spec(), 2, 2, value, None, NOW)
    assert decision.replicas == 5
    assert decision.status.desired_replicas == 5 and decision.status.below_target_since == ""
    assert decision.message == "queuedTurns 10 against the target 4"


def test_max_replicas_bounds_a_scale_up() -> None:
    decision = autoscaler.decide(spec(maxReplicas=3), 2, 2, 100.0, None, NOW)
    assert decision.replicas == 3


def test_within_the_tolerance_nothing_changes() -> None:
    for value in (3.7, 4.0, 4.35):
        decision = autoscaler.decide(spec(), 2, 2, value, None, NOW)
        assert decision.replicas == 2 and decision.message == "", value


def test_engines_still_starting_hold_further_changes() -> None:
    # 4 wanted, 2 ready: the queue the new ones are for is still there; counting it again
    # would add more.
    decision = autoscaler.decide(spec(), 4, 2, 50.0, None, NOW)
    assert decision.replicas == 4 and decision.status.desired_replicas == 4


def test_a_scale_down_waits_for_the_delay_from_when_the_value_fell() -> None:
    auto = spec(scaleDownDelaySeconds=60)
    first = autoscaler.decide(auto, 4, 4, 0.0, None, NOW)
    assert first.replicas == 4  # below the target from now on
    assert first.status.below_target_since == "2026-11-29T12:00:00Z"
    later = autoscaler.decide(auto, 4, 4, 0.0, first.status, NOW + timedelta(seconds=59))
    assert later.replicas == 4
    assert later.status.below_target_since == "2026-11-29T12:00:00Z"
    done = autoscaler.decide(auto, 4, 4, 0.0, later.status, NOW + timedelta(seconds=60))
    assert done.replicas == 1  # to minReplicas: nothing waits
    assert done.message == "queuedTurns 0 against the target 4 for 60 s (scaleDownDelaySeconds)"
    assert done.status.below_target_since == ""


def test_a_value_back_at_the_target_restarts_the_delay() -> None:
    auto = spec(scaleDownDelaySeconds=60)
    below = autoscaler.decide(auto, 4, 4, 0.0, None, NOW)
    back = autoscaler.decide(auto, 4, 4, 4.0, below.status, NOW + timedelta(seconds=30))
    assert back.status.below_target_since == ""
    again = autoscaler.decide(auto, 4, 4, 0.0, back.status, NOW + timedelta(seconds=70))
    assert again.replicas == 4  # 60 s from its own fall, not the first one


def test_replicas_outside_the_bounds_are_brought_in_without_metrics() -> None:
    assert autoscaler.decide(spec(minReplicas=2), 1, 1, None, None, NOW).replicas == 2
    high = autoscaler.decide(spec(maxReplicas=3), 6, 6, None, None, NOW)
    assert (high.replicas, high.message) == (3, "maxReplicas is 3")
    # No report from the scheduler: no change otherwise.
    quiet = autoscaler.decide(spec(), 3, 3, None, None, NOW)
    assert quiet.replicas == 3 and quiet.status.value is None


def test_kv_usage_is_the_mean_over_engines_taking_turns() -> None:
    auto = spec(metric="kvUsage", target=0.5)
    value = autoscaler.metric_value(
        auto, probe(0, 0.2, 0.9, 0.9, taken_out="reload timed out"), ready=3
    )
    assert value == pytest.approx(0.9)  # e0 was taken out by the scheduler
    assert autoscaler.decide(auto, 3, 3, value, None, NOW).replicas == 6
    assert autoscaler.metric_value(auto, None, ready=3) is None


def test_invalid_bounds_and_targets_are_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError, match=r"minReplicas \(4\) must not exceed maxReplicas"):
        spec(minReplicas=4, maxReplicas=2)
    with pytest.raises(ValidationError, match=r"target \(2\) must be at most 1 for metric kvUsage"):
        spec(metric="kvUsage", target=2)
    with pytest.raises(ValidationError, match="maxReplicas"):
        AutoscalingSpec.model_validate({"target": 1})
    with pytest.raises(ValidationError, match="metric"):
        spec(metric="gpuUtilisation")


def fleet(replicas: int, status: dict[str, object]) -> tuple[dict[str, object], RolloutFleetSpec]:
    return {"status": status}, RolloutFleetSpec.model_validate({"replicas": replicas})


def test_a_change_of_replicas_by_someone_else_is_reported() -> None:
    obj, fleet_spec = fleet(3, {"replicas": 1})
    event = seen_scale(obj, fleet_spec, NOW)
    assert event is not None
    assert (event.from_replicas, event.to_replicas, event.reason) == (1, 3, "SpecChanged")
    assert event.time == "2026-11-29T12:00:00Z"
    # The first status, or an unchanged size: nothing new.
    assert seen_scale(*fleet(3, {}), NOW) is None
    assert seen_scale(*fleet(1, {"replicas": 1}), NOW) is None


def test_the_operators_own_change_keeps_its_reason() -> None:
    own = {"time": "t", "fromReplicas": 1, "toReplicas": 2, "reason": "Autoscaled", "message": "m"}
    obj, fleet_spec = fleet(2, {"replicas": 1, "lastScale": own})
    event = seen_scale(obj, fleet_spec, NOW)
    assert event is not None and event.reason == "Autoscaled" and event.message == "m"


def test_the_status_fields_are_all_written() -> None:
    # The status is merge-patched: a field left out would keep an earlier value.
    status = autoscaler.decide(spec(), 2, 2, 4.0, None, NOW).status
    dumped = status.model_dump(mode="json", by_alias=True, exclude_unset=True)
    assert set(dumped) == {"value", "desiredReplicas", "belowTargetSince"}
    assert isinstance(status, AutoscalingStatus)
