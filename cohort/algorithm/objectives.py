"""The mathematics of GRPO as small pure functions.

Everything here is a function of tensors with no hidden state, so each can be tested against an
independent float64 computation. Sources:

- GRPO: Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
  Language Models", §4.1 and Algorithm 1.
- Clipped surrogate: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7.
- k1/k2/k3 KL estimators: J. Schulman, "Approximating KL Divergence" (2020, blog note).
- Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective".
- DAPO: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale".
- GSPO: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv 2507.18071).
- Sampler/trainer mismatch: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training" (truncated importance sampling); TRL 1.16's masked and sequence variants.
- Two-sided clipping (`delta`): INTELLECT-2 (Prime Intellect 2025); the importance-weighted KL
  (`use_bias_correction_kl`): DeepSeek-V3.2 (2025), §2.1.
- GAE: Schulman et al. 2015, "High-Dimensional Continuous Control Using Generalized Advantage
  Estimation"; clipped value loss as in OpenAI baselines' PPO2 / Ziegler et al. 2019.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, Protocol

import torch
from torch import Tensor

from ..choices import CHOICES

ScaleRewards = Literal["group", "batch", "none"]
KLEstimator = Literal["k1", "k2", "k3"]
LossType = Literal["grpo", "bnpo", "dapo", "dr_grpo"]

# The option values come from the one table of them (cohort/choices.py); the Literals above name them for
# type checkers only.
SCALE_CHOICES = CHOICES["scale_rewards"]
KL_CHOICES = ("k1", "k2", "k3")
LOSS_TYPES = CHOICES["loss_type"]
IMPORTANCE_LEVELS = CHOICES["importance_sampling_level"]
SAMPLER_CORRECTIONS = CHOICES["importance_sampling_mode"]


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


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from samples of π_θ (Schulman 2020).

    With log-ratio r = ref_logp − logp:

    - k1 = −r = logp − ref_logp   (unbiased, can be negative)
    - k2 = ½ r²                   (biased, low variance)
    - k3 = exp(r) − r − 1         (unbiased, always ≥ 0; the one DeepSeekMath eq. 4 uses)

    Worked example: logp = log 0.5, ref_logp = log 0.25 → r = −0.693;
    k1 = 0.693, k2 = 0.240, k3 = 0.5 + 0.693 − 1 = 0.193.
    """
    log_ratio = ref_logp - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"estimator must be one of {KL_CHOICES}, got {estimator!r}")


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    loss_type: LossType = "grpo",
    max_completion_length: int | None = None,
    num_tokens: float | None = None,
) -> Tensor:
    """Reduce a `[B, T]` per-token loss to a scalar: every length-normalisation choice lives here.

    - ``"grpo"`` (DeepSeekMath eq. 3): mean over each completion's own tokens, then mean over
      completions — a token of a short completion weighs more than one of a long completion.
    - ``"bnpo"`` / ``"dapo"`` (DAPO §3.3, token-level): sum over all tokens ÷ number of tokens, so every
      token weighs the same. `num_tokens` overrides the divisor (DAPO divides by the token count
      of the whole accumulated batch, not of one micro-batch).
    - ``"dr_grpo"`` (Dr. GRPO §3.1): sum over all tokens ÷ (B × max_completion_length), a constant,
      so no length bias at all.

    Worked example, B = 2, mask rows of length 1 and 3, every token's loss = its row index + 1::

        grpo    → (1/1 + 6/3) / 2 = 1.5
        dapo    → (1 + 6) / 4   = 1.75
        dr_grpo → (1 + 6) / (2 × 4) = 0.875   # max_completion_length = 4
    """
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if loss_type == "grpo":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo"):
        divisor = num_tokens if num_tokens is not None else mask.sum().clamp(min=1.0)
        return masked.sum() / divisor
    if loss_type == "dr_grpo":
        length = max_completion_length if max_completion_length is not None else per_token.shape[1]
        return masked.sum() / (per_token.shape[0] * length)
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


@dataclass
class PolicyLossStats:
    """Diagnostics of one `policy_loss` call, each averaged over completion tokens. 0-dim tensors
    on the loss's device, so a loop over micro-batches can sum them without waiting for the GPU."""

    kl: Tensor  # mean k3 KL to the reference (0 when no reference)
    clip_ratio_low: Tensor  # fraction of tokens with ρ < 1−ε and A < 0 (the clip is active)
    clip_ratio_high: Tensor  # fraction of tokens with ρ > 1+ε_high and A > 0
    clip_ratio: Tensor  # fraction of tokens where either clip is active

    def as_dict(self) -> dict[str, Tensor]:
        return {
            "kl": self.kl,
            "clip_ratio/low_mean": self.clip_ratio_low,
            "clip_ratio/high_mean": self.clip_ratio_high,
            "clip_ratio/region_mean": self.clip_ratio,
        }


