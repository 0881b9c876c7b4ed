"""Reading an answer's text as ONE value (`read_value`): a plain number, read exactly as a fraction
("1,000", "$18.00", "50%", "1e-5", "18 dollars"), or else one LaTeX expression that math-verify's LaTeX
parser reads whole ("\\frac{3}{4}", "2\\sqrt{2}", "(1, 2]", "x = 5"). Text that reads as more than one
value ("2 or 3"), only partly, or with a word that changes the value ("18 thousand", "not 5") reads as
no value (None), which scores 0: a reward that pays a wrong answer teaches the policy to game it.

math-verify guards its own work with `signal.alarm`, which only works on the main thread; we turn it
off (`parsing_timeout=None` here, `timeout_seconds=None` in `answer_comparison`) and
`cohort_grpo.rewards.sample_workers` enforces a time limit per sample instead, in a worker process it can
kill (see `SampleWorkerPool`). Nothing here imports torch: the per-sample scoring worker imports this module.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from fractions import Fraction

from cohort_grpo.rewards.answer_text import (NOT_UNITS, WORD_ANSWER, are_units, has_prose, located_values, normalise,
                                             words_in)

_UNIT_TAIL = re.compile(r"^(?P<head>.*?[\d}\)\]])\s*(?P<tail>(?:[^\W\d_]{2,}\.?(?:\^\{?-?\d\}?)?\s*(?:/\s*)?)+)$")
_SPACED_DIGITS = re.compile(r"(?<![_^\d])\d+\s+\d")  # "2 3" reads as 5 in the LaTeX parser: no value
_ANSWER_PREFIX = re.compile(r"^(?:so|thus|therefore|hence)?,?\s*(?:the\s+)?(?:final\s+)?answer\s*(?:is|:|=)\s*:?\s*",
                            re.IGNORECASE)
_PLAIN_NUMBER = re.compile(
    r"(?P<sign>[-+])?\s*(?P<cur>\$)?\s*(?P<sign2>[-+])?\s*"
    r"(?P<int>\d{1,3}(?:,\d{3})+|\d+)?(?:\.(?P<frac>\d+))?(?:[eE](?P<exp>[-+]?\d+))?"
    r"\s*(?P<pct>%|percent\b|per\s?cent\b)?\s*\$?"
    r"(?P<unit>(?:\s*[^\W\d_]{2,}\.?(?:\^\{?\d\}?)?(?:\s*/)?)*)\s*"
)
_PLAIN_FRACTION = re.compile(r"(?P<sign>-)?\s*(?:(?P<whole>\d+)\s+)?(?P<num>\d+)\s*/\s*(?P<den>\d+)"
                             r"(?P<unit>(?:\s*[^\W\d_]{2,}\.?)*)\s*")
_MAX_LATEX = 400  # longer "answers" are not one value


def _value_spans(text: str) -> list[str]:
    return [content for _, _, content in located_values(text)]


@dataclass(frozen=True)
class AnswerValue:
    """One answer, read. `number`: a plain number, exact; `expr`: a sympy object from the LaTeX parser."""

    number: Fraction | None = None
    percent: bool = False  # written with %: it may be read as n or n/100
    decimals: int | None = None  # a decimal's digits after the point as written ("0.3333" → 4)
    significant: int = 0  # its significant digits as written
    expr: object = None


def _plain_number(text: str) -> AnswerValue | None:
    m = _PLAIN_FRACTION.fullmatch(text)
    if m and int(m["den"]) != 0 and (m["whole"] is None or int(m["num"]) < int(m["den"])) \
            and (not m["unit"].strip() or are_units(m["unit"])):
        number = int(m["whole"] or 0) + Fraction(int(m["num"]), int(m["den"]))  # "3/4", mixed "1 1/2"
        return AnswerValue(number=-number if m["sign"] else number)
    m = _PLAIN_NUMBER.fullmatch(text)
    if m is None or (m["int"] is None and m["frac"] is None) or (m["sign"] and m["sign2"]):
        return None
    if m["unit"].strip() and not are_units(m["unit"]):
        return None
    digits = (m["int"] or "0").replace(",", "") + "." + (m["frac"] or "")
    exponent = int(m["exp"] or 0)
    if abs(exponent) > 1000:  # "1e999999999": no answer, and too large to build
        return None
    number = Fraction(digits.rstrip(".")) * Fraction(10) ** exponent
    if (m["sign"] or m["sign2"]) == "-":
        number = -number
    decimals = significant = None
    if m["frac"] is not None or exponent < 0:
        decimals = len(m["frac"] or "") - exponent
        significant = len(digits.replace(".", "").lstrip("0"))
    return AnswerValue(number=number, percent=m["pct"] is not None, decimals=decimals, significant=significant or 0)


@functools.lru_cache(maxsize=16384)
def read_value(piece: str | None, inner: bool = False) -> AnswerValue | None:
    """`piece` read as one value, or None when it is not exactly one. Prose with exactly one number or
    maths span in it ("The answer is 18.") reads as that, unless a word in it changes or hedges it."""
    if piece is None:
        return None
    text = normalise(piece)
    text = _ANSWER_PREFIX.sub("", text, count=1).strip().rstrip(".,;:").strip()  # not "!": 5! is 120
    if not text or len(text) > _MAX_LATEX:
        return None
    value = _plain_number(text)
    if value is not None:
        return value
    tail = _UNIT_TAIL.fullmatch(text)
    if tail and are_units(tail["tail"]):
        text = tail["head"].strip()
    if has_prose(text) and not WORD_ANSWER.fullmatch(text):
        if inner or any(w in NOT_UNITS for w in words_in(text)):
            return None
        spans = _value_spans(text)
        return read_value(spans[0], True) if len(spans) == 1 else None
    if _SPACED_DIGITS.search(text):
        return None
    expr = _parse_latex(text.replace("$", ""))
    return None if expr is None or _too_large(expr) else AnswerValue(expr=expr)


class _DropDisabledTimeoutNotice(logging.Filter):
    """math-verify logs a warning the first time its timeout is disabled; we disable it on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropDisabledTimeoutNotice())


