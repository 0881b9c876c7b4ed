"""Under top-k, top-p or min-p every log-prob the loss compares is of the truncated distribution that was sampled.

The reference here is written from the definitions, in float64: softmax at the temperature, top-k then top-p
(over the top-k's renormalised mass) then min-p, the kept tokens renormalised; it draws its own tokens from that
distribution. Against it: the engine's recorded log-probs, the trainer's log π (plain, chunked and fused heads,
values and gradients), the GRPO ratio and loss, and `sampler_correction_weights`.
"""

import pytest
import torch

from cohort_grpo.algorithm.loss_spec import LossSpec
from cohort_grpo.algorithm.objectives import policy_loss
from cohort_grpo.algorithm.sampler_correction import sampler_correction_weights, sampler_log_ratio
from cohort_grpo.rollout.sampling import Truncation, sample_from_logits
from cohort_grpo.update.fused_head import head_with_token_loss
from cohort_grpo.update.logprobs import lm_head_logprobs, selected_logprobs

TEMPERATURE = 0.8
VOCAB = 40
CASES = {  # (top_k, top_p, min_p)
    "top_k": (6, 1.0, 0.0),
    "top_p": (0, 0.7, 0.0),
    "min_p": (0, 1.0, 0.15),
    "top_k_top_p": (10, 0.8, 0.0),
    "top_p_min_p": (0, 0.9, 0.05),
    "all_three": (12, 0.85, 0.05),
}


