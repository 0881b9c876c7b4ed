"""How a rollout's rows are laid out for the passes over them (log π_old, log π_ref, the update): grouped by
identical prompt, so that a group's prompt is computed once for its G completions (the shared-prompt layout), or
one padded row each.

`Layout` is that decision, taken once for the run (`Layout.choose`), and what follows from it without tensors:
the units micro-batches are planned from and the plan itself (`plan`), the prompt tokens and attention pairs the
forwards compute (`computed_prompt_tokens`, `attention_pairs`: throughput and MFU), and the tokens a micro-batch of
so many completions reaches (`full_length_tokens`: memory sizing). Packing the planned rows into a forward's
tensors is cohort_grpo/update/packing.py's `pack`, which takes the `Layout`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor


def prompt_groups(prompt_ids: list, max_rows: int) -> list[list[int]]:
    """The rollout's rows grouped by identical prompt (first-seen order, rows in order), each group
    cut into runs of at most `max_rows` completions. A prompt is its token ids, or any sequence that
    tells prompts apart (`prompt_keys`: the ids and the prompt's images)."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for row, prompt in enumerate(prompt_ids):
        by_prompt.setdefault(tuple(prompt), []).append(row)
    return [rows[i: i + max_rows] for rows in by_prompt.values() for i in range(0, len(rows), max_rows)]


def prompt_keys(prompt_ids: list[list[int]], images: list | None = None) -> list:
    """What makes each row's prompt the same as another's: its token ids, and a vision-language row's images
    (one `ImageInputs` object per prompt, shared by its rows: two prompts of the same tokens may hold different
    images, and are then two prompts).

    >>> prompt_keys([[7, 8], [7, 8]], ["a", None])
    [('a', 7, 8), [7, 8]]
    """
    if images is None:
        return prompt_ids
    return [ids if row_images is None else (row_images, *ids) for ids, row_images in zip(prompt_ids, images)]


def plan_micro_batches(lengths: list[int], max_rows: int, max_tokens: int = 0,
                       sizes: list[int] | None = None) -> list[list[int]]:
    """Split units of `lengths` tokens (each holding `sizes` completions, default 1) into
    micro-batches of similar length: at most `max_rows` completions each and, when `max_tokens` > 0,
    at most `max_tokens` padded tokens (units × the longest unit) each.

    Units are taken longest first, so each micro-batch's padding is only the difference between
    neighbours in the sorted order. Deterministic (ties keep unit order). A single unit longer than
    `max_tokens` still gets a micro-batch of its own.

    >>> plan_micro_batches([5, 100, 6, 90], max_rows=2)
    [[1, 3], [2, 0]]
    """
    if max_rows < 1:
        raise ValueError(f"max_rows={max_rows}: a micro-batch needs at least one row")
    sizes = sizes or [1] * len(lengths)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plans: list[list[int]] = []
    current: list[int] = []
    rows = 0
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        too_many_tokens = max_tokens > 0 and (len(current) + 1) * longest > max_tokens
        if current and (rows + sizes[i] > max_rows or too_many_tokens):
            plans.append(current)
            current, rows = [], 0
        current.append(i)
        rows += sizes[i]
    if current:
        plans.append(current)
    return plans


def causal_pairs(length: int, window: int | None = None) -> int:
    """(query, key) pairs of causal attention over `length` tokens, each query seeing itself and at
    most `window` - 1 earlier keys (`window` None: all of them)."""
    if window is None or length <= window:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


@dataclass(frozen=True)
class Layout:
    """The layout of the passes over a run's rollouts. `shared`: each prompt once for its completions, which
    attend to it through index rows (cohort_grpo/models/shared_prefix.py); else one [prompt | completion | pad] row
    per completion. `group`: G, the completions of a prompt (a micro-batch's size in prompts follows from it)."""

    shared: bool = False
    group: int = 1

    @classmethod
    def choose(cls, share_prompt_prefix: bool, num_generations: int, takes_attention_rows: bool = True) -> "Layout":
        """The run's layout: shared where `share_prompt_prefix` asks for it, a prompt has several completions,
        and the model takes attention rows (our CausalLM: `update.logprobs.supports_hidden`; a memory plan, made
        before any model is loaded, plans for ours)."""
        return cls(shared=bool(share_prompt_prefix and num_generations > 1 and takes_attention_rows),
                   group=num_generations)

    def plan(self, prompt_ids: list[list[int]], completion_mask: Tensor, max_rows: int,
             max_tokens: int = 0, images: list | None = None) -> list[list[int]]:
        """`plan_micro_batches` over a rollout: rows as long as prompt + completion, or shared prompt groups as
        long as the prompt + their completions (the shared layout has no padding, but the budget stays a bound
        on rows × length, as in the other layout). Returns the rollout rows of each micro-batch (a group's rows
        stay together; `images`: each row's prompt images, which tell prompts apart as their tokens do)."""
        completion_lengths = completion_mask.sum(dim=1).tolist()
        if not self.shared:
            lengths = [len(p) + int(n) for p, n in zip(prompt_ids, completion_lengths)]
            return plan_micro_batches(lengths, max_rows, max_tokens)
        groups = prompt_groups(prompt_keys(prompt_ids, images), max_rows)
        lengths = [len(prompt_ids[g[0]]) + sum(int(completion_lengths[r]) for r in g) for g in groups]
        plans = plan_micro_batches(lengths, max_rows, max_tokens, sizes=[len(g) for g in groups])
        return [[row for unit in plan for row in groups[unit]] for plan in plans]

    def computed_prompt_tokens(self, prompt_ids: list[list[int]], max_rows: int, images: list | None = None) -> int:
        """Prompt tokens the forwards of `plan(..., max_rows)` compute: each prompt once per group run when
        shared, once per completion else."""
        if not self.shared:
            return sum(len(p) for p in prompt_ids)
        return sum(len(prompt_ids[group[0]]) for group in prompt_groups(prompt_keys(prompt_ids, images), max_rows))

    def attention_pairs(self, prompt_ids: list[list[int]], completion_lengths: list[int], max_rows: int,
                        window: int | None = None, images: list | None = None) -> int:
        """(query, key) pairs one attention layer computes over a rollout laid out as `plan` lays it out:
        [prompt | completion] per row, or when shared each prompt's queries once per group, then every
        completion's queries over the prompt and its own earlier tokens."""
        if not self.shared:
            return sum(causal_pairs(len(p) + n, window) for p, n in zip(prompt_ids, completion_lengths))
        total = 0
        for group in prompt_groups(prompt_keys(prompt_ids, images), max_rows):
            prompt = len(prompt_ids[group[0]])
            total += causal_pairs(prompt, window)
            total += sum(causal_pairs(prompt + completion_lengths[r], window) - causal_pairs(prompt, window)
                         for r in group)
        return total

    def unit_rows(self, rows: int) -> int:
        """Completions in the largest unit a micro-batch of `rows` cannot split: a prompt's G, or one row."""
        return min(self.group, rows) if self.shared else 1

    def full_length_tokens(self, rows: int, prompt_len: int, completion_len: int) -> int:
        """Tokens `rows` completions take at `prompt_len` + `completion_len` each: a prompt once per G of them when
        shared (a plan keeps a group's rows together), once per row else."""
        prompts = math.ceil(rows / min(self.group, rows)) if self.shared else rows
        return prompts * prompt_len + rows * completion_len


PADDED = Layout()  # one padded row per completion: any model can run it
