"""The LM head fused with the per-token GRPO loss (cohort_grpo.update.fused_head) against the plain path,
`policy_loss` over `micro_batch_logprobs`: the same loss, statistics and parameter gradients
(float32, CPU, ≤1e-5), with several chunks per micro-batch, padding, ratios away from 1 (clipped
both ways), a KL term, an entropy bonus, a row left out of the loss, and each length normalisation;
and the per-token weights read off `aggregate_loss` against hand-computed values; and the statistics of
both paths against hand counts."""

import math

import pytest
import torch

from cohort_grpo.algorithm.objectives import BatchShare, LossSpec, token_weights
from cohort_grpo.update.fused_head import micro_batch_policy_loss
from cohort_grpo.update.logprobs import micro_batch_logprobs
from cohort_grpo.update.packing import pack_micro_batch

ATOL = 1e-5


def _model(tiny_dir):
    from cohort_grpo.models import from_pretrained

    torch.manual_seed(0)
    return from_pretrained(tiny_dir, dtype="float32").train()


def _micro(vocab: int, rows: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt_ids = [torch.randint(1, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
                  for _ in range(rows)]
    lengths = [int(n) for n in torch.randint(1, 8, (rows,), generator=g)]
    completion = torch.zeros(rows, max(lengths), dtype=torch.long)
    mask = torch.zeros(rows, max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        completion[i, :n] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, :n] = 1
    return pack_micro_batch(prompt_ids, completion, mask, list(range(rows)), pad_id=0)


def _loss_and_grads(model, micro, fused: bool, **kwargs):
    model.zero_grad(set_to_none=True)
    (loss, stats) = out = micro_batch_policy_loss(model, micro, fused=fused, chunk_rows=5, **kwargs)
    (loss * 1.7).backward()  # an upstream gradient other than 1, as the trainer's micro-batch weights give
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), {k: v.detach() for k, v in stats.items()}, out, grads


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.3])
def test_fused_head_loss_equals_plain_loss_statistics_and_gradients(tiny_dir, loss_type, entropy_coef):
    model = _model(tiny_dir)
    micro = _micro(model.config.vocab_size)
    shape = micro.completion_mask.shape
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        current = micro_batch_logprobs(model, micro).logp
    # π_old and π_ref away from π_θ: ratios spread over [0.5, 2], so both clips bind somewhere
    old = (current + 0.7 * torch.randn(shape, generator=g)) * micro.completion_mask
    ref = (current + 0.3 * torch.randn(shape, generator=g)) * micro.completion_mask
    loss_mask = micro.completion_mask.clone()
    loss_mask[2] = 0  # a row left out of the loss (a truncated completion, say)
    kwargs = dict(old_logp=old, ref_logp=ref, advantages=torch.randn(shape[0], generator=g), loss_mask=loss_mask,
                  temperature=0.8, spec=LossSpec(epsilon=0.2, epsilon_high=0.28, beta=0.04, loss_type=loss_type,
                                                 max_completion_length=8, entropy_coef=entropy_coef),
                  share=BatchShare(shape[0], shape[0], float(loss_mask.sum()) + 3.0))
    plain_loss, plain_stats, plain_out, plain_grads = _loss_and_grads(model, micro, fused=False, **kwargs)
    fused_loss, fused_stats, fused_out, fused_grads = _loss_and_grads(model, micro, fused=True, **kwargs)

    assert plain_stats["clip_ratio/low_mean"] > 0 and plain_stats["clip_ratio/high_mean"] > 0
    assert torch.allclose(fused_loss, plain_loss, atol=ATOL)
    for key, value in plain_stats.items():
        assert torch.allclose(fused_stats[key], value, atol=ATOL), key
    assert torch.allclose(fused_out.logp, plain_out.logp, atol=ATOL)
    assert torch.allclose(fused_out.entropy, plain_out.entropy, atol=ATOL)
    assert plain_grads.keys() == fused_grads.keys() and len(plain_grads) > 0
    for name, grad in plain_grads.items():
        assert torch.allclose(fused_grads[name], grad, atol=ATOL, rtol=1e-4), name
    assert max(grad.abs().max() for grad in plain_grads.values()) > 1e-3  # a gradient to compare at all


