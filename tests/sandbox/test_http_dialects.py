"""The sandbox's HTTP dialects (`--http-listen`), on real servers on 127.0.0.1 with real
executors: SandboxFusion's `/run_code`, driven by verl's own sandbox-fusion reward utilities
from PyPI (package `verl`, unchanged), and code-judge's `/run/long-batch`, called as the
rStar2-Agent recipe calls it (aiohttp, the token in the URL); both served by a worker and by a
dispatcher, with the installation's token, as one-line 422s for bad input."""

from __future__ import annotations

import base64
import functools
import importlib
import importlib.machinery
import importlib.util
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import types
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
import yaml
from kubestar.api.v1alpha1 import RolloutFleetSpec, SandboxPoolSpec
from kubestar.common.auth import ENV_TOKEN, ENV_TOKEN_FILE
from kubestar.common.net import free_port
from kubestar.operator import build_fleet, build_sandbox
from kubestar.operator.settings import OperatorSettings
from kubestar.sandbox.limits import CallLimits, LimitPolicy
from kubestar.sandbox.pool import MAX_ATTEMPTS
from kubestar.sandbox.server import ServerConfig

from tests.real_parts import require_modules
from tests.sandbox.support import (
    TEST_PRELOAD,
    ServerProcess,
    ThreadedServer,
    executor_config,
    pool_of,
    scratch_dir,
)

TOKEN = "kubestar-http-test-token-0123456789"
# Calls can import only what their executor preloaded (the stdlib may be unreadable to the
# calls' uid): what verl's function-call wrapper imports, besides the tests' own.
PRELOAD = (
    *TEST_PRELOAD,
    *("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math"),
    *("random", "statistics", "itertools", "functools", "operator", "io", "json", "typing"),
    "traceback",
)
# Without a proxy: every address here is 127.0.0.1.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def with_token(url: str, token: str = TOKEN) -> str:
    """The token as a URL's credentials: how a client that sets no headers sends it."""
    return url.replace("http://", f"http://kubestar:{token}@", 1)


def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url,
        data=data,
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with _OPENER.open(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def get(url: str) -> tuple[int, Any]:
    with _OPENER.open(url, timeout=30) as response:
        return response.status, json.load(response)


def http_base(threaded: ThreadedServer) -> str:
    """The base URL of an in-process server's HTTP dialects."""
    assert threaded.server.http is not None
    return f"http://127.0.0.1:{threaded.server.http.port}"


def bearer(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def basic(token: str = TOKEN) -> dict[str, str]:
    """What requests and aiohttp send for a URL with credentials (urllib does not)."""
    credentials = base64.b64encode(f"kubestar:{token}".encode()).decode()
    return {"Authorization": f"Basic {credentials}"}


@pytest.fixture(scope="module")
def worker(log_dir: Path) -> Iterator[tuple[ServerProcess, str]]:
    """A worker process with the token, serving both dialects; yields it and its base URL."""
    port = free_port()
    server = ServerProcess(
        log_dir,
        "--http-listen",
        f"127.0.0.1:{port}",
        env={ENV_TOKEN: TOKEN},
        preload=PRELOAD,
    ).wait_ready()
    yield server, f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture(scope="module")
def dispatcher(log_dir: Path, worker: tuple[ServerProcess, str]) -> Iterator[str]:
    """A dispatcher process in front of the worker, serving both dialects; its base URL."""
    port = free_port()
    server = ServerProcess(
        log_dir,
        "--worker",
        worker[0].endpoint,
        "--http-listen",
        f"127.0.0.1:{port}",
        env={ENV_TOKEN: TOKEN},
        worker=False,
    ).wait_ready()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture(scope="module")
def quick() -> Iterator[str]:
    """A worker in this process without a token: one executor, a 1 s default time limit and a
    0.5 s queue timeout (for time limits and queue timeouts in seconds); its base URL."""
    policy = LimitPolicy(default=CallLimits(timeout_seconds=1.0))
    threaded = ThreadedServer(
        ServerConfig(
            listen="127.0.0.1:0",
            executors=1,
            executor=executor_config(policy=policy),
            queue_timeout=0.5,
            http_listen="127.0.0.1:0",
            drain_seconds=1.0,
        )
    ).start()
    yield http_base(threaded)
    threaded.stop()


def verl_root() -> Path:
    """The folder of the installed verl package."""
    require_modules("verl")
    spec = importlib.util.find_spec("verl")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="module")
def verl() -> Iterator[types.ModuleType]:
    """verl's SandboxFusion reward utilities (`verl.utils.reward_score.sandbox_fusion`), as
    installed from PyPI. verl's top-level packages `verl` and `verl.utils` import its trainer
    stack (tensordict, a torch extension built for another torch) that the reward utilities
    never use, so those two are entered as bare namespaces: `verl.utils.reward_score` and the
    utilities' own code run unchanged. sys.modules is restored afterwards."""
    root = verl_root()
    saved = {name: module for name, module in sys.modules.items() if name.startswith("verl")}
    for name, path in (("verl", root), ("verl.utils", root / "utils")):
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(path)]
        sys.modules[name] = importlib.util.module_from_spec(spec)
    try:
        yield importlib.import_module("verl.utils.reward_score.sandbox_fusion")
    finally:
        for name in [name for name in sys.modules if name.startswith("verl")]:
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.fixture(scope="module")
def verl_reward(verl: types.ModuleType) -> types.ModuleType:
    """verl's `verl.utils.reward_score` (its `default_compute_score`), loaded by `verl`."""
    return sys.modules["verl.utils.reward_score"]


