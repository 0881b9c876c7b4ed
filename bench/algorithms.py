"""GRPO, Dr. GRPO, DAPO, GSPO and PPO on the built-in task: held-out accuracy vs time, peak memory.

    python bench/algorithms.py                       # 5 algorithms × 3 seeds, writes its notebook section + PNG
    python bench/algorithms.py --steps 20 --seeds 0  # a quick look

Each (algorithm, seed) runs in its own subprocess (one torch thread) so its peak RSS is its own:
the parent reads it from `os.wait4`. Every run starts from the built-in warm-started tiny model with
`cohort-grpo train`'s defaults for the arithmetic task (level 3), then applies the algorithm's options
below. Accuracy is greedy pass@1 on held-out problems every `--eval-every` steps; the time axis is
training time with the evaluations themselves taken out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Algorithms on the built-in task (issue 10)"
NOTEBOOK = "benchmarks-2026-11.md"  # the dated notebook this section lives in (docs/history/)

# Options on top of the arithmetic task's defaults. μ = 2 for all: at μ = 1 the ratio is ≡ 1, so
# clipping (DAPO's clip-higher, GSPO's sequence clip, PPO's clip) would never act.
COMMON = dict(num_iterations=2)
ALGORITHMS = {
    "grpo": dict(),  # the default: β = 0.04 with a reference, group-std scaling, per-completion mean
    "dr_grpo": dict(scale_rewards="none", loss_type="dr_grpo", beta=0.0),  # Liu et al. 2025 drop KL too
    "dapo": dict(epsilon_high=0.28, dynamic_sampling=True, loss_type="dapo", beta=0.0,
                 overlong_buffer_length=2, overlong_penalty_factor=1.0),
    # GSPO's paper clips the sequence ratio at 3e-4 / 4e-4 (its §5.1); the ratio is a geometric mean.
    "gspo": dict(importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
    "ppo": dict(),  # PPOConfig: separate critic copy, GAE γ = 1, λ = 0.95, token-mean loss, KL in the reward
}
LABELS = {"grpo": "GRPO", "dr_grpo": "Dr. GRPO", "dapo": "DAPO", "gspo": "GSPO", "ppo": "PPO (critic + GAE)"}


# ---- worker: one run, in its own process -------------------------------------------------------

class EvalClock:
    """A trainer callback: held-out accuracy against training time with the evaluations taken out. An
    evaluation starts right after `on_train_begin` (the one before step 1) or `on_step_end`, and ends
    with its `on_evaluate`; the first one's end starts the clock."""

    def __init__(self):
        self.points: list[dict] = []
        self.start: float | None = None
        self.eval_seconds = 0.0
        self.mark = 0.0  # when the latest evaluation could have started

    def on_train_begin(self, args, state, control, **kwargs):
        self.mark = time.perf_counter()

    on_step_end = on_train_begin

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        now, accuracy = time.perf_counter(), (metrics or {}).get("eval/accuracy")
        if self.start is None:
            self.start = now
            self.points.append({"step": 0, "seconds": 0.0, "accuracy": accuracy})
        else:
            seconds = self.mark - self.start - self.eval_seconds
            self.points.append({"step": state.global_step, "seconds": seconds, "accuracy": accuracy})
            self.eval_seconds += now - self.mark


