"""`cohort-grpo report RUN_DIR [RUN_DIR ...]`: training curves as PNGs and one self-contained HTML page.

Reads each run's `metrics.jsonl` (required), `completions.jsonl` and `summary.json` (optional), draws
one PNG per metric group with every run on the same axes, and writes `index.html` with the PNGs
embedded as base64 data URIs and inline CSS: the page loads nothing from anywhere, so it can be
mailed, archived or opened offline. Groups a run never logged are listed as skipped on the page; the
learning-health warnings a run gave (metrics.jsonl's `warnings`) are listed under the summary.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from cohort_grpo.errors import CohortError
from cohort_grpo.telemetry.metrics import COMPLETIONS_FILE, METRICS_FILE, read_completions, read_metrics

FIGURE_INCHES = (8.0, 4.5)
FIGURE_DPI = 100
FIGURE_PIXELS = (int(FIGURE_INCHES[0] * FIGURE_DPI), int(FIGURE_INCHES[1] * FIGURE_DPI))  # (w, h)
COMPLETIONS_PER_RUN = 8
LINE_STYLES = ("-", "--", ":", "-.")
TEXT_LIMIT = 1500  # characters of a prompt / completion shown in the table


@dataclass(frozen=True)
class PlotSpec:
    """One PNG: the metrics it draws are `keys` and/or those matching `pattern`."""

    slug: str
    title: str
    ylabel: str
    keys: tuple[str, ...] = ()
    pattern: str | None = None
    joined: bool = True  # False: a marker per logged value, no line (evaluations, a few steps apart)

    def metric_names(self, available: set[str]) -> list[str]:
        names = [key for key in self.keys if key in available]
        if self.pattern:
            names += sorted(n for n in available if re.fullmatch(self.pattern, n) and n not in names)
        return names

    def legend_name(self, name: str) -> str:
        """`rewards/accuracy/mean` -> `accuracy`: the pattern's group where it has one."""
        match = re.fullmatch(self.pattern, name) if self.pattern else None
        return match.group(1) if match and match.groups() else name


PLOTS = (
    PlotSpec("reward", "Reward of the sampled training completions (mean over the batch)", "reward", ("reward",)),
    PlotSpec("reward_per_function", "Reward per function", "mean reward", pattern=r"rewards/(.+)/mean"),
    # Evaluated at a few steps only: a line between them would draw progress nobody measured.
    PlotSpec("accuracy", "Held-out accuracy, greedy (at each evaluation)", "accuracy", ("eval/accuracy",),
             joined=False),
    PlotSpec("tool_calls", "Tool use per completion", "per completion", ("tools/call_frequency", "tools/turns")),
    PlotSpec("tool_failures", "Failed tool calls (fraction of calls)", "fraction", ("tools/failure_frequency",)),
    PlotSpec("tool_time", "Seconds per tool call", "seconds", ("tools/seconds_per_call",)),
    PlotSpec("kl", "KL to the reference model", "KL", ("kl",)),
    PlotSpec("entropy", "Policy entropy", "nats / token", ("entropy",)),
    PlotSpec("completion_length", "Completion length", "tokens", ("completions/mean_length",)),
    PlotSpec("clip_fractions", "Clipped tokens, truncated completions, zero-std groups", "fraction",
             ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
              "completions/clipped_ratio", "frac_reward_zero_std")),
    PlotSpec("throughput", "Throughput", "tokens / second", pattern=r"tokens_per_second/(.+)"),
    PlotSpec("step_time", "Time per step", "seconds", ("step_time",), pattern=r"time/(.+)"),
    PlotSpec("loss", "Loss", "loss", ("loss",)),
    PlotSpec("grad_norm", "Gradient norm", "norm", ("grad_norm",)),
    PlotSpec("learning_rate", "Learning rate", "learning rate", ("learning_rate",)),
    PlotSpec("memory", "Peak memory (CUDA: max allocated per step; CPU: process max RSS)", "GiB",
             ("peak_memory_gib",)),
    PlotSpec("mfu", "Model FLOPs utilisation", "fraction of peak", ("mfu",)),
)


