"""The generic task: your rows and your reward functions, as `trl grpo` takes them.

Rows come from `--data_files` (.jsonl, .json, .parquet, .csv) or a hub dataset (`--dataset_name`);
the column named by `--prompt_column` becomes `prompt`, and every other column reaches the reward
functions as a keyword argument (`def reward(prompts, completions, solution, **_)`). The rewards are
`--reward_funcs` (built-in names or `module:function`). It has no verifier, so there is no held-out
accuracy: `cohort-grpo train` says so in one line and trains on.

`cohort-grpo train` picks this task when data is given without `--task`.
"""

from __future__ import annotations

import random

from cohort_grpo.errors import CohortError
from cohort_grpo.tasks.data import check_prompt_column, load_hub_dataset, load_rows


class GenericTask:
    name = "generic"
    default_config: dict = {}  # GRPOConfig's own defaults
    system_prompt = None
    reward_funcs: list = []  # --reward_funcs supplies them
    reward_weights: list = []

    def load(self, split: str = "train", data_files=None, dataset_name: str | None = None,
             dataset_config: str | None = None, prompt_column: str = "prompt", subset: int | None = None,
             seed: int = 0, **_) -> list[dict]:
        """Rows with a `prompt` (the `prompt_column`, renamed) and the data's other columns, from
        `data_files` or the hub dataset `dataset_name`; `subset=N` keeps N rows chosen by `seed`, in order."""
        if data_files is not None:
            raw, source = load_rows(data_files, split=split), str(data_files)
        elif dataset_name is not None:
            raw, source = load_hub_dataset(dataset_name, dataset_config, split), dataset_name
        else:
            raise CohortError("the generic task trains on your rows: pass --data_files FILE (.jsonl, .json, .parquet, "
                              ".csv) or --dataset_name NAME, or --task NAME for a built-in task")
        rows = [self._row(dict(row), index, prompt_column, source) for index, row in enumerate(raw)]
        check_prompt_column(rows, source)
        if subset is not None:
            if int(subset) < 1:
                raise CohortError(f"subset must be a positive number of rows, got {subset!r}")
            if subset < len(rows):
                keep = sorted(random.Random(seed).sample(range(len(rows)), int(subset)))
                rows = [rows[i] for i in keep]
        return rows

    @staticmethod
    def _row(row: dict, index: int, prompt_column: str, source: str) -> dict:
        if prompt_column not in row:
            raise CohortError(f"{source} row {index} has no {prompt_column!r} column (columns: {sorted(row)}); "
                              "name the prompt column with --prompt_column NAME")
        if prompt_column == "prompt":
            return row
        prompt = row.pop(prompt_column)
        return {"prompt": prompt, **{k: v for k, v in row.items() if k != "prompt"}}
