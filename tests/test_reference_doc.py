"""The docs cannot drift from the code: docs/reference.md is exactly what docs/generate_reference.py
makes of `GRPOConfig` (every field with a help text), and the user pages name only options that exist."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

from cohort_grpo.config.grpo_config import GRPOConfig
from cohort_grpo.config.rules import RULES
from cohort_grpo.config.sections import SECTIONS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FIELDS = {f.name for f in dataclasses.fields(GRPOConfig)}
# Flags of the other commands and of `cohort-grpo train` itself that are not GRPOConfig fields.
OTHER_FLAGS = {
    "config", "nproc_per_node", "help", "debug", "print_config", "version",  # cohort-grpo train; every command
    "nnodes", "node_rank", "master_addr", "master_port",  # cohort-grpo train's launcher, on several machines
    "standalone", "nodes", "ntasks_per_node", "gpus_per_task",  # torchrun and SLURM's srun, in multi-gpu.md
    "index_url",  # pip, in the README's CPU-only note
    "limit", "num_samples", "split", "output",  # cohort-grpo eval
    "system", "raw", "max_new_tokens", "tool_timeout", "image",  # cohort-grpo chat (its tools: --tools, --environment)
    "prompts", "chat",  # cohort-grpo generate (with --output)
    "out",  # cohort-grpo report
}
USER_PAGES = [ROOT / "README.md", DOCS / "README.md", DOCS / "concepts.md", DOCS / "guide.md",
              DOCS / "reliability.md", *sorted((DOCS / "howto").glob("*.md"))]


def generator():
    spec = importlib.util.spec_from_file_location("generate_reference", DOCS / "generate_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_reference_md_is_what_the_generator_writes(tmp_path):
    out = tmp_path / "reference.md"
    assert generator().main(["--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == (DOCS / "reference.md").read_text(encoding="utf-8"), (
        "docs/reference.md is stale: run `python docs/generate_reference.py`")


def test_every_option_has_help_and_a_section():
    for f in dataclasses.fields(GRPOConfig):
        text = f.metadata.get("help", "")
        assert isinstance(text, str) and text.strip(), f"GRPOConfig.{f.name} has no help text"
    listed = [name for section in SECTIONS for name in section.options]
    assert listed == [f.name for f in dataclasses.fields(GRPOConfig)]  # each once, in the class's order
    reference = (DOCS / "reference.md").read_text(encoding="utf-8")
    assert all(f"| `{name}` |" in reference for name in FIELDS)


def test_reference_lists_every_refused_configuration():
    reference = (DOCS / "reference.md").read_text(encoding="utf-8")
    refused = reference.split("## Refused configurations")[1].split("\n## ")[0]
    assert [line[2:] for line in refused.splitlines() if line.startswith("- ")] == [rule.when for rule in RULES]
    named = {name for rule in RULES for name in re.findall(r"`(\w+)`", rule.when)}
    assert named <= FIELDS, named - FIELDS


BENCH_SECTION = re.compile(r"^#+ .*`bench/(\w+)\.py`", re.M)


def flags(text: str) -> set[str]:
    """--names inside code spans and fenced blocks, dashes read as underscores."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M))
    return {name.replace("-", "_") for span in blocks + inline
            for name in re.findall(r"(?<![\w-])--([a-z][a-z0-9_-]*)", span)}


def sections(text: str) -> list[tuple[str | None, str]]:
    """The page cut at its `## ` headings: (the benchmark script a heading names as `bench/NAME.py`, or None;
    the section's text). A benchmark's section names that script's flags, not a command's."""
    parts = re.split(r"\n(?=## )", text)
    return [((match.group(1) if (match := BENCH_SECTION.search(part.split("\n", 1)[0])) else None), part)
            for part in parts]


def test_user_pages_name_only_flags_that_exist():
    for page in USER_PAGES:
        for script, text in sections(page.read_text(encoding="utf-8")):
            if script is None:
                unknown = flags(text) - FIELDS - OTHER_FLAGS
                assert not unknown, f"{page.relative_to(ROOT)} names flags that no command has: {sorted(unknown)}"
                continue
            source = (ROOT / "bench" / f"{script}.py").read_text(encoding="utf-8")
            unknown = {name for name in flags(text) if f'"--{name}"' not in source}
            assert not unknown, f"{page.relative_to(ROOT)}: bench/{script}.py has no {sorted(unknown)}"


def table_cells(text: str, column: int) -> list[str]:
    return [cells[column] for cells in (row.split("|") for row in text.splitlines()
                                        if row.startswith("| ") and "---" not in row)][1:]


def test_option_columns_name_config_fields():
    concepts = (DOCS / "concepts.md").read_text(encoding="utf-8")
    algorithm = concepts.split("## The algorithm, line by line")[1].split("\n## ")[0]
    named = {n for cell in table_cells(algorithm.split("\n\n", 1)[1].split("\n\n")[0], 3)
             for n in re.findall(r"`([a-z_0-9]+)`", cell)}
    assert len(named) > 15 and named <= FIELDS, named - FIELDS
    trl = (DOCS / "howto" / "from-trl.md").read_text(encoding="utf-8")
    same = trl.split("## The same names")[1].split("\n## ")[0]
    different = trl.split("## Different names, or no equivalent")[1].split("\n## ")[0]
    listed = {n for cell in table_cells(same, 2) + table_cells(different, 2) for n in re.findall(r"`([a-z_0-9]+)`", cell)}
    assert len(listed) > 30 and listed <= FIELDS, listed - FIELDS
    for trl_cell, cohort_cell in (row.split("|")[1:3] for row in same.splitlines() if row.startswith("| `")):
        assert re.findall(r"`(\w+)`", trl_cell) == re.findall(r"`(\w+)`", cohort_cell)