# ---- SandboxFusion, through verl's own client ------------------------------------------------


def test_verl_runs_python_with_stdin_through_run_code(
    worker: tuple[ServerProcess, str], verl: types.ModuleType
) -> None:
    url = with_token(f"{worker[1]}/run_code")
    response, error = verl.utils.call_sandbox_api(
        url, "print(int(input()) * 2)", "21", 10, 10, 1024, "python"
    )
    assert error is None
    assert response["status"] == "Success" and response["message"] == ""
    assert response["compile_result"] is None and response["files"] == {}
    run = response["run_result"]
    assert run["status"] == "Finished" and run["return_code"] == 0
    assert run["stdout"] == "42\n" and run["stderr"] == ""  # strings, never null
    assert 0 < run["execution_time"] < 10


def test_verl_scores_test_cases(worker: tuple[ServerProcess, str], verl: types.ModuleType) -> None:
    url = with_token(f"{worker[1]}/run_code")
    adder = "a, b = map(int, input().split())\nprint(a + b)"
    cases = {"inputs": ["1 2\n", "20 22\n", "1 1\n"], "outputs": ["3", "42", "3"]}
    results, metadata = verl.check_correctness(url, cases, adder, timeout=5)
    assert results == [True, True, False]
    assert [m["status"] for m in metadata] == ["success", "success", "wrong_answer"]

    # A runtime error (-2) and a time limit (-3), as verl tells them apart.
    results, metadata = verl.check_correctness(
        url, {"inputs": [""], "outputs": ["1"]}, "raise ValueError('no')", timeout=5
    )
    assert results == [-2] and metadata[0]["exit_code"] == 1
    assert "ValueError: no" in metadata[0]["stderr"]
    results, metadata = verl.check_correctness(
        url, {"inputs": [""], "outputs": ["1"]}, "while True:\n    pass", timeout=1
    )
    assert results == [-3]
    assert metadata[0]["run_status"] == "TimeLimitExceeded" and metadata[0]["status"] == "timeout"

    # verl's function-call wrapper (JSON arguments on stdin, many imports) and compute_score.
    calls = {"fn_name": "add", "inputs": ["1\n2", "5\n7"], "outputs": ["3", "12"]}
    results, _ = verl.check_correctness(url, calls, "def add(a, b):\n    return a + b", timeout=5)
    assert results == [True, True]
    completion = f"The answer:\n```python\n{adder}\n```"
    score, _ = verl.compute_score(url, None, 1024, completion, json.dumps(cases))
    assert score == pytest.approx(2 / 3)


def test_another_language_is_a_sandbox_error(
    worker: tuple[ServerProcess, str], verl: types.ModuleType
) -> None:
    url = with_token(f"{worker[1]}/run_code")
    response, error = verl.utils.call_sandbox_api(url, "int main() {}", None, 10, 10, 1024, "cpp")
    assert error is None
    assert response["status"] == "SandboxError" and response["run_result"] is None
    assert "'cpp' is not supported" in response["message"]
    assert "Python only" in response["message"]
    results, metadata = verl.check_correctness(
        url, {"inputs": [""], "outputs": [""]}, "int main() {}", language="cpp"
    )
    assert results == [-1] and metadata[0]["status"] == "sandbox_error"


