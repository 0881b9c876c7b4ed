"""DAPO's dynamic sampling: keep only groups that carry a learning signal, and sample more to refill.

A group whose G rewards are all equal has zero group-relative advantage, so it contributes no
policy gradient and only dilutes the batch. DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", §3.2 and Algorithm 1) drops such groups and keeps
sampling prompts until the batch holds `prompts_per_step` informative groups. We bound the
number of extra sampling rounds; when they run out we train on the informative groups we have.

The kept groups of the rounds are joined by `Batch.concatenate` (every per-row field; completions right-padded to
one width; the reward metrics averaged over the rounds).
"""

from __future__ import annotations

from typing import Callable

import torch

from cohort_grpo.rollout.batch import Batch, select_groups


def informative_groups(rewards: torch.Tensor, group_size: int, scored: torch.Tensor | None = None) -> torch.Tensor:
    """`[num_groups]` bool: True where the group's scored rewards are not all equal (max > min).
    `scored` ([B] bool) leaves out completions no reward function scored (their advantage is 0)."""
    grouped = rewards.view(-1, group_size)
    if scored is None:
        return grouped.max(dim=1).values > grouped.min(dim=1).values
    kept = scored.view(-1, group_size)
    return grouped.masked_fill(~kept, -torch.inf).max(dim=1).values > grouped.masked_fill(~kept, torch.inf).min(dim=1).values


def scored_rows(batch) -> torch.Tensor | None:
    """[B] bool: the completions some reward function scored (None: every one)."""
    return None if batch.per_function is None else ~torch.isnan(batch.per_function).all(dim=1)


def fill_informative(first, sample_more: Callable[[], object], *, prompts_needed: int, group_size: int,
                     max_resample_tries: int, pad_id: int) -> tuple[object, dict[str, float]]:
    """Drop uninformative groups of `first`, calling `sample_more()` (a new scored batch) up to
    `max_resample_tries` times until `prompts_needed` informative groups are collected.

    Returns (batch, stats). The batch holds exactly `prompts_needed` informative groups when they
    were found; fewer when the tries ran out; and `first` unchanged when no group anywhere was
    informative (every advantage is zero then, so that step teaches nothing but stays well-formed).
    Stats: `dynamic_sampling/tries` (sampling rounds, 1 = no refill needed),
    `dynamic_sampling/dropped_groups` (uninformative groups thrown away), and
    `dynamic_sampling/informative_groups` (groups trained on).
    """
    kept, dropped, tries = [], 0, 0
    batch = first
    while True:
        tries += 1
        keep = informative_groups(batch.rewards, group_size, scored_rows(batch))
        dropped += int((~keep).sum())
        groups = keep.nonzero().flatten().tolist()
        if groups:
            kept.append(select_groups(batch, groups, group_size))
        have = sum(len(b.rows) for b in kept) // group_size
        if have >= prompts_needed or tries > max_resample_tries:
            break
        batch = sample_more()
    stats = {"dynamic_sampling/tries": float(tries), "dynamic_sampling/dropped_groups": float(dropped)}
    if not kept:
        stats["dynamic_sampling/informative_groups"] = 0.0
        return first, stats
    merged = Batch.concatenate(kept, pad_id)
    if have > prompts_needed:  # the last round overshot: keep the first prompts_needed groups
        merged = select_groups(merged, list(range(prompts_needed)), group_size)
    stats["dynamic_sampling/informative_groups"] = float(min(have, prompts_needed))
    return merged, stats


def refill_informative(batch, sample_more: Callable[[], object], args, pad_id: int):
    """`fill_informative` with the run's settings (`args`); its statistics join the batch's reward metrics."""
    batch, stats = fill_informative(batch, sample_more, prompts_needed=args.prompts_per_step,
                                    group_size=args.num_generations, max_resample_tries=args.max_resample_tries,
                                    pad_id=pad_id)
    batch.reward_metrics = {**(batch.reward_metrics or {}), **stats}
    return batch
