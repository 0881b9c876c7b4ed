"""`cohort eval`: per-question JSONL, pass@1 / pass@k / maj@k consistent with the verdicts, verdicts
checked independently of the code under test, and the in-training eval logging `eval/accuracy`."""

import json
import re
from math import comb

import pytest
import torch

from cohort import GRPOConfig, GRPOTrainer
from cohort.cli import main
from cohort.rewards.rules import accuracy_reward, format_reward

torch.set_num_threads(1)


def _printed(out: str, label: str) -> float:
    match = re.search(rf"{re.escape(label)}\s+([\d.]+)%", out)
    assert match, (label, out)
    return float(match.group(1))


def _arithmetic_truth(question: str) -> int:
    a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)", question).groups()
    return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def _tagged_answer(text: str) -> str | None:
    start = text.find("<answer>")
    end = text.find("</answer>", start + 1) if start >= 0 else -1
    return text[start + len("<answer>"):end].strip() if start >= 0 and end >= 0 else None


def test_arithmetic_eval_writes_jsonl_and_consistent_metrics(tiny_dir, tmp_path, capsys):
    out_file = tmp_path / "eval.jsonl"
    code = main(["eval", "--model", tiny_dir, "--task", "arithmetic", "--limit", "12", "--num_samples", "4",
                 "--levels", "1", "--output", str(out_file), "--device", "cpu"])
    assert code == 0
    printed = capsys.readouterr().out
    records = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert len(records) == 12 and [r["index"] for r in records] == list(range(12))
    for r in records:
        # gold and verdicts recomputed from the question text itself
        assert int(r["gold"]) == _arithmetic_truth(r["question"])
        assert r["correct"] == (_tagged_answer(r["completion"]) == r["gold"])
        assert len(r["samples"]) == len(r["samples_correct"]) == 4
        assert r["samples_correct"] == [_tagged_answer(s) == r["gold"] for s in r["samples"]]
    pass1 = sum(r["correct"] for r in records) / 12
    # with n = k samples the unbiased pass@k is 1 - C(n-c, k) / C(n, k): 1 when any sample is right
    passk = sum(1 - comb(4 - sum(r["samples_correct"]), 4) / comb(4, 4) for r in records) / 12
    assert _printed(printed, "pass@1 (greedy)") == pytest.approx(100 * pass1, abs=0.05)
    assert _printed(printed, "pass@4") == pytest.approx(100 * passk, abs=0.05)
    assert _printed(printed, "maj@4") == pytest.approx(100 * sum(r["majority_correct"] for r in records) / 12, abs=0.05)
    assert _printed(printed, "format rate") == pytest.approx(
        100 * sum(_tagged_answer(r["completion"]) is not None for r in records) / 12, abs=0.05)
    assert re.search(r"mean length\s+[\d.]+ tokens", printed)


def test_gsm8k_eval_from_data_files(tiny_dir, tmp_path, capsys):
    data = tmp_path / "mini.jsonl"
    questions = [("Tom has 3 apples and gets 4 more. How many?", "7"), ("What is 2 times 6?", "12"),
                 ("A box holds 1,000 pins; how many in one box?", "1,000")]
    data.write_text("".join(json.dumps({"question": q, "answer": f"Work.\n#### {a}"}) + "\n" for q, a in questions))
    out_file = tmp_path / "gsm.jsonl"
    assert main(["eval", "--model", tiny_dir, "--task", "gsm8k", "--split", "test", "--data_files", str(data),
                 "--max_completion_length", "16", "--output", str(out_file), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    records = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["question"] for r in records] == [q for q, _ in questions]
    assert [r["gold"] for r in records] == ["7", "12", "1000"]  # commas removed from the gold answer
    for r in records:
        assert r["correct"] == (accuracy_reward(None, [r["completion"]], solution=[r["gold"]])[0] == 1.0)
        assert r["format_ok"] == (format_reward(None, [r["completion"]])[0] == 1.0)
        assert "samples" not in r
    assert "pass@" not in printed.replace("pass@1 (greedy)", "")  # k = 1: no pass@k / maj@k lines


def test_no_model_means_the_built_in_model(tiny_dir, tmp_path, monkeypatch, capsys):
    import cohort.tiny

    asked = []
    monkeypatch.setattr(cohort.tiny, "tiny_model_dir", lambda log=print, **_: asked.append(1) or tiny_dir)
    out_file = tmp_path / "builtin.jsonl"
    assert main(["eval", "--limit", "3", "--output", str(out_file), "--device", "cpu"]) == 0
    assert asked and len(out_file.read_text().splitlines()) == 3
    assert "model built-in tiny" in capsys.readouterr().out


@pytest.mark.parametrize("argv, fragment", [
    (["eval", "--task", "nope"], "unknown task 'nope'"),
    (["eval", "--num_samples", "0"], "--num_samples 0 must be at least 1"),
    (["eval", "--limits", "3"], "unknown option --limits"),
    (["eval", "--limit", "x"], "--limit expects int"),
    (["eval", "--task", "gsm8k", "--data_files", "/nonexistent.jsonl"], "/nonexistent.jsonl"),
])
def test_bad_input_is_one_line(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1


def test_training_logs_eval_accuracy_every_eval_steps(tiny_dir, tmp_path):
    from cohort.tasks import get_task

    task = get_task("arithmetic")
    held_out = task.load("test", levels=[2], size=6)
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                      max_completion_length=4, max_steps=3, eval_steps=1, learning_rate=1e-4,
                      output_dir=str(tmp_path), quiet=True, seed=0, device="cpu")
    trainer = GRPOTrainer(tiny_dir, None, task.load("train", levels=[2], size=20), args=args,
                          eval_dataset=held_out, task=task, log=lambda *_: None)
    trainer.train()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    eval_steps = [r["step"] for r in lines if "eval/accuracy" in r]
    assert eval_steps == [0, 1, 2, 3]  # before training, every eval_steps, and after the last step
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in lines if "eval/accuracy" in r)
