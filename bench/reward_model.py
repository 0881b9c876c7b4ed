"""A learned reward model r_φ kept current by replay (issue 7) vs the same r_φ frozen after K steps.

On the built-in task (the warm-started tiny Llama policy, arithmetic level 3) the policy is rewarded
by r_φ alone: σ(r_φ(prompt + completion)), an estimate of P(correct). The rule verifier never reaches
the policy; it only labels the samples r_φ trains on. r_φ starts from the policy's warm-start weights
(same character tokenizer) with a fresh zero head: by default the likelihood verifier, score =
a · log π_φ(completion | prompt) + b (`--scorer head`: a scalar head on the last token). Before GRPO,
both conditions share one offline warm-up: `--warmup-batches` batches of the initial policy, labelled,
a head-only probe, then `--warmup-updates` updates; its held-out accuracy is reported.

    (a) replay  — r_φ trains after every step: k updates on mini-batches mixing fresh and replayed samples
    (b) frozen  — the same, but only during the first K steps; afterwards r_φ is fixed

Per step it records true accuracy (the verifier on the step's sampled completions), the policy's mean
reward, their gap (reward − accuracy: how far r_φ's belief drifts from the truth) and r_φ's online
accuracy (on the fresh samples, before it trains on them). Held-out greedy accuracy is measured before
and after. Writes results JSON, a Markdown table and a PNG of the curves (mean over seeds, min–max band).

    python bench/reward_model.py                                  # 3 seeds × 2 conditions (~15–20 min on a shared 2-core CPU)
    python bench/reward_model.py --steps 8 --seeds 0 --out /tmp/rm   # smoke test
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from cohort_grpo import GRPOConfig, GRPOTrainer# noqa: E402
from cohort_grpo.config.settings import RewardModelSettings# noqa: E402
from cohort_grpo.rewards.model import RewardModelReward, task_labeller, warm_up_reward_models# noqa: E402
from cohort_grpo.rewards.scorers import load_scorer# noqa: E402
from cohort_grpo.tasks.arithmetic import ArithmeticTask# noqa: E402
from cohort_grpo.sft.builtin import tiny_model_dir# noqa: E402

CONDITIONS = ("replay", "frozen")


def make_trainer(condition: str, seed: int, opts, out_dir: Path, rm=None):
    task = ArithmeticTask()
    policy_dir = str(tiny_model_dir(log=lambda *_: None))
    if rm is None:
        scorer, tokenizer, _, _ = load_scorer(policy_dir, kind=opts.scorer)  # warm-start weights, fresh zero head
        settings = RewardModelSettings(
            updates_per_step=opts.rm_updates, batch_size=opts.rm_batch, learning_rate=opts.rm_lr,
            head_learning_rate=opts.rm_head_lr, replay_ratio=opts.replay_ratio, buffer_size=opts.buffer_size,
            loss="pointwise", scorer=opts.scorer, max_length=64)
        rm = RewardModelReward(scorer, tokenizer, settings, label_fn=task_labeller(task), seed=seed)
    rm.train_steps = opts.frozen_after if condition == "frozen" else 0
    defaults = dict(task.default_config)
    defaults.update(max_steps=opts.steps, seed=seed, quiet=True, logging_steps=1, log_completions_steps=10**6,
                    eval_limit=opts.eval_limit, output_dir=str(out_dir / f"{condition}-seed{seed}"), device="cpu",
                    learning_rate=opts.policy_lr, rm_warmup_batches=opts.warmup_batches,
                    rm_warmup_updates=opts.warmup_updates)
    args = GRPOConfig(**defaults)
    train = task.load("train", levels=[3], size=2000, seed=seed)
    held_out = task.load("test", levels=[3], size=opts.eval_limit)
    return GRPOTrainer(policy_dir, [rm], train, args=args, eval_dataset=held_out, task=task, log=lambda *_: None), rm


def run_seed(seed: int, opts, out_dir: Path) -> list[dict]:
    """Both conditions of one seed; they share one warm-up (the same r_φ, copied before GRPO starts)."""
    trainer, rm = make_trainer("replay", seed, opts, out_dir)
    started = time.perf_counter()
    warm_up_reward_models(trainer)
    warmup = {"seconds": time.perf_counter() - started, **getattr(rm, "warmup_metrics", {})}
    print(f"seed {seed} warm-up: " + ", ".join(f"{k.removeprefix('rm/warmup_')} {v:.3f}" for k, v in warmup.items()),
          flush=True)
    frozen, _ = make_trainer("frozen", seed, opts, out_dir, rm=copy.deepcopy(rm))
    return [dict(run_one(t, c, seed), warmup=warmup) for c, t in (("replay", trainer), ("frozen", frozen))]


def run_one(trainer, condition: str, seed: int) -> dict:
    started = time.perf_counter()
    trainer.train()
    history = trainer.history
    keys = ("success", "reward", "rm/online_accuracy", "rm/pair_accuracy", "rm/loss", "rm/label_mean")
    curves = {k: [float(r.get(k, float("nan"))) for r in history] for k in keys}
    curves["gap"] = [r - s for r, s in zip(curves["reward"], curves["success"])]
    return {"condition": condition, "seed": seed, "seconds": time.perf_counter() - started,
            "accuracy_before": trainer.accuracy_before, "accuracy_after": trainer.accuracy_after, "curves": curves}


def summarise(runs: list[dict], opts) -> list[dict]:
    """Per condition: mean ± std over seeds of the figures the issue asks for."""
    tail = slice(-opts.tail, None)
    warm = slice(opts.warmup, None)
    rows = []
    for condition in CONDITIONS:
        group = [r for r in runs if r["condition"] == condition]
        if not group:
            continue

        def stat(values):
            return float(np.mean(values)), float(np.std(values))

        rows.append({
            "condition": condition, "seeds": len(group),
            "warmup_acc_before": stat([r["warmup"].get("rm/warmup_online_accuracy_before", np.nan) for r in group]),
            "warmup_acc_after": stat([r["warmup"].get("rm/warmup_online_accuracy_after", np.nan) for r in group]),
            "held_out_before": stat([r["accuracy_before"] for r in group]),
            "held_out_after": stat([r["accuracy_after"] for r in group]),
            "true_acc_tail": stat([np.mean(r["curves"]["success"][tail]) for r in group]),
            "reward_tail": stat([np.mean(r["curves"]["reward"][tail]) for r in group]),
            "abs_gap_tail": stat([np.mean(np.abs(r["curves"]["gap"][tail])) for r in group]),
            "abs_gap_after_warmup": stat([np.mean(np.abs(r["curves"]["gap"][warm])) for r in group]),
            "online_acc_after_warmup": stat([np.nanmean(r["curves"]["rm/online_accuracy"][warm]) for r in group]),
            "steps_online_acc_over_90": stat([np.mean(np.array(r["curves"]["rm/online_accuracy"][warm]) > 0.9)
                                              for r in group]),
            "seconds": stat([r["seconds"] for r in group]),
        })
    return rows


def markdown(rows: list[dict], opts) -> str:
    def pct(pair):
        return f"{100 * pair[0]:.1f} ± {100 * pair[1]:.1f}"

    lines = [
        f"| r_φ | r_φ warm-up held-out acc. before → after | policy held-out acc. before → after | true acc. (last {opts.tail} steps) | reward (last {opts.tail}) | "
        f"\\|reward − true\\| (last {opts.tail}) | \\|reward − true\\| (steps > {opts.warmup}) | "
        f"r_φ online acc. (steps > {opts.warmup}) | steps with online acc. > 90% | s / run |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        name = "replay-updated" if r["condition"] == "replay" else f"frozen after {opts.frozen_after} steps"
        lines.append(f"| {name} | {pct(r['warmup_acc_before'])} → {pct(r['warmup_acc_after'])} | {pct(r['held_out_before'])} → {pct(r['held_out_after'])} | {pct(r['true_acc_tail'])} "
                     f"| {pct(r['reward_tail'])} | {pct(r['abs_gap_tail'])} | {pct(r['abs_gap_after_warmup'])} | "
                     f"{pct(r['online_acc_after_warmup'])} | {pct(r['steps_online_acc_over_90'])} | "
                     f"{r['seconds'][0]:.0f} |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], opts, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("success", "true accuracy (sampled completions)"), ("reward", "policy reward σ(r_φ)"),
              ("gap", "reward − true accuracy"), ("rm/online_accuracy", "r_φ online accuracy (before update)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(18, 3.8))
    colours = {"replay": "tab:blue", "frozen": "tab:red"}
    window = opts.smooth
    for ax, (key, title) in zip(axes, panels):
        for condition in CONDITIONS:
            group = [np.array(r["curves"][key], dtype=float) for r in runs if r["condition"] == condition]
            if not group:
                continue
            kernel = np.ones(window) / window
            smooth = np.stack([np.convolve(np.nan_to_num(g, nan=0.5), kernel, mode="valid") for g in group])
            steps = np.arange(window, window + smooth.shape[1])
            label = "replay-updated r_φ" if condition == "replay" else f"r_φ frozen after step {opts.frozen_after}"
            ax.plot(steps, smooth.mean(0), color=colours[condition], label=label)
            ax.fill_between(steps, smooth.min(0), smooth.max(0), color=colours[condition], alpha=0.2)
        if key == "gap":
            ax.axhline(0, color="grey", lw=0.8)
        if key == "rm/online_accuracy":
            ax.axhline(0.9, color="grey", lw=0.8, ls="--")
        ax.axvline(opts.frozen_after, color="grey", lw=0.6, ls=":")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GRPO step")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Learned reward model on the built-in task ({len(runs) // len(CONDITIONS)} seeds; "
                 f"{window}-step moving average, band = min–max over seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--frozen-after", type=int, default=10, help="K: the frozen r_φ trains on steps 1..K only")
    parser.add_argument("--rm-updates", type=int, default=4)
    parser.add_argument("--rm-batch", type=int, default=64)
    parser.add_argument("--rm-lr", type=float, default=3e-4)
    parser.add_argument("--rm-head-lr", type=float, default=3e-3)
    parser.add_argument("--scorer", default="likelihood", choices=["likelihood", "head"])
    parser.add_argument("--warmup-batches", type=int, default=48, help="offline r_φ warm-up: batches of 64 samples")
    parser.add_argument("--warmup-updates", type=int, default=250)
    parser.add_argument("--policy-lr", type=float, default=2e-5)
    parser.add_argument("--replay-ratio", type=float, default=0.5)
    parser.add_argument("--buffer-size", type=int, default=4096)
    parser.add_argument("--eval-limit", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=0, help="GRPO steps excluded from 'after warm-up' figures")
    parser.add_argument("--tail", type=int, default=15)
    parser.add_argument("--smooth", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/bench-reward-model")
    parser.add_argument("--png", default=None, help="also write the figure here (e.g. docs/history/reward_model.png)")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in [int(s) for s in opts.seeds.split(",")]:
        for run in run_seed(seed, opts, out):
            condition = run["condition"]
            runs.append(run)
            c = run["curves"]
            print(f"{condition:7s} seed {seed}: held-out {100 * run['accuracy_before']:.1f}% → "
                  f"{100 * run['accuracy_after']:.1f}%, last-{opts.tail} true acc "
                  f"{100 * np.mean(c['success'][-opts.tail:]):.1f}%, reward {np.mean(c['reward'][-opts.tail:]):.3f}, "
                  f"online acc {100 * np.nanmean(c['rm/online_accuracy'][opts.warmup:]):.1f}% "
                  f"({run['seconds']:.0f} s)", flush=True)
            (out / "runs.json").write_text(json.dumps(runs) + "\n")
    rows = summarise(runs, opts)
    table = markdown(rows, opts)
    (out / "summary.json").write_text(json.dumps({"options": vars(opts), "summary": rows}, indent=2) + "\n")
    (out / "table.md").write_text(table)
    plot(runs, opts, out / "reward_model.png")
    if opts.png:
        plot(runs, opts, Path(opts.png))
    print(table)


if __name__ == "__main__":
    main()
