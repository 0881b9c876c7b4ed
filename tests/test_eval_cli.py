"""`cohort eval`: per-question JSONL, pass@1 / pass@k / maj@k consistent with the verdicts, verdicts
checked independently of the code under test, and the in-training eval logging `eval/accuracy`.

Where a verdict must come out right (not merely agree with the code's own parse), the model is a
scripted one (`save_answering_model`) whose greedy completion is known in advance, and the expected
verdicts follow from the data by plain Python."""

import json
import re
from math import comb

import pytest
import torch

from cohort import GRPOConfig, GRPOTrainer
from cohort.cli import main

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


def save_answering_model(path, completion: str) -> str:
    """A one-layer Llama that is a bigram table, saved with the tiny character tokenizer: every layer
    weight is zero, so the last hidden state is the current token's (one-hot) embedding, and the head
    maps each token of "\\n" + `completion` to the next one, the last to EOS. After any prompt that ends
    in a newline, greedy decoding (and sampling: the margin is ~50 nats) writes exactly `completion`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from cohort.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    chain = tokenizer("\n" + completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert len(set(chain[:-1])) == len(chain) - 1, "a bigram table gives each token one successor"
    vocab = len(tokenizer)
    hidden = 8 * (vocab // 8 + 1)  # room for a one-hot embedding of every token
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        model.model.norm.weight.fill_(1.0)
        for token, successor in zip(chain, chain[1:]):
            model.lm_head.weight[successor, token] = 5.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


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


def test_gsm8k_eval_from_data_files(tmp_path, capsys):
    """A model that always answers `<answer>12</answer>`: right on the question whose '#### N' line says
    12, wrong on the others, and never in GSM8K's <think>/<answer> layout."""
    model_dir = save_answering_model(tmp_path / "answers_12", "<answer>12</answer>")
    data = tmp_path / "mini.jsonl"
    questions = [("Tom has 3 apples and gets 4 more. How many?", "7"), ("What is 2 times 6?", "12"),
                 ("A box holds 1,000 pins; how many in one box?", "1,000")]
    data.write_text("".join(json.dumps({"question": q, "answer": f"Work.\n#### {a}"}) + "\n" for q, a in questions))
    out_file = tmp_path / "gsm.jsonl"
    assert main(["eval", "--model", model_dir, "--task", "gsm8k", "--split", "test", "--data_files", str(data),
                 "--max_completion_length", "16", "--output", str(out_file), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    records = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["question"] for r in records] == [q for q, _ in questions]
    assert [r["gold"] for r in records] == ["7", "12", "1000"]  # commas removed from the gold answer
    assert [r["completion"] for r in records] == ["<answer>12</answer>"] * 3
    assert [r["correct"] for r in records] == [gold.replace(",", "") == "12" for _, gold in questions]
    assert [r["correct"] for r in records] == [False, True, False]
    assert [r["format_ok"] for r in records] == [False] * 3  # no <think> block
    assert all("samples" not in r for r in records)
    assert _printed(printed, "pass@1 (greedy)") == pytest.approx(100 / 3, abs=0.05)
    assert _printed(printed, "format rate") == 0.0
    assert "pass@" not in printed.replace("pass@1 (greedy)", "")  # k = 1: no pass@k / maj@k lines


def test_no_model_means_the_built_in_model(tiny_dir, tmp_path, monkeypatch, capsys):
    import cohort.models.tiny

    asked = []
    monkeypatch.setattr(cohort.models.tiny, "tiny_model_dir", lambda log=print, **_: asked.append(1) or tiny_dir)
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


def test_training_logs_eval_accuracy_every_eval_steps(tmp_path):
    from cohort.tasks import get_task

    task = get_task("arithmetic")
    held_out = task.load("test", levels=[2], size=6)
    # A model that always answers the first held-out problem whose sum has two different digits: it is
    # right on every held-out problem with that sum. Its completions never differ, so every group's
    # rewards are equal, the update is zero, and every evaluation must find the same accuracy.
    sums = [_arithmetic_truth(row["question"]) for row in held_out]
    answer = next(str(n) for n in sums if 10 <= n <= 99 and len(set(str(n))) == 2)
    expected = sum(str(n) == answer for n in sums) / len(sums)
    model_dir = save_answering_model(tmp_path / "model", f"<answer>{answer}</answer>")
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                      max_completion_length=4, max_steps=3, eval_steps=1, learning_rate=1e-4,
                      output_dir=str(tmp_path / "run"), quiet=True, seed=0, device="cpu")
    trainer = GRPOTrainer(model_dir, None, task.load("train", levels=[2], size=20), args=args,
                          eval_dataset=held_out, task=task, log=lambda *_: None)
    trainer.train()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    eval_steps = [r["step"] for r in lines if "eval/accuracy" in r]
    assert eval_steps == [0, 1, 2, 3]  # before training, every eval_steps, and after the last step
    assert 0 < expected < 1
    assert [r["eval/accuracy"] for r in lines if "eval/accuracy" in r] == pytest.approx([expected] * 4)
