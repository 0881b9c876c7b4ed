"""`cohort-grpo eval`: score a model on a task's held-out split with the code training uses.

    cohort-grpo eval --model DIR|FILE.gguf --task gsm8k --split test [--data_files F] [--limit N]
                [--num_samples k] [--output FILE | --output_dir DIR]

Prints the greedy accuracy (one temperature-0 completion per question, "pass@1 (greedy)"), the
format rate and the mean length of the greedy completions; with --num_samples n > 1 it also samples n
completions per question at --temperature and prints the unbiased pass@k from those n samples (Chen et
al. 2021) for k = 1, 2, 4, … up to n and n itself (pass@1 = the samples' mean accuracy), and maj@n
(Wang et al. 2023, self-consistency). Writes one JSON line per question (question, gold answer,
completion(s), verdicts, that question's pass@k) and, beside it, `<output stem>.summary.json`: the
metrics under the keys training logs (`eval/greedy_accuracy`, `eval/pass@4`, `eval/maj@8`, ...), what
each key means, and the settings. The results of a model cohort wrote (a run's folder,
a checkpoint, an SFT output) go beside it, so two runs never overwrite each other's: `<model folder>/eval/
<task>_<split>.jsonl`; any other model (a downloaded folder, which is not written into, a .gguf file, a hub id,
the built-in tiny model) puts them in `runs/eval/<model name>/<task>_<split>.jsonl`; `--output_dir DIR` puts
them in DIR, `--output FILE` names the file. The scoring itself is `cohort_grpo.eval.evaluate.evaluate`, which the
trainer also runs every `eval_steps`. Without --model the built-in tiny model (warm-started on
arithmetic) is evaluated.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from cohort_grpo.errors import CohortError
from cohort_grpo.cli.flags import Option, mapping, options_help, parse_options, pick_device

EVAL_OPTIONS = {
    "model": Option(str, None, "HF folder, .gguf file or hub id; none: the built-in tiny model"),
    "task": Option(str, "arithmetic", "arithmetic, calculator, shapes, gsm8k or reasoning_gym:NAME[,NAME...]"),
    "split": Option(str, "test", "the split to score"),
    "data_files": Option(str, None, "local .jsonl/.json/.parquet file(s) for the split (comma-separated)"),
    "limit": Option(int, None, "score the first N questions (arithmetic and reasoning_gym generate N)",
                    "all of the split; arithmetic and reasoning_gym: 200"),
    "levels": Option(str, None, "arithmetic difficulty levels, e.g. 3 or 1,2"),
    "num_samples": Option(int, 1, "n > 1: also sample n completions per question for pass@k "
                                  "(k = 1, 2, 4, …, n) and maj@n"),
    "temperature": Option(float, 1.0, "sampling temperature of the n samples (the greedy accuracy is at 0)"),
    "max_completion_length": Option(int, None, "new tokens per completion", "the task's, else 256"),
    "batch_size": Option(int, 64, "questions per generation batch"),
    "chat_template_kwargs": Option(mapping, None, "a JSON object passed to the chat template, as in cohort-grpo train"),
    "seed": Option(int, 0, "seed of the n samples"),
    "device": Option(str, "auto", "auto, cpu or cuda"),
    "dtype": Option(str, "auto", "auto (float32), float32 or bfloat16"),
    "model_impl": Option(str, "auto", "as in train: auto, cohort (the engine, also over transformers' modules for "
                                      "other decoder-only types) or hf (transformers and generate)"),
    "output": Option(str, None, "per-question JSONL; the summary goes beside it as <stem>.summary.json",
                     "<output_dir>/<task>_<split>.jsonl"),
    "output_dir": Option(str, None, "folder of the results",
                         "<model folder>/eval for a run, checkpoint or SFT folder cohort wrote; else "
                         "runs/eval/<model name>"),
}

BUILTIN_NAME = "builtin-tiny"  # the folder name of the built-in model's results under runs/eval/


def eval_rows(task, split: str, data_files=None, limit: int | None = None, levels=None, seed: int = 0) -> list[dict]:
    """The questions `cohort-grpo eval` scores: the task's split, first `limit` rows (arithmetic generates them)."""
    options: dict = {"seed": seed}
    if data_files is not None:
        options["data_files"] = data_files.split(",") if isinstance(data_files, str) and "," in data_files else data_files
    if task.name == "arithmetic" or task.name.startswith("reasoning_gym:"):
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
                   num_samples_correct=sum(record["sample_correct"]), majority_correct=record["majority_correct"])
        out.update({f"pass@{k}": value for k, value in record["pass_at"].items()})
    return out


