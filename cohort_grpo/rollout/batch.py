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

from cohort_grpo.rollout.images import restored_images, restored_rows, stored_images, stored_rows
from cohort_grpo.rollout.records import COMPLETION, WHOLE, RowRecord, record_field
from cohort_grpo.rollout.sampler import Rollout


def mean_per_key(parts: list[dict | None]) -> dict:
    """Each key of the first part's metrics, averaged over the parts that have it (reward metrics describe
    everything sampled in a step: every round of dynamic sampling)."""
    metrics = {}
    for key in parts[0] or {}:
        values = [part[key] for part in parts if part and key in part]
        metrics[key] = sum(values) / len(values)
    return metrics


@dataclass
class Batch(RowRecord):
    """Every field but the two metrics is one value per row, declared with its layout (cohort_grpo/rollout/records.py):
    selecting and joining rows carry each of them; `state` keeps what sampling made (a rollout sampled ahead, in a
    checkpoint or a message between ranks), the environments excepted (live objects)."""

    # the dataset row of each completion (repeated G times); its images saved as PNG bytes
    rows: list[dict] = record_field(stored=(stored_rows, restored_rows))
    prompt_ids: list[list[int]] = record_field()  # [B] prompt token ids
    rollout: Rollout = record_field(record=Rollout)  # completion ids [B, T], mask [B, T], finish reasons
    completions: list = record_field()  # decoded completions (str, or chat messages for chat prompts)
    rewards: torch.Tensor | None = record_field(default=None, state=False)  # [B]
    # [B], or [B, T] per token (PPO's GAE)
    advantages: torch.Tensor | None = record_field(COMPLETION, default=None, state=False)
    old_logp: torch.Tensor | None = record_field(COMPLETION, default=None, state=False)  # [B, T] log π_old, when μ > 1
    ref_logp: torch.Tensor | None = record_field(COMPLETION, default=None, state=False)  # [B, T] log π_ref, when β > 0
    # [B, F] each reward function's score (NaN = not scored)
    per_function: torch.Tensor | None = record_field(default=None, state=False)
    reward_metrics: dict | None = record_field(WHOLE, default=None, state=False, merge=mean_per_key)
    # [B] the columns reward functions logged for each completion (TRL's log_extra): {column: value}; None if none
    reward_extras: list | None = record_field(default=None, state=False, absent=lambda part: [{}] * len(part.rows))
    # [B] each completion's environment (environment_factory), or None
    environments: list | None = record_field(default=None, state=False)
    # [B] each completion's prompt as the model saw it, where that is not the row's own (an environment's reset()
    # text appended); None when every one is its row's
    sampled_prompts: list | None = record_field(default=None, absent=lambda part: part.prompts)
    # a vision-language model's prompt images, one `ImageInputs` per row (shared by a prompt's G rows)
    images: list | None = record_field(default=None, stored=(stored_images, restored_images))
    # tools/* of a tool-calling rollout, async/* of one sampled ahead (joined: the first part's)
    rollout_metrics: dict | None = record_field(WHOLE, default=None)
    # distillation/* of a step with a teacher (cohort_grpo/update/teacher.py)
    teacher_metrics: dict | None = record_field(WHOLE, default=None, state=False, merge=mean_per_key)

    @property
    def prompts(self) -> list:
        """[B] each completion's prompt (a string or chat messages)."""
        return [r["prompt"] for r in self.rows]

    @property
    def columns(self) -> dict[str, list]:
        """The dataset's other columns, one list of B values each (reward functions take them as keywords); a
        column some rows lack is None there, as in a Hugging Face Dataset made from such rows."""
        names = dict.fromkeys(name for row in self.rows for name in row if name != "prompt")
        columns = {k: [r.get(k) for r in self.rows] for k in names}
        if self.environments is not None:  # TRL passes them to reward functions as `environments`
            columns["environments"] = self.environments
        return columns

    def completion_token_ids(self) -> list[list[int]]:
        """[B] each completion's own token ids (padding removed)."""
        return [ids[m.bool()].tolist() for ids, m in zip(self.rollout.completion_ids, self.rollout.completion_mask)]


def select_groups(batch: Batch, groups: list[int], group_size: int) -> Batch:
    """The batch restricted to the given group indices (each group's G rows, in order)."""
    return batch.select([g * group_size + i for g in groups for i in range(group_size)])


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
