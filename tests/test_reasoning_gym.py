"""`--task reasoning_gym:NAME[:W],…`: reasoning-gym's generators as a cohort task. Three steps of training on the
tiny model with each reward logged, the correctness reward against reasoning-gym's own `score_answer`, held-out
questions never trained on, a mixture's rows by weight, `cohort-grpo eval` with pass@k on a scripted sampler,
the TRL-style helper, and the one line when reasoning-gym is not installed."""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
from collections import Counter

import pytest
import torch

from cohort_grpo.cli import main
from cohort_grpo.errors import CohortError
from cohort_grpo.tasks import get_task

torch.set_num_threads(1)

try:
    import reasoning_gym
except ImportError:  # the envs extra (and the test extra) bring it
    pytest.skip('reasoning-gym is not installed (pip install "cohort-grpo[envs]")', allow_module_level=True)

TASK = "reasoning_gym:basic_arithmetic"
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
TRAIN_OPTIONS = ["--num_generations", "2", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
                 "--max_completion_length", "8", "--max_prompt_length", "96", "--long_prompts", "truncate_left",
                 "--eval_limit", "4", "--eval_steps", "3", "--save_steps", "0", "--device", "cpu", "--quiet",
                 "--logging_steps", "1", "--learning_rate", "1e-4"]


def test_three_steps_on_the_tiny_model_log_each_reward(tiny_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--model", tiny_dir, "--task", TASK, "--max_steps", "3", "--output_dir", str(out),
                 *TRAIN_OPTIONS]) == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        for name in ("score_reward", "answer_format_reward"):
            assert 0.0 <= record[f"rewards/{name}/mean"] <= 1.0
        # the total is the weighted sum of the two (weights 1.0 and 0.2)
        assert record["reward"] == pytest.approx(record["rewards/score_reward/mean"]
                                                 + 0.2 * record["rewards/answer_format_reward/mean"], abs=1e-6)
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 3]


def test_the_correctness_reward_is_reasoning_gyms_score():
    task = get_task("reasoning_gym:basic_arithmetic,leg_counting")
    rows = task.load("test", size=24)
    score_reward, format_reward = task.reward_funcs
    fresh = {name: reasoning_gym.create_dataset(name, seed=123, size=1) for name in ("basic_arithmetic", "leg_counting")}
    for row in rows:
        gold = row["entry"]["answer"]
        completions = [f"steps\n<answer>{gold}</answer>", f"<answer>{int(gold) + 1}</answer>", f"<answer>x{gold}</answer>",
                       f"<answer>0</answer> then <answer>{gold}</answer>", f"no tags {gold}"]
        answers = [gold, str(int(gold) + 1), f"x{gold}", gold, None]  # reasoning-gym reads the last block
        rewards = score_reward(None, completions, entry=[row["entry"]] * len(completions))
        scorer = fresh[row["source_dataset"]]
        assert rewards == [scorer.score_answer(answer, row["entry"]) for answer in answers]
        assert rewards[0] == rewards[3] == 1.0 and rewards[4] == 0.0
        assert rewards[2] == pytest.approx(len(gold) / (len(gold) + 1))  # the base scorer's partial credit
        assert [task.is_correct(c, row) for c in completions] == [True, False, False, True, False]
        assert format_reward(None, completions) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_held_out_questions_are_never_trained_on():
    task = get_task("reasoning_gym:chain_sum,basic_arithmetic")
    held_out = {r["question"] for r in task.load("test", size=1000)}
    assert len(held_out) > 900
    for seed in (0, 1, 7):
        train = [r["question"] for r in task.load("train", size=2000, seed=seed)]
        assert not held_out & set(train), seed
    # the held-out split is the same for every run seed, and a shorter one is its beginning
    assert [r["question"] for r in task.load("test", size=50, seed=5)] == \
        [r["question"] for r in task.load("test", size=1000)][:50]
    assert [r["question"] for r in task.load("train", size=50, seed=1)] != \
        [r["question"] for r in task.load("train", size=50, seed=2)]


