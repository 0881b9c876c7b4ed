"""Rule-based reward functions for reasoning tasks, in TRL's reward-function signature.

The trainer calls every function here by keyword, `f(prompts=…, completions=…, completion_ids=…,
**columns)`, and each returns one `float | None` per completion (None: "this function does not score
this sample"). A completion is a plain string or a conversational list `[{"role": "assistant",
"content": ...}]`. Called by position, cohort's own functions take `(prompts, completions, …)`;
`think_format_reward(completions)` and a soft overlong punishment's `(completion_ids)` keep TRL's order,
so TRL's examples run unchanged; `accuracy_reward` takes `solution` by keyword only.

The format rewards follow DeepSeek-R1 (2025, §2.2.2 "Reward Modeling": accuracy and format rewards)
and the open-r1 reproduction's `tag_count` / `reasoning_steps` shaping rewards. `think_format_reward`,
`accuracy_reward` and `get_soft_overlong_punishment` carry TRL's names and contracts. The accuracy
reward grades each completion's final answer against the gold one in `cohort_grpo.rewards.grading`.
"""

from __future__ import annotations

import importlib
import json
import re
from typing import Callable

from cohort_grpo.errors import CohortError
from cohort_grpo.rewards.answer_extraction import extract_answer
from cohort_grpo.rewards.completions import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN, completion_text
from cohort_grpo.rewards.grading import canonical_answer, score_accuracy

__all__ = ["REWARD_FUNCS", "accuracy_reward", "canonical_answer", "completion_text", "extract_answer",
           "format_reward", "get_soft_overlong_punishment", "lenient_format_reward", "reasoning_steps_reward",
           "resolve_reward", "serve_sample_scoring", "tag_count_reward", "think_format_reward"]

# ----------------------------------------------------------------------------------------- helpers

# A decoded completion can end in the tokenizer's end-of-sequence text when it was decoded without
# `skip_special_tokens`; the format rewards ignore such trailing markers (and whitespace) so they judge
# the model's layout, not the decoding option.
_TRAILING_EOS = re.compile(r"(?:\s|<\|[^|<>]{1,40}\|>|</s>|<eos>|<end_of_turn>)*\Z")


def _strip_trailing_eos(text: str) -> str:
    return text[: _TRAILING_EOS.search(text).start()]


# ------------------------------------------------------------------------------------ format rewards

_STRICT_FORMAT = re.compile(r"<think>\n(.*?)\n</think>\n<answer>\n(.*?)\n</answer>", re.DOTALL)
_LENIENT_FORMAT = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_TAGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)


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


def _first_message_text(completion) -> str:
    """The text TRL's format rewards look at: a plain completion itself, or the content of a
    conversational completion's first message."""
    if isinstance(completion, (list, tuple)):
        completion = completion[0] if completion else ""
    return completion_text(completion)


def think_format_reward(completions, **kwargs) -> list[float]:
    """TRL's `think_format_reward`: 1.0 when the completion starts with `<think>`, closes it with
    `</think>`, and opens no second `<think>`; whatever follows `</think>` (the answer, or nothing) is
    free, and no `<answer>` tag is needed. Else 0.0. Nothing may come before `<think>`, not even a space.
    For a conversational completion the first message's content is judged, as TRL does. TRL's signature
    (`completions` first), so `think_format_reward(completions)` works as in TRL; the trainer calls it
    by keyword like every reward function."""
    rewards = []
    for completion in completions:
        text = _first_message_text(completion)
        rest = text[len(THINK_OPEN):]
        ok = text.startswith(THINK_OPEN) and THINK_OPEN not in rest and THINK_CLOSE in rest
        rewards.append(1.0 if ok else 0.0)
    return rewards


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

def accuracy_reward(prompts=None, completions=None, *, solution, completion_ids=None, **_) -> list[float | None]:
    """1.0 when the completion's final answer (see `extract_answer`) equals the dataset's `solution` column
    mathematically, 0.0 when not (or when it gives no answer), None when the gold answer cannot be read
    (DeepSeek-R1 §2.2.2's accuracy reward; TRL's name and contract). `RewardRunner` scores it one sample
    at a time in a worker process (`score_sample`), so a pathological sample costs only that sample."""
    if completions is None:
        raise TypeError("accuracy_reward needs completions=[...] and solution=[...]")
    if len(completions) != len(solution):
        raise ValueError(f"accuracy_reward got {len(completions)} completions and {len(solution)} solutions")
    return [score_accuracy(completion, gold) for completion, gold in zip(completions, solution)]


# The runner calls this per sample, with the keyword columns it names, in a killable worker process.
accuracy_reward.score_sample = score_accuracy


# ------------------------------------------------------------------------------------ length reward


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable:
    """TRL's `get_soft_overlong_punishment`: a reward function over `completion_ids` that gives DAPO's
    soft overlong punishment (Yu et al. 2025, §3.4, eq. 13; the formula is `overlong_penalty` in
    `cohort_grpo/algorithm/objectives.py`): 0 up to `max_completion_len − soft_punish_cache` tokens, then
    falling linearly to −1 at `max_completion_len`, and −1 beyond. With `soft_punish_cache=0` the
    punishment is hard: 0 up to `max_completion_len`, −1 beyond.

    `get_soft_overlong_punishment(100, 20)(completion_ids=[[1] * 90])` → `[-0.5]`. It is a picklable
    object with `__name__ = "soft_overlong_punishment_reward"`, so its metrics are
    `rewards/soft_overlong_punishment_reward/*` as in TRL. (The same shaping is built into the trainer
    as `--overlong_buffer_length`; use one or the other.)"""
    return _SoftOverlongPunishment(max_completion_len, soft_punish_cache)


class _SoftOverlongPunishment:
    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        if not 0 <= soft_punish_cache <= max_completion_len:
            raise CohortError(f"soft_punish_cache={soft_punish_cache} must lie in [0, max_completion_len="
                              f"{max_completion_len}]")
        self.max_completion_len = int(max_completion_len)
        self.soft_punish_cache = int(soft_punish_cache)

    def __call__(self, completion_ids, **kwargs) -> list[float]:
        lengths = [len(ids) for ids in completion_ids]
        if self.soft_punish_cache == 0:  # no linear part: the hard limit alone
            return [-1.0 if n > self.max_completion_len else 0.0 for n in lengths]
        import torch

        from cohort_grpo.algorithm.advantages import overlong_penalty

        penalty = overlong_penalty(torch.tensor(lengths, dtype=torch.float64), self.max_completion_len,
                                   self.soft_punish_cache)
        return [float(x) for x in penalty.tolist()]


# ---------------------------------------------------------------------------------------- registry

REWARD_FUNCS: dict[str, Callable] = {
    "format": format_reward,
    "lenient_format": lenient_format_reward,
    "tag_count": tag_count_reward,
    "reasoning_steps": reasoning_steps_reward,
    "accuracy": accuracy_reward,
    "think_format_reward": think_format_reward,  # TRL's name
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
