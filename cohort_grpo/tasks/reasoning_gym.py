"""reasoning-gym's procedural tasks: `--task reasoning_gym:NAME` or a mixture `reasoning_gym:A:2,B:1`.

reasoning-gym (PyPI `reasoning-gym`, the `envs` extra) generates problems from a seed and scores answers with
each dataset's own `score_answer(answer, entry)`, 1.0 for a right answer and partial credit for some near
misses. This task asks in reasoning-gym's own layout (its `default` system prompt: reason, then the answer
alone in `<answer>…</answer>`), reads the answer with reasoning-gym's extractor (the last `<answer>` block) and
rewards:

- `score_reward` (weight 1.0): the dataset's `score_answer` on the extracted answer (0.0 without one);
- `answer_format_reward` (weight 0.2): 1.0 when the completion ends with its one `<answer>…</answer>` block.

The held-out split never meets training: a question is held out when its SHA-256 falls in one bucket of
`HELD_OUT_BUCKETS` (so a question is on one side at any size of either split), and the two sides draw from
different ranges of reasoning-gym seeds besides. Held-out accuracy counts a completion correct when its
score is 1.0.

A mixture `A:2,B:1` draws each row's dataset by weight (a name without `:W` weighs 1). Outside cohort's
own trainer, `rows_and_reward(dataset)` turns any reasoning-gym dataset (a composite one too) into
TRL-style rows and a reward function (docs/howto/real-tasks.md).
"""

from __future__ import annotations

import difflib
import hashlib
import random
import re

from cohort_grpo.errors import CohortError
from cohort_grpo.rewards.completions import ANSWER_CLOSE, ANSWER_OPEN, completion_text

FAMILY = "reasoning_gym"
HELD_OUT_BUCKETS = 8  # one question in 8 is held out
SEED_BLOCK = 10**7  # reasoning-gym seeds an item with (dataset seed + index): a run's block of seeds
HELD_OUT_SEEDS = {"test": 0, "validation": SEED_BLOCK}  # fixed: every run is judged on the same questions
TRAIN_SEEDS = (2 * SEED_BLOCK, 2**32 - SEED_BLOCK)  # [start, end) of the training blocks; numpy seeds stay < 2**32
MAX_ROWS = SEED_BLOCK // (2 * HELD_OUT_BUCKETS)  # rows a split can draw within its block of seeds
SYSTEM_PROMPT_NAME = "default"  # the key of reasoning-gym's SYSTEM_PROMPTS this task asks with
MAX_MISSES = 64 * HELD_OUT_BUCKETS  # items in a row on the other side of the split before giving up


def import_reasoning_gym():
    """The `reasoning_gym` package; without it, one line naming the package and the extra that brings it."""
    try:
        import reasoning_gym
    except ImportError:
        raise CohortError('the reasoning_gym tasks need the reasoning-gym package, which is not installed: '
                          'pip install "cohort-grpo[envs]" (or pip install reasoning-gym)') from None
    return reasoning_gym


def parse_mixture(spec: str, known) -> list[tuple[str, float]]:
    """`A`, `A,B` or `A:2,B:1` → [(name, weight)]; an unknown name is one line listing the close ones."""
    if not spec or not spec.strip():
        raise CohortError("--task reasoning_gym needs the task's name: --task reasoning_gym:leg_counting "
                          "(or a mixture, reasoning_gym:leg_counting:2,basic_arithmetic:1)")
    mixture = []
    for part in (p.strip() for p in spec.split(",")):
        name, _, weight_text = part.partition(":")
        name = name.strip()
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=5, cutoff=0.6)
            hint = f"close names: {', '.join(close)}" if close else f"none is close among its {len(known)} tasks"
            raise CohortError(f"unknown reasoning-gym task {name!r} ({hint}); list them with python -c \"import "
                              "reasoning_gym; print(sorted(reasoning_gym.factory.DATASETS))\" (--task)")
        try:
            weight = float(weight_text) if weight_text.strip() else 1.0
        except ValueError:
            weight = -1.0
        if not weight > 0 or weight == float("inf"):
            raise CohortError(f"reasoning-gym task {name}: weight {weight_text!r} is not a positive number; "
                              "write NAME:WEIGHT, e.g. --task reasoning_gym:leg_counting:2,basic_arithmetic:1")
        if name in [n for n, _ in mixture]:
            raise CohortError(f"reasoning-gym task {name} appears twice in {spec!r}; name each task once")
        mixture.append((name, weight))
    return mixture