def test_a_mixture_draws_each_task_by_its_weight():
    rows = get_task("reasoning_gym:leg_counting:3,chain_sum:1,basic_arithmetic:0.5").load("train", size=6000)
    counts = Counter(r["source_dataset"] for r in rows)
    for name, weight in (("leg_counting", 3), ("chain_sum", 1), ("basic_arithmetic", 0.5)):
        p = weight / 4.5
        assert abs(counts[name] - p * 6000) < 4 * math.sqrt(6000 * p * (1 - p)), counts
        assert all(r["entry"]["metadata"]["source_dataset"] == name for r in rows if r["source_dataset"] == name)
    equal = Counter(r["source_dataset"] for r in get_task("reasoning_gym:leg_counting,chain_sum").load("train", size=2000))
    assert abs(equal["leg_counting"] - 1000) < 4 * math.sqrt(500)


@pytest.mark.parametrize("spec, fragments", [
    ("leg_countin", ["unknown reasoning-gym task 'leg_countin'", "close names: leg_counting"]),
    ("leg_counting:-1", ["weight '-1' is not a positive number"]),
    ("leg_counting:x", ["weight 'x'"]),
    ("leg_counting,leg_counting", ["appears twice"]),
    ("", ["'reasoning_gym:' is not one of its values", "reasoning_gym:NAME"]),
])
def test_bad_task_names_and_weights_are_one_line(spec, fragments, capsys):
    assert main(["train", "--task", f"reasoning_gym:{spec}", "--max_steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(f in err for f in fragments), err


def test_without_reasoning_gym_one_line_names_the_package_and_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` raises ImportError
    with pytest.raises(CohortError, match=r'reasoning-gym package.*pip install "cohort-grpo\[envs\]"'):
        get_task(TASK)
    assert main(["train", "--task", TASK, "--max_steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'pip install "cohort-grpo[envs]"' in err, err


def test_rows_and_reward_for_a_trl_style_trainer():
    from cohort_grpo.tasks.reasoning_gym import rows_and_reward

    dataset = reasoning_gym.create_dataset("leg_counting", seed=9, size=6)
    rows, reward = rows_and_reward(dataset)
    assert [r["question"] for r in rows] == [dataset[i]["question"] for i in range(6)]
    assert all(r["prompt"][-1] == {"role": "user", "content": r["question"]} for r in rows)
    assert all(isinstance(v, (str, int, list)) for r in rows for v in r.values())  # plain values: a datasets.Dataset
    completions = [f"<answer>{r['solution']}</answer>" if i % 2 else "<answer>1</answer>" for i, r in enumerate(rows)]
    indices = [r["entry_index"] for r in rows]
    assert reward(prompts=None, completions=completions, entry_index=indices) == \
        [dataset.score_answer(ANSWER.search(c).group(1), dataset[i]) for c, i in zip(completions, indices)]
    assert reward(completions=completions, entry_index=indices) == [float(i % 2) for i in range(6)]


class ScriptedSampler:
    """Completions chosen in advance from the prompt's question: the greedy one right on even-numbered
    questions; of n samples, (question number mod n + 1) right, the rest a wrong number."""

    def __init__(self, tokenizer, numbers: dict[str, int], solutions: dict[str, str]):
        self.tokenizer, self.numbers, self.solutions = tokenizer, numbers, solutions

    def completions(self, question: str, n: int, greedy: bool) -> list[str]:
        number, gold = self.numbers[question], self.solutions[question]
        if greedy:
            return [f"<answer>{gold if number % 2 == 0 else gold + '1'}</answer>"]
        return [f"<answer>{gold if j < number % (n + 1) else '99999'}</answer>" for j in range(n)]

    def generate(self, prompt_ids, num_generations, params):
        from cohort_grpo.rollout.sampler import Rollout

        texts = [text for ids in prompt_ids for text in self.completions(
            self.tokenizer.decode(ids).strip().splitlines()[-1], num_generations, params.temperature == 0)]
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        width = max(map(len, ids))
        completion_ids = torch.tensor([row + [params.pad_token_id] * (width - len(row)) for row in ids])
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])
        return Rollout(completion_ids, mask, None, ["stop"] * len(texts))


def test_eval_cli_greedy_accuracy_and_pass_at_k(tiny_dir, tmp_path, monkeypatch, capsys):
    import cohort_grpo.rollout

    rows = get_task(TASK).load("test", size=8)
    numbers = {r["question"]: i for i, r in enumerate(rows)}
    solutions = {r["question"]: r["solution"] for r in rows}
    monkeypatch.setattr(cohort_grpo.rollout, "make_sampler",
                        lambda model, tokenizer: ScriptedSampler(tokenizer, numbers, solutions))
    assert main(["eval", "--model", tiny_dir, "--task", TASK, "--limit", "8", "--num_samples", "4",
                 "--output_dir", str(tmp_path), "--device", "cpu"]) == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (tmp_path / "reasoning_gym-basic_arithmetic_test.jsonl").read_text()
               .splitlines()]
    assert [r["question"] for r in records] == [r["question"] for r in rows]
    expected = {k: 0.0 for k in (1, 2, 4)}
    for i, record in enumerate(records):
        verdicts = [ANSWER.search(s).group(1) == record["gold"] for s in record["samples"]]
        assert record["samples_correct"] == verdicts and sum(verdicts) == i % 5
        assert record["correct"] == (i % 2 == 0)
        for k in expected:
            subsets = list(itertools.combinations(verdicts, k))
            expected[k] += sum(any(s) for s in subsets) / len(subsets) / 8
    metrics = json.loads((tmp_path / "reasoning_gym-basic_arithmetic_test.summary.json").read_text())["metrics"]
    assert metrics["eval/greedy_accuracy"] == pytest.approx(0.5)
    for k, value in expected.items():
        assert metrics[f"eval/pass@{k}"] == pytest.approx(value, abs=1e-12), k


def test_the_python_api_trains_on_the_helpers_rows_and_reward(tiny_dir, tmp_path):
    from cohort_grpo import GRPOConfig, GRPOTrainer
    from cohort_grpo.tasks.reasoning_gym import rows_and_reward

    dataset = reasoning_gym.create_dataset("basic_arithmetic", seed=1, size=16)
    rows, reward = rows_and_reward(dataset, system_prompt="")  # the tiny model's context: the question alone
    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=2, num_generations=2, per_device_train_batch_size=4,
                      gradient_accumulation_steps=1, max_completion_length=8, max_prompt_length=64, save_steps=0,
                      logging_steps=1, device="cpu", quiet=True, report_to="none")
    trainer = GRPOTrainer(tiny_dir, reward_funcs=[reward], train_dataset=rows, args=args)
    trainer.train()
    assert [r["step"] for r in trainer.history] == [1, 2]
    assert all(0.0 <= r["rewards/reasoning_gym_reward/mean"] <= 1.0 for r in trainer.history)


def test_a_curriculum_stage_can_be_a_reasoning_gym_task(capsys):
    from cohort_grpo import GRPOConfig
    from cohort_grpo.config.curriculum import parse_curriculum
    from cohort_grpo.tasks.curriculum import Curriculum

    args = GRPOConfig(curriculum=parse_curriculum("arithmetic:2,reasoning_gym:chain_sum:3")).validate()
    assert args.curriculum == [{"task": "arithmetic", "steps": 2}, {"task": "reasoning_gym:chain_sum", "steps": 3}]
    curriculum = Curriculum.from_config(args)
    switch = curriculum.enter(3, tokenizer=None)
    assert switch is not None and curriculum.task.name == "reasoning_gym:chain_sum"
    assert {r["source_dataset"] for r in switch.rows} == {"chain_sum"}
    # a misspelt stage stops the command before anything loads, not at its first step
    assert main(["train", "--curriculum", "arithmetic:2,reasoning_gym:chain_sums:3", "--max_steps", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown reasoning-gym task 'chain_sums' (close names: chain_sum" in err, err
