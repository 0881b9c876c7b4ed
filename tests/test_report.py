"""`cohort-grpo report`: PNG curves that show the logged data, and a self-contained, escaped HTML page."""

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from cohort_grpo.errors import CohortError
from cohort_grpo.telemetry.metrics import MetricsLogger
from cohort_grpo.telemetry.report import FIGURE_PIXELS, build_report, main, sample_completions

STEPS = 40
EVIL_COMPLETION = "<script>alert('x')</script> & the answer is 4"


def write_run(directory: Path, reward_of_step, summary=None, completions=True, extra=None) -> Path:
    with MetricsLogger(directory) as logger:
        for step in range(1, STEPS + 1):
            reward = reward_of_step(step)
            metrics = {"reward": reward, "rewards/accuracy/mean": reward, "rewards/format/mean": 0.5,
                       "kl": 0.001 * step, "completions/mean_length": 100 - step, "step_time": 2.0}
            if step % 10 == 0:
                metrics["eval/accuracy"] = step / STEPS
            metrics.update((extra or {}).get(step, {}))
            logger.log(step, metrics)
            if completions and step in (1, STEPS):
                logger.log_completions(step, [
                    {"prompt": f"What is {step}+{i}?", "completion": EVIL_COMPLETION if i == 0 else f"{step + i}",
                     "rewards": {"accuracy": float(i % 2), "format": None}, "advantage": i - 1.5}
                    for i in range(4)
                ])
    if summary is not None:
        (directory / "summary.json").write_text(json.dumps(summary))
    return directory


def line_pixels(png: Path, colour: str, tolerance: float = 0.1):
    """(columns, mean row per column) of the pixels drawn in `colour`."""
    image = imread(png)[..., :3]
    mask = np.abs(image - np.array(to_rgb(colour))).max(axis=-1) < tolerance
    columns = np.nonzero(mask.any(axis=0))[0]
    rows = np.array([np.nonzero(mask[:, c])[0].mean() for c in columns])
    return columns, rows