@functools.lru_cache(maxsize=1)
def _latex_config():
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig

    # units=False: math-verify would drop "m" from "5m" (5 metres, or 5·m?); we take units off ourselves,
    # only where they are words or \text{…}, so a letter after a number stays a variable.
    return LatexExtractionConfig(
        boxed_match_priority=0, try_extract_without_anchor=False,
        normalization_config=NormalizationConfig(basic_latex=True, units=False, malformed_operators=True,
                                                 nits=True, boxed="all"))


def _parse_latex(text: str):
    """The sympy object math-verify's LaTeX parser reads from `text` as a whole (given to it boxed, so it
    cannot read a prefix), or None."""
    from math_verify import parse  # imported here: it pulls in sympy, which takes a moment

    found = parse("$\\boxed{" + text + "}$", extraction_config=[_latex_config()], fallback_mode="no_fallback",
                  extraction_mode="first_match", parsing_timeout=None)
    return next((item for item in found if not isinstance(item, str)), None)


def _too_large(expr) -> bool:
    """Whether `expr` holds a power or factorial too large to evaluate (`9^{9^{9^9}}`, `10^6!`): no answer
    a grader would accept, and comparing it could run for hours outside the runner's time limit."""
    import sympy

    try:
        for node in sympy.preorder_traversal(expr):
            if isinstance(node, sympy.Pow) and node.exp.is_number and node.base not in (0, 1, -1):
                if abs(node.exp.evalf(5)) > 100_000:
                    return True
            elif isinstance(node, sympy.factorial) and node.args[0].is_number and abs(node.args[0].evalf(5)) > 10_000:
                return True
    except (TypeError, ValueError, ArithmeticError, RecursionError):
        return True
    return False

