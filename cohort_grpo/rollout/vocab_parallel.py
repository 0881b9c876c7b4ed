"""Sampling when the vocabulary is split over ranks, without gathering the logits.

Each of T ranks of a process group holds the logits of one contiguous slice [vocab_start,
vocab_start + width) of the vocabulary, as a vocabulary-parallel output layer leaves them.
`sample_vocab_parallel` draws the tokens `cohort_grpo.rollout.sampling.sample_from_logits` draws from
the concatenated logits, and their log-probs, exchanging a few numbers per row and rank. The
reductions follow Megatron-LM's vocabulary-parallel cross-entropy (Shoeybi et al. 2019, "Megatron-LM:
Training Multi-Billion Parameter Language Models Using Model Parallelism"): each rank reduces its
slice, and only the reductions travel.

- Draw: the Gumbel-max trick (Gumbel 1954; Maddison et al. 2014) makes the token the argmax of
  l_i / temperature + g_i, and the noise g_i is a hash of (seed, draw, row, global token index)
  (`sampling.gumbel_noise`), so a rank computes its columns' perturbed scores bit for bit as one
  process does. The token is the best (score, index) pair over ranks, a tie going to the lowest
  index as torch.argmax's does.
- Log-prob (of the distribution drawn from, the temperature-scaled softmax renormalised over the
  tokens the filters keep, as `sample_from_logits`): the log-sum-exp of the row's kept tokens from
  each rank's (max, sum of exp relative to it), merged as the online softmax normaliser merges
  chunks (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"); it travels in the
  gather of the ranks' best draws.
- top-k: the k-th largest logit of the row is among the union of the ranks' own k largest, so
  the ranks gather k values each (and, for ties at their k-th value, how many equal it).
- top-p: the cut needs the mass of the most probable tokens in order. With top-k on, the top-k
  lists hold every kept token. Without it each rank sends its `FIRST_TOP_P_CANDIDATES` largest
  logits; every token above the largest of the ranks' last sent values is then known in order,
  and if their mass reaches top-p the cut lies among them. Otherwise the lists double and are
  gathered again, until the cut is found or the lists are whole slices: a flat distribution with
  top-p near 1 can cost about log2(V / T / 64) extra gathers, the last of up to twice a slice's
  width per rank. Where the cut falls inside a run of equal logits, the run's tokens of lowest
  index are kept, as `sampling.top_p_filter`'s stable sort keeps them; each rank counts the run's
  tokens on the ranks before it from the lists.
- min-p: its threshold is the row's largest logit (always kept by top-k and top-p) plus
  log(min_p), computed as `sampling.min_p_filter` computes it.

Exactness: the tokens kept by top-k and min-p, and every argmax, are those of one process bit for
bit. The top-p cut compares a mass summed in float64 from merged partial sums where one process
sums float32 probabilities of the whole row, so the two can keep different tokens where a
cumulative mass lies within float32 rounding (~1e-7) of top-p: a uniform row of 1000 tokens at
top-p 0.3, say (one process on CPU and on CUDA round such cases differently too). Log-probs equal
one process's within float32 rounding of the log-sum-exp (the last step, logit - log-sum-exp, is
the same float32 subtraction).

Collectives per call, all-gathers of float64 tensors of B rows (B = batch) from each rank:
greedy or plain temperature: one [B, 5]; min-p alone: [B, 2] then [B, 5]; top-k (with or without
top-p and min-p): [B, k + 3] then [B, 5]; top-p without top-k: [B, 64 + 3], then [B, c + 1] for each
doubling c (up to the vocabulary size) while some row's cut is not found, then [B, 5]. Only that
last mode reads anything on the host (whether to gather again), so the others can be captured in
a CUDA graph. The slices are checked once, at set-up, by `check_vocab_slices`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from cohort_grpo.rollout.sampling import gumbel_noise, noise_keys, scale_by_temperature

NEG_INF = float("-inf")
FIRST_TOP_P_CANDIDATES = 64  # values per rank and row in top-p's first gather (top-k off)


def sample_vocab_parallel(
    local_logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: torch.Tensor | None = None,
    draw: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    *,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from logits split over the ranks of `group`; return (tokens [B]
    long, log-probs [B] float32), the same on every rank and equal to `sample_from_logits` of the
    full logits with the same arguments.

    local_logits: [B, width], the columns vocab_start .. vocab_start + width - 1 of a vocabulary of
    `vocab_size`; the ranks' slices, in rank order, must tile the vocabulary (`check_vocab_slices`
    checks it once). Every rank passes the same rows, settings and (seed, draw, rows) keys. With
    `functools.partial` over the keyword-only arguments it takes `sample_from_logits`'s arguments.
    """
    batch, width = local_logits.shape
    if width < 1 or vocab_start < 0 or vocab_start + width > vocab_size:
        raise ValueError(f"slice [{vocab_start}, {vocab_start + width}) is empty or outside "
                         f"a vocabulary of {vocab_size}")
    seed, draw, rows = noise_keys(seed, draw, rows, batch, local_logits.device)
    logits = local_logits.float()
    if temperature <= 0.0:  # greedy; its log-prob at temperature 1, as sample_from_logits
        return draw_unfiltered(logits, logits, vocab_start, group)
    scaled = scale_by_temperature(logits, temperature)
    perturbed = scaled + gumbel_noise(seed, draw, rows, width, vocab_start)
    top_k = top_k if 0 < top_k < vocab_size else 0
    if top_k == 0 and top_p >= 1.0 and min_p <= 0.0:
        return draw_unfiltered(scaled, perturbed, vocab_start, group)
    keep, _ = filtered_tokens(scaled, top_k, top_p, min_p, vocab_size, group)
    filtered = perturbed.masked_fill(~keep, NEG_INF)
    local = torch.cat([best_draw(filtered, scaled, vocab_start), max_and_sumexp(scaled.masked_fill(~keep, NEG_INF))],
                      dim=1)
    gathered = gather_from_ranks(local, group)
    tokens, chosen = merge_draws(gathered[..., :3])
    return tokens, chosen.float() - merged_logsumexp(gathered[..., 3], gathered[..., 4]).float()


