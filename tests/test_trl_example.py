"""Every script of examples/ runs as written, here in seconds: examples/trl_quickstart.py (a script written
for TRL whose one cohort line is its import) trains two steps on a tiny model, in this process, through its
own `if __name__ == "__main__"` with the environment variables its docstring names."""

import ast
import dataclasses
import json
import re
import runpy
import sys
from pathlib import Path

import pytest

from test_trl_config_table import TRL_FIELDS, TRL_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
EXAMPLE = EXAMPLES / "trl_quickstart.py"
# each example and the test of this file that runs it; a new example needs its own
RUN_TESTS = {"trl_quickstart.py": "test_quickstart_runs_two_steps_on_a_tiny_model"}


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    """A random-init two-layer Qwen2 with a character-level tokenizer that has a chat template."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from cohort_grpo.models.tiny import build_tokenizer

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


def test_every_example_has_a_test_that_runs_it():
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts == sorted(RUN_TESTS), f"examples/ holds {scripts}; each needs a run test named in RUN_TESTS"
    for test_name in RUN_TESTS.values():
        assert callable(globals().get(test_name)), test_name


def test_the_import_is_the_only_cohort_line():
    """The one line that names cohort in code (not in a comment, a string or the docstring) is the import;
    the environment variables are strings, read the same under TRL."""
    source = EXAMPLE.read_text()
    body = ast.parse(source)
    imports = [node for node in ast.walk(body) if isinstance(node, (ast.Import, ast.ImportFrom))]
    modules = {alias.name for node in imports if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module for node in imports if isinstance(node, ast.ImportFrom)}
    assert modules == {"os", "re", "sys", "cohort_grpo", "datasets"}
    [cohort_import] = [node for node in imports if isinstance(node, ast.ImportFrom) and node.module == "cohort_grpo"]
    assert source.splitlines()[cohort_import.lineno - 1] == (
        "from cohort_grpo import GRPOConfig, GRPOTrainer  # under TRL: from trl import GRPOConfig, GRPOTrainer")
    identifiers = {node.id for node in ast.walk(body) if isinstance(node, ast.Name)}
    identifiers |= {node.attr for node in ast.walk(body) if isinstance(node, ast.Attribute)}
    assert {"GRPOConfig", "GRPOTrainer"} <= identifiers
    assert not [name for name in identifiers if "cohort" in name.lower()]


def keywords_of(call_name: str) -> set[str]:
    calls = [node for node in ast.walk(ast.parse(EXAMPLE.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == call_name]
    assert len(calls) == 1, call_name
    return {keyword.arg for keyword in calls[0].keywords}


def test_the_config_and_trainer_keywords_are_trls():
    """Under TRL 1.16 the same calls construct: every GRPOConfig keyword is a field of TRL's GRPOConfig
    (its own, frozen in test_trl_config_table, or a transformers TrainingArguments field it extends)."""
    from transformers import TrainingArguments

    trl_config = set(TRL_FIELDS) | set(TRL_OVERRIDES) | {f.name for f in dataclasses.fields(TrainingArguments)}
    config_keywords = keywords_of("GRPOConfig")
    assert config_keywords and config_keywords <= trl_config, config_keywords - trl_config
    # TRL 1.16's GRPOTrainer(model, reward_funcs, args=None, train_dataset=None, eval_dataset=None, ...)
    assert keywords_of("GRPOTrainer") == {"model", "reward_funcs", "train_dataset", "args"}


def test_quickstart_runs_two_steps_on_a_tiny_model(tiny_qwen2, tmp_path, monkeypatch):
    monkeypatch.setenv("COHORT_EXAMPLE_MAX_STEPS", "2")
    monkeypatch.setenv("COHORT_EXAMPLE_MAX_COMPLETION_LENGTH", "8")
    monkeypatch.setenv("COHORT_EXAMPLE_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), str(tiny_qwen2)])
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(EXAMPLE), run_name="__main__")

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
    assert not (tmp_path / "Qwen2.5-0.5B-GRPO").exists()  # the variable chose the folder
