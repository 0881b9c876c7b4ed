"""The Triton sampling kernel (cohort_grpo.kernels.sampling) against the torch reference
`sampling.sample_from_logits`: the same tokens for the same (seed, draw, rows), log-probs within
1e-5, and token frequencies that follow the softmax. Without CUDA the kernels run in Triton's CPU
interpreter; without triton the module is skipped."""

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the fused sampling kernel needs it")

from triton_interpreter import DEVICE, kernel_module  # noqa: E402

from cohort_grpo.rollout.sampling import gumbel_noise, sample_from_logits# noqa: E402

triton_sampling = kernel_module("cohort_grpo.kernels.sampling", "_partial_kernel")

# numpy warns where the interpreter takes log(0) = -inf on purpose: rows of nothing but -inf.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")

LOGPROB_ATOL = 1e-5  # float32 log-softmax of logits of std ~3 over <= 5003 tokens
NEAR_TIE = 1e-5  # two perturbed scores this close may order differently after float rounding


def check_against_reference(logits, temperature, seed, draw, rows, **split) -> torch.Tensor:
    """The kernel's tokens equal the reference's (or tie with them within float rounding) and its
    log-probs equal log softmax(logits / temperature) at those tokens within LOGPROB_ATOL."""
    tokens, logprobs = triton_sampling.gumbel_sample(logits, temperature, seed, draw, rows, **split)
    ref_tokens, ref_logprobs = sample_from_logits(logits, temperature, seed=seed, draw=draw, rows=rows)
    assert tokens.shape == ref_tokens.shape and tokens.dtype == torch.int64
    assert logprobs.shape == ref_logprobs.shape and logprobs.dtype == torch.float32
    scaled = logits.float() / temperature
    perturbed = scaled + gumbel_noise(seed, draw, rows, logits.shape[-1])
    differ = tokens != ref_tokens
    if differ.any():
        gap = perturbed.gather(1, ref_tokens[:, None]) - perturbed.gather(1, tokens[:, None])
        assert gap.squeeze(1)[differ].abs().max() < NEAR_TIE, (tokens, ref_tokens)
    expected = torch.where(differ, torch.log_softmax(scaled, -1).gather(1, tokens[:, None]).squeeze(1), ref_logprobs)
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=LOGPROB_ATOL)
    return tokens


# (batch, vocab, tile_size, target_programs): vocabularies that are no multiple of the block, and
# splits that exercise loops over several blocks, several chunks per row, a last chunk mostly
# past the vocabulary, several rows per program with a ragged last tile, and the default split.
SPLITS = [
    pytest.param(1, 5003, 512, 4, id="B1-10blocks-in-4chunks"),
    pytest.param(3, 1000, 256, 6, id="B3-2chunks-of-2blocks"),
    pytest.param(17, 5003, 8192, 1, id="B17-one-block-past-V"),
    pytest.param(17, 1000, 4096, 1, id="B17-4rows-per-program"),
    pytest.param(3, 5003, 1024, 1024, id="B3-default-split"),
]
# Seeds beyond int32 and negative ones check the int64 -> int32 wrap-around of the reference.
SEEDS = [0, 2**31 - 1, -5, 2**40 + 17, 123456789]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch, vocab, tile_size, target_programs", SPLITS)
def test_matches_reference(batch, vocab, tile_size, target_programs, dtype, temperature):
    case = len(SPLITS) * int(dtype == torch.bfloat16) + vocab % 97 + batch + int(temperature * 10)
    generator = torch.Generator().manual_seed(case)
    logits = (torch.randn(batch, vocab, generator=generator) * 3).to(dtype).to(DEVICE)
    rows = 10**6 + 7 * torch.arange(batch, device=DEVICE)  # global indices, not 0..B-1
    draw_per_row = torch.randint(0, 10**5, (batch,), generator=generator).to(DEVICE)
    split = dict(tile_size=tile_size, target_programs=target_programs)
    for seed, draw in [(SEEDS[case % 5], draw_per_row), (SEEDS[(case + 2) % 5], torch.tensor(41, device=DEVICE))]:
        check_against_reference(logits, temperature, torch.tensor(seed, device=DEVICE), draw, rows, **split)


def test_token_frequencies_follow_softmax():
    """Gumbel-max over rows that differ only in their `rows` key: each token's frequency is within
    3 standard errors sqrt(p(1-p)/n) of softmax(logits / T). The noise is a fixed hash, so the
    outcome is deterministic (largest deviation here 1.3 SE); sampling at T = 1 instead of 0.7
    would miss by about 15 SE."""
    num_rows, temperature = 4000, 0.7
    row_logits = torch.tensor([1.5, -0.5, 0.0, 2.0, 0.7, -2.0, 1.0, 0.3])
    logits = row_logits.expand(num_rows, -1).contiguous().to(DEVICE)
    rows = 3 * torch.arange(num_rows, device=DEVICE) + 11
    seed, draw = torch.tensor(2024, device=DEVICE), torch.tensor(9, device=DEVICE)
    tokens, logprobs = triton_sampling.gumbel_sample(logits, temperature, seed, draw, rows)
    probs = torch.softmax(row_logits / temperature, -1)
    frequencies = torch.bincount(tokens.cpu(), minlength=8).float() / num_rows
    standard_errors = (probs * (1 - probs) / num_rows).sqrt()
    assert ((frequencies - probs).abs() <= 3 * standard_errors).all(), (frequencies, probs)
    expected = probs.log()[tokens.cpu()]
    torch.testing.assert_close(logprobs.cpu(), expected, rtol=0, atol=LOGPROB_ATOL)


