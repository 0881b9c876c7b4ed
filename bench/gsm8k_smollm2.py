"""GSM8K with a real pretrained model: SmolLM2-135M-Instruct (GGUF), format reward from its start to ≥ 0.9.

What it measures (issue 3, item 6): greedy test pass@1 on N GSM8K test questions before training;
a short supervised "cold start" (DeepSeek-R1 §2.3.1) on reference solutions in the rewarded layout,
run in small rounds only until sampled completions follow the format *sometimes* (the base model
never writes `<think>`/`<answer>` tags, so every GRPO group would tie and give no gradient); then
GRPO on a GSM8K train subset with the task's default reward mix (format 0.5, tag count 0.5, accuracy
1.0) until `rewards/format_reward/mean` has stayed ≥ 0.9 for 5 steps (or the step / time bound);
test pass@1 again. Prints the per-step curve and a markdown row for docs/history/benchmarks-2026-11.md.

    python bench/gsm8k_smollm2.py prepare            # here: GGUF halves, GSM8K files, wheels → .bench/
    python bench/gsm8k_smollm2.py --model FILE.gguf --data_dir DIR [--out DIR]      # on the GPU
    python bench/gsm8k_smollm2.py --smoke            # CPU, tiny settings, checks the script end to end
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHARED = ROOT.parent / "shared"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
BUNDLE = ROOT / ".bench" / "gsm8k_smollm2"  # ignored by git; carried to the GPU machine
# Not on the GPU image (../shared/notes/device.md): math-verify and its parser, and gguf.
WHEELS = ["math-verify==0.9.0", "latex2sympy2_extended==1.11.0", "antlr4-python3-runtime==4.13.2", "gguf==0.19.0"]


class _Stop(Exception):
    """Raised from the trainer's step record to end GRPO early (target held, or time spent)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", default="run", choices=["run", "prepare"])
    p.add_argument("--model", help="the SmolLM2 .gguf file (default: fetched with ../shared get.sh)")
    p.add_argument("--data_dir", help="folder with GSM8K train.jsonl / test.jsonl (default: ../shared/data/gsm8k)")
    p.add_argument("--out", default="runs/bench_gsm8k_smollm2", help="run folder (metrics, results.json)")
    p.add_argument("--eval_questions", type=int, default=200)
    p.add_argument("--train_subset", type=int, default=2000)
    p.add_argument("--prompts_per_step", type=int, default=16)
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--max_completion_length", type=int, default=256)
    p.add_argument("--learning_rate", type=float, default=1e-5)
    p.add_argument("--max_steps", type=int, default=100, help="GRPO steps at most")
    p.add_argument("--target", type=float, default=0.9, help="format reward to reach and hold")
    p.add_argument("--hold", type=int, default=5, help="steps the target must hold before stopping")
    p.add_argument("--time_budget", type=float, default=240.0, help="GRPO seconds at most")
    p.add_argument("--sft_until", type=float, default=0.15, help="cold start until this sampled format rate")
    p.add_argument("--sft_round", type=int, default=10, help="SFT steps per cold-start round")
    p.add_argument("--sft_max_steps", type=int, default=80, help="cold-start steps at most (0: none)")
    p.add_argument("--sft_learning_rate", type=float, default=2e-5)
    p.add_argument("--sft_batch_size", type=int, default=16)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--importance_sampling_correction", choices=["auto", "true", "false"], default="auto",
                   help="the sampler correction (auto: on for bf16 on a GPU); compare runs with true and false")
    p.add_argument("--smoke", action="store_true", help="CPU, a few questions, 2 GRPO steps: checks the script")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.eval_questions, args.train_subset = "cpu", 3, 8
        args.prompts_per_step, args.num_generations, args.max_completion_length = 2, 2, 16
        args.max_steps, args.time_budget, args.sft_round, args.sft_max_steps = 2, 600.0, 1, 1
        args.sft_batch_size = 2
        args.sft_until = 1.01  # always run the one cold-start round, to exercise it
    return args


# ---------------------------------------------------------------------------------------- prepare

