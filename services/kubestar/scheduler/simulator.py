"""Discrete-event simulator of a rollout fleet: N engines, thousands of multi-turn trajectories.

Projects the scheduler comparison of `bench/scheduler_bench.py` (two real engines) to a large
fleet; `bench/rollout_sim.py` is its command line. The admission decisions are made by the
scheduler's own code (`kubestar.scheduler.core`: `plan_admissions` with the `POLICIES`,
`reserve`, `release`) on simulated `EngineState`s, so the policies are exactly the service's.

Model
-----
* Engine: KV capacity `kv_tokens` in blocks of `block_size`; continuous batching in vLLM's
  manner: every step each running sequence decodes one token; a step takes
  `step_base_s + step_per_seq_s * batch` (+ prefill of newly admitted tokens at
  `prefill_tokens_per_s`). Waiting sequences are admitted FIFO while their blocks fit.
  When a step would need more blocks than the cache has, the newest running sequence is
  preempted (its KV freed; it goes back to the front of the waiting queue and recomputes its
  prompt plus the tokens generated so far when resumed), as vLLM V1 does.
  Steps are simulated in chunks of up to `chunk` steps (no sequence finishes and no block
  overflows inside a chunk); arrivals join at the next chunk boundary. Keep chunks short
  (default 4): a turn kv-aware admits holds its reserved blocks unused until the boundary,
  and at 16 steps that alone made kv-aware look ~10% slower than the real bench.
* Prefix cache: a turn that lands on the engine that ran the trajectory's previous turn
  prefills only the new tokens (previous output + tool output); elsewhere the whole context.
* Trajectory: prompt, then turns with long-tailed (lognormal) output lengths; between turns a
  tool call (lognormal pause, mean `tool_s`) adds tool-output tokens to the context.
* Segments (kv-aware, `segment_tokens`): a turn is admitted in segments of at most that
  many new tokens, as the service does; the next segment joins the front of the queue as the
  last one ends. An idle engine takes over a segment from a much slower engine as the service
  does (`segment_to_move`; the segment restarts there, its tokens so far dropped).
* Uneven fleet (`slow_engines` K, `slow_factor` F): the first K engines take F times as
  long for every step and prefill. The scheduler measures each engine's decode rate from the
  segments it finishes there, as the service does from real generations.
* Scheduler: sees exact KV use (kv_usage set from the engine at every decision; the real one
  samples /metrics every 100-200 ms) and scans the first `window` queued turns per
  decision (the service scans the whole queue).
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kubestar.scheduler.core import (
    KV_AWARE,
    LEAST_REQUESTS,
    POLICIES,
    ROUND_ROBIN,
    EngineState,
    RunningSegment,
    TurnRequest,
    plan_admissions,
    record_decode,
    release,
    segment_new_tokens,
    segment_to_move,
)

# Round-robin first: the baseline the other policies are compared with.
POLICY_ORDER = (ROUND_ROBIN, LEAST_REQUESTS, KV_AWARE)


@dataclass(frozen=True)
class SimConfig:
    engines: int = 64
    trajectories: int = 4096
    seed: int = 0
    # KV cache per engine (tokens) and block size: e.g. a 7B model on an 80 GB GPU holds
    # ~100k tokens; smaller here so that capacity binds with a long-tailed mix.
    kv_tokens: int = 65_536
    block_size: int = 16
    max_context: int = 16_384
    # Step time = base + per_seq * batch (GPU-like defaults: ~25 ms at batch 1, ~60 at 128).
    step_base_s: float = 0.025
    step_per_seq_s: float = 0.0003
    prefill_tokens_per_s: float = 20_000.0
    turn_overhead_s: float = 0.01
    # Workload: prompt tokens uniform in [prompt_min, prompt_max]; turns uniform in
    # [turns_min, turns_max]; output tokens per turn lognormal(median, sigma), capped.
    prompt_min: int = 200
    prompt_max: int = 800
    turns_min: int = 1
    turns_max: int = 6
    new_median: int = 300
    new_sigma: float = 1.1
    new_max: int = 6_000
    tool_s: float = 0.3
    tool_tokens_min: int = 20
    tool_tokens_max: int = 300
    chunk: int = 4
    window: int = 256
    starvation_s: float = 5.0
    # kv-aware admits long turns in segments of this many new tokens (0: whole turns).
    segment_tokens: int = 0
    # An uneven fleet (an older GPU, a noisy neighbour): the first `slow_engines` engines take
    # `slow_factor` times as long for every step and prefill.
    slow_engines: int = 0
    slow_factor: float = 1.0

    @property
    def usable_tokens(self) -> int:
        return (self.kv_tokens // self.block_size - 1) * self.block_size


@dataclass(frozen=True)
class Turn:
    new_tokens: int
    tool_s: float
    tool_tokens: int


@dataclass(frozen=True)
class Trajectory:
    prompt_tokens: int
    turns: tuple[Turn, ...]


def make_workload(config: SimConfig) -> list[Trajectory]:
    rng = random.Random(config.seed)
    sigma_tool = 0.5
    out = []
    for _ in range(config.trajectories):
        prompt = rng.randint(config.prompt_min, config.prompt_max)
        context = prompt
        turns: list[Turn] = []
        for _ in range(rng.randint(config.turns_min, config.turns_max)):
            new = int(rng.lognormvariate(math.log(config.new_median), config.new_sigma))
            new = max(1, min(config.new_max, new, config.max_context - context))
            if new < 1 or context + new > config.max_context:
                break
            tool = rng.randint(config.tool_tokens_min, config.tool_tokens_max)
            pause = rng.lognormvariate(math.log(config.tool_s) - sigma_tool**2 / 2, sigma_tool)
            turns.append(Turn(new, pause, tool))
            context += new + tool
            if context >= config.max_context:
                break
        if turns:
            out.append(Trajectory(prompt, tuple(turns)))
    return out


@dataclass(eq=False)
class Seq:
    """One turn on an engine."""

    request: TurnRequest
    traj: int
    turn: int
    context: int  # tokens in KV when running (prompt + generated so far)
    remaining: int
    prefill: int  # tokens to prefill when (re)admitted
    reserved: int = 0
    arrived: float = 0.0
    # New tokens of the turn left after this segment.
    left_after: int = 0
    sent_at: float = 0.0  # when the engine got it (its decode rate is measured from here)


@dataclass(eq=False)
class SimEngine:
    state: EngineState
    index: int
    running: list[Seq] = field(default_factory=list)
    waiting: deque[Seq] = field(default_factory=deque)
    busy: bool = False
    idle_since: float = 0.0
    idle_s: float = 0.0
    preemptions: int = 0
    steps: int = 0
    max_blocks_used: int = 0
    kv_blocks: int = 0  # blocks in use at the start of the current chunk
    slowdown: float = 1.0  # step and prefill times are multiplied by this


@dataclass
class SimResult:
    policy: str
    makespan_s: float
    idle_fraction: float
    idle_engine_s: float
    preemptions: int
    turns: int
    queued_on_arrival: int
    queue_mean_s: float
    queue_p95_s: float
    capacity_ok: bool
    wall_s: float
    moves: int = 0  # kv-aware: segments an idle engine took over from a slower one


class Simulation:
    def __init__(self, config: SimConfig, policy: str, workload: list[Trajectory]) -> None:
        self.config = config
        self.policy_name = policy
        self.policy = POLICIES[policy]
        self.workload = workload
        self.blocks = config.kv_tokens // config.block_size
        self.engines = [
            SimEngine(
                EngineState(
                    name=f"e{i}",
                    healthy=True,
                    probed=True,
                    block_size=config.block_size,
                    num_blocks=self.blocks,
                    max_model_len=config.max_context,
                ),
                i,
                slowdown=config.slow_factor if i < config.slow_engines else 1.0,
            )
            for i in range(config.engines)
        ]
        self.events: list[tuple[float, int, str, Any]] = []
        self.counter = 0
        self.queue: list[TurnRequest] = []
        self.pending: dict[int, Seq] = {}  # request seq -> Seq, queued in the scheduler
        self.last_engine: dict[int, int] = {}
        self.contexts: dict[int, int] = {}  # trajectory -> tokens of context for next turn
        self.prev_context: dict[int, int] = {}  # trajectory -> context cached by last turn
        self.queue_s: list[float] = []
        self.queued_on_arrival = 0
        self.turns_done = 0
        self.trajectories_left = len(workload)
        self.now = 0.0
        self.seq_no = 0
        self.capacity_ok = True
        self.dirty = False
        self.need: dict[int, int] = {}
        self.arrived_now: list[TurnRequest] = []
        self.segment_tokens = config.segment_tokens if policy == KV_AWARE else 0
        self.moves = 0

    # -- events --
    def push(self, at: float, kind: str, payload: Any) -> None:
        self.counter += 1
        heapq.heappush(self.events, (at, self.counter, kind, payload))

    def run(self) -> SimResult:
        started = time.monotonic()
        for t, traj in enumerate(self.workload):
            self.contexts[t] = traj.prompt_tokens
            self.push(0.0, "arrive", (t, 0))
        while self.events:
            at, _, kind, payload = heapq.heappop(self.events)
            self.now = at
            if kind == "arrive":
                self.arrive(*payload)
            elif kind == "step":
                self.step_done(payload)
            # Decide once per instant, and only when a turn arrived or ended.
            if self.dirty and (not self.events or self.events[0][0] > at):
                self.dispatch()
                self.dirty = False
        makespan = self.now
        idle = 0.0
        for e in self.engines:
            idle += e.idle_s + (makespan - e.idle_since if not e.busy else 0.0)
        qs = sorted(self.queue_s)
        return SimResult(
            policy=self.policy_name,
            makespan_s=makespan,
            idle_fraction=idle / (makespan * len(self.engines)) if makespan else 0.0,
            idle_engine_s=idle,
            preemptions=sum(e.preemptions for e in self.engines),
            turns=self.turns_done,
            queued_on_arrival=self.queued_on_arrival,
            queue_mean_s=sum(qs) / len(qs) if qs else 0.0,
            queue_p95_s=qs[int(0.95 * (len(qs) - 1))] if qs else 0.0,
            capacity_ok=self.capacity_ok,
            moves=self.moves,
            wall_s=time.monotonic() - started,
        )

    def arrive(self, traj: int, turn: int) -> None:
        spec = self.workload[traj].turns[turn]
        self.enqueue(traj, turn, self.contexts[traj], spec.new_tokens, front=False)

    def continue_turn(self, s: Seq) -> None:
        self.enqueue(s.traj, s.turn, s.context, s.left_after, front=True)

    def enqueue(self, traj: int, turn: int, context: int, new_tokens: int, front: bool) -> None:
        self.seq_no += 1
        segment = segment_new_tokens(
            new_tokens, self.segment_tokens, context, self.config.block_size
        )
        request = TurnRequest(
            trajectory_id=str(traj),
            prompt_tokens=context,
            max_new_tokens=segment,
            seq=self.seq_no,
            enqueued_at=self.now,
        )
        self.pending[request.seq] = Seq(
            request,
            traj,
            turn,
            context,
            segment,
            0,
            arrived=self.now,
            left_after=new_tokens - segment,
        )
        self.need[request.seq] = self.engines[0].state.need(request)
        if front:
            self.queue.insert(0, request)
        else:
            self.queue.append(request)
            self.arrived_now.append(request)
        self.dirty = True

    def dispatch(self) -> None:
        self.admit()
        if self.policy_name == KV_AWARE and self.segment_tokens and self.move_to_idle_engine():
            self.admit()

    def admit(self) -> None:
        arrived, self.arrived_now = self.arrived_now, []
        if not self.queue:
            return
        for e in self.engines:
            self.sync_state(e)
        states = [e.state for e in self.engines]
        # Least-requests and round-robin send every turn at once: give them the whole queue.
        window = self.queue if self.policy_name != KV_AWARE else self.queue[: self.config.window]
        if self.policy_name == KV_AWARE:
            # Exactly what plan_admissions would admit, cheaper: a turn that needs more than
            # the most free room anywhere is skipped by it anyway (free only shrinks while it
            # plans), unless it has starved, when it holds an engine; keep those.
            most_free = max(s.free_tokens for s in states)
            starved = self.now - self.config.starvation_s
            window = [
                r for r in window if self.need[r.seq] <= most_free or r.enqueued_at <= starved
            ]
        admitted = plan_admissions(window, states, self.policy, self.now, self.config.starvation_s)
        sent = {r.seq for r, _ in admitted}
        if sent:
            self.queue = [r for r in self.queue if r.seq not in sent]
        self.queued_on_arrival += sum(1 for r in arrived if r.seq not in sent)
        by_name = {e.state.name: e for e in self.engines}
        for request, state in admitted:
            engine = by_name[state.name]
            seq = self.pending.pop(request.seq)
            seq.reserved = state.need(request)
            self.queue_s.append(self.now - seq.arrived)
            state.trajectories.add(request.trajectory_id)
            cached = (
                self.prev_context.get(seq.traj, 0)
                if self.last_engine.get(seq.traj) == engine.index
                else 0
            )
            seq.prefill = max(1, seq.context - cached)
            seq.sent_at = self.now
            self.last_engine[seq.traj] = engine.index
            engine.waiting.append(seq)
            self.wake(engine)

    def move_to_idle_engine(self) -> bool:
        """As the service does: an idle engine takes over a segment from a much slower one
        (restarted: the tokens it generated so far are dropped)."""
        running = {
            id(segment): (e, s, segment)
            for e in self.engines
            for s in [*e.running, *e.waiting]
            for segment in [RunningSegment(s.request, e.state, self.now - s.sent_at)]
        }
        choice = segment_to_move([e.state for e in self.engines], [r[2] for r in running.values()])
        if choice is None:
            return False
        e, s, _ = running[id(choice[0])]
        if s in e.running:
            e.running.remove(s)
        else:
            e.waiting.remove(s)
        release(e.state, s.reserved)
        self.moves += 1
        request = s.request
        self.enqueue(
            s.traj, s.turn, request.prompt_tokens, request.max_new_tokens + s.left_after, True
        )
        return True

    def sync_state(self, e: SimEngine) -> None:
        usable = self.blocks - 1
        e.state.kv_usage = min(1.0, e.kv_blocks / usable)
        e.state.running = len(e.running)
        e.state.waiting = len(e.waiting)
        e.state.preemptions = e.preemptions
        e.state.released_since_sample = 0

    def blocks_of(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def wake(self, e: SimEngine) -> None:
        if not e.busy:
            e.busy = True
            e.idle_s += self.now - e.idle_since
            self.start_chunk(e)

    def start_chunk(self, e: SimEngine) -> None:
        c = self.config
        usable = self.blocks - 1
        used = sum(self.blocks_of(s.context) for s in e.running)
        prefill = 0
        # Admit waiting FIFO while their context (+1 token) fits.
        while e.waiting:
            s = e.waiting[0]
            need = self.blocks_of(s.context + 1)
            if used + need > usable:
                break
            e.waiting.popleft()
            e.running.append(s)
            used += self.blocks_of(s.context)
            prefill += s.prefill
        # Preempt the newest while the next step overflows.
        while e.running and sum(self.blocks_of(s.context + 1) for s in e.running) > usable:
            victim = e.running.pop()
            victim.prefill = victim.context  # recompute prompt + generated so far
            e.waiting.appendleft(victim)
            e.preemptions += 1
        e.kv_blocks = sum(self.blocks_of(s.context) for s in e.running)
        if not e.running:
            e.busy = False
            e.idle_since = self.now
            if e.waiting:  # one sequence larger than the cache: cannot happen (check_fits)
                self.capacity_ok = False
            return
        # Chunk: k steps with no finish and no overflow inside (largest such k, by bisection).
        lo, hi = 1, min(c.chunk, min(s.remaining for s in e.running))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if sum(self.blocks_of(s.context + mid) for s in e.running) <= usable:
                lo = mid
            else:
                hi = mid - 1
        k = lo
        blocks_used = sum(self.blocks_of(s.context + k) for s in e.running)
        e.max_blocks_used = max(e.max_blocks_used, blocks_used)
        if blocks_used > usable:
            self.capacity_ok = False
        batch = len(e.running)
        seconds = k * (c.step_base_s + c.step_per_seq_s * batch) + prefill / c.prefill_tokens_per_s
        seconds *= e.slowdown
        self.push(self.now + seconds, "step", (e.index, k))

    def step_done(self, payload: tuple[int, int]) -> None:
        index, k = payload
        e = self.engines[index]
        e.steps += k
        still = []
        for s in e.running:
            s.context += k
            s.remaining -= k
            if s.remaining <= 0:
                self.finish(e, s)
            else:
                still.append(s)
        e.running = still
        self.start_chunk(e)

    def finish(self, e: SimEngine, s: Seq) -> None:
        release(e.state, s.reserved)
        record_decode(e.state, s.request.max_new_tokens, self.now - s.sent_at)
        self.dirty = True
        self.prev_context[s.traj] = s.context
        if s.left_after > 0:  # the service queues the next segment as it releases this one
            self.continue_turn(s)
            return
        self.turns_done += 1
        traj = self.workload[s.traj]
        spec = traj.turns[s.turn]
        if s.turn + 1 < len(traj.turns):
            self.contexts[s.traj] = s.context + spec.tool_tokens
            delay = spec.tool_s + self.config.turn_overhead_s
            self.push(self.now + delay, "arrive", (s.traj, s.turn + 1))
        else:
            e.state.trajectories.discard(str(s.traj))
            self.trajectories_left -= 1


def simulate(config: SimConfig, policy: str) -> SimResult:
    return Simulation(config, policy, make_workload(config)).run()
