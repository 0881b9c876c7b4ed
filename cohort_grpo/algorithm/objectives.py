"""The mathematics of GRPO's loss as small pure functions (the advantages it weighs are in advantages.py).

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

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import Tensor

from cohort_grpo.algorithm.loss_spec import (IMPORTANCE_LEVELS, KL_CHOICES, LOSS_TYPES, SAMPLER_CORRECTIONS, SCALE_CHOICES, BatchShare,
                        KLEstimator, LossSpec, LossType, ScaleRewards)
from cohort_grpo.algorithm.sampler_correction import sampler_correction_weights, sampler_log_ratio, sampler_mismatch_stats

__all__ = ["IMPORTANCE_LEVELS", "KL_CHOICES", "LOSS_TYPES", "MICRO_BATCH_MEAN", "SAMPLER_CORRECTIONS",
           "SCALE_CHOICES", "BatchShare", "LossSpec", "aggregate_loss", "kl_penalty", "nonfinite_tokens",
           "per_token_policy_loss", "policy_loss", "policy_loss_stats", "sampler_correction_weights", "sampler_log_ratio", "sampler_mismatch_stats",
           "sequence_log_ratio", "token_weights", "value_loss"]

# `aggregate_loss`'s weighting of a loss that is already one micro-batch's mean (the router's load balancing)
MICRO_BATCH_MEAN = "micro_batch_mean"


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


def aggregate_loss(per_token: Tensor, mask: Tensor | None, loss_type: LossType | str = "grpo",
                   max_completion_length: int | None = None, share: BatchShare | None = None) -> Tensor:
    """Reduce a `[B, T]` per-token loss to a scalar: every normalisation of the loss lives here.

    - ``"grpo"`` (DeepSeekMath eq. 3): mean over each completion's own tokens, then mean over
      completions — a token of a short completion weighs more than one of a long completion.
    - ``"bnpo"`` / ``"dapo"`` (DAPO §3.3, token-level): sum over all tokens ÷ number of tokens, so every
      token weighs the same.
    - ``"dr_grpo"`` (Dr. GRPO §3.1): sum over all tokens ÷ (B × max_completion_length), a constant,
      so no length bias at all.
    - ``MICRO_BATCH_MEAN`` (not a `loss_type` option): `per_token` is a loss already averaged over one
      micro-batch's forward (0-dim, `mask` unused), such as a mixture of experts' load-balancing loss over
      its tokens; whatever the policy loss's type, it weighs as grpo's mean over completions does, by the
      micro-batch's share of the step's completions.

    `share` (None: these rows are the whole step) places a micro-batch in the optimizer step that
    accumulates it, so the sum of the micro-batches' losses over every rank is the step's loss:
    grpo, bnpo and dr_grpo weigh the micro-batch by its share of the step's completions; dapo divides
    by the step's token count instead of its own (TRL's ``num_items_in_batch``). Both are multiplied
    by the world size, because DDP averages the ranks' gradients while these divisors already count
    every rank's rows.

    Worked example, B = 2, mask rows of length 1 and 3, every token's loss = its row index + 1::

        grpo    → (1/1 + 6/3) / 2 = 1.5
        dapo    → (1 + 6) / 4   = 1.75
        dr_grpo → (1 + 6) / (2 × 4) = 0.875   # max_completion_length = 4

    and as one of two ranks' micro-batches of a step of 8 completions and 14 tokens: grpo → 1.5 × 2/8 × 2
    = 0.75, dapo → 7 / 14 × 2 = 1.0.
    """
    if loss_type == MICRO_BATCH_MEAN:
        return per_token if share is None else per_token * share.rows / share.step_rows * share.world_size
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if loss_type == "dapo" and share is not None:
        return masked.sum() / share.step_tokens * share.world_size
    if loss_type == "grpo":
        loss = (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()
    elif loss_type in ("bnpo", "dapo"):
        loss = masked.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        length = max_completion_length if max_completion_length is not None else per_token.shape[1]
        loss = masked.sum() / (per_token.shape[0] * length)
    else:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    return loss if share is None else loss * (share.rows / share.step_rows * share.world_size)


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

    loss: Tensor  # [] with gradient, normalised for the step when given a BatchShare
    stats: dict[str, Tensor]  # PolicyLossStats.as_dict() and sampling/*: [] tensors
    logp: Tensor  # [B, T] log π_θ, detached
    entropy: Tensor | None  # [B, T] entropy of π_θ, detached (when computed)
    nonfinite: Tensor | None = None  # [] loss tokens whose log-probs or importance ratio are NaN/inf

    def __iter__(self):
        return iter((self.loss, self.stats))


# ℓ_t for the tokens at (rows, cols) of the [B, T] layout, from their log π_θ and entropy.
TokenLoss = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


class FusedTokenLossHead(Protocol):
    """A source of log π_θ that evaluates Σ_t w_t ℓ_t(log π_t, H_t) as it computes log π, chunk by
    chunk, so the logits are never needed again for the gradient (cohort_grpo/update/fused_head.py).
    Returns (loss, log π [B, T], entropy [B, T]); only the loss carries a gradient."""

    def weighted_token_loss(self, token_loss: TokenLoss, weights: Tensor) -> tuple[Tensor, Tensor, Tensor]: ...


DEFAULT_SPEC = LossSpec()


def policy_loss(logp: Tensor | FusedTokenLossHead, old_logp: Tensor | None, advantages: Tensor, mask: Tensor,
                spec: LossSpec = DEFAULT_SPEC, *, ref_logp: Tensor | None = None, entropy: Tensor | None = None,
                sampling_logp: Tensor | None = None, share: BatchShare | None = None) -> PolicyLossOutput:
    """The GRPO objective (DeepSeekMath eq. 3), negated so that minimising it is ascent.

    Shapes: `logp`, `old_logp`, `ref_logp`, `mask`, `entropy`, `sampling_logp` are `[B, T]`;
    `advantages` is `[B]` (one per completion, broadcast over its tokens) or `[B, T]` (one per token,
    as PPO's GAE gives). Per token, with the settings of `spec` (`LossSpec`)::

        ρ = exp(logp − old_logp)
        loss = −[ min(ρ·A, clip(ρ, 1−ε, 1+ε_high)·A) − β · k3(logp, ref_logp) ]

    then reduced by `aggregate_loss(spec.loss_type, share)`. ε_high=None means ε (symmetric clip);
    DAPO's "clip-higher" sets ε_high > ε. `old_logp=None` means π_old = π_θ (μ = 1, one update per
    rollout): ρ = 1 and only its gradient matters, ∇ρ = ∇logp, so the loss is the REINFORCE
    estimator with group baselines.

    Worked example, one token, A = 1, ε = 0.2: ρ = 1.5 → min(1.5, 1.2) = 1.2 → loss −1.2 (the
    clip is active; no gradient flows). ρ = 0.5 → min(0.5, 0.8) = 0.5 → loss −0.5.

    `importance_sampling_level="sequence"` replaces ρ by GSPO's sequence ratio
    (`sequence_log_ratio`); the clip then acts on whole completions. `entropy_coef` > 0 subtracts
    coef · entropy per token (an exploration bonus), reduced by the same aggregation. `delta`
    caps ρ in the unclipped term too (INTELLECT-2's two-sided clipping), and
    `use_bias_correction_kl` weighs each token's KL by ρ (DeepSeek-V3.2's unbiased estimator).

    `sampling_logp` (the sampler's own log-probs) measures how far the sampler's arithmetic is from
    the trainer's (`stats["sampling/..."]`); with `spec.importance_sampling_mode` the surrogate term is
    weighted by `sampler_correction_weights` of the trainer's π_old against it (π_θ's own detached
    log-probs at μ = 1).

    `nonfinite` counts the loss tokens whose log π_θ, log π_old, log π_ref (β ≠ 0), sampler log-prob
    (with a correction on) or ratio ρ is NaN or ±inf: the update skips a step where it is not 0, since
    such a token's term is NaN, or silently clamped, or dropped by a later `nan_to_num`.

    `logp` is either the log-probs themselves (with their gradient) or a head that computes them
    (`FusedTokenLossHead`): since the token-level loss is Σ_t w_t ℓ_t with w = `token_weights`, such a
    head gets each token's gradient as soon as its log π exists and never recomputes the logits. The
    formula is the same either way: `per_token_policy_loss` weighted as `aggregate_loss` weighs it.
    """
    if isinstance(logp, Tensor):
        loss, log_ratio = _policy_loss_of_logprobs(logp, old_logp, advantages, mask, spec, ref_logp=ref_logp,
                                                   entropy=entropy, sampling_logp=sampling_logp, share=share)
        logp, entropy = logp.detach(), None if entropy is None else entropy.detach()
    else:
        loss, logp, entropy = _policy_loss_through_head(logp, old_logp, advantages, mask, spec, ref_logp=ref_logp,
                                                        sampling_logp=sampling_logp, share=share)
        log_ratio = torch.zeros_like(logp) if old_logp is None else logp - old_logp
    correction = _sampler_correction(spec, sampling_logp)
    stats = policy_loss_stats(logp, log_ratio, _per_token(advantages, logp), mask, ref_logp, spec.epsilon,
                              spec.upper_epsilon)
    if sampling_logp is not None:
        stats.update(sampler_mismatch_stats(logp if old_logp is None else old_logp, sampling_logp, mask, correction,
                                            spec.importance_sampling_clip_min, spec.importance_sampling_clip_max))
    nonfinite = nonfinite_tokens(mask, logp, old_logp, ref_logp if spec.beta != 0.0 else None,
                                 sampling_logp if correction is not None else None, torch.exp(log_ratio))
    return PolicyLossOutput(loss, stats, logp, entropy, nonfinite)


def _policy_loss_of_logprobs(logp: Tensor, old_logp: Tensor | None, advantages: Tensor, mask: Tensor, spec: LossSpec,
                             *, ref_logp: Tensor | None, entropy: Tensor | None, sampling_logp: Tensor | None,
                             share: BatchShare | None) -> tuple[Tensor, Tensor]:
    """`policy_loss` of log-probs given as a `[B, T]` tensor: (the loss, log ρ detached).

    log ρ is each token's log-ratio to π_old, or its completion's mean one (GSPO, `sequence_log_ratio`)."""
    old = logp.detach() if old_logp is None else old_logp
    if spec.importance_sampling_level == "token":
        log_ratio = logp - old
    else:
        log_ratio = sequence_log_ratio(logp, old, mask)
    adv = _per_token(advantages, logp)
    is_weight = None
    if _sampler_correction(spec, sampling_logp) is not None:
        is_weight = _sampler_weights(old, sampling_logp, mask, spec)
    per_token = per_token_policy_loss(logp, log_ratio, adv.expand_as(logp), spec, ref_logp=ref_logp,
                                      entropy=entropy, is_weight=is_weight)
    loss = aggregate_loss(per_token, mask, spec.loss_type, spec.max_completion_length, share)
    return loss, log_ratio.detach()


def _policy_loss_through_head(head: FusedTokenLossHead, old_logp: Tensor | None, advantages: Tensor, mask: Tensor,
                              spec: LossSpec, *, ref_logp: Tensor | None, sampling_logp: Tensor | None,
                              share: BatchShare | None) -> tuple[Tensor, Tensor, Tensor]:
    """`policy_loss` of a head that computes log π_θ: (the loss, log π_θ, entropy), the last two detached.

    The head weighs each token's `_token_loss` by `token_weights`, the weights `aggregate_loss` gives."""
    if spec.importance_sampling_level != "token":
        raise ValueError("GSPO's sequence ratio couples a completion's tokens: pass the log-probs themselves")
    if spec.sequence_correction and sampling_logp is not None and old_logp is None:
        raise ValueError("a sequence-level sampler correction needs π_old's log-probs before the head runs: "
                         "pass old_logp")
    token_loss = _token_loss(old_logp, advantages, mask, spec, ref_logp=ref_logp, sampling_logp=sampling_logp)
    weights = token_weights(mask, spec.loss_type, spec.max_completion_length, share)
    return head.weighted_token_loss(token_loss, weights)


