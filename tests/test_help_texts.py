"""The help and the docs name what exists: every task in `train --help`, every task with a verifier in
`eval --help`, one default per eval option, every built-in model in a doc, the zero loss at μ = 1 explained."""

from __future__ import annotations

import re
from pathlib import Path

from cohort_grpo.cli import main
from cohort_grpo.models.tiny import BUILTIN_MODELS
from cohort_grpo.tasks import TASKS, task_class

DOCS = Path(__file__).resolve().parents[1] / "docs"


def help_of(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_train_help_names_every_task(capsys):
    text = help_of(capsys, "train", "--help")
    tasks_paragraph = " ".join(re.search(r"\nTasks: (.*?)\n\n", text, re.S).group(1).split())
    task_option = " ".join(re.search(r"\n  --task .*?\n(.*?)\n  --", text, re.S).group(1).split())
    for name in TASKS:
        assert re.search(rf"\b{name}\b", tasks_paragraph), name
        assert re.search(rf"\b{name}\b", task_option), name


def test_eval_help_gives_each_default_once_and_every_gradable_task(capsys):
    text = help_of(capsys, "eval", "--help")
    options = [line for line in text.splitlines() if line.startswith("  --")]
    assert options and all(line.lower().count("default") == 1 for line in options), \
        [line for line in options if line.lower().count("default") != 1]
    task_line = next(line for line in options if line.startswith("  --task "))
    for name in TASKS:
        assert (re.search(rf"\b{name}\b", task_line) is not None) == hasattr(task_class(name), "is_correct"), name


def test_every_built_in_model_is_in_a_doc():
    text = "\n".join(path.read_text() for path in [*DOCS.rglob("*.md"), DOCS.parent / "README.md"])
    for name in BUILTIN_MODELS:
        assert f"`{name}`" in text or f"--model {name}" in text, name


def test_first_run_explains_the_zero_loss_at_one_update_per_batch():
    text = " ".join((DOCS / "howto" / "first-run.md").read_text().split())
    assert "`Loss=0.0000`" in text and "μ_iters=1" in text and "ratio π_θ/π_old is exactly 1" in text
