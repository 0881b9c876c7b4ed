"""Evaluation by the run's own reward functions: what `trainer.evaluate()` does on `eval_dataset` where the rows'
task has no verifier (a TRL script's own `reward_funcs`), as TRL's GRPOTrainer evaluates.

Each held-out prompt gets its G completions sampled from the current policy as in training (the same
temperature and sampling settings, TRL's default `num_generations_eval`), the reward functions score them,
and the metrics are the training step's names for the same quantities with transformers' `eval_` prefix:
`eval_reward`, `eval_reward_std` (the mean of the groups' standard deviations), `eval_frac_reward_zero_std`,
`eval_rewards/<func>/mean` and `/std`, `eval_completions/mean_length`, `eval_completions/clipped_ratio`.
Several ranks each score their block of the prompts; the means are weighted by the completions each scored.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from cohort_grpo.rollout.batch import Batch

PREFIX = "eval_"


def sample_and_score(rows: list[dict], sample: Callable[[list[dict]], Batch], score: Callable[[Batch], None],
                     prompts_per_call: int, pad_id: int) -> Batch | None:
    """G completions of each row sampled `prompts_per_call` rows at a time, joined, then scored once (`score` sets
    the batch's rewards); None for no rows."""
    parts = [sample(rows[start:start + prompts_per_call]) for start in range(0, len(rows), max(prompts_per_call, 1))]
    if not parts:
        return None
    batch = Batch.concatenate(parts, pad_id=pad_id)
    score(batch)
    return batch


def reward_metrics(batch: Batch | None, group_size: int) -> dict[str, float]:
    """This rank's metrics of a scored batch, unprefixed (empty for None), with `completions` for the weighting."""
    if batch is None or not len(batch.rows):
        return {}
    grouped = batch.rewards.view(-1, group_size)
    scored = None if batch.per_function is None else ~torch.isnan(batch.per_function).all(dim=1)
    if scored is None or bool(scored.all()):
        group_std, reward = grouped.std(dim=1), float(batch.rewards.mean())
    else:  # completions no reward function scored are left out, as from training's record
        group_std = torch.stack([g[k].std() if int(k.sum()) > 1 else torch.zeros(())
                                 for g, k in zip(grouped, scored.view(-1, group_size))])
        reward = float(batch.rewards[scored].mean()) if bool(scored.any()) else 0.0
    lengths = batch.rollout.loss_mask.sum(dim=1).float()
    metrics = {key: value for key, value in (batch.reward_metrics or {}).items()
               if key.startswith("rewards/") and not key.endswith("/errors")}
    metrics.update({
        "reward": reward,
        "reward_std": float(group_std.mean()),
        "frac_reward_zero_std": float(torch.isclose(group_std, torch.zeros(())).float().mean()),
        "completions/mean_length": float(lengths.mean()),
        "completions/clipped_ratio": sum(r == "length" for r in batch.rollout.finish_reasons) / len(batch.rows),
    })
    return {**metrics, "completions": float(len(batch.rows))}


def combined_metrics(mine: dict[str, float], names: Sequence[str],
                     all_reduce_sums: Callable[[list[float]], list[float]]) -> dict[str, float]:
    """The metrics over every rank, `PREFIX`ed: each the mean of the ranks' values weighted by the completions each
    scored (`all_reduce_sums` sums a list over ranks; every rank calls it with the same `names`, in order)."""
    count = mine.get("completions", 0.0)
    sums = all_reduce_sums([count, *[count * mine.get(name, 0.0) for name in names]])
    total = sums[0]
    if total <= 0:
        return {}
    return {PREFIX + name: value / total for name, value in zip(names, sums[1:]) if not math.isnan(value)}


def metric_names(reward_names: Sequence[str]) -> list[str]:
    """The unprefixed names `reward_metrics` gives for these reward functions, in one order on every rank."""
    per_function = [f"rewards/{name}/{stat}" for name in reward_names for stat in ("mean", "std")]
    return [*per_function, "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
            "completions/clipped_ratio"]