def distinct_colours(image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct RGB colours of an image (packed into one integer each) and their pixel counts."""
    rgb = (image[..., :3] * 255).astype(np.uint32)
    return np.unique((rgb[..., 0] << 16 | rgb[..., 1] << 8 | rgb[..., 2]).ravel(), return_counts=True)


def straight_line_slope(columns, rows) -> float:
    """Slope (rows per column) of a least-squares line, asserting the pixels do lie on a line."""
    slope, intercept = np.polyfit(columns, rows, 1)
    residual = rows - (slope * columns + intercept)
    assert np.median(np.abs(residual)) < 3.0, "the drawn pixels are not a straight line"
    return slope


def test_rising_and_falling_rewards_are_drawn_as_such(tmp_path):
    rising = write_run(tmp_path / "rising", lambda s: s / STEPS)
    falling = write_run(tmp_path / "falling", lambda s: 1 - s / STEPS)
    up = build_report([rising]).parent / "reward.png"
    down = build_report([falling]).parent / "reward.png"
    assert up == rising / "report" / "reward.png"

    columns, rows = line_pixels(up, "C0")
    assert columns.max() - columns.min() > FIGURE_PIXELS[0] // 2  # the line spans the plot
    assert straight_line_slope(columns, rows) < -0.2  # image rows count downwards: the line rises
    columns, rows = line_pixels(down, "C0")
    assert straight_line_slope(columns, rows) > 0.2
    assert not np.array_equal(imread(up), imread(down))


def test_pngs_are_images_of_the_documented_size(tmp_path):
    run = write_run(tmp_path / "run", lambda s: (s / STEPS) ** 2)
    page = build_report([run], tmp_path / "out")
    pngs = sorted(page.parent.glob("*.png"))
    assert {p.stem for p in pngs} >= {"reward", "reward_per_function", "accuracy", "kl", "completion_length",
                                       "step_time"}
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = imread(png)
        assert image.shape[:2] == (FIGURE_PIXELS[1], FIGURE_PIXELS[0]), png.name
        colours, _ = distinct_colours(image)
        assert len(colours) > 20, f"{png.name} looks blank"


def test_several_runs_share_the_axes(tmp_path):
    a = write_run(tmp_path / "a", lambda s: s / STEPS)
    b = write_run(tmp_path / "b", lambda s: 0.5 - s / (2 * STEPS))
    page = build_report([a, b], tmp_path / "both")
    # run a is the first line (C0, rising); run b the second (C1, falling), on the same axes
    columns, rows = line_pixels(page.parent / "reward.png", "C0")
    left, right = columns < np.percentile(columns, 33), columns > np.percentile(columns, 67)
    assert np.median(rows[left]) > np.median(rows[right]) + 50
    columns, rows = line_pixels(page.parent / "reward.png", "C1")
    left, right = columns < np.percentile(columns, 33), columns > np.percentile(columns, 67)
    assert np.median(rows[left]) + 50 < np.median(rows[right])
    text = page.read_text()
    assert "cohort-grpo report: a, b" in text


def test_default_output_dir_for_several_runs_is_cwd_report(tmp_path, monkeypatch):
    a = write_run(tmp_path / "x" / "run", lambda s: s / STEPS)
    b = write_run(tmp_path / "y" / "run", lambda s: s / STEPS)
    monkeypatch.chdir(tmp_path)
    page = build_report([a, b])
    assert page.resolve() == (tmp_path / "report" / "index.html").resolve()
    assert "x/run" in page.read_text() and "y/run" in page.read_text()  # equal names get their parent


def test_html_is_self_contained_and_escaped(tmp_path):
    run = write_run(tmp_path / "run", lambda s: s / STEPS,
                    summary={"accuracy_before": 0.125, "accuracy_after": 0.875, "seconds": 61.5, "steps": STEPS})
    page = build_report([run])
    text = page.read_text(encoding="utf-8")
    assert "http://" not in text and "https://" not in text
    sources = re.findall(r"""(?:src|href)\s*=\s*['"]([^'"]*)""", text, flags=re.IGNORECASE)
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources)
    assert "<link" not in text and "@import" not in text and "url(" not in text
    # the embedded images are exactly the PNG files written beside the page
    embedded = {base64.b64decode(s.split(",", 1)[1]) for s in sources}
    assert embedded == {p.read_bytes() for p in page.parent.glob("*.png")}
    # completion text is escaped: the page has no script element at all
    assert "<script" not in text.lower()
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; the answer is 4" in text
    for value in ("0.125", "0.875", "61.5"):
        assert value in text


def test_missing_metrics_are_skipped_and_said_so(tmp_path):
    run = write_run(tmp_path / "run", lambda s: s / STEPS)
    page = build_report([run])
    text = page.read_text()
    assert not (page.parent / "entropy.png").exists()
    skipped = re.search(r"Not plotted[^<]*", text).group(0)
    assert "entropy" in skipped and "clip_ratio/low_mean" in skipped
    assert "kl" not in re.findall(r"\((\w+)\)", skipped)  # kl was logged, so it is plotted


def test_nan_steps_are_left_out_of_the_curve(tmp_path):
    entropy = {5: {"entropy": float("nan")}, 6: {"entropy": 1.0}}
    run = write_run(tmp_path / "run", lambda s: s / STEPS, extra=entropy)
    page = build_report([run])
    assert (page.parent / "entropy.png").exists()  # one finite point is enough to draw


