"""Sampling behind one interface: prompts in, G completions per prompt out.

The trainer only ever talks to a `Sampler`. Two implement it: the fast KV-cache engine
(`cohort_grpo.rollout.engine.Engine`, for our own model implementations) and `HFGenerateSampler`, a thin
wrapper over Hugging Face `generate` that serves every other architecture.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from cohort_grpo.rollout.records import COMPLETION, PAD_TOKEN, POSITION, RowRecord, record_field
from cohort_grpo.rollout.turns import TURN_NOISE_STRIDE, TurnHandler


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    stop: list[str] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int = 0
    seed: int | None = None
    # Global index of this call's first completion (the engine keys its sampling noise by global
    # completion index and token index): a rank sampling rows [o, o + n) of a batch split over
    # several processes passes o, and draws exactly what one process sampling the whole batch would.
    sequence_offset: int = 0


@dataclass
class Rollout(RowRecord):
    """G completions for each prompt, rows group-contiguous (prompt i → rows i*G … i*G+G-1). Every field is one
    value per row, declared with its layout (cohort_grpo/rollout/records.py), so selecting, joining and saving rows
    carry each of them."""

    # [B, T] long, right-padded with pad_token_id
    completion_ids: torch.Tensor = record_field(COMPLETION, pad=PAD_TOKEN)
    # [B, T] long, 1 on generated tokens up to and including the first EOS
    completion_mask: torch.Tensor = record_field(COMPLETION)
    # [B, T] float32 log-probs of the distribution each token was drawn from (temperature, then top-k / top-p /
    # min-p renormalised: rollout/sampling.py), or None
    logprobs: torch.Tensor | None = record_field(COMPLETION)
    finish_reasons: list[str] = record_field()  # "stop" (EOS or stop string) or "length"
    # Multi-turn rollouts (cohort_grpo/rollout/turns.py): [B, T] long, 1 on tokens the model sampled, 0 on
    # tokens appended between its turns (tool results); None when nothing was appended (every token sampled).
    tool_mask: torch.Tensor | None = record_field(COMPLETION, default=None,
                                                  absent=lambda part: torch.ones_like(part.completion_mask))
    # A mixture-of-experts model's expert ids per row and position of [prompt | completion], as the
    # sampler routed them: [B, S, MoE layers, k] int16 (zeros past a row's end), or None (routing replay).
    routed_experts: torch.Tensor | None = record_field(POSITION, default=None)

    @property
    def loss_mask(self) -> torch.Tensor:
        """[B, T] the tokens the policy is trained on: the completion's, less any appended ones (TRL's
        `completion_mask * tool_mask`)."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask

    def rows(self, start: int, stop: int) -> "Rollout":
        """Rows [start, stop), every per-row field, cut to their longest completion (`trimmed`)."""
        return self.select(slice(start, stop)).trimmed()

    def trimmed(self) -> "Rollout":
        """The completion tensors cut to the longest completion: a part of a larger rollout is then what sampling it
        alone gives (`routed_experts`, by position of prompt and completion, is kept as it is)."""
        mask = self.completion_mask
        width = max(1, int(mask.sum(dim=1).max())) if mask.shape[0] else 1
        return self if width >= self.completion_ids.shape[1] else self.cut(width)


class Sampler(Protocol):
    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 turns=None) -> Rollout:
        """`turns`: a `cohort_grpo.rollout.turns.TurnHandler` for multi-turn (tool-calling) rollouts."""
        ...


