"""A real pretrained model on CPU: SmolLM2-135M-Instruct (GGUF, Q4_1) — `cohort-grpo eval` on 20 GSM8K test
questions, `cohort-grpo sft` from the GGUF, and two GRPO steps on GSM8K train from the SFT output.
Needs ../shared (the fetch script and the GSM8K files); skipped with the reason when it is absent or
the model cannot be fetched."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.cli import main
from cohort_grpo.rewards.rules import accuracy_reward, format_reward
from cohort_grpo.tasks import get_task

SHARED = Path(__file__).resolve().parents[2] / "shared"
GET_SCRIPT = SHARED / "models" / "smollm2-135m-instruct" / "get.sh"
GSM8K = SHARED / "data" / "gsm8k"

# One thread: on a shared CI runner, OpenMP threads that wait on busy cores cost far more than they give.
torch.set_num_threads(1)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (GET_SCRIPT.is_file() and (GSM8K / "test.jsonl").is_file()),
                                 reason="../shared (SmolLM2 fetch script, GSM8K data) is not present")]


@pytest.fixture(scope="module")
def gguf_file(smollm2_gguf) -> str:
    """SmolLM2's GGUF as tests/conftest.py's `smollm2_gguf` fetches it."""
    return smollm2_gguf


@pytest.mark.soak  # 20 greedy answers of a 135M model on the CPU, half a minute: CI runs it with -m soak
def test_eval_on_20_gsm8k_test_questions(gguf_file, tmp_path, capsys):
    out_file = tmp_path / "eval.jsonl"
    assert main(["eval", "--model", gguf_file, "--task", "gsm8k", "--split", "test", "--limit", "20",
                 "--max_completion_length", "128", "--output", str(out_file), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    records = [json.loads(line) for line in out_file.read_text().splitlines()]
    test_rows = [json.loads(line) for line in (GSM8K / "test.jsonl").read_text().splitlines()[:20]]
    assert len(records) == 20
    assert [r["question"] for r in records] == [t["question"] for t in test_rows]
    for record, raw in zip(records, test_rows):
        assert record["gold"] == raw["answer"].split("####")[-1].strip().replace(",", "")
        assert record["completion"].strip(), "the model wrote nothing"
        assert 1 <= record["length"] <= 128
        # verdicts recomputed with the reward functions directly
        assert record["correct"] == (accuracy_reward(None, [record["completion"]], solution=[record["gold"]])[0] == 1.0)
        assert record["format_ok"] == (format_reward(None, [record["completion"]])[0] == 1.0)
    pass1 = float(re.search(r"pass@1 \(greedy\)\s+([\d.]+)%", printed).group(1))
    assert pass1 == pytest.approx(100 * sum(r["correct"] for r in records) / 20, abs=0.05)


@pytest.fixture(scope="module")
def sft_dir(gguf_file, tmp_path_factory):
    """`cohort-grpo sft` from the GGUF: one step on two GSM8K reference solutions, saved as an HF folder."""
    out = tmp_path_factory.mktemp("smollm2_sft")
    assert main(["sft", "--model", gguf_file, "--task", "gsm8k", "--subset", "2", "--max_steps", "1",
                 "--batch_size", "2", "--max_completion_length", "64", "--output_dir", str(out), "--device", "cpu"]) == 0
    return out


def test_sft_from_gguf_saves_a_loadable_changed_model(gguf_file, sft_dir):
    from cohort_grpo.models import from_pretrained

    losses = json.loads((sft_dir / "sft_losses.json").read_text())["losses"]
    assert len(losses) == 1 and math.isfinite(losses[0]) and losses[0] > 0
    tuned = dict(from_pretrained(str(sft_dir)).named_parameters())
    base = dict(from_pretrained(gguf_file).named_parameters())
    assert tuned.keys() == base.keys()
    assert any(not torch.equal(tuned[k], base[k]) for k in base)


def shorter_is_better(prompts, completions, **_):
    return [-len(c[-1]["content"]) / 1000 for c in completions]


def test_two_grpo_steps_on_gsm8k_train(sft_dir, tmp_path):
    """GRPO loads the `cohort-grpo sft` output (the warm-start → GRPO path) and takes two real steps."""
    task = get_task("gsm8k")
    rows = task.load("train", subset=16, seed=0)
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                      max_completion_length=48, max_prompt_length=512, max_steps=2, learning_rate=1e-5, beta=0.0,
                      temperature=1.0, output_dir=str(tmp_path), quiet=True, seed=0, device="cpu",
                      log_completions_steps=1)
    # The untrained model rarely earns format or accuracy reward, so every group could tie and the
    # update be exactly zero; a small length reward (it differs between any two completions of
    # different length) makes the two steps' gradient non-zero for sure, next to GSM8K's own rewards.
    args.reward_weights = list(task.reward_weights) + [0.1]
    trainer = GRPOTrainer(str(sft_dir), list(task.reward_funcs) + [shorter_is_better], rows, args=args, task=task,
                          log=lambda *_: None)
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    history = trainer.history
    assert [r["step"] for r in history] == [1, 2]
    samples = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    for record in history:
        for name in ("loss", "reward", "grad_norm", "entropy", "completions/mean_length"):
            assert math.isfinite(record[name]), (name, record[name])
        assert record["informative"] > 0  # the length reward splits every group of different lengths
        rows = [c for c in samples if c["step"] == record["step"]]
        assert len(rows) == 4  # every completion of the step (log_completions_steps=1)
        texts = [c["completion"][-1]["content"] for c in rows]
        # recomputed from the texts: the length reward, and open-r1's tag count (0.25 for each layout
        # piece that appears exactly once)
        pieces = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
        tag_counts = [0.25 * sum(text.count(piece) == 1 for piece in pieces) for text in texts]
        assert [c["rewards"]["tag_count_reward"] for c in rows] == pytest.approx(tag_counts)
        assert record["rewards/tag_count_reward/mean"] == pytest.approx(sum(tag_counts) / 4)
        assert record["rewards/shorter_is_better/mean"] == pytest.approx(sum(-len(t) / 1000 for t in texts) / 4)
        for name in ("format_reward", "accuracy_reward"):
            scores = [c["rewards"][name] for c in rows]
            assert set(scores) <= {0.0, 1.0}, (name, scores)
            assert record[f"rewards/{name}/mean"] == pytest.approx(sum(scores) / 4)
    changed = [k for k, v in trainer.model.named_parameters() if not torch.equal(before[k], v.detach())]
    assert changed, "two GRPO steps left every weight unchanged"
    for name in ("metrics.jsonl", "completions.jsonl", "config.json", "model.safetensors", "tokenizer.json",
                 "summary.json"):
        assert (tmp_path / name).is_file(), name
    # the saved folder is the trained policy: reloading it gives the updated weights
    from cohort_grpo.models import from_pretrained

    reloaded = dict(from_pretrained(str(tmp_path)).named_parameters())
    name = changed[0]
    assert torch.allclose(reloaded[name].float(), dict(trainer.model.named_parameters())[name].detach().float())
