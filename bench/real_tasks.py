"""A real model's held-out gains from GRPO: SmolLM2-135M-Instruct (GGUF) on reasoning-gym tasks and GSM8K.

    python bench/real_tasks.py probe [--tasks A,B,...]      # each task's start: which lie in [5%, 60%]
    python bench/real_tasks.py run --tasks A,B [--arms auto] # held-out before → after GRPO, per task and arm
    python bench/real_tasks.py laptop --task A --max_steps N # the same on CPU for N steps: seconds per step
    python bench/real_tasks.py table DIR [DIR ...]           # every result.json under DIRs as one markdown table
    python bench/real_tasks.py prepare                       # bundle for the GPU machine; prints the device calls
    python bench/real_tasks.py --smoke                       # the whole pipeline on CPU, built-in tiny model

A task is `NAME` (a reasoning-gym dataset) or `gsm8k` (GSM8K from --data_dir). SmolLM2 never writes the
`<answer>` tags the tasks read, so its held-out accuracy is 0 whatever it knows. The format warm start
fine-tunes on the task's own rewarded layout (`task.solved_completion`) in rounds of --sft_round steps, only
until --sft_until of sampled completions follow the format; the task's *start* is the greedy held-out
accuracy after it. `probe` measures the starts; `run` trains each arm (`sft`: warm start, then GRPO;
`plain`: GRPO from the base model; `auto`: both where the base model misses the format, else `plain`) for
at most --time_budget seconds of GRPO and reports held-out accuracy before → start → after with Wilson 95%
intervals, the curves (`cohort-grpo report` of each run folder) and a markdown table with card, date and
command. Each arm's folder holds metrics.jsonl, summary.json, report/ and result.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROBE_TASKS = ["syllogism", "leg_counting", "letter_counting", "basic_arithmetic", "chain_sum", "gcd",
               "spell_backward", "count_bits"]
WINDOW = (0.05, 0.60)  # the starts worth training: room to gain, and not a task the model cannot answer at all
Z95 = 1.959964  # the standard normal's 97.5% quantile


def shared_dir() -> Path:
    """The project's shared folder: beside the checkout (../shared), or beside the worktrees' folder."""
    for candidate in (ROOT.parent / "shared", ROOT.parent.parent / "shared"):
        if candidate.is_dir():
            return candidate
    return ROOT.parent / "shared"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", default="run", choices=["probe", "run", "laptop", "table", "prepare"])
    p.add_argument("dirs", nargs="*", help="table: folders searched for result.json")
    p.add_argument("--model", help="the SmolLM2 .gguf file (default: fetched with ../shared get.sh)")
    p.add_argument("--tasks", default=",".join(PROBE_TASKS), help="comma-separated reasoning-gym names or gsm8k")
    p.add_argument("--task", help="laptop: the one task")
    p.add_argument("--arms", default="auto", help="auto, sft, plain or sft,plain")
    p.add_argument("--data_dir", help="GSM8K's train.jsonl / test.jsonl (default: ../shared/data/gsm8k)")
    p.add_argument("--out", default="runs/bench_real_tasks", help="folder of the runs and results")
    p.add_argument("--eval_limit", type=int, default=400, help="held-out questions per evaluation")
    p.add_argument("--eval_steps", type=int, default=20, help="held-out evaluation every N GRPO steps (0: ends)")
    p.add_argument("--train_size", type=int, default=4000, help="training questions per task")
    p.add_argument("--prompts_per_step", type=int, default=16)
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--max_completion_length", type=int, default=256)
    p.add_argument("--learning_rate", type=float, default=1e-5)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--max_steps", type=int, default=1000, help="GRPO steps at most (the time bound usually ends it)")
    p.add_argument("--time_budget", type=float, default=360.0, help="GRPO seconds at most per arm (≤ 900)")
    p.add_argument("--format_probe", type=int, default=32, help="training prompts sampled for the format rate")
    p.add_argument("--sft_until", type=float, default=0.5, help="warm start until this sampled format rate")
    p.add_argument("--sft_round", type=int, default=10, help="SFT steps per warm-start round")
    p.add_argument("--sft_max_steps", type=int, default=60, help="warm-start steps at most")
    p.add_argument("--sft_learning_rate", type=float, default=2e-5)
    p.add_argument("--sft_batch_size", type=int, default=16)
    p.add_argument("--eval_batch_size", type=int, default=256)
    p.add_argument("--skip_base", action="store_true", help="arm sft: no held-out evaluation of the base model")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", help="float32 (samples and training agree), bfloat16 or auto")
    p.add_argument("--cpu_threads", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="CPU, the built-in tiny model, tiny sizes: checks the script")
    args = p.parse_args(argv)
    args.command = "python bench/real_tasks.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    if args.mode == "laptop":
        laptop_defaults(args, argv or sys.argv[1:])
    if args.smoke:
        args.model, args.device, args.eval_limit, args.eval_steps, args.train_size = "builtin", "cpu", 4, 1, 16
        args.prompts_per_step, args.num_generations, args.max_completion_length = 2, 2, 8
        args.max_steps, args.time_budget, args.format_probe = 2, 600.0, 2
        args.sft_round, args.sft_max_steps, args.sft_batch_size, args.sft_until = 1, 1, 2, 1.01
        args.eval_batch_size = 8
    return args


def laptop_defaults(args, argv) -> None:
    """Point 5's sizes on 2 CPU cores, for the options not given on the command line."""
    given = {a.split("=")[0][2:] for a in argv if a.startswith("--")}
    sizes = dict(device="cpu", eval_limit=48, eval_steps=0, train_size=400, prompts_per_step=4, num_generations=4,
                 max_completion_length=64, max_steps=6, time_budget=1200.0, format_probe=16, sft_round=5,
                 sft_max_steps=40, sft_batch_size=8, sft_learning_rate=4e-5, eval_batch_size=48, arms="sft",
                 skip_base=True)
    for name, value in sizes.items():
        if name not in given:
            setattr(args, name, value)
    args.tasks = args.task or "syllogism"


