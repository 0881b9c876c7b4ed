"""Training on a CPU beside another busy program: the built-in tasks alone and beside a CPU hog, per thread count.

A laptop has other work open. PyTorch's CPU threads wait for each other at the end of every parallel
region, so a run whose threads fill every core stalls whenever the scheduler gives one of those cores to
another program. This runs `cohort-grpo train` on a task with each `--cpu_threads` setting, once alone and once
beside one busy process (a Python loop), and prints the training seconds (summary.json: the steps, not
the start-up), the slowdown beside the hog, and whether the two runs logged the same numbers (the thread
count, not the load, decides the arithmetic).

    python bench/busy_cpu.py                                  # calculator task, --cpu_threads auto and every core
    python bench/busy_cpu.py --task arithmetic --max_steps 100 --threads auto,1,2 --out busy.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(task: str, threads: str, max_steps: int | None, out: Path) -> tuple[float, list[dict], float]:
    command = [sys.executable, "-m", "cohort_grpo", "train", "--task", task, "--output_dir", str(out),
               "--cpu_threads", threads, "--device", "cpu", "--quiet", "true"]
    if max_steps:
        command += ["--max_steps", str(max_steps)]
    started = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    wall = time.perf_counter() - started
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    numbers = [{k: v for k, v in r.items() if k in ("step", "loss", "reward", "kl", "entropy")} for r in records]
    return float(summary["seconds"]), numbers, wall


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="calculator")
    parser.add_argument("--max_steps", type=int, default=0, help="0: the task's own")
    parser.add_argument("--threads", default=f"auto,{len(os.sched_getaffinity(0))}",
                        help="comma-separated --cpu_threads settings (default: auto and every core)")
    parser.add_argument("--out", default="", help="write the results as JSON here")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for threads in args.threads.split(","):
            alone, numbers_alone, _ = train(args.task, threads, args.max_steps, Path(tmp) / f"alone-{threads}")
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                busy, numbers_busy, _ = train(args.task, threads, args.max_steps, Path(tmp) / f"busy-{threads}")
            finally:
                hog.kill()
                hog.wait()
            rows.append({"task": args.task, "cpu_threads": threads, "cores": len(os.sched_getaffinity(0)),
                         "seconds_alone": round(alone, 1), "seconds_beside_hog": round(busy, 1),
                         "slowdown": round(busy / alone, 2), "same_numbers": numbers_alone == numbers_busy})
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print("\n| task | --cpu_threads | cores | alone s | beside a hog s | slowdown | same numbers |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['task']} | {r['cpu_threads']} | {r['cores']} | {r['seconds_alone']} | {r['seconds_beside_hog']} "
              f"| {r['slowdown']}× | {'yes' if r['same_numbers'] else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
