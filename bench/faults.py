"""Faults in a 2-GPU job (NCCL): each ends within a bounded time with one line, and --resume then equals the
uninterrupted run.

Three faults, each on `cohort-grpo train --nproc_per_node 2` with the built-in tiny model and the arithmetic task:

- trainer_killed: DDP over 2 ranks; `kill -9` of rank 1 once step 2 is logged;
- sampler_killed: `--rollout_gpus 1` (rank 0 trains, rank 1 samples); `kill -9` of rank 1 once step 2 is logged;
- weights_withheld: `--rollout_gpus 1` with COHORT_INJECT_FAULT=withhold_weights:2 (rank 0 skips the weight
  broadcasts from policy version 2 on: a broadcast that never completes) and `--ddp_timeout` short.

For each: an uninterrupted run of --steps steps (one per layout), the faulted run, then `--resume` to --steps
steps; "resume equal" = every step's loss and the final weights within --tolerance of the uninterrupted run.
On GPUs every run has `--full_determinism true` (the attention backward's atomics and cuBLAS's workspace
would otherwise make two uninterrupted runs differ in the last bf16 bits), and a second uninterrupted run
per layout (`run_to_run_difference`) shows that two runs from one seed are equal there.
Prints a table (fault, seconds to end, the one line, resume equal) and writes JSON to --out.

    python bench/faults.py --out faults.json               # 2 GPUs, NCCL (~3 min)
    python bench/faults.py --smoke --out /tmp/faults.json  # CPU processes with gloo: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]


def options(out: Path, device: str, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "cohort_grpo", "train", "--nproc_per_node", "2", "--task", "arithmetic",
            "--num_generations", "4", "--per_device_train_batch_size", "8", "--max_completion_length", "16",
            "--eval_limit", "0", "--learning_rate", "3e-4", "--seed", "3", "--logging_steps", "1", "--quiet",
            "--device", device, "--save_steps", "1", "--save_total_limit", "0", "--max_steps", str(steps),
            "--output_dir", str(out), *(["--full_determinism", "true"] if device != "cpu" else []), *extra]


def environment(**extra: str) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1", CI="1", **extra)


def steps_logged(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def rank_pid(tag: str, rank: int) -> int | None:
    """The pid of rank `rank` of the job whose environment holds COHORT_BENCH_TAG=tag."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = (Path("/proc") / entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"COHORT_BENCH_TAG={tag}".encode() in env and f"RANK={rank}".encode() in env:
            return int(entry)
    return None


def faulted_run(command: list[str], out: Path, kill_rank: int | None, inject: str | None,
                limit_s: float) -> tuple[float, list[str], int]:
    """Run `command` with its fault; seconds from the fault (the kill, or the start for an injected one) to the
    job's end, its `cohort: error:` lines, and its exit code."""
    tag = f"faults-{os.getpid()}-{time.monotonic_ns()}"
    env = environment(COHORT_BENCH_TAG=tag, **({"COHORT_INJECT_FAULT": inject} if inject else {}))
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started = time.monotonic()
    try:
        if kill_rank is not None:
            while len(steps_logged(out)) < 2:
                if process.poll() is not None or time.monotonic() - started > limit_s:
                    raise RuntimeError("the job ended or stalled before step 2; nothing was killed")
                time.sleep(0.1)
            os.kill(rank_pid(tag, kill_rank), signal.SIGKILL)
            started = time.monotonic()
        output, _ = process.communicate(timeout=limit_s)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    lines = [line for line in output.splitlines() if line.startswith("cohort: error:")]
    return time.monotonic() - started, lines, process.returncode