@dataclass
class Run:
    """What one run directory holds."""

    directory: Path
    label: str
    metrics: list[dict[str, Any]]
    completions: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    def warnings(self) -> list[tuple[Any, str]]:
        """(step, line) of each learning-health warning the run gave (metrics.jsonl's `warnings`)."""
        return [(record.get("step"), str(line)) for record in self.metrics
                if isinstance(record.get("warnings"), list) for line in record["warnings"]]

    def first_evaluation(self) -> float | None:
        """The held-out accuracy logged before training (step 0): what summary.json's accuracy_before holds
        once the run ends."""
        return next((record["eval/accuracy"] for record in self.metrics
                     if record.get("step") == 0 and "eval/accuracy" in record), None)

    def series(self, name: str) -> tuple[list[float], list[float]]:
        """(steps, values) of one metric, leaving out steps where it is missing or non-finite."""
        steps, values = [], []
        for record in self.metrics:
            value, step = record.get(name), record.get("step")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                if isinstance(step, (int, float)):
                    steps.append(step)
                    values.append(float(value))
        return steps, values


def load_run(directory: Path, label: str) -> Run:
    directory = Path(directory)
    if not directory.is_dir():
        raise CohortError(f"run directory {directory} does not exist: pass the output_dir of `cohort-grpo train`")
    metrics_path = directory / METRICS_FILE
    if not metrics_path.is_file():
        raise CohortError(f"{metrics_path} is missing: pass a run directory written by `cohort-grpo train`")
    metrics = read_metrics(metrics_path)
    if not metrics:
        raise CohortError(f"{metrics_path} is empty: the run logged no steps; train for at least one step")
    summary: dict[str, Any] = {}
    summary_path = directory / "summary.json"
    if summary_path.is_file():
        try:
            summary = json.loads(summary_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            raise CohortError(f"{summary_path} is not valid JSON: delete it or rerun the training") from None
    return Run(directory, label, metrics, read_completions(directory), summary)


def _labels(directories: Sequence[Path]) -> list[str]:
    """Short names for the legend: the folder name, with its parent where two runs share a name."""
    names = [Path(d).resolve().name for d in directories]
    if len(set(names)) == len(names):
        return names
    return [f"{Path(d).resolve().parent.name}/{Path(d).resolve().name}" for d in directories]


def plot(spec: PlotSpec, runs: Sequence[Run], path: Path) -> list[dict[str, Any]]:
    """Draw `spec` for all runs into `path` (PNG of FIGURE_PIXELS). Returns the curves drawn, each
    `{"run", "metric", "label", "steps", "values"}`; an empty list (and no file) when no run has them."""
    available = {key for run in runs for record in run.metrics for key in record}
    names = spec.metric_names(available)
    lines = []  # (label, line style, steps, values); runs differ by line style too, so equal curves show
    drawn: list[dict[str, Any]] = []
    for run_index, run in enumerate(runs):
        for name in names:
            steps, values = run.series(name)
            if steps:
                parts = [run.label] if len(runs) > 1 else []
                parts += [spec.legend_name(name)] if len(names) > 1 else []
                style = LINE_STYLES[run_index % len(LINE_STYLES)]
                lines.append((" · ".join(parts) or name, style, steps, values))
                drawn.append({"run": run.label, "metric": name, "label": lines[-1][0], "steps": steps,
                              "values": values, "joined": spec.joined})
    if not lines:
        return []
    figure = Figure(figsize=FIGURE_INCHES, dpi=FIGURE_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    sparse = max(len(steps) for _, _, steps, _ in lines) <= 30  # few points: mark each one
    for index, (label, style, steps, values) in enumerate(lines):
        axes.plot(steps, values, color=f"C{index % 10}", linestyle=style if spec.joined else "none", label=label,
                  linewidth=1.8, marker="o" if sparse or not spec.joined else None,
                  markersize=3.5 if spec.joined else 6)
    axes.set_title(spec.title)
    axes.set_xlabel("step")
    axes.set_ylabel(spec.ylabel)
    axes.grid(True, alpha=0.3)
    if len(lines) > 1:
        axes.legend(fontsize="small")
    figure.savefig(path, format="png", metadata={"Software": None})  # no tool URL in the file
    return drawn


def _number(value: Any, digits: int = 4) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "–" if value is None else html.escape(str(value))
    if isinstance(value, float) and not math.isfinite(value):
        return "–"
    return f"{value:.{digits}g}"


# The two figures side by side measure different things; each column says which.
SUMMARY_NOTE = ("Accuracy: one greedy (temperature 0) completion per held-out question, right or wrong. Reward: "
                "the reward functions' weighted sum, averaged over a step's training completions, sampled at the "
                "run's temperature (1.0 unless set): another measure, not comparable with the accuracy.")


def _summary_table(runs: Sequence[Run]) -> str:
    # metrics.jsonl holds every logging_steps-th step: the first reward logged is that step's, said with it
    header = ("run", "steps", "seconds", "held-out accuracy before (greedy)", "held-out accuracy after (greedy)",
              "reward, sampled (first logged step)", "reward, sampled (last logged step)")
    rows = []
    for run in runs:
        steps, rewards = run.series("reward")
        rows.append((
            html.escape(run.label),
            _steps_cell(run),
            _number(run.summary.get("seconds")),
            _number(run.summary.get("accuracy_before", run.first_evaluation())),
            _number(run.summary.get("accuracy_after")),
            _at_step(rewards[0], steps[0]) if rewards else _number(None),
            _at_step(rewards[-1], steps[-1]) if rewards else _number(None),
        ))
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return (f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
            f"<p class='note'>{html.escape(SUMMARY_NOTE)}</p>")


def _warnings_section(runs: Sequence[Run]) -> str:
    """The learning-health warnings of each run that gave any (cohort_grpo/telemetry/health.py); nothing when none did."""
    items = [f"<li>{html.escape(run.label)}, step {_number(step)}: {html.escape(line)}</li>"
             for run in runs for step, line in run.warnings()]
    return f"<h2>Warnings</h2><ul>{''.join(items)}</ul>" if items else ""


def _steps_cell(run: Run) -> str:
    # summary.json is written when a run ends: without it, the run stopped (or still runs) at its last logged step
    if run.summary:
        return _number(run.summary.get("steps", run.metrics[-1].get("step")))
    return f"{_number(run.metrics[-1].get('step'))} <span class='note'>(unfinished: no summary.json)</span>"


def _at_step(value: float, step: float) -> str:
    return f"{_number(value)} <span class='note'>(step {_number(step)})</span>"


def _text(value: Any) -> str:
    """A prompt or completion as escaped text; a chat message list becomes its conversation, one line a turn,
    with the tool calls an assistant turn made and the tool each result came from."""
    if isinstance(value, list):
        value = "\n".join(line for m in value for line in _message_lines(m))
    text = "" if value is None else str(value)
    if len(text) > TEXT_LIMIT:
        text = text[:TEXT_LIMIT] + f" … [{len(text) - TEXT_LIMIT} more characters]"
    return html.escape(text)


def _message_lines(message: Any) -> list[str]:
    """`assistant: text`, `assistant: [calculator(expression='6*7')]` per call, `tool (calculator): 42`."""
    if not isinstance(message, dict):
        return [str(message)]
    role, content = message.get("role", "?"), message.get("content") or ""
    if role == "tool" and message.get("name"):
        role = f"tool ({message['name']})"
    calls = [call.get("function", call) for call in message.get("tool_calls") or [] if isinstance(call, dict)]
    lines = [f"{role}: {content}"] if content or not calls else []
    for call in calls:
        arguments = call.get("arguments")
        shown = (", ".join(f"{k}={v!r}" for k, v in arguments.items()) if isinstance(arguments, dict)
                 else "" if arguments is None else str(arguments))
        lines.append(f"{message.get('role', '?')}: [{call.get('name', '?')}({shown})]")
    return lines


def sample_completions(completions: list[dict[str, Any]], limit: int = COMPLETIONS_PER_RUN) -> list[dict]:
    """Up to `limit` completions: half from the first logged step, the rest from the last one."""
    if not completions:
        return []
    first_step, last_step = completions[0].get("step"), completions[-1].get("step")
    first = [row for row in completions if row.get("step") == first_step]
    last = [row for row in completions if row.get("step") == last_step] if last_step != first_step else []
    if not last:
        return first[:limit]
    return first[: limit // 2] + last[: limit - min(len(first), limit // 2)]


def _completions_section(run: Run) -> str:
    title = f"<h3>{html.escape(run.label)}</h3>"
    rows = sample_completions(run.completions)
    if not rows:
        return title + f"<p class='note'>No {COMPLETIONS_FILE} in this run.</p>"
    body = []
    for row in rows:
        rewards = row.get("rewards") or {}
        reward_text = "<br>".join(
            f"{html.escape(str(name))}: {_number(value, 3)}" for name, value in rewards.items()
        ) if isinstance(rewards, dict) else _number(rewards, 3)
        body.append(
            f"<tr><td>{_number(row.get('step'))}</td><td><pre>{_text(row.get('prompt'))}</pre></td>"
            f"<td><pre>{_text(row.get('completion'))}</pre></td><td>{reward_text}</td>"
            f"<td>{_number(row.get('advantage'), 3)}</td></tr>"
        )
    head = "<tr><th>step</th><th>prompt</th><th>completion</th><th>rewards</th><th>advantage</th></tr>"
    return title + f"<table class='completions'><thead>{head}</thead><tbody>{''.join(body)}</tbody></table>"


STYLE = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 2rem auto; max-width: 1400px;
       padding: 0 1rem; color: #1d2330; background: #fbfbfd; }
h1 { font-size: 1.6rem; } h2 { margin-top: 2.2rem; border-bottom: 2px solid #d8dce6; }
table { border-collapse: collapse; margin: 0.8rem 0; background: white; }
th, td { border: 1px solid #d8dce6; padding: 0.35rem 0.6rem; text-align: left; vertical-align: top; }
th { background: #eef1f7; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 1rem; }
.plots figure { margin: 0; background: white; border: 1px solid #d8dce6; padding: 0.4rem; }
.plots img { width: 100%; height: auto; }
pre { white-space: pre-wrap; word-break: break-word; margin: 0; max-width: 48rem; font-size: 0.85rem; }
.note { color: #5b6375; }
"""


def _page(runs: Sequence[Run], figures: list[tuple[str, bytes]], skipped: list[str]) -> str:
    names = ", ".join(run.label for run in runs)
    plots = "".join(
        f"<figure><img alt='{html.escape(title)}' src='data:image/png;base64,"
        f"{base64.b64encode(png).decode('ascii')}'></figure>"
        for title, png in figures
    )
    skipped_html = (
        "<p class='note'>Not plotted (no run logged these metrics): " + html.escape("; ".join(skipped)) + "</p>"
        if skipped else ""
    )
    completions = "".join(_completions_section(run) for run in runs)
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>cohort-grpo report: {html.escape(names)}</title><style>{STYLE}</style></head><body>"
        f"<h1>cohort-grpo report: {html.escape(names)}</h1>"
        f"<h2>Summary</h2>{_summary_table(runs)}{_warnings_section(runs)}"
        f"<h2>Training curves</h2><div class='plots'>{plots}</div>{skipped_html}"
        f"<h2>Sample completions</h2>{completions}"
        "</body></html>\n"
    )


def build_report(run_dirs: Sequence[str | Path], out_dir: str | Path | None = None) -> Path:
    """Write `<out_dir>/index.html`, one PNG per plotted metric group and `figures.json` (the data
    of every curve drawn, by PNG name, for checking or re-plotting); returns the HTML path.

    `out_dir` defaults to `<run>/report` for one run and `./report` for several.
    """
    if not run_dirs:
        raise CohortError("no run directory given: usage `cohort-grpo report RUN_DIR [RUN_DIR ...]`")
    directories = [Path(d) for d in run_dirs]
    runs = [load_run(d, label) for d, label in zip(directories, _labels(directories))]
    if out_dir is None:
        out_dir = directories[0] / "report" if len(directories) == 1 else Path("report")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures, skipped, data = [], [], {}
    for spec in PLOTS:
        png_path = out_dir / f"{spec.slug}.png"
        curves = plot(spec, runs, png_path)
        if curves:
            figures.append((spec.title, png_path.read_bytes()))
            data[png_path.name] = {"title": spec.title, "curves": curves}
        else:
            skipped.append(f"{spec.title} ({', '.join(spec.keys or (spec.pattern,))})")
            png_path.unlink(missing_ok=True)  # a stale PNG from an earlier report would mislead
    (out_dir / "figures.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    page_path = out_dir / "index.html"
    page_path.write_text(_page(runs, figures, skipped), encoding="utf-8")
    return page_path


def main(argv: Sequence[str] | None = None) -> int:
    """`cohort-grpo report RUN_DIR [RUN_DIR ...] [--out DIR]`; CohortError propagates to the CLI."""
    parser = argparse.ArgumentParser(
        prog="cohort-grpo report", description="Plot training runs into a self-contained HTML page and PNGs."
    )
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="output directories of `cohort-grpo train` (several: drawn on the same axes)")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="where to write index.html and the PNGs "
                             "(default: RUN_DIR/report for one run, ./report for several)")
    args = parser.parse_args(argv)
    page = build_report(args.run_dirs, args.out)
    print(f"report written to {page}")
    return 0
