"""The scheduler's pure core: engine state, vLLM /metrics parsing, admission policies.

Nothing here does I/O, reads a clock or awaits: the async scheduler
(`kubestar.scheduler.scheduler`) and a discrete-event simulator (`kubestar.scheduler.simulator`)
drive exactly the same functions, so what the simulator measures is what the service does.

Interface (what a simulator needs)
----------------------------------
* `EngineState`: one engine as the scheduler sees it. Learned from /metrics (`apply_sample`):
  `block_size`, `num_blocks` (capacity = blocks x block size), `kv_usage`, `running`,
  `waiting`, `preemptions`; kept by the scheduler itself: `reserved_tokens`, `in_flight`,
  `trajectories` (the prefix-affinity set), `healthy`. A simulator may set the fields directly.
* `TurnRequest`: one trajectory turn (`trajectory_id`, `prompt_tokens`, `max_new_tokens`,
  `seq` = arrival number, `enqueued_at` = arrival time in the caller's clock, `samples` =
  continuations sampled from the prompt, vLLM's n).
* A policy is `choose(engines, request) -> EngineState | None` (`POLICIES[name]`); None means
  "queue it". `kv_aware` may return None; `least_requests` and `round_robin` never do while
  an engine is admitting (they send at once, as static assignment and upstream verl do).
* `plan_admissions(queue, engines, policy, now)`: which queued turns go where now, in FIFO
  order with backfilling and starvation protection (`soonest_fit`); it `reserve`s on the
  chosen engines.
* `reserve(engine, request)` when a turn is sent, `release(engine, reserved, used)` when it
  ends; `check_fits(engines, request)` raises `RequestTooLarge` for a turn no engine can hold.

KV-aware admission
------------------
Per engine, in tokens, with B = block size and N = number of KV blocks::

    usable   = (N - 1) * B              # vLLM keeps one null block; kv_usage is over N - 1
    observed = kv_usage * usable - released_since_sample
    used     = max(observed, reserved)
    free     = usable - used
    need     = ceil((prompt + max_new_tokens) / B) * B
    admit on an engine iff free >= need

A turn of n samples (vLLM's n: a search tree's siblings) is one request: the engine prefills
the prompt once, its full blocks are shared by the n continuations (prefix caching), and each
continuation holds its own copy of the prompt's last, partial block and its new tokens::

    need     = floor(prompt / B) * B + n * ceil((prompt mod B + max_new_tokens) / B) * B

about prompt + n * max_new_tokens; for n = 1 the two formulas agree.

`reserved` is the sum of `need` over the turns the scheduler has in flight there: the most
KV those turns can ever hold, so while the engine's cache holds only our turns, vLLM never has
to preempt one. `observed` covers load the scheduler did not send (other clients) and keeps
the estimate honest when reservations and reality drift. The two lags of /metrics are covered
by the two terms: a turn admitted after the last sample is in `reserved` at once; a turn that
finished after the last sample still shows in `kv_usage`, so its blocks are subtracted
(`released_since_sample`) until the next sample shows them gone.

Choice: the engine that holds the trajectory's prefix (its previous turn's engine) while it has
room and is not crowded (another engine with room runs under three quarters as many turns, as
at the end of a batch, or decodes 1.5x as fast, as beside a slower engine); otherwise the
engine with the most free tokens (ties: fewer waiting in vLLM, fewer in flight, list order).
An engine with nothing left to do takes over the segment a much slower engine would still
need longest for, restarting it (`segment_to_move`): at the end of a batch on an uneven fleet
the last turns would otherwise finish on the slow engine while the fast one idles.

Segments: a long turn is admitted in segments of at most `segment_tokens` new tokens, each
reserving only its context + segment; the next segment is queued ahead of new turns and keeps
to the same engine (prefix cache) while it has room. Reserving prompt + max_new_tokens for a
whole turn would hold room the turn may never use (most turns stop long before their limit)
and cap the engine's batch well below what its cache holds; a segment reserves about what the
turn will actually hold next, and still never more than the engine has, so vLLM never
preempts. vLLM looks for stop strings within one request only: one split across two segments
is found by `find_split_stop`. A turn of n samples is admitted whole: its n continuations part
ways after the first token, so a next segment would be n requests of their own anyway, and the
steps a search samples this way are short.

Queue: FIFO with backfilling (a turn that does not fit is passed by later ones that do).
A turn that has waited `starvation_seconds` holds one engine, the one that lacks the fewest
tokens for it: nothing queued behind it is admitted there, so that engine drains until the
turn fits, while the other engines keep admitting (stopping every engine would leave them
idle for nothing). Several starving turns hold one engine each, oldest first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

KV_AWARE = "kv-aware"
LEAST_REQUESTS = "least-requests"
ROUND_ROBIN = "round-robin"

# After this long in the queue a turn that does not fit holds one engine (the one closest to
# fitting it): that engine admits nothing behind it and drains until it fits, so a big turn
# is never starved; the other engines keep admitting.
DEFAULT_STARVATION_SECONDS = 5.0

# kv-aware keeps a trajectory on its engine unless another engine that has room runs fewer
# than this share of its turns (minus one): 3 vs 0, 8 vs 4, 100 vs 73 move; 4 vs 2 stays.
AFFINITY_LOAD_RATIO = 0.75
# ... or unless another engine with room decodes a sequence this many times as fast (measured).
AFFINITY_SPEED_RATIO = 1.5
# An engine left idle takes over a segment running on a slower engine (restarting it: the
# tokens that segment generated so far are dropped) when it would end it in under this share
# of the time the slower engine still needs.
MOVE_GAIN = 0.7
# Decode-rate samples: weight of the newest, and the fewest tokens a sample needs (shorter
# generations are mostly request overhead).
DECODE_RATE_WEIGHT = 0.3
DECODE_RATE_MIN_TOKENS = 16


class RequestTooLarge(ValueError):
    """The turn needs more KV cache (or context) than any engine has in total."""


@dataclass(frozen=True)
class TurnRequest:
    trajectory_id: str
    prompt_tokens: int
    max_new_tokens: int
    # Arrival number, unique per turn (round-robin assigns by it).
    seq: int = 0
    # Arrival time in the caller's clock (starvation protection).
    enqueued_at: float = 0.0
    # Continuations sampled from the prompt in one request (vLLM's n).
    samples: int = 1

    @property
    def tokens(self) -> int:
        """The longest sequence of the turn (what the context length must hold)."""
        return self.prompt_tokens + self.max_new_tokens

    @property
    def kv_tokens(self) -> int:
        """KV the turn holds at the most, before rounding to blocks: the prompt once, the new
        tokens of every sample (a lower bound of `EngineState.need`)."""
        return self.prompt_tokens + self.samples * self.max_new_tokens


@dataclass(frozen=True)
class EngineSample:
    """What one /metrics scrape of a vLLM engine says."""

    block_size: int
    num_blocks: int
    kv_usage: float
    running: int
    waiting: int
    preemptions: int
    # The largest single engine core's blocks (a server with data parallelism has several).
    max_core_blocks: int = 0


@dataclass
class EngineState:
    name: str
    url: str = ""
    # Healthy: answering; only healthy engines that are not being removed take turns.
    healthy: bool = False
    # At least one probe has finished (until then an engine counts as possibly alive).
    probed: bool = False
    removing: bool = False
    # From vllm:cache_config_info.
    block_size: int = 0
    num_blocks: int = 0
    max_core_blocks: int = 0
    # From /v1/models; 0 = unknown.
    max_model_len: int = 0
    # Live gauges from the last sample.
    kv_usage: float = 0.0
    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    # The scheduler's own bookkeeping.
    reserved_tokens: int = 0
    in_flight: int = 0
    released_since_sample: int = 0
    trajectories: set[str] = field(default_factory=set)
    weights_version: int = 0
    # Why it takes no turns: its last failure ("" once it is up again).
    error: str = ""
    # Tokens per second one sequence decodes at here, from the turns it finished (0: unknown).
    decode_rate: float = 0.0

    @property
    def admitting(self) -> bool:
        return self.healthy and not self.removing

    @property
    def capacity_known(self) -> bool:
        return self.block_size > 0 and self.num_blocks > 1

    @property
    def capacity_tokens(self) -> int:
        """Blocks x block size, as vLLM reports it (kv_cache_size_tokens)."""
        return self.num_blocks * self.block_size

    @property
    def usable_tokens(self) -> int:
        return max(0, self.num_blocks - 1) * self.block_size

    @property
    def observed_used_tokens(self) -> int:
        observed = round(self.kv_usage * self.usable_tokens) - self.released_since_sample
        return max(0, observed)

    @property
    def used_tokens(self) -> int:
        return max(self.observed_used_tokens, self.reserved_tokens)

    @property
    def free_tokens(self) -> int:
        return self.usable_tokens - self.used_tokens

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size) * self.block_size if self.block_size else tokens

    def need(self, request: TurnRequest) -> int:
        """The most KV (tokens, whole blocks) the turn can hold on this engine: the prompt's
        full blocks once, shared by its samples, and for each sample the prompt's partial
        last block and its new tokens (see the module docstring)."""
        if request.samples <= 1 or not self.block_size:
            return self.blocks_for(request.tokens if request.samples <= 1 else request.kv_tokens)
        shared = request.prompt_tokens // self.block_size * self.block_size
        own = self.blocks_for(request.prompt_tokens - shared + request.max_new_tokens)
        return shared + request.samples * own

    def largest_request_tokens(self) -> int:
        """The largest `need` this engine can ever hold (0: not known yet)."""
        if not self.capacity_known:
            return 0
        blocks = min(self.num_blocks, self.max_core_blocks or self.num_blocks)
        return (blocks - 1) * self.block_size

    def can_ever_hold(self, request: TurnRequest) -> bool:
        if self.max_model_len and request.tokens > self.max_model_len:
            return False
        return not self.capacity_known or self.need(request) <= self.largest_request_tokens()

    def fits(self, request: TurnRequest) -> bool:
        return (
            self.capacity_known
            and self.can_ever_hold(request)
            and self.free_tokens >= self.need(request)
        )


Policy = Callable[[Sequence[EngineState], TurnRequest], "EngineState | None"]


def _affine(engines: Iterable[EngineState], request: TurnRequest) -> EngineState | None:
    if not request.trajectory_id:
        return None
    for engine in engines:
        if request.trajectory_id in engine.trajectories:
            return engine
    return None


def kv_aware(engines: Sequence[EngineState], request: TurnRequest) -> EngineState | None:
    """Prefix affinity while it has room and is not crowded, else most free KV; None (queue)
    when nothing fits."""
    candidates = [e for e in engines if e.admitting and e.fits(request)]
    if not candidates:
        return None
    affine = _affine(candidates, request)
    if affine is not None:
        fastest = max(candidates, key=lambda e: e.decode_rate)
        if affine.decode_rate and fastest.decode_rate >= AFFINITY_SPEED_RATIO * affine.decode_rate:
            return fastest
        if not _crowded(affine, candidates):
            return affine
    order = {id(e): i for i, e in enumerate(candidates)}
    return min(candidates, key=lambda e: (-e.free_tokens, e.waiting, e.in_flight, order[id(e)]))


def _crowded(engine: EngineState, candidates: Sequence[EngineState]) -> bool:
    """Another engine with room runs far fewer turns: leaving the prefix is worth it.

    Reusing the prefix saves a prefill (cheap next to decoding); staying on an engine that
    runs many more turns than another (or, `kv_aware`, is much slower) costs decode speed for
    the rest of the turn, and at the end of a batch it leaves the other engines idle."""
    lightest = min(e.in_flight for e in candidates)
    return lightest < AFFINITY_LOAD_RATIO * engine.in_flight - 1


def record_decode(engine: EngineState, tokens: int, seconds: float) -> None:
    """A generation of `tokens` took `seconds` here: update the engine's decode rate."""
    if tokens < DECODE_RATE_MIN_TOKENS or seconds <= 0:
        return
    rate = tokens / seconds
    old = engine.decode_rate
    engine.decode_rate = rate if not old else old + DECODE_RATE_WEIGHT * (rate - old)


