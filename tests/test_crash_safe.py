"""Never lose a run: an exception out of the training loop after a completed step keeps that step in a
checkpoint (the state at its end, exactly) and says where in its one line; `--resume` continues it as if
nothing had failed. A failure after the weights changed writes nothing and names the newest checkpoint."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.errors import CohortError
from cohort_grpo.models.tiny import build_model, build_tokenizer
from cohort_grpo.run.checkpoint import MARKER, TRAINER_STATE, check_checkpoint, list_checkpoints
from cohort_grpo.run.failure import TrainingFailed
from helpers import UPDATE_PROMPTS

SPEC = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=64)
REWARD_MODULE = '''
import os
import random

calls = 0

def digit_share(prompts, completions, completion_ids=None, **_):
    """Share of digits plus noise from python's global generator; from call CRASH_FROM_CALL on it raises (on rank
    CRASH_ON_RANK alone when that is set), after drawing its noise (the failing step moved that generator too)."""
    global calls
    calls += 1
    noise = [1e-2 * random.random() for _ in completions]
    on_this_rank = os.environ.get("RANK", "0") == os.environ.get("CRASH_ON_RANK", os.environ.get("RANK", "0"))
    if on_this_rank and calls >= int(os.environ.get("CRASH_FROM_CALL") or 10**9):
        raise ValueError("the reward service is down")
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) + n for c, n in zip(completions, noise)]
'''


def noisy_reward(completions, **_):
    """A reward that moves python's global generator, so that a checkpoint must restore it."""
    return [len(c) / 10 + 1e-2 * random.random() for c in completions]


class RaisesAt:
    """A callback raising `error` at `event` of step `step` (user code outside the reward functions)."""

    def __init__(self, event: str, step: int, error: Exception):
        self.event, self.step, self.error = event, step, error
        self.running = 0  # the step running now

    def __getattr__(self, name):
        if not name.startswith("on_"):
            raise AttributeError(name)

        def handler(args, state, control, **_):
            if name == "on_step_begin":
                self.running = state.global_step + 1
            if name == self.event and self.running == self.step:
                raise self.error
        return handler


def config(out: Path, **overrides) -> GRPOConfig:
    base = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=4, max_steps=4, seed=3,
                learning_rate=1e-3, beta=0.04, output_dir=str(out), quiet=True, save_steps=0)
    return GRPOConfig(**{**base, **overrides})


WALL_CLOCK = ("time", "step_time")


def without_wall_clock(record: dict) -> dict:
    return {k: v for k, v in record.items()
            if k not in WALL_CLOCK and not k.startswith(("time/", "tokens_per_second", "peak_memory"))}


def trainer_state(folder: Path) -> dict:
    """The checkpoint's trainer_state.json less what the clock decides (times; the logs' sizes, which hold times)."""
    state = json.loads((folder / TRAINER_STATE).read_text())
    for key in ("seconds", "config", "file_sizes"):
        state.pop(key)
    state["history"] = [without_wall_clock(record) for record in state["history"]]
    return state


def same_files(a: Path, b: Path, names: list[str]) -> bool:
    manifests = [json.loads((folder / MARKER).read_text())["files"] for folder in (a, b)]
    return all(manifests[0][name]["sha256"] == manifests[1][name]["sha256"] for name in names)


# ---- the Python API --------------------------------------------------------------------------------

