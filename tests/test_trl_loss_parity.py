"""cohort's GRPO loss and advantages against TRL 1.16's formulas, written out here independently in
float64 (from TRL's `GRPOTrainer._compute_loss`, its importance-sampling ratio in
`_generate_and_score_completions`, and its advantage computation), at 1e-12.

What TRL does, per token, with ρ = exp(logp − old) (old = the detached logp at μ = 1; the sequence
level takes the masked mean of the log-ratio over each completion):

    c2 = clamp(ρ, 1 − ε_low, 1 + ε_high)
    c1 = min(ρ, delta)                       when delta is set (two-sided clipping), else ρ
    ℓ  = −min(c1·A, c2·A)
    ℓ  = ℓ · w_IS                            with a sampler correction (surrogate only)
    ℓ  = ℓ + β·k3(logp, ref) [· ρ]           [· ρ] with use_bias_correction_kl (ρ before delta)

where w_IS = exp(old − sampling_logp) per token (the masked sum over the completion for the sequence
modes), clamped to [C_min, C_max] (truncate) or set to 0 outside it (mask). Aggregation, one
micro-batch and no gradient accumulation: grpo = mean over completions of each one's token mean;
bnpo = token sum ÷ this batch's token count; dapo = token sum ÷ the generation batch's token count;
dr_grpo = token sum ÷ (B × max_completion_length).

Gradients with respect to logp are compared too (1e-10), at the sequence level as well: there the
ratio's gradient flows through every token of the completion, as TRL's does, so a term weighted per
token (the KL of use_bias_correction_kl, a token-level sampler weight) reaches the whole completion.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from cohort_grpo.algorithm.advantages import group_advantages
from cohort_grpo.algorithm.objectives import BatchShare, LossSpec, policy_loss

torch.set_num_threads(1)

TOL = 1e-12
MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


# ---- TRL 1.16's formulas, float64, independent of cohort -------------------------------------------

def trl_sampler_weights(old, sampling, mask, mode, clip_min, clip_max):
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return torch.where((ratio < low) | (ratio > high), torch.zeros_like(ratio), ratio)


def trl_loss(logp, old, ref, advantages, mask, *, epsilon=0.2, epsilon_high=None, beta=0.0, loss_type="grpo",
             max_completion_length=None, num_items=None, level="token", delta=None, bias_kl=False,
             sampling=None, mode=None, clip_min=None, clip_max=3.0):
    mask = mask.to(logp.dtype)
    eps_high = epsilon if epsilon_high is None else epsilon_high
    old = logp.detach() if old is None else old
    A = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    log_ratio = logp - old
    if level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    rho = torch.exp(log_w)
    if beta != 0.0:
        x = ref - logp
        kl = torch.exp(x) - x - 1
        if bias_kl:
            kl = kl * rho
    c2 = torch.clamp(rho, 1 - epsilon, 1 + eps_high)
    c1 = rho if delta is None else torch.clamp(rho, max=delta)
    per_token = -torch.min(c1 * A, c2 * A)
    if mode is not None:
        per_token = per_token * trl_sampler_weights(old, sampling, mask, mode, clip_min, clip_max)
    if beta != 0.0:
        per_token = per_token + beta * kl
    per_token = per_token * mask  # broadcasts a [B, 1] sequence-level term over the tokens
    if loss_type == "grpo":
        return (per_token.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return per_token.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dapo":
        return per_token.sum() / (mask.sum() if num_items is None else num_items)
    if loss_type == "dr_grpo":
        return per_token.sum() / (per_token.size(0) * max_completion_length)
    raise ValueError(loss_type)


def trl_advantages(rewards, G, scale):
    """sum_then_normalize: rewards NaN where unscored; NaN-aware group mean, Bessel std (nanstd), then
    NaN → 0."""
    grouped = rewards.view(-1, G)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(G)

    def nanstd(x, dim=None):
        m = torch.nanmean(x, dim=dim, keepdim=dim is not None)
        n = (~torch.isnan(x)).sum(dim=dim) if dim is not None else (~torch.isnan(x)).sum()
        var = torch.nanmean((x - m) ** 2, dim=dim) if dim is not None else torch.nanmean((x - m) ** 2)
        return torch.sqrt(var * n / (n - 1))

    std = nanstd(grouped, dim=1).repeat_interleave(G) if scale in ("group", "none") else nanstd(rewards).expand_as(
        rewards)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


# ---- inputs -----------------------------------------------------------------------------------------

def inputs(seed=0, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, T, 3, 5, T - 1, 2])[:B]
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    old = logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ρ spread over ~[0.4, 2.5]
    ref = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    sampling = logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)  # a sampler off by a lot
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    return logp, old, ref, sampling, advantages, mask


def both(options: dict, cohort_only: dict, seed=0):
    """(cohort loss, TRL loss, cohort ∇logp, TRL ∇logp) for one set of options."""
    logp, old, ref, sampling, advantages, mask = inputs(seed)
    use_old = options.pop("use_old", True)
    old = old if use_old else None
    a = logp.clone().requires_grad_(True)
    spec_options = {k: v for k, v in {**options, **cohort_only}.items() if k not in ("sampling_logp", "num_tokens")}
    if "importance_sampling_correction" in spec_options:
        spec_options["importance_sampling_mode"] = spec_options.pop("importance_sampling_correction")
    num_tokens = options.get("num_tokens")
    share = None if num_tokens is None else BatchShare(len(a), len(a), num_tokens)
    out = policy_loss(a, old, advantages, mask, LossSpec(**spec_options), ref_logp=ref,
                      sampling_logp=options.get("sampling_logp"), share=share)
    (grad_cohort,) = torch.autograd.grad(out.loss, a)
    b = logp.clone().requires_grad_(True)
    trl_options = dict(options)
    for ours, theirs in (("max_completion_length", "max_completion_length"), ("num_tokens", "num_items"),
                         ("importance_sampling_level", "level"), ("use_bias_correction_kl", "bias_kl"),
                         ("sampling_logp", "sampling"), ("importance_sampling_correction", "mode"),
                         ("importance_sampling_clip_min", "clip_min"),
                         ("importance_sampling_clip_max", "clip_max")):
        if ours in trl_options:
            trl_options[theirs] = trl_options.pop(ours)
    want = trl_loss(b, old, ref, advantages, mask, **trl_options)
    (grad_trl,) = torch.autograd.grad(want, b)
    return out.loss.detach(), want.detach(), grad_cohort, grad_trl


def check(options: dict, *, seed=0):
    got, want, grad_got, grad_want = both(dict(options), {}, seed)
    assert got.dtype == torch.float64
    assert abs(got.item() - want.item()) <= TOL * max(1.0, abs(want.item())), (got.item(), want.item())
    assert torch.allclose(grad_got, grad_want, rtol=0, atol=1e-10), (grad_got - grad_want).abs().max()


# ---- the loss -----------------------------------------------------------------------------------------

LOSS_TYPES = ["grpo", "bnpo", "dapo", "dr_grpo"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("epsilon_high", [None, 0.28])
@pytest.mark.parametrize("use_old", [True, False])
def test_clipped_surrogate_kl_and_aggregation(loss_type, level, beta, epsilon_high, use_old):
    check(dict(loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon=0.2,
               epsilon_high=epsilon_high, max_completion_length=9, use_old=use_old))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_dapo_divides_by_the_generation_batch_tokens(level):
    """dapo's divisor is the token count of the whole generation batch (here 3× this micro-batch's), which
    the update passes as num_tokens (for dapo only: bnpo divides by the micro-batch's own count, as TRL's)."""
    _, _, _, _, _, mask = inputs()
    check(dict(loss_type="dapo", num_tokens=float(3 * mask.sum()), importance_sampling_level=level, beta=0.04))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("delta", [None, 1.3, 2.0])
@pytest.mark.parametrize("use_old", [True, False])
def test_two_sided_clipping(loss_type, level, delta, use_old):
    check(dict(loss_type=loss_type, importance_sampling_level=level, delta=delta, epsilon_high=0.28,
               max_completion_length=7, use_old=use_old))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("delta", [None, 1.5])
def test_bias_corrected_kl(loss_type, level, delta):
    check(dict(loss_type=loss_type, importance_sampling_level=level, beta=0.1, use_bias_correction_kl=True,
               delta=delta, max_completion_length=7))


def test_bias_corrected_kl_is_off_by_default_and_changes_the_loss_off_policy():
    plain, _, _, _ = both(dict(beta=0.1), {})
    corrected, _, _, _ = both(dict(beta=0.1, use_bias_correction_kl=True), {})
    assert abs(plain.item() - corrected.item()) > 1e-4


SAMPLER_CASES = [
    (mode, clip_min, clip_max)
    for mode in MODES
    for clip_min, clip_max in ((None, 3.0), (0.5, 3.0), (0.8, 1.25), (0.5, None))
    if not (mode.endswith("truncate") and clip_max is None and clip_min is None)
]


@pytest.mark.parametrize("mode, clip_min, clip_max", SAMPLER_CASES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("use_old", [True, False])
def test_sampler_correction_weights_the_surrogate_only(mode, clip_min, clip_max, loss_type, use_old):
    _, _, _, sampling, _, _ = inputs()
    check(dict(loss_type=loss_type, sampling_logp=sampling, importance_sampling_correction=mode,
               importance_sampling_clip_min=clip_min, importance_sampling_clip_max=clip_max, beta=0.05,
               max_completion_length=7, use_old=use_old))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_everything_at_once(mode, level):
    _, _, _, sampling, _, _ = inputs(seed=5)
    for loss_type, bias_kl in itertools.product(LOSS_TYPES, (False, True)):
        check(dict(loss_type=loss_type, importance_sampling_level=level, sampling_logp=sampling,
                   importance_sampling_correction=mode, importance_sampling_clip_min=0.5,
                   importance_sampling_clip_max=2.0, beta=0.07, use_bias_correction_kl=bias_kl, delta=1.6,
                   epsilon=0.15, epsilon_high=0.3, max_completion_length=8), seed=5)


def test_sampling_logp_without_a_correction_changes_nothing():
    _, _, _, sampling, _, _ = inputs()
    with_it, _, _, _ = both(dict(beta=0.05, sampling_logp=sampling), {})
    without, _, _, _ = both(dict(beta=0.05), {})
    assert with_it.item() == without.item()


def test_sampler_nan_logprobs_count_as_no_correction():
    """A token the sampler has no log-prob for (NaN) gets ratio 1, as TRL's nan_to_num makes it."""
    _, _, _, sampling, _, mask = inputs()
    sampling = sampling.clone()
    sampling[1, 2] = math.nan
    check(dict(sampling_logp=sampling, importance_sampling_correction="token_truncate", loss_type="dapo"))


