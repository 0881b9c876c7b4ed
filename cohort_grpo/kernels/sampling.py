"""The engine's default sampling step (temperature > 0, no top-k/top-p/min-p) as one pass of Triton.

`gumbel_sample` reproduces `cohort_grpo.rollout.sampling.sample_from_logits(logits, temperature, seed=, draw=, rows=)`
without materialising the [B, V] noise, the scaled logits or the log-softmax: each program reads
its tile of the logits once and keeps, per lane, the running maximum and rescaled sum of
exponentials of the scaled logits (the online softmax normaliser of Milakov & Gimelshein 2018,
"Online normalizer calculation for softmax") and the best Gumbel-perturbed score with its index
(the Gumbel-max trick: Gumbel 1954; Maddison et al. 2014). A second, tiny kernel merges the
chunks of each row into its token and log-prob.

The noise is bit-for-bit `cohort_grpo.rollout.sampling.gumbel_noise`: the same 32-bit hash chain (Wellons'
"lowbias32", counter-based as in Salmon et al. 2011) on uint32, so shifts are logical and
products wrap, then the same float32 uniform and -log(-log(u)). Division by the temperature is
IEEE-rounded (`div_rn`) as torch's CPU division; eager torch on CUDA multiplies by 1/temperature
instead, so against it the tokens can differ where two perturbed scores are within a rounding.

Work split: a program covers `tile_size` logits, one row's block of a large vocabulary or several
rows of a small one. Small batches would leave most SMs idle with one program per row, so each
row's vocabulary is cut into chunks of whole blocks until there are about `target_programs`
programs; large batches get one chunk per row. The grid depends on shapes only, and seed, draw
and rows are read on the device, so a CUDA graph can capture the call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# triton None (not installed): the torch path; `triton` stays a module name for the tests
from cohort_grpo.kernels.triton_common import MAX_COMBINE, MIN_COMBINE, SUM_COMBINE, tl, triton  # noqa: F401
from cohort_grpo.kernels.triton_common import jit as _jit


DEFAULT_TILE_SIZE = 1024  # 8 logits per thread at 4 warps: 16-byte bf16 loads
DEFAULT_TARGET_PROGRAMS = 1024  # several waves of programs on a 132-SM H100


class SplitPlan(NamedTuple):
    """How `gumbel_sample` cuts a [batch, vocab] problem into programs (all powers of two but
    the counts)."""

    tile_rows: int  # rows per program of the first kernel
    block: int  # vocabulary lanes per row and loop step
    blocks_per_chunk: int  # loop steps per program
    num_chunks: int  # programs per row tile
    merge_rows: int  # rows per program of the merge kernel
    merge_chunks: int  # num_chunks rounded up to a power of two


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def split_plan(batch: int, vocab: int, tile_size: int, target_programs: int) -> SplitPlan:
    """The work split for `gumbel_sample`: tiles of `tile_size` (a power of two) logits, and
    enough chunks per row that there are about `target_programs` programs, no chunk empty."""
    block = min(tile_size, _next_pow2(vocab))
    tile_rows = min(tile_size // block, _next_pow2(batch))
    num_blocks = _cdiv(vocab, block)
    wanted_chunks = max(1, min(num_blocks, _cdiv(target_programs, _cdiv(batch, tile_rows))))
    blocks_per_chunk = _cdiv(num_blocks, wanted_chunks)
    num_chunks = _cdiv(num_blocks, blocks_per_chunk)
    merge_chunks = _next_pow2(num_chunks)
    merge_rows = max(1, min(tile_size // merge_chunks, _next_pow2(batch)))
    return SplitPlan(tile_rows, block, blocks_per_chunk, num_chunks, merge_rows, merge_chunks)


def gumbel_sample(
    logits: torch.Tensor,
    temperature: float,
    seed: torch.Tensor,
    draw: torch.Tensor,
    rows: torch.Tensor,
    *,
    tile_size: int = DEFAULT_TILE_SIZE,
    target_programs: int = DEFAULT_TARGET_PROGRAMS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` [B, V] (bf16, fp16 or fp32) at `temperature` > 0
    with the noise `sampling.gumbel_noise(seed, draw, rows, V)`; return (tokens [B] int64,
    log-probs [B] float32 of the tokens under softmax(logits / temperature)).

    seed: integer 0-dim tensor; draw: integer [B] or 0-dim; rows: integer [B]; all on logits'
    device. Ties between perturbed scores go to the smallest index, as torch.argmax.
    `tile_size` (a power of two) and `target_programs` change only the work split.
    """
    if temperature <= 0.0:
        raise ValueError(f"gumbel_sample needs temperature > 0, got {temperature}")
    batch, vocab = logits.shape
    device = logits.device
    tokens = torch.empty(batch, dtype=torch.int64, device=device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=device)
    if batch == 0:
        return tokens, logprobs
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    draw = draw.expand(batch) if draw.dim() == 0 else draw
    plan = split_plan(batch, vocab, tile_size, target_programs)
    chunk_stats = torch.empty(3, batch, plan.num_chunks, dtype=torch.float32, device=device)
    chunk_index = torch.empty(batch, plan.num_chunks, dtype=torch.int32, device=device)
    chunk_max, chunk_sumexp, chunk_best = chunk_stats.unbind(0)
    _partial_kernel[(_cdiv(batch, plan.tile_rows), plan.num_chunks)](
        logits, logits.stride(0), batch, vocab, float(temperature),
        seed, draw, draw.stride(0), rows, rows.stride(0),
        chunk_max, chunk_sumexp, chunk_best, chunk_index, plan.num_chunks, plan.blocks_per_chunk,
        ROWS=plan.tile_rows, BLOCK=plan.block, UNIT_TEMPERATURE=temperature == 1.0, PIPELINED=logits.is_cuda,
    )  # fmt: skip
    _merge_kernel[(_cdiv(batch, plan.merge_rows),)](
        logits, logits.stride(0), batch, float(temperature),
        chunk_max, chunk_sumexp, chunk_best, chunk_index, plan.num_chunks,
        tokens, logprobs, ROWS=plan.merge_rows, CHUNKS=plan.merge_chunks,
    )  # fmt: skip
    return tokens, logprobs


