"""Does the fast engine change what GRPO learns? The same runs with each sampler, side by side.

For each seed, `cohort-grpo train` runs twice on the built-in task with identical settings: once with
our own model sampled by the engine (`--model_impl cohort`), once with the transformers model
sampled by Hugging Face `generate` (`--model_impl hf`). The two samplers draw different random
numbers, so the runs are not token-identical; what must agree is the learning curve, within the
spread that seeds alone produce. Prints held-out accuracy before/after and the mean success per
window of steps for each run, the mean per sampler, and the seed-to-seed spread; writes
$OUT/engine_vs_hf.json and $OUT/engine_vs_hf.png when OUT is set.

    python bench/engine_vs_hf.py --seeds 0,1,2 --max_steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def run(impl: str, seed: int, args, root: Path) -> dict:
    out = root / f"{impl}-seed{seed}"
    command = [sys.executable, "-m", "cohort_grpo", "train", "--model_impl", impl, "--seed", str(seed),
               "--max_steps", str(args.max_steps), "--output_dir", str(out), "--quiet", "true",
               "--logging_steps", "1"]
    started = time.perf_counter()
    subprocess.run(command, check=True)
    seconds = time.perf_counter() - started
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    success = [m["success"] for m in metrics if "success" in m]
    summary = json.loads((out / "summary.json").read_text())
    return dict(impl=impl, seed=seed, seconds=seconds, success=success,
                accuracy_before=summary["accuracy_before"], accuracy_after=summary["accuracy_after"])


def windows(values: list[float], size: int) -> list[float]:
    return [float(np.mean(values[i: i + size])) for i in range(0, len(values), size)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--window", type=int, default=25)
    args = parser.parse_args(argv)
    root = Path(os.environ.get("OUT", "runs/engine_vs_hf"))
    root.mkdir(parents=True, exist_ok=True)
    runs = [run(impl, int(seed), args, root) for seed in args.seeds.split(",") for impl in ("cohort", "hf")]
    for r in runs:
        r["success_windows"] = windows(r["success"], args.window)
        print(json.dumps({k: v for k, v in r.items() if k != "success"}), flush=True)
    table = ["| sampler | seed | held-out before → after | success per window of "
             f"{args.window} steps | wall s |", "| --- | --- | --- | --- | --- |"]
    for r in runs:
        table.append(f"| {r['impl']} | {r['seed']} | {100 * r['accuracy_before']:.1f}% → {100 * r['accuracy_after']:.1f}% "
                     f"| {' '.join(f'{100 * w:.0f}' for w in r['success_windows'])} | {r['seconds']:.0f} |")
    print("\n".join(table))
    by_impl = {impl: np.array([r["success_windows"] for r in runs if r["impl"] == impl]) for impl in ("cohort", "hf")}
    gap = np.abs(by_impl["cohort"].mean(0) - by_impl["hf"].mean(0))
    spread = np.concatenate([by_impl["cohort"], by_impl["hf"]]).std(0)
    after = {impl: float(np.mean([r["accuracy_after"] for r in runs if r["impl"] == impl])) for impl in by_impl}
    print(json.dumps(dict(mean_accuracy_after=after, max_window_gap=float(gap.max()),
                          mean_seed_spread=float(spread.mean()))), flush=True)
    (root / "engine_vs_hf.json").write_text(json.dumps(runs, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for r in runs:
            steps = np.arange(len(r["success_windows"])) * args.window + args.window / 2
            ax.plot(steps, r["success_windows"], color="C0" if r["impl"] == "cohort" else "C1", alpha=0.8,
                    label=f"{'engine' if r['impl'] == 'cohort' else 'HF generate'} seed {r['seed']}")
        ax.set_xlabel("GRPO step")
        ax.set_ylabel(f"training success (mean over {args.window} steps)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(root / "engine_vs_hf.png", dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