def test_empty_or_missing_metrics_raise_cohort_error_naming_the_file(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(CohortError, match=r"empty.metrics\.jsonl is empty"):
        build_report([tmp_path / "empty"])
    (tmp_path / "nothing").mkdir()
    with pytest.raises(CohortError, match=r"nothing.metrics\.jsonl is missing"):
        build_report([tmp_path / "nothing"])
    with pytest.raises(CohortError, match="does not exist"):
        build_report([tmp_path / "absent"])
    with pytest.raises(CohortError, match="no run directory"):
        build_report([])


def test_sample_completions_come_from_first_and_last_step():
    rows = [{"step": step, "i": i} for step in (1, 2, 3) for i in range(6)]
    picked = sample_completions(rows, limit=8)
    assert [r["step"] for r in picked] == [1] * 4 + [3] * 4
    assert [r["step"] for r in sample_completions(rows[:6], limit=4)] == [1] * 4


def test_main_writes_to_out(tmp_path, capsys):
    run = write_run(tmp_path / "run", lambda s: s / STEPS, completions=False)
    assert main([str(run), "--out", str(tmp_path / "custom")]) == 0
    assert (tmp_path / "custom" / "index.html").is_file()
    assert str(tmp_path / "custom" / "index.html") in capsys.readouterr().out
    assert "No completions.jsonl" in (tmp_path / "custom" / "index.html").read_text()


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_page_renders_in_headless_chromium(tmp_path):
    page = build_report([write_run(tmp_path / "run", lambda s: s / STEPS)])
    screenshot = tmp_path / "screenshot.png"
    subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={screenshot}", "--window-size=1200,2000",
         page.resolve().as_uri()],
        capture_output=True, timeout=120, check=True,
    )
    image = imread(screenshot)[..., :3]
    colours, counts = distinct_colours(image)
    assert len(colours) > 200, "the screenshot is (nearly) blank"
    assert counts.max() < 0.95 * counts.sum()
    # the embedded PNGs were decoded and drawn: the reward line's blue is on screen
    blue = np.abs(image - np.array(to_rgb("C0"))).max(axis=-1) < 0.1
    assert blue.sum() > 500


def test_each_figure_holds_exactly_the_logged_series(tmp_path):
    """figures.json (the data behind every PNG) equals what metrics.jsonl says, read here with plain json."""
    a = write_run(tmp_path / "a", lambda s: s / STEPS, extra={7: {"kl": float("nan")}})
    b = write_run(tmp_path / "b", lambda s: 1 - s / STEPS)
    page = build_report([a, b], tmp_path / "both")
    figures = json.loads((page.parent / "figures.json").read_text())
    assert set(figures) == {p.name for p in page.parent.glob("*.png")}
    logged = {run.name: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
              for run in (a, b)}
    checked = 0
    for name, figure in figures.items():
        for curve in figure["curves"]:
            records = [r for r in logged[curve["run"]] if r.get(curve["metric"]) is not None]
            assert curve["steps"] == [r["step"] for r in records], (name, curve["metric"])
            assert curve["values"] == pytest.approx([r[curve["metric"]] for r in records]), (name, curve["metric"])
            checked += 1
    assert checked >= 2 * 6  # both runs, every figure
    kl_a = next(c for c in figures["kl.png"]["curves"] if c["run"] == "a")
    assert 7 not in kl_a["steps"] and len(kl_a["steps"]) == STEPS - 1  # the NaN step is left out
    per_function = {(c["run"], c["metric"]) for c in figures["reward_per_function.png"]["curves"]}
    assert per_function == {(r, f"rewards/{f}/mean") for r in ("a", "b") for f in ("accuracy", "format")}