def default_output_dir(model: str | None) -> Path:
    """Where `cohort-grpo eval` writes when neither --output nor --output_dir is given: beside the model
    (`<folder>/eval`) when it is a folder cohort wrote (`written_by_cohort`: a run, a checkpoint, an SFT output)
    and that folder can be written; else — any other folder (a downloaded model is not written into), a .gguf
    file, the built-in model, a hub id — `runs/eval/<model name>` under the working directory."""
    if model is not None:
        path = Path(model).expanduser()
        if path.is_dir() and written_by_cohort(path) and _writable(path):
            return path / "eval"
        name = (path.name if path.is_file() else path.resolve().name) if path.exists() else \
            model.replace("/", "--").replace(":", "-")  # a hub id or a built-in name (cohort:tiny-tools)
    else:
        name = BUILTIN_NAME
    return Path("runs") / "eval" / (name or "model")


def written_by_cohort(folder: Path) -> bool:
    """Whether `folder` is one that cohort wrote a model into: a training run's output folder (its metrics.jsonl),
    one of its checkpoints (complete.json) or `cohort-grpo sft`'s output (sft_losses.json)."""
    from cohort_grpo.cli.sft import SFT_LOSSES
    from cohort_grpo.run.checkpoint import MARKER
    from cohort_grpo.telemetry.metrics import METRICS_FILE

    return any((folder / name).is_file() for name in (METRICS_FILE, MARKER, SFT_LOSSES))


def _writable(folder: Path) -> bool:
    eval_dir = folder / "eval"
    return os.access(eval_dir if eval_dir.is_dir() else folder, os.W_OK)


def check_writable(output: Path) -> None:
    """A one-line `CohortError` unless `output` can be written (nothing is created here)."""
    target = output
    while not target.exists() and target != target.parent:
        target = target.parent
    problem = None
    if target == output and output.is_dir():
        problem = "it is a folder"
    elif target != output and not target.is_dir():
        problem = f"{target} is not a folder"
    elif not os.access(target, os.W_OK):
        problem = "permission denied"
    if problem:
        raise CohortError(f"cohort-grpo eval: cannot write {output} ({problem}); pass --output_dir or --output with a "
                          "place you can write to")


def output_path(options: dict, task_name: str) -> Path:
    """The per-question JSONL: --output, else <--output_dir or the default folder>/<task>_<split>.jsonl."""
    if options["output"]:
        return Path(options["output"])
    folder = Path(options["output_dir"]).expanduser() if options["output_dir"] else default_output_dir(options["model"])
    file_stem = re.sub(r"[^\w.-]+", "-", task_name)  # reasoning_gym:a:2,b -> reasoning_gym-a-2-b
    return folder / f"{file_stem}_{options['split']}.jsonl"


def summary_path(output: Path) -> Path:
    """`runs/x/eval/gsm8k_test.jsonl` -> `runs/x/eval/gsm8k_test.summary.json`."""
    return output.with_name(output.stem + ".summary.json")


def summary_of(result, options: dict, model_name: str, max_new_tokens: int) -> dict:
    """The summary JSON: the metrics under training's keys, what each means, and the settings."""
    sampled = result.pass_at_k is not None
    return {"task": options["task"], "split": options["split"], "model": model_name,
            "num_questions": result.num_questions, "max_completion_length": max_new_tokens,
            "samples": ({"num_samples": result.k, "temperature": result.temperature, "seed": options["seed"],
                         "pass_k": sorted(result.pass_at)} if sampled else None),
            "metrics": result.metrics(), "definitions": result.definitions()}


def summary_lines(result, temperature: float) -> list[str]:
    """The printed summary, each number labelled as what it is."""
    width = 34
    lines = [f"  {'greedy accuracy, pass@1 (greedy)':<{width}}{100 * result.accuracy:5.1f}%   "
             "one greedy (T=0) completion per question",
             f"  {'format rate':<{width}}{100 * result.format_rate:5.1f}%   of the greedy completions",
             f"  {'mean length':<{width}}{result.mean_length:5.1f} tokens   of the greedy completions"]
    if result.pass_at_k is None:
        return lines
    n = result.k
    lines.append(f"  sampled: n={n} completions per question at T={temperature:g}; "
                 "pass@k = unbiased estimator from the n (Chen et al. 2021)")
    for k, value in sorted(result.pass_at.items()):
        note = "mean accuracy of the samples" if k == 1 else ""
        lines.append(f"  {f'pass@{k}':<{width}}{100 * value:5.1f}%   {note}".rstrip())
    lines.append(f"  {f'maj@{n}':<{width}}{100 * result.maj_at_k:5.1f}%   majority vote of the {n} samples' answers")
    return lines


