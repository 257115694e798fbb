"""Infrastructure failures kept apart from the policy's mistakes.

A trajectory is spoiled when an engine or the rollout scheduler failed while generating it
(finish reason `error`) or when the sandbox could not run one of its calls (`internal`,
`queue-timeout`): its reward says nothing about the policy, so it never enters a group, and
its tool errors never reach Resample-on-Correct's penalty. When more than
`spec.resilience.maxInfraFailureFraction` of a step's trajectories are spoiled, the step is
rolled out again (after a back-off that doubles) instead of trained on; after
`rolloutAttempts` the run fails with reason InfrastructureFailures.

Weights reach the engines through the rollout scheduler, which keeps them in memory: each
push has a deadline and is tried again when the scheduler is away (`push_weights`), and
before each rollout the trainer checks that the scheduler still serves the latest weights
and pushes them again if a restart lost them (`ensure_weights`). Between two tries the
back-off is the longest wait: meanwhile the scheduler is asked for its status every
READY_POLL_SECONDS, and a scheduler that was away (a deleted pod) and answers again (its
replacement) is tried again at once, not when the back-off ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from kubestar.api.errors import KubestarError
from kubestar.api.v1alpha1 import ResilienceSpec, RolloutRetry
from kubestar.scheduler.client import SchedulerClient
from kubestar.training.trajectory import Trajectory
from kubestar.v1 import rollout_pb2 as pb

T = TypeVar("T")

log = logging.getLogger(__name__)

MAX_BACKOFF_SECONDS = 600.0
# During a back-off between two tries of a call to the rollout scheduler (`with_retries`): how
# often it is asked whether it answers again, and how long one such question may take.
READY_POLL_SECONDS = 0.5
READY_PROBE_SECONDS = 2.0


class InfrastructureFailure(KubestarError):
    """A step's rollouts stayed spoiled by infrastructure failures through every attempt."""


@dataclass(frozen=True)
class SpoiledCount:
    """How many of a rollout's trajectories infrastructure failures spoiled, and by what."""

    trajectories: int
    spoiled: int
    causes: dict[str, int]  # cause (Trajectory.infra_failure) -> trajectories
    first_error: str

    @property
    def fraction(self) -> float:
        return self.spoiled / self.trajectories if self.trajectories else 0.0

    def describe(self) -> str:
        causes = ", ".join(f"{cause} {n}" for cause, n in sorted(self.causes.items()))
        text = f"{self.spoiled} of {self.trajectories} trajectories spoiled ({causes})"
        return f"{text}; first: {self.first_error}" if self.first_error else text


def count_spoiled(trajectories: Sequence[Trajectory]) -> SpoiledCount:
    spoiled = [t for t in trajectories if t.infra_failure]
    return SpoiledCount(
        trajectories=len(trajectories),
        spoiled=len(spoiled),
        causes=dict(Counter(t.infra_failure for t in spoiled)),
        first_error=next((t.infra_error_text for t in spoiled if t.infra_error_text), "")[:300],
    )


def backoff_seconds(attempt: int, base: float) -> float:
    """Wait after failed attempt `attempt` (1, 2, ...): base, 2 base, 4 base, ... capped."""
    return min(base * 2.0 ** (attempt - 1), MAX_BACKOFF_SECONDS)


def rollout_step(
    rollout: Callable[[], tuple[list[Trajectory], Any]],
    spec: ResilienceSpec,
    step: int,
    on_retry: Callable[[RolloutRetry], None],
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[list[Trajectory], Any, int]:
    """Roll out step `step` until few enough trajectories are spoiled: the rollout, its
    stats and the attempts it took. `on_retry` hears of each attempt that is thrown away
    (and of the last one before InfrastructureFailure is raised)."""
    for attempt in range(1, spec.rollout_attempts + 1):
        trajectories, stats = rollout()
        count = count_spoiled(trajectories)
        if count.fraction <= spec.max_infra_failure_fraction:
            return trajectories, stats, attempt
        last = attempt == spec.rollout_attempts
        limit = f"more than maxInfraFailureFraction {spec.max_infra_failure_fraction:g}"
        if last:
            message = (
                f"step {step}: rollout attempt {attempt} of {attempt}: {count.describe()}, "
                f"{limit}: giving up (check the RolloutFleet's engines and scheduler and the "
                "SandboxPool; spec.resilience sets the limits)"
            )
        else:
            wait = backoff_seconds(attempt, spec.retry_backoff_seconds)
            message = (
                f"step {step}: rollout attempt {attempt} of {spec.rollout_attempts}: "
                f"{count.describe()}, {limit}: rolling out again in {wait:g} s"
            )
        log.warning("%s", message)
        on_retry(
            RolloutRetry(
                step=step,
                attempt=attempt,
                attempts=spec.rollout_attempts,
                spoiled=count.spoiled,
                trajectories=count.trajectories,
                message=message,
            )
        )
        if last:
            raise InfrastructureFailure(message)
        sleep(wait)
    raise AssertionError("unreachable: rollout_attempts >= 1")


# What a scheduler that is restarting, overloaded or past a deadline answers: worth another
# try. Refusals (a bad token, a bad path) are not.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
    }
)


