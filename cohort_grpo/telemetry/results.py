"""The results files and printout of transformers' `Trainer`, for the trainer's methods of those names.

`log_metrics` prints one block for a split (`***** train metrics *****`, a line per metric, keys sorted, the
values shown as transformers shows them: a runtime as h:mm:ss, a float to 4 decimals); `save_metrics` writes
`<split>_results.json` in output_dir and merges the same metrics into `all_results.json`; `save_state` writes
the trainer state as `trainer_state.json`. A script that reads these files after a TRL run reads them here.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Callable

STATE_FILE = "trainer_state.json"
ALL_RESULTS_FILE = "all_results.json"


def shown_value(key: str, value):
    """`value` as transformers prints metric `key`."""
    if "_mem_" in key and isinstance(value, int):
        return f"{value >> 20}MB"
    if "_runtime" in key and isinstance(value, (int, float)):
        return f"{datetime.timedelta(seconds=int(value))}.{int(abs(value - int(value)) * 100):02d}"  # hundredths cut
    if key == "total_flos" and isinstance(value, (int, float)):
        return f"{int(value) >> 30}GF"
    return round(value, 4) if isinstance(value, float) else value


def log_metrics(split: str, metrics: dict, write: Callable[[str], None] = print) -> None:
    """One block: a header naming `split`, then `key = value` per metric, aligned, keys sorted."""
    shown = {key: shown_value(key, value) for key, value in metrics.items()}
    lines = [f"***** {split} metrics *****"]
    if shown:
        key_width, value_width = max(len(str(k)) for k in shown), max(len(str(v)) for v in shown.values())
        lines += [f"  {key: <{key_width}} = {shown[key]:>{value_width}}" for key in sorted(shown)]
    write("\n".join(lines))


def save_metrics(output_dir: str | Path, split: str, metrics: dict, combined: bool = True) -> Path:
    """`<split>_results.json` in `output_dir` (replaced), and with `combined` the metrics merged into
    all_results.json (a key of an earlier split is kept unless this one has it); the split's file is returned."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{split}_results.json"
    write_json(path, metrics)
    if combined:
        everything = out / ALL_RESULTS_FILE
        merged = json.loads(everything.read_text(encoding="utf-8")) if everything.exists() else {}
        write_json(everything, {**merged, **metrics})
    return path


def save_state(state, output_dir: str | Path) -> Path:
    """transformers' `TrainerState` as trainer_state.json in `output_dir` (its own `save_to_json`)."""
    path = Path(output_dir) / STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    state.save_to_json(str(path))
    return path


def write_json(path: Path, values: dict) -> None:
    path.write_text(json.dumps(values, indent=4, sort_keys=True) + "\n", encoding="utf-8")