def run_eval(argv: list[str], log=print):
    """`cohort-grpo eval` (argv without the command word); returns the `EvalResult`."""
    from cohort_grpo.tasks import get_task, prompt_text

    if argv[:1] in (["-h"], ["--help"]):
        log("usage: cohort-grpo eval [--option value ...]\n\noptions:\n" + options_help(EVAL_OPTIONS))
        return None
    o = parse_options(argv, EVAL_OPTIONS, "eval")
    if o["num_samples"] < 1:
        raise CohortError(f"cohort-grpo eval: --num_samples {o['num_samples']} must be at least 1")
    if o["limit"] is not None and o["limit"] < 1:
        raise CohortError(f"cohort-grpo eval: --limit {o['limit']} must be at least 1")
    if o["model_impl"] not in ("auto", "cohort", "hf"):
        raise CohortError(f"cohort-grpo eval: --model_impl {o['model_impl']!r} is not one of auto, cohort, hf")
    if o["output"] and o["output_dir"]:
        raise CohortError("cohort-grpo eval: --output names the file and --output_dir the folder of the results; "
                          "pass one of them")
    # the model's side (torch, transformers: seconds) loads once the options hold
    import torch

    from cohort_grpo.rollout import make_sampler
    from cohort_grpo.rollout.images import ImagePrompts
    from cohort_grpo.eval.evaluate import evaluate
    from cohort_grpo.run.policy import load_policy
    from cohort_grpo.tools.loading import resolve_tools
    from cohort_grpo.tools.toolbox import Toolbox, saved_toolbox

    task = get_task(o["task"])
    if not hasattr(task, "is_correct"):
        raise CohortError(f"cohort-grpo eval: task {o['task']!r} has no verifier to grade answers with; evaluate with "
                          "--task arithmetic, calculator, shapes, gsm8k or reasoning_gym:NAME")
    output = output_path(o, task.name)  # decided, and checked writable, before the model is loaded
    check_writable(output)
    rows = eval_rows(task, o["split"], o["data_files"], o["limit"], o["levels"], o["seed"])
    max_new = o["max_completion_length"] or getattr(task, "default_config", {}).get("max_completion_length", 256)
    started = time.perf_counter()
    device = pick_device(o["device"])
    model_spec = o["model"] or getattr(task, "default_config", {}).get("model")  # a task's own built-in model
    model, tokenizer = load_policy(model_spec, device=device, dtype=o["dtype"], log=log, impl=o["model_impl"])
    model.eval()
    sampler = make_sampler(model, tokenizer)
    # The tools the model was trained with (tools.json beside it), else the task's: it answers through them.
    toolbox = saved_toolbox(model_spec) if model_spec and Path(str(model_spec)).is_dir() else None
    if toolbox is None and getattr(task, "tools", None):
        toolbox = Toolbox(tools=resolve_tools(task.tools),
                          max_iterations=getattr(task, "default_config", {}).get("max_tool_calling_iterations"))

    if toolbox is not None:
        toolbox.template_kwargs = o["chat_template_kwargs"]

    def encode(prompt, tools=None) -> list[int]:
        text = prompt_text(tokenizer, prompt, tools, o["chat_template_kwargs"])
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    with torch.no_grad():
        result = evaluate(sampler, tokenizer, task, rows, encode, max_new_tokens=max_new,
                          num_samples=o["num_samples"], temperature=o["temperature"], batch_size=o["batch_size"],
                          seed=o["seed"], toolbox=toolbox, images=ImagePrompts.of(model, o["chat_template_kwargs"]))
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w") as f:
        for i, (row, record) in enumerate(zip(rows, result.records)):
            f.write(json.dumps(record_of(row, record, i)) + "\n")
    model_name = o["model"] or "built-in tiny"
    summary = summary_path(output)
    summary.write_text(json.dumps(summary_of(result, o, model_name, max_new), indent=1) + "\n")
    lines = [f"cohort-grpo eval: {task.name} {o['split']}, {result.num_questions} questions, "
             f"model {model_name} ({time.perf_counter() - started:.1f}s)",
             *summary_lines(result, o["temperature"]),
             f"  per-question results: {output}",
             f"  summary: {summary}"]
    log("\n".join(lines))
    return result
