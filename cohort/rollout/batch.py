"""`Batch`: one step's data as it flows through Algorithm 1's stages.

The rollout makes it (rows, prompt ids, completions); the reward stage adds rewards; the log-prob
passes add log π_old and log π_ref; advantage estimation adds the advantages; the update reads it.
B = prompts × G completions, everything group-contiguous (prompt i → rows i*G … i*G+G-1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from cohort.rollout.sampler import Rollout


@dataclass
class Batch:
    rows: list[dict]  # the dataset row of each completion (repeated G times)
    prompt_ids: list[list[int]]  # [B] prompt token ids
    rollout: Rollout  # completion ids [B, T], mask [B, T], finish reasons
    completions: list  # decoded completions (str, or chat messages for chat prompts)
    rewards: torch.Tensor | None = None  # [B]
    advantages: torch.Tensor | None = None  # [B], or [B, T] per token (PPO's GAE)
    old_logp: torch.Tensor | None = None  # [B, T] log π_old, when μ > 1
    ref_logp: torch.Tensor | None = None  # [B, T] log π_ref, when β > 0
    per_function: torch.Tensor | None = None  # [B, F] each reward function's score (NaN = not scored)
    reward_metrics: dict | None = None
    environments: list | None = None  # [B] each completion's environment (environment_factory), or None
    rollout_metrics: dict | None = None  # tools/* of a tool-calling rollout, async/* of one sampled ahead

    @property
    def prompts(self) -> list:
        """[B] each completion's prompt (a string or chat messages)."""
        return [r["prompt"] for r in self.rows]

    @property
    def columns(self) -> dict[str, list]:
        """The dataset's other columns, one list of B values each (reward functions take them as keywords)."""
        columns = {k: [r[k] for r in self.rows] for k in self.rows[0] if k != "prompt"}
        if self.environments is not None:  # TRL passes them to reward functions as `environments`
            columns["environments"] = self.environments
        return columns

    def completion_token_ids(self) -> list[list[int]]:
        """[B] each completion's own token ids (padding removed)."""
        return [ids[m.bool()].tolist() for ids, m in zip(self.rollout.completion_ids, self.rollout.completion_mask)]


def select_groups(batch, groups: list[int], group_size: int):
    """The batch restricted to the given group indices (each group's G rows, in order)."""
    rows = [g * group_size + i for g in groups for i in range(group_size)]
    index = torch.tensor(rows, dtype=torch.long)

    def pick(x):
        if x is None:
            return None
        return x[index] if isinstance(x, torch.Tensor) else [x[r] for r in rows]

    rollout = batch.rollout
    return dataclasses.replace(
        batch, rows=pick(batch.rows), prompt_ids=pick(batch.prompt_ids), completions=pick(batch.completions),
        rewards=pick(batch.rewards), per_function=pick(batch.per_function), advantages=pick(batch.advantages),
        rollout=Rollout(pick(rollout.completion_ids), pick(rollout.completion_mask), pick(rollout.logprobs),
                        pick(rollout.finish_reasons), pick(rollout.tool_mask), pick(rollout.routed_experts)),
        environments=pick(batch.environments),
    )


def without_extra_padding(batch: Batch) -> Batch:
    """The batch with its completion tensors cut to its longest completion (a part of a larger rollout
    is then what sampling it alone gives)."""
    rollout = batch.rollout.trimmed()
    return batch if rollout is batch.rollout else dataclasses.replace(batch, rollout=rollout)


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """`tensor` on `device`; CPU → CUDA through pinned memory without a host sync."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
