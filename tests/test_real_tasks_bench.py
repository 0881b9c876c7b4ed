"""bench/real_tasks.py: `--smoke` runs probe, run (both arms, the report) and table end to end on the CPU with the
built-in tiny model; its Wilson intervals are the roots of the score test's quadratic; the GPU bundle's
calls each stay under what a device call carries."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "real_tasks.py"


def bench_module(name: str):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPT.parent / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPT.parent))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("real_tasks")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], cwd=out, env=env,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out / "smoke", done.stdout


@pytest.mark.slow
def test_smoke_trains_each_arm_and_reports_what_its_run_logged(smoke):
    folder, printed = smoke
    assert "smoke: ok" in printed and "in the window:" in printed
    results = {(r["task"], r["arm"]): r for r in map(json.loads, map(Path.read_text, folder.rglob("result.json")))}
    assert {("leg_counting", "sft"), ("leg_counting", "plain")} <= set(results)
    for result in results.values():
        run = Path(result["run_dir"])
        evaluations = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                       if "eval/accuracy" in line]
        # the trainer's own held-out evaluations before the first step and after the last
        assert result["start"] == evaluations[0]["eval/accuracy"]
        assert result["after"] == evaluations[-1]["eval/accuracy"]
        assert result["grpo_steps"] == 2 and result["n"] == 4 and (run / "report" / "index.html").is_file()
        assert result["sft_steps"] == (1 if result["arm"] == "sft" else 0)
        if result["arm"] == "plain":
            assert result["before"] == result["start"]
    row = f"| {results['leg_counting', 'sft']['task']} | sft | 4 | "
    assert row in printed


def test_wilson_bounds_are_the_score_tests_roots():
    real_tasks = bench_module("real_tasks")
    z = 1.959964
    for correct, n in [(0, 4), (3, 4), (17, 48), (48, 48), (120, 400)]:
        low, high = real_tasks.wilson(correct, n)
        p = correct / n
        # (p - q)^2 = z^2 q (1 - q) / n  <=>  (1 + z^2/n) q^2 - (2p + z^2/n) q + p^2 = 0
        a, b, c = 1 + z * z / n, -(2 * p + z * z / n), p * p
        roots = sorted(((-b - math.sqrt(b * b - 4 * a * c)) / (2 * a), (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)))
        assert low == pytest.approx(roots[0], abs=1e-12) and high == pytest.approx(roots[1], abs=1e-12)
    assert real_tasks.accuracy_cell(0.0, 4) == "0.0% [0.0, 49.0]"


def test_bundle_calls_stay_under_a_device_calls_carry(tmp_path, monkeypatch):
    bundle = bench_module("real_tasks_bundle")
    monkeypatch.setattr(bundle, "CALL_BYTES", 100)
    sizes = [90, 60, 50, 40, 30, 10, 10, 5]
    pieces = []
    for i, size in enumerate(sizes):
        pieces.append(tmp_path / f"piece{i}")
        pieces[-1].write_bytes(b"x" * size)
    calls = bundle.pack(pieces)
    assert sorted(p.name for call in calls for p in call) == sorted(p.name for p in pieces)
    assert all(sum(p.stat().st_size for p in call) <= 100 for call in calls)
    assert len(calls) == math.ceil(sum(sizes) / 100)


def test_printed_device_calls_fit_a_command(capsys):
    bundle = bench_module("real_tasks_bundle")
    bundle.print_calls(3, "SmolLM2-135M-Instruct.Q4_1.gguf", "0" * 64)
    commands = [line.strip() for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert len(commands) == 4 and all(len(c) <= 2000 for c in commands)
    assert "sha256sum -c" in commands[2] and "probe" in commands[2] and "--arms ARM" in commands[3]


def test_the_time_bound_stops_after_the_step_that_crosses_it():
    from transformers import TrainerControl, TrainerState

    real_tasks = bench_module("real_tasks")
    watch, state = real_tasks.StepWatch(seconds=3600.0), TrainerState()
    control = TrainerControl()
    watch.on_step_begin(None, state, control)
    watch.on_step_end(None, state, control)
    assert not control.should_training_stop and watch.stop_reason is None
    watch.started -= 3601.0  # the first step began an hour and a second ago
    watch.on_step_begin(None, state, control)  # later steps keep the first step's start
    watch.on_step_end(None, state, control)
    assert control.should_training_stop and watch.stop_reason == "time budget 3600s"
