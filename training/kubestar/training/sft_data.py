"""The examples of non-reasoning SFT, made here: the tool-call format and instruction following.

rStar2-Agent starts RL from a model that already follows instructions and writes well-formed
tool calls, but has not been taught to reason (that is RL's job). This module makes that
small warm-up set itself (`build_sft_examples`); `kubestar.training.sft` trains on it:

* Problems: reasoning-gym generators (basic_arithmetic, chain_sum, products, gcd, lcm,
  simple_equations, fraction_simplification, prime_factorization) and simple
  instruction-following items made here (reverse a word, count letters, sort numbers, ...).
* Solutions: one short sentence and a `<tool_call>` whose Python prints the computation,
  importing what it needs (`math.gcd`, `math.lcm`, `fractions.Fraction`, sympy's `solve` and
  `factorint`); the REAL output of that code (run by the sandbox); then a final turn that
  states the result in `\\boxed{}`. About one example in seven first writes code with a bug
  (a misspelled name, an unclosed parenthesis, adding a string to a number, a missing
  import), reads the real traceback, says what was wrong and sends fixed code, never the
  same code again.
* Format and masks: every example is produced by the agent loop itself (`AgentLoop` with a
  scripted "model" and the real sandbox via `SandboxClient`), so prompts, tool turns and
  token ownership are exactly those of RL trajectories: the assistant's text (up to
  `</tool_call>`, and the final turn with its `<|im_end|>`) has loss mask 1; system, user
  and tool tokens (including the `<|im_end|>` the loop adds after `</tool_call>`) have 0,
  and so does the turn that sends a planted bug (the model reads it, is never taught it).

An example is kept only when the loop ended with an answer, every call had the intended
status (`error` for a planted bug, then `ok`), the printed value agrees with the reference
answer, and prompt + response fit `max_tokens`. With SmolLM2's tokenizer the prompt (system
prompt with the tool declaration) takes about 310 tokens and whole examples 400-600, the
error-fixing ones being the longest: a `max_tokens` under about 640 drops those first, and
one under about 400 leaves nothing (an error says so).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kubestar.sandbox.client import Call, SandboxClient
from kubestar.training.chat import ChatTokenizer
from kubestar.training.datasets import Problem, reasoning_gym_problems
from kubestar.training.generators import ScriptedGenerator
from kubestar.training.rollout import AgentLoop, RolloutConfig
from kubestar.training.tools import (
    PYTHON_TOOL,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
    render_prompt,
    system_prompt,
)
from kubestar.training.trajectory import ANSWERED, MODEL, Trajectory
from kubestar.v1 import sandbox_pb2 as pb

log = logging.getLogger(__name__)

# Seeds of the reasoning-gym problems used here are offset so that they do not coincide with
# the seeds RL stages and evaluations usually take (0, 1, 2, ...).
SEED_OFFSET = 7_919_000

# How often each family is drawn. "instruction" items are made here; the others come from
# reasoning-gym.
DEFAULT_MIX: dict[str, float] = {
    "basic_arithmetic": 0.20,
    "chain_sum": 0.05,
    "products": 0.05,
    "gcd": 0.07,
    "lcm": 0.07,
    "simple_equations": 0.08,
    "fraction_simplification": 0.07,
    "prime_factorization": 0.06,
    "instruction": 0.35,
}
ERROR_FRACTION = 0.15


# -- phrasing --------------------------------------------------------------------------------
INTROS = (
    "Let me compute this with Python.",
    "I'll calculate it with the python tool.",
    "I will use Python to get the exact value.",
    "Let me run a quick calculation.",
    "I can check this with a short Python snippet.",
    "Let me use the python tool for this.",
)
FINALS = (
    "The code printed {output}, so the answer is \\boxed{{{answer}}}.",
    "Python returns {output}. The answer is \\boxed{{{answer}}}.",
    "The result is {output}.\n\n\\boxed{{{answer}}}",
    "The output is {output}, so the final answer is \\boxed{{{answer}}}.",
    "It prints {output}. Therefore the answer is \\boxed{{{answer}}}.",
)
SUFFIXES = (
    "",
    "",
    " Put your final answer in \\boxed{}.",
    " Answer with just the result.",
    " Use the python tool to check.",
)
WORDS = (
    "python", "banana", "strawberry", "mississippi", "keyboard", "rainbow", "elephant",
    "notebook", "sunflower", "calendar", "mountain", "volcano", "pineapple", "library",
    "triangle", "hospital", "umbrella", "chocolate", "astronaut", "butterfly", "kangaroo",
    "parallel", "tomorrow", "necessary", "committee", "assessment", "bookkeeper", "coffee",
)  # fmt: skip
INSTRUCTION_KINDS = (
    "reverse", "count", "digits", "sort", "largest", "upper", "remainder", "percent", "words",
    "binary", "square",
)  # fmt: skip
SENTENCES = (
    "the quick brown fox jumps over the lazy dog",
    "a journey of a thousand miles begins with a single step",
    "practice makes perfect",
    "all that glitters is not gold",
    "the early bird catches the worm",
    "knowledge is power",
    "actions speak louder than words",
    "time and tide wait for no man",
)


@dataclass(frozen=True)
class Attempt:
    """One tool call of a planned solution."""

    code: str
    fails: bool = False  # a planted bug: the sandbox must answer `error`
    fix_note: str = ""  # said after reading this attempt's error, before the next attempt


@dataclass(frozen=True)
class Plan:
    """A problem and the scripted solution the agent loop plays out."""

    problem: Problem
    family: str
    intro: str
    attempts: tuple[Attempt, ...]
    final: str  # a FINALS template

    @property
    def fixes_error(self) -> bool:
        return any(attempt.fails for attempt in self.attempts)


@dataclass
class SftExample:
    """One training example, tokenized and masked as an RL trajectory."""

    id: str
    family: str
    question: str
    answer: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    prompt_text: str
    assistant_turns: list[str]  # the model-owned text of each turn, in order
    tool_codes: list[str]
    tool_responses: list[str]  # what the model read inside <tool_response>, per call
    tool_statuses: list[str]
    fixes_error: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def trained_tokens(self) -> int:
        return sum(self.response_mask)

    def to_dict(self, tokens: bool = True) -> dict[str, Any]:
        data = asdict(self)
        if not tokens:
            for key in ("prompt_ids", "response_ids", "response_mask"):
                data.pop(key)
        return data


def format_tool_call(code: str) -> str:
    """A call as the system prompt asks for it (and as `parse_tool_calls` reads it)."""
    body = json.dumps({"name": PYTHON_TOOL, "arguments": {"code": code}})
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


# -- answers ---------------------------------------------------------------------------------
def _number(text: str) -> float | None:
    try:
        value = float(text.replace(",", "").strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def agrees(output: str, reference: str) -> bool:
    """The printed value is the reference answer (exactly, or as the same number)."""
    output, reference = output.strip(), reference.strip()
    if output == reference:
        return True
    a, b = _number(output), _number(reference)
    return a is not None and b is not None and abs(a - b) <= 1e-9 * max(1.0, abs(b))


_LATEX_FRACTION = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(\d+)\}$")


def plain_answer(reference: str) -> str:
    """A reference answer as code prints it: `$3/4$` and `\\frac{3}{4}` become `3/4`."""
    text = reference.strip().strip("$").strip()
    fraction = _LATEX_FRACTION.match(text)
    if fraction:
        sign, numerator, denominator = fraction.groups()
        return f"{sign}{numerator}/{denominator}"
    return text


def _last_tool_response(context: str) -> str:
    start = context.rfind(TOOL_RESPONSE_OPEN)
    end = context.rfind(TOOL_RESPONSE_CLOSE)
    if start < 0 or end < start:
        return ""
    return context[start + len(TOOL_RESPONSE_OPEN) : end].strip("\n")


def _error_line(response: str) -> str:
    lines = [line.strip() for line in response.splitlines() if line.strip()]
    return lines[-1] if lines else "an error"


# -- plans per family ------------------------------------------------------------------------
_IDENTIFIER = re.compile(r"^[a-z]+$")


def _euclid(a: int, b: int) -> str:
    return f"a, b = {a}, {b}\nwhile b:\n    a, b = b, a % b\nprint(a)"


def _numeric_attempts(rng: random.Random, expression: str, with_bug: bool) -> tuple[Attempt, ...]:
    """Print `expression`; with a bug, a failing first attempt and its fix."""
    name = rng.choice(("result", "total", "value", "answer"))
    named = f"{name} = {expression}\nprint({name})"
    code = rng.choice((f"print({expression})", named))
    if not with_bug:
        return (Attempt(code),)
    kind = rng.choice(("typo", "paren", "concat"))
    if kind == "typo":
        typo = name[:-2] + name[-1]
        bug = Attempt(
            f"{name} = {expression}\nprint({typo})",
            fails=True,
            fix_note=f"I misspelled the variable `{name}`. Let me fix it.",
        )
        return (bug, Attempt(named))
    if kind == "paren":
        bug = Attempt(
            f"print(({expression})",
            fails=True,
            fix_note="A parenthesis is not closed. I'll store the value in a variable first.",
        )
        return (bug, Attempt(named))
    bug = Attempt(
        f"print('Result: ' + {expression})",
        fails=True,
        fix_note="A string cannot be added to a number, so I will print the number directly.",
    )
    return (bug, Attempt(f"print({expression})"))


def _expression_plan(rng: random.Random, problem: Problem, with_bug: bool) -> tuple[Attempt, ...]:
    expression = str(problem.metadata.get("expression", "")).strip()
    if not expression:
        raise ValueError(f"{problem.id}: no expression")
    return _numeric_attempts(rng, expression, with_bug)


def _import_bug(code: str, name: str, module: str) -> tuple[Attempt, ...]:
    """`code` (which starts with its import) first sent without the import: the NameError,
    and the fix is the import, not the same code again."""
    _, _, body = code.partition("\n")
    return (
        Attempt(
            body,
            fails=True,
            fix_note=f"`{name}` has to be imported from `{module}` first.",
        ),
        Attempt(code),
    )


def _gcd_plan(rng: random.Random, problem: Problem, with_bug: bool) -> tuple[Attempt, ...]:
    numbers = ", ".join(str(int(n)) for n in problem.metadata["numbers"])
    code = f"from math import gcd\nprint(gcd({numbers}))"
    if with_bug:
        return _import_bug(code, "gcd", "math")
    if len(problem.metadata["numbers"]) == 2 and rng.random() < 0.3:
        return (Attempt(_euclid(*(int(n) for n in problem.metadata["numbers"]))),)
    return (Attempt(code),)


def _lcm_plan(rng: random.Random, problem: Problem, with_bug: bool) -> tuple[Attempt, ...]:
    numbers = ", ".join(str(int(n)) for n in problem.metadata["numbers"])
    code = f"from math import lcm\nprint(lcm({numbers}))"
    return _import_bug(code, "lcm", "math") if with_bug else (Attempt(code),)


def _equation_plan(rng: random.Random, problem: Problem, with_bug: bool) -> tuple[Attempt, ...]:
    equation = str(problem.metadata["equation"])
    var = str(problem.metadata["variable"])
    if not _IDENTIFIER.match(var) or equation.count("=") != 1:
        raise ValueError(f"{problem.id}: unexpected equation {equation!r}")
    left, right = (side.strip() for side in equation.split("="))
    code = (
        f"from sympy import Eq, solve, symbols\n{var} = symbols('{var}')\n"
        f"print(solve(Eq({left}, {right}), {var})[0])"
    )
    return _import_bug(code, "symbols", "sympy") if with_bug else (Attempt(code),)


def _fraction_plan(rng: random.Random, problem: Problem, with_bug: bool) -> tuple[Attempt, ...]:
    n, d = int(problem.metadata["numerator"]), int(problem.metadata["denominator"])
    code = f"from fractions import Fraction\nprint(Fraction({n}, {d}))"
    return _import_bug(code, "Fraction", "fractions") if with_bug else (Attempt(code),)


def _factor_plan(rng: random.Random, problem: Problem, with_bug: bool) -> tuple[Attempt, ...]:
    number = int(problem.metadata["number"])
    code = (
        f"from sympy import factorint\nfactors = factorint({number})\n"
        "print(' × '.join(str(p) for p in sorted(factors) for _ in range(factors[p])))"  # noqa: RUF001
    )
    return _import_bug(code, "factorint", "sympy") if with_bug else (Attempt(code),)


PlanMaker = Callable[[random.Random, Problem, bool], tuple[Attempt, ...]]
GYM_FAMILIES: dict[str, PlanMaker] = {
    "basic_arithmetic": _expression_plan,
    "chain_sum": _expression_plan,
    "products": _expression_plan,
    "gcd": _gcd_plan,
    "lcm": _lcm_plan,
    "simple_equations": _equation_plan,
    "fraction_simplification": _fraction_plan,
    "prime_factorization": _factor_plan,
}


def instruction_item(rng: random.Random, index: int, seed: int) -> tuple[Problem, str, bool]:
    """A simple instruction-following problem, the code that answers it, and whether a
    numeric bug may be planted in it."""
    kind = rng.choice(INSTRUCTION_KINDS)
    word = rng.choice(WORDS)
    numeric = False
    if kind == "reverse":
        question = f"Reverse the word '{word}'. Reply with the reversed word only."
        code, answer = f"print('{word}'[::-1])", word[::-1]
    elif kind == "count":
        letter = rng.choice(sorted(set(word)))
        question = f"How many times does the letter '{letter}' appear in the word '{word}'?"
        code, answer = f"print('{word}'.count('{letter}'))", str(word.count(letter))
    elif kind == "digits":
        number = rng.randint(100, 10**7)
        question = f"What is the sum of the digits of {number}?"
        code = f"print(sum(int(d) for d in str({number})))"
        answer = str(sum(int(d) for d in str(number)))
    elif kind == "sort":
        values = [rng.randint(-50, 99) for _ in range(rng.randint(4, 7))]
        shown = ", ".join(str(v) for v in values)
        question = (
            f"Sort these numbers from smallest to largest: {shown}. Give them separated by commas."
        )
        code = f"print(', '.join(str(x) for x in sorted([{shown}])))"
        answer = ", ".join(str(v) for v in sorted(values))
    elif kind == "largest":
        values = [rng.randint(-999, 999) for _ in range(rng.randint(4, 8))]
        shown = ", ".join(str(v) for v in values)
        question = f"Which is the largest of these numbers: {shown}? Answer with the number only."
        code, answer = f"print(max([{shown}]))", str(max(values))
    elif kind == "upper":
        question = f"Write the word '{word}' in capital letters."
        code, answer = f"print('{word}'.upper())", word.upper()
    elif kind == "remainder":
        a, b = rng.randint(100, 99999), rng.randint(3, 97)
        question = f"What is the remainder when {a} is divided by {b}?"
        code, answer, numeric = f"print({a} % {b})", str(a % b), True
    elif kind == "percent":
        percent = rng.choice((10, 20, 25, 50, 75))
        base = 20 * rng.randint(1, 50)
        question = f"What is {percent}% of {base}?"
        code, answer = f"print({base} * {percent} // 100)", str(base * percent // 100)
        numeric = True
    elif kind == "words":
        sentence = rng.choice(SENTENCES)
        question = f'How many words are in the sentence "{sentence}"?'
        code, answer = f"print(len('{sentence}'.split()))", str(len(sentence.split()))
    elif kind == "binary":
        number = rng.randint(2, 1000)
        question = f"Write {number} in binary, using only the digits 0 and 1."
        code, answer = f"print(bin({number})[2:])", bin(number)[2:]
    else:  # square
        number = rng.randint(11, 999)
        question = f"What is {number} squared?"
        code, answer, numeric = f"print({number} ** 2)", str(number**2), True
    problem = Problem(
        id=f"sft-instruction-{seed}-{index}",
        question=question + rng.choice(SUFFIXES),
        answer=answer,
        source="instruction",
        metadata={"kind": kind, "code": code},
    )
    return problem, code, numeric


class _Pools:
    """reasoning-gym problems per family, generated in growing seeded chunks."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.items: dict[str, list[Problem]] = {}
        self.used: dict[str, int] = {}
        self.chunks: dict[str, int] = {}

    def next(self, family: str) -> Problem:
        pool = self.items.setdefault(family, [])
        used = self.used.get(family, 0)
        if used >= len(pool):
            chunk = self.chunks.get(family, 0)
            self.chunks[family] = chunk + 1
            pool += reasoning_gym_problems(family, 64, seed=SEED_OFFSET + self.seed * 1000 + chunk)
        self.used[family] = used + 1
        return pool[used]


