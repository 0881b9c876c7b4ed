"""Your own data from the command line, as `trl grpo` takes it: `--data_files` (JSONL, JSON, parquet,
CSV) or `--dataset_name`, any prompt column (`--prompt_column`), the other columns passed to
`--reward_funcs module:function` as keywords; without `--task` that is the generic task, which has no
verifier and so no held-out evaluation (one line says so)."""

from __future__ import annotations

import csv
import json
import sys
import textwrap
from pathlib import Path

import pytest

from cohort_grpo.cli import main, task_rows
from cohort_grpo.config.command_line import resolve_config
from cohort_grpo.errors import CohortError
from cohort_grpo.tasks import get_task
from cohort_grpo.tasks.data import load_rows

ROWS = [{"question": "1+2=", "target": "3", "level": "easy"},
        {"question": "2+2=", "target": "4", "level": "easy"},
        {"question": "3+4=", "target": "7", "level": "hard"},
        {"question": "5+1=", "target": "6", "level": "hard"}]

# A reward module the test writes next to the data, imported by `--reward_funcs rewards_under_test:...`
# from the current directory; it records what it was called with.
REWARD_MODULE = textwrap.dedent('''
    import json
    from pathlib import Path

    CALLS = Path(__file__).with_name("calls.jsonl")


    def has_target(prompts, completions, completion_ids=None, *, target, level, **_):
        with CALLS.open("a") as f:
            f.write(json.dumps({"prompts": prompts, "target": target, "level": level,
                                "n": len(completions)}) + "\\n")
        return [1.0 if t in c else 0.0 for c, t in zip(completions, target)]
''')


