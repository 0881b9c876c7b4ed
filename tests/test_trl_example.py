"""examples/trl_quickstart.py — TRL's quick start with only the import changed — runs two steps."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "trl_quickstart.py"


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    """A random-init two-layer Qwen2 with a character-level tokenizer that has a chat template."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from cohort.models.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("tiny_qwen2")
    tokenizer = build_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_the_import_is_the_only_cohort_line():
    source = EXAMPLE.read_text()
    imports = [line for line in source.splitlines() if re.match(r"\s*(from|import)\s+cohort\b", line)]
    assert imports == ["from cohort import GRPOConfig, GRPOTrainer# the only change: TRL has "
                       "`from trl import GRPOConfig, GRPOTrainer`"]
    for name in ("format_reward_func", "beta=0.02", "num_generations=8", "temperature=0.9", "trainer.train()",
                 "GRPOTrainer(", "reward_funcs=", "train_dataset=", "args=training_args"):
        assert name in source


@pytest.mark.slow
def test_quickstart_runs_two_steps_on_a_tiny_model(tiny_qwen2, tmp_path):
    env = dict(os.environ, COHORT_EXAMPLE_MAX_STEPS="2", COHORT_EXAMPLE_MAX_COMPLETION_LENGTH="8",
               COHORT_EXAMPLE_OUTPUT_DIR=str(tmp_path / "out"), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(EXAMPLE), str(tiny_qwen2)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in metrics if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        # 8 tokens of the character tokenizer cannot spell "<think>…</think>" (15 characters for the tags
        # alone), so no completion earns the format reward, and the reward is that function's alone
        assert record["rewards/format_reward_func/mean"] == 0.0 and record["reward"] == 0.0
        assert record["frac_reward_zero_std"] == 1.0 and record["informative"] == 0.0
        assert record["completions/mean_length"] <= 8
    samples = [json.loads(line) for line in (tmp_path / "out" / "completions.jsonl").read_text().splitlines()]
    assert samples and all(s["step"] == 1 for s in samples)  # step 1 is logged (then every 10 steps)
    for sample in samples:  # the example's own pattern, applied to each logged completion
        matched = re.match(r"^<think>.*?</think>\s*<answer>.*?</answer>$", sample["completion"][0]["content"], re.DOTALL)
        assert sample["rewards"] == {"format_reward_func": 1.0 if matched else 0.0}
        assert sample["advantage"] == 0.0  # all-equal groups carry no signal
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "qwen2"
