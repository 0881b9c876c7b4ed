"""Loading dataset rows: local JSON Lines / JSON / Parquet / CSV files, or a Hugging Face Hub dataset.

Rows are plain dicts (one per example), the shape every task's `load` returns. Errors name the file
(and for JSON Lines the line number) and the fix, as `CohortError`.
"""

from __future__ import annotations

import csv
import glob
import json
from pathlib import Path

from cohort_grpo.errors import CohortError

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


def load_rows(data_files: str | list[str] | dict[str, str], split: str | None = None) -> list[dict]:
    """All rows of the given files, in order.

    `data_files` is a path, a glob (`data/*.jsonl`), comma-separated paths (`a.jsonl,b.jsonl`), a list
    of them, or a mapping split → path(s) as in `datasets.load_dataset(data_files=...)`; with a mapping,
    `split` picks the entry (it may be left out when the mapping has a single entry)."""
    if isinstance(data_files, dict):
        if split is None and len(data_files) == 1:
            split = next(iter(data_files))
        if split not in data_files:
            raise CohortError(f"data_files has splits {sorted(data_files)}, not {split!r}; "
                              "add that split to --data_files or choose one of those")
        data_files = data_files[split]
    paths = _paths(data_files, split)
    if not paths:
        raise CohortError("data_files is empty; pass at least one .jsonl, .json, .parquet or .csv file (--data_files)")
    rows: list[dict] = []
    for path in _expand(paths):
        rows.extend(_read_file(path))
    return rows


def _expand(paths) -> list[Path]:
    """Paths with globs expanded, each checked to exist."""
    out = []
    for path in map(str, paths):
        if any(c in path for c in "*?["):
            matches = sorted(glob.glob(path))
            if not matches:
                raise CohortError(f"data file pattern {path!r} matches no file; check the path (--data_files)")
            out.extend(Path(m) for m in matches)
            continue
        p = Path(path).expanduser()
        if not p.is_file():
            what = "is a directory, not a file" if p.is_dir() else "not found"
            raise CohortError(f"data file {path!r} {what}; pass the path of a .jsonl, .json, .parquet or .csv "
                              "file (--data_files)")
        out.append(p)
    return out


def _read_file(path: Path) -> list[dict]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = _read_jsonl(path, path.read_text(encoding="utf-8"))
    elif suffix == ".json":
        rows = _read_json(path)
    elif suffix == ".parquet":
        rows = _read_parquet(path)
    elif suffix == ".csv":
        rows = _read_csv(path)
    else:
        raise CohortError(f"data file {str(path)!r} has extension {path.suffix or '(none)'!r}; "
                          f"use one of {list(SUFFIXES)}")
    if not rows:
        raise CohortError(f"data file {str(path)!r} has no rows; check that it is the file you meant")
    return rows


def _read_jsonl(path: Path, text: str) -> list[dict]:
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise CohortError(f"{path}:{number}: not valid JSON ({e.msg}, column {e.colno}); "
                              "each line of a .jsonl file must be one JSON object") from None
        if not isinstance(row, dict):
            raise CohortError(f"{path}:{number}: a JSON {type(row).__name__}, not an object; "
                              "each line of a .jsonl file must be one JSON object like {\"question\": ...}")
        rows.append(row)
    return rows


def _read_json(path: Path) -> list[dict]:
    """A list of objects, a mapping column → list of values, or (as `datasets` accepts) JSON Lines."""
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        return []
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several top-level values: JSON Lines saved as .json
            return _read_jsonl(path, text)
        raise CohortError(f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno}); fix the file") from None
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        lengths = {len(v) for v in data.values()}
        if len(lengths) != 1:
            raise CohortError(f"{path}: columns have different lengths {sorted(lengths)}; "
                              "a column-wise .json file needs lists of equal length")
        columns = list(data)
        return [dict(zip(columns, values)) for values in zip(*data.values())]
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
        raise CohortError(f"{path}: expected a list of JSON objects (one per example); "
                          "reshape the file or save it as .jsonl")
    return data


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CohortError(f"reading {str(path)!r} needs pyarrow; pip install pyarrow "
                          "(or convert the file to .jsonl)") from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow's ArrowInvalid etc. for a damaged file
        raise CohortError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None


def _read_csv(path: Path) -> list[dict]:
    """Rows of a CSV file with a header line; every cell is read as text (reward functions convert)."""
    with path.open(encoding="utf-8", newline="") as file:
        reader = csv.DictReader(file)
        header = reader.fieldnames or []
        if len(set(header)) != len(header) or any(not name.strip() for name in header):
            raise CohortError(f"{path}:1: the header {header} needs distinct, non-empty column names")
        rows = []
        for row in reader:
            if None in row or any(value is None for value in row.values()):
                cells = sum(v is not None for k, v in row.items() if k is not None) + len(row.get(None, []))
                raise CohortError(f"{path}:{reader.line_num}: this row has {cells} cells where the header has "
                                  f"{len(header)} columns; quote cells that hold commas")
            rows.append(dict(row))
    return rows


