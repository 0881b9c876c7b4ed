"""On-policy distillation: a teacher's per-token log-probs of the student's own samples as a dense advantage.

The student samples; a frozen teacher scores every sampled token; each token's reward is the negative per-token
reverse KL estimate `−(log π_old(y_t) − log π_teacher(y_t))`, which is positive where the teacher likes the token
more than the student did. This is the recipe of Thinking Machines' "On-Policy Distillation" (Lu et al., 2025),
which also takes a discount of zero (each token is credited with its own term only) as the default. With no
reward functions and coefficient 1 it is pure on-policy distillation; beside a reward, the term is added to
GRPO's group-relative advantage of the completion (the same advantage on each of its tokens).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["distillation_advantages", "reverse_kl_mean", "with_token_advantages"]


def distillation_advantages(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor, coef: float,
                            discount: float = 0.0) -> Tensor:
    """Per-token distillation advantage `[B, T]`, 0 where `mask` is 0.

    `student_logp` (log π_old of each sampled token), `teacher_logp` (log π_teacher of the same token) and
    `mask` (1 on the tokens the student sampled: tool results and padding 0) are `[B, T]`. Each masked token's
    reward is ``r_t = −coef · (student_logp_t − teacher_logp_t)``; the advantage is its discounted sum to go
    over the completion's later sampled tokens, ``A_t = r_t + γ · A_next``, where `next` is the next token the
    student sampled (a tool result in between is no action and does not count as a step of the discount).
    γ = `discount` = 0 gives each token its own term, as the recipe does.

    Worked example, one row, coef = 1, student [-1, -2, -0.5], teacher [-0.5, -3, -0.5], mask [1, 1, 1]::

        r           = [0.5, -1.0, 0.0]
        γ = 0   → A = [0.5, -1.0, 0.0]
        γ = 0.5 → A = [0.5 + 0.5·(-1.0 + 0.5·0), -1.0, 0.0] = [0.0, -1.0, 0.0]

    With mask [1, 0, 1] (the middle token a tool result) and γ = 0.5: A = [0.5 + 0.5·0, 0, 0] = [0.5, 0, 0].
    """
    if not student_logp.shape == teacher_logp.shape == mask.shape:
        raise ValueError(f"student_logp, teacher_logp and mask must have one shape, got {tuple(student_logp.shape)}, "
                         f"{tuple(teacher_logp.shape)} and {tuple(mask.shape)}")
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must lie in [0, 1], got {discount}")
    keep = mask.to(torch.bool)
    reward = torch.where(keep, -coef * (student_logp - teacher_logp), torch.zeros_like(student_logp))
    if discount == 0.0:
        return reward
    advantages = torch.zeros_like(reward)
    carry = torch.zeros_like(reward[:, 0])
    for t in range(reward.shape[1] - 1, -1, -1):  # a masked-out position passes the carry on unchanged
        carry = torch.where(keep[:, t], reward[:, t] + discount * carry, carry)
        advantages[:, t] = torch.where(keep[:, t], carry, torch.zeros_like(carry))
    return advantages


def reverse_kl_mean(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """The mean over masked tokens of `student_logp − teacher_logp`: the per-token Monte-Carlo estimate of
    KL(π_old ‖ π_teacher) on the student's own samples (0 when the mask is empty). Worked example: student
    [-1, -2], teacher [-0.5, -3], mask [1, 1] → ((-0.5) + 1.0) / 2 = 0.25."""
    weight = mask.to(student_logp.dtype)
    return ((student_logp - teacher_logp) * weight).sum() / weight.sum().clamp(min=1)


def with_token_advantages(advantages: Tensor, token_advantages: Tensor) -> Tensor:
    """`advantages` (`[B]`, one per completion, or `[B, T]`) plus the per-token `token_advantages` `[B, T]`:
    a completion's advantage stands on each of its tokens, then each token's own term is added. Worked
    example: [1., -1.] + [[0.5, 0.], [0., 0.25]] → [[1.5, 1.], [-1., -0.75]]."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    return advantages.to(token_advantages.dtype) + token_advantages