def is_held_out(question: str) -> bool:
    """Whether a question belongs to the held-out side (its SHA-256 in bucket 0 of `HELD_OUT_BUCKETS`)."""
    return hashlib.sha256(question.encode("utf-8")).digest()[0] % HELD_OUT_BUCKETS == 0


def dataset_seed(split: str, seed: int) -> int:
    """The reasoning-gym seed of a split: the held-out splits' fixed blocks, else the run seed's training block."""
    if split in HELD_OUT_SEEDS:
        return HELD_OUT_SEEDS[split]
    if split != "train":
        raise CohortError(f"reasoning-gym tasks have splits train/test/validation, not {split!r}")
    start, end = TRAIN_SEEDS
    return start + (int(seed) * SEED_BLOCK) % (end - start - SEED_BLOCK)


def extract_answer(completion) -> str | None:
    """The answer as reasoning-gym reads it: the last `<answer>…</answer>` block, stripped; None without one."""
    from reasoning_gym.utils import extract_answer as last_answer_block

    return last_answer_block(completion_text(completion))


_TAG = re.compile(re.escape(ANSWER_OPEN) + "|" + re.escape(ANSWER_CLOSE))


def follows_format(completion) -> bool:
    """The layout reasoning-gym's prompt asks for: one `<answer>…</answer>` block, nothing but space after it."""
    text = completion_text(completion)
    tags = _TAG.findall(text)
    return tags == [ANSWER_OPEN, ANSWER_CLOSE] and text.rstrip().endswith(ANSWER_CLOSE)


def answer_format_reward(prompts, completions, completion_ids=None, **_) -> list[float]:
    """1.0 when a completion ends with its one `<answer>…</answer>` block (`follows_format`), else 0.0."""
    return [1.0 if follows_format(completion) else 0.0 for completion in completions]


def score(dataset, completion, entry: dict) -> float:
    """reasoning-gym's own score of a completion's answer: `dataset.score_answer(answer, entry)`, as a float."""
    return float(dataset.score_answer(extract_answer(completion), entry))


def make_score_reward(datasets: dict):
    """The correctness reward over rows with an `entry` column (a reasoning-gym item): each completion scored by
    the dataset its entry came from (`datasets`: name → dataset, by the entry's `metadata.source_dataset`)."""

    def score_reward(prompts, completions, completion_ids=None, *, entry, **_) -> list[float]:
        return [score(datasets[item["metadata"]["source_dataset"]], completion, item)
                for completion, item in zip(completions, entry)]

    return score_reward


def chat_prompt(question: str, system_prompt: str | None) -> list[dict]:
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*system, {"role": "user", "content": question}]


