"""What the user pages (README.md, docs/ but docs/history/) and the messages tell a user to run exists for a
user: the distribution they install is pyproject's, never PyPI's unrelated `cohort`; the extras they name
are pyproject's; the README's two set-up commands are what it says; and no page sends a user to
`../shared`, the developers' folder beside the checkout (tests and bench/ may use it)."""

import ast
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
USER_PAGES = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").rglob("*.md")) if "history" not in p.parts)]
# options of `pip install` followed by a value that is not a requirement
VALUED_OPTIONS = {"-i", "--index-url", "--extra-index-url", "-t", "--target", "-r", "--requirement", "-c",
                  "--constraint", "-d", "-f", "--find-links"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def python_strings(path: Path) -> list[str]:
    """Every string literal of a Python file, implicit concatenations joined (as the messages print)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def told_to_users() -> list[tuple[str, str]]:
    """(where, text) for the user pages, the examples and the strings of cohort_grpo/ (its messages)."""
    texts = [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in USER_PAGES]
    for path in [*sorted((ROOT / "examples").glob("*.py")), *sorted((ROOT / "cohort_grpo").rglob("*.py"))]:
        texts += [(str(path.relative_to(ROOT)), text) for text in python_strings(path)]
    return texts


def pip_install_arguments(text: str) -> list[list[str]]:
    """The words after each `pip install` of a text, up to the end of the command (a backtick, `&&`, `#`,
    a bracket or a dash of prose, or a word that ends a clause)."""
    commands = []
    for match in re.finditer(r"\bpip3? install((?:[ \t]+[^\s`&|;#()—]+)+)", text):
        words = []
        for word in match.group(1).split():
            clause_ends = word not in (".",) and word[-1] in ",.;:" and not word.endswith("]")
            words.append(word.strip("'\"").rstrip(",.;:") if word != "." else word)
            if clause_ends:
                break
        commands.append(words)
    return commands


def installs(words: list[str]) -> tuple[list[str], list[str]]:
    """(local paths, requirements) that one `pip install` names; options and their values are skipped."""
    paths, requirements, skip = [], [], False
    for word in words:
        if skip:
            skip = False
        elif word in VALUED_OPTIONS:
            skip = True
        elif word.startswith("-"):
            continue
        elif word.startswith((".", "/")) or "/" in word:
            paths.append(word)
        else:
            requirements.append(word)
    return paths, requirements


def test_the_distribution_has_a_name_of_its_own_and_the_pages_say_it():
    name = PYPROJECT["project"]["name"]
    # "cohort" on PyPI is another project (multi-agent orchestration, with a `cohort` module and command)
    assert normalized(name) != "cohort"
    for page in ("README.md", "docs/howto/first-run.md"):
        assert f"`{name}`" in (ROOT / page).read_text(encoding="utf-8"), f"{page} does not name {name}"


def test_every_pip_install_names_this_distribution_or_its_extras():
    name, extras = PYPROJECT["project"]["name"], set(PYPROJECT["project"]["optional-dependencies"])
    local_installs = 0
    for where, text in told_to_users():
        for words in pip_install_arguments(text):
            paths, requirements = installs(words)
            for path in paths:
                local_installs += path.startswith(".")
                for listed in re.findall(r"\[([^\]]*)\]", path):
                    unknown = {e.strip() for e in listed.split(",")} - extras
                    assert not unknown, f"{where}: pip install {path}: no extra {sorted(unknown)} in pyproject.toml"
            for requirement in requirements:
                requirement_name = re.match(r"[A-Za-z0-9._-]+", requirement).group()
                if normalized(requirement_name).startswith("cohort"):
                    assert normalized(requirement_name) == normalized(name), (
                        f"{where}: `pip install {requirement}` installs another project; this one is {name}")
    assert local_installs >= 3  # the README's two set-up commands and the how-to pages' extras


def test_the_readme_keeps_its_two_set_up_commands_and_they_resolve():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Quick start\n\n```bash\n(.*?)```", readme, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    assert commands == ["pip install -e . && cohort-grpo train", 'pip install -e ".[test]" && python -m pytest']
    assert PYPROJECT["project"]["scripts"]["cohort-grpo"] == "cohort_grpo.cli:main"
    from cohort_grpo.cli import main

    assert callable(main)
    assert "pytest" in " ".join(PYPROJECT["project"]["optional-dependencies"]["test"])


def test_no_user_page_sends_a_user_to_the_developers_shared_folder():
    sent = [f"{page.relative_to(ROOT)}:{number}" for page in USER_PAGES
            for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1) if "../shared" in line]
    assert not sent, f"user pages naming ../shared (say how a user gets the data or model instead): {sent}"


@pytest.mark.parametrize("text, expected", [
    ("`pip install tensorboard`, or drop", [["tensorboard"]]),
    ('pip install -e ".[hub]"    # reads GSM8K', [["-e", ".[hub]"]]),
    ("needs pyarrow; pip install pyarrow (or convert", [["pyarrow"]]),
    ("the datasets package; pip install datasets, or pass a local file", [["datasets"]]),
    ("pip install torch --index-url https://x/whl/cpu — then", [["torch", "--index-url", "https://x/whl/cpu"]]),
    ("LoRA needs peft: pip install 'cohort[peft]' (or", [["cohort[peft]"]]),
    ("pip install -e . && cohort-grpo train", [["-e", "."]]),
])
def test_the_reader_of_pip_commands(text, expected):
    assert pip_install_arguments(text) == expected
