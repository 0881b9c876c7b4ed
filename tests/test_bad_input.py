"""Bad input, one clear line each (issue 8; the catalogue is docs/reliability.md).

Every case goes through the command line (`cohort_grpo.cli.main`) and must end with exit code 2, exactly one
`cohort: error:` line on stderr naming the input and the fix, and no traceback. Cases the command line
cannot reach (rows handed to the Python API) check the `CohortError` message instead."""

import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.run import checkpoint as ckpt
from cohort_grpo.cli import main
from cohort_grpo.errors import CohortError
from cohort_grpo.models.tiny import build_model, build_tokenizer

SPEC = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=64)
OTHER_SPEC = {**SPEC, "hidden_size": 48}


def save_model(path: Path, spec=SPEC, tokenizer=None) -> Path:
    tokenizer = tokenizer or build_tokenizer()
    build_model(build_tokenizer(), seed=0, spec=spec).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-input")
    save_model(root / "model")
    save_model(root / "other-model", spec=OTHER_SPEC)
    return root


def small_run(files: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(files / "model"), "--num_generations", "4", "--per_device_train_batch_size", "8",
            "--gradient_accumulation_steps", "1", "--max_completion_length", "4", "--max_prompt_length", "64",
            "--max_steps", "2", "--save_steps", "1", "--eval_limit", "2", "--learning_rate", "1e-3", "--quiet",
            "--device", "cpu", "--output_dir", str(out), *extra]


def one_error_line(capsys, argv, *expected: str) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("cohort: error:")]
    assert code == 2, err
    assert len(errors) == 1, err
    assert "Traceback" not in err
    for words in expected:
        assert words in errors[0], errors[0]
    return errors[0]


# ---- contradictory or unknown options: caught before anything is loaded ----------------------------