@dataclass(frozen=True)
class RunningSegment:
    """An admission in flight: what `segment_to_move` weighs."""

    request: TurnRequest
    engine: EngineState
    elapsed_seconds: float


def segment_to_move(
    engines: Sequence[EngineState], running: Sequence[RunningSegment]
) -> tuple[RunningSegment, EngineState] | None:
    """kv-aware on an uneven fleet: an engine with nothing to do takes over the segment that a
    much slower engine (AFFINITY_SPEED_RATIO) would still need longest for, if restarting it
    there ends it sooner (MOVE_GAIN); None if nothing is worth moving.

    At the end of a batch the last turns otherwise finish on whichever engine holds them
    while a faster one idles; segments bound what a restart throws away. Rates are the
    measured per-sequence decode rates (the idle engine's, measured under load, understates
    its speed alone: the estimate errs towards staying).
    """
    idle = [e for e in engines if e.admitting and e.in_flight == 0 and e.decode_rate > 0]
    for target in sorted(idle, key=lambda e: -e.decode_rate):
        best: tuple[float, RunningSegment] | None = None
        for segment in running:
            slow = segment.engine
            if slow is target or slow.decode_rate <= 0:
                continue
            if target.decode_rate < AFFINITY_SPEED_RATIO * slow.decode_rate:
                continue
            new_tokens = segment.request.max_new_tokens
            left = max(0.0, new_tokens - segment.elapsed_seconds * slow.decode_rate)
            still_needs = left / slow.decode_rate
            on_target = new_tokens / target.decode_rate
            if on_target >= MOVE_GAIN * still_needs or not target.fits(segment.request):
                continue
            gain = still_needs - on_target
            if best is None or gain > best[0]:
                best = (gain, segment)
        if best is not None:
            return best[1], target
    return None