def prepare() -> None:
    """Bundle what the GPU machine lacks into .bench/gsm8k_smollm2 and print the two device calls.
    The GGUF (98 MB) is larger than one call may carry (64 MiB), so it travels as two halves."""
    gguf = _fetch_gguf()
    BUNDLE.mkdir(parents=True, exist_ok=True)
    data = gguf.read_bytes()
    half = len(data) // 2
    (BUNDLE / "part0").write_bytes(data[:half])
    (BUNDLE / "part1").write_bytes(data[half:])
    (BUNDLE / "gsm8k").mkdir(exist_ok=True)
    for split in ("train", "test"):
        (BUNDLE / "gsm8k" / f"{split}.jsonl").write_bytes((SHARED / "data" / "gsm8k" / f"{split}.jsonl").read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "--platform", "any",
                    "-d", str(BUNDLE / "whl"), *WHEELS], check=True)
    b = ".bench/gsm8k_smollm2"
    print(f"bundle ready in {BUNDLE}\n\ndevice call 1 (carry [\"{b}/part0\"]):\n"
          f"  mkdir -p /tmp/smol && cp {b}/part0 /tmp/smol/part0 && ls -l /tmp/smol\n\n"
          f"device call 2, same warm machine (carry [\"{b}/part1\", \"{b}/whl\", \"{b}/gsm8k\"]):\n"
          f"  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
          f"{b}/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit; "
          f"cat /tmp/smol/part0 {b}/part1 > /tmp/smol/{GGUF_NAME} && "
          f"echo \"{GGUF_SHA256}  /tmp/smol/{GGUF_NAME}\" | sha256sum -c || exit; nvidia-smi -L; "
          f"python3 bench/gsm8k_smollm2.py --model /tmp/smol/{GGUF_NAME} --data_dir {b}/gsm8k --out /tmp/bench_run "
          f"2>&1 | tee $OUT/log.txt; cp /tmp/bench_run/results.json /tmp/bench_run/metrics.jsonl $OUT/")


def _fetch_gguf() -> Path:
    cache = Path.home() / ".cache" / "cohort" / "smollm2-135m-instruct"
    script = SHARED / "models" / "smollm2-135m-instruct" / "get.sh"
    done = subprocess.run(["bash", str(script), str(cache)], capture_output=True, text=True, check=True)
    return Path(done.stdout.strip().splitlines()[-1])


# -------------------------------------------------------------------------------------------- run

