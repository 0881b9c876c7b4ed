"""Rule-based reward functions for reasoning tasks, in TRL's reward-function signature.

Every function here is called as `f(prompts, completions, completion_ids=None, **columns)` and returns
one `float | None` per completion (None: "this function does not score this sample"). A completion
is a plain string or a conversational list `[{"role": "assistant", "content": ...}]`.

The format rewards follow DeepSeek-R1 (2025, §2.2.2 "Reward Modeling": accuracy and format rewards)
and the open-r1 reproduction's `tag_count` / `reasoning_steps` shaping rewards; the accuracy reward
compares answers symbolically with HuggingFace's math-verify (`math_verify.parse` / `verify`).

math-verify guards its own work with `signal.alarm`, which only works on the main thread; we turn it
off (`parsing_timeout=None`, `timeout_seconds=None`) and `cohort.rewards.runner` enforces a time limit
per sample instead, in a worker process it can kill (see `RewardRunner`).
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import re
from typing import Callable

from ..errors import CohortError

# ----------------------------------------------------------------------------------------- helpers


def completion_text(completion) -> str:
    """The text of one completion: the string itself, or the contents of a conversational completion's
    messages joined (a content may also be a list of `{"type": "text", "text": ...}` parts)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)):
        parts = []
        for message in completion:
            content = message.get("content", "") if isinstance(message, dict) else message
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(content if isinstance(content, str) else str(content))
        return "".join(parts)
    return "" if completion is None else str(completion)


# A decoded completion can end in the tokenizer's end-of-sequence text when it was decoded without
# `skip_special_tokens`; the format rewards ignore such trailing markers (and whitespace) so they judge
# the model's layout, not the decoding option.
_TRAILING_EOS = re.compile(r"(?:\s|<\|[^|<>]{1,40}\|>|</s>|<eos>|<end_of_turn>)*\Z")


def _strip_trailing_eos(text: str) -> str:
    return text[: _TRAILING_EOS.search(text).start()]


# ------------------------------------------------------------------------------------ format rewards

_STRICT_FORMAT = re.compile(r"<think>\n(.*?)\n</think>\n<answer>\n(.*?)\n</answer>", re.DOTALL)
_LENIENT_FORMAT = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def _each_tag_once(text: str) -> bool:
    return all(text.count(tag) == 1 for tag in _TAGS)


def format_reward(prompts, completions, completion_ids=None, **_) -> list[float]:
    """1.0 when the completion is exactly `<think>\\n…\\n</think>\\n<answer>\\n…\\n</answer>` (each tag
    once), else 0.0. Trailing whitespace and a trailing end-of-sequence marker such as `<|im_end|>` or
    `</s>` are ignored; anything else before `<think>` or after `</answer>` fails. (DeepSeek-R1 §2.2.2.)"""
    rewards = []
    for completion in completions:
        text = _strip_trailing_eos(completion_text(completion))
        ok = _STRICT_FORMAT.fullmatch(text) is not None and _each_tag_once(text)
        rewards.append(1.0 if ok else 0.0)
    return rewards


def lenient_format_reward(prompts, completions, completion_ids=None, **_) -> list[float]:
    """Like `format_reward` but whitespace (or none) is allowed around every tag:
    `<think>…</think> <answer>…</answer>` scores 1.0. Each tag must still appear exactly once."""
    rewards = []
    for completion in completions:
        text = _strip_trailing_eos(completion_text(completion))
        ok = _LENIENT_FORMAT.fullmatch(text) is not None and _each_tag_once(text)
        rewards.append(1.0 if ok else 0.0)
    return rewards


def tag_count_reward(prompts, completions, completion_ids=None, **_) -> list[float]:
    """0.25 for each of `<think>\\n`, `\\n</think>\\n`, `\\n<answer>\\n`, `\\n</answer>` that appears
    exactly once: a dense signal toward the strict format (open-r1's `tag_count_reward`)."""
    pieces = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
    return [0.25 * sum(completion_text(c).count(p) == 1 for p in pieces) for c in completions]


# A step marker: "Step 3:", a numbered line "2. ", a bullet "- " / "* " at a line start, or an ordinal
# word. Numbers and bullets must start a line so decimals ("1.5") and minus signs ("5 - 3") don't count.
_STEP_MARKER = re.compile(
    r"Step \d+:|^[ \t]*\d+\.[ \t]|^[ \t]*[-*][ \t]|\b(?:First|Second|Next|Finally),", re.MULTILINE
)


def reasoning_steps_reward(prompts, completions, completion_ids=None, **_) -> list[float]:
    """min(1, markers / 3): rewards laying reasoning out in at least three explicit steps
    (open-r1's `reasoning_steps_reward`)."""
    return [min(1.0, len(_STEP_MARKER.findall(completion_text(c))) / 3) for c in completions]


# ---------------------------------------------------------------------------------- accuracy reward

