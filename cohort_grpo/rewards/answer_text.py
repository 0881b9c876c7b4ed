"""The rules that finding an answer (`answer_extraction`) and reading it as one value (`answer_reading`)
share: an answer's text in normal form (`normalise`), which words are prose and which are units
(`has_prose`, `are_units`), and where the values in running text are (`located_values`: the maths spans
and the bare numbers outside them). A change here is checked against both by tests/test_grading.py.
Nothing here imports torch: the per-sample scoring worker imports this module.
"""

from __future__ import annotations

import re

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


def located_values(text: str) -> list[tuple[int, int, str]]:
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


# Words that may follow a number as its unit only when they do not change or hedge its value.
NOT_UNITS = frozenset("""
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
_THOUSANDS_SPACED = re.compile(r"(?<![\d.,])\d{1,3}(?: \d{3})+(?![\d,])")
_UNICODE = {"−": "-", "–": "-", "×": r"\times ", "÷": r"\div ", "·": r"\cdot ", "π": r"\pi ",
            "∞": r"\infty ", "√": r"\sqrt", "°": r"^\circ", "\u00a0": " ", "\u2009": " ", "\u202f": " "}
WORD_ANSWER = re.compile(r"\\text\s*\{[^{}\d]*\}")  # "\text{even}", "\text{(B)}"


def words_in(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def has_prose(text: str) -> bool:
    return any(w not in _MATH_WORDS for w in words_in(text))


def are_units(text: str) -> bool:
    words = words_in(text)
    return bool(words) and not any(w in NOT_UNITS or w in _MATH_WORDS for w in words)


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


def normalise(text: str) -> str:
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
    if unit and unit.start() > 0 and (unit.group(1) in _ONE_LETTER_UNITS or are_units(unit.group(1))):
        text = text[: unit.start()]
    whole_text = WORD_ANSWER.fullmatch(text.strip())  # "\text{even}": a word answer, kept for math-verify
    while not whole_text:
        unwrapped = _STYLE.sub(r"\1", text)
        if unwrapped == text:
            break
        text = unwrapped
    text = re.sub(r"\s+", " ", text).strip()
    text = _THOUSANDS_SPACED.sub(lambda m: m.group().replace(" ", ""), text)
    text = re.sub(r"\^\s*(-?\d{2,}|-\d)", r"^{\1}", text)
    return re.sub(r"(\d) x (\d)", r"\1 \\times \2", text)
