"""The order of a decode step's token copies by expert, as one Triton launch: a stable counting sort.

A mixture of experts' layer sends each token's k copies to their experts, grouped (`moe.SparseMoeBlock`): the
copies sorted by expert (stable, so one expert's copies keep token order), each expert's cumulative end, and
each sorted copy's token. torch does that in about six launches a layer (the ids' cast, a radix sort, a gather,
an arange, a search, a cast), a few microseconds each, which at a decode step's few copies costs more than
the work. Here program e counts the copies routed below expert e (its start) and writes its own copies' places
in one pass: `expert_order(ids, E, k)` gives exactly `torch.argsort(ids, stable=True)`, that order // k, and
`searchsorted`'s ends, with nothing on the host, so a CUDA graph captures it.
"""

from __future__ import annotations

import torch

from cohort_grpo.kernels.triton_common import SUM_COMBINE, jit, tl, triton

# The copies one program reads at a time; a decode step of 512 sequences × top-8 is 4,096.
MAX_BLOCK = 1024


@jit
def _expert_order_kernel(ids_ptr, order_ptr, tokens_ptr, ends_ptr, n, top_k, BLOCK: tl.constexpr):
    """Program e: start = copies routed to experts below e; then e's copies, in copy order, to start, start+1, ..."""
    expert = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    start = tl.reduce(tl.full([BLOCK], 0, tl.int32), 0, SUM_COMBINE)  # an int32 scalar the loops carry
    for first in range(0, n, BLOCK):
        copy = first + offs
        ids = tl.load(ids_ptr + copy, mask=copy < n, other=0)
        start += tl.reduce(((copy < n) & (ids < expert)).to(tl.int32), 0, SUM_COMBINE)
    for first in range(0, n, BLOCK):
        copy = first + offs
        ids = tl.load(ids_ptr + copy, mask=copy < n, other=0)
        mine = (copy < n) & (ids == expert)
        place = start + tl.associative_scan(mine.to(tl.int32), 0, SUM_COMBINE) - 1  # inclusive count - 1
        tl.store(order_ptr + place, copy.to(tl.int64), mask=mine)
        tl.store(tokens_ptr + place, (copy // top_k).to(tl.int64), mask=mine)
        start += tl.reduce(mine.to(tl.int32), 0, SUM_COMBINE)
    tl.store(ends_ptr + expert, start)


def expert_order(ids: torch.Tensor, num_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For `ids` [n] (each token's k expert ids in a row, flattened): `order` [n] int64, the copies sorted by
    expert (stable); `tokens` [n] int64, each sorted copy's token (order // k); `ends` [E] int32, each expert's
    cumulative end in that order."""
    n = ids.numel()
    ids = ids.reshape(-1).contiguous()
    order = torch.empty(n, dtype=torch.int64, device=ids.device)
    tokens = torch.empty_like(order)
    ends = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    block = max(16, min(MAX_BLOCK, triton.next_power_of_2(max(n, 1))))
    _expert_order_kernel[(num_experts,)](ids, order, tokens, ends, n, top_k, BLOCK=block, num_warps=4)
    return order, tokens, ends