@dataclass
class PolicyLossOutput:
    """What `policy_loss` returns. Unpacks as `loss, stats = policy_loss(...)` too."""

    loss: Tensor  # scalar, with gradient
    stats: dict[str, Tensor]  # PolicyLossStats.as_dict(): 0-dim tensors
    logp: Tensor  # [B, T] log π_θ, detached
    entropy: Tensor | None  # [B, T] entropy of π_θ, detached (when computed)

    def __iter__(self):
        return iter((self.loss, self.stats))


# ℓ_t for the tokens at (rows, cols) of the [B, T] layout, from their log π_θ and entropy.
TokenLoss = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


class FusedTokenLossHead(Protocol):
    """A source of log π_θ that evaluates Σ_t w_t ℓ_t(log π_t, H_t) as it computes log π, chunk by
    chunk, so the logits are never needed again for the gradient (cohort/update/fused_head.py).
    Returns (loss, log π [B, T], entropy [B, T]); only the loss carries a gradient."""

    def weighted_token_loss(self, token_loss: TokenLoss, weights: Tensor) -> tuple[Tensor, Tensor, Tensor]: ...


def policy_loss(
    logp: Tensor | FusedTokenLossHead,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    ref_logp: Tensor | None = None,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    loss_type: LossType = "grpo",
    max_completion_length: int | None = None,
    num_tokens: float | None = None,
    importance_sampling_level: str = "token",
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    delta: float | None = None,
    use_bias_correction_kl: bool = False,
    sampling_logp: Tensor | None = None,
    importance_sampling_correction: str | None = None,
    importance_sampling_clip_min: float | None = None,
    importance_sampling_clip_max: float | None = 3.0,
) -> PolicyLossOutput:
    """The GRPO objective (DeepSeekMath eq. 3), negated so that minimising it is ascent.

    Shapes: `logp`, `old_logp`, `ref_logp`, `mask`, `entropy` are `[B, T]`; `advantages` is `[B]`
    (one per completion, broadcast over its tokens) or `[B, T]` (one per token, as PPO's GAE gives).
    Per token::

        ρ = exp(logp − old_logp)
        loss = −[ min(ρ·A, clip(ρ, 1−ε, 1+ε_high)·A) − β · k3(logp, ref_logp) ]

    then reduced by `aggregate_loss(loss_type)`. ε_high=None means ε (symmetric clip); DAPO's
    "clip-higher" sets ε_high > ε. `old_logp=None` means π_old = π_θ (μ = 1, one update per
    rollout): ρ = 1 and only its gradient matters, ∇ρ = ∇logp, so the loss is the REINFORCE
    estimator with group baselines.

    Worked example, one token, A = 1, ε = 0.2: ρ = 1.5 → min(1.5, 1.2) = 1.2 → loss −1.2 (the
    clip is active; no gradient flows). ρ = 0.5 → min(0.5, 0.8) = 0.5 → loss −0.5.

    `importance_sampling_level="sequence"` replaces ρ by GSPO's sequence ratio
    (`sequence_log_ratio`); the clip then acts on whole completions. `entropy_coef` > 0 subtracts
    coef · entropy per token (an exploration bonus), reduced by the same aggregation. `delta`
    caps ρ in the unclipped term too (INTELLECT-2's two-sided clipping), and
    `use_bias_correction_kl` weighs each token's KL by ρ (DeepSeek-V3.2's unbiased estimator).

    `sampling_logp` ([B, T], the sampler's own log-probs) measures how far the sampler's arithmetic
    is from the trainer's (`stats["sampling/..."]`); with `importance_sampling_correction` (one of
    SAMPLER_CORRECTIONS) the surrogate term is weighted by `sampler_correction_weights` of the
    trainer's π_old against it (π_θ's own detached log-probs at μ = 1).

    `logp` is either the log-probs themselves (with their gradient) or a head that computes them
    (`FusedTokenLossHead`): since the token-level loss is Σ_t w_t ℓ_t with w = `token_weights`, such a
    head gets each token's gradient as soon as its log π exists and never recomputes the logits. The
    formula is the same either way: `per_token_policy_loss` weighted as `aggregate_loss` weighs it.
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    if importance_sampling_level not in IMPORTANCE_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_LEVELS}, got {importance_sampling_level!r}")
    options = dict(epsilon=epsilon, epsilon_high=eps_high, beta=beta, entropy_coef=entropy_coef, delta=delta,
                   use_bias_correction_kl=use_bias_correction_kl)
    correction = importance_sampling_correction if sampling_logp is not None else None
    if correction is not None and correction not in SAMPLER_CORRECTIONS:
        raise ValueError(f"importance_sampling_correction must be one of {SAMPLER_CORRECTIONS}, got {correction!r}")
    clip = (importance_sampling_clip_min, importance_sampling_clip_max)
    sequence_correction = correction is not None and correction.startswith("sequence")
    if isinstance(logp, Tensor):
        old = logp.detach() if old_logp is None else old_logp
        if importance_sampling_level == "token":
            log_ratio = logp - old
        else:
            log_ratio = sequence_log_ratio(logp, old, mask)
        adv = _per_token(advantages, logp)
        is_weight = None if correction is None else sampler_correction_weights(
            sampler_log_ratio(old, sampling_logp, mask, correction), correction, *clip)
        per_token = per_token_policy_loss(logp, log_ratio, adv.expand_as(logp), ref_logp=ref_logp, entropy=entropy,
                                          is_weight=is_weight, **options)
        loss = aggregate_loss(per_token, mask, loss_type, max_completion_length, num_tokens)
        logp, entropy = logp.detach(), None if entropy is None else entropy.detach()
        log_ratio = log_ratio.detach()
    else:
        if importance_sampling_level != "token":
            raise ValueError("GSPO's sequence ratio couples a completion's tokens: pass the log-probs themselves")
        if sequence_correction and old_logp is None:
            raise ValueError("a sequence-level sampler correction needs π_old's log-probs before the head runs: "
                             "pass old_logp")
        adv = _per_token(advantages, mask).float().expand(mask.shape)
        sequence_weight = None if not sequence_correction else sampler_correction_weights(
            sampler_log_ratio(old_logp, sampling_logp, mask, correction), correction, *clip).expand(mask.shape)

        def token_loss(token_logp: Tensor, token_entropy: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
            old_t = token_logp.detach() if old_logp is None else old_logp[rows, cols]
            ref_t = None if ref_logp is None else ref_logp[rows, cols]
            if correction is None:
                is_weight = None
            elif sequence_correction:
                is_weight = sequence_weight[rows, cols]
            else:  # token modes: element-wise in the token's own values
                is_weight = sampler_correction_weights(old_t - sampling_logp[rows, cols], correction, *clip)
            return per_token_policy_loss(token_logp, token_logp - old_t, adv[rows, cols], ref_logp=ref_t,
                                         entropy=token_entropy, is_weight=is_weight, **options)

        weights = token_weights(mask, loss_type, max_completion_length, num_tokens)
        loss, logp, entropy = logp.weighted_token_loss(token_loss, weights)
        log_ratio = torch.zeros_like(logp) if old_logp is None else logp - old_logp
    stats = policy_loss_stats(logp, log_ratio, _per_token(advantages, logp), mask, ref_logp, epsilon, eps_high)
    if sampling_logp is not None:
        stats.update(sampler_mismatch_stats(logp if old_logp is None else old_logp, sampling_logp, mask, correction,
                                            *clip))
    return PolicyLossOutput(loss, stats, logp, entropy)


def _per_token(advantages: Tensor, like: Tensor) -> Tensor:
    """[B] → [B, 1] (one advantage per completion, broadcast), [B, T] as is; in `like`'s float dtype."""
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    return adv.to(like.dtype) if like.is_floating_point() else adv


