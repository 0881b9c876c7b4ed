"""GSM8K: grade-school math word problems with a numeric answer (Cobbe et al. 2021, "Training
Verifiers to Solve Math Word Problems"; hub id `openai/gsm8k`, config `main`: 7,473 train / 1,319 test).

Each reference `answer` is a worked solution whose last line is `#### <number>`; the number (commas
removed) becomes the `solution` column that `accuracy_reward` checks. The model is asked to reason in
`<think>` tags and answer in `<answer>` tags (the DeepSeek-R1 layout), which `format_reward` and
`tag_count_reward` reward.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
from collections.abc import Mapping
from pathlib import Path

from cohort_grpo.errors import CohortError
from cohort_grpo.rewards.rules import accuracy_reward, format_reward, tag_count_reward
from cohort_grpo.tasks.data import load_hub_dataset, load_rows

HUB_ID, HUB_CONFIG = "openai/gsm8k", "main"
SPLITS = ("train", "test")

SYSTEM_PROMPT = (
    "You solve grade-school math word problems. Think through the problem step by step inside "
    "<think> and </think> tags, then write only the final number inside <answer> and </answer> tags, "
    "laid out exactly like this:\n<think>\nyour reasoning\n</think>\n<answer>\nthe number\n</answer>"
)

_CALCULATOR_NOTE = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations: "2*3=<<2*3=6>>6"


def gold_number(answer: str) -> str:
    """The final answer after `####` in a GSM8K reference solution, commas removed ("1,000" → "1000")."""
    if "####" not in answer:
        raise CohortError(f"GSM8K answer {answer[-80:]!r} has no '#### <number>' line; is this GSM8K data?")
    return answer.split("####")[-1].strip().replace(",", "")


DATA_DIR_ENV = "COHORT_GSM8K_DIR"  # a folder holding train.jsonl and test.jsonl
SHARED_DATA = Path("shared") / "data" / "gsm8k"


def default_data_dir() -> Path | None:
    """The folder of GSM8K's local split files: `$COHORT_GSM8K_DIR` when set; else the first `shared/data/gsm8k`
    in the working directory or a folder above it, then in this package's folder or one above it (a checkout's
    `../shared`, also from a git worktree beside the checkout); None when there is none."""
    given = os.environ.get(DATA_DIR_ENV)
    if given:
        return Path(given).expanduser()
    starts = [Path(__file__).resolve().parent]
    with contextlib.suppress(OSError):  # a working directory that was deleted
        starts.insert(0, Path.cwd())
    for start in starts:
        for folder in (start, *start.parents):
            if (folder / SHARED_DATA).is_dir():
                return folder / SHARED_DATA
    return None


def default_data_files(split: str) -> str | None:
    """`<default_data_dir()>/<split>.jsonl` when it is there, else None; a `$COHORT_GSM8K_DIR` without it is a
    one-line `CohortError` (the variable was set to be used)."""
    folder = default_data_dir()
    path = None if folder is None else folder / f"{split}.jsonl"
    if path is not None and path.is_file():
        return str(path)
    if os.environ.get(DATA_DIR_ENV):
        raise CohortError(f"{DATA_DIR_ENV}={os.environ[DATA_DIR_ENV]} holds no {split}.jsonl; point it to a folder "
                          f"with GSM8K's train.jsonl and test.jsonl, or pass --data_files FILE")
    return None


class GSM8KTask:
    name = "gsm8k"
    # `cohort-grpo train --task gsm8k` starts from these, under any YAML or flag (docs/howto/gsm8k.md's recipe).
    default_config = dict(
        num_generations=8, per_device_train_batch_size=64, gradient_accumulation_steps=1, max_completion_length=512,
        learning_rate=1e-6, beta=0.04, temperature=1.0, max_steps=200, eval_steps=50, eval_limit=200,
        output_dir="runs/gsm8k",
    )
    system_prompt = SYSTEM_PROMPT
    reward_funcs = [format_reward, tag_count_reward, accuracy_reward]
    reward_weights = [0.5, 0.5, 1.0]

    def load(self, split: str = "train", data_files=None, subset: int | None = None, tokenizer=None,
             max_prompt_tokens: int | None = None, max_answer_tokens: int | None = None, seed: int = 0,
             dataset_name: str | None = None, dataset_config: str | None = None, **_) -> list[dict]:
        """Rows {prompt, solution, question, answer}; `prompt` is [system, user] chat messages.

        Source: `data_files` when given; else the hub dataset `dataset_name` (config `dataset_config`)
        when given; else `<split>.jsonl` in `default_data_dir()` when present (no network needed); else the
        hub dataset `openai/gsm8k`. With a `tokenizer`, rows whose prompt (chat template applied)
        exceeds `max_prompt_tokens` or whose reference answer exceeds `max_answer_tokens` are dropped.
        `subset=N` then keeps N rows chosen by `seed`, in file order."""
        if split not in SPLITS and data_files is None and dataset_name is None:
            raise CohortError(f"gsm8k has splits {list(SPLITS)}, not {split!r}")
        if data_files is None and dataset_name is None:
            data_files = default_data_files(split)
        if data_files is not None:
            raw, source = load_rows(data_files, split=split), str(data_files)
        elif dataset_name is not None:
            raw, source = load_hub_dataset(dataset_name, dataset_config, split), dataset_name
        else:
            try:
                raw, source = load_hub_dataset(HUB_ID, HUB_CONFIG, split), HUB_ID
            except CohortError as e:
                raise CohortError(f"no local gsm8k {split!r} file (pass --data_files FILE, or set {DATA_DIR_ENV} to a "
                                  f"folder holding {split}.jsonl), and {e}") from None
        rows = [self._row(r, i, source) for i, r in enumerate(raw)]
        if tokenizer is not None and (max_prompt_tokens or max_answer_tokens):
            rows = [r for r in rows
                    if (not max_prompt_tokens or _prompt_tokens(tokenizer, r["prompt"]) <= max_prompt_tokens)
                    and (not max_answer_tokens or _text_tokens(tokenizer, r["answer"]) <= max_answer_tokens)]
            if not rows:
                raise CohortError(f"no gsm8k {split!r} row fits max_prompt_tokens={max_prompt_tokens} / "
                                  f"max_answer_tokens={max_answer_tokens}; raise those limits")
        if subset is not None:
            if int(subset) < 1:
                raise CohortError(f"gsm8k subset must be a positive number of rows, got {subset!r}")
            if subset < len(rows):
                keep = sorted(random.Random(seed).sample(range(len(rows)), int(subset)))
                rows = [rows[i] for i in keep]
        return rows

    def _row(self, raw: dict, index: int, source: str) -> dict:
        missing = [c for c in ("question", "answer") if c not in raw]
        if missing:
            raise CohortError(f"{source}: row {index} has no {missing} column (it has {sorted(raw)}); GSM8K "
                              "rows need 'question' and 'answer'")
        answer = str(raw["answer"])
        row = dict(raw)
        row.update(prompt=[{"role": "system", "content": self.system_prompt},
                           {"role": "user", "content": str(raw["question"])}],
                   solution=gold_number(answer), question=str(raw["question"]), answer=answer)
        return row

    @staticmethod
    def follows_format(completion) -> bool:
        """The strict DeepSeek-R1 layout that `format_reward` rewards (`cohort-grpo eval`'s format rate)."""
        return format_reward(None, [completion])[0] == 1.0

    def is_correct(self, completion, row: dict) -> bool:
        return accuracy_reward(None, [completion], solution=[row["solution"]])[0] == 1.0

    @staticmethod
    def solved_completion(row: dict) -> str:
        """The reference solution in the rewarded layout, for a supervised warm start: the worked
        steps (calculator notes removed) as thinking, the gold number as answer."""
        steps = _CALCULATOR_NOTE.sub("", row["answer"].split("####")[0]).strip()
        return f"<think>\n{steps}\n</think>\n<answer>\n{row['solution']}\n</answer>"


def _token_ids(encoded) -> list:
    """Token ids from what a tokenizer call returned: a list, or a mapping with `input_ids`."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):  # batched: one sequence
        encoded = encoded[0]
    return list(encoded)


def _text_tokens(tokenizer, text: str) -> int:
    try:
        return len(_token_ids(tokenizer.encode(text, add_special_tokens=False)))
    except TypeError:  # a tokenizer without add_special_tokens
        return len(_token_ids(tokenizer.encode(text)))


def _prompt_tokens(tokenizer, messages: list[dict]) -> int:
    """Tokens the model sees for the prompt: the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        return len(_token_ids(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)))
    return _text_tokens(tokenizer, "\n".join(m["content"] for m in messages))
