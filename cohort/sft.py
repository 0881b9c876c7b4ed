"""Supervised fine-tuning: the warm start that gives GRPO a policy which earns some reward.

GRPO learns only from groups whose rewards differ; a policy that never succeeds gets zero
advantage everywhere. DeepSeek-R1 starts from a "cold-start" SFT for the same reason. Rows are
either {prompt, completion} strings or {messages: [...]} chats (the last assistant turn is the
target); the loss covers completion tokens only. Prompts are rendered with `cohort.tasks.prompt_text`,
the function training and evaluation use, so the warm-started policy sees the prompts GRPO will show it.

`cohort sft --model M --data_files F [--output_dir D]` (`run_sft`) saves an ordinary Hugging Face
folder that `cohort train --model D` loads; the built-in tiny model's warm start (`cohort.tiny`) is
the same `sft_train`.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CohortError
from .logprobs import micro_batch_logprobs
from .packing import pack_micro_batch
from .tasks import prompt_text


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
    max_completion_length: int | None = None  # truncate longer targets (their EOS is then dropped)


def encode_sft_row(row: dict, tokenizer, max_completion_length: int | None = None) -> tuple[list[int], list[int]]:
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
    prompt_ids = tokenizer(prompt_text(tokenizer, prompt), add_special_tokens=False)["input_ids"]
    completion = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    if max_completion_length is not None:
        completion = completion[:max_completion_length]
    return prompt_ids, completion


def sft_train(model, tokenizer, rows: list[dict], config: SFTConfig, log=print, should_stop=None,
              check_every: int = 25) -> list[float]:
    """Train `model` in place on `rows`; returns the loss of every step.

    `should_stop(step) -> bool`, asked every `check_every` steps, ends training early (e.g. once a
    validation accuracy is reached)."""
    if not rows:
        raise CohortError("SFT data is empty: give at least one row")
    device = next(model.parameters()).device
    encoded = [encode_sft_row(r, tokenizer, config.max_completion_length) for r in rows]
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
        micro = pack_micro_batch([p for p, _ in batch], completion, mask, list(range(len(batch))), pad).to(device)
        logp = micro_batch_logprobs(model, micro).logp
        loss = -(logp * micro.completion_mask).sum() / mask.sum()
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


# ------------------------------------------------------------------------------------- cohort sft

def _sft_options():
    from .eval_cli import Option

    defaults = SFTConfig()
    return {
        "model": Option(str, None, "HF folder, .gguf file or hub id to fine-tune (required)"),
        "data_files": Option(str, None, "rows {prompt, completion} or {messages}: .jsonl/.json/.parquet, comma-separated"),
        "task": Option(str, None, "instead of data_files: a task's train split with its reference solutions"),
        "subset": Option(int, None, "use N rows"),
        "output_dir": Option(str, "runs/sft", "where the fine-tuned Hugging Face folder is saved"),
        "max_steps": Option(int, 100, "optimizer steps"),
        "learning_rate": Option(float, 2e-5, "peak learning rate (warmup, then cosine to 10%)"),
        "batch_size": Option(int, 8, "rows per step"),
        "warmup_steps": Option(int, 10, "linear warmup steps"),
        "weight_decay": Option(float, defaults.weight_decay, "AdamW weight decay"),
        "max_grad_norm": Option(float, defaults.max_grad_norm, "gradient clipping"),
        "max_completion_length": Option(int, None, "truncate targets to N tokens"),
        "logging_steps": Option(int, 10, "print the mean loss every N steps"),
        "seed": Option(int, 0, "seed of the row order"),
        "device": Option(str, "auto", "auto, cpu or cuda"),
        "dtype": Option(str, "auto", "auto (float32), float32 or bfloat16"),
    }


def sft_rows(data_files=None, task_name: str | None = None, subset: int | None = None, seed: int = 0) -> list[dict]:
    """SFT rows from files, or from a task's train split (`task.solved_completion` as the target)."""
    from .tasks import get_task
    from .tasks.data import load_rows

    if (data_files is None) == (task_name is None):
        raise CohortError("cohort sft needs exactly one of --data_files FILE (prompt/completion or messages rows) "
                          "or --task NAME")
    if data_files is not None:
        files = data_files.split(",") if isinstance(data_files, str) else data_files
        rows = load_rows(files)
    else:
        task = get_task(task_name)
        if not hasattr(task, "solved_completion"):
            raise CohortError(f"task {task_name!r} has no reference solutions to fine-tune on; pass --data_files")
        rows = [{"prompt": r["prompt"], "completion": task.solved_completion(r)}
                for r in task.load("train", seed=seed, subset=subset)]
    if subset is not None:
        rows = random.Random(seed).sample(rows, min(int(subset), len(rows)))
    return rows


def run_sft(argv: list[str], log=print) -> Path | None:
    """`cohort sft` (argv without the command word): fine-tune, save a Hugging Face folder, return its path."""
    from .eval_cli import options_help, parse_options, pick_device
    from .modelio import load_policy, save_policy

    options = _sft_options()
    if argv[:1] in (["-h"], ["--help"]):
        log("usage: cohort sft --model M --data_files FILE [--option value ...]\n\noptions:\n" + options_help(options))
        return None
    o = parse_options(argv, options, "sft")
    if o["model"] is None:
        raise CohortError("cohort sft needs --model (a Hugging Face folder, a .gguf file or a hub id)")
    for name in ("max_steps", "batch_size"):
        if o[name] < 1:
            raise CohortError(f"cohort sft: --{name} {o[name]} must be at least 1")
    rows = sft_rows(o["data_files"], o["task"], o["subset"], o["seed"])
    config = SFTConfig(learning_rate=o["learning_rate"], max_steps=o["max_steps"], batch_size=o["batch_size"],
                       warmup_steps=o["warmup_steps"], weight_decay=o["weight_decay"],
                       max_grad_norm=o["max_grad_norm"], seed=o["seed"], logging_steps=o["logging_steps"],
                       max_completion_length=o["max_completion_length"])
    model, tokenizer = load_policy(o["model"], device=pick_device(o["device"]), dtype=o["dtype"], log=log)
    log(f"cohort sft: {len(rows)} rows, {config.max_steps} steps of {config.batch_size} rows, lr {config.learning_rate:g}")
    torch.manual_seed(config.seed)
    losses = sft_train(model, tokenizer, rows, config, log=log)
    out = save_policy(model, tokenizer, Path(o["output_dir"]))
    (out / "sft_losses.json").write_text(json.dumps({"losses": losses, "rows": len(rows)}) + "\n")
    log(f"cohort sft: loss {losses[0]:.4f} -> {losses[-1]:.4f}; saved {out} (GRPO: cohort train --model {out} ...)")
    return out
