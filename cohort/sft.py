"""Supervised fine-tuning: the warm start that gives GRPO a policy which earns some reward.

GRPO learns only from groups whose rewards differ; a policy that never succeeds gets zero
advantage everywhere. DeepSeek-R1 starts from a "cold-start" SFT for the same reason. Rows are
either {prompt, completion} strings or {messages: [...]} chats (the last assistant turn is the
target); the loss covers completion tokens only.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from .errors import CohortError
from .logprobs import completion_logprobs, pack_prompt_completion


@dataclass
class SFTConfig:
    learning_rate: float = 1e-3
    max_steps: int = 300
    batch_size: int = 32
    warmup_steps: int = 20
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    logging_steps: int = 50


def encode_sft_row(row: dict, tokenizer) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids + EOS) for one row."""
    if "messages" in row:
        messages = row["messages"]
        if not messages or messages[-1].get("role") != "assistant":
            raise CohortError("an SFT 'messages' row must end with an assistant turn")
        prompt_text = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        completion_text = messages[-1]["content"]
    elif "prompt" in row and "completion" in row:
        prompt_text, completion_text = row["prompt"], row["completion"]
        if isinstance(prompt_text, list):
            prompt_text = tokenizer.apply_chat_template(prompt_text, tokenize=False, add_generation_prompt=True)
    else:
        raise CohortError(f"SFT rows need 'prompt' and 'completion' columns or 'messages'; got columns {sorted(row)}")
    prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    completion = tokenizer(completion_text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt, completion


def sft_train(model, tokenizer, rows: list[dict], config: SFTConfig, log=print, should_stop=None,
              check_every: int = 25) -> list[float]:
    """Train `model` in place on `rows`; returns the loss of every step.

    `should_stop(step) -> bool`, asked every `check_every` steps, ends training early (e.g. once a
    validation accuracy is reached)."""
    if not rows:
        raise CohortError("SFT data is empty: give at least one row")
    device = next(model.parameters()).device
    encoded = [encode_sft_row(r, tokenizer) for r in rows]
    rng = random.Random(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _warmup_cosine(s, config.warmup_steps, config.max_steps))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model.train()
    losses = []
    for step in range(1, config.max_steps + 1):
        batch = [encoded[rng.randrange(len(encoded))] for _ in range(config.batch_size)]
        width = max(len(c) for _, c in batch)
        completion = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (_, c) in enumerate(batch):
            completion[i, : len(c)] = torch.tensor(c)
            mask[i, : len(c)] = 1
        input_ids, attention_mask = pack_prompt_completion([p for p, _ in batch], completion, mask, pad)
        logp = completion_logprobs(model, input_ids.to(device), attention_mask.to(device), completion.to(device)).logp
        loss = -(logp * mask.to(device)).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        if config.logging_steps and step % config.logging_steps == 0:
            log(f"SFT step {step}/{config.max_steps}: loss={sum(losses[-config.logging_steps:]) / config.logging_steps:.4f}")
        if should_stop is not None and step % check_every == 0:
            model.eval()
            stop = should_stop(step)
            model.train()
            if stop:
                break
    model.eval()
    return losses


def _warmup_cosine(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
