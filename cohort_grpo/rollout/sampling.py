"""Token sampling on the device: temperature, top-k, top-p, min-p, greedy.

Small pure functions over a `[B, V]` float logits tensor. Filters return new logits with the
removed tokens set to -inf; the order of application follows Hugging Face's logits warpers
(temperature, top-k, top-p, min-p). The recorded log-prob of a sampled token is that of the
distribution it was drawn from: softmax at the temperature over the tokens the filters keep,
renormalised (`Truncation`; the full softmax when no filter is on). The trainer computes its log π_old
and log π_θ in the same family (`kept_logits`), so the GRPO ratio and the sampler correction compare
like with like (docs/concepts.md, "Truncated sampling").

References: top-k (Fan et al. 2018, "Hierarchical Neural Story Generation"), top-p / nucleus
(Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"), min-p (Nguyen et al.
2024, "Turning Up the Heat: Min-p Sampling for Creative and Coherent LLM Outputs").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cohort_grpo.kernels import logprobs as head_kernels
from cohort_grpo.kernels.sampling import gumbel_sample
from cohort_grpo.kernels.elementwise import fused, triton_kernel_on

NEG_INF = float("-inf")


def scale_by_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide logits by the temperature (temperature 0 is greedy and is handled by the caller)."""
    if temperature == 1.0:
        return logits
    return logits / temperature


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the `top_k` largest logits of each row (ties with the k-th value are kept); 0 = off."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, NEG_INF)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most probable tokens whose probability mass reaches `top_p`.

    A token is kept when the mass of the tokens ranked strictly above it is below `top_p`, so the
    most probable token is always kept; tokens of equal logit are ranked by index. 1.0 = off.
    """
    if top_p >= 1.0:
        return logits
    # Stable: tokens of equal logit are ranked by index, so where the cut falls inside a run of
    # equal logits (common with bf16 logits) the lowest indices are kept, on every device, and a
    # vocabulary split over ranks can make the same cut (cohort_grpo/rollout/vocab_parallel.py).
    sorted_logits, sorted_index = torch.sort(logits, dim=-1, descending=True, stable=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_above = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    remove_sorted = mass_above >= top_p
    remove_sorted[..., 0] = False
    remove = torch.zeros_like(remove_sorted).scatter_(-1, sorted_index, remove_sorted)
    return logits.masked_fill(remove, NEG_INF)


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep tokens whose probability is at least `min_p` times the row's largest probability; 0 = off."""
    if min_p <= 0.0:
        return logits
    # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p): no softmax needed.
    threshold = logits.amax(dim=-1, keepdim=True) + math.log(min_p)
    return logits.masked_fill(logits < threshold, NEG_INF)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """Apply top-k, then top-p, then min-p (Hugging Face's warper order)."""
    return min_p_filter(top_p_filter(top_k_filter(logits, top_k), top_p), min_p)