def test_without_the_token_nothing_runs(
    worker: tuple[ServerProcess, str], verl: types.ModuleType
) -> None:
    base = worker[1]
    directory = scratch_dir()
    marker = directory / "ran"
    touch = f"open({str(marker)!r}, 'w').close()"
    try:
        response, error = verl.utils.call_sandbox_api(
            f"{base}/run_code", touch, None, 10, 10, 1024, "python"
        )
        assert response is None and "401" in error
        batch = {"type": "batch", "submissions": [{"type": "python", "solution": touch}]}
        for url, body in (
            ("/run_code", {"code": touch, "language": "python"}),
            ("/run/long-batch", batch),
        ):
            for headers in ({}, bearer("not-the-token"), {"Authorization": "Basic !!"}):
                status, answer = post(base + url, body, headers)
                assert status == 401, answer
                assert ENV_TOKEN_FILE in answer["detail"] and "\n" not in answer["detail"]
            assert post(base + url, body, basic("wrong"))[0] == 401
        assert not marker.exists()
        # Probes need no token.
        assert get(f"{base}/v1/ping") == (200, "pong")
        assert get(f"{base}/ping") == (200, "pong")
        # The token as a bearer header works too.
        status, answer = post(
            f"{base}/run_code", {"code": "print(1)", "language": "python"}, bearer()
        )
        assert status == 200 and answer["status"] == "Success"
    finally:
        marker.unlink(missing_ok=True)
        directory.rmdir()


def test_files_are_written_before_and_fetched_after_the_run(
    worker: tuple[ServerProcess, str],
) -> None:
    code = (
        "import sys\n"
        "print(open('data/in.txt').read().upper())\n"
        "open('out.bin', 'wb').write(bytes(range(256)))\n"
        "sys.stderr.write('own stderr')\n"
        "raise SystemExit(3)\n"
    )
    body = {
        "code": code,
        "language": "python",
        "files": {"data/in.txt": base64.b64encode(b"hello").decode(), "none.txt": None},
        "fetch_files": ["out.bin", "missing.txt"],
    }
    status, answer = post(f"{worker[1]}/run_code", body, bearer())
    assert status == 200
    assert answer["status"] == "Failed"
    run = answer["run_result"]
    assert run["status"] == "Finished" and run["return_code"] == 3
    assert run["stdout"] == "HELLO\n" and run["stderr"] == "own stderr"
    assert answer["files"] == {"out.bin": base64.b64encode(bytes(range(256))).decode()}

    # A traceback is a script's: it starts at the code, not at what wrote the files.
    body["code"] = "x = 1\n1 / 0\n"
    status, answer = post(f"{worker[1]}/run_code", body, bearer())
    assert answer["run_result"]["stderr"] == (
        'Traceback (most recent call last):\n  File "<tool_call>", line 2, in <module>\n'
        "ZeroDivisionError: division by zero\n"
    )


@pytest.mark.parametrize(
    ("body", "loc", "words"),
    [
        ({"language": "python"}, ["body", "code"], "code: field required"),
        ({"code": "print(1)"}, ["body", "language"], "language: field required"),
        ({"code": 1, "language": "python"}, ["body", "code"], "code must be a string"),
        (
            {"code": "1", "language": "python", "run_timeout": "9"},
            ["body", "run_timeout"],
            "run_timeout must be a number",
        ),
        (
            {"code": "1", "language": "python", "run_timeout": 301},
            ["body", "run_timeout"],
            "maximum of 300 seconds",
        ),
        (
            {"code": "1", "language": "python", "run_timeout": 0},
            ["body", "run_timeout"],
            "more than 0",
        ),
        (
            {"code": "1", "language": "python", "memory_limit_MB": 9000},
            ["body", "memory_limit_MB"],
            "maximum of 8192 MB",
        ),
        (
            {"code": "1", "language": "python", "files": {"a": "%%"}},
            ["body", "files", "a"],
            "not valid base64",
        ),
        (
            {"code": "1", "language": "python", "fetch_files": [1]},
            ["body", "fetch_files", 0],
            "fetch_files[0]",
        ),
        ({"code": "1\x00", "language": "python"}, ["body", "code"], "code contains a NUL byte"),
        ([1], ["body"], "must be a JSON object"),
        (b"{not json", ["body"], "not valid JSON"),
    ],
)
def test_bad_run_code_input_is_a_one_line_422(
    worker: tuple[ServerProcess, str], body: Any, loc: list[Any], words: str
) -> None:
    status, answer = post(f"{worker[1]}/run_code", body, bearer())
    assert status == 422, answer
    (error,) = answer["detail"]
    assert error["loc"] == loc
    assert words in error["msg"] and "\n" not in error["msg"]