def test_a_failure_in_step_3_saves_the_state_at_the_end_of_step_2_exactly(tiny_dir, tmp_path):
    """The failure checkpoint equals the one a save at step 2 writes: RNG states, data position, logs, weights,
    optimizer — although step 3 had sampled (moving the generators and the data stream) before it failed."""
    reference = GRPOTrainer(tiny_dir, noisy_reward, UPDATE_PROMPTS, args=config(tmp_path / "saved", save_steps=2,
                                                                                max_steps=2))
    reference.train()
    failing = RuntimeError("the tool server went away")
    trainer = GRPOTrainer(tiny_dir, noisy_reward, UPDATE_PROMPTS, args=config(tmp_path / "failed"))
    score = trainer.score

    def score_then_fail(batch):  # step 3 samples and scores (moving the generators and the stream), then fails
        score(batch)
        if trainer.step == 3:
            raise failing
    trainer.score = score_then_fail
    with pytest.raises(RuntimeError) as raised:  # a caller's own `except RuntimeError:` still catches it
        trainer.train()
    saved = tmp_path / "failed" / "checkpoint-2"
    assert raised.value is failing and raised.value.checkpoint == saved
    assert "checkpoint-2 saved in" in raised.value.__notes__[0] and "resume=True" in raised.value.__notes__[0]
    assert [p.name for p in list_checkpoints(tmp_path / "failed")] == ["checkpoint-2"]
    assert check_checkpoint(saved) is None
    expected = tmp_path / "saved" / "checkpoint-2"
    state, wanted = trainer_state(saved), trainer_state(expected)
    assert state["python_random"] == wanted["python_random"] and state["torch_random"] == wanted["torch_random"]
    assert state["data_order"] == wanted["data_order"] and state["data_rng"] == wanted["data_rng"]
    assert state == wanted
    assert same_files(saved, expected, ["model.safetensors", "optimizer.pt", "reference.safetensors"])
    sizes = json.loads((saved / TRAINER_STATE).read_text())["file_sizes"]
    for name in ("metrics.jsonl", "completions.jsonl"):  # the logs end where step 2 ended
        assert sizes[name] == (tmp_path / "failed" / name).stat().st_size
        assert records(tmp_path / "failed" / name) == records(tmp_path / "saved" / name)


