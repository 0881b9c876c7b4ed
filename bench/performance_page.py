"""docs/performance.md's tables, (re)written from bench results.

The page holds the current figures only: one table per kind of measurement, model shape and card,
one row per configuration, each row with its date and command. A result is a dict::

    {"kind": "grpo_step", "shape": "Qwen2.5-0.5B shape", "card": "H100 80GB HBM3",
     "configuration": "torch_compile=true", "date": "2026-11-27 01:20", "command": "python bench/...",
     "cohort_seconds": 2.85, "trl_seconds": 16.21, ...}      # the fields its kind's columns read (KINDS)

`write_result` replaces the row of the same (kind, shape, card, configuration), or adds it (and its
table, when new), leaving every other row and all hand-written text alone. The page stays within
MAX_LINES: when a new row would pass it, the oldest rows of other configurations are dropped (the
dated notebooks in docs/history/ keep the past). Every column that holds a figure holds it against a
baseline (TRL's step, HF generate, the bandwidth floor, one GPU, the card's memory).

    python bench/grpo_step_report.py $OUT/grpo_step.json --write-docs   # GRPO step rows from bench/grpo_step.py
    python bench/performance_page.py results.json                       # any rows: one result dict or a list
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

PAGE = Path(__file__).resolve().parents[1] / "docs" / "performance.md"
MAX_LINES = 300
MARK, END = "<!-- performance-table ", "<!-- /performance-table -->"
REQUIRED = ("kind", "shape", "card", "configuration", "date", "command")


def _num(value, spec: str, suffix: str = "") -> str:
    return "—" if value is None else format(value, spec) + suffix


def _ratio(top, bottom) -> str:
    return f"{top / bottom:.2f}×" if top and bottom else "—"


def _pair(a, b, spec: str) -> str:
    return f"{_num(a, spec)} / {_num(b, spec)}"


def _share(part, whole) -> str:
    return f"{100 * part / whole:.0f}%" if part and whole else "—"


@dataclass(frozen=True)
class Kind:
    heading: str  # the page's "## " heading above this kind's tables (made when the first table is)
    columns: tuple[tuple[str, Callable[[dict], str]], ...]  # after "configuration", before "date" and "command"


KINDS = {
    "grpo_step": Kind("The GRPO step against TRL's GRPOTrainer", (
        ("speed-up vs TRL", lambda r: _ratio(r.get("trl_seconds"), r.get("cohort_seconds"))),
        ("s/step, cohort / TRL", lambda r: _pair(r.get("cohort_seconds"), r.get("trl_seconds"), ".2f")),
        ("peak GiB, cohort / TRL", lambda r: _pair(r.get("cohort_peak_gib"), r.get("trl_peak_gib"), ".1f")
         + f" ({_ratio(r.get('cohort_peak_gib'), r.get('trl_peak_gib'))})"),
        ("cohort sampling / log-probs / update s", lambda r: " / ".join(
            _num(r.get(f"{p}_seconds"), ".2f") for p in ("sampling", "logprobs", "update"))),
        ("update MFU", lambda r: _num(r.get("mfu") and 100 * r["mfu"], ".1f", "%")),
    )),
    "sampling": Kind("Sampling against Hugging Face `generate`", (
        ("speed-up vs HF generate",
         lambda r: _ratio(r.get("engine_tokens_per_second"), r.get("hf_tokens_per_second"))),
        ("tokens/s, engine / HF",
         lambda r: _pair(r.get("engine_tokens_per_second"), r.get("hf_tokens_per_second"), ",.0f")),
        ("ms per decode step, engine / floor", lambda r: _pair(r.get("engine_ms"), r.get("floor_ms"), ".2f")),
        ("share of the bandwidth floor", lambda r: _share(r.get("floor_ms"), r.get("engine_ms"))),
    )),
    "scaling": Kind("Several GPUs", (
        ("throughput vs 1 GPU", lambda r: _ratio(r.get("one_gpu_seconds"), r.get("seconds"))),
        ("s/step, these GPUs / 1 GPU", lambda r: _pair(r.get("seconds"), r.get("one_gpu_seconds"), ".2f")),
    )),
    "async_rollouts": Kind("Asynchronous rollouts against the synchronous loop", (
        ("completion tok/s vs synchronous", lambda r: _ratio(r.get("async_tok_per_s"), r.get("sync_tok_per_s"))),
        ("step s, asynchronous / synchronous", lambda r: _pair(r.get("async_wall_s"), r.get("sync_wall_s"), ".2f")),
        ("trainer's wait for its rollout s, async / sync sampling s",
         lambda r: _pair(r.get("async_wait_s"), r.get("sync_sampling_s"), ".2f")),
        ("update s, async / sync", lambda r: _pair(r.get("async_update_s"), r.get("sync_update_s"), ".2f")),
    )),
    "capacity": Kind("What fits in memory", (
        ("peak GiB / card GiB", lambda r: _pair(r.get("peak_gib"), r.get("card_gib"), ".1f")
         + f" ({_share(r.get('peak_gib'), r.get('card_gib'))})"),
    )),
}


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _cells(line: str) -> list[str]:
    """The cells of a markdown table row (escaped pipes stay inside their cell)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def header(kind: str) -> list[str]:
    return ["configuration", *(name for name, _ in KINDS[kind].columns), "date", "command"]


