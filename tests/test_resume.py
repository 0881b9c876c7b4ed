"""Same seed, same run; SIGKILL (and SIGTERM) at random moments + `--resume` give the uninterrupted run (issue 8).

Real `python -m cohort_grpo train` processes on the CPU: the built-in arithmetic task with a tiny
random-init model and a dense reward named as `module:function` (so each step moves the weights)."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cohort_grpo.run.checkpoint import check_checkpoint, list_checkpoints
from cohort_grpo.models.tiny import build_model, build_tokenizer

SPEC = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=64)
MAX_STEPS = 20
REWARD_MODULE = '''
import os
import random
import time

def digit_share(prompts, completions, completion_ids=None, **_):
    """Share of digits in the completion, plus noise from python's global generator (restored on resume).
    REWARD_DELAY_S slows each call down without changing a number."""
    time.sleep(float(os.environ.get("REWARD_DELAY_S", "0")))
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) + 1e-2 * random.random() for c in completions]
'''
# The SIGTERM attempt's reward delay a step: on an idle machine the 18 steps after the first checkpoint took under
# half a second, so the signal could land after training had ended; at 0.2 s a step it lands inside it.
SIGTERM_ATTEMPT_DELAY_S = 0.2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0, spec=SPEC).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "rewardmod.py").write_text(REWARD_MODULE)
    return root


def train_command(root: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "cohort_grpo", "train", "--model", str(root / "model"), "--task", "arithmetic",
            "--reward_funcs", "rewardmod:digit_share", "--num_generations", "4", "--per_device_train_batch_size", "8",
            "--gradient_accumulation_steps", "1", "--max_completion_length", "5", "--max_prompt_length", "64",
            "--max_steps", str(MAX_STEPS), "--save_steps", "2", "--eval_limit", "4", "--eval_steps", "5",
            "--learning_rate", "3e-3", "--beta", "0.05", "--ref_reset_steps", "6", "--lr_scheduler_type", "cosine",
            "--log_completions_steps", "3", "--logging_steps", "1", "--seed", "7", "--device", "cpu", "--quiet", "--output_dir", str(out),
            *extra]


def environment(root: Path, reward_delay_s: float = 0.0) -> dict:
    # One thread everywhere: the same float reductions in every process, and fair to the shared CPU.
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CI="1", REWARD_DELAY_S=str(reward_delay_s))


def start(root: Path, out: Path, *extra: str, reward_delay_s: float = 0.0) -> subprocess.Popen:
    return subprocess.Popen(train_command(root, out, *extra), env=environment(root, reward_delay_s),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen) -> str:
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-3000:]
    return output


def records(path: Path) -> list[dict]:
    wall_clock = ("time", "step_time")
    return [{k: v for k, v in json.loads(line).items()
             if k not in wall_clock and not k.startswith(("time/", "tokens_per_second", "peak_memory"))}
            for line in path.read_text().splitlines()]


def newest_complete_step(out: Path) -> int:
    steps = [int(p.name.split("-")[1]) for p in list_checkpoints(out) if check_checkpoint(p, hashes=False) is None]
    return max(steps, default=0)


@pytest.fixture(scope="module")
def uninterrupted(setup):
    """Two uninterrupted runs with one seed, started at once and left running beside the killed one
    (on a busy machine, three processes get three shares of the CPU)."""
    runs = {setup / "run-a": start(setup, setup / "run-a"), setup / "run-b": start(setup, setup / "run-b")}

    def finished() -> list[Path]:
        for process in runs.values():
            if process.returncode is None:
                finish(process)
        return list(runs)

    yield finished
    for process in runs.values():
        if process.poll() is None:
            process.kill()


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_equals_the_uninterrupted_run(setup, uninterrupted):
    out = setup / "killed"
    rng = random.Random()
    seed = rng.randrange(10**6)
    rng.seed(seed)
    kills: list[str] = []
    attempt, sigterm_output = 0, None
    while True:
        before = newest_complete_step(out)
        process = start(setup, out, "--resume", reward_delay_s=SIGTERM_ATTEMPT_DELAY_S if attempt == 1 else 0.0)
        if attempt < 4:
            # Attempt 0 dies at a random time (maybe before its first checkpoint); later ones once a new
            # checkpoint exists, a random fraction of a few steps later (maybe while saving one). Attempt 1
            # gets SIGTERM instead: it must save a checkpoint and exit with 143.
            deadline = time.monotonic() + (rng.uniform(0.5, 3.0) if attempt == 0 else 120)
            while process.poll() is None and time.monotonic() < deadline and (
                    attempt == 0 or newest_complete_step(out) <= before):
                time.sleep(0.02)
            time.sleep(0 if attempt == 0 else rng.uniform(0.0, 0.4))
            if process.poll() is None:
                if attempt == 1:
                    process.send_signal(signal.SIGTERM)
                    sigterm_output, _ = process.communicate(timeout=300)
                    assert process.returncode == 143, sigterm_output[-2000:]
                    stopped = [line for line in sigterm_output.splitlines() if line.startswith("cohort: stopped by SIGTERM")]
                    assert len(stopped) == 1 and stopped[0].endswith("continue the run with --resume"), sigterm_output
                    saved = Path(stopped[0].split("checkpoint saved in ")[1].split(" — ")[0])
                    assert check_checkpoint(saved) is None and saved.name == f"checkpoint-{newest_complete_step(out)}"
                else:
                    process.send_signal(signal.SIGKILL)
                    process.wait()
                    kills.append(f"attempt {attempt}: killed with checkpoint-{newest_complete_step(out)} the newest")
                attempt += 1
                continue
        output = finish(process)
        break
    reference = uninterrupted()[0]
    assert sigterm_output is not None, "the SIGTERM attempt did not happen"
    # Attempt 0's kill, and at least one after a checkpoint; a third happens unless the random waits
    # let the run reach its last step first (a fast, idle machine: then nothing is left to kill).
    assert len(kills) >= 2 and any(not k.endswith("checkpoint-0 the newest") for k in kills), (seed, kills)
    assert "resumed from" in output, output
    assert records(out / "metrics.jsonl") == records(reference / "metrics.jsonl"), (seed, kills)
    assert records(out / "completions.jsonl") == records(reference / "completions.jsonl"), (seed, kills)
    final, expected = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in expected), (seed, kills)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == MAX_STEPS
    assert summary["accuracy_before"] == json.loads((reference / "summary.json").read_text())["accuracy_before"]


@pytest.mark.slow
def test_two_runs_with_one_seed_are_identical(uninterrupted):
    a, b = uninterrupted()
    assert len(records(a / "metrics.jsonl")) >= MAX_STEPS
    assert records(a / "metrics.jsonl") == records(b / "metrics.jsonl")
    assert records(a / "completions.jsonl") == records(b / "completions.jsonl")
    weights_a, weights_b = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
