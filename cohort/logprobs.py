"""Per-token log-probabilities of given tokens, without materialising `[B, T, vocab]` in float32.

A float32 logits tensor at 16 × 1024 × 151,936 is 10 GB. We take the final hidden states once and
apply the LM head over chunks of the sequence, keeping only the selected token's log-prob (and
the entropy, for logging) per position. Our own models expose the hidden states
(`return_hidden=True`); Hugging Face models fall back to their logits, restricted to the
completion positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class TokenLogprobs:
    logp: Tensor  # [B, T] log π(token_t | prefix), float32
    entropy: Tensor | None  # [B, T] entropy of π(· | prefix), float32, when asked for


def selected_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0, with_entropy: bool = False):
    """log softmax(logits / temperature)[token] for each position, in float32.

    `logits` `[..., V]`, `tokens` `[...]`. Uses logsumexp rather than a full log_softmax so only
    one `[..., V]` float32 temporary exists at a time.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = lse - (probs * logits).sum(-1)
    return logp, entropy


def supports_hidden(model) -> bool:
    return getattr(model, "supports_return_hidden", False)


def causal_logits(model, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None) -> Tensor:
    """Logits from either our CausalLM (a tensor) or a Hugging Face model (an output object)."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return out if isinstance(out, Tensor) else out.logits


def completion_logprobs(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_ids: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = 256,
) -> TokenLogprobs:
    """Log-probs of `completion_ids` `[B, T]`, the last T columns of `input_ids` `[B, P+T]`.

    The logits at column P−1+t predict completion token t. Position ids follow the attention mask
    (left-padded prompts start at position 0), matching how the sampler produced the tokens.
    """
    num_completion = completion_ids.shape[1]
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    if supports_hidden(model):
        hidden = model(input_ids, position_ids=position_ids, attention_mask=attention_mask, return_hidden=True)
        hidden = hidden[:, -num_completion - 1 : -1]
        head = model.lm_head.weight
        parts_logp, parts_ent = [], []
        for start in range(0, num_completion, chunk_size):
            logits = F.linear(hidden[:, start : start + chunk_size], head)
            logp, ent = selected_logprobs(logits, completion_ids[:, start : start + chunk_size], temperature, with_entropy)
            parts_logp.append(logp)
            parts_ent.append(ent)
        logp = torch.cat(parts_logp, dim=1)
        entropy = torch.cat(parts_ent, dim=1) if with_entropy else None
        return TokenLogprobs(logp, entropy)
    logits = causal_logits(model, input_ids, attention_mask, position_ids)[:, -num_completion - 1 : -1]
    logp, entropy = selected_logprobs(logits, completion_ids, temperature, with_entropy)
    return TokenLogprobs(logp, entropy)


def pack_prompt_completion(prompt_ids: list[list[int]], completion_ids: Tensor, completion_mask: Tensor, pad_id: int):
    """[left-padded prompt | completion] rows and their attention mask, for the log-prob passes."""
    width = max(len(p) for p in prompt_ids)
    batch = len(prompt_ids)
    prompt = torch.full((batch, width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((batch, width), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        prompt[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        prompt_mask[i, width - len(p) :] = 1
    input_ids = torch.cat([prompt, completion_ids.cpu()], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask.cpu().long()], dim=1)
    return input_ids, attention_mask
