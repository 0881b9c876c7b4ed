"""Log π(token), entropy and log-sum-exp of each row of an LM-head chunk's logits, in one Triton pass.

The chunked LM head (`cohort_grpo/update/logprobs.py`) turns each chunk's logits [n, V] (bf16, ~880 × 151,936)
into three float32 numbers per row. torch.compile lowers that to a reduction that reads the chunk once
for the maximum, again for the sum of exponentials and again for the entropy's Σ p·z, and a GRPO step
has hundreds of chunks. Here each program reads
its row once and keeps, per lane, the running maximum m, S = Σ exp(z − m) and T = Σ exp(z − m)·z,
rescaling both when m grows (the online softmax normaliser of Milakov & Gimelshein 2018, "Online
normalizer calculation for softmax", extended by the first moment). Then
logsumexp = m + log S and the entropy H = logsumexp − T / S (since p = exp(z − logsumexp)).

z = logits · (1 / temperature) in float32, as in `cohort_grpo.update.logprobs._chunk_forward`, the reference
the kernel is tested against.
"""

from __future__ import annotations

import torch

# triton None (not installed): the LM head uses torch ops; `triton` stays a module name for the tests
from cohort_grpo.kernels.triton_common import MAX_COMBINE, SUM_COMBINE, tl, triton  # noqa: F401
from cohort_grpo.kernels.triton_common import jit as _jit


BLOCK = 2048  # logits per loop step: 8 bf16 (16 bytes) per thread at 8 warps
NUM_WARPS = 8


def chunk_logprob_stats(logits: torch.Tensor, tokens: torch.Tensor, inv_temperature: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log π(token) [n], entropy [n], logsumexp [n]), float32, of softmax(logits · inv_temperature)
    for logits [n, V] (bf16, fp16 or fp32, unit stride along V) and tokens [n]."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(3, rows, dtype=torch.float32, device=logits.device)
    logp, entropy, lse = out.unbind(0)
    if rows:
        _stats_kernel[(rows,)](logits, logits.stride(0), tokens, tokens.stride(0), logp, entropy, lse, vocab,
                               float(inv_temperature), BLOCK=BLOCK, PIPELINED=logits.is_cuda,
                               num_warps=NUM_WARPS)
    return logp, entropy, lse


@_jit
def _fold(base, start, vocab, inv_temperature, lane_max, lane_sum, lane_moment, BLOCK: tl.constexpr):
    """BLOCK logits from `start` folded into each lane's (m, S, T), with one exp per logit: of
    exp(old m − new m) and exp(z − new m) one is exp(0) = 1, the other exp(−|z − old m|)."""
    offs = start + tl.arange(0, BLOCK)
    z = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32) * inv_temperature
    gap = z - lane_max
    decay = tl.exp(-tl.abs(gap))
    grows = gap > 0  # z is the lane's new maximum: the old sums shrink by `decay`, z adds exp(0)
    seen = z != float("-inf")  # padding lanes (and -inf logits) add nothing, and no 0 * -inf
    lane_sum = tl.where(grows, lane_sum * decay + 1.0, tl.where(seen, lane_sum + decay, lane_sum))
    lane_moment = tl.where(grows, lane_moment * decay + z, tl.where(seen, lane_moment + decay * z, lane_moment))
    return tl.maximum(lane_max, z), lane_sum, lane_moment


@_jit
def _stats_kernel(logits_ptr, row_stride, tokens_ptr, token_stride, logp_ptr, entropy_ptr, lse_ptr, vocab,
                  inv_temperature, BLOCK: tl.constexpr, PIPELINED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # rows × V may pass 2^31
    base = logits_ptr + row * row_stride
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_sum = tl.full([BLOCK], 0.0, tl.float32)
    lane_moment = tl.full([BLOCK], 0.0, tl.float32)
    if PIPELINED:  # range() lets the compiler prefetch the next block
        for start in range(0, vocab, BLOCK):
            lane_max, lane_sum, lane_moment = _fold(base, start, vocab, inv_temperature, lane_max, lane_sum,
                                                    lane_moment, BLOCK)
    else:  # the interpreter (CPU tests) cannot run range() with a runtime bound under numpy >= 2.4
        start = 0
        while start < vocab:
            lane_max, lane_sum, lane_moment = _fold(base, start, vocab, inv_temperature, lane_max, lane_sum,
                                                    lane_moment, BLOCK)
            start += BLOCK
    row_max = tl.reduce(lane_max, 0, MAX_COMBINE)
    weight = tl.where(lane_sum > 0, tl.exp(lane_max - row_max), 0.0)  # lanes that saw nothing weigh 0
    total = tl.reduce(lane_sum * weight, 0, SUM_COMBINE)
    moment = tl.reduce(lane_moment * weight, 0, SUM_COMBINE)
    lse = row_max + tl.log(total)
    token = tl.load(tokens_ptr + row * token_stride)
    # A token id outside [0, V) reads nothing outside its row: its log-prob is NaN, which the loss's
    # non-finite guard counts and skips, instead of whatever memory lies there (or an illegal address).
    in_vocab = (token >= 0) & (token < vocab)
    chosen = tl.load(base + tl.where(in_vocab, token, 0)).to(tl.float32) * inv_temperature
    chosen = tl.where(in_vocab, chosen, float("nan"))
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, chosen - lse)
    tl.store(entropy_ptr + row, lse - moment / total)
