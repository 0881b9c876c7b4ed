"""`cohort-grpo eval`: per-question JSONL, the greedy accuracy and (from n samples) pass@k for k = 1, 2, 4, …, n
and maj@n consistent with the verdicts, each printed and stored under its own label, verdicts checked
independently of the code under test, and the in-training eval logging `eval/accuracy`.

Where a verdict must come out right (not merely agree with the code's own parse), the model is a
scripted one (`save_answering_model`) whose greedy completion is known in advance, and the expected
verdicts follow from the data by plain Python."""

import itertools
import json
import random
import re
from collections import Counter
from math import comb

import pytest
import torch

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.cli import main

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

    from cohort_grpo.models.tiny import build_tokenizer

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


def test_model_impl_hf_grades_what_the_engine_grades(tiny_dir, tmp_path, capsys):
    """--model_impl hf (transformers and generate) greedy-decodes the same completions as the engine does."""
    records = {}
    for impl in ("cohort", "hf"):
        out_file = tmp_path / f"{impl}.jsonl"
        assert main(["eval", "--model", tiny_dir, "--task", "arithmetic", "--limit", "6", "--levels", "1",
                     "--output", str(out_file), "--device", "cpu", "--model_impl", impl]) == 0
        records[impl] = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["completion"] for r in records["hf"]] == [r["completion"] for r in records["cohort"]]
    assert len(records["hf"]) == 6


