"""docs/models.md against the installed transformers: every causal-LM type walked again (tests/model_coverage.py).

The committed page is the one record of which types pass; a type it marks passing that no longer passes fails
here, and so does a page that differs from the rows (regenerate it: the command is in the page's header)."""

from pathlib import Path

import pytest
import torch

from model_coverage import PASS, check_greedy, check_logits, coverage_rows, parse, render, tiny_config

pytestmark = [pytest.mark.cpu("float32 tolerances of CPU forwards"), pytest.mark.slow]

PAGE = Path(__file__).resolve().parent.parent / "docs" / "models.md"


@pytest.fixture(scope="module")
def rows():
    return coverage_rows(workers=2)  # spawned processes: about a minute on two cores


def test_types_the_page_marks_passing_still_pass(rows):
    committed = parse(PAGE.read_text())
    now = {row["type"]: row for row in rows}
    broken = {model_type: now.get(model_type, {}).get("result", "no longer a causal-LM type of transformers")
              for model_type, row in committed.items() if row["result"] == PASS and
              now.get(model_type, {}).get("result") != PASS}
    assert not broken, broken
    assert sum(row["result"] == PASS for row in rows) >= 40


def test_page_is_up_to_date(rows):
    import re
    import transformers

    page = PAGE.read_text()
    generated_for = re.search(r"Generated for transformers (\S+) ", page).group(1)
    if generated_for != transformers.__version__:  # another release has other types: the page is its version's
        pytest.skip(f"docs/models.md was generated for transformers {generated_for}, {transformers.__version__} is "
                    "installed: regenerate it with that version to compare")
    assert page == render(rows), (
        "docs/models.md is out of date: PYTHONPATH=$PWD python tests/model_coverage.py --write docs/models.md")


def test_checks_catch_a_model_that_differs_from_transformers():
    """The walk's checks fail a wrapped model whose weights are not the reference's: they can fail."""
    import transformers

    from cohort_grpo.models.generic import TransformersCausalLM

    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(tiny_config("olmo2")).eval()
    reference.generation_config.eos_token_id = None
    model = TransformersCausalLM.wrap(transformers.AutoModelForCausalLM.from_config(tiny_config("olmo2"))).eval()
    assert "differs from transformers'" in check_logits(reference, model)
    assert "differ from generate's" in check_greedy(reference, model)