def make_plans(
    count: int,
    seed: int = 0,
    mix: dict[str, float] | None = None,
    error_fraction: float = ERROR_FRACTION,
    start: int = 0,
) -> list[Plan]:
    """`count` scripted solutions, the same for the same arguments."""
    mix = mix or DEFAULT_MIX
    families = sorted(mix)
    weights = [mix[name] for name in families]
    rng = random.Random(f"kubestar-sft/{seed}/{start}")
    pools = _Pools(seed * 7919 + start)
    plans: list[Plan] = []
    index = start
    while len(plans) < count:
        family = rng.choices(families, weights)[0]
        index += 1
        try:
            if family == "instruction":
                problem, code, numeric = instruction_item(rng, index, seed)
                attempts: tuple[Attempt, ...] = (Attempt(code),)
                if numeric and rng.random() < error_fraction:
                    expression = code.removeprefix("print(").removesuffix(")")
                    attempts = _numeric_attempts(rng, expression, with_bug=True)
            else:
                problem = pools.next(family)
                with_bug = rng.random() < error_fraction
                attempts = GYM_FAMILIES[family](rng, problem, with_bug)
        except (KeyError, ValueError, TypeError) as exc:
            log.debug("sft plan skipped: %s", exc)
            continue
        plans.append(
            Plan(
                problem=Problem(
                    id=f"sft-{seed}-{index}-{problem.id}",
                    question=problem.question,
                    answer=plain_answer(problem.answer),
                    source=family,
                    metadata=problem.metadata,
                ),
                family=family,
                intro=rng.choice(INTROS),
                attempts=attempts,
                final=rng.choice(FINALS),
            )
        )
    return plans