def write_rows(path: Path, rows=ROWS) -> str:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return str(path)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A current directory holding the reward module; sys.path and sys.modules restored afterwards."""
    (tmp_path / "rewards_under_test.py").write_text(REWARD_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "rewards_under_test", raising=False)
    yield tmp_path
    sys.modules.pop("rewards_under_test", None)


SMALL = ["--num_generations", "2", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
         "--max_completion_length", "3", "--max_prompt_length", "32", "--max_steps", "2", "--save_steps", "0",
         "--device", "cpu", "--quiet", "--logging_steps", "1", "--learning_rate", "1e-4"]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_train_on_a_file_with_a_reward_module_end_to_end(workdir, tiny_dir, capsys, suffix):
    data = write_rows(workdir / f"rows{suffix}")
    out = workdir / "run"
    code = main(["train", "--model", tiny_dir, "--data_files", data, "--prompt_column", "question",
                 "--reward_funcs", "rewards_under_test:has_target", "--output_dir", str(out), *SMALL])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    skipped = [line for line in captured.out.splitlines() if line.startswith("no held-out evaluation")]
    assert len(skipped) == 1 and "no verifier" in skipped[0]
    calls = [json.loads(line) for line in (workdir / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 2  # one batch call per step
    by_prompt = {r["question"]: r for r in ROWS}
    for call in calls:
        assert call["n"] == 4
        for prompt, target, level in zip(call["prompts"], call["target"], call["level"]):
            assert by_prompt[prompt]["target"] == target and by_prompt[prompt]["level"] == level
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("rewards/has_target/mean" in m for m in metrics)
    assert not any("eval/accuracy" in m for m in metrics)
    (state,) = list(out.glob("checkpoint-*/trainer_state.json"))
    recorded = json.loads(state.read_text())["config"]  # the resolved configuration
    assert recorded["task"] == "generic" and recorded["prompt_column"] == "question"
    assert recorded["data_files"] == data and recorded["reward_funcs"] == ["rewards_under_test:has_target"]
    assert recorded["max_steps"] == 2 and recorded["output_dir"] == str(out)


def test_the_same_run_from_yaml(workdir, tiny_dir, capsys):
    data = write_rows(workdir / "rows.jsonl")
    (workdir / "run.yaml").write_text(f"data_files: {data}\nprompt_column: question\n"
                                      "reward_funcs: [rewards_under_test:has_target]\n")
    assert main(["train", "--config", "run.yaml", "--model", tiny_dir, "--output_dir", str(workdir / "run"),
                 *SMALL]) == 0, capsys.readouterr().err
    assert len((workdir / "calls.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_every_format_gives_the_same_rows(tmp_path, suffix):
    rows = get_task("generic").load("train", data_files=write_rows(tmp_path / f"rows{suffix}"),
                                    prompt_column="question")
    assert rows == [{"prompt": r["question"], "target": r["target"], "level": r["level"]} for r in ROWS]


def test_parquet_gives_the_same_rows(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    rows = get_task("generic").load("train", data_files=str(path), prompt_column="question")
    assert [r["prompt"] for r in rows] == [r["question"] for r in ROWS]


def test_csv_cells_are_text_and_quoted_commas_survive(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text('prompt,solution\n"Add 1, 2",3\nplain,"4"\n')
    assert load_rows(str(path)) == [{"prompt": "Add 1, 2", "solution": "3"}, {"prompt": "plain", "solution": "4"}]
    path.write_text("prompt,solution\nAdd 1, 2,3\n")
    with pytest.raises(CohortError, match=r"rows.csv:2: this row has 3 cells where the header has 2 columns"):
        load_rows(str(path))


def test_comma_separated_files_are_concatenated(tmp_path):
    a, b = write_rows(tmp_path / "a.jsonl", ROWS[:2]), write_rows(tmp_path / "b.csv", ROWS[2:])
    assert load_rows(f"{a},{b}") == ROWS


def test_a_missing_prompt_column_names_the_columns_and_the_option(tmp_path):
    data = write_rows(tmp_path / "rows.jsonl")
    with pytest.raises(CohortError, match=r"row 0 has no 'prompt' column \(columns: \['level', 'question', 'target'\]\)"
                                          r"; name the prompt column with prompt_column=NAME"):
        get_task("generic").load("train", data_files=data)


def test_hub_dataset_by_name(monkeypatch):
    import cohort_grpo.tasks.generic as generic

    asked = []

    def fake_hub(name, config, split):
        asked.append((name, config, split))
        return [dict(r) for r in ROWS]

    monkeypatch.setattr(generic, "load_hub_dataset", fake_hub)
    args, _ = resolve_config(["--dataset_name", "org/rows", "--dataset_config", "main", "--dataset_train_split",
                              "train[:50%]", "--prompt_column", "question", "--reward_funcs", "accuracy"])
    assert args.task == "generic"
    lines = []
    train, held_out = task_rows(get_task(args.task), args, log=lines.append)
    assert asked == [("org/rows", "main", "train[:50%]")]
    assert [r["prompt"] for r in train] == [r["question"] for r in ROWS] and held_out is None
    assert len(lines) == 1 and "no verifier" in lines[0]


def test_a_task_reads_the_hub_dataset_too(monkeypatch):
    import cohort_grpo.tasks.gsm8k as gsm8k

    asked = []

    def fake_hub(name, config, split):
        asked.append((name, config, split))
        return [{"question": f"q{split}", "answer": "#### 1"}]

    monkeypatch.setattr(gsm8k, "load_hub_dataset", fake_hub)
    args, _ = resolve_config(["--task", "gsm8k", "--dataset_name", "me/gsm8k-copy", "--dataset_config", "main",
                              "--dataset_test_split", "validation"])
    train, held_out = task_rows(get_task("gsm8k"), args)
    assert asked == [("me/gsm8k-copy", "main", "train"), ("me/gsm8k-copy", "main", "validation")]
    assert train[0]["question"] == "qtrain" and held_out[0]["question"] == "qvalidation"


@pytest.mark.parametrize("argv, words", [
    (["--data_files", "rows.jsonl"], ["no reward functions", "--reward_funcs", "module:function"]),
    (["--task", "generic", "--reward_funcs", "accuracy"], ["pass --data_files FILE", "--dataset_name"]),
    (["--task", "arithmetic", "--data_files", "rows.jsonl"], ["arithmetic generates its problems", "leave out --task"]),
    (["--task", "gsm8k", "--prompt_column", "q"], ["--prompt_column q applies to your own rows"]),
    (["--data_files", "a.jsonl", "--dataset_name", "org/x", "--reward_funcs", "accuracy"], ["pass only one"]),
    (["--data_files", "nope.jsonl", "--reward_funcs", "accuracy"], ["data file 'nope.jsonl' not found"]),
])
def test_data_mistakes_are_one_line(tmp_path, monkeypatch, capsys, argv, words):
    monkeypatch.chdir(tmp_path)
    write_rows(tmp_path / "rows.jsonl")
    assert main(["train", "--output_dir", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("cohort: error: "), err
    for word in words:
        assert word in err, err
    assert not (tmp_path / "out").exists()


def test_docs_describe_the_reward_module_workflow():
    page = (Path(__file__).resolve().parents[1] / "docs" / "howto" / "data.md").read_text(encoding="utf-8")
    for words in ("--data_files", "--dataset_name", "--prompt_column", "--reward_funcs my_rewards:exact_match",
                  ".csv", "generic", "no verifier"):
        assert words in page, words