def same_run(out: Path, reference: Path, tolerance: float) -> tuple[bool, float]:
    from safetensors.torch import load_file

    got, expected = steps_logged(out), steps_logged(reference)
    if [r["step"] for r in got] != [r["step"] for r in expected]:
        return False, float("inf")
    worst = max(abs(a["loss"] - b["loss"]) for a, b in zip(got, expected))
    weights, reference_weights = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    worst = max(worst, max((weights[k].float() - reference_weights[k].float()).abs().max().item() for k in weights))
    return worst <= tolerance, worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--smoke", action="store_true", help="CPU processes with gloo (checks the script)")
    parser.add_argument("--steps", type=int, default=8, help="steps of every run (the kill comes after step 2)")
    parser.add_argument("--timeout", type=int, default=20, help="--ddp_timeout of the withheld-weights run")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest loss / weight difference for equal")
    parser.add_argument("--limit", type=float, default=300,
                        help="seconds any one job may take (on a GPU, compilation takes about 20 s of each)")
    parser.add_argument("--faults", default="trainer_killed,sampler_killed,weights_withheld",
                        help="which faults to run, in order")
    parser.add_argument("--workdir", default=None, help="folder for the runs (default: a temporary one)")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    work = Path(args.workdir or tempfile.mkdtemp(prefix="cohort-faults-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    # The built-in model is built once per machine (an SFT warm start, about 45 s on an H200): before the
    # timed jobs, so no job's limit is spent on it.
    sys.path.insert(0, str(ROOT))
    from cohort_grpo.sft.builtin import builtin_model_dir

    builtin_model_dir("cohort:tiny-arithmetic")
    rollout = ["--async_rollouts", "true", "--rollout_gpus", "1"]
    faults = [("trainer_killed", [], 1, None), ("sampler_killed", rollout, 1, None),
              ("weights_withheld", [*rollout, "--ddp_timeout", str(args.timeout)], None, "withhold_weights:2")]
    faults = [fault for fault in faults if fault[0] in args.faults.split(",")]
    references: dict[str, Path] = {}
    controls: dict[str, float] = {}
    results = []
    for name, extra, kill_rank, inject in faults:
        layout = "rollout" if extra else "ddp"
        if layout not in references:
            references[layout] = work / f"reference-{layout}"
            with open(work / f"reference-{layout}.log", "w") as log:  # read it when a reference run fails
                subprocess.run(options(references[layout], device, args.steps, *extra), env=environment(),
                               check=True, timeout=args.limit, stdout=log, stderr=subprocess.STDOUT)
            if device != "cpu":  # the floor "equal" is judged against: a second run from the same seed
                control = work / f"control-{layout}"
                subprocess.run(options(control, device, args.steps, *extra), env=environment(), check=True,
                               timeout=args.limit, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                controls[layout] = same_run(control, references[layout], args.tolerance)[1]
        out = work / name
        row = {"fault": name, **({"run_to_run_difference": controls[layout]} if layout in controls else {})}
        try:
            seconds, lines, code = faulted_run(options(out, device, args.steps, *extra), out, kill_rank, inject,
                                               args.limit)
            row.update(seconds_to_end=round(seconds, 1), exit_code=code, lines=lines,
                       line=lines[0] if len(lines) == 1 else f"{len(lines)} error lines")
            resumed = subprocess.run(options(out, device, args.steps, *extra, "--resume", "true"), env=environment(),
                                     timeout=args.limit, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            (work / f"{name}-resume.log").write_text(resumed.stdout)
            equal, worst = same_run(out, references[layout], args.tolerance) if resumed.returncode == 0 else (False, None)
            row.update(resume_equal=equal, resume_max_difference=worst, resume_exit_code=resumed.returncode)
            if resumed.returncode != 0:
                row["resume_output"] = resumed.stdout.splitlines()[-15:]
        except (RuntimeError, subprocess.TimeoutExpired, OSError, TypeError) as error:
            row.update(error=f"{type(error).__name__}: {error}", resume_equal=False)
        results.append(row)
        Path(args.out).write_text(json.dumps({"device": device, "steps": args.steps, "results": results}, indent=2))
    print(f"{'fault':<18} {'s to end':>8}  {'resume equal':<12} the one line")
    for row in results:
        seconds = row.get("seconds_to_end", float("nan"))
        print(f"{row['fault']:<18} {seconds:>8.1f}  {'yes' if row['resume_equal'] else 'no':<12} "
              f"{row.get('line', row.get('error'))}")
    print(f"wrote {args.out}")
    return 0 if all(row["resume_equal"] and "line" in row for row in results) else 1


if __name__ == "__main__":
    sys.exit(main())