def reads_host(temperature: float, top_k: int, top_p: float, min_p: float, vocab_size: int) -> bool:
    """Whether `sample_vocab_parallel` with these settings reads a result on the host (top-p without
    top-k: whether to gather longer lists again), so that a CUDA graph cannot capture it."""
    return temperature > 0.0 and top_p < 1.0 and not 0 < top_k < vocab_size


def draw_unfiltered(scaled, perturbed, vocab_start, group):
    """Greedy or plain temperature sampling: one gather of each rank's best (score, index, logit)
    and (max, sum of exp)."""
    local = torch.cat([best_draw(perturbed, scaled, vocab_start), max_and_sumexp(scaled)], dim=1)
    gathered = gather_from_ranks(local, group)
    tokens, chosen = merge_draws(gathered[..., :3])
    return tokens, chosen.float() - merged_logsumexp(gathered[..., 3], gathered[..., 4]).float()


def filtered_tokens(scaled, top_k, top_p, min_p, vocab_size, group):
    """(mask [B, width] of this slice's tokens that top-k, top-p and min-p keep, the row's
    log-sum-exp [B] float64), from one gather (two or more for top-p without top-k)."""
    lists_needed = top_k > 0 or top_p < 1.0
    count = top_k if top_k > 0 else min(FIRST_TOP_P_CANDIDATES, vocab_size)
    parts = [max_and_sumexp(scaled)] + ([largest_values(scaled, count)] if lists_needed else [])
    gathered = gather_from_ranks(torch.cat(parts, dim=1), group)
    maxima, sumexps = gathered[..., 0], gathered[..., 1]
    row_max = maxima.amax(dim=0)
    logsumexp = merged_logsumexp(maxima, sumexps)
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if lists_needed:
        lists, left_out = gathered[..., 2:-1], gathered[..., -1]
    if top_k > 0:
        kth = torch.topk(rows_of_ranks(lists), top_k, dim=-1).values[:, -1]
        keep &= scaled >= kth.float()[:, None]
        if top_p < 1.0:
            # The kept tokens: the listed ones above the k-th value, then every token equal to it.
            above = rows_of_ranks(lists).masked_fill(rows_of_ranks(lists) <= kth[:, None], NEG_INF)
            left_out_ties = torch.where(lists[..., -1] == kth, left_out.clamp(min=0), 0)  # -1: a whole slice
            tail_count = (lists == kth[None, :, None]).sum(-1) + left_out_ties
            tail_count = tail_count.sum(0).double()
            kept_mass = torch.exp(above - row_max[:, None]).sum(-1) + tail_count * torch.exp(kth - row_max)
            cut = top_p_cut(above, kth, tail_count, row_max + torch.log(kept_mass), top_p)[:2]
            keep &= top_p_keep(scaled, lists, left_out, *cut, group)
    elif top_p < 1.0:
        cut = top_p_by_rounds(scaled, lists, left_out, logsumexp, top_p, vocab_size, group)
        keep &= top_p_keep(scaled, *cut, group)
    if min_p > 0.0:
        # As sampling.min_p_filter: the float32 row maximum plus log(min_p), in float32.
        keep &= scaled >= row_max.float()[:, None] + math.log(min_p)
    return keep, logsumexp


