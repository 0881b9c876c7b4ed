"""Grading a math answer: find the completion's final answer, read it as one value, compare it with the
gold answer. The accuracy reward (`rules.accuracy_reward`), evaluation (`extract_answer`) and majority
voting (`canonical_answer`) all grade through here, so an answer is read the same way everywhere.

One module on purpose: finding, reading and comparing share their rules (what counts as prose, as a
unit, as a single value), and a change to one is checked against the others by tests/test_grading.py.
The rules, and what is and is not graded right, are in docs/howto/rewards.md.

math-verify guards its own work with `signal.alarm`, which only works on the main thread; we turn it
off (`parsing_timeout=None`, `timeout_seconds=None`) and `cohort_grpo.rewards.sample_workers` enforces a time limit
per sample instead, in a worker process it can kill (see `SampleWorkerPool`). Nothing here imports torch:
the per-sample scoring worker imports this module.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from dataclasses import dataclass
from fractions import Fraction

from cohort_grpo.rewards.completions import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN, completion_text

# ------------------------------------------------------------------------------ finding the answer
#
# Grading takes two steps. `extract_answer` finds the text that holds the completion's final answer;
# `_read_value` reads that text as ONE value: a plain number, read exactly as a fraction ("1,000",
# "$18.00", "50%", "1e-5", "18 dollars"), or else one LaTeX expression that math-verify's LaTeX parser
# reads whole ("\frac{3}{4}", "2\sqrt{2}", "(1, 2]", "x = 5"). Numbers are compared exactly (a decimal
# written to 6 or more significant digits may stand for a fraction or a surd); everything else is
# compared by `math_verify.verify`.
#
# The first rule is no false positive: a reward that pays a wrong answer teaches the policy to game it.
# Text that reads as more than one value ("2 or 3"), only partly ("\boxed{12" cut off), or with a word
# that changes the value ("18 thousand", "not 5") reads as no value, which scores 0.

_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")

# Inline or display maths. A single-dollar span follows Pandoc's rule, so money is not maths: the
# opening `$` has a non-space right after it, the closing one a non-space right before it and no digit
# right after it ("$18 and $5" holds no maths; "$\frac{1}{2}$" does).
_MATH_SPAN = re.compile(
    r"\$\$(?P<display>.+?)\$\$"
    r"|\\\[(?P<bracket>.+?)\\\]"
    r"|\\\((?P<paren>.+?)\\\)"
    r"|(?<![\\$])\$(?=[^\s$])(?P<inline>(?:\\.|[^$\\\n])*?[^\s\\$])\$(?![\d$])",
    re.DOTALL,
)
# A number in running text: "1,234.5" or "1 234" (thousands groups), "-12", "3.75", ".5", "1e-5", "50%".
# It does not start inside a word or right after a closing bracket, so "H2O" and "x-3" hold no "-3".
_NUMBER = re.compile(
    r"(?<![\w.)\]}])-?(?:\d{1,3}(?:,\d{3})+(?![\d,])(?:\.\d+)?|\d{1,3}(?: \d{3})+(?![\d,-])(?:\.\d+)?"
    r"|\d+(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?(?:\s*%)?"
)


def _last_box(text: str) -> str | None:
    """Content of the LAST `\\boxed{…}` (or `\\fbox{…}`), or None when it is cut off before its closing
    brace (an earlier box is then not used: the model was replacing it when it stopped)."""
    starts = list(_BOX_START.finditer(text))
    if not starts:
        return None
    depth, begin = 1, starts[-1].end()
    for j in range(begin, len(text)):
        if text[j] in "{}" and text[j - 1] != "\\":  # escaped braces \{ \} are set braces, not grouping
            depth += 1 if text[j] == "{" else -1
            if depth == 0:
                return text[begin:j].strip()
    return None


def _located_values(text: str) -> list[tuple[int, int, str]]:
    """(start, end, content) of the inline/display maths and the bare numbers outside maths, in the
    order they end."""
    found = []
    blanked = list(text)
    for m in _MATH_SPAN.finditer(text):
        content = next(g for g in m.groups() if g is not None)
        found.append((m.start(), m.end(), content.strip()))
        blanked[m.start() : m.end()] = " " * (m.end() - m.start())
    for m in _NUMBER.finditer("".join(blanked)):
        found.append((m.start(), m.end(), m.group()))
    return sorted(found, key=lambda item: item[1])


def _value_spans(text: str) -> list[str]:
    return [content for _, _, content in _located_values(text)]


_HEDGE_GAP = re.compile(r"\W*(?:or|nor|and/or)\W*", re.IGNORECASE)  # "$2$ or $3$": no single answer


def extract_answer(text) -> str | None:
    """The text of a completion's final answer, or None when it gives none. In this order:

    1. only what follows the last `</think>` counts; a `<think>` that is never closed means no answer
       (the model was cut off while reasoning);
    2. the last `<answer>…</answer>` block, with a `\\boxed{…}` inside it taken out; an `<answer>` that
       is never closed means no answer;
    3. else the last `\\boxed{…}` (a second box corrects the first); one cut off before its closing
       brace means no answer;
    4. else what follows the last `####` on its line (GSM8K's reference layout);
    5. else the whole text, when it is one line of maths without words (`2\\sqrt{2}`, `5, 6`);
    6. else the last inline maths (`$…$`, `\\(…\\)`, `\\[…\\]`, `$$…$$`) or bare number, whichever ends later.
    """
    text = completion_text(text)
    if text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE):
        return None
    if THINK_CLOSE in text:
        text = text[text.rfind(THINK_CLOSE) + len(THINK_CLOSE) :]
    open_at, close_at = text.rfind(ANSWER_OPEN), text.rfind(ANSWER_CLOSE)
    if open_at != -1:
        if open_at > close_at:
            return None
        block = text[open_at + len(ANSWER_OPEN) : close_at].strip()
        return _last_box(block) if _BOX_START.search(block) else block
    if _BOX_START.search(text):
        return _last_box(text)
    if "####" in text:
        line = text[text.rfind("####") + 4 :].split("\n", 1)[0].strip()
        if line:
            return line
    whole = text.strip()
    if whole and "\n" not in whole and len(whole) <= 120 and (not _has_prose(_normalise(whole))
                                                               or _WORD_ANSWER.fullmatch(_normalise(whole))):
        return whole
    spans = _located_values(text)
    if len(spans) >= 2 and _HEDGE_GAP.fullmatch(text[spans[-2][1] : spans[-1][0]]):
        return None
    return spans[-1][2] if spans else None


# ------------------------------------------------------------------------------ reading one value

# Words that may follow a number as its unit only when they do not change or hedge its value.
_NOT_UNITS = frozenset("""
    not no never nor neither either or than least most about approximately approx around roughly nearly
    almost over under between unless except cannot impossible undefined none thousand thousands million
    millions billion billions trillion trillions hundred hundreds dozen dozens squared cubed half halves
    third thirds quarter quarters fourth fourths fifth fifths tenth tenths hundredth hundredths
    thousandth thousandths plus minus point negative twice double triple wrong incorrect false unsure
    maybe perhaps possibly probably guess unknown isn
""".split())
# Words that are maths, not prose, when written without a backslash.
_MATH_WORDS = frozenset("""
    sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log ln lg exp sqrt pi mod gcd lcm max min
    lim det infty inf
""".split())
_WORD = re.compile(r"(?<!\\)(?<![^\W\d_])[^\W\d_]{2,}")  # 2+ letters, not a \command or inside one
_SIZING = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|biggl|biggr|Biggl|Biggr|big|Big|bigg|Bigg)(?![A-Za-z])\.?"
                     r"|\\(?:displaystyle|textstyle|scriptstyle)(?![A-Za-z])")
_STYLE = re.compile(r"\\(?:mathbf|textbf|boldsymbol|bm|mathit|textit|mathrm|textrm|text|mbox|hbox|mathsf|"
                    r"textsf|textup|textnormal|mathnormal|emph|boxed|fbox)\s*\{([^{}]*)\}")
# A unit in \text{…} after a value ("5\text{ m}", "18\,\mathrm{cm}^2"), taken off before \text is
# unwrapped so that one-letter units survive; \mathrm{e} and \mathrm{i} are constants, not units.
_TEXT_UNIT = re.compile(r"(?<=[\d}\)\]\s])\s*\\(?:text|textrm|mathrm|mbox|textup|rm)\s*\{\s*([^{}\d\\]*?)\s*\}"
                        r"(?:\s*\^\s*\{?-?\d\}?)?\s*$")
_ONE_LETTER_UNITS = frozenset("m g s h l L K A V W J N".split())  # in \text{…}: "5\text{ m}"; not "x"
_UNIT_TAIL = re.compile(r"^(?P<head>.*?[\d}\)\]])\s*(?P<tail>(?:[^\W\d_]{2,}\.?(?:\^\{?-?\d\}?)?\s*(?:/\s*)?)+)$")
_THOUSANDS_SPACED = re.compile(r"(?<![\d.,])\d{1,3}(?: \d{3})+(?![\d,])")
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
_UNICODE = {"−": "-", "–": "-", "×": r"\times ", "÷": r"\div ", "·": r"\cdot ", "π": r"\pi ",
            "∞": r"\infty ", "√": r"\sqrt", "°": r"^\circ", "\u00a0": " ", "\u2009": " ", "\u202f": " "}
_WORD_ANSWER = re.compile(r"\\text\s*\{[^{}\d]*\}")  # "\text{even}", "\text{(B)}"
_MAX_LATEX = 400  # longer "answers" are not one value


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def _has_prose(text: str) -> bool:
    return any(w not in _MATH_WORDS for w in _words(text))


def _are_units(text: str) -> bool:
    words = _words(text)
    return bool(words) and not any(w in _NOT_UNITS or w in _MATH_WORDS for w in words)


def _unwrap_whole(text: str) -> str:
    """`$…$`, `$$…$$`, `\\(…\\)`, `\\[…\\]` around the whole text, taken off."""
    while True:
        for left, right in (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$")):
            inner = text[len(left) : -len(right)]
            if len(text) > len(left) + len(right) and text.startswith(left) and text.endswith(right) \
                    and "$" not in inner.replace("\\$", ""):
                text = inner.strip()
                break
        else:
            return text


def _normalise(text: str) -> str:
    """One answer's text in a form both readers take: `\\dfrac`/`\\tfrac` → `\\frac`, no `\\left`/`\\right`,
    `\\mathbf{7}` → `7`, `\\text{…}` units off, `{,}` / `\\,` / spaced thousands joined, `\\$` off, `\\%` → `%`,
    degrees off, `10^-5` → `10^{-5}`, `2^10` → `2^{10}`."""
    for old, new in _UNICODE.items():
        text = text.replace(old, new)
    text = _unwrap_whole(text.strip())
    text = _SIZING.sub("", text)
    text = re.sub(r"\\[dtc]frac(?![A-Za-z])", r"\\frac", text)
    text = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![A-Za-z])|\\circ(?![A-Za-z])|\\degree(?![A-Za-z])", "", text)
    text = text.replace("{,}", ",").replace("\\$", "").replace("\\%", "%")
    text = re.sub(r"(?<!\\)\\[,;:! ]|\\q?quad(?![A-Za-z])|~", " ", text)  # not the "\\" of a new row
    unit = _TEXT_UNIT.search(text)
    if unit and unit.start() > 0 and (unit.group(1) in _ONE_LETTER_UNITS or _are_units(unit.group(1))):
        text = text[: unit.start()]
    whole_text = _WORD_ANSWER.fullmatch(text.strip())  # "\text{even}": a word answer, kept for math-verify
    while not whole_text:
        unwrapped = _STYLE.sub(r"\1", text)
        if unwrapped == text:
            break
        text = unwrapped
    text = re.sub(r"\s+", " ", text).strip()
    text = _THOUSANDS_SPACED.sub(lambda m: m.group().replace(" ", ""), text)
    text = re.sub(r"\^\s*(-?\d{2,}|-\d)", r"^{\1}", text)
    return re.sub(r"(\d) x (\d)", r"\1 \\times \2", text)


@dataclass(frozen=True)
class _Value:
    """One answer, read. `number`: a plain number, exact; `expr`: a sympy object from the LaTeX parser."""

    number: Fraction | None = None
    percent: bool = False  # written with %: it may be read as n or n/100
    decimals: int | None = None  # a decimal's digits after the point as written ("0.3333" → 4)
    significant: int = 0  # its significant digits as written
    expr: object = None


def _plain_number(text: str) -> _Value | None:
    m = _PLAIN_FRACTION.fullmatch(text)
    if m and int(m["den"]) != 0 and (m["whole"] is None or int(m["num"]) < int(m["den"])) \
            and (not m["unit"].strip() or _are_units(m["unit"])):
        number = int(m["whole"] or 0) + Fraction(int(m["num"]), int(m["den"]))  # "3/4", mixed "1 1/2"
        return _Value(number=-number if m["sign"] else number)
    m = _PLAIN_NUMBER.fullmatch(text)
    if m is None or (m["int"] is None and m["frac"] is None) or (m["sign"] and m["sign2"]):
        return None
    if m["unit"].strip() and not _are_units(m["unit"]):
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
    return _Value(number=number, percent=m["pct"] is not None, decimals=decimals, significant=significant or 0)


@functools.lru_cache(maxsize=16384)
def _read_value(piece: str | None, inner: bool = False) -> _Value | None:
    """`piece` read as one value, or None when it is not exactly one. Prose with exactly one number or
    maths span in it ("The answer is 18.") reads as that, unless a word in it changes or hedges it."""
    if piece is None:
        return None
    text = _normalise(piece)
    text = _ANSWER_PREFIX.sub("", text, count=1).strip().rstrip(".,;:").strip()  # not "!": 5! is 120
    if not text or len(text) > _MAX_LATEX:
        return None
    value = _plain_number(text)
    if value is not None:
        return value
    tail = _UNIT_TAIL.fullmatch(text)
    if tail and _are_units(tail["tail"]):
        text = tail["head"].strip()
    if _has_prose(text) and not _WORD_ANSWER.fullmatch(text):
        if inner or any(w in _NOT_UNITS for w in _words(text)):
            return None
        spans = _value_spans(text)
        return _read_value(spans[0], True) if len(spans) == 1 else None
    if _SPACED_DIGITS.search(text):
        return None
    expr = _parse_latex(text.replace("$", ""))
    return None if expr is None or _too_large(expr) else _Value(expr=expr)


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


# ------------------------------------------------------------------------------ comparing two values

def _relations(expr) -> list:
    """The relations of `expr` in written order: [expr] for one, the chain for `a = b = c`, else []."""
    import sympy

    if isinstance(expr, sympy.core.relational.Relational):
        return [expr]
    if isinstance(expr, sympy.And):
        parts = list(getattr(expr, "_unsorted_args", expr.args))
        if parts and all(isinstance(p, sympy.core.relational.Relational) for p in parts):
            return parts
    return []


def _as_answer(expr, other):
    """`x = 5` (or `x = 2 + 3 = 5`) answers with its last right-hand side when `other` is no equation,
    math-verify's rule, applied before we compare numbers ourselves. A link between two numbers must
    hold: `9 * 2 = 18` answers 18, `18 = 19` answers nothing (None)."""
    import sympy

    chain = _relations(expr)
    if chain and all(isinstance(r, sympy.Eq) for r in chain) and not _relations(other):
        for relation in chain:
            lhs, rhs = _as_number(relation.lhs), _as_number(relation.rhs)
            if lhs is not None and rhs is not None and not _numbers_equal(lhs, rhs):
                return None
        return chain[-1].rhs
    return expr


def _as_number(expr):
    """A sympy number (finite or ±∞) from `expr`, or None when it is not one."""
    import sympy

    if isinstance(expr, Fraction):
        return sympy.Rational(expr.numerator, expr.denominator)
    if isinstance(expr, sympy.Expr) and not isinstance(expr, sympy.MatrixBase) and expr.is_number:
        if expr.has(sympy.zoo, sympy.nan):
            return None
        return expr
    return None


def _numbers_equal(a, b) -> bool:
    import sympy

    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a == b
    a, b = _as_number(a), _as_number(b)
    if a is None or b is None:
        return False
    if a.is_infinite or b.is_infinite:
        return a == b
    if a.is_Rational and b.is_Rational:
        return a == b
    tolerance = 1e-12 if (a.has(sympy.Float) or b.has(sympy.Float)) else 1e-25
    try:
        difference = abs((a - b).evalf(40))
        scale = max(abs(a.evalf(40)), abs(b.evalf(40)))
        return bool(difference == 0 or difference <= tolerance * scale)
    except (TypeError, ValueError, ArithmeticError):
        return False


def _terminates(x) -> bool:
    """Whether `x` is a terminating decimal (so a decimal answer must equal it exactly)."""
    import sympy

    if isinstance(x, Fraction):
        x = sympy.Rational(x.numerator, x.denominator)
    if isinstance(x, sympy.Float) or x.is_infinite:
        return True
    if not x.is_Rational:
        return False
    q = int(x.q)
    for p in (2, 5):
        while q % p == 0:
            q //= p
    return q == 1


def _approximates(decimal: _Value, exact) -> bool:
    """A decimal written to ≥ 6 significant digits stands for a non-terminating exact value (1/3,
    √2, π) that it matches to its last written digit: 0.333333 for 1/3, 1.414214 for √2; 0.33 does not."""
    if decimal.decimals is None or decimal.significant < 6 or decimal.percent:
        return False
    exact = _as_number(exact)
    if exact is None or _terminates(exact):
        return False
    try:
        return bool(abs((exact - _as_number(decimal.number)).evalf(40)) < Fraction(1, 10 ** max(decimal.decimals, 0)))
    except (TypeError, ValueError, ArithmeticError):
        return False


def _is_proportion(x) -> bool:
    """A value that "n%" may stand for as n/100: a fraction, or a whole number no larger than 1 in size."""
    x = _as_number(x)
    return x is not None and x.is_finite and (not x.is_integer or abs(x) <= 1)


def _numeric_match(gold: _Value, gold_number, pred: _Value, pred_number) -> bool:
    """Two numbers. One written with % may be read as n, or as n/100 where the other is a proportion:
    "50%" answers 50 and 0.5, "150%" answers 1.5; "1800%" does not answer 18."""
    golds = [gold_number] + ([gold_number / 100] if gold.percent and not pred.percent
                             and _is_proportion(pred_number) else [])
    preds = [pred_number] + ([pred_number / 100] if pred.percent and not gold.percent
                             and _is_proportion(gold_number) else [])
    if any(_numbers_equal(g, p) for g in golds for p in preds):
        return True
    return _approximates(pred, gold_number) or _approximates(gold, pred_number)


def _same_value(gold: _Value, pred: _Value) -> bool:
    if gold.number is not None and pred.number is not None:  # the fast path: two plain numbers, exact
        return _numeric_match(gold, gold.number, pred, pred.number)
    from math_verify import verify

    g = gold.number if gold.number is not None else gold.expr
    p = pred.number if pred.number is not None else pred.expr
    if gold.expr is not None:
        g = _as_answer(gold.expr, p)
    if pred.expr is not None:
        p = _as_answer(pred.expr, g)
    if g is None or p is None:  # an equation between two different numbers
        return False
    g_number = g if isinstance(g, Fraction) else _as_number(g)
    p_number = p if isinstance(p, Fraction) else _as_number(p)
    if g_number is not None and p_number is not None:
        return _numeric_match(gold, g_number, pred, p_number)
    g, p = (_as_number(x) if isinstance(x, Fraction) else x for x in (g, p))
    return bool(verify([g], [p], timeout_seconds=None))


# ------------------------------------------------------------------------------- one answer, graded

@functools.lru_cache(maxsize=4096)
def _gold_value(solution: str) -> _Value | None:
    """The dataset's answer, read like a completion's: a bare `72` or `\\frac{1}{2}`, a `$…$`, a box in a
    worked solution, a `#### 72` line."""
    return _read_value(extract_answer(solution))


def score_accuracy(completion, solution) -> float | None:
    """One sample of `accuracy_reward`: 1.0 / 0.0, or None when the gold `solution` has no readable answer."""
    gold = _gold_value(str(solution))
    if gold is None:
        return None
    pred = _read_value(extract_answer(completion))
    if pred is None:
        return 0.0
    return 1.0 if _same_value(gold, pred) else 0.0


def canonical_answer(text) -> str | None:
    """A normal form of a completion's answer for majority voting: numbers as plain decimals
    (`18.00`, `$18`, `18` → "18"; `\\frac{1}{2}` → "0.5"; `x = 5` → "5"), other expressions as sympy
    prints them; None when no answer can be read."""
    value = _read_value(extract_answer(text))
    if value is None:
        return None
    number = value.number
    if number is None:
        expr = _as_answer(value.expr, None)
        if expr is None:
            return None
        number = _as_number(expr)
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
