"""How a rollout's rows are laid out for the passes over them: grouped by identical prompt, so that a group's
prompt is computed once for its G completions (the shared-prompt layout), or one padded row each."""

from __future__ import annotations


def prompt_groups(prompt_ids: list[list[int]], max_rows: int) -> list[list[int]]:
    """The rollout's rows grouped by identical prompt (first-seen order, rows in order), each group
    cut into runs of at most `max_rows` completions."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for row, prompt in enumerate(prompt_ids):
        by_prompt.setdefault(tuple(prompt), []).append(row)
    return [rows[i: i + max_rows] for rows in by_prompt.values() for i in range(0, len(rows), max_rows)]
