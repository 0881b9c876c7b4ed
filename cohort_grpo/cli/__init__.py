"""The `cohort-grpo` command: `main.py` dispatches to one module per subcommand (`train.py`, with `launch.py` for a
job of several processes; `eval.py`, `sft.py`, `chat.py`; `report` runs `cohort_grpo.telemetry.report`);
`flags.py` is the `--name value` parser that `eval` and `sft` share."""

from cohort_grpo.cli.main import main
from cohort_grpo.cli.train import task_rows

__all__ = ["main", "task_rows"]