@dataclass(frozen=True)
class Truncation:
    """Which tokens a sampled distribution keeps: top-k, then top-p, then min-p over softmax at the temperature;
    the others get probability 0 and the kept ones are renormalised. The engine draws from it, and every log-prob
    the loss compares (the sampler's, π_old's, π_θ's, π_ref's) is of it."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @classmethod
    def of(cls, settings) -> "Truncation | None":
        """The truncation of `settings` (a `GRPOConfig` or `SamplingParams`: temperature, top_k, top_p, min_p), or
        None where nothing is cut: no filter on, or greedy (temperature 0) decoding, which filters nothing."""
        truncation = cls(settings.top_k or 0, settings.top_p, settings.min_p or 0.0)
        greedy = settings.temperature is not None and settings.temperature <= 0.0
        return None if greedy or not truncation.cuts else truncation

    @property
    def cuts(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def kept_logits(logits: torch.Tensor, tokens: torch.Tensor, inv_temperature: float,
                truncation: Truncation) -> torch.Tensor:
    """`logits` [n, V] (their dtype) with -inf in place of each token `truncation` drops from
    softmax(logits · inv_temperature), each row's `tokens` [n] always kept: the log-softmax of the result at
    that temperature is the truncated distribution's. The sampled token is in its row's kept set wherever the
    row's logits are those it was drawn from; kept regardless, a token the trainer's logits (rounded
    differently) would have cut still gets a finite log-prob for the sampler correction to weigh. The engine's
    exact-numerics sampler and the trainer run this one function, so equal logits give equal bits."""
    scaled = logits.float() * inv_temperature
    dropped = torch.isneginf(filter_logits(scaled, truncation.top_k, truncation.top_p, truncation.min_p))
    dropped[torch.arange(len(tokens), device=tokens.device), tokens] = False
    return logits.masked_fill(dropped, NEG_INF)


def _int32(constant: int) -> int:
    """A 32-bit constant as the signed int32 with the same bits."""
    return constant - (1 << 32) if constant >= 1 << 31 else constant


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixing function (Wellons' "lowbias32", from the hash-prospector search):
    every input bit flips each output bit with probability ≈ 1/2. On int32 tensors: products wrap
    modulo 2^32 and the masks make the right shifts logical, so the bits are those of the
    unsigned original."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _int32(0x846CA68B)
    return x ^ ((x >> 16) & 0xFFFF)


def gumbel_noise(seed: torch.Tensor, draw: torch.Tensor, rows: torch.Tensor, vocab: int,
                 vocab_start: int = 0) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, vocab] for the tokens vocab_start .. vocab_start + vocab - 1, from a
    counter-based generator (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3"):
    the number for (seed, draw, row, token) is a hash of those four integers, not the next output
    of a stateful generator.

    The engine passes row = the *global* index of the sequence (its row in the whole batch, over
    all ranks) and draw = the index of the token being drawn within that sequence, so a
    completion's tokens depend on the seed, its prompt and its index only: not on which KV slot
    it occupies, how many sequences share a decode step, nor on how the batch is split over
    processes (cohort_grpo/parallel/distributed.py). No generator state is involved, so a captured CUDA graph
    can sample: `seed`, `draw` and `rows` are device tensors the graph reads. Under
    torch.compile it is one elementwise kernel.
    The token's number is its index in the whole vocabulary, so a rank holding the slice that
    starts at `vocab_start` draws the very numbers one process draws for those columns
    (cohort_grpo/rollout/vocab_parallel.py).
    seed: integer scalar; draw: integer scalar or [B]; rows: integer [B].
    """
    seed, draw, rows = seed.to(torch.int32), draw.to(torch.int32), rows.to(torch.int32)
    row_key = hash32(seed ^ hash32(draw * _int32(0x9E3779B9) + rows))  # [B]
    token = torch.arange(vocab_start, vocab_start + vocab, device=rows.device, dtype=torch.int32)
    bits = hash32(row_key[:, None] ^ hash32(token * _int32(0x85EBCA6B))[None, :])  # [B, vocab]
    # 23 bits: (n + 0.5) / 2^23 is exact in float32 and strictly inside (0, 1). With 24 bits the
    # largest n + 0.5 rounds up to 2^24, u = 1 and g = +inf: that token would win whatever its
    # logit (one draw in ~110 at a 152k vocabulary).
    uniform = (((bits >> 9) & 0x7FFFFF).float() + 0.5) * (1.0 / 8388608.0)
    return -torch.log(-torch.log(uniform))


