"""On-policy distillation against GRPO alone on the built-in arithmetic task, on the CPU: held-out accuracy by step.

    python bench/distillation_gain.py                 # the table of docs/howto/distillation.md (about 9 minutes, 2 cores)
    python bench/distillation_gain.py --steps 100 --eval-every 20   # a quick look

A teacher (the built-in tiny model's shape, 96 hidden, 3 layers) is trained longer: the built-in model's supervised
warm start (solved level-2 and level-3 problems), run for `--teacher-sft-steps` steps where the built-in one stops
once it reaches 50% on level 3. A fresh, smaller student (64 hidden, 2 layers, another seed) gets the same warm
start for only `--student-sft-steps` steps (the answer format, few right answers). The
student then trains `--steps` GRPO steps three ways, each from the same weights with the same rollouts' size,
learning rate (3e-4) and seed, β = 0 (the arithmetic task's `cohort-grpo train` defaults otherwise):

- distillation: no reward functions (`--reward_funcs ''`), `--teacher_model` with `--distillation_coef 1`;
- GRPO: the task's reward, no teacher;
- both: the task's reward and the teacher.

Every run evaluates greedy pass@1 on the same `--eval-limit` held-out level-3 problems every `--eval-every` steps.
Each step samples and updates alike in the three; the teacher's arms add one no-grad forward of the teacher and one
of the student per step (the log π_old pass at μ = 1).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUDENT_SPEC = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=128)
ARMS = {
    "distillation": ["--reward_funcs", "", "--teacher_model", "{teacher}", "--distillation_coef", "1"],
    "GRPO": [],
    "both": ["--teacher_model", "{teacher}", "--distillation_coef", "1"],
}


def warm_start(model, tokenizer, steps: int, seed: int) -> None:
    """The built-in model's supervised warm start (solved level-2 and level-3 problems), `steps` steps long."""
    from cohort_grpo.sft.sft_config import SFTConfig
    from cohort_grpo.sft.sft_trainer import sft_train
    from cohort_grpo.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask()
    rows = task.load("train", levels=[2, 3], size=5000, seed=seed)
    solved = [{"prompt": r["prompt"], "completion": task.solved_completion(r)} for r in rows]
    sft_train(model, tokenizer, solved, SFTConfig(learning_rate=3e-3, max_steps=steps, batch_size=64, seed=seed,
                                                  logging_steps=10**9), log=lambda *_: None)


def build_models(folder: Path, teacher_steps: int, student_steps: int) -> tuple[Path, Path]:
    """(teacher folder, student folder), each warm-started and saved as a Hugging Face folder."""
    import torch

    from cohort_grpo.models.tiny import TINY_SPEC, build_model, build_tokenizer

    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    tokenizer = build_tokenizer()
    for name, spec, steps, seed in (("teacher", TINY_SPEC, teacher_steps, 0), ("student", STUDENT_SPEC, student_steps, 1)):
        if not (folder / name / "config.json").exists():
            model = build_model(tokenizer, seed=seed, spec=spec)
            warm_start(model, tokenizer, steps, seed)
            model.save_pretrained(folder / name)
            tokenizer.save_pretrained(folder / name)
    return folder / "teacher", folder / "student"


def train(arm: str, student: Path, teacher: Path, out: Path, args) -> dict[int, float]:
    """`cohort-grpo train` of one arm; {step: held-out accuracy} (its metrics.jsonl has the rest: `training_lines`)."""
    extra = [a.replace("{teacher}", str(teacher)) for a in ARMS[arm]]
    command = [sys.executable, "-m", "cohort_grpo", "train", "--model", str(student), "--max_steps", str(args.steps),
               "--eval_steps", str(args.eval_every), "--eval_limit", str(args.eval_limit), "--learning_rate",
               str(args.learning_rate), "--per_device_train_batch_size", str(args.completions), "--beta", "0",
               "--save_strategy", "no", "--quiet", "--device", "cpu", "--output_dir", str(out),
               "--overwrite_output_dir", "true", *extra]
    subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL)
    accuracy = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "eval/accuracy" in record:
            accuracy[record["step"]] = record["eval/accuracy"]
    return accuracy


def training_lines(folder: Path) -> list[str]:
    """Each arm's sampled success (temperature 1) and reverse KL to the teacher, over the first and the last fifth
    of its logged steps."""
    lines = []
    for arm in ARMS:
        records = [json.loads(line) for line in (folder / arm / "metrics.jsonl").read_text().splitlines()]
        records = [r for r in records if "loss" in r]
        fifth = max(1, len(records) // 5)

        def mean(key, part):
            values = [r[key] for r in part if key in r]
            return sum(values) / len(values) if values else float("nan")

        first, last = records[:fifth], records[-fifth:]
        kl = (f"; reverse KL {mean('distillation/reverse_kl', first):.2f} → {mean('distillation/reverse_kl', last):.2f}"
              if "distillation/reverse_kl" in records[0] else "")
        lines.append(f"- {arm}: sampled success {100 * mean('success', first):.1f}% → {100 * mean('success', last):.1f}%"
                     f"{kl}")
    return lines


def table(results: dict[str, dict[int, float]]) -> str:
    steps = sorted(next(iter(results.values())))
    lines = ["| step | " + " | ".join(results) + " |", "| ---: |" + " ---: |" * len(results)]
    for step in steps:
        lines.append(f"| {step} | " + " | ".join(f"{100 * results[arm][step]:.1f}%" for arm in results) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--eval-limit", type=int, default=200)
    parser.add_argument("--completions", type=int, default=64, help="completions per step (8 per prompt)")
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--teacher-sft-steps", type=int, default=1500)
    parser.add_argument("--student-sft-steps", type=int, default=300)
    parser.add_argument("--folder", default="runs/distillation_gain")
    args = parser.parse_args()
    folder = Path(args.folder)
    started = time.perf_counter()
    teacher, student = build_models(folder, args.teacher_sft_steps, args.student_sft_steps)
    print(f"models ready in {time.perf_counter() - started:.0f} s", flush=True)
    results = {}
    for arm in ARMS:
        began = time.perf_counter()
        results[arm] = train(arm, student, teacher, folder / arm, args)
        print(f"{arm}: {time.perf_counter() - began:.0f} s", flush=True)
    teacher_accuracy = train_free_accuracy(teacher, folder / "teacher-eval", args)
    print(f"\n{datetime.date.today()}: python bench/distillation_gain.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"teacher's held-out accuracy: {100 * teacher_accuracy:.1f}%; total {time.perf_counter() - started:.0f} s\n")
    print(table(results))
    print("\nfirst fifth → last fifth of the logged steps:")
    print("\n".join(training_lines(folder)))


def train_free_accuracy(model: Path, out: Path, args) -> float:
    """The held-out accuracy of `model` as it is (`cohort-grpo eval`'s greedy pass@1 on the same problems)."""
    command = [sys.executable, "-m", "cohort_grpo", "eval", "--model", str(model), "--limit", str(args.eval_limit),
               "--levels", "3", "--device", "cpu", "--output", str(out.with_suffix(".jsonl"))]
    subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL)
    return json.loads(out.with_suffix(".summary.json").read_text())["metrics"]["eval/accuracy"]


if __name__ == "__main__":
    main()