# ------------------------------------------------------------------------------------------- pieces

def wilson(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion `correct / n` (95% at the default z)."""
    if n <= 0:
        return (0.0, 1.0)
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def accuracy_cell(accuracy: float | None, n: int) -> str:
    """`41.5% [36.8, 46.4]`: the accuracy and its Wilson 95% interval, in percent."""
    if accuracy is None:
        return "–"
    low, high = wilson(round(accuracy * n), n)
    return f"{100 * accuracy:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"


def model_path(args) -> str | None:
    """The .gguf file (fetched once with ../shared's get.sh), or None for the built-in tiny model."""
    if args.model == "builtin":
        return None
    if args.model:
        return args.model
    import subprocess

    cache = Path.home() / ".cache" / "cohort" / "smollm2-135m-instruct"
    script = shared_dir() / "models" / "smollm2-135m-instruct" / "get.sh"
    done = subprocess.run(["bash", str(script), str(cache)], capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def task_and_rows(name: str, args):
    """(task, training rows, held-out rows) of a reasoning-gym name or `gsm8k`."""
    from cohort_grpo.tasks import get_task

    if name == "gsm8k":
        task = get_task("gsm8k")
        data = Path(args.data_dir) if args.data_dir else shared_dir() / "data" / "gsm8k"
        train = task.load("train", data_files=str(data / "train.jsonl"), subset=args.train_size, seed=args.seed)
        return task, train, task.load("test", data_files=str(data / "test.jsonl"))[: args.eval_limit]
    task = get_task(f"reasoning_gym:{name}")
    return task, task.load("train", size=args.train_size, seed=args.seed), task.load("test", size=args.eval_limit)


def make_trainer(name: str, args, out: Path, max_steps: int, callbacks=()):
    """A GRPOTrainer of `name` on the model, writing to `out` (its rows as `task_and_rows` gives them)."""
    from cohort_grpo import GRPOConfig, GRPOTrainer

    task, train, held_out = task_and_rows(name, args)
    generations = args.prompts_per_step * args.num_generations
    tiny = args.model == "builtin"
    config = GRPOConfig(
        num_generations=args.num_generations, per_device_train_batch_size=min(64, generations),
        gradient_accumulation_steps=max(1, generations // 64), max_steps=max_steps,
        max_completion_length=args.max_completion_length, max_prompt_length=96 if tiny else 512,
        long_prompts="truncate_left" if tiny else "refuse", learning_rate=args.learning_rate, beta=args.beta,
        temperature=1.0, seed=args.seed, device=args.device, dtype=args.dtype, cpu_threads=args.cpu_threads,
        output_dir=str(out), logging_steps=1, log_completions_steps=10, eval_steps=args.eval_steps,
        eval_limit=len(held_out), save_strategy="no", quiet=True, overwrite_output_dir=True)
    trainer = GRPOTrainer(model_path(args), None, train, args=config, eval_dataset=held_out, task=task,
                          log=lambda *a: print(*a, flush=True), callbacks=list(callbacks))
    return trainer, task, train, held_out


def held_out(trainer, task, rows, args, label: str):
    """Greedy held-out accuracy of the trainer's model now (not logged into the run's metrics)."""
    from cohort_grpo.eval.evaluate import evaluate

    started = time.perf_counter()
    result = evaluate(trainer.sampler, trainer.tokenizer, task, rows, trainer.group_sampler.encode_prompt,
                      max_new_tokens=args.max_completion_length, batch_size=args.eval_batch_size)
    print(f"{label}: held-out accuracy {accuracy_cell(result.accuracy, len(rows))}, format "
          f"{100 * result.format_rate:.1f}%, mean length {result.mean_length:.0f} "
          f"({time.perf_counter() - started:.0f}s)", flush=True)
    return result


def constant_answer_share(rows) -> float:
    """The held-out accuracy of always giving the commonest reference answer: a start at this share may be
    a model that answers one thing to every question (SFT on the training answers teaches their bias)."""
    counts = Counter(str(r["solution"]).strip() for r in rows)
    return max(counts.values()) / len(rows)


def sampled_format_rate(trainer, task, train, args) -> float:
    """The share of temperature-1 completions of `--format_probe` training prompts in the task's format."""
    from cohort_grpo.rollout.sampler import SamplingParams

    rows = train[: max(2, args.format_probe)]
    tokenizer = trainer.tokenizer
    prompts = [trainer.group_sampler.encode_prompt(r["prompt"]) for r in rows]
    rollout = trainer.sampler.generate(prompts, 1, SamplingParams(
        max_new_tokens=args.max_completion_length, temperature=1.0, eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=trainer.pad_id, seed=args.seed))
    texts = [tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
             for ids, m in zip(rollout.completion_ids, rollout.completion_mask)]
    return sum(bool(task.follows_format(t)) for t in texts) / len(texts)


def warm_start(trainer, task, train, args) -> tuple[int, float, float]:
    """SFT on the task's rewarded layout in rounds, until the sampled format rate reaches --sft_until:
    (SFT steps, the base model's rate, the rate after)."""
    from cohort_grpo.sft.sft_trainer import SFTConfig, sft_train

    rows = [{"prompt": r["prompt"], "completion": task.solved_completion(r)} for r in train]
    steps = 0
    rate = base_rate = sampled_format_rate(trainer, task, train, args)
    print(f"sampled format rate of the base model: {rate:.3f}", flush=True)
    while rate < args.sft_until and steps < args.sft_max_steps:
        n = min(args.sft_round, args.sft_max_steps - steps)
        started = time.perf_counter()
        sft_train(trainer.model, trainer.tokenizer, rows, SFTConfig(
            learning_rate=args.sft_learning_rate, max_steps=n, batch_size=args.sft_batch_size, warmup_steps=0,
            seed=args.seed + steps, logging_steps=0, max_completion_length=args.max_completion_length))
        steps += n
        rate = sampled_format_rate(trainer, task, train, args)
        print(f"warm start: {steps} SFT steps ({time.perf_counter() - started:.0f}s), sampled format rate {rate:.3f}",
              flush=True)
    return steps, base_rate, rate


class StepWatch:
    """A trainer callback: prints each step's rewards, keeps the held-out evaluations, and stops training once
    --time_budget seconds of GRPO steps have passed (the step that crosses it finishes)."""

    def __init__(self, seconds: float):
        self.seconds, self.started, self.stop_reason, self.threads = seconds, None, None, None
        self.evaluations: list[dict] = []

    def on_step_begin(self, args, state, control, **_):
        if self.started is None:
            self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **_):
        self.threads = torch_threads()  # the count the run trains with (cpu_threads)
        if time.perf_counter() - self.started > self.seconds:
            control.should_training_stop = True
            self.stop_reason = f"time budget {self.seconds:g}s"

    def on_log(self, args, state, control, logs=None, **_):
        rewards = "  ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in logs.items()
                            if k.startswith("rewards/") and k.endswith("/mean") and v is not None)
        print(f"step {logs.get('step', 0):4d}  {rewards}  length {logs.get('completions/mean_length', 0):.0f}  "
              f"{logs.get('step_time', 0):.1f}s", flush=True)

    def on_evaluate(self, args, state, control, metrics=None, **_):
        self.evaluations.append({"step": state.global_step, **(metrics or {})})


# -------------------------------------------------------------------------------------------- modes

def probe_task(name: str, args) -> dict:
    """A task's start: the format warm start (only as far as --sft_until), then greedy held-out accuracy."""
    started = time.perf_counter()
    trainer, task, train, rows = make_trainer(name, args, Path(args.out) / "probe" / name, max_steps=1)
    sft_steps, base_rate, rate = warm_start(trainer, task, train, args)
    start = held_out(trainer, task, rows, args, f"{name}: start after {sft_steps} SFT steps")
    trainer.rewards.close()
    return {"task": name, "n": len(rows), "format_base": base_rate, "sft_steps": sft_steps, "format_sampled": rate,
            "start": start.accuracy, "start_format": start.format_rate, "constant": constant_answer_share(rows),
            "in_window": WINDOW[0] <= start.accuracy <= WINDOW[1], "seconds": round(time.perf_counter() - started)}


def probe(args) -> list[dict]:
    found = []
    for name in args.tasks.split(","):
        found.append(probe_task(name.strip(), args))
        print(json.dumps(found[-1]), flush=True)
    print(f"\n| task | held-out n | sampled format, base → warm start (SFT steps) | start [95% CI] | format | "
          f"commonest answer's share | in {100 * WINDOW[0]:.0f}–{100 * WINDOW[1]:.0f}% |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    for r in found:
        print(f"| {r['task']} | {r['n']} | {r['format_base']:.2f} → {r['format_sampled']:.2f} ({r['sft_steps']}) | "
              f"{accuracy_cell(r['start'], r['n'])} | {100 * r['start_format']:.0f}% | {100 * r['constant']:.1f}% | "
              f"{'yes' if r['in_window'] else 'no'} |")
    chosen = [r["task"] for r in found if r["in_window"]]
    print(f"\nin the window: {','.join(chosen) or 'none'}  ({device_name(args)}, {datetime.date.today()}; "
          f"{args.command})")
    return found


def run_arm(name: str, arm: str, args) -> dict:
    """One task, one arm: the base model's held-out accuracy, the warm start (arm sft), GRPO for at most
    --time_budget seconds with the trainer's own held-out evaluations at its start and end, the report."""
    started = time.perf_counter()
    out = Path(args.out) / f"{name}-{arm}"
    watch = StepWatch(args.time_budget)
    trainer, task, train, rows = make_trainer(name, args, out, args.max_steps, callbacks=[watch])
    base, sft_steps, rates = None, 0, (None, None)
    if arm == "sft" and not args.skip_base:
        base = held_out(trainer, task, rows, args, f"{name}: base model").accuracy
    if arm == "sft":
        sft_steps, *rates = warm_start(trainer, task, train, args)
    trainer.train()
    trainer.rewards.close()  # the per-sample scoring processes
    history = trainer.history
    step_seconds = [r["step_time"] for r in history if r.get("step_time") is not None]
    before = trainer.accuracy_before if arm == "plain" else base
    result = {
        "task": name, "arm": arm, "date": datetime.date.today().isoformat(), "device": device_name(args),
        "model": Path(model_path(args) or "builtin tiny").name, "n": len(rows), "train_rows": len(train),
        "before": before, "start": trainer.accuracy_before, "after": trainer.accuracy_after,
        "constant": constant_answer_share(rows),
        "sft_steps": sft_steps, "format_base": rates[0], "format_warm": rates[1], "grpo_steps": len(history),
        "grpo_seconds": round(sum(step_seconds), 1),
        "seconds_per_step": round(sum(step_seconds) / max(1, len(step_seconds)), 2),
        "stop": watch.stop_reason or f"max_steps {args.max_steps}",
        "curve": [{k: e.get(k) for k in ("step", "eval/accuracy", "eval/format_rate")} for e in watch.evaluations],
        "threads": watch.threads, "total_seconds": round(time.perf_counter() - started), "command": args.command,
        "run_dir": str(out),
    }
    result["report"] = write_report(out)
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table([result]), flush=True)
    return result


def write_report(out: Path) -> str:
    """`cohort-grpo report` of the run folder (the curves), or why not."""
    try:
        from cohort_grpo.telemetry.report import build_report
    except ImportError as missing:
        return f"not drawn ({missing}); run cohort-grpo report {out}"
    return str(build_report([out], out / "report"))


def arms_of(name: str, args) -> list[str]:
    """auto: the warm start and GRPO alone where the base model misses the format, else GRPO alone (a
    quick look at sampled completions of the base model decides)."""
    if args.arms != "auto":
        return [a.strip() for a in args.arms.split(",")]
    trainer, task, train, _ = make_trainer(name, args, Path(args.out) / "format" / name, max_steps=1)
    rate = sampled_format_rate(trainer, task, train, args)
    trainer.rewards.close()
    print(f"{name}: the base model's sampled format rate {rate:.3f}", flush=True)
    return ["sft", "plain"] if rate < args.sft_until else ["plain"]


def run(args) -> list[dict]:
    names = [name.strip() for name in args.tasks.split(",")]
    results = [run_arm(name, arm, args) for name in names for arm in arms_of(name, args)]
    print("\n" + table(results))
    return results


def table(results: list[dict]) -> str:
    """The markdown table of arms' results: held-out accuracy before → start of GRPO → after, 95% intervals."""
    lines = ["| date | card | task | arm | held-out n | commonest answer | base | after warm start (SFT steps) "
             "| after GRPO | gain | GRPO steps (s, s/step) | stop |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        gain = 100 * (r["after"] - r["start"]) if r["after"] is not None and r["start"] is not None else math.nan
        warm = f"{accuracy_cell(r['start'], r['n'])} ({r['sft_steps']})" if r["arm"] == "sft" else "–"
        lines.append(f"| {r['date']} | {r['device']} | {r['task']} | {r['arm']} | {r['n']} | "
                     f"{100 * r['constant']:.1f}% | "
                     f"{accuracy_cell(r['before'], r['n'])} | {warm} | {accuracy_cell(r['after'], r['n'])} | "
                     f"{gain:+.1f} | {r['grpo_steps']} ({r['grpo_seconds']:.0f}, {r['seconds_per_step']:.1f}) | "
                     f"{r['stop']} |")
    commands = sorted({r["command"] for r in results})
    return "\n".join(lines) + "\n\n" + "\n".join(f"command: `{c}`" for c in commands)


def collect(dirs) -> list[dict]:
    """Every result.json under `dirs` (the folders several device calls brought back)."""
    found = [json.loads(p.read_text()) for d in dirs for p in sorted(Path(d).rglob("result.json"))]
    print(table(found))
    return found


def device_name(args) -> str:
    import torch

    if args.device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({os.cpu_count()} cores)"


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def smoke(args) -> None:
    """probe, run (both arms, with the report) and table on the built-in tiny model, GSM8K included."""
    args.out = str(Path(args.out) / "smoke")
    args.tasks = "leg_counting"
    probe(args)
    args.arms = "auto"
    results = run(args)
    if (shared_dir() / "data" / "gsm8k" / "train.jsonl").is_file() or args.data_dir:
        args.tasks, args.arms = "gsm8k", "sft"
        results += run(args)
    else:
        print("smoke: GSM8K left out (no ../shared/data/gsm8k; --data_dir names it)")
    assert len(collect([args.out])) == len(results), results
    for r in results:
        assert r["grpo_steps"] == args.max_steps and Path(r["report"]).is_file(), r
    print("smoke: ok")


def main(argv=None):
    args = parse_args(argv)
    if args.mode == "prepare":
        from real_tasks_bundle import prepare

        return prepare(args)
    if args.smoke:
        return smoke(args)
    if args.mode == "table":
        return collect(args.dirs or [args.out])
    return {"probe": probe, "run": run, "laptop": run}[args.mode](args)


if __name__ == "__main__":
    main()
