"""Prefill: admitted prompts into their KV-cache rows, and each sequence's first token.

Each distinct prompt (its tokens and, for a vision-language model, its images) runs once, into the row of its first
sequence; its keys and values are then copied to the rows of the other sequences with that prompt (GRPO's G
completions of a prompt share it). Every sequence's first
token is sampled from its prompt's last position, under its own noise key. Prompts go in chunks of at most
`prefill_tokens` padded tokens, sorted by length so a chunk pads little; for a model with linear-attention layers
(`keeps_recurrent_state`) a chunk holds prompts of one length, as pad tokens after a prompt would run into its
recurrent state. Host data goes to the device without
syncing (`to_device`): the engine may have a decode chunk in flight meanwhile.
"""

from __future__ import annotations

import torch

from cohort_grpo.kernels.elementwise import fused_kernels
from cohort_grpo.models.cache import KVCache
from cohort_grpo.models.exact_layers import head_logits
from cohort_grpo.rollout.overlap import to_device
from cohort_grpo.rollout.sampler import SamplingParams
from cohort_grpo.rollout.sampling import sampling_key
from cohort_grpo.rollout.sequence import Sequence, SlotState
from cohort_grpo.rollout.token_sampler import TokenSampler
from cohort_grpo.rollout.layout import prompt_groups


def prefill(model, cache: KVCache, state: SlotState, admitted: list[Sequence], params: SamplingParams,
            prefill_tokens: int, sample: TokenSampler) -> dict[str, int]:
    """Prefill the `admitted` sequences (each already holds its slot) and start them in `state`, their first
    tokens drawn by `sample` (the engine's `token_sampler(model)`). Returns the counts the engine reports:
    forwards, padded tokens, rows that copied a shared prompt."""
    groups = [[admitted[i] for i in group]
              for group in prompt_groups([seq.prompt_key for seq in admitted], max_rows=len(admitted))]
    groups.sort(key=lambda group: len(group[0].prompt))  # similar lengths pad less
    counts = dict(prefill_forwards=0, prefill_tokens=0, prefill_shared_rows=0)
    unpadded = getattr(model, "keeps_recurrent_state", False)
    start = 0
    while start < len(groups):
        end = start + 1
        while end < len(groups) and (end + 1 - start) * len(groups[end][0].prompt) <= prefill_tokens and not (
                unpadded and len(groups[end][0].prompt) != len(groups[start][0].prompt)):
            end += 1
        tokens, shared = prefill_chunk(model, cache, state, groups[start:end], params, sample)
        counts["prefill_forwards"] += 1
        counts["prefill_tokens"] += tokens
        counts["prefill_shared_rows"] += shared
        start = end
    return counts


def prefill_chunk(model, cache: KVCache, state: SlotState, groups: list[list[Sequence]],
                  params: SamplingParams, sample: TokenSampler) -> tuple[int, int]:
    """One forward over the first sequence of each group; (padded tokens, rows that copied a prompt)."""
    device = model.device
    firsts = [group[0] for group in groups]
    lengths = [len(seq.prompt) for seq in firsts]
    width = max(lengths)
    # Right padding: pad tokens sit at positions after the prompt, so no real token attends to
    # them, and the keys they write are overwritten by the completion before anything reads them.
    input_ids = torch.full((len(firsts), width), params.pad_token_id, dtype=torch.long)
    for row, seq in enumerate(firsts):
        input_ids[row, : len(seq.prompt)] = torch.tensor(seq.prompt, dtype=torch.long)
    input_ids = to_device(input_ids, device)
    positions = torch.arange(width, device=device).expand(len(firsts), width)
    chunk = [seq for group in groups for seq in group]
    slots = to_device([seq.slot for seq in chunk], device)
    cache.own_rows(slots)  # these rows are rewritten
    # A vision-language prompt's images run through the vision tower here, once per prompt (vision_language.py).
    images = {"images": [seq.images for seq in firsts]} if any(seq.images is not None for seq in firsts) else {}
    # Plain ops here: a prefill runs once per prompt, not worth compiled variants for every length.
    with fused_kernels(False):
        hidden = model(input_ids, positions, kv_cache=cache, cache_rows=to_device([seq.slot for seq in firsts], device),
                       return_hidden=True, cache_len=width, **images)
    copies = [(group[0].slot, seq.slot, len(seq.prompt)) for group in groups for seq in group[1:]]
    if copies:
        source, target, length = zip(*copies)
        cache.share_prefix(to_device(list(source), device), to_device(list(target), device), width,
                           to_device(list(length), device))
    last = to_device([n - 1 for n in lengths], device)
    # Logits only at each prompt's last position: the full [B, T, V] tensor would be huge. (A shard's head
    # gives its slice of the vocabulary, which `sample` expects.)
    logits = head_logits(model, hidden[torch.arange(len(firsts), device=device), last])
    logits = logits[to_device([i for i, group in enumerate(groups) for _ in group], device)]
    # Token 0 of each sequence, keyed by its global index (params.sequence_offset + its row):
    # sequences sharing a prompt share its logits, not their draws.
    sequences = to_device([seq.noise_key(params.sequence_offset) for seq in chunk], device)
    tokens, logprobs = sample(logits, *sampling_key(params), seed=state.seed,
                              draw=torch.zeros_like(sequences), rows=sequences)
    limits = to_device([seq.limit for seq in chunk], device)
    prompt_lengths = to_device([len(seq.prompt) for seq in chunk], device)
    state.start(slots, tokens, logprobs, prompt_lengths, limits, sequences)
    return len(firsts) * width, len(copies)