def run(args) -> dict:
    import torch

    from cohort_grpo import GRPOConfig, GRPOTrainer
    from cohort_grpo.eval.evaluate import evaluate
    from cohort_grpo.rewards.rules import format_reward
    from cohort_grpo.rollout.sampler import SamplingParams
    from cohort_grpo.sft.sft_trainer import SFTConfig, sft_train
    from cohort_grpo.tasks import get_task

    started = time.perf_counter()
    model = args.model or str(_fetch_gguf())
    data_dir = Path(args.data_dir) if args.data_dir else SHARED / "data" / "gsm8k"
    task = get_task("gsm8k")
    test_rows = task.load("test", data_files=str(data_dir / "test.jsonl"))[: args.eval_questions]
    train_rows = task.load("train", data_files=str(data_dir / "train.jsonl"), subset=args.train_subset, seed=args.seed)
    G = args.num_generations
    config = GRPOConfig(
        num_generations=G, per_device_train_batch_size=min(64, args.prompts_per_step * G),
        gradient_accumulation_steps=max(1, args.prompts_per_step * G // 64), max_steps=args.max_steps,
        max_completion_length=args.max_completion_length, max_prompt_length=512, learning_rate=args.learning_rate,
        beta=0.0, temperature=1.0, seed=args.seed, device=args.device, output_dir=args.out, logging_steps=1,
        log_completions_steps=10, quiet=True, overwrite_output_dir=True,
        importance_sampling_correction={"auto": None, "true": True, "false": False}[args.importance_sampling_correction],
    )
    curve: list[dict] = []

    class BenchTrainer(GRPOTrainer):
        def log_step(self, batch, losses, seconds):
            super().log_step(batch, losses, seconds)
            r = self.history[-1]
            curve.append({k: r.get(k) for k in ("step", "rewards/format_reward/mean", "rewards/tag_count_reward/mean",
                                                 "rewards/accuracy_reward/mean", "reward", "informative",
                                                 "completions/mean_length", "step_time",
                                                 "sampling/sampling_logp_difference/mean",
                                                 "sampling/importance_sampling_ratio/min",
                                                 "sampling/importance_sampling_ratio/max")})
            print(f"step {r['step']:3d}  format {r['rewards/format_reward/mean']:.3f}  "
                  f"|Δlogp| {_num(r.get('sampling/sampling_logp_difference/mean')):.4f}  "
                  f"tag_count {r['rewards/tag_count_reward/mean']:.3f}  accuracy {_num(r['rewards/accuracy_reward/mean']):.3f}  "
                  f"informative {r['informative']:.2f}  length {r['completions/mean_length']:.0f}  "
                  f"{r['step_time']:.1f}s", flush=True)
            held = [c["rewards/format_reward/mean"] for c in curve[-args.hold:]]
            if len(held) == args.hold and min(held) >= args.target:
                raise _Stop(f"format reward ≥ {args.target} for {args.hold} steps")
            if time.perf_counter() - grpo_started > args.time_budget:
                raise _Stop(f"time budget {args.time_budget:g}s spent")

    trainer = BenchTrainer(model, None, train_rows, args=config, task=task, log=lambda *a: print(*a, flush=True))
    tokenizer, sampler = trainer.tokenizer, trainer.sampler
    print(f"device {trainer.device}, {torch.cuda.get_device_name() if trainer.device.type == 'cuda' else 'cpu'}; "
          f"model {model}; {len(test_rows)} test questions, {len(train_rows)} train questions", flush=True)

    def held_out(label: str):
        t = time.perf_counter()
        result = evaluate(sampler, tokenizer, task, test_rows, trainer.group_sampler.encode_prompt,
                          max_new_tokens=args.max_completion_length, batch_size=256)
        print(f"eval {label}: pass@1 {100 * result.accuracy:.1f}%  format {100 * result.format_rate:.1f}%  "
              f"mean length {result.mean_length:.0f}  ({time.perf_counter() - t:.0f}s)", flush=True)
        return result

    def sampled_format_rate() -> float:
        probe = train_rows[:max(2, min(32, len(train_rows)))]
        rollout = sampler.generate([trainer.group_sampler.encode_prompt(r["prompt"]) for r in probe], 2, SamplingParams(
            max_new_tokens=args.max_completion_length, temperature=1.0, eos_token_ids=[tokenizer.eos_token_id],
            pad_token_id=trainer.pad_id, seed=args.seed))
        texts = [tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
                 for ids, m in zip(rollout.completion_ids, rollout.completion_mask)]
        return sum(format_reward(None, texts)) / len(texts)

    before = held_out("before (base model)")
    # Cold start, in rounds, only until the format appears in samples: GRPO must do the rest.
    sft_rows = [{"prompt": r["prompt"], "completion": task.solved_completion(r)} for r in train_rows]
    sft_steps, rate = 0, sampled_format_rate()
    print(f"sampled format rate of the base model: {rate:.3f}", flush=True)
    while rate < args.sft_until and sft_steps < args.sft_max_steps:
        steps = min(args.sft_round, args.sft_max_steps - sft_steps)
        sft_train(trainer.model, tokenizer, sft_rows, SFTConfig(
            learning_rate=args.sft_learning_rate, max_steps=steps, batch_size=args.sft_batch_size, warmup_steps=0,
            seed=args.seed + sft_steps, logging_steps=0, max_completion_length=args.max_completion_length))
        sft_steps += steps
        rate = sampled_format_rate()
        print(f"cold start: {sft_steps} SFT steps, sampled format rate {rate:.3f}", flush=True)
    after_sft = held_out(f"after {sft_steps} cold-start SFT steps") if sft_steps else before

    grpo_started = time.perf_counter()
    stop_reason = f"max_steps {args.max_steps}"
    try:
        trainer.train()
    except _Stop as stop:
        stop_reason = str(stop)
        trainer.finish()
    grpo_seconds = time.perf_counter() - grpo_started
    after = held_out("after GRPO")
    trainer.rewards.close()  # the per-sample scoring processes
    results = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if trainer.device.type == "cuda" else "cpu",
        "model": Path(model).name, "eval_questions": len(test_rows), "train_questions": len(train_rows),
        "pass1_before": before.accuracy, "pass1_after_sft": after_sft.accuracy, "pass1_after": after.accuracy,
        "format_rate_before": before.format_rate, "format_rate_after": after.format_rate,
        "sft_steps": sft_steps, "grpo_steps": len(curve), "grpo_seconds": round(grpo_seconds, 1),
        "format_start": curve[0]["rewards/format_reward/mean"] if curve else None,
        "format_end": curve[-1]["rewards/format_reward/mean"] if curve else None,
        "stop_reason": stop_reason, "total_seconds": round(time.perf_counter() - started, 1), "curve": curve,
        "command": "python " + " ".join(sys.argv),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\ncurve (step, format mean):", " ".join(f"{c['step']}:{c['rewards/format_reward/mean']:.2f}" for c in curve))
    print("\n| date | card | model | test questions | pass@1 before → after cold start → after GRPO | "
          "format reward first → last GRPO step | SFT steps | GRPO steps (s) | stop |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {results['date']} | {results['device']} | {results['model']} | {len(test_rows)} | "
          f"{100 * before.accuracy:.1f}% → {100 * after_sft.accuracy:.1f}% → {100 * after.accuracy:.1f}% | "
          f"{_num(results['format_start']):.2f} → {_num(results['format_end']):.2f} | {sft_steps} | "
          f"{len(curve)} ({grpo_seconds:.0f}) | {stop_reason} |")
    return results


def _num(value) -> float:
    return math.nan if value is None else float(value)


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.mode == "prepare":
        prepare()
    else:
        run(parsed)