def load_hub_dataset(name: str, config: str | None, split: str) -> list[dict]:
    """Rows of a Hugging Face Hub dataset split via `datasets.load_dataset(name, config, split=split)`.

    Fails fast and in one line: when the hub cannot be reached (one request with a short timeout,
    `cohort_grpo.models.loading.hub_unreachable`) only `datasets`' local cache is tried, never the hub with its
    retries. Raises `CohortError` when `datasets` is not installed or the dataset cannot be loaded
    (offline, unknown name, unknown split), suggesting a local file instead."""
    try:
        import datasets
    except ImportError:
        raise CohortError(f"loading hub dataset {name!r} needs the datasets package; pip install datasets, "
                          "or pass a local file with --data_files") from None
    from cohort_grpo.models.loading import hub_endpoint, hub_offline, hub_unreachable, one_line

    what = f"hub dataset {name!r} (config {config!r}, split {split!r})"
    unreachable = None if hub_offline() else hub_unreachable()
    try:
        if unreachable:
            with _hub_offline(datasets):  # the local cache only: no retries against a hub that is not there
                dataset = datasets.load_dataset(name, config, split=split)
        else:
            dataset = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # offline, gated, missing split…: all end the same way for the user
        if unreachable:
            raise CohortError(f"could not load {what}: the Hugging Face hub cannot be reached ({hub_endpoint()}: "
                              f"{unreachable}) and it is not in the datasets cache; pass a local file with "
                              "--data_files") from None
        raise CohortError(f"could not load {what}: {one_line(e)[:300]}; pass a local file with --data_files") from None
    return [dict(row) for row in dataset]


class _hub_offline:
    """Within: `datasets` and `huggingface_hub` in offline mode (their module flags, which they read at
    import from HF_HUB_OFFLINE), so `load_dataset` answers from the cache at once; restored on exit."""

    FLAGS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")

    def __init__(self, datasets_module):
        self.modules = [getattr(datasets_module, "config", None)]
        try:
            from huggingface_hub import constants

            self.modules.append(constants)
        except ImportError:
            pass
        self.saved: list = []

    def __enter__(self):
        for module in self.modules:
            for flag in self.FLAGS:
                if module is not None and hasattr(module, flag):
                    self.saved.append((module, flag, getattr(module, flag)))
                    setattr(module, flag, True)
        return self

    def __exit__(self, *exc):
        for module, flag, value in reversed(self.saved):
            setattr(module, flag, value)
        return False


def is_message_content(content) -> bool:
    """A chat message's content: a string, or a list of typed parts ({"type": "text", "text": ...}, {"type": "image"})."""
    return isinstance(content, str) or (isinstance(content, list) and all(
        isinstance(part, dict) and isinstance(part.get("type"), str) for part in content))


def check_prompt_column(rows: list[dict], source: str) -> None:
    """Every row has a `prompt` that is a string or a list of {"role", "content"} chat messages (a content a string,
    or a list of typed parts such as a vision-language prompt's {"type": "image"}); otherwise a `CohortError`
    naming the first bad row and what it holds."""
    for index, row in enumerate(rows):
        if "prompt" not in row:
            raise CohortError(f"{source} row {index} has no 'prompt' column (columns: {sorted(row)}); "
                              "rename the prompt column to 'prompt'")
        prompt = row["prompt"]
        if isinstance(prompt, str):
            continue
        if isinstance(prompt, list) and prompt and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and is_message_content(m.get("content"))
                for m in prompt):
            continue
        shown = repr(prompt)
        shown = shown if len(shown) <= 60 else shown[:60] + "…"
        raise CohortError(f"{source} row {index}: 'prompt' is a {type(prompt).__name__} ({shown}); it must be a "
                          "string or a list of {'role': ..., 'content': ...} messages")


def dataset_rows(dataset, name: str) -> list[dict]:
    """A dataset (list of dicts, HF Dataset, ...) as a list of row dicts, its prompt column checked."""
    if dataset is None:
        raise CohortError(f"{name} is missing: pass a list of rows with a 'prompt' column")
    rows = [dict(r) for r in dataset]
    if not rows:
        raise CohortError(f"{name} is empty: it needs at least one row with a 'prompt' column")
    if "prompt" not in rows[0]:
        raise CohortError(f"{name} has no 'prompt' column (columns: {sorted(rows[0])}); rename the prompt column to 'prompt'")
    check_prompt_column(rows, name)  # wrong types fail here, not mid-run
    return rows


def row_origins(args, rows: list[dict]):
    """Where row i of `rows` — the training rows a run loaded from `args.data_files` — comes from ("data.jsonl:12",
    "data.csv row 3"), for a message about that row; the files are read again only when asked, and a row that is not
    the file's (rows given to the trainer directly, a subset, a curriculum) is named by its index alone."""
    def origin(index: int) -> str:
        where = f"train_dataset row {index}"
        if args.data_files is None or args.subset is not None or args.curriculum:
            return where
        try:
            for path in _expand(_paths(args.data_files, args.dataset_train_split)):
                found = _read_file(path)
                if index < len(found):
                    if found[index].get(args.prompt_column) != rows[index]["prompt"]:
                        return where
                    return f"{where} ({_position(path, index)})"
                index -= len(found)
        except (CohortError, OSError):
            pass
        return where
    return origin


def _paths(data_files, split: str | None) -> list:
    if isinstance(data_files, dict):
        data_files = data_files[split] if split in data_files else next(iter(data_files.values()))
    if isinstance(data_files, str) and "," in data_files and not Path(data_files).expanduser().exists():
        return [part.strip() for part in data_files.split(",") if part.strip()]
    return [data_files] if isinstance(data_files, (str, Path)) else list(data_files)


def _position(path: Path, index: int) -> str:
    """Row `index` of the file: its line in a JSON Lines file (blank lines hold no row), else its row number."""
    if path.suffix.lower() == ".jsonl":
        lines = [n for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1) if line.strip()]
        return f"{path}:{lines[index]}"
    return f"{path} row {index}"
