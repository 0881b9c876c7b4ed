"""Every keyword a TRL 1.16 `GRPOConfig` takes (its own fields and the transformers `TrainingArguments`
it extends) either works in cohort's `GRPOConfig` or is a one-line `CohortError` naming it, never a bare
TypeError; and a ported script with TRL's common settings trains on CPU.

TRL's field list is read from the installed `trl` when there is one, else it is the frozen TRL 1.16 list
of tests/test_trl_config_table.py; the TrainingArguments fields come from the installed transformers."""

import dataclasses
import importlib.util
import json

import pytest
import torch

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.config.grpo_config import ALIASES
from cohort_grpo.errors import CohortError
from cohort_grpo.config.epochs import with_epoch_steps
from cohort_grpo.tasks import prompt_text
from test_trl_config_table import TRL_FIELDS, TRL_OVERRIDES


def trl_fields() -> dict:
    if importlib.util.find_spec("trl") is not None:
        from trl import GRPOConfig as TRLConfig

        return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(TRLConfig) if f.init}
    from transformers import TrainingArguments

    inherited = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                 for f in dataclasses.fields(TrainingArguments) if f.init}
    return {**inherited, **TRL_FIELDS, **TRL_OVERRIDES}


def another(value):
    """A value of the default's kind that differs from it."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 3
    if isinstance(value, str):
        return value + "_other"
    if isinstance(value, (list, dict)):
        return type(value)()
    return 7


FIELDS = trl_fields()


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_no_trl_keyword_is_a_bare_type_error(name):
    for value in (FIELDS[name], another(FIELDS[name])):
        try:
            GRPOConfig(**{name: value}).validate()
        except CohortError as error:
            text = str(error)
            named = {name} | {field for alias, field in ALIASES if alias == name}  # an alias's check names cohort's
            assert "\n" not in text and any(n in text for n in named), f"{name}={value!r}: {text}"
        # Anything else (TypeError above all) fails the test as it is.


def test_the_field_list_is_trls():
    assert {"bf16", "num_train_epochs", "use_vllm", "log_completions", "chat_template_kwargs"} <= set(FIELDS)
    assert len(FIELDS) > 150  # TRL's ~80 and transformers' ~110, less the ones both have


def test_trl_meanings():
    assert GRPOConfig(bf16=True).dtype == "bfloat16" and GRPOConfig(fp16=True).dtype == "float16"
    assert GRPOConfig(bf16=False).dtype == "float32"
    assert GRPOConfig(log_completions=True, logging_steps=5).log_completions_steps == 5
    assert GRPOConfig(use_cpu=True).device == "cpu"
    assert GRPOConfig(min_p=None).min_p == 0.0  # TRL's off
    assert GRPOConfig(max_steps=-1).num_train_epochs == 3.0  # transformers' default epochs
    for bad, words in ((dict(bf16=True, fp16=True), "two precisions"),
                       (dict(bf16=True, dtype="float32"), "bf16=True) means dtype='bfloat16'"),
                       (dict(use_vllm=True), "own engine"),
                       (dict(save_strategy="best"), "metric_for_best_model, which cohort does not track"),
                       (dict(loss_type="cispo"), "TRL's cispo loss, which cohort does not have"),
                       (dict(logging_strategy="epoch"), "TrainingArguments option"),
                       (dict(lerning_rate=1e-5), "did you mean learning_rate?")):
        with pytest.raises(CohortError, match=words.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
            GRPOConfig(**bad)


def test_a_value_of_the_wrong_type_names_the_option_and_its_type():
    with pytest.raises(CohortError, match=r"^GRPOConfig\(max_steps='ten'\): max_steps takes int, not str$"):
        GRPOConfig(max_steps="ten")
    with pytest.raises(CohortError, match="temperature takes float, not str"):
        config = GRPOConfig()
        config.temperature = "hot"  # set after construction: validate() says it
        config.validate()
    assert GRPOConfig(learning_rate=1).learning_rate == 1  # a whole number is a float


def test_epochs_count_steps_from_the_rows():
    config = GRPOConfig(num_train_epochs=2, num_generations=2, per_device_train_batch_size=4,
                        gradient_accumulation_steps=1)  # 2 prompts a step
    assert with_epoch_steps(config, rows=5, world_size=1).max_steps == 5  # ceil(2 × 5 / 2)
    assert with_epoch_steps(config, rows=5, world_size=2).max_steps == 3  # ceil(2 × 5 / 4)
    assert with_epoch_steps(GRPOConfig(max_steps=7), rows=5).max_steps == 7


def test_chat_template_kwargs_reach_the_template(tiny_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    tokenizer.chat_template = "{{ messages[0].content }}{% if enable_thinking %}<think>{% endif %}"
    prompt = [{"role": "user", "content": "2+2="}]
    assert prompt_text(tokenizer, prompt, template_kwargs={"enable_thinking": True}) == "2+2=<think>"
    assert prompt_text(tokenizer, prompt, template_kwargs={"enable_thinking": False}) == "2+2="
    from cohort_grpo.config.command_line import parse_config

    parsed = parse_config(["--chat_template_kwargs", json.dumps({"enable_thinking": False})])
    assert parsed.chat_template_kwargs == {"enable_thinking": False}


def test_a_ported_trl_script_trains_on_cpu(tiny_dir, tmp_path):
    torch.set_num_threads(1)
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(4)]

    def length_reward(completions, **_):
        return [float(len(c)) for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path), bf16=True, num_train_epochs=1, log_completions=True,
                      logging_steps=1, num_generations=2, per_device_train_batch_size=4,
                      gradient_accumulation_steps=1, max_completion_length=4, learning_rate=1e-4, report_to="none",
                      use_vllm=False, device="cpu", quiet=True, eval_limit=0)
    trainer = GRPOTrainer(model=tiny_dir, reward_funcs=length_reward, args=args, train_dataset=rows)
    assert trainer.args.dtype == "bfloat16" and trainer.args.max_steps == 2  # 4 rows, 2 prompts a step
    trainer.train()
    history = trainer.history
    assert [r["step"] for r in history] == [1, 2]
    logged = [json.loads(line)["step"] for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert sorted(set(logged)) == [1, 2]  # every logging_steps step, as TRL's log_completions
