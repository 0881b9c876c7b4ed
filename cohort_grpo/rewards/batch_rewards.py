"""The rewards of a step's batch: scored by the run's reward runner, DAPO's overlong penalty added, and the learned
reward models' step of training on the same completions (Algorithm 1's last line).

`batch` is the rollout's `Batch` (cohort_grpo/rollout/records.py), read and written by its fields: prompts,
completions, `completion_token_ids()`, dataset columns, and the rewards, per-function scores and reward metrics.
"""

from __future__ import annotations

from cohort_grpo.algorithm.advantages import overlong_penalty


def add_rewards(rewards, batch, args, trainer_state=None) -> None:
    """`batch`'s rewards, per-function scores and metrics from `rewards` (a `RewardRunner`, which hands the reward
    functions `trainer_state`, as TRL does); with `args.overlong_buffer_length`, DAPO's soft overlong punishment
    added to the rewards."""
    out = rewards(batch.prompts, batch.completions, batch.completion_token_ids(), batch.columns,
                  trainer_state=trainer_state)
    batch.rewards, batch.per_function, batch.reward_metrics = out.rewards, out.per_function, out.metrics
    batch.reward_extras = [{column: values[i] for column, values in out.extras.items()}
                           for i in range(len(batch.rows))] if out.extras else None
    if args.overlong_buffer_length:  # DAPO soft overlong punishment, part of the reward
        penalty = overlong_penalty(batch.rollout.completion_mask.sum(dim=1), args.max_completion_length,
                                   args.overlong_buffer_length, args.overlong_penalty_factor)
        batch.rewards = batch.rewards + penalty.to(batch.rewards.dtype)
        batch.reward_metrics = {**batch.reward_metrics, "rewards/overlong_penalty": float(penalty.mean())}


def learned_reward_models(reward_funcs: list) -> list:
    """The reward functions that train during the run (those with `on_step_end`: `RewardModelReward`)."""
    return [f for f in reward_funcs if hasattr(f, "on_step_end")]


def train_reward_models(reward_funcs: list, batch, group_size: int, step: int) -> None:
    """Each learned reward model trains on `batch`'s samples with replay; its metrics join
    `batch.reward_metrics` (under `<function>/` where a name is taken already)."""
    ids, columns = batch.completion_token_ids(), batch.columns
    for func in learned_reward_models(reward_funcs):
        metrics = func.on_step_end(batch.prompts, batch.completions, ids, group_size=group_size, step=step, **columns)
        for key, value in metrics.items():
            batch.reward_metrics[key if key not in batch.reward_metrics else f"{func.__name__}/{key}"] = value