def test_with_asynchronous_rollouts_a_failure_in_step_3_keeps_step_2_and_resume_gives_the_uninterrupted_run(
        tiny_dir, tmp_path):
    """The rollouts sampled ahead at step 2's end (step 3's, in hand when it failed, and step 4's, still sampling)
    go into the failure checkpoint as a save at step 2 would have kept them."""
    ahead = dict(async_rollouts=True, max_staleness=1, max_steps=5, logging_steps=1)
    GRPOTrainer(tiny_dir, noisy_reward, UPDATE_PROMPTS, args=config(tmp_path / "whole", **ahead)).train()
    calls = []

    def fails_in_step_3(completions, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("the reward service is down")
        return noisy_reward(completions, **kwargs)

    fails_in_step_3.__name__ = "noisy_reward"  # the metrics' names are the function's
    with pytest.raises(TrainingFailed) as raised:
        GRPOTrainer(tiny_dir, fails_in_step_3, UPDATE_PROMPTS, args=config(tmp_path / "run", **ahead)).train()
    assert raised.value.checkpoint == tmp_path / "run" / "checkpoint-2" and "checkpoint-2 saved" in str(raised.value)
    GRPOTrainer(tiny_dir, noisy_reward, UPDATE_PROMPTS, args=config(tmp_path / "run", resume=True, **ahead)).train()
    assert records(tmp_path / "run" / "metrics.jsonl") == records(tmp_path / "whole" / "metrics.jsonl")
    final = load_file(tmp_path / "whole" / "model.safetensors")
    assert all(torch.equal(final[k], v) for k, v in load_file(tmp_path / "run" / "model.safetensors").items())


def test_a_reward_function_that_raises_is_a_cohort_error_naming_the_checkpoint(tiny_dir, tmp_path):
    calls = []

    def breaks_in_step_2(completions, **_):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("bad row")
        return [1.0] * len(completions)

    trainer = GRPOTrainer(tiny_dir, breaks_in_step_2, UPDATE_PROMPTS, args=config(tmp_path))
    with pytest.raises(TrainingFailed) as raised:
        trainer.train()
    message = str(raised.value)
    assert isinstance(raised.value, CohortError) and "\n" not in message
    assert message.startswith("reward 'breaks_in_step_2' raised ValueError: bad row")
    assert message.endswith(f"checkpoint-1 saved in {tmp_path} — continue the run with resume=True")
    assert raised.value.checkpoint == tmp_path / "checkpoint-1" and raised.value.step == 2
    assert check_checkpoint(tmp_path / "checkpoint-1") is None


def test_a_checkpoint_the_run_saved_already_is_not_written_again(tiny_dir, tmp_path):
    saves = []
    trainer = GRPOTrainer(tiny_dir, noisy_reward, UPDATE_PROMPTS, args=config(tmp_path, save_steps=2),
                          callbacks=[RaisesAt("on_step_begin", 3, KeyError("x"))])
    trainer.add_callback(type("Saves", (), {"on_save": lambda self, *a, **k: saves.append(trainer.step)})())
    with pytest.raises(KeyError) as raised:
        trainer.train()
    assert saves == [2] and raised.value.checkpoint == tmp_path / "checkpoint-2"


def test_a_failure_after_the_weights_changed_writes_nothing_and_names_the_newest_checkpoint(tiny_dir, tmp_path):
    """on_log runs after step 3's update: a checkpoint-2 of those weights would be wrong."""
    trainer = GRPOTrainer(tiny_dir, noisy_reward, UPDATE_PROMPTS, args=config(tmp_path, save_steps=1, logging_steps=1),
                          callbacks=[RaisesAt("on_log", 3, CohortError("a callback refused"))])
    with pytest.raises(TrainingFailed) as raised:
        trainer.train()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2"]
    assert str(raised.value) == ("a callback refused; no checkpoint of step 2 could be written: the failure came "
                                 f"after step 3 changed the weights; the newest checkpoint is checkpoint-2 in "
                                 f"{tmp_path} — continue the run with resume=True")
    assert raised.value.checkpoint == tmp_path / "checkpoint-2"


def test_a_failure_in_the_first_step_after_a_resume_names_the_checkpoint_it_resumed_from(tiny_dir, tmp_path):
    GRPOTrainer(tiny_dir, noisy_reward, UPDATE_PROMPTS, args=config(tmp_path, save_steps=2, max_steps=2)).train()
    trainer = GRPOTrainer(tiny_dir, noisy_reward, UPDATE_PROMPTS, args=config(tmp_path, max_steps=4, resume=True),
                          callbacks=[RaisesAt("on_step_begin", 3, KeyError("x"))])
    with pytest.raises(KeyError) as raised:
        trainer.train()
    assert raised.value.checkpoint == tmp_path / "checkpoint-2"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2"]


def test_a_failure_before_any_step_completed_is_raised_as_it_was(tiny_dir, tmp_path):
    failing = RuntimeError("step 1")
    trainer = GRPOTrainer(tiny_dir, noisy_reward, UPDATE_PROMPTS, args=config(tmp_path / "run"),
                          callbacks=[RaisesAt("on_step_begin", 1, failing)])
    with pytest.raises(RuntimeError) as raised:
        trainer.train()
    assert not hasattr(raised.value, "checkpoint") and not (tmp_path / "run").exists()


def test_the_command_line_prints_another_exception_as_one_line_naming_the_checkpoint(tmp_path):
    from cohort_grpo.run.failure import failure_line, with_hint

    try:
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors ...")
    except RuntimeError as error:
        kept = with_hint(error, f"checkpoint-2 saved in {tmp_path} — continue the run with --resume",
                         tmp_path / "checkpoint-2", 3)
    assert isinstance(kept, RuntimeError) and kept.checkpoint == tmp_path / "checkpoint-2" and kept.failed_step == 3
    line = failure_line(kept)
    assert "\n" not in line
    assert line.startswith("step 3 failed: RuntimeError: CUDA error: an illegal memory access was encountered (at "
                           "test_crash_safe.py:")
    assert line.endswith(f"checkpoint-2 saved in {tmp_path} — continue the run with --resume; --debug shows the traceback")
    assert failure_line(ValueError("no run kept")) is None


def test_noting_a_step_s_end_costs_the_same_at_any_length_of_the_history(tiny_dir, tmp_path):
    """Every step notes its end (`GRPOTrainer.step_end`); a copy of the per-step history there would be work growing
    with the steps (a long run's steps slowing). The note shares the history and keeps its length: the bytes it
    allocates are the same beside 10 records as beside 100,000, and a checkpoint of it holds the records it had."""
    import tracemalloc

    measured = {}

    class MeasureTheNote:  # in the run, at its step's end, as the loop notes it
        def on_step_end(self, args, state, control, **_):
            history = trainer.report.history
            measured["short"], _ = allocated_by_a_note(history, 10)
            measured["long"], measured["noted"] = allocated_by_a_note(history, 100_000)
            history.append({"step": 100_001, "loss": 1.0})  # the run goes on after the note
            measured["kept"], measured["history"] = measured["noted"].state.records(), list(history)
            del history[1:]

    def allocated_by_a_note(history: list, records: int) -> tuple[int, object]:
        history[1:] = [{"step": i + 2, "loss": 0.0} for i in range(records - 1)]
        trainer.step_end()  # once before: lazily made objects are not the note's
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            noted = trainer.step_end()
            return tracemalloc.get_traced_memory()[0] - before, noted
        finally:
            tracemalloc.stop()

    trainer = GRPOTrainer(tiny_dir, noisy_reward, UPDATE_PROMPTS, args=config(tmp_path / "run", max_steps=1),
                          callbacks=[MeasureTheNote()])
    trainer.train()
    assert abs(measured["long"] - measured["short"]) < 16 * 1024, measured  # a copy of the list alone: 800 KB
    assert measured["kept"] == measured["history"][:100_000] and len(measured["history"]) == 100_001


def test_one_rank_failing_alone_among_several_writes_nothing(tmp_path):
    """The save is a collective the other ranks would not join: the error is left as it is."""
    from cohort_grpo.run.checkpoint import RunState
    from cohort_grpo.run.failure import StepEnd, keep_failed_run

    end = StepEnd(RunState(step=2, prompts={}, history=[]), [], optimizer_steps=2)
    saves = []
    kept = keep_failed_run(RuntimeError("one rank"), last=end, now=lambda: end, out=tmp_path, world_size=2,
                           save_once=lambda step, at: saves.append(step))
    assert kept is None and saves == []
    alike = RuntimeError("every rank")
    alike.every_rank = True
    kept = keep_failed_run(alike, last=end, now=lambda: end, out=tmp_path, world_size=2,
                           save_once=lambda step, at: saves.append(step) or tmp_path / "checkpoint-2")
    assert kept is alike and saves == [2] and alike.checkpoint == tmp_path / "checkpoint-2"


# ---- the command line ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0, spec=SPEC).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "crashmod.py").write_text(REWARD_MODULE)
    return root


def train(root: Path, out: Path, *extra: str, crash_from_call: int = 0, wait: bool = True):
    command = [sys.executable, "-m", "cohort_grpo", "train", "--model", str(root / "model"), "--task", "arithmetic",
               "--reward_funcs", "crashmod:digit_share", "--num_generations", "4", "--per_device_train_batch_size", "8",
               "--max_completion_length", "5", "--max_prompt_length", "64", "--max_steps", "5", "--eval_limit", "4",
               "--learning_rate", "3e-3", "--beta", "0.05", "--log_completions_steps", "1", "--logging_steps", "1",
               "--seed", "7", "--device", "cpu", "--quiet", "--output_dir", str(out), *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CI="1", CRASH_FROM_CALL=str(crash_from_call or ""))
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return process.communicate(timeout=300) + (process.returncode,) if wait else process


def records(path: Path) -> list[dict]:
    return [without_wall_clock(json.loads(line)) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_cohort_train_failing_in_step_3_keeps_step_2_and_resume_gives_the_uninterrupted_run(setup):
    reference = train(setup, setup / "whole", wait=False)
    out = setup / "failed"
    stdout, stderr, code = train(setup, out, crash_from_call=3)
    assert code == 2, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("cohort: ")]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("cohort: error: reward 'digit_share' raised ValueError: the reward service is down")
    assert lines[0].endswith(f"checkpoint-2 saved in {out} — continue the run with --resume")
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"] and check_checkpoint(out / "checkpoint-2") is None
    stdout, stderr, code = train(setup, out, "--resume")
    assert code == 0, stderr[-3000:]
    assert "resumed from" in stdout + stderr
    whole_out, whole_err = reference.communicate(timeout=300)
    assert reference.returncode == 0, whole_err[-3000:]
    got, expected = records(out / "metrics.jsonl"), records(setup / "whole" / "metrics.jsonl")
    assert [r["step"] for r in got if "loss" in r] == [1, 2, 3, 4, 5]
    assert got == expected
    assert records(out / "completions.jsonl") == records(setup / "whole" / "completions.jsonl")
    final, wanted = load_file(out / "model.safetensors"), load_file(setup / "whole" / "model.safetensors")
    assert all(torch.equal(final[k], wanted[k]) for k in wanted)


# ---- prompts longer than max_prompt_length, found before step 1 --------------------------------------

def rows_file(path: Path) -> tuple[Path, list[dict]]:
    """Four rows, the third too long, after a blank line (so that its line is not its index + 1)."""
    rows = [{"prompt": "1+1="}, {"prompt": "2+2="}, {"prompt": "3+3=" * 30}, {"prompt": "4+4="}]
    path.write_text(json.dumps(rows[0]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[1:]) + "\n")
    return path, rows


def test_a_long_prompt_in_a_data_file_is_named_by_file_and_line_before_step_1(setup, tmp_path, capsys, monkeypatch):
    from cohort_grpo.cli import main

    data, rows = rows_file(tmp_path / "rows.jsonl")
    out = tmp_path / "out"
    monkeypatch.syspath_prepend(str(setup))
    code = main(["train", "--model", str(setup / "model"), "--data_files", str(data), "--reward_funcs",
                 "crashmod:digit_share", "--num_generations", "4", "--per_device_train_batch_size", "8",
                 "--max_completion_length", "4", "--max_prompt_length", "32", "--max_steps", "2", "--eval_limit", "0",
                 "--quiet", "--device", "cpu", "--output_dir", str(out)])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("cohort: error:")]
    length = len(build_tokenizer()(rows[2]["prompt"], add_special_tokens=False)["input_ids"])
    assert code == 2 and len(errors) == 1, err
    assert errors[0] == (f"cohort: error: train_dataset row 2 ({data}:4): the prompt has {length} tokens, more than "
                         "max_prompt_length=32; raise --max_prompt_length, filter long prompts out of the data, or "
                         "pass --long_prompts truncate_left to keep each one's last max_prompt_length tokens")
    assert not out.exists()  # refused before step 1: nothing sampled, nothing written