def top_p_by_rounds(scaled, lists, left_out, logsumexp, top_p, vocab_size, group):
    """Top-p over the whole vocabulary: gather longer lists until every row's cut is among the
    tokens known in order. Returns (lists, left_out, cut value, tokens kept at the cut value).
    Whether to gather again is read on the host: a CUDA graph cannot capture this path."""
    count = lists.shape[-1]
    cut_value = keep_at_cut = found = None
    while True:
        frontier = torch.where(left_out >= 0, lists[..., -1], NEG_INF).amax(dim=0)  # [B]
        # Tokens above the frontier are all listed; those at or below it may not be.
        known = rows_of_ranks(lists)
        known = known.masked_fill(known <= frontier[:, None], NEG_INF)
        no_tail = torch.zeros_like(frontier)
        value, at_cut, now_found = top_p_cut(known, frontier, no_tail, logsumexp, top_p)
        now_found |= frontier == NEG_INF  # every finite logit is listed: the cut (if any) is known
        if found is None:
            cut_value, keep_at_cut, found = value, at_cut, now_found
        else:  # rows settled earlier keep their cut
            cut_value = torch.where(found, cut_value, value)
            keep_at_cut = torch.where(found, keep_at_cut, at_cut)
            found = found | now_found
        if bool(found.all()):
            return lists, left_out, cut_value, keep_at_cut
        count = min(2 * count, vocab_size)
        gathered = gather_from_ranks(largest_values(scaled, count), group)
        lists, left_out = gathered[..., :-1], gathered[..., -1]


def top_p_cut(known, tail_value, tail_count, log_norm, top_p):
    """Where the top-p cut falls in a row's kept tokens, ordered by logit: `known` [B, n] float64
    (descending once sorted, -inf for none) followed by `tail_count` tokens of logit `tail_value`
    below all of them, probabilities exp(l - log_norm). Returns (cut value, how many tokens of
    that value are kept, whether the cut was found), float64 [B] and bool [B].

    As sampling.top_p_filter: the token at position j is kept when j = 0 or the mass of positions
    before j is below top_p (compared with top_p rounded to float32, as a float32 tensor is). The
    last kept position is thus the first whose cumulative mass reaches top_p. Not found: (-inf,
    inf), every token kept.
    """
    threshold = float(torch.tensor(top_p, dtype=torch.float32))
    known = torch.sort(known, dim=-1, descending=True).values
    mass = torch.cumsum(torch.exp(known - log_norm[:, None]), dim=-1)
    reached = (mass >= threshold) & (known > NEG_INF)  # -inf: no token
    found = reached.any(dim=-1)
    last = reached.int().argmax(dim=-1)  # the first position that reaches it
    value = known.gather(1, last[:, None]).squeeze(1)
    kept_equal = (last + 1 - (known > value[:, None]).sum(-1)).double()
    # Not reached among the known tokens: the tail's tokens, all of one probability, continue the run.
    before = mass[:, -1]
    each = torch.exp(tail_value - log_norm)
    tail_kept = torch.ceil((threshold - before) / each).clamp(min=0)
    tail_kept = torch.minimum(tail_kept, tail_count)
    tail_kept = torch.where(known[:, 0] == NEG_INF, tail_kept.clamp(min=1), tail_kept)  # position 0 stays
    in_tail = ~found & (tail_count > 0)
    value = torch.where(found, value, torch.where(in_tail, tail_value, NEG_INF))
    kept_equal = torch.where(found, kept_equal, torch.where(in_tail, tail_kept, math.inf))
    return value, kept_equal, found | in_tail


def top_p_keep(scaled, lists, left_out, cut_value, keep_at_cut, group):
    """This slice's tokens top-p keeps: those above the cut value, and of those equal to it the
    `keep_at_cut` of lowest global index (ranks before this one hold the lower ones)."""
    left_out = left_out.clamp(min=0)  # -1: a whole slice
    at_cut = (lists == cut_value[None, :, None]).sum(-1) + torch.where(lists[..., -1] == cut_value, left_out, 0)
    rank = dist.get_rank(group)
    before = at_cut[:rank].sum(0)  # [B] tokens of the cut value on earlier ranks
    cut = cut_value.float()[:, None]
    tie = scaled == cut
    order = torch.cumsum(tie, dim=-1) - tie.long() + before[:, None].long()
    return (scaled > cut) | (tie & (order < keep_at_cut[:, None]))


