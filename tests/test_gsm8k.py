"""The GSM8K task (cohort_grpo/tasks/gsm8k.py): rows, gold answers, filtering, subsets, correctness."""

import json
from pathlib import Path

import pytest

from cohort_grpo.errors import CohortError
from cohort_grpo.rewards.rules import accuracy_reward, format_reward, tag_count_reward
from cohort_grpo.tasks.gsm8k import DATA_DIR_ENV, GSM8KTask, default_data_files, gold_number

# the main checkout's ../shared copy, found from this checkout or a git worktree beside it (any folder above)
SHARED = next((folder / "shared" / "data" / "gsm8k" for folder in Path(__file__).resolve().parents
               if (folder / "shared" / "data" / "gsm8k" / "test.jsonl").is_file()), None)
NO_SHARED = "no shared/data/gsm8k/ (the main checkout's ../shared copy of GSM8K) in any folder above this checkout"

ROWS = [
    {"question": "Tom has 3 boxes of 400 pens. How many pens?", "answer": "3*400=<<3*400=1200>>1200\n#### 1,200"},
    {"question": "Half of 9?", "answer": "9/2=<<9/2=4.5>>4.5\n#### 4.5"},
    {"question": "A long question " + "with many words " * 20 + "?", "answer": "It is 7.\n#### 7"},
    {"question": "What is 10 - 12?", "answer": "10-12=<<10-12=-2>>-2\n#### -2"},
]

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def rendered_prompt(messages):
    """The chat template above applied by hand: what a character tokenizer counts."""
    return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return str(path)


