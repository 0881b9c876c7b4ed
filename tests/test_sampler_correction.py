"""The sampler/trainer mismatch: measured every step (TRL's `sampling/*` metrics) and corrected by
importance weights π_trainer / π_sampler (token or sequence level, truncated or masked), through the
plain and the fused log-prob paths alike."""

import math

import pytest
import torch

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.algorithm import objectives
from cohort_grpo.algorithm.objectives import (BatchShare, LossSpec, policy_loss, sampler_correction_weights,
                                         sampler_log_ratio)
from cohort_grpo.errors import CohortError
from cohort_grpo.update.fused_head import FusedHead
from cohort_grpo.update.logprobs import micro_batch_logprobs
from helpers import UPDATE_PROMPTS, variable_batch


def test_correction_weights_worked_examples():
    ratios = torch.tensor([[0.5, 1.2, 4.0]])
    log_ratio = ratios.log()
    assert sampler_correction_weights(log_ratio, "token_truncate", None, 3.0).tolist()[0] == pytest.approx([0.5, 1.2, 3.0])
    assert sampler_correction_weights(log_ratio, "token_mask", None, 3.0).tolist()[0] == pytest.approx([0.5, 1.2, 0.0])
    assert sampler_correction_weights(log_ratio, "token_truncate", 0.8, 3.0).tolist()[0] == pytest.approx([0.8, 1.2, 3.0])
    assert sampler_correction_weights(log_ratio, "token_mask", 0.8, None).tolist()[0] == pytest.approx([0.0, 1.2, 4.0])
    # sequence level: one ratio per completion, the product of its tokens' ratios (padding excluded)
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    sampler = torch.tensor([[-1.5, -2.5, 9.0], [-1.0, -3.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    seq = sampler_log_ratio(trainer, sampler, mask, "sequence_mask")
    assert seq.shape == (2, 1) and seq.squeeze(1).tolist() == pytest.approx([1.0, 2.0])
    assert sampler_correction_weights(seq, "sequence_mask", None, 3.0).squeeze(1).tolist() == pytest.approx([math.e, 0.0])
    assert sampler_correction_weights(seq, "sequence_truncate", None, 3.0).squeeze(1).tolist() == pytest.approx([math.e, 3.0])


def _float64_loss(logp, old, sampling, adv, mask, correction, clip_max=3.0, eps=0.2):
    """Per token, in float64 loops: −min(ρA, clip(ρ)A) · w, w the corrected π_old / π_sampler; grpo mean."""
    rows = []
    for b in range(logp.shape[0]):
        n = int(mask[b].sum())
        seq_ratio = math.exp(sum(float(old[b, t] - sampling[b, t]) for t in range(n)))
        total = 0.0
        for t in range(n):
            rho = math.exp(float(logp[b, t] - old[b, t]))
            surrogate = -min(rho * float(adv[b]), min(max(rho, 1 - eps), 1 + eps) * float(adv[b]))
            r = seq_ratio if correction.startswith("sequence") else math.exp(float(old[b, t] - sampling[b, t]))
            w = min(r, clip_max) if correction.endswith("truncate") else (0.0 if r > clip_max else r)
            total += surrogate * w
        rows.append(total / n)
    return sum(rows) / len(rows)


@pytest.mark.parametrize("correction", objectives.SAMPLER_CORRECTIONS)
def test_policy_loss_weighs_the_surrogate_as_an_independent_computation(correction):
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    logp = -torch.rand(3, 4, generator=g, dtype=torch.float64) * mask
    old = (logp + 0.1 * torch.randn(3, 4, generator=g, dtype=torch.float64)) * mask
    sampling = (old + 0.8 * torch.randn(3, 4, generator=g, dtype=torch.float64)) * mask  # some ratios above 3
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    out = policy_loss(logp, old, adv, mask, LossSpec(importance_sampling_mode=correction), sampling_logp=sampling)
    want = _float64_loss(logp, old, sampling, adv, mask, correction)
    assert out.loss.item() == pytest.approx(want, abs=1e-12)
    unweighted = policy_loss(logp, old, adv, mask).loss.item()
    assert abs(unweighted - want) > 1e-3  # the weights really change the loss here


@pytest.mark.parametrize("correction", objectives.SAMPLER_CORRECTIONS)
def test_fused_and_plain_paths_apply_the_same_correction(tiny_dir, correction):
    from cohort_grpo.models import from_pretrained
    from cohort_grpo.update.packing import pack_micro_batch

    torch.manual_seed(0)
    model = from_pretrained(tiny_dir, dtype="float32").train()
    prompt_ids, completion, mask = variable_batch(model.config.vocab_size, seed=4, rows=6)
    micro = pack_micro_batch(prompt_ids, completion, mask, list(range(6)), pad_id=0)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        current = micro_batch_logprobs(model, micro).logp
    sampling = (current + 0.6 * torch.randn(mask.shape, generator=g)) * mask
    old = current if correction.startswith("sequence") else None  # sequence weights need π_old up front
    advantages = torch.randn(6, generator=g)
    spec = LossSpec(importance_sampling_mode=correction, loss_type="dapo")
    share = BatchShare(6, 6, float(mask.sum()))
    results = []
    for fused in (True, False):
        model.zero_grad(set_to_none=True)
        if fused:
            out = policy_loss(FusedHead(model, micro, chunk_rows=4), old, advantages, mask, spec, sampling_logp=sampling,
                              share=share)
        else:
            out = policy_loss(micro_batch_logprobs(model, micro).logp, old, advantages, mask, spec, sampling_logp=sampling,
                              share=share)
        out.loss.backward()
        results.append((out, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (a, grads_a), (b, grads_b) = results
    assert a.loss.item() == pytest.approx(b.loss.item(), abs=1e-6)
    for key in b.stats:
        assert a.stats[key].item() == pytest.approx(b.stats[key].item(), abs=1e-5), key
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(grads_a, grads_b))
    assert b.stats["sampling/sampling_logp_difference/max"] > 0.5


def _trainer(tiny_dir, tmp_path, **overrides):
    args = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=4, max_steps=1,
                output_dir=str(tmp_path), quiet=True, save_steps=0, learning_rate=1e-3, max_grad_norm=1e9)
    args.update(overrides)
    return GRPOTrainer(tiny_dir, lambda completions, **_: [float(len(c) % 3) for c in completions], UPDATE_PROMPTS,
                       args=GRPOConfig(**args))


@pytest.mark.slow
def test_every_step_logs_the_mismatch_and_the_correction_reaches_the_update(tiny_dir, tmp_path):
    """A sampler that reports every token 10 nats less likely than the trainer finds it: ratio e^10
    > clip_max, so token_mask drops every sample and the update has no gradient; uncorrected it has one."""
    grad_norms = {}
    for correction in (False, True):
        trainer = _trainer(tiny_dir, tmp_path / str(correction), importance_sampling_correction=correction,
                           importance_sampling_mode="token_mask")
        assert trainer.sampler_correction == ("token_mask" if correction else None)
        rollout = trainer.rollouts.group_sampler.__call__

        def skewed(*args, **kwargs):
            batch = rollout(*args, **kwargs)
            batch.rollout.logprobs = batch.rollout.logprobs - 10.0 * batch.rollout.completion_mask
            return batch

        trainer.rollouts.group_sampler = skewed  # the synchronous source's sampling stage
        trainer.train()
        record = trainer.history[0]
        assert record["sampling/sampling_logp_difference/mean"] == pytest.approx(10.0, abs=1e-3)
        grad_norms[correction] = record["grad_norm"]
    assert grad_norms[False] > 1e-3 and grad_norms[True] == 0.0


def test_the_correction_is_automatic_where_the_sampler_is_not_exact(tiny_dir, tmp_path):
    assert _trainer(tiny_dir, tmp_path / "cpu", device="cpu").sampler_correction is None  # float32: exact enough
    if torch.cuda.is_available():  # bf16 on a GPU: the engine's log-probs are not the trainer's
        assert _trainer(tiny_dir, tmp_path / "gpu", device="cuda").sampler_correction == "token_truncate"
    assert GRPOConfig(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="sequence_mask",
                      vllm_importance_sampling_cap=2.0).validate().importance_sampling_mode == "sequence_mask"
    with pytest.raises(CohortError, match="importance_sampling_mode"):
        GRPOConfig(importance_sampling_mode="sequence").validate()
    with pytest.raises(CohortError, match="delta"):
        GRPOConfig(delta=0.9).validate()
