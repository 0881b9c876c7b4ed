"""Bad input on the command line: one clear line naming the problem, exit code 2, no traceback."""

import subprocess
import sys

import pytest

from cohort_grpo.cli import main
from cohort_grpo.config.grpo_config import GRPOConfig
from cohort_grpo.config.command_line import parse_config
from cohort_grpo.errors import CohortError


def _run_cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["train", "--task", "nope"], "unknown task 'nope'"),
        (["train", "--num_generations", "1"], "num_generations=1"),
        (["train", "--num_generations", "3", "--per_device_train_batch_size", "8",
          "--gradient_accumulation_steps", "1"], "not divisible by num_generations=3"),
        (["train", "--model", "/no/such/model_dir"], "/no/such/model_dir"),
        (["train", "--loss_type", "ppo2"], "loss_type='ppo2' is not one of its values"),
        (["train", "--epsilon_high", "0.1"], "epsilon_high=0.1 is below epsilon=0.2"),
        (["train", "--beta", "-1"], "beta=-1.0 is negative"),
        (["train", "--learnig_rate", "1e-5"], "did you mean learning_rate"),
        (["train", "--max_steps", "ten"], "--max_steps expects int"),
        (["frobnicate"], "unknown command 'frobnicate'"),
    ],
)
def test_bad_input_is_one_clear_line(capsys, argv, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the checkout, where a finished `cohort-grpo train` may have left runs/
    code, err = _run_cli(capsys, *argv)
    assert code == 2
    assert expected in err
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err


def test_missing_column_a_reward_needs(tmp_path):
    from cohort_grpo import GRPOTrainer
    from cohort_grpo.models.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(tokenizer)

    def needs_solution(prompts, completions, completion_ids=None, *, solution, **_):
        return [0.0] * len(completions)

    with pytest.raises(CohortError, match="solution"):
        GRPOTrainer(model, needs_solution, [{"prompt": "1+1"}], processing_class=tokenizer,
                    args=GRPOConfig(output_dir=str(tmp_path), quiet=True, per_device_train_batch_size=8,
                                    gradient_accumulation_steps=1))


def test_yaml_unknown_key_is_named(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("learning_rate: 1e-5\nnum_generatons: 4\n")
    with pytest.raises(CohortError, match="num_generatons.*did you mean num_generations"):
        parse_config(["--config", str(cfg)])


def test_cli_flags_override_yaml_and_accept_dashes(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("learning_rate: 1.0e-5\nnum_generations: 4\n")
    args = parse_config(["--config", str(cfg), "--num-generations", "8", "--beta=0.02", "--quiet"])
    assert (args.learning_rate, args.num_generations, args.beta, args.quiet) == (1e-5, 8, 0.02, True)


def test_no_traceback_from_a_real_process():
    out = subprocess.run([sys.executable, "-m", "cohort_grpo", "train", "--task", "nope"], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip() == "cohort: error: unknown task 'nope'; choose one of arithmetic, calculator, gsm8k, generic, shapes, reasoning_gym:NAME or verifiers:NAME (--task)"
