"""π_teacher, on-policy distillation's scorer: a frozen model whose log-probs of the student's sampled tokens add a
dense per-token term to the advantages (the maths: cohort_grpo/algorithm/distillation.py).

The teacher is scored as π_ref is (`ReferencePolicy`): one no-grad forward per micro-batch through the same
chunked LM-head log-prob path (`PolicyUpdate.logprobs`: no `[B, T, vocab]` logits, the memory manager's sizes and
out-of-memory retry), at the sampling temperature, in the teacher's own layout (the shared-prompt one where it
takes attention rows) and never with the policy's mixture-of-experts routes. Both log-probs are the trainer's own,
never the sampler's: log π_old is the π_old pass where the step computes one (μ > 1, a sequence-level sampler
correction), else a pass of π_θ before the update, which is π_old (after an asynchronous rollout: the policy the
update starts from, whose ratio to the sampler the sampler correction weighs).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from cohort_grpo.algorithm.distillation import distillation_advantages, reverse_kl_mean, with_token_advantages
from cohort_grpo.rollout.layout import Layout


class TeacherPolicy:
    """`model`: the teacher, frozen and in eval mode (cohort_grpo/run/teacher.py loads it); `policy`: π_θ;
    `logprobs(model, batch, layout)`: `PolicyUpdate.logprobs`; `layout`: how the teacher's passes lay the rollout
    out; `coef`, `discount`: `distillation_coef` and `distillation_discount`."""

    def __init__(self, model: nn.Module, policy: nn.Module, logprobs: Callable, layout: Layout, coef: float,
                 discount: float):
        self.model, self.policy, self.policy_logprobs, self.layout = model, policy, logprobs, layout
        self.coef, self.discount = coef, discount

    def __call__(self, batch) -> tuple[torch.Tensor, dict[str, float]]:
        """(`batch.advantages` with the distillation term added, `[B, T]`; the step's `distillation/*` metrics):
        `reverse_kl`, the mean per sampled token of log π_old − log π_teacher, and `teacher_logp`, the mean
        log π_teacher. Tool results are no sampled tokens: they get no term and count in neither mean."""
        student = batch.old_logp if batch.old_logp is not None else self.policy_logprobs(self.policy, batch)
        teacher = self.policy_logprobs(self.model, batch, self.layout)
        mask = batch.rollout.loss_mask
        term = distillation_advantages(student, teacher, mask, self.coef, self.discount)
        weight = mask.to(teacher.dtype)
        metrics = {"distillation/reverse_kl": float(reverse_kl_mean(student, teacher, mask)),
                   "distillation/teacher_logp": float((teacher * weight).sum() / weight.sum().clamp(min=1))}
        return with_token_advantages(batch.advantages, term), metrics