def default_system_prompt() -> str:
    """reasoning-gym's own system prompt (`SYSTEM_PROMPTS["default"]`): reason, then the answer in tags."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS[SYSTEM_PROMPT_NAME]


def rows_and_reward(dataset, system_prompt: str | None = None) -> tuple[list[dict], object]:
    """TRL-style rows from a reasoning-gym dataset and a reward function that scores with it:
    `GRPOTrainer(train_dataset=rows, reward_funcs=[reward])`. Each row is {prompt (chat messages with
    reasoning-gym's system prompt, or `system_prompt`), question, solution, entry_index}; the reward reads
    `entry_index` to find the item again (`dataset[entry_index]`: reasoning-gym's items are a function of
    their index), so the rows hold only plain values and fit a `datasets.Dataset`."""
    system_prompt = default_system_prompt() if system_prompt is None else system_prompt
    rows = []
    for index in range(len(dataset)):
        entry = dataset[index]
        rows.append({"prompt": chat_prompt(entry["question"], system_prompt), "question": entry["question"],
                     "solution": str(entry["answer"]), "entry_index": index})

    def reasoning_gym_reward(prompts=None, completions=None, completion_ids=None, *, entry_index, **_) -> list[float]:
        return [score(dataset, completion, dataset[int(index)]) for completion, index in zip(completions, entry_index)]

    return rows, reasoning_gym_reward


class ReasoningGymTask:
    """`--task reasoning_gym:NAME[:WEIGHT],…`: reasoning-gym's generators as a cohort task (see the module)."""

    # `cohort-grpo train --task reasoning_gym:NAME` starts from these (as gsm8k does: an instruct model that
    # reasons at some length), under any YAML or flag.
    default_config = dict(
        num_generations=8, per_device_train_batch_size=64, gradient_accumulation_steps=1, max_completion_length=512,
        learning_rate=1e-6, beta=0.04, temperature=1.0, max_steps=200, eval_steps=50, eval_limit=200,
        output_dir="runs/reasoning_gym",
    )
    reads_data = False  # it generates its problems: --data_files / --dataset_name do not apply
    reward_weights = [1.0, 0.2]
    extract_answer = staticmethod(extract_answer)
    follows_format = staticmethod(follows_format)

    def __init__(self, spec: str = ""):
        reasoning_gym = import_reasoning_gym()
        self.mixture = parse_mixture(spec, reasoning_gym.factory.DATASETS)
        self.name = f"{FAMILY}:{spec.replace(' ', '')}"
        self.system_prompt = default_system_prompt()
        # score_answer depends on a dataset's config, not its seed: one scoring instance per task
        self.scorers = {name: reasoning_gym.create_dataset(name, seed=0, size=1) for name, _ in self.mixture}
        self.reward_funcs = [make_score_reward(self.scorers), answer_format_reward]

    def load(self, split: str = "train", *, size: int = 2000, seed: int = 0, **_) -> list[dict]:
        """`size` rows {prompt (system + user messages), question, solution, source_dataset, entry}: each row's
        task drawn by weight, its item the next of that task's generator (seeded by `dataset_seed`) that falls
        on this split's side of `is_held_out`."""
        if not isinstance(size, int) or not 1 <= size <= MAX_ROWS:
            raise CohortError(f"{self.name}: size must be a whole number of rows from 1 to {MAX_ROWS}, got {size!r}")
        base = dataset_seed(split, seed)
        held_out = split != "train"
        reasoning_gym = import_reasoning_gym()
        generators = {name: reasoning_gym.create_dataset(name, seed=base, size=SEED_BLOCK) for name, _ in self.mixture}
        next_index = {name: 0 for name, _ in self.mixture}
        names, weights = [n for n, _ in self.mixture], [w for _, w in self.mixture]
        choice = random.Random(base)
        rows = []
        while len(rows) < size:
            name = choice.choices(names, weights)[0] if len(names) > 1 else names[0]
            entry = self._next_entry(generators[name], next_index, name, held_out)
            rows.append({"prompt": chat_prompt(entry["question"], self.system_prompt), "question": entry["question"],
                         "solution": str(entry["answer"]), "source_dataset": name, "entry": entry})
        return rows

    def _next_entry(self, generator, next_index: dict, name: str, held_out: bool) -> dict:
        """The next item of `generator` on the wanted side of the split (`next_index[name]` moves past it)."""
        for _ in range(MAX_MISSES):
            index = next_index[name]
            next_index[name] += 1
            entry = generator[index]
            if is_held_out(entry["question"]) == held_out:
                return entry
        side = "held-out" if held_out else "training"
        raise CohortError(f"{self.name}: reasoning-gym task {name} gave {MAX_MISSES} questions in a row that are not "
                          f"on the {side} side of the split (too few distinct questions); mix in another task")

    def is_correct(self, completion, row: dict) -> bool:
        return score(self.scorers[row["source_dataset"]], completion, row["entry"]) == 1.0

    @staticmethod
    def solved_completion(row: dict) -> str:
        """A completion in the rewarded layout with the right answer (a supervised warm start's target)."""
        return f"{ANSWER_OPEN}{row['solution']}{ANSWER_CLOSE}"
