"""What a user reads when something happens in a run: one clear line each, saying what and what next.

A NaN reward is one line naming the function, the sample and its fate (not four lines of Python warnings);
a reward function that raises on a batch quotes the completion it fails on; an `output_dir` that is a file
is called a file; Ctrl-C in a script saves, prints one line and exits 130 (no traceback); the console
prints the steps `logging_steps` asks for, with the time left when piped, then where the run is; a saved
model draws no "Writing model shards" bar and its weights get the umask's mode; the report says which
figure is greedy and which is sampled. The environment's prompt in completions.jsonl is in
test_trl_environments.py (it needs that module's tools model)."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.errors import CohortError
from cohort_grpo.rewards.runner import RewardRunner
from cohort_grpo.run import checkpoint as ckpt
from cohort_grpo.run.lifecycle import prepare_output_dir

torch.set_num_threads(1)

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPLETIONS = ["12", "7", "x9", "30"]


def stderr_lines(capfd) -> list[str]:
    return [line for line in capfd.readouterr().err.splitlines() if line.strip()]


# ---- rewards ---------------------------------------------------------------------------------------

def nan_for_the_third(prompts, completions, **_):
    return [float("nan") if c == "x9" else 1.0 for c in completions]


def one_for_all(prompts, completions, **_):
    return [1.0] * len(completions)


def test_a_nan_reward_is_one_line_naming_the_function_the_sample_and_its_fate(capfd):
    runner = RewardRunner([nan_for_the_third])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = runner(["p"] * 4, COMPLETIONS, None, {})
    assert not caught  # no Python warning (a file:line header and a source line of cohort's own code)
    [line] = stderr_lines(capfd)
    assert line.startswith("cohort: reward 'nan_for_the_third' returned nan for sample 2 of 4 ('x9')"), line
    assert "gets advantage 0" in line and "runner.py" not in line
    assert out.unscored.tolist() == [False, False, True, False]
    # scored by another function too: the line says that one's score stands
    RewardRunner([nan_for_the_third, one_for_all])(["p"] * 4, COMPLETIONS, None, {})
    [line] = stderr_lines(capfd)
    assert "sample 2 of 4 ('x9')" in line and "the other reward functions do" in line, line


def fails_on_x(prompts, completions, **_):
    out = []
    for completion in completions:
        if completion.startswith("x"):
            raise ValueError(f"cannot read {completion!r}")
        out.append(float(completion))
    return out


def test_a_batch_reward_that_raises_quotes_the_completion_it_fails_on(capfd):
    with pytest.raises(CohortError) as caught:
        RewardRunner([fails_on_x])(["p"] * 4, COMPLETIONS, None, {})
    message = str(caught.value)
    assert "raised ValueError: cannot read 'x9' on a batch of 4 completions, and on sample 2 alone ('x9')" in message
    assert "'12'" not in message  # the first completion had nothing to do with it
    RewardRunner([fails_on_x, one_for_all], errors="warn")(["p"] * 4, COMPLETIONS, None, {})
    [line] = stderr_lines(capfd)
    assert "on sample 2 alone ('x9')" in line and "'12'" not in line, line


# ---- the output folder -----------------------------------------------------------------------------

def test_an_output_dir_that_is_a_file_is_called_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CohortError) as caught:
        prepare_output_dir(GRPOConfig(output_dir=str(tmp_path / "notes.txt")))
    message = str(caught.value)
    assert f"output_dir '{tmp_path / 'notes.txt'}' is a file, not a folder" in message
    assert "not writable" not in message
    assert (tmp_path / "notes.txt").read_text() == "mine"


# ---- Ctrl-C in a script ----------------------------------------------------------------------------

CTRL_C_SCRIPT = """
import os, signal, sys
from cohort_grpo import GRPOConfig, GRPOTrainer

def reward(prompts, completions, **_):
    if trainer.step == 2:
        os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C, during step 2
    return [float(len(c) % 2) for c in completions]

args = GRPOConfig(output_dir=sys.argv[2], max_steps=4, num_generations=2, per_device_train_batch_size=4,
                  gradient_accumulation_steps=1, max_completion_length=3, eval_limit=0, quiet=True, device="cpu")