def _token_loss(old_logp: Tensor | None, advantages: Tensor, mask: Tensor, spec: LossSpec, *,
                ref_logp: Tensor | None, sampling_logp: Tensor | None) -> TokenLoss:
    """The `TokenLoss` of `policy_loss` for a fused head: `per_token_policy_loss` of the tokens at (rows, cols),
    with π_old, π_ref and the advantage read at those positions ([B, T] inputs).

    A token-level sampler weight is computed from each token's own values; a sequence-level one sums whole
    completions, so it is computed once, from π_old, before the head runs.

    Worked example: a head's chunk holding tokens 2 of row 0 and 0 of row 1 calls `token_loss(logp_c, H_c,
    rows=[0, 1], cols=[2, 0])`, whose terms read old_logp[0, 2] and old_logp[1, 0], and the advantages A[0]
    and A[1] of `[B]` advantages (each completion's, on every one of its tokens)."""
    correction = _sampler_correction(spec, sampling_logp)
    sequence_correction = correction is not None and spec.sequence_correction
    adv = _per_token(advantages, mask).float().expand(mask.shape)
    sequence_weight = None
    if sequence_correction:
        sequence_weight = _sampler_weights(old_logp, sampling_logp, mask, spec).expand(mask.shape)
    clip = (spec.importance_sampling_clip_min, spec.importance_sampling_clip_max)

    def token_loss(token_logp: Tensor, token_entropy: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
        old_t = token_logp.detach() if old_logp is None else old_logp[rows, cols]
        ref_t = None if ref_logp is None else ref_logp[rows, cols]
        if correction is None:
            is_weight = None
        elif sequence_correction:
            is_weight = sequence_weight[rows, cols]
        else:  # token modes: element-wise in the token's own values (NaN read as 0, as sampler_log_ratio does)
            log_ratio_t = torch.nan_to_num(old_t - sampling_logp[rows, cols], nan=0.0)
            is_weight = sampler_correction_weights(log_ratio_t, correction, *clip)
        return per_token_policy_loss(token_logp, token_logp - old_t, adv[rows, cols], spec, ref_logp=ref_t,
                                     entropy=token_entropy, is_weight=is_weight)

    return token_loss


def _sampler_correction(spec: LossSpec, sampling_logp: Tensor | None) -> str | None:
    """The sampler correction `policy_loss` applies: `spec`'s, when the sampler's log-probs are given."""
    return spec.importance_sampling_mode if sampling_logp is not None else None


def _sampler_weights(trainer_logp: Tensor, sampling_logp: Tensor, mask: Tensor, spec: LossSpec) -> Tensor:
    """`sampler_correction_weights` of the trainer's log-probs against the sampler's, as `spec` sets them:
    `[B, T]` for a token-level correction, `[B, 1]` for a sequence-level one."""
    correction = spec.importance_sampling_mode
    return sampler_correction_weights(sampler_log_ratio(trainer_logp, sampling_logp, mask, correction), correction,
                                      spec.importance_sampling_clip_min, spec.importance_sampling_clip_max)


def _per_token(advantages: Tensor, like: Tensor) -> Tensor:
    """[B] → [B, 1] (one advantage per completion, broadcast), [B, T] as is; in `like`'s float dtype."""
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    return adv.to(like.dtype) if like.is_floating_point() else adv


def token_weights(mask: Tensor, loss_type: LossType, max_completion_length: int | None = None,
                  share: BatchShare | None = None) -> Tensor:
    """[B, T] weight of each token's loss in `aggregate_loss`, float32.

    `aggregate_loss` is linear in the per-token losses, so its gradient with respect to them is the
    same at every point: these weights. Reading them off by autograd keeps every normalisation in
    `aggregate_loss` alone. Worked example, "grpo", rows of 1 and 3 tokens:
    [[1/2, 0, 0], [1/6, 1/6, 1/6]] (each row's mean, then the mean over 2 rows)."""
    probe = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device, requires_grad=True)
    with torch.enable_grad():
        (weights,) = torch.autograd.grad(aggregate_loss(probe, mask, loss_type, max_completion_length, share), probe)
    return weights


