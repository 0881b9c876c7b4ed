"""Loading rows from local files (cohort_grpo/tasks/data.py) and its error messages."""

import json
import sys

import pytest

from cohort_grpo.errors import CohortError
from cohort_grpo.tasks.data import load_hub_dataset, load_rows

ROWS = [{"question": "1+1?", "answer": "#### 2"}, {"question": "2+2?", "answer": "#### 4"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_json_and_lists(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ROWS)
    b = write_jsonl(tmp_path / "b.jsonl", ROWS[:1])
    assert load_rows(str(a)) == ROWS
    assert load_rows([str(a), str(b)]) == ROWS + ROWS[:1]
    assert load_rows(str(tmp_path / "*.jsonl")) == ROWS + ROWS[:1]  # glob, sorted
    (tmp_path / "list.json").write_text(json.dumps(ROWS))
    assert load_rows(str(tmp_path / "list.json")) == ROWS
    columns = {"question": [r["question"] for r in ROWS], "answer": [r["answer"] for r in ROWS]}
    (tmp_path / "columns.json").write_text(json.dumps(columns))
    assert load_rows(str(tmp_path / "columns.json")) == ROWS
    (tmp_path / "lines.json").write_text(a.read_text())  # JSON Lines under a .json name
    assert load_rows(str(tmp_path / "lines.json")) == ROWS


def test_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text("\n" + json.dumps(ROWS[0]) + "\n\n   \n" + json.dumps(ROWS[1]) + "\n\n")
    assert load_rows(str(path)) == ROWS


def test_split_mapping(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    test = write_jsonl(tmp_path / "test.jsonl", ROWS[:1])
    files = {"train": str(train), "test": str(test)}
    assert load_rows(files, split="test") == ROWS[:1]
    assert load_rows({"train": str(train)}) == ROWS  # a single entry needs no split
    with pytest.raises(CohortError, match=r"splits \['test', 'train'\], not 'validation'"):
        load_rows(files, split="validation")


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + '{"question": "x", "answer": \n' + json.dumps(ROWS[1]) + "\n")
    with pytest.raises(CohortError, match=r"bad\.jsonl:3: not valid JSON"):
        load_rows(str(path))


def test_non_object_line(tmp_path):
    path = tmp_path / "list_line.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n[1, 2]\n")
    with pytest.raises(CohortError, match=r"list_line\.jsonl:2: a JSON list, not an object"):
        load_rows(str(path))


def test_missing_empty_and_wrong_extension(tmp_path):
    with pytest.raises(CohortError, match=r"nope\.jsonl' not found"):
        load_rows(str(tmp_path / "nope.jsonl"))
    with pytest.raises(CohortError, match="matches no file"):
        load_rows(str(tmp_path / "*.parquet"))
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(CohortError, match=r"empty\.jsonl' has no rows"):
        load_rows(str(tmp_path / "empty.jsonl"))
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(CohortError, match="has no rows"):
        load_rows(str(tmp_path / "empty.json"))
    (tmp_path / "data.txt").write_text("question,answer\n")
    with pytest.raises(CohortError, match=r"extension '\.txt'; use one of \['\.jsonl', '\.json', '\.parquet', '\.csv'\]"):
        load_rows(str(tmp_path / "data.txt"))
    with pytest.raises(CohortError, match="is a directory"):
        load_rows(str(tmp_path))
    (tmp_path / "broken.json").write_text('[{"a": 1},')
    with pytest.raises(CohortError, match=r"broken\.json:1: not valid JSON"):
        load_rows(str(tmp_path / "broken.json"))


def test_parquet(tmp_path):
    pyarrow = pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install -e '.[test]' installs it)")
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pyarrow.Table.from_pylist(ROWS), path)
    assert load_rows(str(path)) == ROWS


def test_parquet_without_pyarrow_is_an_error_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # makes `import pyarrow.parquet` fail
    path = tmp_path / "rows.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(CohortError, match="pip install pyarrow"):
        load_rows(str(path))


def test_hub_dataset_without_datasets_or_network_is_a_clear_error():
    # Either `datasets` is missing or there is no network here: both must end in a CohortError
    # that points at --data_files.
    with pytest.raises(CohortError, match="a local file with data_files"):
        load_hub_dataset("cohort-test/definitely-not-a-dataset", None, "train")