@pytest.fixture(scope="module")
def char_tokenizer():
    """One token per character, with a chat template: token counts equal string lengths."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    text = "".join(r["question"] + r["answer"] for r in ROWS) + GSM8KTask.system_prompt + CHAT_TEMPLATE
    vocab = {"<unk>": 0}
    for ch in sorted(set(text + "<>/abcdefghijklmnopqrstuvwxyz\n")):
        vocab.setdefault(ch, len(vocab))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")),
                                        unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def test_task_contract():
    task = GSM8KTask()
    assert task.name == "gsm8k"
    assert task.reward_funcs == [format_reward, tag_count_reward, accuracy_reward]
    assert task.reward_weights == [0.5, 0.5, 1.0]
    assert "<think>" in task.system_prompt and "<answer>" in task.system_prompt


def test_rows_from_a_file(data_file):
    rows = GSM8KTask().load("train", data_files=data_file)
    assert [r["solution"] for r in rows] == ["1200", "4.5", "7", "-2"]
    for row, raw in zip(rows, ROWS):
        assert row["question"] == raw["question"] and row["answer"] == raw["answer"]
        assert row["prompt"] == [{"role": "system", "content": GSM8KTask.system_prompt},
                                 {"role": "user", "content": raw["question"]}]


def test_gold_number():
    assert gold_number("work\n#### 1,000,000") == "1000000"
    with pytest.raises(CohortError, match="no '#### <number>' line"):
        gold_number("just text")


def test_token_length_filters(data_file, char_tokenizer):
    task = GSM8KTask()
    rows = task.load("train", data_files=data_file)
    prompt_lengths = [len(rendered_prompt(r["prompt"])) for r in rows]
    answer_lengths = [len(r["answer"]) for r in rows]
    assert len(char_tokenizer.apply_chat_template(rows[0]["prompt"], tokenize=True, add_generation_prompt=True)
               ["input_ids"]) == prompt_lengths[0]  # the tokenizer really is one token per character
    limit = sorted(prompt_lengths)[2]  # keeps the three shortest prompts
    kept = task.load("train", data_files=data_file, tokenizer=char_tokenizer, max_prompt_tokens=limit)
    assert [r["question"] for r in kept] == [r["question"] for r, n in zip(rows, prompt_lengths) if n <= limit]
    assert len(kept) == 3
    answer_limit = min(answer_lengths)
    kept = task.load("train", data_files=data_file, tokenizer=char_tokenizer, max_answer_tokens=answer_limit)
    assert [r["answer"] for r in kept] == [r["answer"] for r, n in zip(rows, answer_lengths) if n <= answer_limit]
    with pytest.raises(CohortError, match="raise those limits"):
        task.load("train", data_files=data_file, tokenizer=char_tokenizer, max_prompt_tokens=5)


def test_subset_is_deterministic_and_seeded(data_file):
    task = GSM8KTask()
    every = [r["question"] for r in task.load("train", data_files=data_file)]
    picks = {seed: [r["question"] for r in task.load("train", data_files=data_file, subset=2, seed=seed)]
             for seed in range(8)}
    for seed, chosen in picks.items():
        assert len(chosen) == 2 and chosen == sorted(chosen, key=every.index)  # file order kept
        assert chosen == [r["question"] for r in task.load("train", data_files=data_file, subset=2, seed=seed)]
    assert len({tuple(c) for c in picks.values()}) > 1  # the seed matters
    assert len(task.load("train", data_files=data_file, subset=100)) == len(ROWS)
    with pytest.raises(CohortError, match="positive number"):
        task.load("train", data_files=data_file, subset=0)


def test_is_correct_and_solved_completion(data_file):
    task = GSM8KTask()
    rows = task.load("train", data_files=data_file)
    assert task.is_correct("<think>\n3*400\n</think>\n<answer>\n1,200\n</answer>", rows[0])
    assert task.is_correct([{"role": "assistant", "content": "<answer>$1200.00</answer>"}], rows[0])
    assert task.is_correct("so it is \\boxed{\\frac{9}{2}}", rows[1])
    assert not task.is_correct("<answer>1201</answer>", rows[0])
    assert not task.is_correct("I give up", rows[3])
    for row in rows:
        completion = task.solved_completion(row)
        assert "<<" not in completion  # calculator notes removed
        assert format_reward(None, [completion]) == [1.0] and task.is_correct(completion, row)


@pytest.mark.parametrize("completion, follows", [
    ("<think>\nadd them\n</think>\n<answer>\n7\n</answer>", True),
    ([{"role": "assistant", "content": "<think>\nadd\n</think>\n<answer>\n7\n</answer><|im_end|>"}], True),
    ("<think>add</think><answer>7</answer>", False),  # the lenient layout is not the format `cohort-grpo eval` counts
    ("The answer is 7.", False),
    ("<think>\nx\n</think>\n<answer>\n7\n</answer>\n<answer>\n8\n</answer>", False),
])
def test_follows_format_is_the_strict_layout(completion, follows):
    assert GSM8KTask.follows_format(completion) is follows


def test_rows_missing_columns_and_bad_split(tmp_path):
    path = tmp_path / "other.jsonl"
    path.write_text(json.dumps({"problem": "x", "answer": "#### 1"}) + "\n")
    with pytest.raises(CohortError, match=r"row 0 has no \['question'\] column"):
        GSM8KTask().load("train", data_files=str(path))
    with pytest.raises(CohortError, match="gsm8k has splits"):
        GSM8KTask().load("dev")


@pytest.mark.skipif(SHARED is None, reason=NO_SHARED)
def test_default_files_and_real_test_split(monkeypatch):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    assert default_data_files("test") == str(SHARED / "test.jsonl")
    assert default_data_files("no_such_split") is None
    rows = GSM8KTask().load("test")  # no data_files: the shared copy
    assert len(rows) == 1319
    assert all(r["solution"].lstrip("-").replace(".", "", 1).isdigit() for r in rows)
    subset = GSM8KTask().load("test", subset=50, seed=1)
    assert len(subset) == 50 and all(r in rows for r in subset)


def test_hub_is_the_fallback_source(monkeypatch):
    import cohort_grpo.tasks.gsm8k as gsm8k

    calls = []

    def fake_hub(name, config, split):
        calls.append((name, config, split))
        return ROWS[:2]

    monkeypatch.setattr(gsm8k, "default_data_files", lambda split: None)
    monkeypatch.setattr(gsm8k, "load_hub_dataset", fake_hub)
    rows = GSM8KTask().load("test")
    assert calls == [("openai/gsm8k", "main", "test")]
    assert [r["solution"] for r in rows] == ["1200", "4.5"]

    def offline_hub(name, config, split):
        raise CohortError("could not load hub dataset 'openai/gsm8k': ConnectionError; pass a local file "
                          "with --data_files")

    monkeypatch.setattr(gsm8k, "load_hub_dataset", offline_hub)
    with pytest.raises(CohortError, match=r"^no local gsm8k 'train' file \(pass data_files=FILE, or set "
                                          r"COHORT_GSM8K_DIR to a folder holding train.jsonl\), and could not"):
        GSM8KTask().load("train")


def test_the_local_files_are_found_above_the_working_directory(tmp_path, monkeypatch):
    """A git worktree or an installed package: `shared/data/gsm8k` in the working directory or any folder above
    it; `COHORT_GSM8K_DIR` before it."""
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    shared = tmp_path / "shared" / "data" / "gsm8k"
    shared.mkdir(parents=True)
    test_file = _write_rows(shared / "test.jsonl", ROWS[:3])
    worktree = tmp_path / "wt" / "branch" / "sub"
    worktree.mkdir(parents=True)
    monkeypatch.chdir(worktree)
    assert default_data_files("test") == test_file
    assert [r["question"] for r in GSM8KTask().load("test")] == [r["question"] for r in ROWS[:3]]
    (tmp_path / "mine").mkdir()
    elsewhere = _write_rows(tmp_path / "mine" / "test.jsonl", ROWS[3:])
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "mine"))
    assert default_data_files("test") == elsewhere
    with pytest.raises(CohortError, match=rf"^{DATA_DIR_ENV}=.*mine holds no train.jsonl; point it to a folder with "
                                          r"GSM8K's train.jsonl and test.jsonl, or pass data_files=FILE$"):  # Python's words
        GSM8KTask().load("train")


def _write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_training_file_is_never_the_held_out_split(tmp_path, monkeypatch):
    """`--data_files` is training data; held-out rows come from --eval_data_files, else the task's own
    test split, else none (one line) — never from the training file."""
    import cohort_grpo.tasks.gsm8k as gsm8k
    from cohort_grpo.cli import task_rows
    from cohort_grpo.config.grpo_config import GRPOConfig

    train_file = _write_rows(tmp_path / "train.jsonl", ROWS[:2])
    eval_file = _write_rows(tmp_path / "eval.jsonl", ROWS[3:])
    args = GRPOConfig(task="gsm8k", data_files=train_file, eval_data_files=eval_file, eval_limit=10)
    train, held_out = task_rows(GSM8KTask(), args)
    assert [r["question"] for r in train] == [r["question"] for r in ROWS[:2]]
    assert [r["question"] for r in held_out] == [ROWS[3]["question"]]

    # no eval file and no test split anywhere: no held-out evaluation, said once
    monkeypatch.setattr(gsm8k, "default_data_files", lambda split: None)
    monkeypatch.setattr(gsm8k, "load_hub_dataset", lambda *a, **k: (_ for _ in ()).throw(CohortError("offline")))
    lines = []
    train, held_out = task_rows(GSM8KTask(), GRPOConfig(task="gsm8k", data_files=train_file), log=lines.append)
    assert held_out is None and len(train) == 2
    assert len(lines) == 1 and "--eval_data_files" in lines[0]


@pytest.mark.skipif(SHARED is None, reason=NO_SHARED)
def test_held_out_defaults_to_the_real_test_split_not_the_training_file(tmp_path):
    from cohort_grpo.cli import task_rows
    from cohort_grpo.config.grpo_config import GRPOConfig

    train_file = _write_rows(tmp_path / "train.jsonl", ROWS)
    _, held_out = task_rows(GSM8KTask(), GRPOConfig(task="gsm8k", data_files=train_file, eval_limit=5))
    test_questions = [r["question"] for r in GSM8KTask().load("test")[:5]]
    assert [r["question"] for r in held_out] == test_questions
