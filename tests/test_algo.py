"""The advantages (cohort_grpo/algorithm/advantages.py) and the policy loss (cohort_grpo/algorithm/objectives.py) against
independent computations: float64 loops for every advantage scale, KL estimator and loss_type; the docstrings'
worked examples; k3's mean over samples against the exact KL; the gradient's direction; and which tokens the
kl, clip and non-finite statistics count."""

import math

import pytest
import torch

from cohort_grpo.algorithm.advantages import group_advantages
from cohort_grpo.algorithm.objectives import BatchShare, LossSpec, aggregate_loss, kl_penalty, policy_loss, policy_loss_stats


def _std(xs):  # Bessel-corrected
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_matches_loop(scale):
    g = torch.Generator().manual_seed(0)
    G, prompts = 4, 5
    rewards = torch.rand(prompts * G, generator=g, dtype=torch.float64)
    rewards[4:8] = 1.0  # one group with all-equal rewards
    got = group_advantages(rewards, G, scale=scale)
    r = rewards.tolist()
    batch_std = _std(r)
    for p in range(prompts):
        group = r[p * G : (p + 1) * G]
        mean = sum(group) / G
        for i, x in enumerate(group):
            if scale == "group":
                want = (x - mean) / (_std(group) + 1e-4)
            elif scale == "batch":
                want = (x - mean) / (batch_std + 1e-4)
            else:
                want = x - mean
            assert got[p * G + i].item() == pytest.approx(want, abs=1e-9)
    assert torch.all(got[4:8] == 0)


def test_group_advantages_docstring_example():
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2)
    assert adv.tolist() == pytest.approx([0.70700, -0.70700, 0.0, 0.0], abs=1e-4)


def test_group_advantages_rejects_bad_shapes():
    with pytest.raises(ValueError):
        group_advantages(torch.ones(5), 2)
    with pytest.raises(ValueError):
        group_advantages(torch.ones(4), 2, scale="weird")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_formulas(estimator):
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(3, 7, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(3, 7, generator=g, dtype=torch.float64) * 3
    got = kl_penalty(logp, ref, estimator)
    for a, b, v in zip(logp.flatten().tolist(), ref.flatten().tolist(), got.flatten().tolist()):
        r = b - a
        want = {"k1": a - b, "k2": 0.5 * r * r, "k3": math.exp(r) - r - 1}[estimator]
        assert v == pytest.approx(want, abs=1e-12)
    if estimator == "k3":
        assert torch.all(got >= 0)


def test_k3_is_unbiased_estimate_of_true_kl():
    # Sample from p, average k3 → KL(p‖q) computed exactly.
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    true_kl = float((p * (p / q).log()).sum())
    idx = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    est = kl_penalty(p.log()[idx], q.log()[idx], "k3").mean().item()
    assert est == pytest.approx(true_kl, rel=0.03)


def _loop_policy_loss(logp, old, adv, mask, ref, eps, eps_high, beta, loss_type, max_len):
    B, T = len(logp), len(logp[0])
    per_seq, total, count = [], 0.0, 0
    for b in range(B):
        s, n = 0.0, 0
        for t in range(T):
            if not mask[b][t]:
                continue
            rho = math.exp(logp[b][t] - old[b][t])
            a = float(adv[b])
            term = min(rho * a, min(max(rho, 1 - eps), 1 + eps_high) * a)
            if ref is not None:
                r = ref[b][t] - logp[b][t]
                term -= beta * (math.exp(r) - r - 1)
            s += -term
            n += 1
        per_seq.append(s / max(n, 1))
        total += s
        count += n
    if loss_type == "grpo":
        return sum(per_seq) / B
    if loss_type in ("bnpo", "dapo"):
        return total / count
    return total / (B * max_len)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("eps_high", [None, 0.28])
def test_policy_loss_matches_loop(loss_type, eps_high):
    g = torch.Generator().manual_seed(2)
    B, T = 4, 6
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    old = logp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)  # ratios beyond the clip range
    ref = logp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 0.3
    adv = torch.tensor([1.0, -0.5, 0.25, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1] * 6, [1] * 2 + [0] * 4, [1] * 4 + [0] * 2, [1] + [0] * 5])
    spec = LossSpec(epsilon=0.2, epsilon_high=eps_high, beta=0.04, loss_type=loss_type, max_completion_length=8)
    loss, stats = policy_loss(logp, old, adv, mask, spec, ref_logp=ref)
    want = _loop_policy_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), ref.tolist(), 0.2,
                             eps_high or 0.2, 0.04, loss_type, 8)
    assert loss.item() == pytest.approx(want, abs=1e-10)
    # Clip fractions, counted independently.
    low = high = n = 0
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                n += 1
                rho = math.exp(logp[b, t] - old[b, t])
                low += rho < 0.8 and adv[b] < 0
                high += rho > 1 + (eps_high or 0.2) and adv[b] > 0
    assert stats["clip_ratio/low_mean"] == pytest.approx(low / n)
    assert stats["clip_ratio/high_mean"] == pytest.approx(high / n)
    assert low + high > 0  # the case actually exercises clipping