# ---- code-judge, as the rStar2-Agent recipe calls it ----------------------------------------


async def long_batch(url: str, submissions: list[dict[str, Any]]) -> Any:
    """What the recipe's call_long_batch sends: aiohttp, JSON, raise_for_status."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json={"type": "batch", "submissions": submissions}) as response,
    ):
        response.raise_for_status()
        return await response.json()


async def test_long_batch_answers_each_submission_in_order(
    worker: tuple[ServerProcess, str],
) -> None:
    url = with_token(f"{worker[1]}/run/long-batch")
    # Later submissions finish first: the answer is still in the order sent.
    sleepers = [
        {"type": "python", "solution": f"import time\ntime.sleep({0.05 * (8 - i)})\nprint({i})"}
        for i in range(8)
    ]
    others: list[dict[str, Any]] = [
        {"type": "python", "solution": "print(input())", "input": "9", "expected_output": " 9\n"},
        {"type": "python", "solution": "print(1)", "expected_output": "2", "sub_id": "mine"},
        {"type": "python", "solution": "raise KeyError('k')", "input": None, "options": {}},
        {"type": "cpp", "solution": "int main() {}"},
        {"type": "python", "solution": ""},
    ]
    answer = await long_batch(url, sleepers + others)
    results = answer["results"]
    assert isinstance(answer["sub_id"], str) and len(results) == len(sleepers) + len(others)
    for i, result in enumerate(results[:8]):
        assert result["stdout"] == f"{i}\n"
        assert result["success"] and result["run_success"] and result["reason"] == ""
        assert result["cost"] > 0
    echo, wrong, raised, cpp, empty = results[8:]
    assert echo["success"] and echo["stdout"] == "9\n"
    assert wrong["sub_id"] == "mine" and wrong["run_success"] and not wrong["success"]
    assert not raised["run_success"] and raised["reason"] == ""
    assert "KeyError: 'k'" in raised["stderr"]
    assert cpp["reason"] == "invalid_input" and "Python only" in cpp["stderr"]
    assert empty["success"] and empty["stdout"] == ""
    assert len({r["sub_id"] for r in results}) == len(results)

    # One submission (`/run`), and `/run/batch`, answer the same way.
    status, single = post(f"{worker[1]}/run", others[0], bearer())
    assert status == 200 and single["success"] and single["stdout"] == "9\n"
    status, batch = post(f"{worker[1]}/run/batch", {"submissions": others[:2]}, bearer())
    assert status == 200 and [r["success"] for r in batch["results"]] == [True, False]


@pytest.mark.parametrize(
    ("body", "loc", "words"),
    [
        ({"submissions": []}, ["body", "submissions"], "non-empty list"),
        (
            {"submissions": [{"type": "python"}]},
            ["body", "submissions", 0, "solution"],
            "submissions[0].solution: field required",
        ),
        (
            {"submissions": [{"solution": "1"}]},
            ["body", "submissions", 0, "type"],
            "submissions[0].type: field required",
        ),
        (
            {"submissions": [{"type": "python", "solution": "1", "input": 5}]},
            ["body", "submissions", 0, "input"],
            "must be a string",
        ),
        (
            {"submissions": [{"type": "python", "solution": "1", "options": {"a": 1}}]},
            ["body", "submissions", 0, "options"],
            "object of strings",
        ),
        (
            {"submissions": [{"type": "python", "solution": "1", "options": {"timeout": "5"}}]},
            ["body", "submissions", 0, "options", "timeout"],
            "submissions[0].options.timeout is not supported: code-judge reads no options",
        ),
        ({"submissions": ["print(1)"]}, ["body", "submissions", 0], "must be a JSON object"),
        (
            {"type": "single", "submissions": [{"type": "python", "solution": "1"}]},
            ["body", "type"],
            "must be 'batch'",
        ),
    ],
)
def test_bad_batch_input_is_a_one_line_422(
    worker: tuple[ServerProcess, str], body: Any, loc: list[Any], words: str
) -> None:
    status, answer = post(f"{worker[1]}/run/long-batch", body, bearer())
    assert status == 422, answer
    (error,) = answer["detail"]
    assert error["loc"] == loc
    assert words in error["msg"] and "\n" not in error["msg"]


# ---- limits, timeouts, the dispatcher, the flag ---------------------------------------------


async def test_time_limits_and_queue_timeouts(quick: str) -> None:
    status, answer = post(
        f"{quick}/run_code",
        {
            "code": "print('started', flush=True)\nwhile True:\n    pass",
            "language": "python",
            "run_timeout": 1,
        },
    )
    assert status == 200 and answer["status"] == "Failed"
    run = answer["run_result"]
    assert run["status"] == "TimeLimitExceeded" and run["return_code"] is None
    assert run["stdout"] == "started\n" and run["stderr"] == ""
    assert run["execution_time"] >= 1

    # One executor: the second submission waits past the 0.5 s queue timeout while the first
    # runs into the default 1 s limit.
    first, second = (
        await long_batch(
            f"{quick}/run/long-batch",
            [
                {"type": "python", "solution": "import time\ntime.sleep(30)"},
                {"type": "python", "solution": "print(1)"},
            ],
        )
    )["results"]
    assert first["reason"] == "worker_timeout" and not first["run_success"]
    assert first["cost"] >= 1
    assert second["reason"] == "queue_timeout" and not second["run_success"]
    assert "no executor became free" in second["stderr"]


async def test_a_dispatcher_serves_both_dialects(dispatcher: str) -> None:
    status, answer = post(
        f"{dispatcher}/run_code", {"code": "print(6 * 7)", "language": "python"}, basic()
    )
    assert status == 200 and answer["status"] == "Success"
    assert answer["run_result"]["stdout"] == "42\n"
    results = (
        await long_batch(
            with_token(f"{dispatcher}/run/long-batch"),
            [{"type": "python", "solution": f"print({i})"} for i in range(4)],
        )
    )["results"]
    assert [r["stdout"] for r in results] == ["0\n", "1\n", "2\n", "3\n"]
    assert post(f"{dispatcher}/run_code", {"code": "1", "language": "python"})[0] == 401


# ---- docs/verl.md, as written -------------------------------------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "verl.md"
# A solution that needs more than the sandbox's default 512 MiB and less than the 1,024 MiB
# of verl's memory_limit_mb (bytes() of that size is allocated, not written).
BIG_ADDER = "block = bytes(640 * 1024 * 1024)\na, b = map(int, input().split())\nprint(a + b)"


@dataclass(frozen=True)
class VerlDoc:
    """What docs/verl.md tells users to set, read from the page."""

    pool: dict[str, Any]  # the SandboxPool it shows
    pool_endpoint: str  # that pool's status.httpEndpoint, as the page gives it
    fleet: dict[str, Any]  # the RolloutFleet it shows
    fleet_endpoint: str  # that fleet's status.openaiEndpoint
    verl_settings: dict[str, str]  # verl's reward.sandbox_fusion.* overrides
    host_addr: str  # the recipe's code-judge host_addr


def verl_doc() -> VerlDoc:
    text = DOC.read_text()
    shown = [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    objects = {item["kind"]: item for item in shown}
    (pool_endpoint,) = re.findall(r"status\.httpEndpoint: (\S+)", text)
    (fleet_endpoint,) = re.findall(r"status\.openaiEndpoint: (\S+)", text)
    (host_addr,) = re.findall(r'`host_addr: "([^"]+)"`', text)
    return VerlDoc(
        pool=objects["SandboxPool"],
        pool_endpoint=pool_endpoint,
        fleet=objects["RolloutFleet"],
        fleet_endpoint=fleet_endpoint,
        verl_settings=dict(re.findall(r"(reward\.sandbox_fusion\.\w+)=(\S+)", text)),
        host_addr=host_addr,
    )


def host_of(url: str) -> str:
    """A URL's host as written (urlsplit's `hostname` is lowercased)."""
    return urlsplit(url).netloc.rpartition("@")[2].rpartition(":")[0]


def test_verl_md_names_the_endpoints_the_operator_gives() -> None:
    doc = verl_doc()
    settings = OperatorSettings()
    name = doc.pool["metadata"]["name"]
    pool = SandboxPoolSpec.model_validate(doc.pool["spec"])
    endpoint = build_sandbox.http_endpoint(name, "NAMESPACE", pool, settings)
    assert doc.pool_endpoint == endpoint
    # verl's URL and the recipe's host: that endpoint, the token as the URL's password.
    assert set(doc.verl_settings) == {
        "reward.sandbox_fusion.url",
        "reward.sandbox_fusion.max_concurrent",
        "reward.sandbox_fusion.memory_limit_mb",
    }
    assert doc.verl_settings["reward.sandbox_fusion.url"] == with_token(
        f"{endpoint}/run_code", "$TOKEN"
    )
    assert doc.host_addr == f"kubestar:TOKEN@{host_of(endpoint)}"
    assert urlsplit(endpoint).port == pool.http_port

    fleet = RolloutFleetSpec.model_validate(doc.fleet["spec"])
    metadata = {**doc.fleet["metadata"], "namespace": "NAMESPACE", "uid": "uid"}
    assert doc.fleet_endpoint == build_fleet.openai_endpoint(
        metadata["name"], "NAMESPACE", fleet, settings
    )
    # "The model's name is the fleet's spec.model.name": what the scheduler serves it as.
    scheduler = build_fleet.scheduler_deployment(
        {**doc.fleet, "metadata": metadata}, fleet, settings
    )
    command = scheduler["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--served-model-name") + 1] == fleet.model.name


def test_verl_md_settings_are_verls_own() -> None:
    """The keys the page tells verl users to set are in verl's own trainer config."""
    config_path = verl_root() / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    config = yaml.safe_load(config_path.read_text())
    for key in verl_doc().verl_settings:
        node = config
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"{key} is not in verl's config"
            node = node[part]