def least_requests(engines: Sequence[EngineState], request: TurnRequest) -> EngineState | None:
    """Upstream verl: a trajectory stays where it started, new ones go to the fewest in flight."""
    candidates = [e for e in engines if e.admitting and e.can_ever_hold(request)]
    if not candidates:
        return None
    affine = _affine(candidates, request)
    if affine is not None:
        return affine
    order = {id(e): i for i, e in enumerate(candidates)}
    return min(candidates, key=lambda e: (e.in_flight, order[id(e)]))


def round_robin(engines: Sequence[EngineState], request: TurnRequest) -> EngineState | None:
    """Static assignment: a trajectory stays where it started, new ones go in turn."""
    candidates = [e for e in engines if e.admitting and e.can_ever_hold(request)]
    if not candidates:
        return None
    affine = _affine(candidates, request)
    if affine is not None:
        return affine
    return candidates[request.seq % len(candidates)]


POLICIES: dict[str, Policy] = {
    KV_AWARE: kv_aware,
    LEAST_REQUESTS: least_requests,
    ROUND_ROBIN: round_robin,
}

# Policies that never queue while an engine is admitting.
IMMEDIATE_POLICIES = frozenset({LEAST_REQUESTS, ROUND_ROBIN})


def check_fits(engines: Sequence[EngineState], request: TurnRequest) -> None:
    """Raise RequestTooLarge when no engine (alive or not yet known) could ever run the turn.

    Engines whose capacity is not known yet give the turn the benefit of the doubt.
    """
    candidates = [e for e in engines if not e.removing and (e.healthy or not e.probed)]
    if not candidates or any(e.can_ever_hold(request) for e in candidates):
        return
    largest = max(e.largest_request_tokens() for e in candidates)
    limits = [e.max_model_len for e in candidates if e.max_model_len]
    context = f", context length {max(limits)}" if limits else ""
    samples = f" x {request.samples} samples" if request.samples > 1 else ""
    raise RequestTooLarge(
        f"turn needs {request.prompt_tokens} prompt + {request.max_new_tokens} new "
        f"tokens{samples} ({candidates[0].need(request)} KV tokens in whole blocks); the largest "
        f"engine holds {largest} KV tokens{context}"
    )


