"""The text of a completion, whichever form the trainer gives it in (a string, or chat messages), and the
tags of DeepSeek-R1's layout (`<think>…</think><answer>…</answer>`) that the rewards and the grader read."""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"


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
