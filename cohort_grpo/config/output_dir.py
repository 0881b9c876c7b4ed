"""Where a run writes when `output_dir` is not given.

A script's runs go to `runs/<script name>`, so two scripts in one folder do not write into (and refuse to
overwrite, or resume) each other's run; with no script file behind the process (an interactive session,
`python -c`, a notebook) the folder is `runs/cohort`. The `cohort-grpo` command keeps its own default,
`COMMAND_LINE_OUTPUT_DIR` below the task's (`runs/arithmetic` for the built-in task).
"""

from __future__ import annotations

import sys
from pathlib import Path

COMMAND_LINE_OUTPUT_DIR = "runs/cohort"
DESCRIPTION = "runs/<script name>"  # what docs/reference.md shows, since the value depends on the script


def script_output_dir() -> str:
    """`runs/<stem of the __main__ module's file>` (`runs/<package>` for `python -m package`), else `runs/cohort`."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path:
        return COMMAND_LINE_OUTPUT_DIR
    script = Path(path)
    name = script.parent.name if script.stem == "__main__" else script.stem
    return f"runs/{name or 'cohort'}"
