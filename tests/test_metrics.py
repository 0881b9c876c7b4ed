"""metrics.jsonl / completions.jsonl writing and reading, and the progress display's plain-text mode."""

import io
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cohort.errors import CohortError
from cohort.metrics import MetricsLogger, parse_report_to, read_completions, read_metrics
from cohort.progress import Progress

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_metrics_round_trip_with_nan_and_inf_as_null(tmp_path):
    logged = [
        {"reward": 0.25, "kl": float("nan"), "loss": torch.tensor(1.5), "grad_norm": np.float32(0.75)},
        {"reward": 0.5, "kl": float("inf"), "loss": -float("inf"), "completions/mean_length": np.int64(17)},
        {"reward": 1.0, "rewards/format/mean": 0.125, "eval/accuracy": None},
    ]
    before = time.time()
    with MetricsLogger(tmp_path) as logger:
        for step, metrics in enumerate(logged, start=1):
            logger.log(step, metrics)
    after = time.time()

    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    for record, metrics in zip(records, logged):
        assert before <= record["time"] <= after
        assert set(record) == {"step", "time", *metrics}
        for name, value in metrics.items():
            value = None if value is None else float(value)
            if value is None or not math.isfinite(value):
                assert record[name] is None, name
            else:
                assert record[name] == pytest.approx(value), name
    # the file itself is strict JSON: no NaN / Infinity tokens, one object per line
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert [json.loads(line)["step"] for line in text.splitlines()] == [1, 2, 3]


def test_read_metrics_drops_truncated_last_line_but_rejects_corrupt_middle(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"reward": 0.1})
        logger.log(2, {"reward": 0.2})
    path = tmp_path / "metrics.jsonl"
    complete = path.read_text()
    path.write_text(complete + '{"step": 3, "time": 17.5, "rew')  # killed mid-write
    assert [r["reward"] for r in read_metrics(tmp_path)] == [0.1, 0.2]
    assert [r["reward"] for r in read_metrics(path)] == [0.1, 0.2]  # a file path works too

    lines = complete.splitlines()
    path.write_text(lines[0][:10] + "\n" + lines[1] + "\n")
    with pytest.raises(CohortError, match=r"metrics\.jsonl line 1"):
        read_metrics(tmp_path)


def test_missing_metrics_file_is_a_cohort_error_naming_it(tmp_path):
    with pytest.raises(CohortError, match="metrics.jsonl"):
        read_metrics(tmp_path / "nowhere")