def test_rows_given_to_the_trainer_are_named_by_index(tiny_dir, tmp_path):
    _, rows = rows_file(tmp_path / "rows.jsonl")
    with pytest.raises(CohortError, match=r"^train_dataset row 2: the prompt has \d+ tokens, more than "
                                          r"max_prompt_length=32; .*long_prompts='truncate_left'"):
        GRPOTrainer(tiny_dir, noisy_reward, rows, args=config(tmp_path / "out", max_prompt_length=32))


def scores_answer(completions, answer, **_):
    return [float(c.strip() == a) + len(c) / 10 for c, a in zip(completions, answer)]


def test_a_row_without_a_column_a_reward_needs_is_named_before_step_1(tiny_dir, tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3="}]
    with pytest.raises(CohortError) as raised:
        GRPOTrainer(tiny_dir, scores_answer, rows, args=config(tmp_path / "out"))
    assert str(raised.value) == ("train_dataset row 2 has no 'answer' column, which reward 'scores_answer' needs (its "
                                 "columns: ['prompt']); add it to every row, or drop the reward")
    assert not (tmp_path / "out").exists()


def test_a_column_only_some_rows_have_reaches_the_rewards_as_none_elsewhere(tiny_dir, tmp_path):
    """As in a Hugging Face Dataset made from such rows (`Dataset.from_list`): the column exists, None where a row
    lacks it."""
    seen = []

    def reads_hint(completions, hint=None, **_):
        seen.extend(hint)
        return [len(c) / 10 for c in completions]

    rows = [{"prompt": f"{a}+1="} if a % 2 else {"prompt": f"{a}+1=", "hint": f"h{a}"} for a in range(8)]
    GRPOTrainer(tiny_dir, reads_hint, rows, args=config(tmp_path / "out", max_steps=2)).train()
    assert seen and set(seen) <= {None, "h0", "h2", "h4", "h6"} and None in seen and len(set(seen)) > 1


def test_a_resume_with_fewer_training_rows_says_so_and_starts_a_fresh_epoch(tiny_dir, tmp_path):
    """The checkpoint's place in its epoch indexes rows that may not exist any more (a bad row deleted from the data
    file, then --resume): one line, and a fresh epoch over the rows there are, not an IndexError mid-step."""
    GRPOTrainer(tiny_dir, noisy_reward, UPDATE_PROMPTS, args=config(tmp_path, max_steps=1, save_steps=1)).train()
    assert max(json.loads((tmp_path / "checkpoint-1" / TRAINER_STATE).read_text())["data_order"]) >= 10
    lines = []
    trainer = GRPOTrainer(tiny_dir, noisy_reward, UPDATE_PROMPTS[:10], log=lines.append,
                          args=config(tmp_path, max_steps=3, resume=True))
    trainer.train()
    assert trainer.step == 3
    assert [line for line in lines if "training rows" in line] == [
        "the training rows changed since checkpoint-1 (24 rows then, 10 now): its place in the epoch cannot be "
        "continued, so a fresh epoch over the 10 rows starts at step 2, and the run differs from an uninterrupted "
        "one from there"]


def test_truncate_left_keeps_the_last_max_prompt_length_tokens(tiny_dir, tmp_path):
    """TRL up to 0.27 cut a long prompt to its last max_prompt_length tokens; long_prompts=truncate_left does."""
    _, rows = rows_file(tmp_path / "rows.jsonl")
    lines = []
    trainer = GRPOTrainer(tiny_dir, noisy_reward, rows, log=lines.append,
                          args=config(tmp_path / "out", max_prompt_length=32, long_prompts="truncate_left", max_steps=1))
    assert any("1 of 4 prompts of train_dataset are longer than max_prompt_length=32" in line for line in lines), lines
    whole = trainer.tokenizer(rows[2]["prompt"], add_special_tokens=False)["input_ids"]
    assert len(whole) > 32 and trainer.group_sampler.encode_prompt(rows[2]["prompt"]) == whole[-32:]
    assert trainer.group_sampler.encode_prompt(rows[0]["prompt"]) == trainer.tokenizer(
        rows[0]["prompt"], add_special_tokens=False)["input_ids"]
    trainer.train()  # a step samples the cut prompt
    assert len(trainer.history) == 1


def test_long_prompts_takes_refuse_or_truncate_left():
    with pytest.raises(CohortError, match="long_prompts"):
        GRPOConfig(long_prompts="cut").validate()


# ---- several processes -----------------------------------------------------------------------------

@pytest.mark.slow
def test_a_reward_failing_on_one_rank_of_two_keeps_the_last_step_on_both(setup):
    """Rank 1's reward function raises in step 3; rank 0's does not. Scoring fails on every rank alike
    (`fail_together`), both ranks save checkpoint-2 together, and `--resume` gives the uninterrupted job's steps."""
    def job(out: Path, *extra: str, crash: bool = False):
        command = [sys.executable, "-m", "cohort_grpo", "train", "--nproc_per_node", "2", "--model", str(setup / "model"),
                   "--task", "arithmetic", "--reward_funcs", "crashmod:digit_share", "--num_generations", "4",
                   "--per_device_train_batch_size", "4", "--max_completion_length", "5", "--max_prompt_length", "64",
                   "--max_steps", "4", "--eval_limit", "0", "--learning_rate", "3e-3", "--seed", "7", "--logging_steps",
                   "1", "--device", "cpu", "--quiet", "--output_dir", str(out), *extra]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(setup), os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CI="1",
                   CRASH_FROM_CALL="3" if crash else "", CRASH_ON_RANK="1")
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    whole = job(setup / "whole-2")
    out = setup / "failed-2"
    failed = job(out, crash=True)
    _, stderr = failed.communicate(timeout=400)
    lines = [line for line in stderr.splitlines() if line.startswith("cohort: ")]
    assert failed.returncode != 0 and len(lines) == 1, stderr[-4000:]
    assert "ValueError: the reward service is down" in lines[0], lines
    assert lines[0].endswith(f"checkpoint-2 saved in {out} — continue the run with --resume"), lines
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"] and check_checkpoint(out / "checkpoint-2") is None
    resumed = job(out, "--resume")
    _, stderr = resumed.communicate(timeout=400)
    assert resumed.returncode == 0, stderr[-4000:]
    _, stderr = whole.communicate(timeout=400)
    assert whole.returncode == 0, stderr[-4000:]
    assert records(out / "metrics.jsonl") == records(setup / "whole-2" / "metrics.jsonl")
