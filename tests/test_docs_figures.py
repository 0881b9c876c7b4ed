"""The README's measured figures are docs/performance.md's: the default job's accuracies and seconds, the
calculator job's, and the GPU ratios and memory it quotes. A figure changes on the page (a row measured
again) and the README follows, or this fails."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
PAGE = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")


def table_after(heading: str, text: str = PAGE) -> list[dict]:
    """The rows of the first table after `heading`, each a dict of header → cell."""
    lines = text[text.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| "))
    table = []
    for line in lines[start:]:
        if not line.startswith("| "):
            break
        table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    header, rows = table[0], table[2:]
    return [dict(zip(header, row)) for row in rows]


def percent_pair(text: str) -> tuple[float, float]:
    before, after = re.match(r"([\d.]+)% → ([\d.]+)%", text).groups()
    return float(before), float(after)


def default_job_claims() -> list[tuple[int, str, tuple[float, float]]]:
    """(seconds, machine, (before, after)) for each "N s on a MACHINE (A% → B%)" of the README."""
    claims = re.findall(r"(\d+) s\s+on a (2-core [A-Za-z ]+?) \(([\d.]+% → [\d.]+%)\)", README)
    return [(int(seconds), machine, percent_pair(pair)) for seconds, machine, pair in claims]


def test_the_default_jobs_accuracies_and_seconds_are_rows_of_the_page():
    rows = {row["machine"]: row for row in table_after("## The built-in task on a CPU")}
    claims = default_job_claims()
    assert len(claims) >= 2, "the README's default-job sentence was not found"
    for seconds, machine, accuracies in claims:
        assert machine in rows, f"README names {machine!r}; the page's machines are {sorted(rows)}"
        row = rows[machine]
        assert percent_pair(row["accuracy before → after"]) == accuracies, (machine, row)
        assert row["time"].startswith(f"{seconds} s, warm start included"), (machine, row["time"])
        assert "clean clone" in row["command"]  # the README says "from a clean clone"


def test_the_sample_output_ends_with_one_of_those_runs():
    before, after = map(float, re.search(r"held-out accuracy: ([\d.]+)% -> ([\d.]+)% \(200 problems\)",
                                         README).groups())
    assert (before, after) in [accuracies for _, _, accuracies in default_job_claims()]


def test_the_calculator_jobs_figures_are_the_pages():
    before, after, seconds = re.search(r"([\d.]+)% → ([\d.]+)% held-out accuracy in (\d+) s on 2 CPU cores",
                                       README).groups()
    [row] = [row for row in table_after("`cohort-grpo train --task calculator`: ") if row["machine"].startswith("2-core")]
    assert percent_pair(row["accuracy before → after"]) == (float(before), float(after))
    assert row["time"].startswith(f"{seconds} s")


def test_every_ratio_and_memory_figure_of_the_readme_is_on_the_page():
    """Each "N×" (or each end of "N–M×") of the README is a "M×" of the page rounded to the README's digits; each
    "A against B GiB" is a "A / B" peak pair of the page."""
    on_page = re.findall(r"(\d+(?:\.\d+)?)×", PAGE)
    ranges = re.findall(r"(\d+(?:\.\d+)?)(?:[–-](\d+(?:\.\d+)?))?×", README)  # "7.75×", "3.9–5.2×"
    quoted = [figure for pair in ranges for figure in pair if figure]
    assert len(quoted) >= 3
    for figure in quoted:
        digits = len(figure.partition(".")[2])
        assert any(round(float(m), digits) == float(figure) for m in on_page), f"{figure}× is not on the page"
    memory = re.findall(r"(\d+\.\d) against (\d+\.\d) GiB", README)
    assert memory
    for ours, theirs in memory:
        assert f"{ours} / {theirs}" in PAGE, (ours, theirs)