# -- playing the plans through the agent loop ---------------------------------------------------
def _script(plans: dict[str, Plan]) -> Callable[[str, int, str], str]:
    def script(trajectory_id: str, turn: int, context: str) -> str:
        plan = plans[trajectory_id]
        attempts = plan.attempts
        if turn == 0:
            return f"{plan.intro}\n{format_tool_call(attempts[0].code)}"
        response = _last_tool_response(context)
        if turn < len(attempts):
            note = attempts[turn - 1].fix_note
            error = _error_line(response)
            return (
                f"The code failed with `{error}`. {note}\n{format_tool_call(attempts[turn].code)}"
            )
        output = response.strip().splitlines()[-1].strip() if response.strip() else ""
        answer = plan.problem.answer if agrees(output, plan.problem.answer) else output
        return plan.final.format(output=output, answer=answer)

    return script


class SandboxTools:
    """The agent loop's ToolExecutor over the blocking SandboxClient (calls run in threads).

    A call the sandbox does not answer is remembered in `error`: the build then fails with
    that error instead of producing examples whose tool turns say that the sandbox failed,
    and every later call fails at once rather than wait out the client's retries again.
    """

    def __init__(self, endpoint: str, timeout: float = 300.0) -> None:
        self.endpoint = endpoint
        self.client = SandboxClient(endpoint, timeout=timeout)
        self.error = ""

    async def execute(self, call: Call) -> pb.ExecutionResult:
        import grpc

        if self.error:
            raise RuntimeError(self.error)
        try:
            return await asyncio.to_thread(self.client.execute, call)
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()  # type: ignore[attr-defined]
            self.error = f"the sandbox at {self.endpoint} did not answer: {code.name}: {details}"
            raise

    async def close(self) -> None:
        self.client.close()


