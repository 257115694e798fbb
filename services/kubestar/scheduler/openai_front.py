"""An OpenAI-compatible front for the rollout scheduler: `/v1/models`, `/v1/completions` and
`/v1/chat/completions`, served by the scheduler's process, so that an OpenAI client, verl's
agent loop or an evaluation harness can use a RolloutFleet as one endpoint while every turn
still goes through the KV-aware scheduler (no preemption, prefix affinity).

- Session: a request's turns run as the trajectory named by the `X-Session-ID` header, else
  the `user` field, else one of their own. A session's turns stay on the engine that holds
  its prefix, as an agent loop's turns do; the `n` choices of a request share it.
- Tokens: prompts are text or token ids (completions); chat messages go through the model's
  chat template. With `return_token_ids: true` (as vLLM) each choice carries `token_ids` and
  the prompt's `prompt_token_ids` come back too: what an RL trainer needs to train on exactly
  the tokens that were sampled.
- Streaming (`stream: true`): server-sent events as the scheduler finishes each part of a
  turn (a segment of the scheduler's `segment_tokens`, 256 by default; the whole turn when
  segments are off), then `data: [DONE]`. Not token by token.
- Errors have vLLM's shape (`{"error": {"message", "type", "param", "code"}}`) and name the
  field; fields the scheduler cannot honour (penalties, `best_of`, tools, more than the
  sampled token's logprob) are refused with a non-default value, never ignored. Unknown
  fields are ignored, as vLLM does.
- Authentication: the installation's bearer token, when there is one (`/health` is open).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from kubestar.common.auth import refusal
from kubestar.scheduler.core import RequestTooLarge
from kubestar.scheduler.errors import NoEngineAvailable, SchedulerDraining, TurnRejected
from kubestar.scheduler.scheduler import Scheduler
from kubestar.v1 import rollout_pb2 as pb

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-ID"
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}
# Fields the scheduler does not pass to the engines, with the value that means "off".
UNSUPPORTED: dict[str, Any] = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "logit_bias": None,
    "best_of": None,
    "suffix": None,
    "echo": False,
    "tools": None,
    "functions": None,
    "response_format": None,
    "min_tokens": 0,
    "use_beam_search": False,
}


@dataclass(frozen=True)
class OpenAIFrontConfig:
    listen: str  # HOST:PORT
    model_name: str  # what /v1/models lists and requests may name
    tokenizer: str  # a folder with the served model's tokenizer and chat template
    # A larger request body is refused (413) before it is read: a prompt is bounded by the
    # engines' context, and 4 MiB holds 128K tokens' text or ids many times over.
    max_body_bytes: int = 4 * 1024 * 1024


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}.get(
        status, "ServiceUnavailableError" if status == 503 else "InternalServerError"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _error(message: str, status: int, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, status, param), status=status)


# ---- request fields ----------------------------------------------------------------------


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise BadRequest(f"{name} must be a number from {low:g} to {high:g}, not {value!r}", name)
    return float(value)


def _integer(body: Mapping[str, Any], name: str, default: int | None, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise BadRequest(f"{name} must be an integer of at least {low}, not {value!r}", name)
    return value


def _stops(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop must be a string or a list of non-empty strings", "stop")
    return stops


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    for name, off in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != off and value not in ([], {}):
            raise BadRequest(
                f"{name} is not supported by the kubestar rollout scheduler (leave it unset)",
                name,
            )


@dataclass
class Sampling:
    """What one request asks of each of its `n` turns."""

    max_tokens: int
    params: pb.SamplingParams
    n: int
    stream: bool
    include_usage: bool
    return_token_ids: bool
    logprobs: bool


def sampling(body: Mapping[str, Any], max_tokens: int | None, logprobs: bool) -> Sampling:
    assert max_tokens is not None
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    return Sampling(
        max_tokens=max_tokens,
        params=pb.SamplingParams(
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
            top_k=_integer(body, "top_k", 0, -1) or 0,
            stop=_stops(body),
            seed=_integer(body, "seed", 0, 0) or 0,
            logprobs=logprobs,
        ),
        n=_integer(body, "n", 1, 1) or 1,
        stream=bool(body.get("stream")),
        include_usage=bool(options.get("include_usage")),
        return_token_ids=bool(body.get("return_token_ids")),
        logprobs=logprobs,
    )


# ---- the front ---------------------------------------------------------------------------


@dataclass
class Part:
    """What the stream of one choice gets next: new tokens, or its end."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    done: pb.GenerateResponse | None = None