def test_aggregate_loss_docstring_example():
    per_token = torch.tensor([[1.0, 1, 1, 1], [2.0, 2, 2, 2]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    assert aggregate_loss(per_token, mask, "grpo").item() == pytest.approx(1.5)
    assert aggregate_loss(per_token, mask, "dapo").item() == pytest.approx(1.75)
    assert aggregate_loss(per_token, mask, "dr_grpo", max_completion_length=4).item() == pytest.approx(0.875)


def test_a_micro_batch_mean_weighs_into_the_steps_row_weighted_mean_over_ranks():
    """A loss already averaged over each micro-batch (the router's load balancing): two ranks, micro-batches of
    3 + 1 and 2 + 2 completions. Summed over a rank's micro-batches and averaged over the ranks as DDP averages
    gradients, it is the step's mean over completions, each micro-batch's value standing for its rows, whatever
    the policy loss's type."""
    from cohort_grpo.algorithm.objectives import MICRO_BATCH_MEAN

    ranks = [[(3, 0.5), (1, 2.0)], [(2, 1.0), (2, 4.0)]]  # (completions, the micro-batch's mean) per rank
    step_rows = sum(rows for rank in ranks for rows, _ in rank)
    per_rank = [sum(aggregate_loss(torch.tensor(value), None, MICRO_BATCH_MEAN,
                                   share=BatchShare(rows, step_rows, step_tokens=99.0, world_size=len(ranks)))
                    for rows, value in rank) for rank in ranks]
    step_mean = (3 * 0.5 + 1 * 2.0 + 2 * 1.0 + 2 * 4.0) / 8
    assert float(sum(per_rank) / len(ranks)) == pytest.approx(step_mean)
    assert float(aggregate_loss(torch.tensor(1.25), None, MICRO_BATCH_MEAN)) == 1.25  # the whole step: as it is


def test_no_reference_means_no_kl_term():
    logp = torch.zeros(2, 3)
    loss, stats = policy_loss(logp, logp, torch.tensor([1.0, -1.0]), torch.ones(2, 3), LossSpec(beta=0.5))
    assert stats["kl"] == 0.0
    assert loss.item() == pytest.approx(0.0)


def test_gradient_raises_logp_of_positive_advantage_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    tokens = torch.tensor([[1, 2, 3], [4, 0, 1]])

    def logp_of(l):
        return torch.log_softmax(l, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    before = logp_of(logits).detach()
    adv = torch.tensor([1.0, -1.0])
    loss, _ = policy_loss(logp_of(logits), before, adv, torch.ones(2, 3))
    loss.backward()
    with torch.no_grad():
        after = logp_of(logits - 0.5 * logits.grad)
    assert torch.all(after[0] > before[0])  # positive advantage: every token more likely
    assert torch.all(after[1] < before[1])  # negative advantage: every token less likely


def test_logged_kl_is_the_k3_estimate_of_the_masked_tokens():
    """The `kl` statistic is the token mean of k3 = exp(r) − r − 1, r = ref − logp (what the loss
    penalises), not k1 = −r or k2 = r²/2: log-ratios of both signs and sizes, where the three differ."""
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.2, -1.5, -4.0, -1.0]], dtype=torch.float64)
    shift = torch.tensor([[0.5, -0.7, 1.2, 0.4], [-1.5, 0.3, 5.0, 2.0]], dtype=torch.float64)
    ref = logp + shift
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 1]])  # the 5.0 shift is padding: it must not count
    advantages = torch.tensor([0.5, -0.5], dtype=torch.float64)
    k1 = k2 = k3 = 0.0
    n = 0
    for b in range(2):
        for t in range(4):
            if mask[b][t]:
                r = float(shift[b, t])
                k1, k2, k3, n = k1 - r, k2 + 0.5 * r * r, k3 + math.exp(r) - r - 1, n + 1
    k1, k2, k3 = k1 / n, k2 / n, k3 / n
    assert min(abs(k3 - k1), abs(k3 - k2)) > 0.05  # the estimators are told apart here
    stats = policy_loss_stats(logp, torch.zeros_like(logp), advantages.unsqueeze(1), mask, ref, 0.2, 0.2)
    assert float(stats["kl"]) == pytest.approx(k3, abs=1e-12)
    _, stats = policy_loss(logp, logp, advantages, mask, LossSpec(beta=0.04), ref_logp=ref)
    assert float(stats["kl"]) == pytest.approx(k3, abs=1e-12)