trainer = GRPOTrainer(sys.argv[1], reward, [{"prompt": f"{i}+1="} for i in range(4)], args=args)
trainer.train()
print("after train()")
"""


def test_ctrl_c_in_a_script_saves_and_ends_in_one_line_with_status_130(tiny_dir, tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", CTRL_C_SCRIPT, tiny_dir, str(out)], capture_output=True,
                            text=True, env=env, timeout=300)
    err = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 128 + signal.SIGINT, result.stderr
    assert err == [f"cohort: stopped by SIGINT after step 2; checkpoint saved in {out / 'checkpoint-2'} — continue "
                   "the run with resume=True"], result.stderr
    assert "after train()" not in result.stdout  # the script's code after train() did not run
    assert ckpt.check_checkpoint(out / "checkpoint-2") is None


# ---- the console -----------------------------------------------------------------------------------

def test_the_console_obeys_logging_steps_shows_the_time_left_and_where_the_run_is(tiny_dir, tmp_path, capsys):
    out = tmp_path / "run"
    args = GRPOConfig(output_dir=str(out), max_steps=5, logging_steps=2, num_generations=2,
                      per_device_train_batch_size=4, gradient_accumulation_steps=1, max_completion_length=3,
                      eval_limit=0, device="cpu")
    GRPOTrainer(tiny_dir, one_for_all, [{"prompt": f"{i}+1="} for i in range(4)], args=args).train()
    lines = capsys.readouterr().out.splitlines()  # pytest's stdout is no terminal: plain lines, no bars
    steps = [line for line in lines if line.startswith("Step ")]
    # the first step (the run is under way), every 2nd, the last; the time left once there is a pace to tell it
    assert [line.split(":")[0] for line in steps] == ["Step 1/5", "Step 2/5", "Step 4/5", "Step 5/5"], steps
    assert [bool(re.search(r", eta \d+:\d\d:\d\d$", line)) for line in steps] == [False, True, True, False], steps
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [2, 4, 5]
    assert lines[-1] == (f"run saved in {out}: the trained policy (a Hugging Face folder), metrics.jsonl, "
                         f"completions.jsonl; `cohort-grpo report {out}` draws it")


# ---- saved weights ---------------------------------------------------------------------------------

@pytest.fixture
def umask():
    """Set the process's umask for the test; the previous one is put back."""
    previous = os.umask(0o022)
    yield lambda value: os.umask(value)
    os.umask(previous)


def test_a_transformers_model_saves_without_a_progress_bar(tmp_path, capfd, umask):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from cohort_grpo.models.policy import save_policy

    config = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    save_policy(Qwen2ForCausalLM(config), None, tmp_path / "hf")
    err = capfd.readouterr().err
    assert "Writing model shards" not in err and "it/s" not in err, err
    assert (tmp_path / "hf" / "model.safetensors").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("mask", [0o022, 0o002])
def test_saved_weights_get_the_mode_of_the_other_files(tiny_dir, tmp_path, umask, mask):
    from cohort_grpo.models import from_pretrained
    from cohort_grpo.models.policy import save_policy
    from cohort_grpo.models.tiny import build_tokenizer

    umask(mask)
    out = save_policy(from_pretrained(tiny_dir), build_tokenizer(), tmp_path / "policy")
    modes = {path.name: path.stat().st_mode & 0o777 for path in out.iterdir() if path.is_file()}
    assert modes["model.safetensors"] == 0o666 & ~mask == modes["config.json"], modes
    assert set(modes.values()) == {0o666 & ~mask}, modes  # every file alike, the tokenizer's included


# ---- the report ------------------------------------------------------------------------------------

def test_the_report_says_which_figure_is_greedy_and_which_sampled(tmp_path):
    from cohort_grpo.telemetry.metrics import MetricsLogger
    from cohort_grpo.telemetry.report import build_report

    with MetricsLogger(tmp_path / "run") as logger:
        for step in (1, 2):
            logger.log(step, {"reward": 0.42})
    (tmp_path / "run" / "summary.json").write_text(json.dumps({"accuracy_before": 0.5, "accuracy_after": 0.85}))
    page = build_report([tmp_path / "run"]).read_text()
    header = re.search(r"<thead><tr>(.*?)</tr></thead>", page).group(1)
    cells = re.findall(r"<th>(.*?)</th>", header)
    assert [c for c in cells if "accuracy" in c] == ["held-out accuracy before (greedy)",
                                                     "held-out accuracy after (greedy)"]
    assert [c for c in cells if "reward" in c] == ["reward, sampled (first logged step)",
                                                   "reward, sampled (last logged step)"]
    assert "sampled at the run&#x27;s temperature" in page and "greedy (temperature 0)" in page