def _example(plan: Plan, trajectory: Trajectory, max_tokens: int) -> tuple[SftExample | None, str]:
    """The example, or None and why it was dropped (a short reason, then details)."""
    trajectory.check()
    if trajectory.finish_reason != ANSWERED:
        return None, f"not answered: finished {trajectory.finish_reason}"
    statuses = [call.status for call in trajectory.tool_calls]
    expected = ["error" if attempt.fails else "ok" for attempt in plan.attempts]
    if statuses != expected:
        return None, f"unexpected tool statuses: {statuses}, expected {expected}"
    output = trajectory.tool_calls[-1].stdout.strip()
    if not agrees(output, plan.problem.answer) or trajectory.answer != plan.problem.answer:
        return None, f"wrong output: {output!r} is not the answer {plan.problem.answer!r}"
    if len(trajectory.prompt_ids) + len(trajectory.response_ids) > max_tokens:
        return None, f"too long: more than {max_tokens} tokens"
    # A planted bug is context, not a lesson: the turn that sends it is not trained on, so
    # SFT teaches reading the error and sending fixed code, never writing the bug.
    mask = list(trajectory.response_mask)
    turns = [segment for segment in trajectory.segments if segment.owner == MODEL]
    for segment, attempt in zip(turns, plan.attempts, strict=False):
        if attempt.fails:
            mask[segment.start : segment.end] = [0] * (segment.end - segment.start)
    return (
        SftExample(
            id=plan.problem.id,
            family=plan.family,
            question=plan.problem.question,
            answer=plan.problem.answer,
            prompt_ids=list(trajectory.prompt_ids),
            response_ids=list(trajectory.response_ids),
            response_mask=mask,
            prompt_text=trajectory.prompt_text,
            assistant_turns=[s.text for s in trajectory.segments if s.owner == MODEL],
            tool_codes=[call.code for call in trajectory.tool_calls],
            tool_responses=[call.response for call in trajectory.tool_calls],
            tool_statuses=statuses,
            fixes_error=plan.fixes_error,
        ),
        "",
    )