def test_a_tool_run_shows_its_tool_curves_and_its_conversations(tmp_path):
    """tools/* are drawn, and a completion shows the calls it made, not only the results it got back."""
    tool_metrics = {step: {"tools/call_frequency": 1 + step / STEPS, "tools/turns": 1.0,
                           "tools/failure_frequency": 0.5 / step, "tools/seconds_per_call": 0.01}
                    for step in range(1, STEPS + 1)}
    run = write_run(tmp_path / "tools", lambda s: s / STEPS, completions=False, extra=tool_metrics)
    conversation = [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "347*2891"}}}]},
        {"role": "tool", "name": "calculator", "content": "1003177"},
        {"role": "assistant", "content": "It is 1003177."},
    ]
    with MetricsLogger(run) as logger:
        logger.log_completions(STEPS, [{"prompt": [{"role": "user", "content": "What is 347*2891?"}],
                                        "completion": conversation, "rewards": {"accuracy": 1.0}, "advantage": 0.5}])
    page = build_report([run])
    figures = json.loads((page.parent / "figures.json").read_text())
    drawn = {c["metric"] for name in ("tool_calls.png", "tool_failures.png", "tool_time.png")
             for c in figures[name]["curves"]}
    assert drawn == set(tool_metrics[1])
    text = page.read_text()
    assert ("user: What is 347*2891?</pre></td><td><pre>assistant: [calculator(expression=&#x27;347*2891&#x27;)]\n"
            "tool (calculator): 1003177\nassistant: It is 1003177.</pre>") in text


def test_summary_rewards_name_the_steps_they_were_logged_at(tmp_path):
    with MetricsLogger(tmp_path / "run") as logger:
        for step in (10, 20, 30):
            logger.log(step, {"reward": step / 100})
    text = build_report([tmp_path / "run"]).read_text()
    assert "reward, sampled (first logged step)" in text
    assert "<td>0.1 <span class='note'>(step 10)</span></td><td>0.3 <span class='note'>(step 30)</span></td>" in text


def test_two_evaluations_are_two_points_not_a_line(tmp_path):
    """A run evaluated before and after training: the accuracy figure marks the two values and draws no line
    between them, which would show progress that nobody measured."""
    with MetricsLogger(tmp_path / "run") as logger:
        for step in range(1, STEPS + 1):
            logger.log(step, {"reward": 0.5, **({"eval/accuracy": step / STEPS} if step in (1, STEPS) else {})})
    page = build_report([tmp_path / "run"])
    columns, _ = line_pixels(page.parent / "accuracy.png", "C0")
    gaps = np.diff(columns)
    assert len(columns) and gaps.max() > FIGURE_PIXELS[0] // 2  # two marks at the ends, nothing in between
    assert len(columns) < 40
    figures = json.loads((page.parent / "figures.json").read_text())
    assert [c["joined"] for c in figures["accuracy.png"]["curves"]] == [False]
    assert [c["joined"] for c in figures["reward.png"]["curves"]] == [True]


def test_a_run_stopped_mid_write_shows_its_first_evaluation_and_says_it_is_unfinished(tmp_path):
    """A crash leaves no summary.json and may cut metrics.jsonl's last line: the accuracy before training is
    still the step-0 evaluation the run logged, the cut line is left out, and the table says the run did not end."""
    run = tmp_path / "run"
    with MetricsLogger(run) as logger:
        logger.log(0, {"eval/accuracy": 0.25})
        for step in (1, 2, 3):
            logger.log(step, {"reward": step / 10})
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 4, "reward": 0.')  # killed while writing step 4
    text = build_report([run]).read_text()
    row = re.search(r"<tbody><tr>(.*?)</tr>", text).group(1)
    cells = re.findall(r"<td>(.*?)</td>", row)
    assert cells[1] == "3 <span class='note'>(unfinished: no summary.json)</span>"
    assert cells[3] == "0.25" and cells[4] == "–"  # before: the step-0 evaluation; after: never measured
    finished = write_run(tmp_path / "done", lambda step: 0.5, summary={"steps": 40, "seconds": 9.0,
                                                                      "accuracy_before": 0.1, "accuracy_after": 0.2})
    cells = re.findall(r"<td>(.*?)</td>", re.search(r"<tbody><tr>(.*?)</tr>", build_report([finished]).read_text()).group(1))
    assert cells[1:5] == ["40", "9", "0.1", "0.2"]