def worker(algorithm: str, seed: int, steps: int, eval_every: int, eval_problems: int, out_dir: str,
           extra: dict | None = None) -> dict:
    import torch

    torch.set_num_threads(1)
    from cohort_grpo.cli import task_rows
    from cohort_grpo.config.grpo_config import GRPOConfig
    from cohort_grpo.trainer.ppo_trainer import PPOConfig, PPOTrainer
    from cohort_grpo.tasks import get_task
    from cohort_grpo.trainer.grpo_trainer import GRPOTrainer

    task = get_task("arithmetic")
    options = dict(task.default_config)
    options.update(COMMON)
    options.update(ALGORITHMS[algorithm])
    options.update(extra or {})
    options.update(seed=seed, max_steps=steps, eval_steps=eval_every, eval_limit=eval_problems, quiet=True,
                   output_dir=out_dir, logging_steps=10, device="cpu")
    config_class, trainer_class = (PPOConfig, PPOTrainer) if algorithm == "ppo" else (GRPOConfig, GRPOTrainer)
    args = config_class(**options).validate()
    train_rows, eval_rows = task_rows(task, args)
    clock = EvalClock()
    trainer = trainer_class(None, None, train_rows, args=args, eval_dataset=eval_rows, task=task, log=lambda *_: None,
                            callbacks=[clock])
    trainer.train()
    points = clock.points
    models = [trainer.model] + [m for m in (trainer.ref_model, getattr(trainer, "critic", None)) if m is not None]
    optimizers = [trainer.optimizer] + [o for o in (getattr(trainer, "critic_optimizer", None),) if o is not None]
    state_bytes = sum(p.numel() * p.element_size() for m in models for p in m.parameters())
    state_bytes += sum(t.numel() * t.element_size() for o in optimizers for s in o.state.values()
                       for t in s.values() if torch.is_tensor(t))
    dropped = [h.get("dynamic_sampling/dropped_groups") for h in trainer.history]
    return {"algorithm": algorithm, "seed": seed, "points": points, "state_mib": state_bytes / 2**20,
            "parameters": sum(p.numel() for m in models for p in m.parameters()),
            "mean_dropped_groups": (sum(dropped) / len(dropped)) if dropped and dropped[0] is not None else None}


def baseline_worker() -> dict:
    """What a process holds before training: torch, the tiny model, the task rows (RSS floor)."""
    import torch

    torch.set_num_threads(1)
    from cohort_grpo.run.policy import load_policy
    from cohort_grpo.tasks import get_task

    load_policy(None, device="cpu", log=lambda *_: None)
    get_task("arithmetic").load("train", levels=(3,))
    return {"algorithm": "baseline"}


# ---- parent: run everything, write the figure and the table ------------------------------------

def run_one(argv: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--worker", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"worker {argv} failed:\n{stderr[-3000:]}")
    result = json.loads(stdout.strip().splitlines()[-1])
    result["peak_rss_mib"] = usage.ru_maxrss / 1024  # Linux: kilobytes
    result["process_seconds"] = time.perf_counter() - started
    return result


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    for algorithm in ALGORITHMS:
        runs = [r for r in results if r["algorithm"] == algorithm]
        if not runs:
            continue
        n = min(len(r["points"]) for r in runs)
        seconds = np.array([[p["seconds"] for p in r["points"][:n]] for r in runs]).mean(axis=0)
        accuracy = 100 * np.array([[p["accuracy"] for p in r["points"][:n]] for r in runs])
        line, = ax.plot(seconds, accuracy.mean(axis=0), marker="o", label=f"{LABELS[algorithm]} ({len(runs)} seeds)")
        ax.fill_between(seconds, accuracy.min(axis=0), accuracy.max(axis=0), color=line.get_color(), alpha=0.15)
    ax.set_xlabel("training time, s (evaluation excluded; mean over seeds)")
    ax.set_ylabel("held-out accuracy, % (greedy)")
    ax.set_title("Built-in arithmetic task (level 3), tiny model, 2-core CPU")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)


