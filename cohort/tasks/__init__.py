"""Built-in tasks, looked up by name (`--task`)."""

from __future__ import annotations

import importlib

from ..errors import CohortError

# name → "module:attribute" so optional tasks import only when asked for.
TASKS = {
    "arithmetic": "cohort.tasks.arithmetic:ArithmeticTask",
    "gsm8k": "cohort.tasks.gsm8k:GSM8KTask",
}


def get_task(name: str):
    if name not in TASKS:
        raise CohortError(f"unknown task {name!r}; choose one of {sorted(TASKS)} (--task)")
    module, attr = TASKS[name].split(":")
    return getattr(importlib.import_module(module), attr)()
