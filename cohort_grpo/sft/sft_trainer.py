"""Supervised fine-tuning: the warm start that gives GRPO a policy which earns some reward.

GRPO learns only from groups whose rewards differ; a policy that never succeeds gets zero
advantage everywhere. DeepSeek-R1 starts from a "cold-start" SFT for the same reason. Rows are
either {prompt, completion} strings or {messages: [...]} chats (the last assistant turn is the
target); the loss covers completion tokens only. Prompts are rendered with `cohort_grpo.tasks.prompt_text`,
the function training and evaluation use, so the warm-started policy sees the prompts GRPO will show it.

`cohort-grpo sft` (cohort_grpo/cli/sft.py) runs `sft_train` on a model and data the user names; the built-in
tiny model (cohort_grpo/models/tiny.py) is warm-started by `tiny_warm_start`, the same `sft_train` on
solved arithmetic problems.
"""

from __future__ import annotations

import math
import random

import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.eval.evaluate import evaluate
from cohort_grpo.rollout.sampler import HFGenerateSampler
from cohort_grpo.tasks import prompt_text
from cohort_grpo.tasks.arithmetic import ArithmeticTask
from cohort_grpo.update.logprobs import micro_batch_logprobs
from cohort_grpo.update.packing import pack_micro_batch
from cohort_grpo.sft.sft_config import SFTConfig


def encode_sft_row(row: dict, tokenizer, max_completion_length: int | None = None,
                   template_kwargs: dict | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids + EOS) for one row."""
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages or messages[-1].get("role") != "assistant":
            raise CohortError("an SFT 'messages' row must be a list of chat turns ending with an assistant turn")
        prompt, target = messages[:-1], messages[-1]["content"]
    elif "prompt" in row and "completion" in row:
        prompt, target = row["prompt"], row["completion"]
        if isinstance(target, list):  # a conversational completion: [{"role": "assistant", "content": ...}]
            target = "".join(m["content"] for m in target)
    else:
        raise CohortError(f"SFT rows need 'prompt' and 'completion' columns or 'messages'; got columns {sorted(row)}")
    prompt_ids = tokenizer(prompt_text(tokenizer, prompt, None, template_kwargs),
                           add_special_tokens=False)["input_ids"]
    completion = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    if max_completion_length is not None:
        completion = completion[:max_completion_length]
    return prompt_ids, completion


def sft_train(model, tokenizer, rows: list[dict], config: SFTConfig, log=print, should_stop=None,
              check_every: int = 25, encode=None, label: str = "SFT") -> list[float]:
    """Train `model` in place on `rows`; returns the loss of every step. Its log lines start with `label`
    (a warm start of several passes names each, since every pass counts its steps from 1).

    `should_stop(step) -> bool`, asked every `check_every` steps, ends training early (e.g. once a
    validation accuracy is reached). `encode(row)`, in place of `encode_sft_row`, returns (prompt ids,
    completion ids) or (prompt ids, completion ids, loss mask): a 0 in the mask marks a completion token
    the model reads but did not write (a tool's result), left out of the loss."""
    if not rows:
        raise CohortError("SFT data is empty: give at least one row")
    device = next(model.parameters()).device
    if encode is None:
        def encode(row):
            return encode_sft_row(row, tokenizer, config.max_completion_length, config.chat_template_kwargs)
    encoded = [encode(r) for r in rows]
    rng = random.Random(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _warmup_cosine(s, config.warmup_steps, config.max_steps))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model.train()
    losses = []
    for step in range(1, config.max_steps + 1):
        batch = [encoded[rng.randrange(len(encoded))] for _ in range(config.batch_size)]
        width = max(len(item[1]) for item in batch)
        completion = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        loss_mask = torch.zeros((len(batch), width), dtype=torch.float32)
        for i, item in enumerate(batch):
            c = item[1]
            completion[i, : len(c)] = torch.tensor(c)
            mask[i, : len(c)] = 1
            loss_mask[i, : len(c)] = torch.tensor(item[2], dtype=torch.float32) if len(item) > 2 else 1.0
        micro = pack_micro_batch([item[0] for item in batch], completion, mask, list(range(len(batch))), pad).to(device)
        logp = micro_batch_logprobs(model, micro).logp
        loss_mask = loss_mask.to(device)
        loss = -(logp * loss_mask).sum() / loss_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        if config.logging_steps and step % config.logging_steps == 0:
            recent = losses[-config.logging_steps:]
            log(f"{label} step {step}/{config.max_steps}: loss={sum(recent) / len(recent):.4f}")
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


# ----------------------------------------------------------------- the built-in tiny model's warm start

def tiny_warm_start(model, tokenizer, spec: dict, log=print) -> list[float]:
    """Teach the built-in tiny model (`cohort_grpo.sft.builtin.tiny_model_dir` calls this once, before caching
    it) the answer format: `sft_train` in place on solved arithmetic problems of the levels
    `spec["sft_levels"]`, with the `spec["sft_*"]` settings; the caller's torch random state is left as it was.

    Addition is learnt in a sudden phase transition whose step count shifts with floating-point details
    (thread count, BLAS). So the warm start stops at a measured skill, not at a step count: once greedy
    accuracy on validation problems of the hardest level reaches `spec["sft_target_accuracy"]` (checked
    from step `spec["sft_min_steps"]` on), or after `spec["sft_steps"]` steps."""
    task = ArithmeticTask()
    rows = task.load("train", levels=spec["sft_levels"], size=5000, seed=spec["sft_seed"])
    solved = [{"prompt": r["prompt"], "completion": task.solved_completion(r)} for r in rows]
    config = SFTConfig(learning_rate=spec["sft_learning_rate"], max_steps=spec["sft_steps"],
                       batch_size=spec["sft_batch_size"], seed=spec["sft_seed"], logging_steps=100)
    validation = task.load("validation", levels=[max(spec["sft_levels"])], size=100)
    sampler = HFGenerateSampler(model, tokenizer)

    def reached_target(step: int) -> bool:
        if step < spec["sft_min_steps"]:
            return False
        accuracy = evaluate(sampler, tokenizer, task, validation,
                            lambda p: tokenizer(p, add_special_tokens=False)["input_ids"], max_new_tokens=8).accuracy
        if accuracy >= spec["sft_target_accuracy"]:
            log(f"SFT step {step}: validation accuracy {100 * accuracy:.0f}% ≥ target; warm start done")
            return True
        return False

    with torch.random.fork_rng():
        return sft_train(model, tokenizer, solved, config, log=log, should_stop=reached_target)