def largest_values(scaled: torch.Tensor, count: int) -> torch.Tensor:
    """[B, count + 1] float64: the slice's `count` largest logits of each row, descending (-inf
    past its width), and how many tokens equal to the last of them the list leaves out (-1 when
    the list is the whole slice)."""
    batch, width = scaled.shape
    taken = min(count, width)
    values = torch.topk(scaled, taken, dim=-1).values
    if taken < width:
        left_out = (scaled >= values[:, -1:]).sum(-1, keepdim=True) - taken
    else:
        left_out = torch.full((batch, 1), -1, dtype=torch.long, device=scaled.device)
    padding = torch.full((batch, count - taken), NEG_INF, device=scaled.device)
    return torch.cat([values.double(), padding.double(), left_out.double()], dim=1)


def best_draw(perturbed: torch.Tensor, scaled: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """[B, 3] float64: each row's best perturbed score in the slice, its global index (the lowest
    among equals, as torch.argmax) and its scaled logit."""
    index = perturbed.argmax(dim=-1, keepdim=True)
    best = perturbed.gather(1, index)
    return torch.cat([best.double(), (index + vocab_start).double(), scaled.gather(1, index).double()], dim=1)


def merge_draws(draws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranks' best draws [T, B, 3] -> (tokens [B] long, their scaled logits [B] float64): the
    best score, a tie going to the lowest index."""
    score, index, logit = draws.unbind(-1)
    contender = torch.where(score == score.amax(dim=0), index, math.inf)
    winner = contender.argmin(dim=0, keepdim=True)
    return index.gather(0, winner).squeeze(0).long(), logit.gather(0, winner).squeeze(0)


def max_and_sumexp(scaled: torch.Tensor) -> torch.Tensor:
    """[B, 2] float64: each row's largest logit in the slice and the float32 sum of exp(l - it)
    (0 in place of an infinite largest, as torch.logsumexp)."""
    row_max = scaled.amax(dim=-1, keepdim=True)
    shift = torch.where(torch.isinf(row_max), 0.0, row_max)
    sumexp = torch.exp(scaled - shift).sum(-1, keepdim=True)
    return torch.cat([row_max.double(), sumexp.double()], dim=1)


def merged_logsumexp(maxima: torch.Tensor, sumexps: torch.Tensor) -> torch.Tensor:
    """The row's log-sum-exp [B] float64 from the ranks' [T, B] (max, sum of exp relative to it)."""
    row_max = maxima.amax(dim=0)
    shift = torch.where(torch.isinf(row_max), 0.0, row_max)
    local_shift = torch.where(torch.isinf(maxima), 0.0, maxima)
    return shift + torch.log((sumexps * torch.exp(local_shift - shift)).sum(0))


def rows_of_ranks(lists: torch.Tensor) -> torch.Tensor:
    """[T, B, n] per-rank lists -> [B, T * n]: each row's values from every rank side by side."""
    ranks, batch, n = lists.shape
    return lists.permute(1, 0, 2).reshape(batch, ranks * n)


def check_vocab_slices(vocab_start: int, width: int, vocab_size: int, group: dist.ProcessGroup | None = None,
                       device: torch.device | str = "cpu") -> None:
    """Raise ValueError on every rank unless the ranks' slices [vocab_start, vocab_start + width),
    in rank order, tile [0, vocab_size). One gather of two numbers per rank: for set-up, since
    `sample_vocab_parallel` trusts its arguments (a check each step would read the result on the
    host, a sync a CUDA graph cannot capture). `device`: where the group's backend gathers (cuda for
    NCCL)."""
    gathered = gather_from_ranks(torch.tensor([vocab_start, width], dtype=torch.float64, device=device), group)
    starts, widths = gathered[:, 0].long(), gathered[:, 1].long()
    if not torch.equal(starts, torch.cumsum(widths, 0) - widths) or int(widths.sum()) != vocab_size:
        raise ValueError(f"the ranks' vocabulary slices (start, width) {list(zip(starts.tolist(), widths.tolist()))} "
                         f"do not tile a vocabulary of {vocab_size} in rank order")


def gather_from_ranks(local: torch.Tensor, group) -> torch.Tensor:
    """[T, *local.shape]: every rank's `local` (same shape on all), in rank order."""
    world = dist.get_world_size(group)
    gathered = local.new_empty((world * local.shape[0], *local.shape[1:]))  # gloo wants them end to end
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(gathered, local.contiguous(), group=group)
    return gathered.view(world, *local.shape)
