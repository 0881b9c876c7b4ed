"""The built-in task: generated arithmetic problems with an exact verifier.

It needs no download, so `cohort-grpo train` runs anywhere. Difficulty is a level:

| level | problems |
| --- | --- |
| 1 | a + b, one digit each |
| 2 | two digits + one digit |
| 3 | two digits + two digits |
| 4 | two digits ± two digits (results may be negative) |
| 5 | three digits ± two digits |
| 6 | one digit × two digits |
"""

from __future__ import annotations

import random
import re

from cohort_grpo.errors import CohortError

PROMPT_TEMPLATE = "{question}=? Reply <answer>N</answer>\n"
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
LEVELS = (1, 2, 3, 4, 5, 6)


def make_problem(level: int, rng: random.Random) -> tuple[str, int]:
    """One problem of a difficulty level: (question text, exact answer)."""

    def num(digits: int) -> int:
        return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)

    if level == 1:
        a, b, op = num(1), num(1), "+"
    elif level == 2:
        a, b, op = num(2), num(1), "+"
    elif level == 3:
        a, b, op = num(2), num(2), "+"
    elif level == 4:
        a, b, op = num(2), num(2), rng.choice("+-")
    elif level == 5:
        a, b, op = num(3), num(2), rng.choice("+-")
    elif level == 6:
        a, b, op = num(1), num(2), "*"
    else:
        raise CohortError(f"arithmetic level {level} does not exist; choose one of {list(LEVELS)}")
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a}{op}{b}", value


def extract_answer(completion: str) -> str | None:
    """The text inside the first <answer>…</answer>, stripped; None when the tags are missing."""
    match = ANSWER_RE.search(completion)
    return match.group(1).strip() if match else None


SPLIT_OFFSETS = {"train": 0, "test": 1_000_003, "validation": 2_000_003}


def split_random(task: str, split: str, seed: int) -> random.Random:
    """The random stream a generated task draws `split` from: disjoint streams per split, train's following the
    run's seed and the held-out splits' not (every run is judged on the same problems)."""
    offset = SPLIT_OFFSETS.get(split)
    if offset is None:
        raise CohortError(f"{task} has splits train/test/validation, not {split!r}")
    return random.Random((seed if split == "train" else 0) * 7919 + offset)


def answer_reward(prompts, completions, completion_ids=None, *, solution, **_) -> list[float]:
    """1.0 when the <answer> content equals the exact integer answer, else 0.0."""
    rewards = []
    for completion, gold in zip(completions, solution):
        answer = extract_answer(_text(completion))
        rewards.append(1.0 if answer is not None and answer == str(gold) else 0.0)
    return rewards


def _text(completion) -> str:
    if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
        return completion[-1]["content"]
    return completion


class ArithmeticTask:
    name = "arithmetic"
    # `cohort-grpo train --task arithmetic` (the task of a bare `cohort-grpo train`) starts from these, under any
    # YAML or flag: the tiny model, trained on unseen level-3 problems (its short warm start leaves it
    # at ~40% there; the test problems are never trained on).
    default_config = dict(
        levels="3", num_generations=8, per_device_train_batch_size=64, gradient_accumulation_steps=1,
        max_completion_length=8, max_prompt_length=64, learning_rate=2e-5, beta=0.04, ref_reset_steps=50,
        max_steps=600, temperature=1.0, eval_limit=200, output_dir="runs/arithmetic", seed=0,
        logging_steps=10, log_completions_steps=100,
    )
    reads_data = False  # it generates its problems: --data_files / --dataset_name do not apply
    system_prompt = None
    reward_funcs = [answer_reward]
    reward_weights = [1.0]
    extract_answer = staticmethod(extract_answer)

    def load(self, split: str = "train", *, levels=(3,), size: int = 2000, seed: int = 0, **_) -> list[dict]:
        """Rows {prompt, solution, level}. Train and test draw from disjoint random streams, and
        test problems are removed from train so held-out accuracy is honest."""
        levels = _parse_levels(levels)
        rng = split_random("arithmetic", split, seed)
        held_out = set() if split != "train" else {r["question"] for r in self.load("test", levels=levels, size=1000)}
        rows, attempts = [], 0
        while len(rows) < size and attempts < size * 50:
            attempts += 1
            level = rng.choice(levels)
            question, value = make_problem(level, rng)
            if question in held_out:
                continue
            rows.append({"prompt": PROMPT_TEMPLATE.format(question=question), "solution": str(value),
                         "question": question, "level": level})
        return rows

    def is_correct(self, completion: str, row: dict) -> bool:
        return answer_reward(None, [completion], solution=[row["solution"]])[0] == 1.0

    @staticmethod
    def solved_completion(row: dict) -> str:
        """The reference completion the SFT warm start imitates."""
        return f"<answer>{row['solution']}</answer>"


def _parse_levels(levels) -> tuple[int, ...]:
    if isinstance(levels, int):
        levels = (levels,)
    if isinstance(levels, str):
        try:
            levels = tuple(int(x) for x in levels.split(",") if x.strip())
        except ValueError:
            raise CohortError(f"arithmetic levels must be integers like '1,2', got {levels!r}") from None
    bad = [lv for lv in levels if lv not in LEVELS]
    if bad or not levels:
        raise CohortError(f"arithmetic level(s) {bad or levels} do not exist; choose from {list(LEVELS)}")
    return tuple(levels)
