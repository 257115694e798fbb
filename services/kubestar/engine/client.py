"""Async HTTP client of one vLLM engine: token-in/token-out completions, metrics, weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kubestar.common.auth import HEADER, client_token, header_value
from kubestar.engine.launch import SERVED_MODEL_NAME
from kubestar.engine.weight_sync import DEFAULT_TIMEOUT, ROUTE


class EngineError(RuntimeError):
    """The engine answered with an error or could not be reached.

    `status` is the HTTP status the engine answered with; None when it could not be reached
    (connection refused or reset, timeout). A 4xx is the request's fault (too long, bad
    parameters), anything else the engine's.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def rejected(self) -> bool:
        """The engine refused this request (HTTP 4xx); it is alive and would refuse it again."""
        return self.status is not None and 400 <= self.status < 500


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    stop_reason: str = ""
    logprobs: list[float] = field(default_factory=list)
    # Where each token's text starts in `text` (with logprobs only).
    text_offsets: list[int] = field(default_factory=list)


def _completion(choice: dict[str, Any]) -> Completion:
    token_logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
    text_offsets = (choice.get("logprobs") or {}).get("text_offset") or []
    stop_reason = choice.get("stop_reason")
    return Completion(
        token_ids=list(choice.get("token_ids") or []),
        text=choice.get("text") or "",
        finish_reason=choice.get("finish_reason") or "stop",
        stop_reason=stop_reason if isinstance(stop_reason, str) else "",
        logprobs=[float(x) for x in token_logprobs],
        text_offsets=[int(x) for x in text_offsets],
    )


class EngineClient:
    """`token`: the installation's bearer token, sent with every request (the engine's
    kubestar.engine.auth_middleware requires it); None takes it from the environment
    (KUBESTAR_AUTH_TOKEN_FILE, KUBESTAR_AUTH_TOKEN), "" sends none."""

    def __init__(self, url: str, timeout: float = 600.0, token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        token = client_token(token)
        self._headers = {HEADER: header_value(token)} if token else {}

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # One pooled session per engine; unlimited connections (the scheduler limits).
            self._session = aiohttp.ClientSession(
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(limit=0),
                headers=self._headers,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _post(
        self, path: str, body: dict[str, Any] | None = None, params: dict[str, str] | None = None
    ) -> Any:
        try:
            async with self._client().post(
                f"{self.url}{path}", json=body or {}, params=params
            ) as response:
                text = await response.text()
                if response.status != 200:
                    raise EngineError(
                        f"{path}: HTTP {response.status}: {text[:500]}", status=response.status
                    )
                return await response.json(content_type=None) if text else None
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            raise EngineError(f"{path}: {error!r}") from error

    async def complete(
        self,
        prompt_token_ids: list[int],
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: list[str] | None = None,
        seed: int | None = None,
        logprobs: bool = False,
    ) -> Completion:
        """One completion of the prompt."""
        completions = await self.sample(
            prompt_token_ids, max_tokens, 1, temperature, top_p, top_k, stop, seed, logprobs
        )
        return completions[0]

    async def sample(
        self,
        prompt_token_ids: list[int],
        max_tokens: int,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: list[str] | None = None,
        seed: int | None = None,
        logprobs: bool = False,
    ) -> list[Completion]:
        """`n` completions of the prompt from one request (vLLM's n: the prompt is prefilled
        once and shared by the n continuations), in order. A seeded request gives sample i
        the seed + i, as vLLM does."""
        body: dict[str, Any] = {
            "model": SERVED_MODEL_NAME,
            "prompt": prompt_token_ids,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p or 1.0,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }
        if n > 1:
            body["n"] = n
        if top_k:
            body["top_k"] = top_k
        if stop:
            body["stop"] = stop
        if seed:
            body["seed"] = seed
        if logprobs:
            body["logprobs"] = 0
        answer = await self._post("/v1/completions", body)
        choices = sorted(answer["choices"], key=lambda choice: choice.get("index") or 0)
        if len(choices) < n:
            raise EngineError(f"/v1/completions: asked for {n} completions, got {len(choices)}")
        return [_completion(choice) for choice in choices[:n]]

    async def metrics_text(self) -> str:
        try:
            async with self._client().get(f"{self.url}/metrics") as response:
                if response.status != 200:
                    raise EngineError(f"/metrics: HTTP {response.status}", status=response.status)
                return await response.text()
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            raise EngineError(f"/metrics: {error!r}") from error

    async def max_model_len(self) -> int:
        """The served model's context length (from /v1/models); 0 when the engine does not say."""
        try:
            async with self._client().get(f"{self.url}/v1/models") as response:
                if response.status != 200:
                    raise EngineError(f"/v1/models: HTTP {response.status}", status=response.status)
                models = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as error:
            raise EngineError(f"/v1/models: {error!r}") from error
        for model in (models or {}).get("data") or []:
            value = model.get("max_model_len")
            if isinstance(value, int):
                return value
        return 0

    async def healthy(self) -> bool:
        try:
            async with self._client().get(f"{self.url}/health") as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def load_weights(self, weights_path: str) -> int:
        """Load new weights in place from `weights_path`, a Hugging Face folder the engine
        can read (its disk or a shared volume), through kubestar's weights route: generation
        pauses once the requests in flight finish, the prefix cache is dropped, generation
        resumes. Returns the bytes loaded."""
        answer = await self._post(ROUTE, {"path": weights_path})
        return int((answer or {}).get("bytes", 0))

    async def receive_weights(
        self,
        source: str,
        session: str,
        engine: int,
        engines: int,
        version: int,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> int:
        """Receive version `version` broadcast by the trainer's WeightServer at `source`
        (`broadcast://HOST:PORT`), as engine `engine` of the `engines` in `session` (every
        one of them is asked at once), and load it in place as load_weights does. Returns
        the bytes received."""
        body = {
            "source": source,
            "session": session,
            "engine": engine,
            "engines": engines,
            "version": version,
            "timeout": timeout,
        }
        answer = await self._post(ROUTE, body)
        return int((answer or {}).get("bytes", 0))
