"""Errors read in the words of the front end that raised them: from Python, `GRPOConfig`'s keywords
(`resume=True`); from `cohort-grpo train`, its flags (`--resume`). A script's default output_dir is named after
the script; the command keeps its own."""

import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.cli.main import main
from cohort_grpo.config.command_line import resolve_config
from cohort_grpo.errors import CohortError, command_line
from cohort_grpo.config.output_dir import script_output_dir
from cohort_grpo.config.spelling import python_spelling
from cohort_grpo.run.lifecycle import TrainingInterrupted


def cli_error(capsys, *argv) -> str:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cohort: error: ") and "\n" not in err, err
    return err


# ---- one bad input, two front ends ----------------------------------------------------------------

def test_a_contradiction_names_keywords_from_python_and_flags_from_the_command_line(capsys):
    with pytest.raises(CohortError) as caught:
        GRPOConfig(async_rollouts=True, max_staleness=0).validate()
    assert str(caught.value).endswith("give max_staleness=1 or more, or leave async_rollouts off")
    assert "--" not in str(caught.value)

    err = cli_error(capsys, "--async_rollouts", "--max_staleness", "0")
    assert err.endswith("give --max_staleness 1 or more, or leave --async_rollouts off")


def test_an_earlier_run_in_output_dir_names_resume_as_each_front_end_writes_it(tiny_dir, tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)
    args = GRPOConfig(output_dir=str(out), num_generations=2, per_device_train_batch_size=2,
                      gradient_accumulation_steps=1, max_completion_length=2, quiet=True)
    with pytest.raises(CohortError) as caught:  # refused when train() starts: train(resume_from_checkpoint=True) may
        GRPOTrainer(tiny_dir, lambda completions, **_: [0.0] * len(completions), [{"prompt": "1+1="}] * 2,
                    args=args).train()  # still continue it
    assert str(caught.value).endswith("pass resume=True to continue it, overwrite_output_dir=True to start over "
                                      "(deleting its checkpoints), or choose another output_dir")

    err = cli_error(capsys, "--output_dir", str(out))
    assert err.endswith("pass --resume to continue it, --overwrite_output_dir to start over (deleting its "
                        "checkpoints), or choose another --output_dir")
    # The command is over: the same error shown from Python again reads as Python.
    assert "resume=True" in str(CohortError("pass --resume"))


def test_a_debug_traceback_keeps_the_flags(tmp_path):
    with pytest.raises(CohortError) as caught:
        main(["train", "--async_rollouts", "--max_staleness", "0", "--debug"])
    assert "give --max_staleness 1 or more" in str(caught.value)


def test_within_command_line_the_message_is_left_as_written():
    error = CohortError("pass --resume or --max_staleness 2")
    with command_line():
        assert str(error) == "pass --resume or --max_staleness 2"
    assert str(error) == "pass resume=True or max_staleness=2"


# ---- the rewrite itself ----------------------------------------------------------------------------

@pytest.mark.parametrize("message, python", [
    ("continue the run with --resume", "continue the run with resume=True"),
    ("pass --resume=false", "pass resume=False"),
    ("(--resume) with more memory", "(resume=True) with more memory"),
    ("set --rm_updates_per_step 0 --rm_warmup_batches 0 or run one process",
     "set rm_updates_per_step=0, rm_warmup_batches=0 or run one process"),
    ("lower --learning_rate, or check", "lower learning_rate, or check"),
    ("the learning rate, e.g. --learning_rate 1e-5.", "the learning rate, e.g. learning_rate=1e-5."),
    ("pass --offload_ref_model false to keep it", "pass offload_ref_model=False to keep it"),
    ("use --device cpu", "use device='cpu'"),
    ("use --scale_rewards none (Dr. GRPO)", "use scale_rewards='none' (Dr. GRPO)"),
    ("or chat without it: --tools none", "or chat without it: tools=None"),
    ("pass --tools module:function or --environment module:Class",
     "pass tools=['module:function'] or environment='module:Class'"),
    ("pass --data_files FILE or --task NAME", "pass data_files=FILE or task=NAME"),
    ("e.g. --curriculum arithmetic:50,gsm8k:200",
     "e.g. curriculum=[{'task': 'arithmetic', 'steps': 50}, {'task': 'gsm8k', 'steps': 200}]"),
    # prose after a name is no value of it
    ("resume with the --model it was trained from", "resume with the model it was trained from"),
    ("--ddp_timeout bounds the wait", "ddp_timeout bounds the wait"),
    ("pass --temperature > 0", "pass temperature > 0"),
    ("leave --async_rollouts off", "leave async_rollouts off"),
    ("--lora_r / --lora_target_modules", "lora_r / lora_target_modules"),
])
def test_known_options_become_keywords(message, python):
    assert python_spelling(message) == python


