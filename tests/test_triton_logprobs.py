"""The one-pass LM-head statistics kernel (cohort_grpo.kernels.logprobs) against the torch reference
`logprobs._chunk_forward` and a float64 log-softmax: log π(token), entropy and log-sum-exp per row,
across vocabularies that are not a multiple of the kernel's block, temperatures, dtypes, strided
rows, a far-from-zero logit scale and -inf logits. Without CUDA the kernel runs in Triton's
interpreter; without triton the module is skipped."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the LM-head statistics kernel needs it")

from triton_interpreter import DEVICE, kernel_module  # noqa: E402

from cohort_grpo.update.logprobs import _chunk_forward# noqa: E402

triton_logprobs = kernel_module("cohort_grpo.kernels.logprobs", "_stats_kernel")


def float64_stats(logits, tokens, inv_temperature):
    z = logits.double() * inv_temperature
    log_p = torch.log_softmax(z, dim=-1)
    p = log_p.exp()
    entropy = -(torch.where(p > 0, p * log_p, 0.0)).sum(-1)
    return log_p.gather(-1, tokens[:, None]).squeeze(-1), entropy, torch.logsumexp(z, dim=-1)


@pytest.mark.parametrize("vocab", [1, 777, 2048, 5003])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_and_float64(vocab, temperature, dtype):
    g = torch.Generator().manual_seed(vocab)
    logits = (3 * torch.randn(5, vocab, generator=g)).to(dtype).to(DEVICE)
    tokens = torch.randint(0, vocab, (5,), generator=g).to(DEVICE)
    logp, entropy, lse = triton_logprobs.chunk_logprob_stats(logits, tokens, 1.0 / temperature)
    ref_logp, ref_entropy, ref_lse = _chunk_forward(logits, tokens, 1.0 / temperature)
    assert torch.allclose(logp, ref_logp, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)
    assert torch.allclose(entropy, ref_entropy, atol=2e-5)
    exact = float64_stats(logits.cpu(), tokens.cpu(), 1.0 / temperature)
    for got, want in zip((logp, entropy, lse), exact):
        assert torch.allclose(got.cpu().double(), want, atol=2e-5)
    if vocab == 1:
        assert torch.all(entropy.abs() < 1e-6) and torch.all(logp.abs() < 1e-6)


def test_strided_rows_large_offsets_and_minus_inf():
    g = torch.Generator().manual_seed(0)
    wide = 40 + 4 * torch.randn(6, 3000, generator=g)  # logits far from 0: the shift matters
    wide[1, 100:2500] = float("-inf")  # masked-out entries: probability 0, no NaN
    logits = wide[:, :2900].to(DEVICE)  # row stride 3000, not the vocabulary
    tokens = torch.tensor([0, 50, 2899, 7, 1234, 2048]).to(DEVICE)
    logp, entropy, lse = triton_logprobs.chunk_logprob_stats(logits, tokens, 1.0)
    exact = float64_stats(logits.cpu(), tokens.cpu(), 1.0)
    for got, want in zip((logp, entropy, lse), exact):
        assert torch.isfinite(got).all()
        assert torch.allclose(got.cpu().double(), want, atol=5e-5)


def test_empty_chunk():
    logits = torch.zeros(0, 10, device=DEVICE)
    logp, entropy, lse = triton_logprobs.chunk_logprob_stats(logits, torch.zeros(0, dtype=torch.long,
                                                                                 device=DEVICE), 1.0)
    assert logp.shape == entropy.shape == lse.shape == (0,)


def test_a_token_outside_the_vocabulary_is_nan_and_reads_no_other_row():
    """Token ids -1 and V (padding written as -1, or a tokenizer larger than the head) give NaN, which the
    loss's non-finite guard counts; the in-range rows keep the reference values."""
    g = torch.Generator().manual_seed(3)
    vocab = 777
    logits = torch.randn(4, vocab, generator=g).to(DEVICE)
    tokens = torch.tensor([5, -1, vocab, vocab - 1]).to(DEVICE)
    logp, entropy, lse = triton_logprobs.chunk_logprob_stats(logits, tokens, 1.0)
    want = torch.log_softmax(logits.cpu().double(), -1)
    assert torch.isnan(logp[1]) and torch.isnan(logp[2])
    assert torch.allclose(logp[[0, 3]].cpu().double(), want[[0, 3], [5, vocab - 1]], atol=1e-5)
    assert torch.isfinite(entropy).all() and torch.isfinite(lse).all()
