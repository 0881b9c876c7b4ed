"""The sampler correction: importance weights π_trainer / π_sampler for samples drawn by a sampler
whose arithmetic is not the trainer's (bf16 kernels, another engine, an older policy), and TRL's
`sampling/*` metrics of how far apart the two are. Yao et al. 2025, "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training" (truncated importance sampling); TRL 1.16's masked and
sequence variants. `objectives.policy_loss` weighs its surrogate term by these weights.

Under top-k, top-p or min-p both log-probs are of the truncated, renormalised distribution each side's logits
give (the sampler's is the one it drew from; the trainer's π_old is cut the same way, rollout/sampling.py's
`kept_logits`), so a weight is the arithmetic or staleness gap and never the kept mass (docs/concepts.md,
"Truncated sampling").
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def sampler_log_ratio(trainer_logp: Tensor, sampling_logp: Tensor, mask: Tensor, correction: str) -> Tensor:
    """log(π_trainer / π_sampler) of the sampled tokens (both truncated alike when the sampling is): `[B, T]`
    for the token-level corrections, `[B, 1]` (summed over each completion) for the sequence-level ones; 0 off
    the mask."""
    diff = torch.nan_to_num((trainer_logp - sampling_logp) * mask.to(trainer_logp.dtype), nan=0.0)
    return diff.sum(dim=1, keepdim=True) if correction.startswith("sequence") else diff


@torch.no_grad()
def sampler_correction_weights(log_ratio: Tensor, correction: str, clip_min: float | None = None,
                               clip_max: float | None = 3.0) -> Tensor:
    """Importance weights π_trainer / π_sampler for samples drawn by a sampler whose arithmetic
    differs from the trainer's (bf16 kernels, another engine): `*_truncate` clamps them to
    [clip_min, clip_max] (truncated IS), `*_mask` sets those outside to 0 (the sample leaves the loss).

    Worked example, ratios [0.5, 1.2, 4.0], clip_max 3: token_truncate → [0.5, 1.2, 3.0];
    token_mask → [0.5, 1.2, 0.0]."""
    ratio = torch.exp(log_ratio)
    if correction.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@torch.no_grad()
def sampler_mismatch_stats(trainer_logp: Tensor, sampling_logp: Tensor, mask: Tensor, correction: str | None,
                           clip_min: float | None = None, clip_max: float | None = 3.0) -> dict[str, Tensor]:
    """TRL's `sampling/*` metrics: |log π_trainer − log π_sampler| over the completion tokens (mean, max),
    and the importance ratio the correction applies (its token or sequence values; the raw ratio
    exp(Σ Δ) per token when no correction is on): min, mean, max."""
    fmask = mask.to(trainer_logp.dtype)
    valid = fmask.bool() & ~torch.isnan(sampling_logp)
    diff = (trainer_logp - sampling_logp).abs()[valid]
    log_ratio = sampler_log_ratio(trainer_logp, sampling_logp, mask, correction or "token_truncate")
    ratio = torch.exp(log_ratio) if correction is None else sampler_correction_weights(log_ratio, correction,
                                                                                        clip_min, clip_max)
    ratio = ratio[valid] if ratio.shape == mask.shape else ratio.reshape(-1)[fmask.sum(dim=1) > 0]
    zero = torch.zeros((), device=trainer_logp.device)
    some = diff.numel() > 0
    return {"sampling/sampling_logp_difference/mean": diff.mean() if some else zero,
            "sampling/sampling_logp_difference/max": diff.max() if some else zero,
            "sampling/importance_sampling_ratio/min": ratio.min() if ratio.numel() else zero,
            "sampling/importance_sampling_ratio/mean": ratio.mean() if ratio.numel() else zero,
            "sampling/importance_sampling_ratio/max": ratio.max() if ratio.numel() else zero}