def here(url: str, base: str) -> str:
    """A URL of the page, sent to a test server (`base`) with the test's token."""
    parts = urlsplit(url)
    credentials = parts.netloc.rpartition("@")[0].replace("$TOKEN", TOKEN)
    return parts._replace(netloc=f"{credentials}@{urlsplit(base).netloc}").geturl()


async def test_verl_md_settings_work_as_verl_and_the_recipe_use_them(
    worker: tuple[ServerProcess, str], verl_reward: types.ModuleType
) -> None:
    doc = verl_doc()
    settings = doc.verl_settings
    # verl's reward, built from the settings as verl's reward loader builds it
    # (verl.trainer.ppo.reward: the URL, a semaphore of max_concurrent, memory_limit_mb).
    reward = functools.partial(
        verl_reward.default_compute_score,
        sandbox_fusion_url=here(settings["reward.sandbox_fusion.url"], worker[1]),
        concurrent_semaphore=threading.Semaphore(
            int(settings["reward.sandbox_fusion.max_concurrent"])
        ),
        memory_limit_mb=int(settings["reward.sandbox_fusion.memory_limit_mb"]),
    )
    cases = json.dumps({"inputs": ["1 2\n", "20 22\n"], "outputs": ["3", "42"]})
    # A code dataset's solution, scored on its test cases: memory_limit_mb reached the sandbox.
    assert reward("codecontests", f"```python\n{BIG_ADDER}\n```", cases) == 1.0
    assert reward("codecontests", "```python\nprint(0)\n```", cases) == 0.0

    # The recipe's code-judge tool: its URL built from host_addr and host_port as the recipe
    # builds it; its submissions run with the sandbox's default limits, as the page says.
    host_addr = doc.host_addr.replace(host_of(doc.pool_endpoint), "127.0.0.1")
    host_addr = host_addr.replace("TOKEN", TOKEN)
    host_port = urlsplit(worker[1]).port
    small = "a, b = map(int, input().split())\nprint(a + b)"
    big, fits = (
        await long_batch(
            f"http://{host_addr}:{host_port}/run/long-batch",
            [
                {"type": "python", "solution": BIG_ADDER, "input": "20 22"},
                {"type": "python", "solution": small, "input": "20 22"},
            ],
        )
    )["results"]
    assert not big["run_success"] and "MemoryError" in big["stderr"]
    assert fits["run_success"] and fits["stdout"] == "42\n"


