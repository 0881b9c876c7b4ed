"""Every Triton kernel's GPU tests, and one whole training run, under NVIDIA's compute-sanitizer.

memcheck catches out-of-bounds and misaligned reads and writes of global memory, racecheck hazards
between threads of a block on shared memory (the decode-attention and sampling kernels reduce
through it), initcheck reads of memory nothing wrote. Each target is a pytest node id run in its own
process with the GPU visible (COHORT_TEST_GPU=1); a target passes when its tests pass and the tool
reports 0 errors. The end-to-end target trains the tiny model for a few steps, so the engine's
CUDA-graph decode, the LM-head statistics and the fused optimizer run on real shapes too.

    python bench/sanitize_kernels.py                      # on a GPU machine; table last
    python bench/sanitize_kernels.py --tools memcheck --out sanitizer.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (tool, pytest target). Kernels with shared-memory reductions get racecheck as well as memcheck.
TARGETS = [
    ("memcheck", "tests/test_trainer.py::test_reference_resets_every_M_steps"),
    ("memcheck", "tests/test_triton_logprobs.py"),
    ("memcheck", "tests/test_triton_sampling.py"),
    ("memcheck", "tests/test_triton_decode_step.py"),
    ("memcheck", "tests/test_decode_attention.py"),
    ("memcheck", "tests/test_adamw_kernel.py"),
    ("racecheck", "tests/test_decode_attention.py"),
    ("racecheck", "tests/test_triton_sampling.py"),
    ("initcheck", "tests/test_triton_logprobs.py"),
]

SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")
HAZARDS = re.compile(r"RACECHECK SUMMARY: (\d+) hazard")


def run_target(tool: str, target: str, timeout_s: float, log_dir: Path | None) -> dict:
    command = ["compute-sanitizer", f"--tool={tool}", "--print-limit=20", "--target-processes=all",
               sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", target]
    env = dict(os.environ, COHORT_TEST_GPU="1", PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        output = (expired.stdout or b"").decode(errors="replace") if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        code = None
    seconds = time.perf_counter() - started
    errors = [int(n) for n in SUMMARY.findall(output)]
    hazards = [int(n) for n in HAZARDS.findall(output)]
    tests = re.findall(r"(\d+ (?:passed|failed|skipped|error)[^\n]*) in [\d.]+s", output)
    if log_dir is not None:
        (log_dir / f"{tool}-{re.sub(r'[^A-Za-z0-9_.-]', '_', target)}.log").write_text(output)
    return {"tool": tool, "target": target, "seconds": round(seconds, 1), "exit_code": code,
            "errors": sum(errors) + sum(hazards) if (errors or hazards) else None,
            "tests": tests[-1] if tests else "no summary",
            "ok": code == 0 and bool(errors or hazards) and sum(errors) + sum(hazards) == 0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tools", default="memcheck,racecheck,initcheck", help="comma-separated tools to run")
    parser.add_argument("--targets", default="", help="comma-separated pytest targets (default: the built-in list)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per target")
    parser.add_argument("--out", default="", help="write the results as JSON here (logs beside it)")
    args = parser.parse_args(argv)
    if shutil.which("compute-sanitizer") is None:
        print("compute-sanitizer is not on PATH: run this on a machine with the CUDA toolkit", file=sys.stderr)
        return 2
    tools = set(args.tools.split(","))
    targets = [(t, x) for t, x in TARGETS if t in tools]
    if args.targets:
        targets = [(t, x) for t in args.tools.split(",") for x in args.targets.split(",")]
    log_dir = Path(args.out).parent if args.out else None
    results = []
    for tool, target in targets:
        result = run_target(tool, target, args.timeout, log_dir)
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print("\n| tool | target | errors | tests | s |\n| --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['tool']} | {r['target']} | {r['errors']} | {r['tests']} | {r['seconds']} |")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