def reference_kept(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """[..., V] bool: the tokens kept, from the definitions, one row at a time in float64."""
    flat = logits.double().reshape(-1, logits.shape[-1]) / temperature
    kept = torch.zeros(flat.shape, dtype=torch.bool)
    for row, z in enumerate(flat):
        keep = [True] * len(z)
        if top_k:
            kth = sorted(z.tolist(), reverse=True)[top_k - 1]
            keep = [k and v >= kth for k, v in zip(keep, z.tolist())]
        if top_p < 1.0:
            weights = [float(torch.exp(v - z.max())) if k else 0.0 for k, v in zip(keep, z)]
            total = sum(weights)
            mass_before = 0.0
            for i in sorted(range(len(z)), key=lambda i: (-z[i].item(), i)):
                if not keep[i]:
                    continue
                if mass_before >= top_p:
                    keep[i] = False
                mass_before += weights[i] / total
        if min_p > 0.0:  # p_i ≥ min_p · p_max over the kept (renormalising changes neither side's ratio)
            keep = [k and float(torch.exp(v - z.max())) >= min_p for k, v in zip(keep, z)]
        kept[row] = torch.tensor(keep)
    return kept.view(logits.shape)


def reference_logp(logits: torch.Tensor, kept: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log of the kept tokens' renormalised softmax at `tokens`, float64 (differentiable in `logits`)."""
    z = (logits.double() / temperature).masked_fill(~kept, float("-inf"))
    return torch.log_softmax(z, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def reference_draw(logits: torch.Tensor, kept: torch.Tensor, temperature: float, seed: int) -> torch.Tensor:
    """Tokens drawn from the truncated distribution (float64 probabilities, torch.multinomial)."""
    z = (logits.double() / temperature).masked_fill(~kept, float("-inf"))
    probs = torch.softmax(z, dim=-1).reshape(-1, logits.shape[-1])
    generator = torch.Generator().manual_seed(seed)
    return torch.multinomial(probs, 1, generator=generator).view(logits.shape[:-1])


def random_logits(*shape: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CASES))
def test_the_sampler_records_the_log_prob_of_the_truncated_distribution_it_draws_from(name):
    top_k, top_p, min_p = CASES[name]
    logits = random_logits(64, VOCAB, seed=1)
    kept = reference_kept(logits, TEMPERATURE, top_k, top_p, min_p)
    assert (kept.sum(-1) < VOCAB).all() and (kept.sum(-1) > 1).any()  # every row truncated, some not to one token
    tokens, logprobs = sample_from_logits(logits, TEMPERATURE, top_k, top_p, min_p, seed=torch.tensor(5))
    assert kept.gather(1, tokens[:, None]).all()
    expected = reference_logp(logits, kept, tokens, TEMPERATURE)
    torch.testing.assert_close(logprobs.double(), expected, atol=2e-6, rtol=0)
    # the full softmax's log-prob (what was recorded before) differs by the log of the kept mass
    full = torch.log_softmax(logits.double() / TEMPERATURE, -1).gather(1, tokens[:, None]).squeeze(1)
    assert (expected - full).min() > 1e-3


@pytest.mark.parametrize("name", list(CASES))
def test_sampled_frequencies_are_the_truncated_distribution(name):
    top_k, top_p, min_p = CASES[name]
    row = random_logits(VOCAB, seed=2)
    kept = reference_kept(row[None], TEMPERATURE, top_k, top_p, min_p)[0]
    tokens, _ = sample_from_logits(row.expand(40000, VOCAB), TEMPERATURE, top_k, top_p, min_p, seed=torch.tensor(3))
    frequencies = torch.bincount(tokens, minlength=VOCAB).double() / tokens.numel()
    expected = torch.softmax((row.double() / TEMPERATURE).masked_fill(~kept, float("-inf")), -1)
    assert frequencies[~kept].sum() == 0
    assert (frequencies - expected).abs().max() < 0.012


@pytest.mark.parametrize("name", list(CASES))
def test_the_trainers_log_probs_and_gradients_are_the_truncated_distributions(name):
    """The plain head (models that give logits), the chunked head (π_old, π_ref, and π_θ off the fused path) and
    the fused head, against float64 autograd through the reference's renormalised softmax."""
    top_k, top_p, min_p = CASES[name]
    truncation = Truncation(top_k, top_p, min_p)
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(30, 16, generator=generator, dtype=torch.float64)
    weight = torch.randn(VOCAB, 16, generator=generator, dtype=torch.float64) / 2
    logits = hidden @ weight.T
    kept = reference_kept(logits, TEMPERATURE, top_k, top_p, min_p)
    tokens = reference_draw(logits, kept, TEMPERATURE, seed=6)
    coefficients = torch.randn(30, generator=generator, dtype=torch.float64)

    def reference(h, w):
        z = h @ w.T
        logp = reference_logp(z, kept, tokens, TEMPERATURE)
        p = torch.softmax(z / TEMPERATURE, -1)  # the entropy stays the full softmax's
        entropy = -(p * torch.log_softmax(z / TEMPERATURE, -1)).sum(-1)
        return logp, entropy

    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp64, entropy64 = reference(h64, w64)
    (coefficients * logp64 + 0.3 * entropy64).sum().backward()

    plain_logp, _ = selected_logprobs(logits.float(), tokens, TEMPERATURE, truncation=truncation)
    torch.testing.assert_close(plain_logp.double(), logp64.detach(), atol=2e-5, rtol=0)

    h32, w32 = hidden.float().requires_grad_(), weight.float().requires_grad_()
    logp, entropy = lm_head_logprobs(h32, w32, tokens, TEMPERATURE, chunk_rows=7, truncation=truncation)
    torch.testing.assert_close(logp.double(), logp64.detach(), atol=2e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), entropy64.detach(), atol=2e-5, rtol=0)
    (coefficients.float() * logp + 0.3 * entropy).sum().backward()
    torch.testing.assert_close(h32.grad.double(), h64.grad, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(w32.grad.double(), w64.grad, atol=2e-5, rtol=1e-4)

    fused_h, fused_w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    loss, fused_logp, _ = head_with_token_loss(
        fused_h, fused_w, tokens, torch.ones(30), lambda lp, ent, part: coefficients.float()[part] * lp + 0.3 * ent,
        TEMPERATURE, chunk_rows=7, truncation=truncation)
    loss.backward()
    torch.testing.assert_close(fused_logp, logp.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(fused_h.grad.double(), h64.grad, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(fused_w.grad.double(), w64.grad, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate"])
def test_ratio_loss_and_sampler_weights_against_float64(name, mode):
    """π_θ, π_old (the trainer's) and the engine's sampler each truncate their own logits; the engine's differ
    from π_old's by rounding-sized noise, π_θ's by an update. The reference draws the tokens from the engine's
    truncated distribution; the ratio μ_θ / μ_old, the weight μ_old / μ_engine and the clipped GRPO loss with its
    gradient are compared with cohort's."""
    top_k, top_p, min_p = CASES[name]
    truncation = Truncation(top_k, top_p, min_p)
    rows, width = 6, 9
    old = random_logits(rows, width, VOCAB, seed=7)
    engine = old + 0.02 * random_logits(rows, width, VOCAB, seed=8, scale=1.0)
    theta = old + 0.25 * random_logits(rows, width, VOCAB, seed=9, scale=1.0)
    kept = {key: reference_kept(value, TEMPERATURE, top_k, top_p, min_p)
            for key, value in (("old", old), ("engine", engine), ("theta", theta))}
    tokens = reference_draw(engine, kept["engine"], TEMPERATURE, seed=10)
    for key in kept:  # the kept set always holds the sampled token (rollout.sampling.kept_logits)
        kept[key] = kept[key].scatter(-1, tokens[..., None], True)
    advantages = torch.linspace(-1.5, 1.5, rows, dtype=torch.float64)
    mask = torch.ones(rows, width)

    theta64 = theta.double().requires_grad_()
    logp64 = reference_logp(theta64, kept["theta"], tokens, TEMPERATURE)
    old64 = reference_logp(old, kept["old"], tokens, TEMPERATURE)
    engine64 = reference_logp(engine, kept["engine"], tokens, TEMPERATURE)
    ratio64 = torch.exp(logp64 - old64)
    weight64 = torch.exp(old64 - engine64)
    if mode.startswith("sequence"):
        weight64 = torch.exp((old64 - engine64).sum(1, keepdim=True)).expand(rows, width)
    weight64 = weight64.clamp(max=3.0) if mode.endswith("truncate") else weight64 * (weight64 <= 3.0)
    surrogate = torch.minimum(ratio64 * advantages[:, None], ratio64.clamp(0.8, 1.2) * advantages[:, None])
    loss64 = -(surrogate * weight64).mean()  # "grpo" over rows of equal length: the mean over every token
    loss64.backward()

    theta32 = theta.clone().requires_grad_()
    logp, _ = selected_logprobs(theta32, tokens, TEMPERATURE, truncation=truncation)
    old_logp, _ = selected_logprobs(old, tokens, TEMPERATURE, truncation=truncation)
    sampling_logp, _ = selected_logprobs(engine, tokens, TEMPERATURE, truncation=truncation)
    assert (ratio64.detach() - 1.0).abs().max() > 0.2  # some tokens clip
    torch.testing.assert_close(torch.exp(logp - old_logp).double(), ratio64.detach(), atol=1e-5, rtol=1e-5)
    weights = sampler_correction_weights(sampler_log_ratio(old_logp, sampling_logp, mask, mode), mode)
    torch.testing.assert_close(weights.expand(rows, width).double(), weight64, atol=1e-5, rtol=1e-5)
    spec = LossSpec(importance_sampling_mode=mode)
    out = policy_loss(logp, old_logp, advantages.float(), mask, spec, sampling_logp=sampling_logp)
    torch.testing.assert_close(out.loss.double(), loss64.detach(), atol=1e-6, rtol=1e-5)
    out.loss.backward()
    torch.testing.assert_close(theta32.grad.double(), theta64.grad, atol=1e-6, rtol=1e-4)


def test_on_policy_with_one_arithmetic_the_ratio_and_the_sampler_weight_are_one():
    """Sampler and trainer on the same logits: the recorded log-prob is the trainer's, so the weight is 1 and the
    ratio too. Had the trainer kept the full softmax against a truncated record, both would be the kept mass."""
    truncation = Truncation(8, 0.75, 0.0)
    logits = random_logits(256, VOCAB, seed=11)
    tokens, recorded = sample_from_logits(logits, TEMPERATURE, truncation.top_k, truncation.top_p, seed=torch.tensor(2))
    trainer, _ = selected_logprobs(logits, tokens, TEMPERATURE, truncation=truncation)
    torch.testing.assert_close(trainer, recorded, atol=1e-6, rtol=0)
    mask = torch.ones(256, 1)
    weights = sampler_correction_weights(sampler_log_ratio(trainer[:, None], recorded[:, None], mask, "token_mask"),
                                         "token_mask")
    torch.testing.assert_close(weights, torch.ones_like(weights), atol=1e-5, rtol=0)
    kept = reference_kept(logits, TEMPERATURE, truncation.top_k, truncation.top_p, 0.0)
    kept_mass = torch.softmax(logits.double() / TEMPERATURE, -1).masked_fill(~kept, 0.0).sum(-1)
    full, _ = selected_logprobs(logits, tokens, TEMPERATURE)
    torch.testing.assert_close(torch.exp(full - recorded).double(), kept_mass, atol=1e-5, rtol=1e-5)
    assert kept_mass.max() < 0.99


def test_the_surrogate_gradient_is_the_truncated_policys_gradient():
    """Why the truncated family: at θ = θ_old, samples from μ_θ (truncated) average the loss's gradient to the
    gradient of E_{y~μ_θ}[A(y)], the expected advantage of what is actually sampled. With the full softmax's log π
    the same samples estimate something else: E[A] times the gradient of the kept mass's log is missing (small
    where advantages are centred, as a group's are at its first token; not at later tokens)."""
    truncation = Truncation(5, 0.9, 0.0)
    logits = random_logits(VOCAB, seed=12)
    kept = reference_kept(logits[None], TEMPERATURE, 5, 0.9, 0.0)[0]
    advantage = torch.linspace(0.0, 2.0, VOCAB, dtype=torch.float64).roll(7)  # a reward, no baseline
    theta = logits.double().requires_grad_()
    probs = torch.softmax((theta / TEMPERATURE).masked_fill(~kept, float("-inf")), -1)
    exact = torch.autograd.grad((probs * advantage).sum(), theta)[0]
    samples = reference_draw(logits.expand(200000, VOCAB), kept.expand(200000, VOCAB), TEMPERATURE, seed=13)

    def estimate(truncated: bool) -> torch.Tensor:
        batch = logits.expand(len(samples), VOCAB).clone().requires_grad_()
        logp, _ = selected_logprobs(batch, samples, TEMPERATURE, truncation=truncation if truncated else None)
        surrogate = (torch.exp(logp - logp.detach()) * advantage.float()[samples]).mean()  # ratio 1, ∇ = ∇ log π
        return torch.autograd.grad(surrogate, batch)[0].sum(0).double()

    truncated, full = estimate(True), estimate(False)
    assert (truncated - exact).abs().max() < 0.01
    assert (full - exact).abs().max() > 0.05