# An index no chunk holds, so it loses every min (a constexpr: kernels may read no other global).
_INT32_MAX = tl.constexpr(2**31 - 1) if tl is not None else None


@_jit
def _hash32(x):
    # sampling.hash32 on uint32: logical shifts, products modulo 2^32.
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@_jit
def _gumbel(row_key, token):
    # sampling.gumbel_noise for row keys [R, 1] and token indices [1, N], in float32.
    token_key = _hash32(token.to(tl.uint32) * tl.full([], 0x85EBCA6B, tl.uint32))
    bits = _hash32(row_key ^ token_key)
    uniform = (((bits >> 9) & 0x7FFFFF).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # as gumbel_noise: u < 1
    return -tl.log(-tl.log(uniform))


@_jit
def _fold_block(row_ptr, row_ok, row_key, lanes, start, vocab, temperature,
                lane_max, lane_sumexp, lane_best, lane_index, UNIT_TEMPERATURE: tl.constexpr):
    """One block of BLOCK logits per row folded into each lane's running max, sum of exps, best
    perturbed score and its index."""
    token = start + lanes
    in_tile = row_ok[:, None] & (token < vocab)
    scaled = tl.load(row_ptr + token, mask=in_tile, other=float("-inf")).to(tl.float32)
    if not UNIT_TEMPERATURE:  # x / 1 is x: the division (IEEE-rounded, as torch's) only when it changes x
        scaled = tl.math.div_rn(scaled, temperature)
    # Online sum of exps with one exp per logit: of exp(old_max - new_max) and exp(x - new_max) one
    # is exp(0) = 1, the other exp(-|x - old_max|).
    gap = scaled - lane_max
    decay = tl.exp(-tl.abs(gap))
    grown = lane_sumexp * decay + 1.0
    kept = lane_sumexp + decay
    lane_sumexp = tl.where(gap > 0, grown, tl.where(scaled == float("-inf"), lane_sumexp, kept))
    lane_max = tl.maximum(lane_max, scaled)
    perturbed = scaled + _gumbel(row_key, token)
    better = perturbed > lane_best  # strict: a later block never wins a tie
    lane_best = tl.where(better, perturbed, lane_best)
    lane_index = tl.where(better, token, lane_index)
    return lane_max, lane_sumexp, lane_best, lane_index


@_jit
def _partial_kernel(
    logits_ptr, row_stride, batch, vocab, temperature,
    seed_ptr, draw_ptr, draw_stride, rows_ptr, rows_stride,
    chunk_max_ptr, chunk_sumexp_ptr, chunk_best_ptr, chunk_index_ptr, num_chunks, blocks_per_chunk,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, UNIT_TEMPERATURE: tl.constexpr, PIPELINED: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = row < batch
    row64 = row.to(tl.int64)  # B * V may pass 2^31
    seed = tl.load(seed_ptr).to(tl.uint32)
    draw = tl.load(draw_ptr + row64 * draw_stride, mask=row_ok, other=0).to(tl.uint32)
    global_row = tl.load(rows_ptr + row64 * rows_stride, mask=row_ok, other=0).to(tl.uint32)
    row_key = _hash32(seed ^ _hash32(draw * tl.full([], 0x9E3779B9, tl.uint32) + global_row))
    row_key = row_key[:, None]
    row_ptr = logits_ptr + row64[:, None] * row_stride
    lanes = tl.arange(0, BLOCK)[None, :]
    start = tl.program_id(1) * blocks_per_chunk * BLOCK
    end = start + blocks_per_chunk * BLOCK
    lane_max = tl.full([ROWS, BLOCK], float("-inf"), tl.float32)
    lane_sumexp = tl.full([ROWS, BLOCK], 0.0, tl.float32)
    lane_best = tl.full([ROWS, BLOCK], float("-inf"), tl.float32)
    # A lane whose scores are all -inf keeps its first index: the smallest, as torch.argmax.
    lane_index = tl.full([ROWS, BLOCK], 0, tl.int32) + start + lanes
    if PIPELINED:  # range() lets the compiler prefetch the next block (software pipelining)
        for block_start in range(start, end, BLOCK):
            lane_max, lane_sumexp, lane_best, lane_index = _fold_block(
                row_ptr, row_ok, row_key, lanes, block_start, vocab, temperature,
                lane_max, lane_sumexp, lane_best, lane_index, UNIT_TEMPERATURE)  # fmt: skip
    else:
        # The interpreter (CPU tests) cannot run range() with a runtime bound under numpy >= 2.4;
        # the while loop has the same body.
        while start < end:
            lane_max, lane_sumexp, lane_best, lane_index = _fold_block(
                row_ptr, row_ok, row_key, lanes, start, vocab, temperature,
                lane_max, lane_sumexp, lane_best, lane_index, UNIT_TEMPERATURE)  # fmt: skip
            start += BLOCK
    chunk_max = tl.reduce(lane_max, 1, MAX_COMBINE)
    shift = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)
    chunk_sumexp = tl.reduce(lane_sumexp * tl.exp(lane_max - shift[:, None]), 1, SUM_COMBINE)
    chunk_best = tl.reduce(lane_best, 1, MAX_COMBINE)
    is_best = lane_best == chunk_best[:, None]
    chunk_index = tl.reduce(tl.where(is_best, lane_index, _INT32_MAX), 1, MIN_COMBINE)
    out = row64 * num_chunks + tl.program_id(1)
    tl.store(chunk_max_ptr + out, chunk_max, mask=row_ok)
    tl.store(chunk_sumexp_ptr + out, chunk_sumexp, mask=row_ok)
    tl.store(chunk_best_ptr + out, chunk_best, mask=row_ok)
    tl.store(chunk_index_ptr + out, chunk_index, mask=row_ok)


@_jit
def _merge_kernel(
    logits_ptr, row_stride, batch, temperature,
    chunk_max_ptr, chunk_sumexp_ptr, chunk_best_ptr, chunk_index_ptr, num_chunks,
    tokens_ptr, logprobs_ptr, ROWS: tl.constexpr, CHUNKS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = row < batch
    row64 = row.to(tl.int64)
    chunks = tl.arange(0, CHUNKS)[None, :]
    real = row_ok[:, None] & (chunks < num_chunks)
    at = row64[:, None] * num_chunks + chunks
    chunk_max = tl.load(chunk_max_ptr + at, mask=real, other=float("-inf"))
    chunk_sumexp = tl.load(chunk_sumexp_ptr + at, mask=real, other=0.0)
    chunk_best = tl.load(chunk_best_ptr + at, mask=real, other=float("-inf"))
    chunk_index = tl.load(chunk_index_ptr + at, mask=real, other=_INT32_MAX)
    row_max = tl.reduce(chunk_max, 1, MAX_COMBINE)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    sumexp = tl.reduce(chunk_sumexp * tl.exp(chunk_max - shift[:, None]), 1, SUM_COMBINE)
    logsumexp = shift + tl.log(tl.where(row_ok, sumexp, 1.0))  # rows past the batch: no log(0)
    best = tl.reduce(chunk_best, 1, MAX_COMBINE)
    token = tl.reduce(tl.where(chunk_best == best[:, None], chunk_index, _INT32_MAX), 1, MIN_COMBINE)
    logit = tl.load(logits_ptr + row64 * row_stride + token, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(tokens_ptr + row, token.to(tl.int64), mask=row_ok)
    tl.store(logprobs_ptr + row, tl.math.div_rn(logit, temperature) - logsumexp, mask=row_ok)
