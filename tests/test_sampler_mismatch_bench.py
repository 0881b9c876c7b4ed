"""bench/sampler_mismatch.py: `--smoke` runs end to end on the CPU and writes the JSON the GPU run
writes; in float32 the engine's sampling log-probs and the trainer's agree; the statistics and TRL's
token_truncate weights are what a hand computation gives."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "sampler_mismatch.py"
STATS = {"tokens", "sequences", "fraction_nonzero", "abs_mean", "abs_p50", "abs_p99", "abs_max", "signed_mean", "seq_ratio_min",
         "seq_ratio_mean", "seq_ratio_max", "seq_log_ratio_abs_max"}
COMPARISONS = {"trainer_bf16_vs_sampler_bf16", "trainer_fp32_vs_sampler_fp32", "trainer_bf16_vs_trainer_fp32",
               "sampler_bf16_vs_trainer_fp32", "trainer_bf16_padded_vs_trainer_bf16", "head_fp32_vs_head_bf16",
               "head_bf16_vs_trainer_fp32", "head_fp32_vs_trainer_fp32"}


def bench_module():
    spec = importlib.util.spec_from_file_location("sampler_mismatch", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("sampler_mismatch")
    env = {**os.environ, "OUT": str(out), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], cwd=out, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "sampler_mismatch.json").read_text()), done.stdout


@pytest.mark.slow
def test_smoke_writes_every_field(smoke):
    results, printed = smoke
    config = results["config"]
    assert config["smoke"] is True and config["device"] == "cpu" and config["sampler"] == "Engine"
    assert (config["questions"], config["generations"], config["max_new_tokens"]) == (4, 4, 24)
    assert set(results["comparisons"]) == COMPARISONS
    for name, stats in results["comparisons"].items():
        assert set(stats) == STATS, name
        assert stats["sequences"] == 16 and stats["tokens"] > 0
        assert 0 <= stats["abs_p50"] <= stats["abs_p99"] <= stats["abs_max"], name
        assert stats["abs_mean"] <= stats["abs_max"] and abs(stats["signed_mean"]) <= stats["abs_mean"] + 1e-15
        assert 0 < stats["seq_ratio_min"] <= stats["seq_ratio_mean"] <= stats["seq_ratio_max"], name
    bf16_tokens = results["comparisons"]["trainer_bf16_vs_sampler_bf16"]["tokens"]
    assert bf16_tokens == config["completion_tokens_bf16"]
    assert results["comparisons"]["trainer_fp32_vs_sampler_fp32"]["tokens"] == config["completion_tokens_fp32"]
    for precision in ("bf16", "fp32"):
        weights = results["importance_sampling"][precision]
        assert weights["mode"] == "token_truncate" and weights["clip_max"] == 3.0
        assert 0 <= weights["fraction_clipped"] <= 1 and 0 < weights["weight_min"] <= weights["weight_mean"] <= 3
    for header in ("| comparison | tokens | Δ ≠ 0 | mean abs Δ | p50 | p99 | max |", "| trainer_fp32 vs sampler_fp32 |",
                   "token_truncate", "| bf16 |"):
        assert header in printed


def test_float32_sampler_and_trainer_agree(smoke):
    results, _ = smoke
    fp32 = results["comparisons"]["trainer_fp32_vs_sampler_fp32"]
    assert fp32["abs_max"] < 1e-4 and fp32["abs_mean"] < 1e-5
    assert fp32["seq_log_ratio_abs_max"] < 1e-3 and abs(fp32["seq_ratio_max"] - 1) < 1e-3
    weights = results["importance_sampling"]["fp32"]
    assert weights["fraction_clipped"] == 0 and abs(weights["weight_mean"] - 1) < 1e-4
    # bf16 arithmetic is visible against float32 on the same weights and tokens, and the head split
    # adds up: bf16 body + bf16 head is the trainer's bf16 result computed another way
    assert results["comparisons"]["trainer_bf16_vs_trainer_fp32"]["abs_mean"] > 1e-5
    assert results["comparisons"]["head_fp32_vs_head_bf16"]["abs_max"] > 0
    assert results["comparisons"]["head_bf16_vs_trainer_fp32"]["abs_mean"] == pytest.approx(
        results["comparisons"]["trainer_bf16_vs_trainer_fp32"]["abs_mean"], rel=0.05)


def test_token_stats_by_hand():
    bench = bench_module()
    a = torch.tensor([[0.0, -1.0, -2.0, 5.0], [-0.5, -0.5, 0.0, 0.0]])
    b = torch.tensor([[0.1, -1.0, -2.3, 9.0], [-0.5, -0.25, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])  # the 5.0 / 9.0 pair is padding
    stats = bench.token_stats(a, b, mask)
    deltas = [-0.1, 0.0, 0.3, 0.0, -0.25]
    assert stats["tokens"] == 5 and stats["sequences"] == 2
    assert stats["fraction_nonzero"] == pytest.approx(3 / 5)
    assert stats["abs_mean"] == pytest.approx(sum(map(abs, deltas)) / 5, abs=1e-7)
    assert stats["abs_p50"] == pytest.approx(0.1, abs=1e-7)
    assert stats["abs_max"] == pytest.approx(0.3, abs=1e-7)
    assert stats["signed_mean"] == pytest.approx(sum(deltas) / 5, abs=1e-7)
    ratios = [math.exp(-0.1 + 0.0 + 0.3), math.exp(0.0 - 0.25)]
    assert stats["seq_ratio_min"] == pytest.approx(min(ratios), rel=1e-6)
    assert stats["seq_ratio_max"] == pytest.approx(max(ratios), rel=1e-6)
    assert stats["seq_ratio_mean"] == pytest.approx(sum(ratios) / 2, rel=1e-6)


def test_token_truncate_weights_by_hand():
    bench = bench_module()
    sampler = torch.tensor([[-3.0, -1.0, -2.0, -1.0]])
    trainer = torch.tensor([[-1.0, -1.0, -2.5, 0.0]])  # ratios e^2 (clipped to 3), 1, e^-0.5; last one padding
    mask = torch.tensor([[1, 1, 1, 0]])
    w = bench.token_truncate_weights(trainer, sampler, mask)
    assert w["tokens"] == 3 and w["fraction_clipped"] == pytest.approx(1 / 3)
    assert w["weight_mean"] == pytest.approx((3.0 + 1.0 + math.exp(-0.5)) / 3, rel=1e-6)
    assert w["weight_min"] == pytest.approx(math.exp(-0.5), rel=1e-6)
    assert w["raw_ratio_max"] == pytest.approx(math.exp(2.0), rel=1e-6)
    assert w["fraction_off_by_1pct"] == pytest.approx(2 / 3)