def plan_admissions(
    queue: Sequence[TurnRequest],
    engines: Sequence[EngineState],
    policy: Policy,
    now: float,
    starvation_seconds: float = DEFAULT_STARVATION_SECONDS,
) -> list[tuple[TurnRequest, EngineState]]:
    """The queued turns to send now and where, reserving for each on its engine.

    Turns are considered in queue order; one that does not fit is skipped (later, smaller
    turns may fill the room left), unless it has waited `starvation_seconds`: then it holds
    the engine closest to fitting it (`soonest_fit`), which admits nothing behind it until
    it fits there; the other engines keep admitting. Once every engine is held, the scan
    stops.
    """
    admitted: list[tuple[TurnRequest, EngineState]] = []
    open_engines = [e for e in engines if e.admitting]
    if not open_engines:
        return admitted
    # Free tokens per engine, kept current as turns are reserved (computed once: cheap scans).
    free = {id(e): e.free_tokens for e in open_engines}
    # kv-aware: a turn needing more tokens than the most free anywhere cannot fit; skipping
    # it without asking the policy, and stopping once no turn left in the queue can fit (the
    # holds matter only to this scan), keep a long queue in front of many engines cheap.
    by_room = policy is kv_aware
    most_free = _most_free(open_engines, free)
    smallest_after = _suffix_min_tokens(queue) if by_room else []
    for index, request in enumerate(queue):
        if by_room and most_free < smallest_after[index]:
            break
        engine = (
            None if by_room and request.kv_tokens > most_free else policy(open_engines, request)
        )
        if engine is None:
            if now - request.enqueued_at >= starvation_seconds:
                held = _soonest_fit(open_engines, request, free)
                if held is not None:
                    open_engines = [e for e in open_engines if e is not held]
                    if not open_engines:
                        break
                    most_free = _most_free(open_engines, free)
            continue
        reserve(engine, request)
        admitted.append((request, engine))
        free[id(engine)] = engine.free_tokens
        if by_room:
            most_free = _most_free(open_engines, free)
            # Nothing more can fit anywhere: stop scanning a long queue.
            if all(not e.capacity_known or free[id(e)] < e.block_size for e in open_engines):
                break
    return admitted