def row(result: dict) -> str:
    missing = [k for k in REQUIRED if not result.get(k)]
    if missing:
        raise ValueError(f"result lacks {missing}: a row needs {list(REQUIRED)}")
    if result["kind"] not in KINDS:
        raise ValueError(f"unknown kind {result['kind']!r}; choose one of {list(KINDS)}")
    cells = [_cell(result["configuration"]), *(_cell(f(result)) for _, f in KINDS[result["kind"]].columns),
             _cell(result["date"]), "`" + _cell(result["command"]) + "`"]
    return "| " + " | ".join(cells) + " |"


def _marker(result: dict) -> str:
    return MARK + json.dumps({k: result[k] for k in ("kind", "shape", "card")}, ensure_ascii=False) + " -->"


@dataclass
class Table:
    kind: str
    marker: int  # line index of the marker; the header follows it, then the separator, then the rows
    end: int  # line index of END

    @property
    def rows(self) -> range:
        return range(self.marker + 3, self.end)


def tables(lines: list[str]) -> list[Table]:
    found, start = [], None
    for i, line in enumerate(lines):
        if line.startswith(MARK):
            start = i
        elif line.strip() == END and start is not None:
            found.append(Table(json.loads(lines[start][len(MARK):].removesuffix("-->").strip())["kind"], start, i))
            start = None
    return found


def _block(result: dict, new_row: str) -> list[str]:
    head = header(result["kind"])
    return [f"### {result['shape']} on {result['card']}", "", _marker(result), "| " + " | ".join(head) + " |",
            "|" + " --- |" * len(head), new_row, END]


def write_result(result: dict, page: Path | str = PAGE, max_lines: int = MAX_LINES) -> list[str]:
    """Put `result`'s row in its table on `page` (replacing the row of the same configuration);
    returns the rows dropped to keep the page within `max_lines`, as "shape on card: configuration"."""
    page = Path(page)
    new_row, marker = row(result), _marker(result)
    lines = page.read_text(encoding="utf-8").splitlines() if page.exists() else ["# Performance"]
    key = _cells(new_row)[0]
    found = next((t for t in tables(lines) if lines[t.marker] == marker), None)
    if found is None:
        same_kind = [t for t in tables(lines) if t.kind == result["kind"]]
        if same_kind:
            at, block = same_kind[-1].end + 1, ["", *_block(result, new_row)]
        else:
            at, block = len(lines), ["", f"## {KINDS[result['kind']].heading}", "", *_block(result, new_row)]
        lines[at:at] = block
    else:
        lines[found.marker + 1] = "| " + " | ".join(header(result["kind"])) + " |"  # columns as the code has them now
        lines[found.marker + 2] = "|" + " --- |" * len(header(result["kind"]))
        same = [i for i in found.rows if _cells(lines[i])[:1] == [key]]
        if same:
            lines[same[0]] = new_row
            for i in reversed(same[1:]):  # a duplicate left by hand
                del lines[i]
        else:
            lines.insert(found.end, new_row)
    dropped = _fit(lines, marker, key, max_lines)
    page.write_text("\n".join(lines).rstrip("\n") + "\n", encoding="utf-8")
    return dropped


def _fit(lines: list[str], marker: str, key: str, max_lines: int) -> list[str]:
    """Drop the oldest rows (by their date cell) of the other configurations until the page fits;
    a table left without rows goes with its heading."""
    dropped = []
    while len(lines) > max_lines:
        candidates = []
        for t in tables(lines):
            date_column = _cells(lines[t.marker + 1]).index("date")
            for i in t.rows:
                cells = _cells(lines[i])
                if not (lines[t.marker] == marker and cells[0] == key):
                    candidates.append((cells[date_column], i, t))
        if not candidates:
            raise ValueError(f"the page has {len(lines)} lines with only this row in its tables; "
                             f"shorten its hand-written text to fit {max_lines}")
        _, i, t = min(candidates, key=lambda c: c[0])
        title = lines[t.marker - 2] if t.marker >= 2 else ""
        dropped.append(f"{title.removeprefix('### ')}: {_cells(lines[i])[0]}")
        if len(t.rows) > 1:
            del lines[i]
            continue
        first = t.marker - 2 if t.marker >= 2 and lines[t.marker - 2].startswith("### ") else t.marker
        last = t.end + 1 if t.end + 1 < len(lines) and not lines[t.end + 1].strip() else t.end
        del lines[first:last + 1]
    return dropped


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="JSON file: one result dict or a list of them")
    parser.add_argument("--page", default=str(PAGE), help="the page to write (default docs/performance.md)")
    args = parser.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    for result in results if isinstance(results, list) else [results]:
        for line in write_result(result, args.page):
            print(f"dropped to stay within {MAX_LINES} lines: {line}", file=sys.stderr)
        print(f"wrote {result['kind']} / {result['shape']} on {result['card']} / {result['configuration']}")


if __name__ == "__main__":
    main()
