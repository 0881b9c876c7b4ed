"""DAPO's dynamic sampling: keep only groups that carry a learning signal, and sample more to refill.

A group whose G rewards are all equal has zero group-relative advantage, so it contributes no
policy gradient and only dilutes the batch. DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", §3.2 and Algorithm 1) drops such groups and keeps
sampling prompts until the batch holds `prompts_per_step` informative groups. We bound the
number of extra sampling rounds; when they run out we train on the informative groups we have.

Works on any dataclass batch with the trainer's `Batch` fields, without importing the trainer.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from cohort.models.moe import stack_routes
from cohort.rollout.batch import select_groups
from cohort.rollout.sampler import Rollout


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


def concat_batches(batches: list, pad_id: int):
    """One batch from several (scored, before advantages); completions are right-padded to one width."""
    if len(batches) == 1:
        return batches[0]
    width = max(b.rollout.completion_ids.shape[1] for b in batches)

    def pad(x, value):
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    rollouts = [b.rollout for b in batches]
    logprobs = None
    if all(r.logprobs is not None for r in rollouts):
        logprobs = torch.cat([pad(r.logprobs, 0.0) for r in rollouts])
    tool_mask = None
    if any(r.tool_mask is not None for r in rollouts):
        tool_mask = torch.cat([pad(r.tool_mask if r.tool_mask is not None else torch.ones_like(r.completion_mask), 0)
                               for r in rollouts])
    # Reward metrics describe everything sampled this step: average them over the rounds.
    metrics = {}
    for key in batches[0].reward_metrics or {}:
        values = [b.reward_metrics[key] for b in batches if b.reward_metrics and key in b.reward_metrics]
        metrics[key] = sum(values) / len(values)
    return dataclasses.replace(
        batches[0],
        rows=[r for b in batches for r in b.rows],
        prompt_ids=[p for b in batches for p in b.prompt_ids],
        completions=[c for b in batches for c in b.completions],
        rewards=torch.cat([b.rewards for b in batches]),
        per_function=torch.cat([b.per_function for b in batches]) if batches[0].per_function is not None else None,
        rollout=Rollout(torch.cat([pad(r.completion_ids, pad_id) for r in rollouts]),
                        torch.cat([pad(r.completion_mask, 0) for r in rollouts]), logprobs,
                        [f for r in rollouts for f in r.finish_reasons], tool_mask,
                        stack_routes([row for r in rollouts for row in (
                            r.routed_experts if r.routed_experts is not None else [None])])),
        reward_metrics=metrics,
        environments=None if batches[0].environments is None else [e for b in batches for e in b.environments],
    )


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
    merged = concat_batches(kept, pad_id)
    if have > prompts_needed:  # the last round overshot: keep the first prompts_needed groups
        merged = select_groups(merged, list(range(prompts_needed)), group_size)
    stats["dynamic_sampling/informative_groups"] = float(min(have, prompts_needed))
    return merged, stats