def soonest_fit(engines: Sequence[EngineState], request: TurnRequest) -> EngineState | None:
    """The engine to hold for a starving turn: of those that could ever run it, the one that
    lacks the fewest free tokens (ties: the trajectory's engine, fewer in flight, list order).

    A held engine takes nothing new, so what it lacks only shrinks as its turns finish; the
    choice moves to another engine only when that one lacks less. The turn therefore fits
    after a bounded wait however many smaller turns keep arriving.
    """
    return _soonest_fit(engines, request, {id(e): e.free_tokens for e in engines})


def _soonest_fit(
    engines: Sequence[EngineState], request: TurnRequest, free: dict[int, int]
) -> EngineState | None:
    best: EngineState | None = None
    best_key: tuple[int, bool, int] | None = None
    for engine in engines:
        if not (engine.admitting and engine.capacity_known and engine.can_ever_hold(request)):
            continue
        key = (
            engine.need(request) - free[id(engine)],
            request.trajectory_id not in engine.trajectories,
            engine.in_flight,
        )
        if best_key is None or key < best_key:  # strict: the first in list order wins ties
            best, best_key = engine, key
    return best


def _most_free(engines: Sequence[EngineState], free: dict[int, int]) -> int:
    return max((free[id(e)] for e in engines if e.capacity_known), default=0)


def _suffix_min_tokens(queue: Sequence[TurnRequest]) -> list[int]:
    """[min(r.kv_tokens for r in queue[i:]) for each i] (computed in one pass)."""
    out = [0] * len(queue)
    smallest = math.inf
    for i in range(len(queue) - 1, -1, -1):
        smallest = min(smallest, queue[i].kv_tokens)
        out[i] = int(smallest)
    return out


