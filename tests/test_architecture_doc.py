"""docs/architecture.md's loop block is `GRPOTrainer.train()`: the same calls, in the same order.

Both are read as Python syntax (no import of the trainer): from the `with` statement that holds the
`for step in self.steps()` loop, every call to a method of `self`, of one of its stages (`self.rollouts.take`)
or to a plain function, in source order. Callback events (`self.callback_handler.event`) and the clean-up in
the `try` statement's handlers and `finally` are the trainer's alone and left out.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "cohort_grpo" / "trainer" / "grpo_trainer.py"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def loop_statement(tree: ast.AST) -> ast.With:
    """The `with` statement whose body (or a `try` in it) runs `for ... in self.steps()`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any(
                isinstance(inner, ast.For) and "self.steps()" in ast.unparse(inner.iter) for inner in ast.walk(node)):
            return node
    raise AssertionError("no `with` statement around `for step in self.steps()`")


def kept_nodes(statements: list[ast.stmt]):
    """Every node of `statements`, skipping `try` handlers and `finally` blocks."""
    for statement in statements:
        if isinstance(statement, ast.Try):
            yield from kept_nodes(statement.body + statement.orelse)
            continue
        yield from ast.walk(statement)


def stage_calls(with_statement: ast.With) -> list[str]:
    """`self.name` / `self.stage.name` / `name` of each call the statement makes, in source order."""
    nodes = [item.context_expr for item in with_statement.items] + list(kept_nodes(with_statement.body))
    calls = [node for root in nodes for node in ast.walk(root) if isinstance(node, ast.Call)]
    names = []
    for call in sorted(set(calls), key=lambda c: (c.lineno, c.col_offset)):
        func = call.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
            names.append(f"self.{func.attr}")
        elif (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute)
              and isinstance(func.value.value, ast.Name) and func.value.value.id == "self"
              and func.value.attr != "callback_handler"):
            names.append(f"self.{func.value.attr}.{func.attr}")
        elif isinstance(func, ast.Name) and func.id != "range":
            names.append(func.id)
    return names


def train_calls(source: str) -> list[str]:
    tree = ast.parse(source)
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GRPOTrainer")
    train = next(n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    return stage_calls(loop_statement(train))


def documented_calls(page: str) -> list[str]:
    section = page.split("## The loop", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "docs/architecture.md: no ```python block under '## The loop'"
    return stage_calls(loop_statement(ast.parse(block.group(1))))


def test_the_documented_loop_is_train():
    documented = documented_calls(ARCHITECTURE.read_text())
    assert documented == train_calls(TRAINER.read_text())
    # what the comparison sees: Algorithm 1's stages, in order
    assert documented[documented.index("self.steps"):documented.index("self.end_step") + 1] == [
        "self.steps", "self.new_iteration", "self.reset_reference", "self.rollouts.take", "self.score",
        "self.refill_uninformative", "self.reference_logprobs", "self.estimate_advantages", "self.distil", "self.update",
        "self.update_reward_models", "self.end_step"]


@pytest.mark.parametrize("change", [
    ("self.score(batch)", "self.score(batch); self.extra_stage(batch)"),
    ("batch = self.rollouts.take(step)", "batch = self.rollouts.sample(self.next_prompts())"),
    ("batch = self.refill_uninformative(batch)", "batch = batch"),
])
def test_a_change_to_train_alone_is_caught(change):
    source = TRAINER.read_text()
    old, new = change
    assert old in source
    assert train_calls(source.replace(old, new, 1)) != documented_calls(ARCHITECTURE.read_text())


def test_a_change_to_the_page_alone_is_caught():
    page = ARCHITECTURE.read_text()
    swapped = page.replace("        self.score(batch)", "        self.SWAP(batch)", 1).replace(
        "        batch = self.refill_uninformative(batch)", "        self.score(batch)", 1).replace(
        "        self.SWAP(batch)", "        batch = self.refill_uninformative(batch)", 1)
    assert swapped != page
    assert documented_calls(swapped) != train_calls(TRAINER.read_text())


def documented_rooms(page: str) -> list[str]:
    """The first column of the table under "Rooms, lowest first": `cohort_grpo/<room>/` or `cohort_grpo/<module>.py`."""
    section = page.split("## Rooms, lowest first", 1)[1].split("\n## ", 1)[0]
    return [match.group(1).rstrip("/") for match in re.finditer(r"^\| `cohort_grpo/([\w.]+/?)` \|", section, re.M)]


def test_the_documented_rooms_are_the_enforced_order():
    """The page's table of rooms lists every room in the order tests/test_structure.py enforces."""
    from test_structure import ROOMS

    assert documented_rooms(ARCHITECTURE.read_text()) == list(ROOMS)


def test_a_room_out_of_order_on_the_page_is_caught():
    page = ARCHITECTURE.read_text()
    swapped = page.replace("| `cohort_grpo/kernels/` |", "| `cohort_grpo/KERNELS/` |", 1).replace(
        "| `cohort_grpo/config/` |", "| `cohort_grpo/kernels/` |", 1).replace("| `cohort_grpo/KERNELS/` |", "| `cohort_grpo/config/` |", 1)
    assert swapped != page and documented_rooms(swapped) != documented_rooms(page)