def per_token_policy_loss(logp: Tensor, log_ratio: Tensor, advantages: Tensor, spec: LossSpec = DEFAULT_SPEC, *,
                          ref_logp: Tensor | None = None, entropy: Tensor | None = None,
                          is_weight: Tensor | None = None) -> Tensor:
    """`policy_loss` before its length normalisation: the loss of each token, any shape (all
    arguments alike, `advantages` included). Element-wise in the token's own values, which is what
    lets a fused head take its gradient one chunk of tokens at a time.

    `is_weight` (no gradient) multiplies the surrogate term only, not the KL or the entropy bonus."""
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - spec.epsilon, 1.0 + spec.upper_epsilon) * advantages
    unclipped = (ratio if spec.delta is None else torch.clamp(ratio, max=spec.delta)) * advantages
    per_token = -torch.min(unclipped, clipped)
    if is_weight is not None:
        per_token = per_token * is_weight
    if ref_logp is not None and spec.beta != 0.0:
        kl = kl_penalty(logp, ref_logp, "k3")
        per_token = per_token + spec.beta * (kl * ratio if spec.use_bias_correction_kl else kl)
    if spec.entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("entropy_coef != 0 needs the per-token entropy (with its gradient)")
        per_token = per_token - spec.entropy_coef * entropy
    return per_token