@pytest.mark.parametrize("message", [
    "resume with --nproc_per_node 2",               # the launcher's flag, no GRPOConfig option
    "see `cohort-grpo train --help`; --config run.yaml",
    "unexpected argument '--resume'; options look like --name value",  # a quoted argument as typed
    "--max-steps 3 and a--resume and ---resume",
    "no option named here at all",
])
def test_other_text_is_left_alone(message):
    assert python_spelling(message) == message


@pytest.mark.parametrize("module", ["cohort_grpo.errors", "cohort_grpo.kernels", "cohort_grpo.optim.precision"])
def test_a_message_reads_as_python_in_an_interpreter_that_imported_one_module_alone(module):
    """What a caller imported first, or which test ran before, does not change a message: a fresh interpreter
    that imports one module (the errors themselves, a room below the config, one above it) and nothing else
    of cohort's shows a message in keywords."""
    code = (f"import {module}\nfrom cohort_grpo.errors import CohortError\n"
            "print(CohortError('pass --resume to continue it, or give --max_staleness 1 or more'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "pass resume=True to continue it, or give max_staleness=1 or more"


# ---- the default output_dir ------------------------------------------------------------------------

@pytest.mark.parametrize("main_file, folder", [
    ("/home/me/project/train_gsm8k.py", "runs/train_gsm8k"),
    ("/home/me/project/mypackage/__main__.py", "runs/mypackage"),  # python -m mypackage
    (None, "runs/cohort"),  # python -c, an interactive session, a notebook
])
def test_a_scripts_default_output_dir_is_named_after_it(monkeypatch, main_file, folder):
    module = types.ModuleType("__main__")
    if main_file is not None:
        module.__file__ = main_file
    monkeypatch.setitem(sys.modules, "__main__", module)
    assert script_output_dir() == folder
    assert GRPOConfig().output_dir == folder
    assert GRPOConfig(output_dir="elsewhere").output_dir == "elsewhere"


def test_two_scripts_in_one_folder_write_to_two_runs(tmp_path):
    folders = []
    for name in ("first_port.py", "second_port.py"):
        script = tmp_path / name
        script.write_text("from cohort_grpo import GRPOConfig\nprint(GRPOConfig().output_dir)\n")
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        folders.append(done.stdout.strip())
    assert folders == ["runs/first_port", "runs/second_port"]


def test_the_command_keeps_its_own_default(monkeypatch, tmp_path):
    module = types.ModuleType("__main__")
    module.__file__ = "/usr/local/bin/some_wrapper"
    monkeypatch.setitem(sys.modules, "__main__", module)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1="}\n')
    config, sources = resolve_config(["--data_files", str(rows)])
    assert (config.output_dir, sources["output_dir"]) == ("runs/cohort", "default")
    config, sources = resolve_config([])
    assert (config.output_dir, sources["output_dir"]) == ("runs/arithmetic", "task:arithmetic")


def test_a_stopped_run_says_how_to_continue_it_in_the_front_ends_words(tmp_path):
    stop = TrainingInterrupted(signal.SIGTERM, tmp_path / "checkpoint-3", 3)
    assert str(stop).endswith(f"after step 3; checkpoint saved in {tmp_path / 'checkpoint-3'} — continue the run "
                              "with resume=True")
    with command_line():
        assert str(stop).endswith("continue the run with --resume")
