"""`cohort-grpo sft`: supervised fine-tuning from the command line.

    cohort-grpo sft --model M --data_files F [--output_dir D] [--max_steps N] [--learning_rate LR]
    cohort-grpo sft --model M --task arithmetic     (the task's train split with its reference solutions)

Saves an ordinary Hugging Face folder that `cohort-grpo train --model D` loads. The training itself is
`cohort_grpo.sft.sft_trainer.sft_train`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from cohort_grpo.sft.sft_config import SFTConfig
from cohort_grpo.errors import CohortError
from cohort_grpo.cli.flags import Option, mapping, options_help, parse_options, pick_device

SFT_LOSSES = "sft_losses.json"  # beside the fine-tuned model: its losses; marks the folder as cohort's

SFT_OPTIONS = {
    "model": Option(str, None, "HF folder, .gguf file or hub id to fine-tune (required)"),
    "data_files": Option(str, None, "rows {prompt, completion} or {messages}: .jsonl/.json/.parquet/.csv, comma-separated"),
    "task": Option(str, None, "instead of data_files: a task's train split with its reference solutions"),
    "subset": Option(int, None, "use N rows"),
    "output_dir": Option(str, "runs/sft", "where the fine-tuned Hugging Face folder is saved"),
    "max_steps": Option(int, 100, "optimizer steps"),
    "learning_rate": Option(float, 2e-5, "peak learning rate (warmup, then cosine to 10%)"),
    "batch_size": Option(int, 8, "rows per step"),
    "warmup_steps": Option(int, 10, "linear warmup steps"),
    "weight_decay": Option(float, SFTConfig.weight_decay, "AdamW weight decay"),
    "max_grad_norm": Option(float, SFTConfig.max_grad_norm, "gradient clipping"),
    "max_completion_length": Option(int, None, "truncate targets to N tokens"),
    "chat_template_kwargs": Option(mapping, None, "a JSON object passed to the chat template, as in cohort-grpo train"),
    "logging_steps": Option(int, 10, "print the mean loss every N steps"),
    "seed": Option(int, 0, "seed of the row order"),
    "device": Option(str, "auto", "auto, cpu or cuda"),
    "dtype": Option(str, "auto", "auto (float32), float32 or bfloat16"),
}


def sft_rows(data_files=None, task_name: str | None = None, subset: int | None = None, seed: int = 0) -> list[dict]:
    """SFT rows from files, or from a task's train split (`task.solved_completion` as the target)."""
    from cohort_grpo.tasks import get_task
    from cohort_grpo.tasks.data import load_rows

    if (data_files is None) == (task_name is None):
        raise CohortError("cohort-grpo sft needs exactly one of --data_files FILE (prompt/completion or messages rows) "
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
    """`cohort-grpo sft` (argv without the command word): fine-tune, save a Hugging Face folder, return its path."""
    if argv[:1] in (["-h"], ["--help"]):
        log("usage: cohort-grpo sft --model M --data_files FILE [--option value ...]\n\noptions:\n"
            + options_help(SFT_OPTIONS))
        return None
    o = parse_options(argv, SFT_OPTIONS, "sft")
    import torch  # after the options: help and bad options answer without loading it

    from cohort_grpo.sft.sft_trainer import sft_train
    from cohort_grpo.models.policy import save_policy
    from cohort_grpo.run.policy import load_policy

    if o["model"] is None:
        raise CohortError("cohort-grpo sft needs --model (a Hugging Face folder, a .gguf file or a hub id)")
    for name in ("max_steps", "batch_size"):
        if o[name] < 1:
            raise CohortError(f"cohort-grpo sft: --{name} {o[name]} must be at least 1")
    rows = sft_rows(o["data_files"], o["task"], o["subset"], o["seed"])
    config = SFTConfig(learning_rate=o["learning_rate"], max_steps=o["max_steps"], batch_size=o["batch_size"],
                       warmup_steps=o["warmup_steps"], weight_decay=o["weight_decay"],
                       max_grad_norm=o["max_grad_norm"], seed=o["seed"], logging_steps=o["logging_steps"],
                       max_completion_length=o["max_completion_length"],
                       chat_template_kwargs=o["chat_template_kwargs"])
    model, tokenizer = load_policy(o["model"], device=pick_device(o["device"]), dtype=o["dtype"], log=log)
    log(f"cohort-grpo sft: {len(rows)} rows, {config.max_steps} steps of {config.batch_size} rows, lr {config.learning_rate:g}")
    torch.manual_seed(config.seed)
    losses = sft_train(model, tokenizer, rows, config, log=log)
    out = save_policy(model, tokenizer, Path(o["output_dir"]))
    (out / SFT_LOSSES).write_text(json.dumps({"losses": losses, "rows": len(rows)}) + "\n")
    log(f"cohort-grpo sft: loss {losses[0]:.4f} -> {losses[-1]:.4f}; saved {out} (GRPO: cohort-grpo train --model {out} ...)")
    return out