def segment_new_tokens(
    remaining: int, segment_tokens: int, context_tokens: int = 0, block_size: int = 0
) -> int:
    """New tokens to ask for in a turn's next segment (`segment_tokens` 0: the whole rest).

    With the engines' block size known, the segment ends on a block boundary (the last one
    within `segment_tokens`, or else the next): its reservation is then exactly the blocks
    vLLM itself will hold when the segment ends, and the next segment starts on a fresh block.
    """
    if segment_tokens <= 0:
        return remaining
    if block_size <= 0:
        return min(remaining, segment_tokens)
    end = (context_tokens + segment_tokens) // block_size * block_size
    if end <= context_tokens:
        end = (context_tokens // block_size + 1) * block_size
    return min(remaining, end - context_tokens)


def find_split_stop(previous: str, segment: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """A stop string that begins in `previous` (the turn's text so far) and ends in `segment`.

    Returns (characters of `segment` up to the end of the stop string, the stop string) for
    the one that ends first, or None. A stop string wholly inside `segment` is the engine's
    to find (it ends that request), so only split ones are looked for.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        if len(stop) < 2:
            continue
        tail = previous[-(len(stop) - 1) :]
        # An occurrence starting in the tail (shorter than the stop) must end in the segment.
        start = (tail + segment[: len(stop) - 1]).find(stop)
        if 0 <= start < len(tail):
            end = start + len(stop) - len(tail)  # in segment characters
            if best is None or end < best[0]:
                best = (end, stop)
    return best


def tokens_through(text_offsets: Sequence[int], characters: int) -> int:
    """How many tokens it takes to cover the first `characters` of a completion's text
    (`text_offsets`: where each token's text starts, as vLLM reports with logprobs)."""
    return sum(1 for offset in text_offsets if offset < characters)


def reserve(engine: EngineState, request: TurnRequest) -> int:
    """Book a turn on an engine; returns the tokens reserved (give them back to `release`)."""
    need = engine.need(request)
    engine.reserved_tokens += need
    engine.in_flight += 1
    return need


def release(engine: EngineState, reserved: int, used_tokens: int = 0) -> None:
    """A turn ended. `used_tokens` (prompt + generated) is what the engine's last sample may
    still count; it is discounted from the observed use until the next sample."""
    engine.reserved_tokens = max(0, engine.reserved_tokens - reserved)
    engine.in_flight = max(0, engine.in_flight - 1)
    if used_tokens:
        engine.released_since_sample += engine.blocks_for(used_tokens)


def apply_sample(
    engine: EngineState, sample: EngineSample, released_during_scrape: int = 0
) -> None:
    """Take a fresh /metrics sample. `released_during_scrape`: the part of
    `released_since_sample` released after the scrape began (the sample may not show it)."""
    engine.block_size = sample.block_size
    engine.num_blocks = sample.num_blocks
    engine.max_core_blocks = sample.max_core_blocks
    engine.kv_usage = sample.kv_usage
    engine.running = sample.running
    engine.waiting = sample.waiting
    engine.preemptions = sample.preemptions
    engine.released_since_sample = max(0, min(engine.released_since_sample, released_during_scrape))


# Only these lines are parsed: a vLLM scrape is ~50 kB, mostly histograms we do not need.
_WANTED = (
    "vllm:cache_config_info",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions_total",
)


def _wanted_lines(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in _WANTED:
                lines.append(line)
    return "\n".join(lines) + "\n"


def _int_label(labels: dict[str, str], name: str) -> int:
    try:
        return int(float(labels.get(name, "")))
    except ValueError:
        return 0


def parse_vllm_metrics(text: str) -> EngineSample:
    """Capacity and live use from a vLLM /metrics text (Prometheus exposition format).

    Several engine cores in one server (data parallelism, label `engine`) are summed; the
    usage is their block-weighted mean. Raises ValueError when the text has no cache config.
    """
    block_size = 0
    core_blocks: dict[str, int] = {}
    usage: dict[str, float] = {}
    running = waiting = preemptions = 0.0
    for family in text_string_to_metric_families(_wanted_lines(text)):
        for sample in family.samples:
            core = sample.labels.get("engine", "0")
            if sample.name == "vllm:cache_config_info":
                block_size = _int_label(sample.labels, "block_size") or block_size
                blocks = _int_label(sample.labels, "num_gpu_blocks")
                if not blocks and block_size:
                    blocks = _int_label(sample.labels, "kv_cache_size_tokens") // block_size
                core_blocks[core] = blocks
            elif sample.name == "vllm:kv_cache_usage_perc":
                usage[core] = float(sample.value)
            elif sample.name == "vllm:num_requests_running":
                running += sample.value
            elif sample.name == "vllm:num_requests_waiting":
                waiting += sample.value
            elif sample.name == "vllm:num_preemptions_total":
                preemptions += sample.value
    if not block_size or not core_blocks or not any(core_blocks.values()):
        raise ValueError("no vllm:cache_config_info with block_size and num_gpu_blocks")
    num_blocks = sum(core_blocks.values())
    usable = sum(max(0, b - 1) for b in core_blocks.values())
    used = sum(usage.get(core, 0.0) * max(0, b - 1) for core, b in core_blocks.items())
    return EngineSample(
        block_size=block_size,
        num_blocks=num_blocks,
        kv_usage=min(1.0, used / usable) if usable else 0.0,
        running=int(running),
        waiting=int(waiting),
        preemptions=int(preemptions),
        max_core_blocks=max(core_blocks.values()),
    )