async def build_sft_examples_async(
    count: int,
    sandbox_endpoint: str,
    tokenizer: ChatTokenizer,
    seed: int = 0,
    max_tokens: int = 1024,
    config: RolloutConfig | None = None,
    mix: dict[str, float] | None = None,
    error_fraction: float = ERROR_FRACTION,
    concurrency: int = 32,
) -> list[SftExample]:
    """`count` examples (see the module docstring), with outputs from the sandbox at
    `sandbox_endpoint`. `config` gives the instructions and tool-response settings (use the
    RL rollouts' so the prompts match; default: RolloutConfig())."""
    base = config or RolloutConfig()
    loop_config = RolloutConfig(
        max_turns=max(4, base.max_turns),
        max_response_tokens=max(max_tokens, 64) * 4,
        tool_timeout_seconds=base.tool_timeout_seconds,
        tool_memory_bytes=base.tool_memory_bytes,
        tool_output_bytes=base.tool_output_bytes,
        max_tool_response_chars=base.max_tool_response_chars,
        max_calls_per_turn=base.max_calls_per_turn,
        instructions=base.instructions,
        user_template=base.user_template,
    )
    tools = SandboxTools(sandbox_endpoint)
    examples: list[SftExample] = []
    dropped: dict[str, int] = {}
    slots = asyncio.Semaphore(concurrency)
    start = 0
    try:
        for _round in range(8):
            needed = count - len(examples)
            if needed <= 0:
                break
            plans = make_plans(math.ceil(needed * 1.2) + 2, seed, mix, error_fraction, start=start)
            start += 100_000
            by_id = {plan.problem.id: plan for plan in plans}
            generator = ScriptedGenerator(tokenizer, _script(by_id))
            loop = AgentLoop(generator, tools, tokenizer, loop_config)

            async def play(plan: Plan, loop: AgentLoop = loop) -> Trajectory:
                async with slots:
                    return await loop.run_trajectory(plan.problem, 0, plan.problem.id)

            trajectories = await asyncio.gather(*(play(plan) for plan in plans))
            if tools.error:
                raise RuntimeError(tools.error)
            before = len(examples)
            for plan, trajectory in zip(plans, trajectories, strict=True):
                example, why = _example(plan, trajectory, max_tokens)
                if example is None:
                    reason = why.split(":")[0]
                    dropped[reason] = dropped.get(reason, 0) + 1
                    log.debug("sft example %s dropped: %s", plan.problem.id, why)
                elif len(examples) < count:
                    examples.append(example)
            if len(examples) == before:  # nothing fits: more rounds will not help
                break
    finally:
        await tools.close()
    if dropped:
        log.info("sft examples dropped: %s", dropped)
    if len(examples) < count:
        prompt = render_prompt(
            loop_config.user_template.format(question=""), system_prompt(loop_config.instructions)
        )
        raise RuntimeError(
            f"only {len(examples)} of {count} SFT examples could be made (dropped: {dropped}); "
            f"the prompt alone takes {len(tokenizer.encode(prompt))} of max_tokens {max_tokens}"
        )
    return examples


def build_sft_examples(
    count: int,
    sandbox_endpoint: str,
    tokenizer: ChatTokenizer,
    seed: int = 0,
    max_tokens: int = 1024,
    config: RolloutConfig | None = None,
    mix: dict[str, float] | None = None,
    error_fraction: float = ERROR_FRACTION,
) -> list[SftExample]:
    """Blocking form of `build_sft_examples_async` (not from inside a running event loop)."""
    return asyncio.run(
        build_sft_examples_async(
            count, sandbox_endpoint, tokenizer, seed, max_tokens, config, mix, error_fraction
        )
    )


def write_examples(examples: Sequence[SftExample], path: Path, tokens: bool = False) -> Path:
    """The examples as JSON lines (e.g. to read what SFT trains on)."""
    with path.open("w") as handle:
        for example in examples:
            handle.write(json.dumps(example.to_dict(tokens=tokens)) + "\n")
    return path