# ---- the sandbox itself failing ---------------------------------------------------------


@pytest.fixture(scope="module")
def no_worker() -> Iterator[str]:
    """A dispatcher in this process whose only worker is away (nothing listens at its
    address), with a 0.5 s queue timeout; its base URL."""
    threaded = ThreadedServer(
        ServerConfig(
            listen="127.0.0.1:0",
            workers=[f"127.0.0.1:{free_port()}"],
            queue_timeout=0.5,
            http_listen="127.0.0.1:0",
            drain_seconds=1.0,
        )
    ).start()
    yield http_base(threaded)
    threaded.stop()


def test_no_reachable_worker_is_an_internal_error_and_nothing_ran(no_worker: str) -> None:
    batch = {"type": "batch", "submissions": [{"type": "python", "solution": "print(1)"}]}
    status, answer = post(f"{no_worker}/run/long-batch", batch)
    assert status == 200
    (result,) = answer["results"]
    assert result["reason"] == "internal_error"
    assert not result["success"] and not result["run_success"]
    assert result["stdout"] == "" and result["stderr"] == "no sandbox worker is reachable"
    assert result["cost"] >= 0.5  # it waited the queue timeout for a worker

    status, answer = post(f"{no_worker}/run_code", {"code": "print(1)", "language": "python"})
    assert status == 200
    assert answer["status"] == "SandboxError"
    assert answer["message"] == "no sandbox worker is reachable"
    assert answer["run_result"] is None  # nothing ran