def test_every_line_survives_a_killed_process(tmp_path):
    """The logger is never closed and the process dies without cleanup: all logged steps are on disk."""
    script = textwrap.dedent(f"""
        import os
        from cohort.metrics import MetricsLogger
        logger = MetricsLogger({str(tmp_path)!r})
        for step in range(1, 6):
            logger.log(step, {{"reward": step / 10}})
        row = {{"prompt": "p", "completion": "c", "rewards": {{"f": 1.0}}, "advantage": 0.0}}
        logger.log_completions(5, [row])
        os._exit(9)
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, timeout=120)
    assert result.returncode == 9, result.stderr.decode()
    assert [r["reward"] for r in read_metrics(tmp_path)] == [0.1, 0.2, 0.3, 0.4, 0.5]
    assert len(read_completions(tmp_path)) == 1


def test_completions_round_trip(tmp_path):
    rows = [
        {"prompt": "What is 2+2?", "completion": "<think>2+2</think> 4 ✓",
         "rewards": {"accuracy": 1.0, "format": None},
         "advantage": 0.7071},
        {"prompt": [{"role": "user", "content": "hi"}], "completion": "", "rewards": {"accuracy": float("nan")},
         "advantage": torch.tensor(-0.5)},
    ]
    with MetricsLogger(tmp_path) as logger:
        logger.log_completions(4, rows)
        logger.log_completions(5, [])
    records = read_completions(tmp_path)
    assert [r["step"] for r in records] == [4, 4]
    assert records[0]["completion"] == rows[0]["completion"]
    assert records[0]["rewards"] == {"accuracy": 1.0, "format": None}
    assert records[1]["prompt"] == rows[1]["prompt"]
    assert records[1]["rewards"] == {"accuracy": None}
    assert records[1]["advantage"] == -0.5
    assert read_completions(tmp_path / "other") == []


def test_report_to_parsing():
    assert parse_report_to("none") == set()
    assert parse_report_to(None) == set()
    assert parse_report_to("all") == {"tensorboard", "wandb"}
    assert parse_report_to("tensorboard, wandb") == {"tensorboard", "wandb"}
    assert parse_report_to(["tensorboard"]) == {"tensorboard"}
    with pytest.raises(CohortError, match="mlflow"):
        parse_report_to("mlflow")


def test_unavailable_backends_give_one_notice_each_and_jsonl_still_works(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    monkeypatch.setitem(sys.modules, "wandb", None)
    with MetricsLogger(tmp_path, report_to=["tensorboard", "wandb"]) as logger:
        logger.log(1, {"reward": 1.0})
    assert len(logger.notices) == 2
    assert "tensorboard" in logger.notices[0].lower() and "wandb" in logger.notices[1].lower()
    assert capsys.readouterr().err.count("\n") == 2
    assert read_metrics(tmp_path)[0]["reward"] == 1.0


def test_tensorboard_writes_event_files_when_installed(tmp_path):
    pytest.importorskip("torch.utils.tensorboard", reason="tensorboard is not installed")
    with MetricsLogger(tmp_path, report_to="tensorboard") as logger:
        logger.log(1, {"reward": 1.0, "kl": float("nan")})
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


# -- progress display ---------------------------------------------------------------------------------

PROGRESS_SCRIPT = """
import sys
from cohort.progress import Progress
quiet = sys.argv[1] == "quiet"
with Progress(total_steps=3, quiet=quiet) as progress:
    for step in range(1, 4):
        with progress.phase("sampling", total=4, unit="seq"):
            progress.advance("sampling", 4)
        with progress.phase("rewards"):
            pass
        progress.step_done(step, f"Step {step}/3: Loss=0.0{step}23, Success=62.50%, μ_iters=2")
    progress.print("[bold]done[/bold]")
"""


@pytest.mark.parametrize("mode", ["quiet", "auto"])
def test_progress_to_a_pipe_prints_only_plain_lines(mode):
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONIOENCODING"] = "utf-8"
    result = subprocess.run([sys.executable, "-c", PROGRESS_SCRIPT, mode], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    out = result.stdout.decode("utf-8")
    assert out.splitlines() == [f"Step {s}/3: Loss=0.0{s}23, Success=62.50%, μ_iters=2" for s in (1, 2, 3)] + [
        "[bold]done[/bold]"]  # printed as is: no markup, no ANSI escape codes, no bars
    assert "\x1b" not in out


class _FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_on_a_terminal_shows_bars_and_lines(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("TERM", raising=False)
    terminal = _FakeTerminal()
    with Progress(total_steps=2, file=terminal) as progress:
        assert progress.live
        with progress.phase("sampling", total=8, unit="seq"):
            for _ in range(4):  # rich needs two samples to estimate a rate
                time.sleep(0.01)
                progress.advance("sampling", 2)
        progress.step_done(1, "Step 1/2: Loss=0.5")
    out = terminal.getvalue()
    assert "Step 1/2: Loss=0.5" in out and "sampling" in out and "seq/s" in out
    assert progress.durations["sampling"] >= 0


def test_progress_in_ci_is_plain_even_on_a_terminal(monkeypatch):
    monkeypatch.setenv("CI", "true")
    terminal = _FakeTerminal()
    with Progress(total_steps=1, file=terminal) as progress:
        with progress.phase("update", total=2):
            progress.advance("update", 2)
        progress.step_done(1, "Step 1/1: Loss=0.1")
    assert not progress.live
    assert terminal.getvalue() == "Step 1/1: Loss=0.1\n"


def test_progress_survives_a_closed_pipe(tmp_path):
    """`cohort train | head -1`: the reader leaves, training goes on and exits cleanly."""
    finished = tmp_path / "finished"
    script = textwrap.dedent(f"""
        import sys
        from cohort.progress import Progress
        with Progress(total_steps=50) as progress:
            progress.step_done(1, "Step 1/50")
            sys.stdin.readline()  # wait until the reader has closed its end
            for step in range(2, 51):
                progress.step_done(step, f"Step {{step}}/50")
        open({str(finished)!r}, "w").close()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout.readline() == b"Step 1/50\n"
    child.stdout.close()
    child.stdin.write(b"go\n")
    child.stdin.close()
    stderr = child.stderr.read().decode()
    assert child.wait(timeout=120) == 0, stderr
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr
    assert finished.exists()


class _FakeWandb:
    """Stands in for the `wandb` module: records what the logger sends."""

    def __init__(self, api_key):
        self.api = type("Api", (), {"api_key": api_key})()
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def finish(self):
        self.finished += 1


def test_wandb_gets_finite_metrics_when_configured(tmp_path, monkeypatch):
    fake = _FakeWandb(api_key=None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    with MetricsLogger(tmp_path, report_to="wandb", run_name="exp1") as logger:
        logger.log(3, {"reward": 0.5, "kl": float("nan")})
    assert fake.inits[0]["name"] == "exp1" and fake.inits[0]["dir"] == str(tmp_path)
    assert fake.logged == [(3, {"reward": 0.5})]  # NaN is not sent; step is W&B's step
    assert fake.finished == 1 and logger.notices == []


def test_wandb_without_login_is_skipped_with_a_notice(tmp_path, monkeypatch):
    fake = _FakeWandb(api_key=None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with MetricsLogger(tmp_path, report_to="wandb") as logger:
        logger.log(1, {"reward": 0.5})
    assert fake.inits == [] and len(logger.notices) == 1 and "WANDB_API_KEY" in logger.notices[0]