def test_clip_high_counts_only_ratios_above_one_plus_epsilon_high():
    """DAPO's clip-higher: with ε = 0.2 and ε_high = 0.28 a positive-advantage token whose ratio lies in
    (1.2, 1.28] is not clipped (it keeps its gradient) and must not count in `clip_ratio/high_mean`;
    one above 1.28 is clipped and counts. Low clipping needs ρ < 1 − ε and a negative advantage."""
    ratios = torch.tensor([
        [1.21, 1.25, 1.27, 1.29, 1.50, 2.00],  # A > 0: the last three are clipped high
        [1.50, 0.70, 0.85, 0.79, 1.00, 1.00],  # A < 0: 0.70 and 0.79 are clipped low, never high
        [1.24, 1.10, 0.50, 1.40, 1.00, 1.00],  # A > 0: 1.40 clipped high; a low ratio is not clipped
    ], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    advantages = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    old = -torch.rand(3, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logp = (old + ratios.log()).requires_grad_()
    n = int(mask.sum())
    loss, stats = policy_loss(logp, old, advantages, mask, LossSpec(epsilon=0.2, epsilon_high=0.28, loss_type="dapo"))
    assert float(stats["clip_ratio/high_mean"]) == pytest.approx(4 / n)
    assert float(stats["clip_ratio/low_mean"]) == pytest.approx(2 / n)
    assert float(stats["clip_ratio/region_mean"]) == pytest.approx(6 / n)
    # the same tokens as the gradient sees them: a clipped token has none, an unclipped one A·ρ/n
    loss.backward()
    clipped = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 0, 1, 0, 0], [0, 0, 0, 1, 0, 0]], dtype=torch.bool)
    want = torch.where(clipped, 0.0, -advantages.unsqueeze(1) * ratios / n) * mask
    assert torch.allclose(logp.grad, want, atol=1e-12)
    # the statistic on its own (as the fused head computes it), with per-token advantages
    direct = policy_loss_stats(logp.detach(), (logp - old).detach(), advantages.unsqueeze(1).expand(3, 6), mask,
                               None, 0.2, 0.28)
    assert float(direct["clip_ratio/high_mean"]) == pytest.approx(4 / n)
    assert float(direct["kl"]) == 0.0  # no reference


def test_nonfinite_counts_loss_tokens_with_a_nan_logprob_or_an_overflowing_ratio_only():
    """A NaN sampler log-prob inside the mask counts (the correction would read it as ratio 1); one in
    padding does not; a finite log-ratio of 100 overflows ρ = e^100 to inf in float32 and counts, though
    the clipped loss stays finite."""
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    logp = -torch.ones(2, 3)
    spec = LossSpec(importance_sampling_mode="token_truncate")
    sampling = logp.clone()
    sampling[0, 2] = sampling[1, 2] = float("nan")  # padding: not counted
    out = policy_loss(logp.clone().requires_grad_(), logp, torch.tensor([1.0, 1.0]), mask, spec,
                      sampling_logp=sampling)
    assert int(out.nonfinite) == 0
    sampling[0, 1] = float("nan")
    out = policy_loss(logp.clone().requires_grad_(), logp, torch.tensor([1.0, 1.0]), mask, spec,
                      sampling_logp=sampling)
    assert int(out.nonfinite) == 1 and torch.isfinite(out.loss)
    old = logp.clone()
    old[1, 0] = -101.0
    out = policy_loss(logp.clone().requires_grad_(), old, torch.tensor([1.0, 1.0]), mask)
    assert int(out.nonfinite) == 1 and torch.isfinite(out.loss)