def completion_mask_from_eos(ids: torch.Tensor, eos_token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask that keeps tokens up to and including the first EOS; also says which rows hit one.

    >>> completion_mask_from_eos(torch.tensor([[5, 2, 7], [5, 6, 7]]), [2])[0].tolist()
    [[1, 1, 0], [1, 1, 1]]
    """
    if not eos_token_ids:
        return torch.ones_like(ids), torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    is_eos = torch.isin(ids, torch.tensor(eos_token_ids, device=ids.device))
    # Count EOS tokens strictly before each position: a token is kept while that count is zero.
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return (eos_before == 0).long(), is_eos.any(dim=1)


def find_stop_string(tokenizer, tokens: list[int], checked_upto: int, stop: list[str]) -> int | None:
    """How many of `tokens` to keep when a stop string appears in their text, else None.

    The kept tokens end with the token that completes the earliest stop string. Only text that
    can involve tokens after `checked_upto` (those not scanned at an earlier check) is decoded:
    the window reaches back far enough to hold any stop string even when each character spans
    several byte tokens (4 bytes per UTF-8 character at most). The tokens are decoded together
    (a character split over byte tokens decodes right), and the cut is found by bisection: once
    a prefix's text holds a stop string every longer prefix's does, so O(log n) decodes.
    """
    if checked_upto >= len(tokens):
        return None
    lookback = 4 * max(len(s) for s in stop) + 4
    window_start = max(0, checked_upto - lookback)

    def has_stop(end: int) -> bool:
        text = tokenizer.decode(tokens[window_start:end], skip_special_tokens=False)
        return any(s in text for s in stop)

    if not has_stop(len(tokens)):
        return None
    low, high = checked_upto, len(tokens)  # has_stop(high) holds; the cut is in (low, high]
    while high - low > 1:
        middle = (low + high) // 2
        if has_stop(middle):
            high = middle
        else:
            low = middle
    return high


def apply_stop_strings(
    ids: torch.Tensor, mask: torch.Tensor, stop: list[str], tokenizer
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut each row after the token that completes the first stop string (as the engine does,
    `find_stop_string`); returns (mask, stopped)."""
    stopped = torch.zeros(ids.shape[0], dtype=torch.bool)
    if not stop:
        return mask, stopped
    mask = mask.clone()
    for row in range(ids.shape[0]):
        length = int(mask[row].sum())
        keep = find_stop_string(tokenizer, ids[row, :length].tolist(), 0, stop)
        if keep is not None:
            mask[row, keep:] = 0
            stopped[row] = True
    return mask, stopped


class HFGenerateSampler:
    """Fallback sampler: Hugging Face `generate` on the trained model itself (no copy)."""

    def __init__(self, model, tokenizer=None):
        self.model = model
        self.tokenizer = tokenizer

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 turns=None) -> Rollout:
        if turns is not None:
            return generate_turn_by_turn(self, prompt_ids, num_generations, params, turns)
        return self.generate_single_turn(prompt_ids, num_generations, params)

    @torch.no_grad()
    def generate_single_turn(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams) -> Rollout:
        model = self.model
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        # Left-pad so every prompt ends at the same column and generation starts together.
        width = max(len(p) for p in prompt_ids)
        rows = [p for p in prompt_ids for _ in range(num_generations)]
        input_ids = torch.full((len(rows), width), params.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, p in enumerate(rows):
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention_mask[i, width - len(p) :] = 1
        greedy = params.temperature == 0
        kwargs = dict(do_sample=not greedy, max_new_tokens=params.max_new_tokens, pad_token_id=params.pad_token_id)
        if not greedy:
            kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None)
            if params.min_p:
                kwargs["min_p"] = params.min_p
        kwargs["eos_token_id"] = list(params.eos_token_ids) or None
        if params.seed is not None:
            torch.manual_seed(params.seed)
        try:
            out = model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **kwargs
            )
        finally:
            model.train(was_training)
        ids = out[:, width:].cpu()
        if ids.shape[1] == 0:
            ids = torch.full((len(rows), 1), params.pad_token_id, dtype=torch.long)
        mask, hit_eos = completion_mask_from_eos(ids, params.eos_token_ids)
        if self.tokenizer is not None:
            mask, hit_stop = apply_stop_strings(ids, mask, params.stop, self.tokenizer)
        else:
            hit_stop = torch.zeros_like(hit_eos)
        ids = ids.masked_fill(mask == 0, params.pad_token_id)
        reasons = ["stop" if (e or s) else "length" for e, s in zip(hit_eos.tolist(), hit_stop.tolist())]
        return Rollout(completion_ids=ids, completion_mask=mask, logprobs=None, finish_reasons=reasons)


