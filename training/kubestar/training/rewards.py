"""Rewards: 1 when the trajectory's final `\\boxed{}` answer equals the reference, else 0.

Equality is decided by math verification (`math-verify`: numbers, fractions, LaTeX, sets,
intervals ...). Obvious cases (the same string, or the same number) are settled here without
it. math-verify's own time limits use `signal.alarm`, which fails off the main thread, so
they are switched off and `RewardScorer` enforces a time limit itself: verification runs in
worker processes that are killed when they take too long (the answer then scores 0).

No answer (a trajectory that was truncated or never wrote `\\boxed{}`) scores 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import multiprocessing
import multiprocessing.connection
import re
from dataclasses import dataclass
from typing import Any

from kubestar.training.tools import extract_boxed, last_boxed
from kubestar.training.trajectory import Trajectory

__all__ = [
    "RewardScorer",
    "extract_boxed",
    "last_boxed",
    "quick_match",
    "score_answer",
    "verify_answer",
]

log = logging.getLogger(__name__)

_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


def _normalize(text: str) -> str:
    text = text.strip().strip("$").strip()
    text = re.sub(r"\\text\{\s*\}|\\[,;!:]|\\quad", "", text)
    text = text.replace("\\left", "").replace("\\right", "").replace(" ", "")
    text = re.sub(r"^\\boxed\{(.*)\}$", r"\1", text)
    return text.rstrip(".")


def _number(text: str) -> float | None:
    candidate = (
        text.replace(",", "") if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d*)?", text) else text
    )
    if _NUMBER.match(candidate):
        try:
            return float(candidate)
        except ValueError:
            return None
    return None


def quick_match(answer: str, reference: str) -> bool | None:
    """True/False when plain string or number comparison settles it, None when it cannot."""
    a, r = _normalize(answer), _normalize(reference)
    if not a:
        return False
    if a == r:
        return True
    x, y = _number(a), _number(r)
    if x is not None and y is not None:
        return abs(x - y) <= 1e-6 * max(1.0, abs(y))
    return None


def _parse_reference(reference: str) -> list[Any]:
    from math_verify import parse  # type: ignore[import-untyped]

    # A bare reference is read as the content of a box: unanchored parsing of LaTeX such
    # as `\{1, 2\}` finds only its first number.
    texts = [f"\\boxed{{{reference}}}", f"${reference}$", reference]
    if "\\boxed" in reference or "$" in reference:
        texts.insert(0, reference)
    for text in texts:
        parsed = parse(text, parsing_timeout=None)  # type: ignore[arg-type]
        if parsed:
            return list(parsed)
    return []


def verify_answer(answer: str | None, reference: str) -> bool:
    """Math verification of one answer (the content of `\\boxed{}`) against the reference.

    Runs in the calling thread with no time limit: use `RewardScorer` for untrusted input.
    """
    if answer is None:
        return False
    quick = quick_match(answer, reference)
    if quick is not None:
        return quick
    from math_verify import parse, verify  # type: ignore[import-untyped]

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold = _parse_reference(reference)
    predicted = parse(f"\\boxed{{{answer}}}", parsing_timeout=None)  # type: ignore[arg-type]
    if not gold or not predicted:
        return False
    return bool(verify(gold, predicted, timeout_seconds=None))


def score_answer(answer: str | None, reference: str) -> float:
    return 1.0 if verify_answer(answer, reference) else 0.0


def _worker_main(connection: multiprocessing.connection.Connection) -> None:
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    while True:
        try:
            request = connection.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        answer, reference = request
        try:
            result = verify_answer(answer, reference)
        except Exception:
            result = False
        connection.send(result)


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    connection: multiprocessing.connection.Connection


class RewardScorer:
    """Scores answers with math verification in worker processes, with a time limit.

    `score` is async and never blocks the event loop; plain cases are settled in-process.
    A verification that runs past `timeout` seconds scores 0 and its worker is replaced.
    """

    def __init__(self, workers: int = 2, timeout: float = 10.0) -> None:
        if importlib.util.find_spec("math_verify") is None:
            raise RuntimeError("math-verify is not installed: pip install 'kubestar[training]'")
        self.workers = max(1, workers)
        self.timeout = timeout
        self._context = multiprocessing.get_context("spawn")
        self._free: asyncio.Queue[_Worker] | None = None
        self._all: list[_Worker] = []
        self.timeouts = 0
        self.verified = 0

    def _spawn(self) -> _Worker:
        parent, child = self._context.Pipe()
        process = self._context.Process(
            target=_worker_main, args=(child,), daemon=True, name="kubestar-reward"
        )
        process.start()
        child.close()
        worker = _Worker(process, parent)
        self._all.append(worker)
        return worker

    def _kill(self, worker: _Worker) -> None:
        with contextlib.suppress(OSError):
            worker.connection.close()
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(5)
        if worker in self._all:
            self._all.remove(worker)

    def _ask(self, worker: _Worker, answer: str, reference: str) -> bool | None:
        """Blocking (runs in a thread): the worker's verdict, None on timeout or death."""
        try:
            worker.connection.send((answer, reference))
            if not worker.connection.poll(self.timeout):
                return None
            return bool(worker.connection.recv())
        except (EOFError, OSError):
            return None

    async def score(self, answer: str | None, reference: str) -> float:
        if answer is None:
            return 0.0
        quick = quick_match(answer, reference)
        if quick is not None:
            return 1.0 if quick else 0.0
        if self._free is None:
            self._free = asyncio.Queue()
            for _ in range(self.workers):
                self._free.put_nowait(await asyncio.to_thread(self._spawn))
        worker = await self._free.get()
        verdict = await asyncio.to_thread(self._ask, worker, answer, reference)
        if verdict is None:
            self.timeouts += 1
            log.warning(
                "answer verification timed out",
                extra={"fields": {"answer": answer[:200], "reference": reference[:200]}},
            )
            await asyncio.to_thread(self._kill, worker)
            worker = await asyncio.to_thread(self._spawn)
        else:
            self.verified += 1
        self._free.put_nowait(worker)
        return 1.0 if verdict else 0.0

    async def score_trajectory(self, trajectory: Trajectory) -> float:
        trajectory.reward = await self.score(trajectory.answer, trajectory.reference)
        return trajectory.reward

    def close(self) -> None:
        for worker in list(self._all):
            with contextlib.suppress(OSError, ValueError):
                worker.connection.send(None)
            worker.process.join(1)
            self._kill(worker)
        self._free = None