_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A number: "1,234.5" (comma thousands groups) or "-12" or "3.75"; groups first so "1,000" stays whole.
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{…}` with balanced braces, or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1 : j].strip()
        start = text.rfind("\\boxed{", 0, start)  # unbalanced (truncated): try an earlier one
    return None


def extract_answer(text) -> str | None:
    """The model's final answer as text: the content of the last `<answer>…</answer>`; failing that the
    last `\\boxed{…}`; failing that the last number in the text; None when there is none of these."""
    text = completion_text(text)
    blocks = _ANSWER_BLOCK.findall(text)
    if blocks:
        return blocks[-1].strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


class _DropDisabledTimeoutNotice(logging.Filter):
    """math-verify logs a warning the first time its timeout is disabled; we disable it on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropDisabledTimeoutNotice())


def _parse_math(text: str) -> list:
    from math_verify import parse  # imported here: it pulls in sympy, which takes a moment

    return parse(text, parsing_timeout=None)


def score_accuracy(completion, solution) -> float | None:
    """One sample of `accuracy_reward`: 1.0 / 0.0, or None when the gold `solution` does not parse.

    The gold answer and the extracted answer are parsed by math-verify and compared with
    `math_verify.verify`, so `1,000` = `1000`, `\\frac{1}{2}` = `0.5`, `$18` = `18`, `18.00` = `18`."""
    from math_verify import verify

    gold = _parse_math(str(solution))
    if not gold:
        return None
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    predicted = _parse_math(answer)
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0


def accuracy_reward(prompts, completions, solution, completion_ids=None, **_) -> list[float | None]:
    """1.0 when the completion's answer (see `extract_answer`) equals the dataset's `solution` column
    mathematically, 0.0 when not, None when the gold answer cannot be parsed (DeepSeek-R1 §2.2.2's
    accuracy reward; comparison by math-verify). `RewardRunner` scores it one sample at a time in a
    worker process (`score_sample`), so a pathological sample costs only that sample."""
    return [score_accuracy(completion, gold) for completion, gold in zip(completions, solution)]


# The runner calls this per sample, with the keyword columns it names, in a killable worker process.
accuracy_reward.score_sample = score_accuracy


def canonical_answer(text) -> str | None:
    """A normal form of a completion's answer for majority voting: numbers as plain decimals
    (`18.00`, `$18`, `18` → "18"; `\\frac{1}{2}` → "0.5"), other expressions as sympy prints them;
    None when no answer can be extracted or parsed."""
    answer = extract_answer(text)
    parsed = _parse_math(answer) if answer is not None else []
    if not parsed:
        return None
    value = parsed[0]
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isfinite(number) and number == round(number) and abs(number) < 1e15:
        return str(int(round(number)))
    return f"{number:.10g}"


# ---------------------------------------------------------------------------------------- registry

REWARD_FUNCS: dict[str, Callable] = {
    "format": format_reward,
    "lenient_format": lenient_format_reward,
    "tag_count": tag_count_reward,
    "reasoning_steps": reasoning_steps_reward,
    "accuracy": accuracy_reward,
}


def resolve_reward(spec) -> Callable:
    """A reward callable from a registry name (`accuracy`), a `package.module:function` path (imported
    only because the user named it), or a callable (returned as is)."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise CohortError(f"reward {spec!r} is not a name; use one of {sorted(REWARD_FUNCS)} or 'module:function'")
    spec = spec.strip()
    if spec in REWARD_FUNCS:
        return REWARD_FUNCS[spec]
    if ":" not in spec:
        raise CohortError(
            f"unknown reward {spec!r}; use one of {sorted(REWARD_FUNCS)} or 'module:function' (--reward_funcs)"
        )
    module_name, _, attr_path = spec.partition(":")
    try:
        target = importlib.import_module(module_name)
    except ImportError as e:
        raise CohortError(f"reward {spec!r}: cannot import module {module_name!r} ({e}); check the name and PYTHONPATH") from e
    for attr in attr_path.split("."):
        if not hasattr(target, attr):
            raise CohortError(f"reward {spec!r}: module {module_name!r} has no {attr_path!r}; check the function name")
        target = getattr(target, attr)
    if not callable(target):
        raise CohortError(f"reward {spec!r} is a {type(target).__name__}, not a function; name a callable")
    return target


# ------------------------------------------------------------------------------- per-sample server


def serve_sample_scoring(requests, replies) -> None:
    """Loop of the per-sample scoring process that `RewardRunner` starts: read one JSON request per line
    `{"fn": "module:function", "args": [...], "kwargs": {...}}` and answer `{"value": …}` or
    `{"error": "…"}`; a request `{"load": "module:function"}` only imports it (answer `{"loaded": true}`),
    so import time is never charged to a sample's time limit. It lives here, not in runner.py, so the worker never imports torch."""
    import math_verify  # noqa: F401 — the accuracy reward's import cost, paid before "ready"

    functions: dict[str, Callable] = {}
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in requests:
        try:
            request = json.loads(line)
            name = request.get("load") or request["fn"]
            if name not in functions:
                module_name, _, attr_path = name.partition(":")
                target = importlib.import_module(module_name)
                for attr in attr_path.split("."):
                    target = getattr(target, attr)
                functions[name] = target
            if "load" in request:
                reply = {"loaded": True}
            else:
                value = functions[name](*request.get("args", []), **request.get("kwargs", {}))
                reply = {"value": None if value is None else float(value)}
        except Exception as e:  # reported to the parent, which warns and records None
            reply = {"error": f"{type(e).__name__}: {e}"[:500]}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