def generate_turn_by_turn(sampler, prompt_ids: list[list[int]], num_generations: int, params, handler: TurnHandler):
    """Multi-turn rollouts over any `Sampler` that cannot pause a sequence (Hugging Face `generate`): each
    round samples the next turn of every continuing sequence together, so a round waits for its slowest
    tool. Same contract and output as the engine's (`Rollout.tool_mask`)."""
    first = sampler.generate(prompt_ids, num_generations, params)
    prompts = [p for p in prompt_ids for _ in range(num_generations)]
    rows = len(prompts)
    tokens = [ids[m.bool()].tolist() for ids, m in zip(first.completion_ids, first.completion_mask)]
    logprobs = [[0.0] * len(t) if first.logprobs is None else first.logprobs[i, :len(t)].tolist()
                for i, t in enumerate(tokens)]
    sampled = [[1] * len(t) for t in tokens]
    reasons, turn_start = list(first.finish_reasons), [0] * rows
    active = list(range(rows))
    turn = 0
    try:
        while active:
            answers = {}
            for i in active:
                if reasons[i] != "stop" or len(tokens[i]) >= params.max_new_tokens:
                    continue
                answer = handler.end_of_turn(i, list(tokens[i]), turn_start[i])
                answer = answer.result() if isinstance(answer, Future) else answer
                if answer is not None:
                    answers[i] = [int(t) for t in answer][:params.max_new_tokens - len(tokens[i])]
            for i, appended in answers.items():
                tokens[i] += appended
                logprobs[i] += [0.0] * len(appended)
                sampled[i] += [0] * len(appended)
            active = [i for i in answers if len(tokens[i]) < params.max_new_tokens]
            for i in answers:
                if len(tokens[i]) >= params.max_new_tokens:
                    reasons[i] = "length"
            if not active:
                break
            turn += 1
            room = max(params.max_new_tokens - len(tokens[i]) for i in active)
            seed = None if params.seed is None else params.seed + turn * TURN_NOISE_STRIDE
            nxt = sampler.generate([prompts[i] + tokens[i] for i in active], 1,
                                   replace(params, max_new_tokens=room, seed=seed))
            for row, i in enumerate(active):
                new = nxt.completion_ids[row][nxt.completion_mask[row].bool()].tolist()
                left = params.max_new_tokens - len(tokens[i])
                turn_start[i] = len(tokens[i])
                reasons[i] = nxt.finish_reasons[row] if len(new) <= left else "length"
                new = new[:left]
                tokens[i] += new
                logprobs[i] += [0.0] * len(new) if nxt.logprobs is None else nxt.logprobs[row, :len(new)].tolist()
                sampled[i] += [1] * len(new)
    finally:
        handler.close()
    width = max(1, max(len(t) for t in tokens))
    ids = torch.full((rows, width), params.pad_token_id, dtype=torch.long)
    mask, tool_mask = torch.zeros((rows, width), dtype=torch.long), torch.zeros((rows, width), dtype=torch.long)
    logp = torch.zeros((rows, width), dtype=torch.float32)
    for i, t in enumerate(tokens):
        ids[i, :len(t)], mask[i, :len(t)] = torch.tensor(t, dtype=torch.long), 1
        tool_mask[i, :len(t)] = torch.tensor(sampled[i], dtype=torch.long)
        logp[i, :len(t)] = torch.tensor(logprobs[i], dtype=torch.float32)
    return Rollout(completion_ids=ids, completion_mask=mask, logprobs=None if first.logprobs is None else logp,
                   finish_reasons=reasons, tool_mask=tool_mask)