def token_weights(mask: Tensor, loss_type: LossType, max_completion_length: int | None = None,
                  num_tokens: float | None = None) -> Tensor:
    """[B, T] weight of each token's loss in `aggregate_loss`, float32.

    `aggregate_loss` is linear in the per-token losses, so its gradient with respect to them is the
    same at every point: these weights. Reading them off by autograd keeps every length
    normalisation in `aggregate_loss` alone. Worked example, "grpo", rows of 1 and 3 tokens:
    [[1/2, 0, 0], [1/6, 1/6, 1/6]] (each row's mean, then the mean over 2 rows)."""
    probe = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device, requires_grad=True)
    with torch.enable_grad():
        (weights,) = torch.autograd.grad(aggregate_loss(probe, mask, loss_type, max_completion_length, num_tokens),
                                         probe)
    return weights


def per_token_policy_loss(logp: Tensor, log_ratio: Tensor, advantages: Tensor, *, ref_logp: Tensor | None = None,
                          epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
                          entropy: Tensor | None = None, entropy_coef: float = 0.0, delta: float | None = None,
                          use_bias_correction_kl: bool = False, is_weight: Tensor | None = None) -> Tensor:
    """`policy_loss` before its length normalisation: the loss of each token, any shape (all
    arguments alike, `advantages` included). Element-wise in the token's own values, which is what
    lets a fused head take its gradient one chunk of tokens at a time.

    `is_weight` (no gradient) multiplies the surrogate term only, not the KL or the entropy bonus."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + eps_high) * advantages
    unclipped = (ratio if delta is None else torch.clamp(ratio, max=delta)) * advantages
    per_token = -torch.min(unclipped, clipped)
    if is_weight is not None:
        per_token = per_token * is_weight
    if ref_logp is not None and beta != 0.0:
        kl = kl_penalty(logp, ref_logp, "k3")
        per_token = per_token + beta * (kl * ratio if use_bias_correction_kl else kl)
    if entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("entropy_coef != 0 needs the per-token entropy (with its gradient)")
        per_token = per_token - entropy_coef * entropy
    return per_token


def sampler_log_ratio(trainer_logp: Tensor, sampling_logp: Tensor, mask: Tensor, correction: str) -> Tensor:
    """log(π_trainer / π_sampler) of the sampled tokens: `[B, T]` for the token-level corrections,
    `[B, 1]` (summed over each completion) for the sequence-level ones; 0 off the mask."""
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


@torch.no_grad()
def policy_loss_stats(logp: Tensor, log_ratio: Tensor, advantages: Tensor, mask: Tensor, ref_logp: Tensor | None,
                      epsilon: float, epsilon_high: float) -> dict[str, Tensor]:
    """`PolicyLossStats` of one micro-batch ([B, T] tensors; advantages [B, 1] or [B, T])."""
    ratio = torch.exp(log_ratio)
    fmask = mask.to(logp.dtype)
    n = fmask.sum().clamp(min=1.0)
    low = ((ratio < 1.0 - epsilon) & (advantages < 0)).to(logp.dtype)
    high = ((ratio > 1.0 + epsilon_high) & (advantages > 0)).to(logp.dtype)
    kl = kl_penalty(logp, ref_logp, "k3") if ref_logp is not None else None
    return PolicyLossStats(
        kl=(kl * fmask).sum() / n if kl is not None else torch.zeros((), device=logp.device),
        clip_ratio_low=(low * fmask).sum() / n,
        clip_ratio_high=(high * fmask).sum() / n,
        clip_ratio=((low + high).clamp(max=1.0) * fmask).sum() / n,
    ).as_dict()


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO's importance log-ratio, `[B, T]`, in the paper's stop-gradient token form (its "GSPO-token").

    The sequence ratio is the geometric mean of the token ratios over the completion's own tokens::

        log s_i = (1/|y_i|) Σ_t (logp_t − old_logp_t)

    and every token t of completion i gets ``log s_i,t = sg[log s_i] + logp_t − sg[logp_t]``. Its value
    equals log s_i on every token, and ∇ s_i,t = s_i · ∇logp_t, so with one advantage per completion and
    the per-completion mean ("grpo" aggregation) the gradient is s_i · A_i · mean_t ∇logp_t — exactly
    the gradient of GSPO's sequence-level objective s_i · A_i.

    Worked example: token log-ratios [0.1, 0.3, (padding)] → log s = 0.2 on both tokens.
    """
    fmask = mask.to(logp.dtype)
    token_log_ratio = (logp - old_logp) * fmask
    seq = token_log_ratio.sum(dim=1, keepdim=True) / fmask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return seq.detach() + logp - logp.detach()


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


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_range: float = 0.2) -> Tensor:
    """Clipped value loss, token mean: ½ · max((V − R)², (V_clip − R)²) with
    V_clip = V_old + clip(V − V_old, −c, c) (OpenAI baselines PPO2; Ziegler et al. 2019).

    Worked example: V_old = 0, V = 1, R = 1, c = 0.2 → V_clip = 0.2 → ½ · max(0, 0.64) = 0.32.
    """
    clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    per_token = 0.5 * torch.max((values - returns).square(), (clipped - returns).square())
    return aggregate_loss(per_token, mask, "dapo")