# A call that runs long enough for the test to kill the executor process running it.
SLEEPER = "import time\ntime.sleep(2)\nprint('woke')"


@pytest.fixture
def one_executor() -> Iterator[ThreadedServer]:
    """A worker in this process with one executor (the tests kill its processes)."""
    threaded = ThreadedServer(
        ServerConfig(
            listen="127.0.0.1:0",
            executors=1,
            executor=executor_config(),
            http_listen="127.0.0.1:0",
            drain_seconds=1.0,
        )
    ).start()
    yield threaded
    threaded.stop()


def lost_on_every_attempt(threaded: ThreadedServer, path: str, body: Any) -> Any:
    """POST `body` (one call of SLEEPER) to the server while killing the executor process
    that runs it each time the call is started on it: the sandbox loses the call on every
    attempt. Returns the answer. (A kill can also land while the pool restarts the process
    for the next attempt: that restart fails and the pool restarts it again, so there may be
    more kills than attempts.)"""
    url = http_base(threaded) + path
    pool = pool_of(threaded)
    (executor,) = pool.executors
    process = executor.process_for(SLEEPER)
    killed: list[int] = []
    with ThreadPoolExecutor(1) as background:
        answer = background.submit(post, url, body)
        while not answer.done():
            pid = process.pid
            # in_flight counts the call from the moment it is sent to the executor.
            if pool.in_flight and pid is not None and pid not in killed:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.02)
        status, result = answer.result()
    assert len(killed) >= MAX_ATTEMPTS
    assert status == 200, result
    return result


def test_a_call_the_sandbox_loses_is_run_status_error(one_executor: ThreadedServer) -> None:
    answer = lost_on_every_attempt(
        one_executor, "/run_code", {"code": SLEEPER, "language": "python"}
    )
    message = f"the executor died {MAX_ATTEMPTS} times while running this call"
    # SandboxFusion's shape for a command the sandbox failed to run to an end.
    assert answer["status"] == "SandboxError" and answer["message"] == message
    assert answer["run_result"] == {
        "status": "Error",
        "execution_time": None,
        "return_code": None,
        "stdout": None,
        "stderr": message,
    }
    assert answer["files"] == {}

    batch = {"type": "batch", "submissions": [{"type": "python", "solution": SLEEPER}]}
    (result,) = lost_on_every_attempt(one_executor, "/run/long-batch", batch)["results"]
    assert result["reason"] == "internal_error"
    assert not result["success"] and not result["run_success"]
    assert result["stdout"] == "" and result["stderr"] == message

    # The executor was restarted: the next call runs.
    status, answer = post(
        f"{http_base(one_executor)}/run_code", {"code": "print('after')", "language": "python"}
    )
    assert status == 200 and answer["run_result"]["stdout"] == "after\n"


def test_a_taken_http_address_is_one_line(log_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        server = ServerProcess(log_dir, "--http-listen", address)
        try:
            assert server.process.wait(60) == 1
        finally:
            server.stop()
    log = server.log()
    assert f"kubestar: error: --http-listen {address}: Address already in use" in log
    assert "Traceback" not in log