class ScriptedSampler:
    """Arithmetic completions chosen in advance, whatever the model: the greedy completion is right
    when the answer is even; of the n samples of a question, `answer % (n + 1)` are right (at random
    positions) and the wrong ones alternate between two wrong answers, so pass@k, pass@1 and maj@n all
    differ from the greedy accuracy and from each other."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def completions(self, question: str, n: int, greedy: bool) -> list[str]:
        truth = _arithmetic_truth(question)
        if greedy:
            return [f"<answer>{truth if truth % 2 == 0 else truth + 1}</answer>"]
        right = set(random.Random(truth).sample(range(n), truth % (n + 1)))
        return [f"<answer>{truth if j in right else truth + 1 + j % 2}</answer>" for j in range(n)]

    def generate(self, prompt_ids, num_generations, params):
        from cohort_grpo.rollout.sampler import Rollout

        texts = [text for ids in prompt_ids
                 for text in self.completions(self.tokenizer.decode(ids).split("=?")[0], num_generations,
                                              params.temperature == 0)]
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        width = max(map(len, ids))
        completion_ids = torch.tensor([row + [params.pad_token_id] * (width - len(row)) for row in ids])
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])
        return Rollout(completion_ids, mask, None, ["stop"] * len(texts))


def subset_pass_at_k(verdicts, k):
    """The share of the k-subsets of one question's samples holding a correct one (enumerated)."""
    subsets = list(itertools.combinations(verdicts, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


def first_most_voted(answers):
    """Independent maj@n: the most frequent answer, ties to the one seen first; None without answers."""
    votes = Counter(a for a in answers if a is not None)
    return max(votes, key=lambda a: (votes[a], -answers.index(a))) if votes else None


def test_pass_at_k_for_every_k_beside_the_greedy_accuracy(tiny_dir, tmp_path, monkeypatch, capsys):
    """n = 6 samples: pass@1, pass@2, pass@4 and pass@6 (n itself) from subset enumeration over the
    JSONL's own verdicts, maj@6 from an independent vote; printed, in the per-question JSONL and in the
    summary JSON under `eval/...` keys, each labelled as what it is."""
    import cohort_grpo.rollout

    monkeypatch.setattr(cohort_grpo.rollout, "make_sampler", lambda model, tokenizer: ScriptedSampler(tokenizer))
    out_file = tmp_path / "scripted.jsonl"
    assert main(["eval", "--model", tiny_dir, "--task", "arithmetic", "--limit", "16", "--levels", "1",
                 "--num_samples", "6", "--temperature", "0.7", "--output", str(out_file), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    records = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert len(records) == 16
    ks = [1, 2, 4, 6]
    expected = {f"pass@{k}": 0.0 for k in ks}
    for r in records:
        truth = _arithmetic_truth(r["question"])
        verdicts = [_tagged_answer(s) == str(truth) for s in r["samples"]]
        assert r["samples_correct"] == verdicts and sum(verdicts) == truth % 7 == r["num_samples_correct"]
        assert r["correct"] == (truth % 2 == 0)
        assert r["majority_correct"] == (first_most_voted([_tagged_answer(s) for s in r["samples"]]) == str(truth))
        for k in ks:
            assert r[f"pass@{k}"] == pytest.approx(subset_pass_at_k(verdicts, k), abs=1e-12), (k, verdicts)
            expected[f"pass@{k}"] += subset_pass_at_k(verdicts, k) / 16
    expected["pass@1"] = sum(sum(r["samples_correct"]) / 6 for r in records) / 16  # the samples' mean accuracy
    greedy = sum(r["correct"] for r in records) / 16
    majority = sum(r["majority_correct"] for r in records) / 16
    assert len({sum(r["samples_correct"]) for r in records}) >= 4  # the script spreads c over 0..6
    assert len({round(v, 6) for v in [greedy, majority, *expected.values()]}) >= 4  # distinct numbers

    summary = json.loads((tmp_path / "scripted.summary.json").read_text())
    metrics = summary["metrics"]
    assert metrics["eval/greedy_accuracy"] == metrics["eval/accuracy"] == pytest.approx(greedy)
    assert metrics["eval/maj@6"] == pytest.approx(majority)
    assert {key for key in metrics if key.startswith("eval/pass@")} == {f"eval/pass@{k}" for k in ks}
    for key, value in expected.items():
        assert metrics[f"eval/{key}"] == pytest.approx(value, abs=1e-12), key
    assert summary["samples"] == {"num_samples": 6, "temperature": 0.7, "seed": 0, "pass_k": ks}
    assert set(summary["definitions"]) == set(metrics)
    assert "greedy" in summary["definitions"]["eval/greedy_accuracy"]
    assert "mean accuracy of the 6 samples" in summary["definitions"]["eval/pass@1"]
    assert "unbiased pass@4 from 6 samples" in summary["definitions"]["eval/pass@4"]

    assert _printed(printed, "greedy accuracy, pass@1 (greedy)") == pytest.approx(100 * greedy, abs=0.05)
    assert re.search(r"n=6 completions per question at T=0\.7", printed)
    for k in ks:  # "pass@1" alone (the sampled one) is a different line from the greedy one
        assert _printed(printed, f"\n  pass@{k}") == pytest.approx(100 * expected[f"pass@{k}"], abs=0.05)
    assert re.search(r"\n  pass@1\s+[\d.]+%\s+mean accuracy of the samples", printed)
    assert _printed(printed, "maj@6") == pytest.approx(100 * majority, abs=0.05)
    assert "pass@8" not in printed and "pass@3" not in printed
    assert f"summary: {tmp_path / 'scripted.summary.json'}" in printed


def test_evaluate_summed_over_ranks_equals_one_rank():
    """`EvalResult.summed` (the in-training eval over several ranks) adds up every pass@k."""
    from cohort_grpo.eval.evaluate import evaluate
    from cohort_grpo.models.tiny import build_tokenizer
    from cohort_grpo.tasks import get_task

    tokenizer = build_tokenizer()
    task = get_task("arithmetic")
    rows = task.load("test", levels=[1], size=10, seed=3)
    encode = lambda prompt: tokenizer(prompt, add_special_tokens=False)["input_ids"]  # noqa: E731
    whole = evaluate(ScriptedSampler(tokenizer), tokenizer, task, rows, encode, num_samples=5)
    halves = [evaluate(ScriptedSampler(tokenizer), tokenizer, task, part, encode, num_samples=5)
              for part in (rows[:3], rows[3:])]
    counts = []
    for half in halves:  # each "rank" records its counts; the reduction adds the two lists
        half.summed(lambda values: counts.append(values) or values)
    total = [a + b for a, b in zip(*counts)]
    merged = halves[0].summed(lambda values: total)
    assert merged.num_questions == 10 and sorted(merged.pass_at) == [1, 2, 4, 5]
    assert merged.metrics() == pytest.approx(whole.metrics(), abs=1e-12)


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
    assert "pass@" not in printed.replace("pass@1 (greedy)", "")  # n = 1: no pass@k / maj@k lines
    assert "maj@" not in printed
    summary = json.loads((tmp_path / "gsm.summary.json").read_text())
    assert summary["samples"] is None
    assert summary["metrics"] == pytest.approx({"eval/accuracy": 1 / 3, "eval/greedy_accuracy": 1 / 3,
                                                "eval/format_rate": 0.0,
                                                "eval/mean_length": sum(r["length"] for r in records) / 3})


def test_no_model_means_the_built_in_model(tiny_dir, tmp_path, monkeypatch, capsys):
    import cohort_grpo.sft.builtin

    asked = []
    monkeypatch.setattr(cohort_grpo.sft.builtin, "tiny_model_dir", lambda log=print, **_: asked.append(1) or tiny_dir)
    out_file = tmp_path / "builtin.jsonl"
    assert main(["eval", "--limit", "3", "--output", str(out_file), "--device", "cpu"]) == 0
    assert asked and len(out_file.read_text().splitlines()) == 3
    assert "model built-in tiny" in capsys.readouterr().out


@pytest.mark.parametrize("argv, fragment", [
    (["eval", "--task", "nope"], "unknown task 'nope'"),
    (["eval", "--num_samples", "0"], "--num_samples 0 must be at least 1"),
    (["eval", "--limits", "3"], "unknown option --limits"),
    (["eval", "--limit", "x"], "--limit expects int"),
    (["eval", "--model_impl", "vllm"], "--model_impl 'vllm' is not one of auto, cohort, hf"),
    (["eval", "--task", "gsm8k", "--data_files", "/nonexistent.jsonl"], "/nonexistent.jsonl"),
])
def test_bad_input_is_one_line(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1


def test_training_logs_eval_accuracy_every_eval_steps(tmp_path):
    from cohort_grpo.tasks import get_task

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
