"""An in-process stand-in for a vLLM OpenAI server, for the scheduler's fast unit tests.

It speaks the few endpoints the scheduler uses (/v1/completions with token ids, /metrics in
vLLM's format, /health, /v1/models, and the weight-reload dev endpoints) and models the KV
cache in whole blocks: a turn holds ceil((prompt + generated) / block_size) blocks, and a
turn that needs a block when none is free counts a preemption (and waits, as vLLM would). A
request for n samples holds the prompt's full blocks once and, for each sample, the prompt's
partial last block and its new tokens (vLLM's prefix sharing); its samples differ.
The real engines are exercised by the integration tests (test_vllm*.py).
"""

from __future__ import annotations

import asyncio
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from kubestar.engine.weight_sync import ROUTE


@dataclass(eq=False)
class _Running:
    prompt: int
    generated: int = 0
    # Preempted: its KV was freed; it comes back when its blocks fit again.
    evicted: bool = False
    samples: int = 1

    def blocks(self, block_size: int, extra: int = 0) -> int:
        if self.evicted and not extra:
            return 0
        shared = self.prompt // block_size
        own = math.ceil((self.prompt % block_size + self.generated + extra) / block_size)
        return shared + self.samples * own


@dataclass
class FakeEngine:
    num_blocks: int = 17
    block_size: int = 16
    max_model_len: int = 1024
    # Seconds per generated token, and before /metrics answers.
    token_delay: float = 0.002
    metrics_delay: float = 0.0
    # "": normal; "500": every completion fails with HTTP 500; "hang": completions never end.
    fail: str = ""
    # Set: the output is this text, one character a token, continuing from the context's
    # length (so segments of a turn continue it), and stop strings end a request as in vLLM.
    script: str = ""
    # Set: sample i of a request follows scripts[i % len(scripts)] as `script` would.
    scripts: tuple[str, ...] = ()
    # Set: sample i of a request writes respond(prompt ids, i), one character a token (its
    # id the character's code), cut at a stop string or max_tokens as vLLM would.
    respond: Callable[[list[int], int], str] | None = None
    weights: str = "base"
    preemptions: int = 0
    requests: list[tuple[int, int]] = field(default_factory=list)
    # n of each request, in order (beside `requests`), and each request's body.
    samples: list[int] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    max_running: int = 0
    reloads: list[str] = field(default_factory=list)
    # In order: ("turn", "") when a completion arrives, ("load", path) when a weight reload
    # arrives and ("loaded", path) when it is done (what a turn may see, and when).
    events: list[tuple[str, str]] = field(default_factory=list)
    # Set: a weight reload answers only after this many seconds (a stuck reload).
    reload_delay: float = 0.0
    paused: bool = False
    port: int = 0
    # Set: like an engine behind kubestar.engine.auth_middleware, every path but /health and
    # /metrics answers 401 without `Authorization: Bearer TOKEN`.
    token: str = ""
    refused: int = 0
    running: list[_Running] = field(default_factory=list)
    down: bool = False
    _runner: web.AppRunner | None = None
    _requests: dict[int, web.Request] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def used_blocks(self) -> int:
        return sum(r.blocks(self.block_size) for r in self.running)

    async def start(self, port: int = 0) -> FakeEngine:
        self.down = False
        app = web.Application(middlewares=[self._authenticate])
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post(ROUTE, self._load_weights)
        # Like vLLM, abort a request whose client went away.
        self._runner = web.AppRunner(
            app, handle_signals=False, access_log=None, handler_cancellation=True
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port or self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        open_path = request.path in ("/health", "/metrics")
        authorized = request.headers.get("Authorization") == f"Bearer {self.token}"
        if self.token and not open_path and not authorized:
            self.refused += 1
            return web.json_response({"error": "unauthorized"}, status=401)
        return await handler(request)

    def kill(self) -> None:
        """Drop every open connection now; requests that still arrive are dropped too."""
        self.down = True
        for request in list(self._requests.values()):
            if request.transport is not None:
                request.transport.close()
        self.running.clear()

    async def crash(self) -> None:
        """kill(), then stop listening (connection refused from now on)."""
        self.kill()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def stop(self) -> None:
        await self.crash()

    async def __aenter__(self) -> FakeEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt: list[int] = body["prompt"]
        max_tokens: int = body["max_tokens"]
        n: int = body.get("n") or 1
        self.requests.append((len(prompt), max_tokens))
        self.samples.append(n)
        self.bodies.append(body)
        self.events.append(("turn", ""))
        if len(prompt) + max_tokens > self.max_model_len:
            return web.json_response(
                {"error": {"message": "longer than max_model_len", "code": 400}}, status=400
            )
        if self.fail == "500":
            return web.json_response({"error": {"message": "engine dead"}}, status=500)
        self._requests[id(request)] = request
        if self.down and request.transport is not None:
            request.transport.close()
        turn = _Running(prompt=len(prompt), samples=n)
        self.running.append(turn)
        self.max_running = max(self.max_running, len(self.running))
        try:
            while turn.generated < max_tokens:
                await asyncio.sleep(self.token_delay)
                if self.down:
                    raise ConnectionResetError("the fake engine crashed")
                if self.fail == "hang" or self.paused:
                    continue
                usable = self.num_blocks - 1
                if turn.evicted:
                    if self.used_blocks + turn.blocks(self.block_size, 1) > usable:
                        continue
                    turn.evicted = False
                elif (turn.prompt + turn.generated) % self.block_size == 0 and (
                    self.used_blocks + turn.samples > usable
                ):
                    self.preemptions += 1  # no free block: vLLM preempts (recomputes later)
                    turn.evicted = True
                    continue
                turn.generated += 1
        finally:
            self._requests.pop(id(request), None)
            if turn in self.running:
                self.running.remove(turn)
        choices = [self._choice(prompt, max_tokens, body, index) for index in range(n)]
        return web.json_response({"choices": choices})

    def _choice(
        self, prompt: list[int], max_tokens: int, body: dict[str, Any], index: int
    ) -> dict[str, Any]:
        script = self.scripts[index % len(self.scripts)] if self.scripts else self.script
        if self.respond is not None:
            text = self.respond(prompt, index)[:max_tokens]
            choice = self._cut(text, max_tokens, body.get("stop") or [])
        elif script:
            choice = self._scripted(script, len(prompt), max_tokens, body.get("stop") or [])
        else:
            # Sample 0 is what a one-sample request gets; the others differ from it.
            seed = zlib.crc32(f"{self.weights}:{sum(prompt)}".encode()) + index * 104729
            tokens = [(seed + i * 7919) % 1000 + 10 for i in range(max_tokens)]
            choice = {
                "text": " ".join(map(str, tokens)),
                "token_ids": tokens,
                "finish_reason": "length",
                "stop_reason": None,
            }
        choice["index"] = index
        if body.get("logprobs") is not None:
            count = len(choice["token_ids"])
            choice["logprobs"] = {"token_logprobs": [-0.5] * count}
            if script or self.respond is not None:
                choice["logprobs"]["text_offset"] = list(range(count))
        return choice

    def _scripted(
        self, script: str, start: int, max_tokens: int, stops: list[str]
    ) -> dict[str, Any]:
        text = "".join(script[(start + i) % len(script)] for i in range(max_tokens))
        return self._cut(text, max_tokens, stops)

    def _cut(self, text: str, max_tokens: int, stops: list[str]) -> dict[str, Any]:
        """End the text at its first stop string (kept), as vLLM does."""
        finish, stop_reason = "length" if len(text) >= max_tokens else "stop", None
        ends = [(text.find(stop) + len(stop), stop) for stop in stops if stop in text]
        if ends:
            end, stop_reason = min(ends)
            text, finish = text[:end], "stop"
        return {
            "text": text,
            "token_ids": [ord(c) for c in text],
            "finish_reason": finish,
            "stop_reason": stop_reason,
        }

    def metrics_text(self) -> str:
        labels = 'engine="0",model_name="policy"'
        usable = self.num_blocks - 1
        usage = self.used_blocks / usable if usable else 0.0
        return "\n".join(
            [
                "# HELP vllm:num_requests_running Number of requests in model execution batches.",
                "# TYPE vllm:num_requests_running gauge",
                f"vllm:num_requests_running{{{labels}}} {float(len(self.running))}",
                "# TYPE vllm:num_requests_waiting gauge",
                f"vllm:num_requests_waiting{{{labels}}} 0.0",
                f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}} 0.0',
                "# TYPE vllm:kv_cache_usage_perc gauge",
                f"vllm:kv_cache_usage_perc{{{labels}}} {usage}",
                "# TYPE vllm:num_preemptions_total counter",
                f"vllm:num_preemptions_total{{{labels}}} {float(self.preemptions)}",
                f"vllm:num_preemptions_created{{{labels}}} 1.7e9",
                "# TYPE vllm:cache_config_info gauge",
                f'vllm:cache_config_info{{block_size="{self.block_size}",engine="0",'
                f'num_gpu_blocks="{self.num_blocks}",'
                f'kv_cache_size_tokens="{self.num_blocks * self.block_size}"}} 1.0',
                f'vllm:request_prompt_tokens_bucket{{{labels},le="1.0"}} 0.0',
                "",
            ]
        )

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        if self.metrics_delay:
            await asyncio.sleep(self.metrics_delay)
        return web.Response(text=self.metrics_text(), content_type="text/plain")

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"data": [{"id": "policy", "max_model_len": self.max_model_len}]})

    async def _load_weights(self, request: web.Request) -> web.StreamResponse:
        """kubestar's weights route (kubestar.engine.weight_sync), from a folder."""
        path = (await request.json())["path"]
        if path.endswith("missing"):
            return web.json_response({"error": "no such folder"}, status=500)
        self.events.append(("load", path))
        if self.reload_delay:
            await asyncio.sleep(self.reload_delay)
        self.weights = path
        self.reloads.append(path)
        self.events.append(("loaded", path))
        return web.json_response({"bytes": 0, "seconds": self.reload_delay})
