"""Finding a completion's final answer: `extract_answer` gives the text that holds it (an `<answer>`
block, the last box, a `####` line, a line of maths, or the last value in the text; the order is in its
docstring), or None when it gives none. Reading that text as one value is `answer_reading`'s step.

A last box cut off before its closing brace, or two values joined only by "or" ("$2$ or $3$"), give no
answer: a reward that pays a wrong answer teaches the policy to game it. Nothing here imports torch.
"""

from __future__ import annotations

import re

from cohort_grpo.rewards.answer_text import WORD_ANSWER, has_prose, located_values, normalise
from cohort_grpo.rewards.completions import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN, completion_text

_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")


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
    if whole and "\n" not in whole and len(whole) <= 120 and (not has_prose(normalise(whole))
                                                               or WORD_ANSWER.fullmatch(normalise(whole))):
        return whole
    spans = located_values(text)
    if len(spans) >= 2 and _HEDGE_GAP.fullmatch(text[spans[-2][1] : spans[-1][0]]):
        return None
    return spans[-1][2] if spans else None