def table(results: list[dict], baseline_rss: float) -> str:
    def spread(values, fmt="{:.1f}"):
        mean = sum(values) / len(values)
        return f"{fmt.format(mean)} [{fmt.format(min(values))}–{fmt.format(max(values))}]"

    rows = ["| algorithm | accuracy before | accuracy after, mean [min–max] | train time s | s / step | "
            "peak RSS MiB | RSS above floor MiB | params + optimizer state MiB |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for algorithm in ALGORITHMS:
        runs = [r for r in results if r["algorithm"] == algorithm]
        if not runs:
            continue
        first = [100 * r["points"][0]["accuracy"] for r in runs]
        last = [100 * r["points"][-1]["accuracy"] for r in runs]
        seconds = [r["points"][-1]["seconds"] for r in runs]
        steps = runs[0]["points"][-1]["step"]
        rss = [r["peak_rss_mib"] for r in runs]
        rows.append(f"| {LABELS[algorithm]} | {spread(first)}% | {spread(last)}% | {spread(seconds, '{:.0f}')} | "
                    f"{sum(seconds) / len(seconds) / steps:.2f} | {spread(rss, '{:.0f}')} | "
                    f"{sum(rss) / len(rss) - baseline_rss:.0f} | {runs[0]['state_mib']:.1f} |")
    return "\n".join(rows)


SETUP = """\
- Machine: the 2-core CPU development machine (no GPU), **shared with other jobs while this ran**, so
  timings are noisy: compare the algorithms with each other, not with other sections. torch 2.13.0 CPU,
  one thread per run. Date: 2026-11-26.
- Command: `{command}` — {n_algorithms} algorithms × seeds {seeds}, each run in its own subprocess (peak
  RSS from `wait4`). Raw results: `results.json` in the runs folder.
- Setup: `cohort-grpo train`'s built-in defaults (the warm-started 313k-parameter tiny Llama; level-3 addition;
  8 prompts × 8 completions per step; lr 2e-5; at most 8 completion tokens), {steps} steps, greedy accuracy
  on {problems} held-out problems every {every} steps. μ = 2 updates per rollout for every algorithm: at μ = 1
  the importance ratio is ≡ 1, so no clip (DAPO's clip-higher, GSPO's sequence clip, PPO's) would ever act.
- Options per algorithm: GRPO = the defaults (β = 0.04 with a reference model, group-std scaling,
  per-completion mean); Dr. GRPO = `scale_rewards=none loss_type=dr_grpo beta=0`; DAPO = `epsilon_high=0.28
  dynamic_sampling loss_type=dapo beta=0 overlong_buffer_length=2`; GSPO = `importance_sampling_level=sequence
  epsilon=3e-4 epsilon_high=4e-4` (the paper's clip range); PPO = `PPOTrainer` (a separate critic copy of the
  policy with a scalar head, GAE γ = 1, λ = 0.95, clipped value loss, token-mean loss, KL in the reward,
  critic lr = policy lr).
- Columns: accuracy before/after (mean [min–max] over seeds); training time excludes the evaluations;
  "RSS above floor" subtracts a process that only imports torch and loads the model and task rows
  ({floor:.0f} MiB); "params + optimizer state" counts policy, reference, critic and AdamW moments.
"""
READING_MARK = "<!-- reading: hand-written notes below are kept when the bench rewrites this section -->"


def section(results: list[dict], baseline_rss: float, opts) -> str:
    seeds = sorted({r["seed"] for r in results})
    algorithms = [a for a in ALGORITHMS if any(r["algorithm"] == a for r in results)]
    command = (f"python bench/algorithms.py --steps {opts.steps} --eval-every {opts.eval_every} "
               f"--eval-problems {opts.eval_problems}")
    text = [SECTION, "", SETUP.format(command=command, n_algorithms=len(algorithms),
                                      seeds=", ".join(map(str, seeds)), steps=opts.steps, problems=opts.eval_problems,
                                      every=opts.eval_every, floor=baseline_rss), table(results, baseline_rss), ""]
    dropped = [r["mean_dropped_groups"] for r in results if r.get("mean_dropped_groups") is not None]
    if dropped:
        text.append(f"DAPO's dynamic sampling dropped {sum(dropped) / len(dropped):.2f} uninformative groups per step "
                    f"on average (of {8} prompts), each refilled by sampling more prompts.\n")
    text.append("![held-out accuracy vs training time, mean and min–max over seeds](algorithms.png)\n")
    return "\n".join(text)


def write_section(text: str, path: Path) -> None:
    """Replace this bench's section of the notebook (or append it), leaving the others alone; notes
    written by hand below READING_MARK inside the section are kept."""
    doc = path.read_text()
    start = doc.find(SECTION)
    notes = ""
    if start == -1:
        doc = doc.rstrip("\n") + "\n\n" + text
    else:
        end = doc.find("\n## ", start + len(SECTION))
        old = doc[start : end if end != -1 else len(doc)]
        if READING_MARK in old:
            notes = old[old.index(READING_MARK) + len(READING_MARK) :].strip("\n")
        doc = doc[:start] + text + (doc[end:] if end != -1 else "")
    text_with_notes = text.rstrip("\n") + "\n\n" + READING_MARK + ("\n\n" + notes if notes else "") + "\n"
    doc = doc.replace(text, text_with_notes, 1)
    path.write_text(doc.rstrip("\n") + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-problems", type=int, default=100)
    parser.add_argument("--out", default="docs/history", help=f"folder of {NOTEBOOK} and algorithms.png ('' = print only)")
    parser.add_argument("--runs-dir", default="/tmp/cohort-bench-algorithms")
    parser.add_argument("--from-results", help="rewrite the doc section and PNG from a saved results.json; no runs")
    parser.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.from_results:
        saved = json.loads(Path(opts.from_results).read_text())
        publish(saved["runs"], saved["baseline"], opts)
        return
    if opts.worker is not None:
        if opts.worker == ["baseline"]:
            print(json.dumps(baseline_worker()))
            return
        algorithm, seed, out_dir = opts.worker[0], int(opts.worker[1]), opts.worker[2]
        print(json.dumps(worker(algorithm, seed, opts.steps, opts.eval_every, opts.eval_problems, out_dir)))
        return

    algorithms = [a for a in opts.algorithms.split(",") if a]
    unknown = set(algorithms) - set(ALGORITHMS)
    if unknown:
        raise SystemExit(f"unknown algorithms {sorted(unknown)}; choose from {list(ALGORITHMS)}")
    seeds = [int(s) for s in opts.seeds.split(",")]
    step_args = ["--steps", str(opts.steps), "--eval-every", str(opts.eval_every),
                 "--eval-problems", str(opts.eval_problems)]
    started = time.perf_counter()
    baseline = run_one(["baseline"])
    print(f"baseline process (torch + tiny model + task rows): peak RSS {baseline['peak_rss_mib']:.0f} MiB", flush=True)
    results = []
    for seed in seeds:  # seeds outermost: a cut-short bench still has every algorithm at seed 0
        for algorithm in algorithms:
            run_dir = Path(opts.runs_dir) / f"{algorithm}-{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)  # this bench's own scratch run folder
            result = run_one([algorithm, str(seed), str(run_dir), *step_args])
            results.append(result)
            curve = " ".join(f"{p['step']}:{100 * p['accuracy']:.0f}%@{p['seconds']:.0f}s" for p in result["points"])
            print(f"{algorithm:8s} seed {seed}: {curve}  peak RSS {result['peak_rss_mib']:.0f} MiB", flush=True)
    total = time.perf_counter() - started
    Path(opts.runs_dir).mkdir(parents=True, exist_ok=True)
    (Path(opts.runs_dir) / "results.json").write_text(json.dumps({"baseline": baseline, "runs": results}, indent=1))
    print(f"bench wall time {total / 60:.1f} min")
    publish(results, baseline, opts)


def publish(results: list[dict], baseline: dict, opts) -> None:
    print(table(results, baseline["peak_rss_mib"]))
    if opts.out:
        out = ROOT / opts.out
        plot(results, out / "algorithms.png")
        write_section(section(results, baseline["peak_rss_mib"], opts), out / NOTEBOOK)
        print(f"wrote {out / 'algorithms.png'} and the section of {out / NOTEBOOK}")


if __name__ == "__main__":
    main()