@pytest.mark.parametrize("argv, expected", [
    (["--task", "nope"], ["unknown task 'nope'", "--task"]),
    (["--loss_type", "ppo2"], ["loss_type='ppo2' is not one of its values", "pass grpo, bnpo, dapo or dr_grpo"]),
    (["--num_generations", "3", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1"],
     ["8 completions is not divisible by num_generations=3", "make it a multiple"]),
    (["--epsilon", "0.2", "--epsilon_high", "0.1"], ["epsilon_high=0.1 is below epsilon=0.2"]),
    (["--beta", "-0.5"], ["beta=-0.5 is negative", "must be ≥ 0"]),
    (["--learnig_rate", "1e-5"], ["unknown option 'learnig_rate' in the command line", "did you mean learning_rate?"]),
    (["--max_steps", "ten"], ["--max_steps expects int, got 'ten'"]),
    (["--resume", "--overwrite_output_dir"], ["overwrite_output_dir and resume contradict each other"]),
    (["--save_total_limit", "-1"], ["save_total_limit=-1 must be ≥ 0"]),
])
def test_contradictory_or_unknown_option(capsys, argv, expected):
    one_error_line(capsys, ["train", *argv], *expected)


def test_unknown_command(capsys):
    code = main(["frobnicate"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == "cohort: unknown command 'frobnicate'; choose one of train, eval, sft, report, chat, generate"


def test_yaml_with_unknown_key_names_it_and_the_nearest(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 1.0e-5\nnum_generatons: 4\n")
    one_error_line(capsys, ["train", "--config", config],
                   "unknown option 'num_generatons' in the YAML config", "did you mean num_generations?")


def test_yaml_that_is_not_yaml_names_the_line(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 1e-5\nbeta: [0.1\n")
    one_error_line(capsys, ["train", "--config", config], f"config file {config} is not valid YAML at line")


# ---- data files -----------------------------------------------------------------------------------

def test_missing_data_file(files, tmp_path, capsys):
    one_error_line(capsys, small_run(files, tmp_path / "out", "--task", "gsm8k", "--data_files", tmp_path / "nope.jsonl"),
                   f"data file '{tmp_path / 'nope.jsonl'}' not found", "--data_files")


def test_empty_data_file(files, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("\n")
    one_error_line(capsys, small_run(files, tmp_path / "out", "--task", "gsm8k", "--data_files", tmp_path / "empty.jsonl"),
                   "has no rows")


def test_malformed_jsonl_line_is_named(files, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?", "answer": "#### 4"}\n{"question": oops}\n')
    one_error_line(capsys, small_run(files, tmp_path / "out", "--task", "gsm8k", "--data_files", data),
                   f"{data}:3: not valid JSON", "one JSON object")


def test_data_file_with_an_unknown_extension(files, tmp_path, capsys):
    (tmp_path / "train.txt").write_text("question,answer\n")
    one_error_line(capsys, small_run(files, tmp_path / "out", "--task", "gsm8k", "--data_files", tmp_path / "train.txt"),
                   "has extension '.txt'", ".jsonl")


def test_missing_column(files, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "1+1?", "answer": "#### 2"}\n')
    one_error_line(capsys, small_run(files, tmp_path / "out", "--task", "gsm8k", "--data_files", data),
                   "row 0 has no ['question'] column", "'problem'")


def test_rows_without_a_prompt_column(files, tmp_path):
    with pytest.raises(CohortError, match=r"^train_dataset has no 'prompt' column \(columns: \['text'\]\); rename"):
        GRPOTrainer(str(files / "model"), "format", [{"text": "1+1"}], args=GRPOConfig(
            output_dir=str(tmp_path), num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=1))


@pytest.mark.parametrize("prompt, shown", [(42, "is a int (42)"), ([{"role": "user"}], "is a list"),
                                           ({"text": "hi"}, "is a dict")])
def test_prompt_of_the_wrong_type(files, tmp_path, prompt, shown):
    rows = [{"prompt": "1+1"}, {"prompt": prompt}]
    with pytest.raises(CohortError, match=r"train_dataset row 1: 'prompt' " + shown.replace("(", r"\(").replace(")", r"\)")) as error:
        GRPOTrainer(str(files / "model"), "format", rows, args=GRPOConfig(
            output_dir=str(tmp_path), num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=1))
    assert "\n" not in str(error.value) and "a string or a list of" in str(error.value)


def test_prompt_longer_than_max_prompt_length(files, tmp_path, capsys):
    argv = small_run(files, tmp_path / "out") + ["--max_prompt_length", "4"]
    one_error_line(capsys, argv, "more than max_prompt_length=4", "raise --max_prompt_length")


# ---- rewards --------------------------------------------------------------------------------------

def test_unknown_reward(files, tmp_path, capsys):
    one_error_line(capsys, small_run(files, tmp_path / "out", "--reward_funcs", "nosuch"),
                   "unknown reward 'nosuch'", "module:function")


def test_reward_module_that_does_not_exist(files, tmp_path, capsys):
    one_error_line(capsys, small_run(files, tmp_path / "out", "--reward_funcs", "no_such_module_xyz:score"),
                   "cannot import module 'no_such_module_xyz'", "PYTHONPATH")


# ---- models ---------------------------------------------------------------------------------------

def test_model_path_that_is_not_a_model(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hello")
    one_error_line(capsys, ["train", "--model", tmp_path / "notes", "--output_dir", tmp_path / "out"],
                   "is not a model folder", "config.json")


def test_model_that_does_not_exist(tmp_path, capsys):
    one_error_line(capsys, ["train", "--model", tmp_path / "nowhere", "--output_dir", tmp_path / "out"],
                   f"model folder '{tmp_path / 'nowhere'}' does not exist ({tmp_path}/ has",
                   "pass an existing folder or a hub id")


def test_tokenizer_without_eos(files, tmp_path, capsys):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer().backend_tokenizer, pad_token="<pad>",
                                        unk_token="<unk>")
    model = save_model(tmp_path / "no-eos", tokenizer=tokenizer)
    argv = small_run(files, tmp_path / "out")
    argv[argv.index("--model") + 1] = str(model)
    one_error_line(capsys, argv, "the tokenizer has no EOS token", "eos_token")


def test_corrupt_safetensors(files, tmp_path, capsys):
    model = tmp_path / "corrupt"
    shutil.copytree(files / "model", model)
    (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    argv = small_run(files, tmp_path / "out")
    argv[argv.index("--model") + 1] = str(model)
    one_error_line(capsys, argv, f"corrupt or unreadable safetensors file {model / 'model.safetensors'}",
                   "re-download or re-save it")


def test_pickle_weights_are_never_loaded(files, tmp_path, capsys):
    model = tmp_path / "pickled"
    shutil.copytree(files / "model", model)
    (model / "model.safetensors").rename(model / "pytorch_model.bin")
    argv = small_run(files, tmp_path / "out")
    argv[argv.index("--model") + 1] = str(model)
    one_error_line(capsys, argv, "has no *.safetensors weights", "cohort never loads pickle files")


def test_custom_model_code_runs_only_with_trust_remote_code(files, tmp_path, capsys):
    model, ran = tmp_path / "custom", tmp_path / "custom-code-ran"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(files / "model" / name, model / name)
    (model / "config.json").write_text(json.dumps({"model_type": "custom_net", "auto_map": {
        "AutoConfig": "modeling_custom.CustomConfig", "AutoModelForCausalLM": "modeling_custom.CustomModel"}}))
    (model / "modeling_custom.py").write_text(f"open({str(ran)!r}, 'w').write('ran')\n")
    argv = small_run(files, tmp_path / "out")
    argv[argv.index("--model") + 1] = str(model)
    one_error_line(capsys, argv, "needs its own Python code to load", "--trust_remote_code")
    assert not ran.exists()


# ---- output folder, checkpoints, resume ----------------------------------------------------------

def test_an_output_folder_inside_a_file(files, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    one_error_line(capsys, small_run(files, tmp_path / "a-file" / "run"),
                   f"output_dir '{tmp_path / 'a-file' / 'run'}' is inside '{tmp_path / 'a-file'}', which is a file",
                   "--output_dir")


@pytest.fixture(scope="module")
def finished_run(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(small_run(files, out)) == 0
    return out


def test_an_unfinished_run_is_not_overwritten_by_accident(files, finished_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    shutil.rmtree(out / "checkpoint-2")  # the run as a stop after step 1 leaves it
    one_error_line(capsys, small_run(files, out), "holds an unfinished run (newest: checkpoint-1)",
                   "--resume to continue it", "--overwrite_output_dir to start over")


def test_resume_from_a_checkpoint_of_another_model(files, finished_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    argv = small_run(files, out, "--resume")
    argv[argv.index("--model") + 1] = str(files / "other-model")
    one_error_line(capsys, argv, "checkpoint-2 was saved from another model", "shape [", "--model it was trained from")


def test_resume_from_a_folder_that_is_not_a_checkpoint(files, finished_run, tmp_path, capsys):
    one_error_line(capsys, small_run(files, tmp_path / "run", "--resume_from_checkpoint", tmp_path / "nothing"),
                   f"cannot resume from {tmp_path / 'nothing'}: it is missing")
    incomplete = tmp_path / "checkpoint-9"
    shutil.copytree(finished_run / "checkpoint-2", incomplete)
    (incomplete / "complete.json").unlink()
    one_error_line(capsys, small_run(files, tmp_path / "run", "--resume_from_checkpoint", incomplete),
                   "it is incomplete (no complete.json: its write was interrupted)")


def test_disk_full_while_saving_keeps_the_previous_checkpoint(files, tmp_path, capsys, monkeypatch):
    save_optimizer = ckpt._save_optimizer

    def disk_full_at_step_2(parts, path, *gathered):
        if path.parent.name.startswith(".tmp-checkpoint-2-"):  # the write of checkpoint-2
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        save_optimizer(parts, path, *gathered)

    monkeypatch.setattr(ckpt, "_save_optimizer", disk_full_at_step_2)
    out = tmp_path / "run"
    one_error_line(capsys, small_run(files, out), f"disk full while saving checkpoint-2 in {out}", "free space",
                   "--resume", "the previous checkpoint checkpoint-1 is intact")
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["checkpoint-1"]
    assert ckpt.check_checkpoint(out / "checkpoint-1") is None
    assert not list(out.glob(".tmp-*"))


@pytest.fixture
def small_filesystem(tmp_path):
    """A 300 KiB tmpfs: room for the weights of the suite's model's checkpoint, not for its optimizer.pt (its
    checkpoint has 448 KiB), so that torch.save's write really fails with ENOSPC; skipped
    where this process may not mount one (it needs root)."""
    folder = tmp_path / "small-disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()})")
    yield folder
    subprocess.run(["umount", "--lazy", str(folder)], check=True)  # the failed run's logs may still be open


def test_a_real_disk_full_while_saving_is_the_disk_full_line(files, small_filesystem, capsys):
    """torch.save's own error on a full disk (its zip writer's "unexpected pos", no OSError) reads as disk full."""
    out = small_filesystem / "run"
    one_error_line(capsys, small_run(files, out), f"disk full while saving checkpoint-1 in {out}", "free space",
                   "--resume", "no earlier checkpoint exists")
    assert not list(out.glob(".tmp-*")) and not ckpt.list_checkpoints(out)


@pytest.mark.slow
def test_no_traceback_from_a_real_process(files, tmp_path):
    """The same contract in a real process: stderr is the single line, exit code 2."""
    argv = small_run(files, tmp_path / "out", "--reward_funcs", "nosuch")
    done = subprocess.run([sys.executable, "-m", "cohort_grpo", *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "cohort: error: unknown reward 'nosuch'; use one of ['accuracy', 'format', 'lenient_format', 'reasoning_steps', "
        "'tag_count', 'think_format_reward'] or 'module:function' (--reward_funcs)"]


class NotPlainData:
    """Anything but tensors and plain containers: torch.load(weights_only=True) must refuse to build it."""


def test_checkpoint_state_with_pickled_objects_is_refused(files, finished_run, tmp_path, capsys):
    import torch

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    folder = out / "checkpoint-2"
    torch.save({"optimizer": NotPlainData()}, folder / "optimizer.pt")
    (folder / "complete.json").unlink()
    ckpt._write_manifest(folder, 2)  # a consistent manifest: only weights_only stands in the way
    one_error_line(capsys, small_run(files, out, "--resume"),
                   f"cannot load {folder / 'optimizer.pt'} with torch.load(weights_only=True)",
                   "holds more than tensors and plain data")
