"""The `cohort` command: one module per subcommand (`main.py` dispatches)."""

from cohort.cli.main import main, task_rows

__all__ = ["main", "task_rows"]
