"""Advantages: how much better each completion (or token) did than its baseline, and the reward shaping
that comes before them. Small pure functions, each tested against an independent float64 computation.

- GRPO's group-relative advantage: Shao et al. 2024, "DeepSeekMath", §4.1.2 (outcome supervision);
  Dr. GRPO's unscaled variant: Liu et al. 2025, "Understanding R1-Zero-Like Training".
- DAPO's soft overlong punishment: Yu et al. 2025, "DAPO", §3.4.
- GAE for PPO with a critic: Schulman et al. 2015, "High-Dimensional Continuous Control Using Generalized
  Advantage Estimation".
"""

from __future__ import annotations

import torch
from torch import Tensor

from cohort_grpo.algorithm.loss_spec import SCALE_CHOICES, ScaleRewards

__all__ = ["gae_advantages", "group_advantages", "overlong_penalty", "whiten"]


def group_advantages(rewards: Tensor, group_size: int, scale: ScaleRewards = "group", eps: float = 1e-4,
                     scored: Tensor | None = None) -> Tensor:
    """Group-relative advantage of each completion (DeepSeekMath §4.1.2, outcome supervision).

    `rewards` is `[B]`, group-contiguous: completions `i*G … i*G+G-1` answer the same prompt.
    Each reward is centred on its group's mean; `scale` picks the divisor:

    - ``"group"``: the group's standard deviation (Bessel-corrected, torch's default) + eps — GRPO;
    - ``"batch"``: the standard deviation of the whole batch + eps;
    - ``"none"``: no division — Dr. GRPO, which argues the std term biases towards easy/hard prompts.

    Worked example, G = 2, two prompts::

        rewards = [1., 0.,   1., 1.]
        means   = [0.5,      1.0]
        stds    = [0.7071,   0.0]         # std([1, 0]) with Bessel's correction
        group   → [0.7070, -0.7070, 0., 0.]   # (1 - 0.5) / (0.7071 + 1e-4)
        none    → [0.5, -0.5, 0., 0.]

    A group whose rewards are all equal gets zero advantage: it carries no learning signal.

    `scored` (`[B]` bool, None = every completion) marks the completions some reward function scored
    (TRL 1.16's semantics for a completion every function returned None for): an unscored one is left
    out of its group's mean and std, and of the batch's std, and gets advantage 0 — its reward is not
    a 0 that would drag the baseline down. A group with fewer than two scored completions gets 0
    everywhere. Worked example, G = 4, rewards [1, 1, 0, ·] with the last unscored: mean 2/3, std
    0.5774 over the three → [0.5773, 0.5773, −1.1545, 0].
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a length divisible by group_size={group_size}, got {tuple(rewards.shape)}")
    if scale not in SCALE_CHOICES:
        raise ValueError(f"scale must be one of {SCALE_CHOICES}, got {scale!r}")
    if scored is not None:
        if scored.shape != rewards.shape:
            raise ValueError(f"scored must be [B] like rewards {tuple(rewards.shape)}, got {tuple(scored.shape)}")
        if not bool(scored.all()):
            return _scored_group_advantages(rewards, scored.to(torch.bool), group_size, scale, eps)
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (rewards.std() + eps)
    return centred.reshape(-1)


def _scored_group_advantages(rewards: Tensor, scored: Tensor, group_size: int, scale: ScaleRewards,
                             eps: float) -> Tensor:
    """`group_advantages` over the scored completions only (some are not): masked means and
    Bessel-corrected stds, a std over fewer than two values taken as 0; unscored rows get 0."""
    weight = scored.to(rewards.dtype)
    kept = torch.where(scored, rewards, torch.zeros_like(rewards))  # an unscored value never enters a sum
    w, r = weight.view(-1, group_size), kept.view(-1, group_size)
    count = w.sum(dim=1, keepdim=True)
    centred = (r - r.sum(dim=1, keepdim=True) / count.clamp(min=1.0)) * w
    if scale == "group":
        std = (centred.square().sum(dim=1, keepdim=True) / (count - 1.0).clamp(min=1.0)).sqrt()
        centred = centred / (std + eps)
    elif scale == "batch":
        n = weight.sum()
        deviation = (kept - kept.sum() / n.clamp(min=1.0)) * weight
        std = (deviation.square().sum() / (n - 1.0).clamp(min=1.0)).sqrt()
        centred = centred / (std + eps)
    return centred.reshape(-1)


def overlong_penalty(lengths: Tensor, max_completion_length: int, buffer_length: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, §3.4 "Overlong Reward Shaping"), added to the reward.

    With L_max = `max_completion_length` and L_cache = `buffer_length`, for a completion of |y| tokens::

        0                                 if |y| ≤ L_max − L_cache
        ((L_max − L_cache) − |y|) / L_cache   if L_max − L_cache < |y| ≤ L_max
        −1                                if |y| > L_max

    times `factor`. Worked example, L_max = 8, L_cache = 2: |y| = 6 → 0, 7 → −0.5, 8 → −1, 9 → −1.
    """
    if buffer_length <= 0 or buffer_length > max_completion_length:
        raise ValueError(f"buffer_length must lie in [1, max_completion_length={max_completion_length}], got {buffer_length}")
    lengths = lengths.to(torch.float64)
    start = max_completion_length - buffer_length
    inside = (start - lengths) / buffer_length
    penalty = torch.where(lengths <= start, torch.zeros_like(lengths), inside)
    penalty = torch.where(lengths > max_completion_length, torch.full_like(lengths, -1.0), penalty)
    return penalty * factor


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2015, eq. 16) over each completion's tokens.

    `rewards`, `values`, `mask` are `[B, T]`; token t of row b is the action taken in state
    (prompt, y_<t) whose value is `values[b, t]`. Past the last masked token the value is 0 (the
    episode ended). Backwards over t::

        δ_t = r_t + γ V_{t+1} − V_t          A_t = δ_t + γ λ A_{t+1}          returns_t = A_t + V_t

    Masked positions get advantage and return 0. Worked example, one row, rewards [0, 1], values
    [0.5, 0.5], γ = λ = 1: δ = [0, 0.5], A = [0.5, 0.5], returns = [1, 1].
    """
    fmask = mask.to(values.dtype)
    rewards, values = rewards.to(values.dtype) * fmask, values * fmask
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        # A masked position (padding after EOS) passes nothing back: the episode is over there.
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = (delta + gamma * lam * next_advantage) * fmask[:, t]
        advantages[:, t] = advantage
        next_value, next_advantage = values[:, t], advantage
    return advantages, (advantages + values) * fmask


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x − mean) / std over the masked entries (PPO's advantage normalisation); masked-out stay 0."""
    fmask = mask.to(values.dtype)
    n = fmask.sum().clamp(min=1.0)
    mean = (values * fmask).sum() / n
    var = ((values - mean).square() * fmask).sum() / (n - 1).clamp(min=1.0)
    return (values - mean) / (var.sqrt() + eps) * fmask