# ---- the advantages ------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("with_unscored", [False, True])
def test_advantages(scale, with_unscored):
    g = torch.Generator().manual_seed(2)
    G = 4
    rewards = torch.randn(6 * G, generator=g, dtype=torch.float64)
    rewards[4:8] = 0.5  # an all-equal group
    scored = torch.ones(6 * G, dtype=torch.bool)
    if with_unscored:
        scored[[1, 9, 10, 11, 16, 17, 18, 19]] = False  # one, three (one left) and four (none left) of a group
    got = group_advantages(rewards, G, scale, scored=scored if with_unscored else None)
    want = trl_advantages(rewards.masked_fill(~scored, math.nan), G, scale)
    assert torch.allclose(got, want, rtol=0, atol=TOL), (got - want).abs().max()


# ---- where the sampling/importance_sampling_ratio metrics depart from TRL's, by design -----------------

def trl_ratio_mean(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's `sampling/importance_sampling_ratio/mean`: the weights of every completion token (a
    NaN log-prob read as ratio 1), or of every completion at the sequence level, empty ones included."""
    weights = trl_sampler_weights(old, sampling, mask, mode, clip_min, clip_max)
    return (weights.flatten() if mode.startswith("sequence") else weights[mask.bool()]).mean()


@pytest.mark.parametrize("mode", MODES)
def test_ratio_metrics_leave_out_what_was_not_measured(mode):
    """cohort's ratio statistics average only what the sampler measured: a token whose sampler log-prob is
    NaN, and at the sequence level a completion with no loss token, are left out (TRL counts each as a
    ratio of 1). docs/howto/from-trl.md states the difference."""
    logp, old, _, sampling, advantages, mask = inputs()
    sampling = sampling.clone()
    sampling[3, 1] = math.nan
    mask = mask.clone()
    mask[4] = 0  # a completion left out of the loss (a truncated one, say)
    spec = LossSpec(importance_sampling_mode=mode, importance_sampling_clip_min=0.5, importance_sampling_clip_max=3.0)
    got = policy_loss(logp.clone().requires_grad_(), old, advantages, mask, spec, sampling_logp=sampling).stats
    weights = trl_sampler_weights(old, sampling, mask, mode, 0.5, 3.0)
    if mode.startswith("sequence"):
        measured = weights.flatten()[mask.sum(dim=1) > 0]
    else:
        measured = weights[mask.bool() & ~torch.isnan(sampling)]
    assert got["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(measured.mean().item(), abs=TOL)
    assert got["sampling/importance_sampling_ratio/min"].item() == pytest.approx(measured.min().item(), abs=TOL)
    trl = trl_ratio_mean(old, sampling, mask, mode, 0.5, 3.0).item()
    assert abs(got["sampling/importance_sampling_ratio/mean"].item() - trl) > 1e-3  # the case tells them apart