def test_on_policy_ratio_gives_the_reinforce_gradient(tiny_dir):
    """μ = 1 (old_logp None): ratio 1, so the loss's gradient is −Σ w_t A ∇log π_t, fused or not."""
    model = _model(tiny_dir)
    micro = _micro(model.config.vocab_size, seed=3)
    kwargs = dict(old_logp=None, ref_logp=None, advantages=torch.tensor([1.0, -0.5, 2.0, 0.0, -1.0, 0.3]),
                  loss_mask=micro.completion_mask, spec=LossSpec(loss_type="grpo"))
    plain_loss, _, _, plain_grads = _loss_and_grads(model, micro, fused=False, **kwargs)
    fused_loss, fused_stats, _, fused_grads = _loss_and_grads(model, micro, fused=True, **kwargs)
    assert torch.allclose(fused_loss, plain_loss, atol=ATOL)
    assert float(fused_stats["clip_ratio/region_mean"]) == 0.0
    for name, grad in plain_grads.items():
        assert torch.allclose(fused_grads[name], grad, atol=ATOL, rtol=1e-4), name


def test_token_loss_weights_are_each_normalisation():
    # two completions of 1 and 3 tokens (aggregate_loss's worked example), max length 4
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    grpo = token_weights(mask, "grpo")
    assert torch.allclose(grpo, torch.tensor([[0.5, 0, 0, 0], [1 / 6, 1 / 6, 1 / 6, 0]]))
    dapo = token_weights(mask, "dapo", share=BatchShare(2, 2, 8.0))  # the whole batch's token count, not this one's
    assert torch.allclose(dapo, mask / 8.0)
    dr_grpo = token_weights(mask, "dr_grpo", max_completion_length=4)
    assert torch.allclose(dr_grpo, mask / 8.0)
    assert torch.allclose(token_weights(mask, "bnpo"), mask / 4.0)


@pytest.mark.parametrize("fused", [True, False])
def test_statistics_count_clip_high_against_epsilon_high_and_kl_as_k3(tiny_dir, fused):
    """Ratios set token by token around the clip range, counted by hand: a positive-advantage token
    with ρ in (1 + ε, 1 + ε_high] is not clipped, one above 1 + ε_high is; the KL statistic is the
    float64 k3 mean of the hand-made reference log-ratios."""
    model = _model(tiny_dir)
    micro = _micro(model.config.vocab_size, rows=6, seed=5)
    mask = micro.completion_mask
    with torch.no_grad():
        current = micro_batch_logprobs(model, micro).logp.double()
    pattern = torch.tensor([1.24, 1.35, 1.1, 0.7, 1.22, 0.9, 1.6])  # between, above, inside, below, ...
    ratios = pattern[torch.arange(mask.numel()) % len(pattern)].view(mask.shape).double()
    shifts = torch.tensor([0.6, -0.4, 1.1, -0.9, 0.2])[torch.arange(mask.numel()) % 5].view(mask.shape).double()
    old = ((current - ratios.log()) * mask).float()
    ref = ((current + shifts) * mask).float()
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 1.0])
    _, stats = micro_batch_policy_loss(model, micro, fused=fused, chunk_rows=5, old_logp=old, ref_logp=ref,
                                       advantages=advantages, loss_mask=mask,
                                       spec=LossSpec(epsilon=0.2, epsilon_high=0.28, beta=0.04, loss_type="grpo"))
    high = low = between = n = 0
    k3 = 0.0
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                continue
            rho, a, r = float(ratios[b, t]), float(advantages[b]), float(shifts[b, t])
            n += 1
            high += rho > 1.28 and a > 0
            between += 1.2 < rho <= 1.28 and a > 0
            low += rho < 0.8 and a < 0
            k3 += math.exp(r) - r - 1
    assert between > 0 and high > 0 and low > 0  # every case occurs
    assert float(stats["clip_ratio/high_mean"]) == pytest.approx(high / n, abs=1e-6)
    assert float(stats["clip_ratio/low_mean"]) == pytest.approx(low / n, abs=1e-6)
    assert float(stats["clip_ratio/region_mean"]) == pytest.approx((high + low) / n, abs=1e-6)
    assert float(stats["kl"]) == pytest.approx(k3 / n, abs=1e-5)