@dataclass
class Retries:
    """A back-off for `with_retries` (its `sleep`) that counts the tries after the first
    (a back-off cut short because the service answers again counts too)."""

    count: int = 0

    async def sleep(self, seconds: float) -> None:
        self.count += 1
        await asyncio.sleep(seconds)


async def answers_again(probe: Callable[[], Awaitable[object]], poll: float) -> None:
    """Returns once `probe()` fails (the service is away: an RPC error, or no answer within
    READY_PROBE_SECONDS) and then succeeds (it is back); never while it keeps answering, as a
    service that is there failed the call for another reason (a deadline, an overload)."""
    away = False
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time()
        try:
            # Not asyncio.wait_for: on Python 3.11 it can swallow the cancellation that ends
            # the watch when the probe answers at that moment.
            async with asyncio.timeout(READY_PROBE_SECONDS):
                await probe()
        except (grpc.aio.AioRpcError, TimeoutError):
            away = True
        else:
            if away:
                return
        await asyncio.sleep(max(0.0, poll - (loop.time() - asked)))


async def back_off(
    seconds: float,
    sleep: Callable[[float], Awaitable[None]],
    ready: Callable[[], Awaitable[object]] | None,
    poll: float,
) -> bool:
    """`sleep(seconds)`, cut short when `ready` (a probe: see `answers_again`) says the
    service was away and answers again; True then."""
    if ready is None or seconds <= 0:
        await sleep(seconds)
        return False
    # The back-off first: `sleep` starts (a counting sleep counts) before any probe answers.
    waiting = asyncio.ensure_future(sleep(seconds))
    watching = asyncio.ensure_future(answers_again(ready, poll))
    try:
        await asyncio.wait((waiting, watching), return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done() and (error := watching.exception()) is not None:
            log.warning("asking whether the service answers again failed: %r", error)
            await waiting  # the plain back-off, then
        if waiting.done():
            waiting.result()  # what the back-off raised, if it did
            return False
        return True
    finally:
        for task in (waiting, watching):
            task.cancel()
        await asyncio.gather(waiting, watching, return_exceptions=True)


async def with_retries(
    call: Callable[[], Awaitable[T]],
    what: str,
    attempts: int,
    backoff: float,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ready: Callable[[], Awaitable[object]] | None = None,
    poll: float = READY_POLL_SECONDS,
) -> T:
    """`call()` until it succeeds, up to `attempts` times when it fails in a way a retry may
    mend; then InfrastructureFailure naming `what`. Between tries `sleep` backs off (base
    `backoff`, doubled each time); with `ready`, a cheap call to the same service asked every
    `poll` s meanwhile, a back-off ends early once the service, found away, answers again."""
    for attempt in range(1, attempts + 1):
        try:
            return await call()
        except grpc.aio.AioRpcError as error:
            code = error.code()
            failure = f"{what}: {code.name}: {error.details() or ''}".rstrip(": ")
            if code not in RETRYABLE:
                raise InfrastructureFailure(failure) from None
            if attempt == attempts:
                raise InfrastructureFailure(
                    f"{failure} (attempt {attempt} of {attempts}: giving up)"
                ) from None
            wait = backoff_seconds(attempt, backoff)
            log.warning("%s (attempt %d of %d; again in %g s)", failure, attempt, attempts, wait)
            started = time.monotonic()
            if await back_off(wait, sleep, ready, poll):
                log.warning(
                    "%s: it answers again %.1f s into the %g s back-off: attempt %d of %d now",
                    what,
                    time.monotonic() - started,
                    wait,
                    attempt + 1,
                    attempts,
                )
    raise AssertionError("unreachable: attempts >= 1")


async def push_weights(
    client: SchedulerClient,
    path: str,
    version: int,
    spec: ResilienceSpec,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> pb.UpdateWeightsResponse:
    """Every engine loads `path` as version `version`, within the deadline, tried again."""
    return await with_retries(
        lambda: client.update_weights(path, version, timeout=spec.weights_update_seconds),
        f"pushing weights v{version} ({path}) through the rollout scheduler {client.endpoint}",
        spec.weights_update_attempts,
        spec.retry_backoff_seconds,
        sleep,
        ready=client.status,
    )


async def ensure_weights(
    client: SchedulerClient,
    path: str,
    version: int,
    spec: ResilienceSpec,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> bool:
    """Push the latest weights again when the scheduler no longer serves them (a restart
    loses them: engines that join would serve the base weights); True if it had to."""
    status = await with_retries(
        client.status,
        f"asking the rollout scheduler {client.endpoint} for its weights",
        spec.weights_update_attempts,
        spec.retry_backoff_seconds,
        sleep,
        ready=client.status,
    )
    if (status.weights_version, status.weights_path) == (version, path):
        return False
    log.warning(
        "the rollout scheduler serves weights v%d (%s), not v%d (%s): restarted? pushing "
        "them again",
        status.weights_version,
        status.weights_path or "the engines' own",
        version,
        path,
    )
    await push_weights(client, path, version, spec, sleep)
    return True
