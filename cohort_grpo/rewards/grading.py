"""Grading a math answer: find the completion's final answer, read it as one value, compare it with the
gold answer. The accuracy reward (`rules.accuracy_reward`, through `score_accuracy`), evaluation
(`extract_answer`) and majority voting (`canonical_answer`) all grade through these steps, so an answer
is read the same way everywhere.

Each step has its module: `answer_extraction` finds the text of the final answer, `answer_reading` reads
it as one value, `answer_comparison` compares two values; the rules the steps share (what counts as
prose, as a unit, as a value in running text) are in `answer_text`, and a change to one is checked
against the others by tests/test_grading.py. The rules, and what is and is not graded right, are in
docs/howto/rewards.md. Nothing here imports torch: the per-sample scoring worker imports this module.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

from cohort_grpo.rewards.answer_comparison import as_answer, as_number, same_value
from cohort_grpo.rewards.answer_extraction import extract_answer
from cohort_grpo.rewards.answer_reading import AnswerValue, read_value


@functools.lru_cache(maxsize=4096)
def _gold_value(solution: str) -> AnswerValue | None:
    """The dataset's answer, read like a completion's: a bare `72` or `\\frac{1}{2}`, a `$…$`, a box in a
    worked solution, a `#### 72` line."""
    return read_value(extract_answer(solution))


def score_accuracy(completion, solution) -> float | None:
    """One sample of `accuracy_reward`: 1.0 / 0.0, or None when the gold `solution` has no readable answer."""
    gold = _gold_value(str(solution))
    if gold is None:
        return None
    pred = read_value(extract_answer(completion))
    if pred is None:
        return 0.0
    return 1.0 if same_value(gold, pred) else 0.0


def canonical_answer(text) -> str | None:
    """A normal form of a completion's answer for majority voting: numbers as plain decimals
    (`18.00`, `$18`, `18` → "18"; `\\frac{1}{2}` → "0.5"; `x = 5` → "5"), other expressions as sympy
    prints them; None when no answer can be read."""
    value = read_value(extract_answer(text))
    if value is None:
        return None
    number = value.number
    if number is None:
        expr = as_answer(value.expr, None)
        if expr is None:
            return None
        number = as_number(expr)
        if number is None:
            return str(expr)
        if number.is_Rational:
            number = Fraction(int(number.p), int(number.q))
    suffix = "%" if value.percent else ""
    if isinstance(number, Fraction) and number.denominator == 1:
        return f"{number.numerator}{suffix}"
    try:
        as_float = float(number)
    except (TypeError, ValueError, OverflowError):
        return str(number)
    if math.isfinite(as_float) and as_float == round(as_float) and abs(as_float) < 1e15:
        return f"{int(round(as_float))}{suffix}"
    return f"{as_float:.10g}{suffix}"