def noise_keys(seed: torch.Tensor | None, draw: torch.Tensor | None, rows: torch.Tensor | None, batch: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (seed, draw, rows) keys of `gumbel_noise` with their defaults: seed 0, draw 0, rows 0..batch-1."""
    seed = torch.zeros((), dtype=torch.int64, device=device) if seed is None else seed
    draw = torch.zeros((), dtype=torch.int64, device=device) if draw is None else draw
    rows = torch.arange(batch, device=device) if rows is None else rows
    return seed, draw, rows


def sample_from_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: torch.Tensor | None = None,
    draw: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return `(tokens [B] long, logprobs [B] float32)`: each token's log-prob in
    the distribution it was drawn from, softmax(logits / temperature) over the tokens top-k, top-p and
    min-p keep, renormalised (`Truncation`).

    Temperature 0 means greedy (argmax); its log-prob is then taken at temperature 1, unfiltered. Sampling
    uses the Gumbel-max trick (Gumbel 1954; Maddison et al. 2014): argmax(l_i + g_i) with g_i ~
    Gumbel(0, 1) picks token i with probability softmax(l)_i, so no softmax or cumulative sum of
    the filtered logits is needed. The noise is `gumbel_noise(seed, draw, rows)`: the same
    (seed, draw, rows) give the same tokens (defaults: seed 0, draw 0, rows 0..B-1; draw may be a
    [B] tensor, one token index per row). Filtered
    tokens have l_i = -inf and are never picked.
    """
    seed, draw, rows = noise_keys(seed, draw, rows, logits.shape[0], logits.device)
    # One compiled function when the engine turns fused kernels on (see cohort_grpo.kernels.elementwise): the
    # noise is recomputed inside the reduction that picks the token, never stored as a [B, V] tensor.
    if temperature <= 0.0:
        return fused("sample", _sample)(logits, temperature, top_k, top_p, min_p, None)
    if top_k <= 0 and top_p >= 1.0 and min_p <= 0.0 and triton_kernel_on(logits):
        return gumbel_sample(logits, temperature, seed, draw, rows)  # one pass, hand-written (cohort_grpo/kernels/sampling.py)
    return fused("sample_gumbel", _sample_gumbel)(logits, temperature, top_k, top_p, min_p, seed, draw, rows)


def sample_with_head_logprobs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                              min_p: float = 0.0, seed: torch.Tensor | None = None, draw: torch.Tensor | None = None,
                              rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_from_logits`'s tokens, each with the log-prob the trainer's LM head computes from the same
    logits (`kernels/logprobs.py`, at 1 / temperature, 1 when greedy; over `kept_logits` when top-k, top-p
    or min-p cut): the engine's sampler under exact numerics, where the two must be the same bits
    (cohort_grpo/models/exact_layers.py)."""
    tokens, _ = sample_from_logits(logits, temperature, top_k, top_p, min_p, seed=seed, draw=draw, rows=rows)
    inv_temperature = 1.0 / temperature if temperature > 0.0 else 1.0
    truncation = Truncation(top_k, top_p, min_p)
    if temperature > 0.0 and truncation.cuts:
        logits = kept_logits(logits, tokens, inv_temperature, truncation)
    return tokens, head_kernels.chunk_logprob_stats(logits, tokens, inv_temperature)[0]


def _sample_gumbel(logits, temperature: float, top_k: int, top_p: float, min_p: float, seed, draw, rows):
    return _sample(logits, temperature, top_k, top_p, min_p, gumbel_noise(seed, draw, rows, logits.shape[-1]))


def _sample(logits, temperature: float, top_k: int, top_p: float, min_p: float, noise):
    logits = logits.float()
    if temperature <= 0.0:
        tokens = logits.argmax(dim=-1)
        return tokens, _token_logprobs(logits, tokens)
    scaled = scale_by_temperature(logits, temperature)
    filtered = filter_logits(scaled, top_k, top_p, min_p)
    tokens = (filtered + noise).argmax(dim=-1)
    return tokens, _token_logprobs(filtered, tokens)  # the distribution drawn from: renormalised over the kept


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] per row, without materialising the full log-softmax."""
    return logits.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def sampling_key(params) -> tuple:
    """The sampling settings a decode step bakes in (part of a CUDA graph's key): temperature, top-k, top-p, min-p
    of a `SamplingParams`."""
    return (params.temperature, params.top_k, params.top_p, params.min_p)
