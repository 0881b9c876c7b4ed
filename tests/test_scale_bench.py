"""bench/scale.py: `--plan` prints the capacity rows the memory plan computes, and `--smoke` runs cohort's
synchronous (FSDP2) and asynchronous (a sampling rank) modes on 2 gloo processes, and a tiny Qwen3-MoE with and
without routing replay, and writes the JSON the GPU run writes; bench/decode_step.py's smoke run times a decode
step per batch size."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "scale.py"


def run(tmp_path, *flags):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(SCRIPT), *flags, "--out", str(tmp_path)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_the_plan_rows_are_the_plans(tmp_path):
    from cohort_grpo.plans.training_plan import GIB

    out = run(tmp_path, "--plan")
    report = json.loads((tmp_path / "scale_plan.json").read_text())
    assert [(r["shape"], r["gpus"]) for r in report["rows"]] == [("llama3.1-8b", 2), ("qwen2.5-14b", 2),
                                                                 ("qwen2.5-32b", 4), ("qwen3-30b-a3b-half", 2),
                                                                 ("qwen3-30b-a3b", 4)]
    for row in report["rows"]:
        peaks = [step["peak_gib"] for step in row["ladder"]]
        assert peaks == sorted(peaks, reverse=True)  # every rung of the ladder takes memory away
        for step in row["ladder"]:
            assert step["fits"] == (step["peak_gib"] <= row["card_gib"] - report["headroom_gib"])
            phases = step["plan"]["phases"]
            assert abs(max(p["total_gib"] for p in phases.values()) - step["peak_gib"]) < 0.06
            assert step["plan"]["peak_gib"] * GIB > 0
        assert f"{row['shape']} on {row['gpus']}×" in out
    # the whole Qwen3-30B-A3B on 4 H200s: its engine's whole copy cannot stay beside the update; split 4 ways (each
    # expert by its columns), it fits once the engine's weights and cache are freed for the update
    moe = {step["configuration"].split(" (")[0]: step for step in report["rows"][-1]["ladder"]}
    assert not moe["cohort's defaults"]["fits"]
    shard = moe["+ the engine a tensor-parallel shard over the GPUs"]["plan"]["phases"]
    whole = moe["cohort's defaults"]["plan"]["phases"]
    assert shard["sampling"]["engine weights"] * 4 == pytest.approx(whole["sampling"]["engine weights"], rel=0.01)
    assert moe["+ KV cache and the engine's weights freed for the update"]["fits"]


@pytest.mark.soak  # about a minute of torchrun launches (dense and MoE, both modes): CI runs it with -m soak
def test_the_smoke_run_measures_both_modes(tmp_path):
    out = run(tmp_path, "--smoke")
    report = json.loads((tmp_path / "scale.json").read_text())
    row, moe = report["rows"]
    for mode in ("sync", "async"):
        assert row["cohort"][mode]["tok_per_s_per_gpu"] > 0 and row["cohort"][mode]["peak_gib"] is not None
        assert row["cohort"][mode]["replay_mismatch"] is None  # a dense model has no routes
    assert row["cohort"]["async"]["weight_sync_s"] > 0  # the sampling rank received the weights each step
    assert "trl" in row and ("skipped" in row["trl"] or "tok_per_s_per_gpu" in row["trl"])
    # the tiny mixture of experts: sync with routing replay, async (colocated, FSDP2) without
    assert moe["shape"] == "qwen3-30b-a3b-half" and list(moe["cohort"]) == ["sync", "async, no replay"]
    assert "routing_replay=true" in moe["cohort"]["sync"]["options"]
    assert {"fsdp=true", "routing_replay=false"} <= set(moe["cohort"]["async, no replay"]["options"])
    for measured in moe["cohort"].values():
        assert measured["tok_per_s_per_gpu"] > 0 and 0 <= measured["replay_mismatch"] <= 1
        assert measured["full_shape_tok_per_s_per_gpu"] == measured["tok_per_s_per_gpu"] * 0.5
        assert measured["expert_load_max_over_mean"] >= 1
    assert "smoke: OK" in out


def test_the_decode_step_bench_times_each_batch_on_the_shapes_model(tmp_path):
    """bench/decode_step.py --smoke: one row per batch size, on a model of the shape's config (its weight bytes are
    those of a CausalLM built here from the same config.json fields), in the JSON a GPU run writes."""
    sys.path.insert(0, str(ROOT / "bench"))
    from grpo_step_worker import SMOKE, config_dict

    from cohort_grpo.models import CausalLM, ModelConfig

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "decode_step.py"), "--smoke", "--out", str(tmp_path)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "decode_step-T1.json").read_text())
    assert [row["sequences"] for row in report["rows"]] == [4, 8] and report["tensor_parallel"] == 1
    model = CausalLM(ModelConfig.from_hf_dict(config_dict(SMOKE["qwen3-30b-a3b-half"])))
    assert report["shard_weight_bytes"] == sum(p.numel() * 4 for p in model.parameters())  # float32 on the CPU
    assert "| 8 |" in done.stdout