@torch.no_grad()
def nonfinite_tokens(mask: Tensor, *values: Tensor | None) -> Tensor:
    """[] count of the tokens inside `mask` ([B, T]) where any of `values` ([B, T] or [B, 1]; None
    skipped) is NaN or ±inf. Positions outside the mask hold padding and are not counted."""
    bad = torch.zeros(mask.shape, dtype=torch.bool, device=mask.device)
    for value in values:
        if value is not None:
            bad = bad | ~torch.isfinite(value).expand(mask.shape)
    return (bad & mask.bool()).sum()


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
    """GSPO's importance log-ratio: each completion's mean token log-ratio, `[B, T]` (its value on every token).

        log s_i = (1/|y_i|) Σ_t (logp_t − old_logp_t)

    The gradient flows through the whole sum, as in GSPO's sequence-level objective and TRL 1.16:
    ∇ log s_i = (1/|y_i|) Σ_t ∇logp_t, so a per-token term that multiplies s_i (the KL of
    `use_bias_correction_kl`, a token-level sampler weight) moves every token of its completion.
    With one weight per completion (the surrogate alone) this equals GSPO's token form
    (sg[s_i] · π_t / sg[π_t]), whose gradient reaches only each token's own log-prob.

    Worked example: token log-ratios [0.1, 0.3, (padding)] → log s = 0.2 on every position.
    """
    fmask = mask.to(logp.dtype)
    token_log_ratio = (logp - old_logp) * fmask
    seq = token_log_ratio.sum(dim=1, keepdim=True) / fmask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return seq.expand_as(logp)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_range: float = 0.2) -> Tensor:
    """Clipped value loss, token mean: ½ · max((V − R)², (V_clip − R)²) with
    V_clip = V_old + clip(V − V_old, −c, c) (OpenAI baselines PPO2; Ziegler et al. 2019).

    Worked example: V_old = 0, V = 1, R = 1, c = 0.2 → V_clip = 0.2 → ½ · max(0, 0.64) = 0.32.
    """
    clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    per_token = 0.5 * torch.max((values - returns).square(), (clipped - returns).square())
    return aggregate_loss(per_token, mask, "dapo")
