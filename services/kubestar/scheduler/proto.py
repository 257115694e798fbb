"""The scheduler's answers as rollout.proto messages: a finished turn, the scheduler's status,
a weight update. (Requests come in as the messages themselves: the sampling parameters of a
turn travel as `pb.SamplingParams` to the engine call.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kubestar.scheduler.core import KV_AWARE, LEAST_REQUESTS, ROUND_ROBIN, EngineState
from kubestar.v1 import rollout_pb2 as pb

if TYPE_CHECKING:
    from kubestar.scheduler.records import Turn

POLICY_TO_PROTO = {
    KV_AWARE: pb.SCHEDULING_POLICY_KV_AWARE,
    LEAST_REQUESTS: pb.SCHEDULING_POLICY_LEAST_REQUESTS,
    ROUND_ROBIN: pb.SCHEDULING_POLICY_ROUND_ROBIN,
}


def _finish(reason: str) -> pb.FinishReason:
    return pb.FINISH_REASON_LENGTH if reason == "length" else pb.FINISH_REASON_STOP


def generate_response(
    turn: Turn, engine: EngineState, finish_reason: str, stop_reason: str
) -> pb.GenerateResponse:
    """A finished turn: what its segments (or its n samples) generated, and where and how
    long it ran. The first completion also fills the fields of a one-sample answer."""
    if turn.completions:
        keep_logprobs = turn.sampling.logprobs
        completions = [
            pb.Completion(
                token_ids=c.token_ids,
                text=c.text,
                logprobs=c.logprobs if keep_logprobs else [],
                finish_reason=_finish(c.finish_reason),
                stop_reason=c.stop_reason,
            )
            for c in turn.completions
        ]
    else:
        completions = [
            pb.Completion(
                token_ids=turn.token_ids,
                text=turn.text,
                logprobs=turn.logprobs,
                finish_reason=_finish(finish_reason),
                stop_reason=stop_reason,
            )
        ]
    first = completions[0]
    return pb.GenerateResponse(
        token_ids=first.token_ids,
        text=first.text,
        logprobs=first.logprobs,
        finish_reason=first.finish_reason,
        stop_reason=first.stop_reason,
        completions=completions,
        engine=engine.name,
        queue_ms=turn.queue_seconds * 1000.0,
        generate_ms=turn.generate_seconds * 1000.0,
        attempts=turn.attempts,
        weights_version=engine.weights_version,
    )


def status_response(
    policy: str,
    engines: Sequence[EngineState],
    queued: int,
    admitted: int,
    retried: int,
    weights_version: int,
    weights_path: str = "",
) -> pb.GetSchedulerStatusResponse:
    return pb.GetSchedulerStatusResponse(
        policy=POLICY_TO_PROTO[policy],
        engines=[
            pb.EngineStatus(
                name=s.name,
                url=s.url,
                healthy=s.admitting,
                capacity_tokens=s.capacity_tokens,
                kv_usage=s.kv_usage,
                running=s.running,
                waiting=s.waiting,
                reserved_tokens=s.reserved_tokens,
                in_flight=s.in_flight,
                preemptions=s.preemptions,
                error="" if s.admitting else s.error,
            )
            for s in engines
        ],
        queued=queued,
        admitted=admitted,
        retried=retried,
        weights_version=weights_version,
        weights_path=weights_path,
    )


def weights_response(
    version: int, engines: Sequence[str], seconds: float
) -> pb.UpdateWeightsResponse:
    """A weight update: the new version, the engines that loaded it, and how long it took."""
    return pb.UpdateWeightsResponse(version=version, engines=list(engines), seconds=seconds)