class OpenAIFront:
    def __init__(
        self, scheduler: Scheduler, config: OpenAIFrontConfig, auth_token: str = ""
    ) -> None:
        from transformers import AutoTokenizer

        self.scheduler = scheduler
        self.config = config
        self.auth_token = auth_token
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
        # Prompts are tokenized here, off the event loop that every rollout's turns share;
        # one thread, since a fast tokenizer is not to be used by two at once.
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="openai-tokenize")
        self.created = int(time.time())
        self.runner: web.AppRunner | None = None
        self.port = 0

    # ---- serving ---------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._errors], client_max_size=self.config.max_body_bytes
        )
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def start(self) -> None:
        host, _, port = self.config.listen.rpartition(":")
        self.runner = web.AppRunner(self.app(), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host.strip("[]") or "127.0.0.1", int(port))
        await site.start()
        self.port = int(self.runner.addresses[0][1])
        log.info(
            "openai front serving",
            extra={"fields": {"listen": self.config.listen, "port": self.port}},
        )

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if self.auth_token and request.path != "/health":
            why = refusal(request.headers.get("Authorization"), self.auth_token)
            if why:
                return _error(why, 401)
        try:
            return await handler(request)
        except BadRequest as error:
            return _error(error.message, error.status, error.param)
        except web.HTTPRequestEntityTooLarge:
            limit = self.config.max_body_bytes
            return _error(f"the request body is over {limit} bytes, more than any prompt", 413)
        except web.HTTPException:
            raise
        except (TurnRejected, RequestTooLarge) as error:
            return _error(str(error), 400)
        except (NoEngineAvailable, SchedulerDraining) as error:
            return _error(str(error), 503)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.scheduler.available() else 503)

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.config.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kubestar",
            "root": self.config.model_name,
            "max_model_len": self.scheduler.context_length() or None,
        }
        return web.json_response({"object": "list", "data": [card]})

    # ---- requests --------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("the request body is not JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if model not in (None, "", self.config.model_name):
            raise BadRequest(f"The model `{model}` does not exist.", "model", status=404)
        _refuse_unsupported(body)
        return body

    def _session(self, request: web.Request, body: Mapping[str, Any]) -> str:
        user = body.get("user")
        return (
            request.headers.get(SESSION_HEADER)
            or (user if isinstance(user, str) and user else "")
            or f"openai-{uuid.uuid4().hex}"
        )

    def _max_tokens(self, body: Mapping[str, Any], names: Sequence[str], prompt: int) -> int:
        for name in names:
            value = _integer(body, name, None, 1)
            if value is not None:
                return value
        context = self.scheduler.context_length()
        if context <= prompt:
            raise BadRequest(f"set {names[0]}: the engines' context length is not known yet")
        return context - prompt

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise BadRequest("prompt is empty", "prompt")
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
        ):
            return list(prompt)
        raise BadRequest(
            "prompt must be a string or a list of token ids (one prompt per request)", "prompt"
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        prompt_ids = await self._off_loop(self._prompt_ids, body.get("prompt"))
        logprobs = _integer(body, "logprobs", None, 0)
        if logprobs is not None and logprobs > 0:
            raise BadRequest(
                "logprobs: only the sampled token's logprob is available (logprobs: 0)",
                "logprobs",
            )
        max_tokens = self._max_tokens(body, ("max_tokens",), len(prompt_ids))
        asked = sampling(body, max_tokens, logprobs is not None)
        return await self._respond(request, body, "text_completion", prompt_ids, asked)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        prompt_ids = await self._off_loop(self._chat_prompt_ids, body.get("messages"))
        if _integer(body, "top_logprobs", 0, 0):
            raise BadRequest(
                "top_logprobs: only the sampled token's logprob is available", "top_logprobs"
            )
        names = ("max_completion_tokens", "max_tokens")
        max_tokens = self._max_tokens(body, names, len(prompt_ids))
        asked = sampling(body, max_tokens, bool(body.get("logprobs")))
        return await self._respond(request, body, "chat.completion", prompt_ids, asked)

    async def _off_loop(self, tokenize: Callable[[Any], list[int]], value: Any) -> list[int]:
        """`tokenize(value)` in the tokenizing thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, tokenize, value)

    def _chat_prompt_ids(self, messages: Any) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list", "messages")
        conversation: list[dict[str, str]] = []
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                texts = [part.get("text") for part in content if isinstance(part, dict)]
                if not all(isinstance(t, str) for t in texts) or len(texts) != len(content):
                    raise BadRequest(f"messages[{i}].content: only text parts", "messages")
                content = "".join(t for t in texts if isinstance(t, str))
            role = message.get("role") if isinstance(message, dict) else None
            if not isinstance(role, str) or not isinstance(content, str):
                raise BadRequest(f"messages[{i}] needs a role and a text content", "messages")
            conversation.append({"role": role, "content": content})
        text = self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ---- answers ---------------------------------------------------------------------------
    async def _respond(
        self,
        request: web.Request,
        body: Mapping[str, Any],
        kind: str,
        prompt_ids: list[int],
        asked: Sampling,
    ) -> web.StreamResponse:
        session = self._session(request, body)
        chat = kind == "chat.completion"
        identifier = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if asked.stream:
            return await self._stream(request, session, identifier, chat, prompt_ids, asked)
        answers = await asyncio.gather(
            *(
                self.scheduler.generate(session, prompt_ids, asked.max_tokens, asked.params)
                for _ in range(asked.n)
            )
        )
        choices = [self._choice(i, a, chat, asked) for i, a in enumerate(answers)]
        answer: dict[str, Any] = {
            "id": identifier,
            "object": kind,
            "created": int(time.time()),
            "model": self.config.model_name,
            "choices": choices,
            "usage": _usage(len(prompt_ids), sum(len(a.token_ids) for a in answers)),
        }
        if asked.return_token_ids:
            if chat:
                answer["prompt_token_ids"] = prompt_ids
            else:
                for choice in choices:
                    choice["prompt_token_ids"] = prompt_ids
        return web.json_response(answer)

    def _logprobs(self, token_ids: Sequence[int], values: Sequence[float], chat: bool) -> Any:
        tokens = [str(self.tokenizer.decode([t])) for t in token_ids]
        if chat:
            return {
                "content": [
                    {
                        "token": token,
                        "logprob": value,
                        "bytes": list(token.encode()),
                        "top_logprobs": [],
                    }
                    for token, value in zip(tokens, values, strict=False)
                ]
            }
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": list(values),
            "top_logprobs": None,
            "text_offset": offsets,
        }

    def _choice(
        self, index: int, answer: pb.GenerateResponse, chat: bool, asked: Sampling
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if chat:
            choice["message"] = {"role": "assistant", "content": answer.text}
        else:
            choice["text"] = answer.text
        choice["logprobs"] = (
            self._logprobs(answer.token_ids, answer.logprobs, chat) if asked.logprobs else None
        )
        choice["finish_reason"] = FINISH_REASONS.get(answer.finish_reason, "stop")
        choice["stop_reason"] = answer.stop_reason or None
        if asked.return_token_ids:
            choice["token_ids"] = list(answer.token_ids)
        return choice

    async def _stream(
        self,
        request: web.Request,
        session: str,
        identifier: str,
        chat: bool,
        prompt_ids: list[int],
        asked: Sampling,
    ) -> web.StreamResponse:
        parts: asyncio.Queue[Part | BaseException] = asyncio.Queue()

        async def one(index: int) -> None:
            def segment(token_ids: list[int], text: str, logprobs: list[float]) -> None:
                parts.put_nowait(Part(index, token_ids, text, logprobs))

            try:
                answer = await self.scheduler.generate(
                    session, prompt_ids, asked.max_tokens, asked.params, on_segment=segment
                )
                parts.put_nowait(Part(index, done=answer))
            except Exception as error:  # sent as the stream's error event
                parts.put_nowait(error)

        tasks = [asyncio.create_task(one(i)) for i in range(asked.n)]
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        base = {
            "id": identifier,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.config.model_name,
        }
        try:
            async for chunk in self._chunks(parts, asked, chat, prompt_ids):
                await response.write(f"data: {json.dumps({**base, **chunk})}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
        finally:
            for task in tasks:
                task.cancel()  # a client that went away: the scheduler drops its turns
            await asyncio.gather(*tasks, return_exceptions=True)
        return response

    async def _chunks(
        self,
        parts: asyncio.Queue[Part | BaseException],
        asked: Sampling,
        chat: bool,
        prompt_ids: list[int],
    ) -> AsyncIterator[dict[str, Any]]:
        finished = 0
        generated = 0
        started: set[int] = set()
        sent_prompt = False
        while finished < asked.n:
            part = await parts.get()
            if isinstance(part, BaseException):
                status = 503 if isinstance(part, NoEngineAvailable | SchedulerDraining) else 400
                yield error_body(str(part), status)
                return
            choice: dict[str, Any] = {"index": part.index}
            if part.done is None:
                generated += len(part.token_ids)
                if chat:
                    delta: dict[str, Any] = {"content": part.text}
                    if part.index not in started:
                        delta["role"] = "assistant"
                    choice["delta"] = delta
                else:
                    choice["text"] = part.text
                choice["logprobs"] = (
                    self._logprobs(part.token_ids, part.logprobs, chat) if asked.logprobs else None
                )
                choice["finish_reason"] = None
                if asked.return_token_ids:
                    choice["token_ids"] = part.token_ids
                    if not chat and part.index not in started:
                        choice["prompt_token_ids"] = prompt_ids
                started.add(part.index)
            else:
                finished += 1
                choice["delta" if chat else "text"] = {} if chat else ""
                choice["finish_reason"] = FINISH_REASONS.get(part.done.finish_reason, "stop")
                choice["stop_reason"] = part.done.stop_reason or None
            chunk: dict[str, Any] = {"choices": [choice]}
            if chat and asked.return_token_ids and not sent_prompt:
                chunk["prompt_token_ids"] = prompt_ids  # once, on the first chunk
                sent_prompt = True
            yield chunk
        if asked.include_usage:
            yield {"choices": [], "usage": _usage(len(prompt_ids), generated)}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