@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")  # -inf - -inf
def test_minus_inf_logits_are_never_drawn():
    """Masked tokens (-inf, as padding of a vocabulary) are never drawn and leave the log-probs
    of the others exact; a row of nothing but -inf gives token 0, as torch.argmax."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=generator) * 3
    logits[:, ::2] = float("-inf")
    logits[:, 250:] = float("-inf")
    logits = logits.to(DEVICE)
    rows, draw = torch.arange(6, device=DEVICE), torch.arange(6, device=DEVICE)
    seed = torch.tensor(77, device=DEVICE)
    tokens = check_against_reference(logits, 1.3, seed, draw, rows, tile_size=128, target_programs=12)
    assert torch.isfinite(logits.gather(1, tokens[:, None])).all()
    all_masked = torch.full((2, 300), float("-inf"), device=DEVICE)
    tokens, _ = triton_sampling.gumbel_sample(all_masked, 1.0, seed, draw[:2], rows[:2], tile_size=128, target_programs=1)
    assert tokens.tolist() == [0, 0]


def test_exact_ties_go_to_the_smallest_index():
    """Candidate logits so large (1e30) that adding any Gumbel noise leaves them unchanged: their
    perturbed scores tie exactly, in the same lane of different blocks and in different chunks,
    whatever the log implementation; the kernel picks the smallest index, as torch.argmax does."""
    vocab, seed, draw = 2000, torch.tensor(3), torch.tensor(1)
    rows = torch.tensor([10, 11])
    logits = torch.full((2, vocab), -50.0)
    candidates = torch.cat([5 + 256 * torch.arange(7), 3 + 256 * torch.arange(7)])  # lanes 5 and 3
    logits[0, candidates] = 1e30
    logits[1, candidates[candidates > 300]] = 1e30  # row 1: the smallest candidates left out
    perturbed = logits + gumbel_noise(seed, draw, rows, vocab)
    tied = perturbed == perturbed.max(1, keepdim=True).values
    assert tied.sum(1).tolist() == [14, 10], "precondition: the construction gives exact ties"
    logits, seed, draw, rows = (t.to(DEVICE) for t in (logits, seed, draw, rows))
    for target_programs in (1, 4):  # one chunk of 8 blocks per row; 4 chunks of 2 blocks
        tokens = check_against_reference(logits, 1.0, seed, draw, rows, tile_size=256, target_programs=target_programs)
        assert tokens.cpu().tolist() == [3, 515]


def test_strided_logits_and_int32_keys():
    """The last position of [B, T, V] logits (row stride T * V) with int32 seed, draw and rows."""
    generator = torch.Generator().manual_seed(9)
    hidden_logits = (torch.randn(4, 3, 700, generator=generator) * 3).to(DEVICE)
    logits = hidden_logits[:, -1]
    assert logits.stride(0) == 3 * 700
    int32 = dict(dtype=torch.int32, device=DEVICE)
    seed, draw = torch.tensor(-123, **int32), torch.tensor([5, 0, 9, 2], **int32)
    rows = torch.tensor([2**31 - 1, 0, 70000, 3], **int32)
    check_against_reference(logits, 0.9, seed, draw, rows, tile_size=256)


def test_empty_batch_and_zero_temperature():
    empty = torch.zeros(0, 50, device=DEVICE)
    keys = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    tokens, logprobs = triton_sampling.gumbel_sample(empty, 1.0, torch.tensor(0, device=DEVICE), keys, keys)
    assert tokens.shape == (0,) and logprobs.shape == (0,)
    with pytest.raises(ValueError, match="temperature > 0"):
        triton_sampling.gumbel_sample(torch.zeros(1, 50, device=DEVICE), 0.0, keys, keys, keys)


@pytest.mark.parametrize("batch", [1, 2, 3, 17, 64, 1000, 1024])
@pytest.mark.parametrize("vocab", [1, 8, 1000, 5003, 151_936])
@pytest.mark.parametrize("tile_size, target_programs", [(1024, 1024), (256, 6), (8192, 1)])
def test_split_plan_tiles_every_logit_once(batch, vocab, tile_size, target_programs):
    """Chunks of whole blocks cover the vocabulary, none starts past it, tiles stay within
    `tile_size`, and constexpr sizes are powers of two (tl.arange needs them)."""
    plan = triton_sampling.split_plan(batch, vocab, tile_size, target_programs)
    chunk_width = plan.blocks_per_chunk * plan.block
    assert plan.num_chunks * chunk_width >= vocab > (plan.num_chunks - 1) * chunk_width
    assert plan.tile_rows * plan.block <= tile_size
    assert plan.merge_rows == 1 or plan.merge_rows * plan.merge_chunks <= tile_size
    for size in (plan.tile_rows, plan.block, plan.merge_rows, plan.merge_chunks):
        assert size & (size - 1) == 0
    assert plan.merge_chunks >= plan.num_chunks
    # Whole blocks per chunk may round the chunk count down, never below half of what was asked.
    row_tiles = math.ceil(batch / plan.tile_rows)
    asked = min(target_programs, row_tiles * math.ceil(vocab / plan.block))
    assert 2 * row_tiles * plan.num_chunks >= asked
