"""metrics.jsonl / completions.jsonl writing and reading, and the progress display's plain-text mode."""

import html
import io
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.telemetry.metrics import MetricsLogger, parse_report_to, read_completions, read_metrics
from cohort_grpo.telemetry.progress import Progress

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
        from cohort_grpo.telemetry.metrics import MetricsLogger
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


def test_a_named_backend_that_is_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(CohortError, match=r"tensorboard, which is not installed: `pip install tensorboard`"):
        MetricsLogger(tmp_path / "a", report_to="tensorboard")
    with pytest.raises(CohortError, match=r"wandb, which is not installed: `pip install wandb`"):
        MetricsLogger(tmp_path / "b", report_to=["wandb"])


def test_report_to_all_skips_missing_backends_with_one_notice_each(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with MetricsLogger(tmp_path, report_to="all") as logger:
        logger.log(1, {"reward": 1.0})
    assert len(logger.notices) == 2
    assert "tensorboard" in logger.notices[0].lower() and "wandb" in logger.notices[1].lower()
    assert capsys.readouterr().err.count("\n") == 2
    assert read_metrics(tmp_path)[0]["reward"] == 1.0


def test_tensorboard_writes_event_files_when_installed(tmp_path):
    pytest.importorskip("torch.utils.tensorboard",
                        reason="tensorboard is not installed (pip install -e '.[test]' installs it)")
    with MetricsLogger(tmp_path, report_to="tensorboard") as logger:
        logger.log(1, {"reward": 1.0, "kl": float("nan")})
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


# -- progress display ---------------------------------------------------------------------------------

PROGRESS_SCRIPT = """
import sys
from cohort_grpo.telemetry.progress import Progress
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
    lines = out.splitlines()
    assert [re.sub(r", eta \d+:\d\d:\d\d$", "", line) for line in lines] == [
        f"Step {s}/3: Loss=0.0{s}23, Success=62.50%, μ_iters=2" for s in (1, 2, 3)] + [
        "[bold]done[/bold]"]  # printed as is: no markup, no ANSI escape codes, no bars
    # the time left, at the pace since the first step: not after the first one, nor at the end
    assert [bool(re.search(r", eta \d+:\d\d:\d\d$", line)) for line in lines[:3]] == [False, True, False]
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
        started = time.perf_counter()
        with progress.phase("sampling", total=8, unit="seq"):
            for _ in range(4):  # rich needs two samples to estimate a rate
                time.sleep(0.01)
                progress.advance("sampling", 2)
        elapsed = time.perf_counter() - started
        progress.step_done(1, "Step 1/2: Loss=0.5")
    out = terminal.getvalue()
    assert "Step 1/2: Loss=0.5" in out and "sampling" in out and "seq/s" in out
    assert 0.04 <= progress.durations["sampling"] <= elapsed  # the block's own wall time: four 10 ms sleeps


def test_phase_bars_show_measured_rates_and_an_eta_from_the_last_run(monkeypatch):
    from cohort_grpo.telemetry.progress import _EtaColumn, _RateColumn

    monkeypatch.delenv("CI", raising=False)
    with Progress(total_steps=2, file=_FakeTerminal()) as progress:
        with progress.phase("sampling"):  # one opaque call: no advances, so rich has no rate of its own
            time.sleep(0.02)
        rates = progress.show_rates(progress.durations, {"sampling": (1000, "tok"), "update": (5, "tok")})
        assert rates == {"sampling": pytest.approx(1000 / progress.durations["sampling"])}  # update never ran
        bar = progress._task(progress._bar_ids["sampling"])
        assert _RateColumn().render(bar).plain == f"{rates['sampling']:,.1f} tok/s"
        assert _EtaColumn().render(bar).plain == "0:00:00"  # finished
        progress.durations["sampling"] = 125.0  # as if the last sampling phase took 2 min 5 s
        with progress.phase("sampling"):
            bar = progress._task(progress._bar_ids["sampling"])
            assert bar.fields["expected"] == 125.0
            assert _EtaColumn().render(bar).plain in ("0:02:05", "0:02:04")
            assert _RateColumn().render(bar).plain.endswith("tok/s")  # the last run's rate stays shown


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
    """`cohort-grpo train | head -1`: the reader leaves, training goes on and exits cleanly."""
    finished = tmp_path / "finished"
    script = textwrap.dedent(f"""
        import sys
        from cohort_grpo.telemetry.progress import Progress
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


def test_wandb_without_login_is_an_error_naming_the_fix(tmp_path, monkeypatch):
    fake = _FakeWandb(api_key=None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with pytest.raises(CohortError, match="WANDB_API_KEY"):
        MetricsLogger(tmp_path, report_to="wandb")
    assert fake.inits == []
    monkeypatch.setenv("WANDB_MODE", "offline")  # offline runs need no login
    with MetricsLogger(tmp_path, report_to="wandb") as logger:
        logger.log(1, {"reward": 0.5})
    assert fake.logged == [(1, {"reward": 0.5})]


# -- every metric of a tiny training run, present and meaning what it says ---------------------------

G, BATCH, MAX_NEW = 4, 8, 4


def first_is_digit(prompts, completions, completion_ids=None, **_):
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]


def has_space(prompts, completions, completion_ids=None, **_):
    return [1.0 if " " in c else 0.0 for c in completions]


def held_out_rows() -> list[dict]:
    from cohort_grpo.tasks import get_task

    return get_task("arithmetic").load("test", levels=[2], size=6, seed=0)


def greedy_eval(model_dir, rows: list[dict], max_new_tokens: int) -> tuple[float, float, float]:
    """(accuracy, format rate, mean length in tokens) of greedy completions from transformers' own
    `generate`, each answer read from its tags and checked against the question's sum by plain Python."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    correct = tagged = length = 0
    for row in rows:
        a, b = row["question"].split("+")  # level 2: two digits + one digit
        ids = torch.tensor([tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        new = out[0, ids.shape[1]:].tolist()
        text = tokenizer.decode(new, skip_special_tokens=True)
        match = re.search(r"<answer>(.*?)</answer>", text, re.DOTALL)
        tagged += match is not None
        correct += match is not None and match.group(1).strip() == str(int(a) + int(b))
        length += len(new)  # the EOS token, when generated, counts
    return correct / len(rows), tagged / len(rows), length / len(rows)


def tiny_run(tiny_dir, output_dir, **overrides):
    """Train 3 steps; returns (trainer, history, rollouts captured from the sampler, one per step)."""
    from cohort_grpo import GRPOConfig, GRPOTrainer
    from cohort_grpo.tasks import get_task

    torch.set_num_threads(1)
    task = get_task("arithmetic")
    rows = task.load("train", levels=[2], size=64, seed=0)
    held_out = held_out_rows()
    args = dict(num_generations=G, per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
                max_completion_length=MAX_NEW, max_steps=3, learning_rate=3e-3, output_dir=str(output_dir),
                quiet=True, seed=0, beta=0.1, log_completions_steps=1, temperature=1.0)
    args.update(overrides)
    trainer = GRPOTrainer(tiny_dir, [first_is_digit, has_space], rows, args=GRPOConfig(**args),
                          eval_dataset=held_out, task=task)
    rollouts, generate = [], trainer.sampler.generate

    def capturing_generate(prompt_ids, num_generations, params):
        rollout = generate(prompt_ids, num_generations, params)
        if num_generations == G:  # training rollouts, not the greedy evaluation
            rollouts.append(rollout)
        return rollout

    trainer.sampler.generate = capturing_generate
    trainer.train()
    history = trainer.history
    return trainer, history, rollouts


@pytest.fixture(scope="module")
def kl_run(tiny_dir, tmp_path_factory):
    """β > 0, μ = 1."""
    return tiny_run(tiny_dir, tmp_path_factory.mktemp("kl_run"))


def on_cpu(run, tiny_dir, folder, **overrides):
    """`run` where it ran on the CPU; with the GPU visible (COHORT_TEST_GPU=1), the same run made on the CPU."""
    if run[0].device.type == "cpu":
        return run
    return tiny_run(tiny_dir, folder, device="cpu", **overrides)


@pytest.fixture(scope="module")
def kl_run_on_cpu(kl_run, tiny_dir, tmp_path_factory):
    return on_cpu(kl_run, tiny_dir, tmp_path_factory.mktemp("kl_run_cpu"))


# β = 0, μ = 2 with a tight clip range and a large step, so the second update clips.
CLIP_RUN = dict(beta=0.0, num_iterations=2, epsilon=0.01, learning_rate=3e-2)


@pytest.fixture(scope="module")
def clip_run_on_cpu(clip_run, tiny_dir, tmp_path_factory):
    return on_cpu(clip_run, tiny_dir, tmp_path_factory.mktemp("clip_run_cpu"), **CLIP_RUN)


@pytest.fixture(scope="module")
def clip_run(tiny_dir, tmp_path_factory):
    """β = 0, μ = 2 with a tight clip range and a large step, so the second update clips."""
    return tiny_run(tiny_dir, tmp_path_factory.mktemp("clip_run"), **CLIP_RUN)


ISSUE_METRICS = ("reward", "reward_std", "rewards/first_is_digit/mean", "rewards/first_is_digit/std",
                 "rewards/has_space/mean", "rewards/has_space/std", "frac_reward_zero_std", "kl", "entropy",
                 "clip_ratio/low_mean", "clip_ratio/high_mean", "completions/mean_length",
                 "completions/clipped_ratio", "step_time", "informative", "tokens_per_second/sampling",
                 "tokens_per_second/logprobs", "tokens_per_second/update", "peak_memory_gib", "mfu")


@pytest.mark.cpu("which metrics a CPU run leaves empty (a GPU run logs MFU and CUDA memory too)")
@pytest.mark.slow
def test_every_metric_of_the_issue_is_logged_each_step(kl_run_on_cpu, tiny_dir):
    trainer, _, _ = kl_run_on_cpu
    records = read_metrics(trainer.args.output_dir)
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        missing = [name for name in ISSUE_METRICS if name not in record]
        assert not missing, missing
        assert record["mfu"] is None  # CPU: no peak FLOP/s to divide by
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3]  # before training and after the last step
    summary = json.loads((Path(trainer.args.output_dir) / "summary.json").read_text())
    assert [r["eval/accuracy"] for r in evals] == [summary["accuracy_before"], summary["accuracy_after"]]
    # recomputed with transformers' greedy generate from the initial and the saved final model
    for record, model_dir in zip(evals, (tiny_dir, trainer.args.output_dir)):
        accuracy, format_rate, mean_length = greedy_eval(model_dir, held_out_rows(), MAX_NEW)
        assert record["eval/accuracy"] == pytest.approx(accuracy)
        assert record["eval/format_rate"] == pytest.approx(format_rate)
        assert record["eval/mean_length"] == pytest.approx(mean_length)


def test_reward_statistics_match_the_logged_completions(kl_run):
    """Recomputed from completions.jsonl (every completion of each step is logged here, in group order)."""
    trainer, _, _ = kl_run
    records = {r["step"]: r for r in read_metrics(trainer.args.output_dir) if "reward" in r}
    completions = read_completions(trainer.args.output_dir)
    for step, record in records.items():
        rows = [c for c in completions if c["step"] == step]
        assert len(rows) == BATCH
        rewards = np.array([c["rewards"]["first_is_digit"] + c["rewards"]["has_space"] for c in rows])
        assert rewards == pytest.approx([c["reward"] for c in rows])
        groups = rewards.reshape(-1, G)
        all_equal = np.array([len(set(g)) == 1 for g in groups])
        assert record["frac_reward_zero_std"] == pytest.approx(all_equal.mean())
        assert record["informative"] == pytest.approx(1 - all_equal.mean())
        assert record["reward"] == pytest.approx(rewards.mean())
        assert record["reward_std"] == pytest.approx(groups.std(axis=1, ddof=1).mean(), abs=1e-6)
        for name in ("first_is_digit", "has_space"):
            scores = np.array([c["rewards"][name] for c in rows])
            assert record[f"rewards/{name}/mean"] == pytest.approx(scores.mean())
            assert record[f"rewards/{name}/std"] == pytest.approx(scores.std(ddof=1), abs=1e-6)  # unbiased, as TRL
            assert all(c["completion"][:1].isdigit() == bool(c["rewards"]["first_is_digit"]) for c in rows)


def test_length_clipping_and_throughput_match_the_rollouts(kl_run):
    trainer, _, rollouts = kl_run
    records = [r for r in read_metrics(trainer.args.output_dir) if "reward" in r]
    assert len(rollouts) == len(records) == 3
    for record, rollout in zip(records, rollouts):
        lengths = rollout.completion_mask.sum(dim=1).float()
        assert record["completions/mean_length"] == pytest.approx(float(lengths.mean()))
        truncated = [not bool((ids[:int(n)] == trainer.tokenizer.eos_token_id).any())
                     for ids, n in zip(rollout.completion_ids, lengths)]
        assert record["completions/clipped_ratio"] == pytest.approx(np.mean(truncated))
        assert record["tokens_per_second/sampling"] == pytest.approx(float(lengths.sum()) / record["time/sampling"])
        phases = sum(record[f"time/{p}"] for p in ("sampling", "rewards", "logprobs", "update"))
        assert phases <= record["step_time"] + 1e-6


def test_kl_is_zero_when_the_reference_equals_the_policy_then_positive(kl_run, clip_run):
    records = [r for r in read_metrics(kl_run[0].args.output_dir) if "reward" in r]
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # step 1: π_ref is a copy of π_θ
    assert all(r["kl"] >= 0 for r in records)  # the k3 estimator is non-negative
    assert records[-1]["kl"] > 1e-6  # the policy has moved away from the reference
    clip_records = [r for r in read_metrics(clip_run[0].args.output_dir) if "reward" in r]
    assert all("kl" not in r for r in clip_records)  # β = 0: there is no reference model


# A module's runs are built before a test's `cpu` marker takes effect: a test of CPU numbers takes the runs
# made on the CPU (the same runs, when no GPU is visible).
@pytest.mark.cpu("only the second of μ = 2 passes can clip at ε = 0.01: in bf16 the first pass's ρ is off 1 by "
                 "more than that")
def test_clip_ratios_are_zero_at_one_update_and_positive_when_the_policy_moves(kl_run, clip_run_on_cpu):
    for record in (r for r in read_metrics(kl_run[0].args.output_dir) if "reward" in r):
        assert record["clip_ratio/low_mean"] == 0.0 and record["clip_ratio/high_mean"] == 0.0  # μ = 1: ρ ≡ 1
    trainer, _, rollouts = clip_run_on_cpu
    moved = [r for r in read_metrics(trainer.args.output_dir) if "reward" in r]
    samples = read_completions(trainer.args.output_dir)
    assert len(moved) == len(rollouts) == 3
    for record, rollout in zip(moved, rollouts):
        # Only tokens of completions with A > 0 can clip high, only those with A < 0 low, and only in
        # the second of the μ = 2 passes (the first has ρ = 1): bounds from the logged advantages.
        advantages = np.array([c["advantage"] for c in samples if c["step"] == record["step"]])
        lengths = rollout.completion_mask.sum(dim=1).numpy()
        assert len(advantages) == len(lengths) == BATCH
        tokens = lengths.sum()
        assert record["clip_ratio/high_mean"] <= 0.5 * lengths[advantages > 0].sum() / tokens + 1e-9
        assert record["clip_ratio/low_mean"] <= 0.5 * lengths[advantages < 0].sum() / tokens + 1e-9
        assert record["clip_ratio/region_mean"] == pytest.approx(record["clip_ratio/low_mean"]
                                                                 + record["clip_ratio/high_mean"])
    assert sum(r["clip_ratio/low_mean"] + r["clip_ratio/high_mean"] for r in moved) > 0


def test_entropy_is_that_of_a_near_uniform_random_model(kl_run):
    """A freshly initialised model (logits ≈ 0) samples from a nearly uniform distribution: entropy ≈ log V."""
    trainer, _, _ = kl_run
    log_vocab = math.log(trainer.model.config.vocab_size)
    first = next(r for r in read_metrics(trainer.args.output_dir) if "reward" in r)
    assert 0.9 * log_vocab < first["entropy"] <= log_vocab + 1e-4


def test_peak_memory_is_the_process_maximum_rss_on_cpu(kl_run):
    import resource

    record = next(r for r in read_metrics(kl_run[0].args.output_dir) if "reward" in r)
    now = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB → GiB (Linux)
    assert 0.01 < record["peak_memory_gib"] <= now + 1e-9


def test_mfu_is_six_n_tokens_over_time_and_peak_without_a_head(monkeypatch):
    from cohort_grpo.telemetry import metrics

    model = torch.nn.Linear(10, 10)  # 110 parameters
    monkeypatch.setattr(metrics, "peak_flops", lambda device: 1e6)
    out = metrics.throughput_metrics(model, "cpu", {"sampling": 2.0, "update": 4.0, "logprobs": 1.0},
                                     prompt_tokens=30, completion_tokens=10, num_iterations=2, logprob_passes=1)
    assert out["tokens_per_second/sampling"] == 10 / 2.0
    assert out["tokens_per_second/update"] == (30 + 10) * 2 / 4.0
    assert out["tokens_per_second/logprobs"] == 40 / 1.0
    assert out["mfu"] == pytest.approx(6 * 110 * 20.0 / 1e6)
    monkeypatch.setattr(metrics, "peak_flops", lambda device: None)
    assert metrics.throughput_metrics(model, "cpu", {}, 1, 1, 1, 0)["mfu"] is None


@pytest.mark.parametrize("tied", [True, False])
def test_update_flops_count_the_head_on_completion_tokens_only(tied):
    from cohort_grpo.telemetry.metrics import update_flops
    from cohort_grpo.models import CausalLM, ModelConfig

    config = ModelConfig(model_type="llama", vocab_size=50, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=4, tie_word_embeddings=tied)
    model = CausalLM(config)
    matrix = 50 * 8  # the head's (and the input embedding's) weights
    everything = sum(p.numel() for p in model.parameters())  # a tied matrix once
    layers = everything - matrix * (1 if tied else 2)
    prompt, completion = 7, 30
    want = 6 * layers * (prompt + completion) + 6 * matrix * completion
    assert update_flops(model, prompt, completion) == want
    for p in model.parameters():  # frozen weights (LoRA's base): no weight-gradient GEMM, 4 FLOPs not 6
        p.requires_grad_(False)
    assert update_flops(model, prompt, completion) == pytest.approx(want * 4 / 6)


def test_peak_flops_table_prefers_the_specific_name(monkeypatch):
    from cohort_grpo.telemetry import metrics

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, expected in (("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                           ("NVIDIA A100-SXM4-80GB", 312e12), ("Tesla T4", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert metrics.peak_flops("cuda") == expected
    assert metrics.peak_flops("cpu") is None


@pytest.mark.cpu("a CPU run's report has no MFU figure; a GPU run's has")
def test_report_of_a_tiny_run_draws_every_figure_the_issue_names(kl_run_on_cpu, tmp_path):
    """`cohort-grpo report` on a real run's output: reward per function, accuracy, KL, entropy, length, clip
    fractions, throughput (each phase), memory; non-blank PNGs; the completions table."""
    from matplotlib.image import imread

    from cohort_grpo.telemetry.report import main as report_main

    trainer, _, _ = kl_run_on_cpu
    assert report_main([trainer.args.output_dir, "--out", str(tmp_path)]) == 0
    figures = json.loads((tmp_path / "figures.json").read_text())
    for name in ("reward", "reward_per_function", "accuracy", "kl", "entropy", "completion_length",
                 "clip_fractions", "throughput", "memory", "step_time"):
        image = imread(tmp_path / f"{name}.png")[..., :3]
        assert image.std() > 0.01, f"{name}.png is blank"
        assert figures[f"{name}.png"]["curves"], name
    throughput = {c["metric"] for c in figures["throughput.png"]["curves"]}
    assert throughput == {"tokens_per_second/sampling", "tokens_per_second/logprobs", "tokens_per_second/update"}
    accuracy = figures["accuracy.png"]["curves"][0]
    assert accuracy["steps"] == [0, 3]
    page = (tmp_path / "index.html").read_text()
    first = read_completions(trainer.args.output_dir)[0]
    assert "<table class='completions'>" in page and "first_is_digit" in page and "has_space" in page
    assert html.escape(first["prompt"]) in page and html.escape(first["completion"]) in page
    assert "mfu.png" not in figures  # no MFU on CPU: that figure is skipped, not drawn empty


@pytest.mark.parametrize("window", [None, 3])
def test_attention_pairs_count_the_mask_entries_of_each_layout(window):
    """Against the attention masks themselves: a causal (windowed) mask per [prompt | completion]
    row; with shared prompts, the prompt's rows once per run of at most max_rows completions and
    each completion's rows from the prompt's end on."""
    from cohort_grpo.rollout.layout import PADDED, Layout, causal_pairs

    def mask(length):
        i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
        allowed = j <= i
        return allowed & (j > i - window) if window else allowed

    prompt_a, prompt_b = [5, 6, 7, 8], [9, 10]
    prompt_ids = [prompt_a, prompt_a, prompt_a, prompt_b, prompt_b]
    lengths = [3, 0, 6, 2, 5]
    rows = [mask(len(p) + n) for p, n in zip(prompt_ids, lengths)]
    assert PADDED.attention_pairs(prompt_ids, lengths, 2, window) == sum(int(m.sum()) for m in rows)
    runs = [[0, 1], [2], [3, 4]]  # max_rows = 2 cuts prompt a's three rows into two runs
    want = sum(int(mask(len(prompt_ids[run[0]])).sum()) for run in runs)
    want += sum(int(rows[r][len(prompt_ids[r]):].sum()) for run in runs for r in run)
    assert Layout(shared=True).attention_pairs(prompt_ids, lengths, 2, window) == want
    assert [causal_pairs(n, window) for n in range(8)] == [int(mask(n).sum()) for n in range(8)]


def test_update_flops_add_twelve_flops_per_attention_pair_and_head_dim_by_layer_window():
    import transformers

    from cohort_grpo.telemetry.metrics import attention_layers, rollout_attention_pairs, update_flops
    from cohort_grpo.models import CausalLM, ModelConfig
    from cohort_grpo.rollout.layout import Layout

    config = ModelConfig(model_type="qwen2", vocab_size=50, hidden_size=8, intermediate_size=16, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=6, sliding_window=4,
                         layer_types=["full_attention", "sliding_attention", "sliding_attention"])
    model = CausalLM(config)
    assert attention_layers(model) == [(12, None), (12, 4), (12, 4)]
    prompts, lengths = [[1, 2, 3]] * 2 + [[4] * 6], [5, 2, 7]
    shared = Layout(shared=True, group=2)
    assert rollout_attention_pairs(model, shared, prompts, lengths, 8) == {
        window: shared.attention_pairs(prompts, lengths, 8, window) for window in (None, 4)}
    pairs = {None: 1000, 4: 300}
    weights_only = update_flops(model, 7, 30)
    # forward: q·k and p·v, 2 FLOPs per multiply-add, per head dim and head; backward twice that
    assert update_flops(model, 7, 30, pairs) - weights_only == 12 * 2 * 6 * (1000 + 300 + 300)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    assert attention_layers(hf) == [(16, None), (16, None)]
    assert attention_layers(torch.nn.Linear(3, 3)) == []  # unknown: no attention term
