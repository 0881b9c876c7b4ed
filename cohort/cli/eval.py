"""`cohort eval`: score a model on a task's held-out split with the code training uses.

    cohort eval --model DIR|FILE.gguf --task gsm8k --split test [--data_files F] [--limit N]
                [--num_samples k] [--output FILE]

Prints pass@1 (greedy), and with k > 1 samples pass@k (Chen et al. 2021, unbiased estimator) and
maj@k (Wang et al. 2023, self-consistency), the format rate and the mean completion length; writes
one JSON line per question (question, gold answer, completion(s), verdicts). The scoring itself is
`cohort.eval.evaluate.evaluate`, which the trainer also runs every `eval_steps`. Without --model the
built-in tiny model (warm-started on arithmetic) is evaluated.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..errors import CohortError
from .options import Option, options_help, parse_options, pick_device

EVAL_OPTIONS = {
    "model": Option(str, None, "HF folder, .gguf file or hub id; none: the built-in tiny model"),
    "task": Option(str, "arithmetic", "arithmetic or gsm8k"),
    "split": Option(str, "test", "the split to score"),
    "data_files": Option(str, None, "local .jsonl/.json/.parquet file(s) for the split (comma-separated)"),
    "limit": Option(int, None, "score the first N questions (arithmetic: generate N; default 200)"),
    "levels": Option(str, None, "arithmetic difficulty levels, e.g. 3 or 1,2"),
    "num_samples": Option(int, 1, "k: also sample k completions per question for pass@k and maj@k"),
    "temperature": Option(float, 1.0, "sampling temperature of the k samples (pass@1 is greedy)"),
    "max_completion_length": Option(int, None, "new tokens per completion (default: the task's, else 256)"),
    "batch_size": Option(int, 64, "questions per generation batch"),
    "seed": Option(int, 0, "seed of the k samples"),
    "device": Option(str, "auto", "auto, cpu or cuda"),
    "dtype": Option(str, "auto", "auto (float32), float32 or bfloat16"),
    "output": Option(str, None, "per-question JSONL (default: runs/eval/<task>_<split>.jsonl)"),
}


def eval_rows(task, split: str, data_files=None, limit: int | None = None, levels=None, seed: int = 0) -> list[dict]:
    """The questions `cohort eval` scores: the task's split, first `limit` rows (arithmetic generates them)."""
    options: dict = {"seed": seed}
    if data_files is not None:
        options["data_files"] = data_files.split(",") if isinstance(data_files, str) and "," in data_files else data_files
    if task.name == "arithmetic":
        options["size"] = limit or 200
        if levels is not None:
            options["levels"] = levels
        elif "levels" in getattr(task, "default_config", {}):
            options["levels"] = task.default_config["levels"]
    rows = task.load(split, **options)
    return rows[:limit] if limit else rows


def record_of(row: dict, record: dict, index: int) -> dict:
    """One line of the per-question JSONL from `evaluate`'s record of that question."""
    question = row.get("question")
    if question is None:
        prompt = row["prompt"]
        question = prompt[-1]["content"] if isinstance(prompt, list) else prompt
    out = {"index": index, "question": question, "gold": row.get("solution"), "completion": record["completion"],
           "answer": record["answer"], "correct": record["correct"], "format_ok": record["format_ok"],
           "length": record["length"]}
    if "samples" in record:
        out.update(samples=record["samples"], samples_correct=record["sample_correct"],
                   majority_correct=record["majority_correct"])
    return out


def run_eval(argv: list[str], log=print):
    """`cohort eval` (argv without the command word); returns the `EvalResult`."""
    from ..rollout import make_sampler
    from ..eval.evaluate import evaluate
    from ..models.policy import load_policy
    from ..tasks import get_task, prompt_text

    if argv[:1] in (["-h"], ["--help"]):
        log("usage: cohort eval [--option value ...]\n\noptions:\n" + options_help(EVAL_OPTIONS))
        return None
    o = parse_options(argv, EVAL_OPTIONS, "eval")
    if o["num_samples"] < 1:
        raise CohortError(f"cohort eval: --num_samples {o['num_samples']} must be at least 1")
    if o["limit"] is not None and o["limit"] < 1:
        raise CohortError(f"cohort eval: --limit {o['limit']} must be at least 1")
    task = get_task(o["task"])
    rows = eval_rows(task, o["split"], o["data_files"], o["limit"], o["levels"], o["seed"])
    max_new = o["max_completion_length"] or getattr(task, "default_config", {}).get("max_completion_length", 256)
    started = time.perf_counter()
    device = pick_device(o["device"])
    model, tokenizer = load_policy(o["model"], device=device, dtype=o["dtype"], log=log)
    model.eval()
    sampler = make_sampler(model, tokenizer)

    def encode(prompt) -> list[int]:
        return tokenizer(prompt_text(tokenizer, prompt), add_special_tokens=False)["input_ids"]

    with torch.no_grad():
        result = evaluate(sampler, tokenizer, task, rows, encode, max_new_tokens=max_new,
                          num_samples=o["num_samples"], temperature=o["temperature"], batch_size=o["batch_size"],
                          seed=o["seed"])
    output = Path(o["output"] or f"runs/eval/{task.name}_{o['split']}.jsonl")
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w") as f:
        for i, (row, record) in enumerate(zip(rows, result.records)):
            f.write(json.dumps(record_of(row, record, i)) + "\n")
    k = o["num_samples"]
    lines = [f"cohort eval: {task.name} {o['split']}, {result.num_questions} questions, "
             f"model {o['model'] or 'built-in tiny'} ({time.perf_counter() - started:.1f}s)",
             f"  pass@1 (greedy)  {100 * result.accuracy:.1f}%"]
    if k > 1:
        lines += [f"  pass@{k:<11} {100 * result.pass_at_k:.1f}%  (T={o['temperature']:g})",
                  f"  maj@{k:<12} {100 * result.maj_at_k:.1f}%"]
    lines += [f"  format rate      {100 * result.format_rate:.1f}%",
              f"  mean length      {result.mean_length:.1f} tokens",
              f"  per-question results: {output}"]
    log("\n".join(lines))
    return result
