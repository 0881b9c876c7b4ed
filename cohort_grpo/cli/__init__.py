"""The `cohort-grpo` command: `main.py` dispatches to one module per subcommand (`eval.py`, `sft.py`,
`chat.py`; `train` and `report` run the trainer and `cohort_grpo.telemetry.report`); `options.py` is the
`--name value` parser that `eval` and `sft` share."""

from cohort_grpo.cli.main import main, task_rows

__all__ = ["main", "task_rows"]
