"""The table of refused configs (cohort_grpo/config/rules.py): each range row refuses exactly the values its words
in docs/reference.md name, `check()` raises the first row that refuses, and a refused value reads one way."""

from __future__ import annotations

import copy
import math
import re

import pytest

from cohort_grpo import GRPOConfig
from cohort_grpo.config.choices import choose
from cohort_grpo.config.rules import RULES, first_refusal, refusal
from cohort_grpo.errors import CohortError

DEFAULTS = GRPOConfig().validate()
RANGE = re.compile(r"^`(?P<name>\w+)` (?:(?P<op>[<≤]) (?P<bound>-?[\d.]+)|outside (?P<interval>[(\[]-?[\d.]+, -?[\d.]+[)\]]))$")


def inside(value: float, word: re.Match) -> bool:
    """Whether `value` is allowed by a range row's words, read independently of the rule's code."""
    if word["op"] == "<":
        return value >= float(word["bound"])
    if word["op"] == "≤":
        return value > float(word["bound"])
    low, high = (float(end) for end in word["interval"][1:-1].split(","))
    return (value > low if word["interval"][0] == "(" else value >= low) and (
        value < high if word["interval"][-1] == ")" else value <= high)


def with_value(name: str, value):
    """The default config with `name` set (and what the option needs to take effect), unchecked: GRPOConfig()
    itself would refuse what a row refuses, and the rows are what is tested here."""
    config = copy.copy(DEFAULTS)
    for key, item in {name: value, **({"use_peft": True} if name == "lora_r" else {})}.items():
        setattr(config, key, item)
    return config


RANGE_ROWS = [(rule, RANGE.match(rule.when)) for rule in RULES if RANGE.match(rule.when)]


def test_the_range_rows_cover_the_ranges():
    names = {word["name"] for _, word in RANGE_ROWS}
    assert len(RANGE_ROWS) >= 40
    assert {"num_generations", "epsilon", "top_p", "rm_replay_ratio", "rm_head_learning_rate", "cpu_threads"} <= names


@pytest.mark.parametrize("rule, word", RANGE_ROWS, ids=[rule.when for rule, _ in RANGE_ROWS])
def test_a_range_row_refuses_what_its_words_say(rule, word):
    name = word["name"]
    integral = isinstance(getattr(DEFAULTS, name), int) or name in ("cpu_threads", "max_tokens_per_micro_batch",
                                                                     "gradient_checkpointing_layers",
                                                                     "rollout_tensor_parallel_size",
                                                                     "max_concurrent_sequences")
    edges = [float(x) for x in re.findall(r"-?[\d.]+", word["bound"] or word["interval"])]
    probes = sorted({e + d for e in edges for d in (-1, 0, 1)} | ({e + d for e in edges for d in (-0.5, 0.5)}
                                                                  if not integral else set()))
    for value in probes:
        value = int(value) if integral else value
        config = with_value(name, value)
        assert rule.refuses(config) != inside(value, word), (rule.when, value)
        if rule.refuses(config):
            assert rule.message(config).startswith(f"{name}={value!r}"), rule.message(config)
    if not integral:
        assert rule.refuses(with_value(name, math.nan))  # no range holds NaN


def test_a_row_reads_only_numbers_so_auto_and_none_pass_it():
    for name in ("cpu_threads", "rollout_tensor_parallel_size", "max_concurrent_sequences", "max_tokens_per_micro_batch"):
        assert first_refusal(RULES, with_value(name, "auto")) is None
    for name in ("num_train_epochs", "rm_head_learning_rate", "delta", "gradient_checkpointing_layers"):
        assert first_refusal(RULES, with_value(name, None)) is None


def test_check_raises_the_first_row_that_refuses():
    with pytest.raises(CohortError) as caught:  # beta's row comes first, rm_batch_size's last
        GRPOConfig(beta=-1.0, epsilon=0.0, rm_batch_size=0)
    assert str(caught.value) == "beta=-1.0 is negative; the KL coefficient must be ≥ 0"
    with pytest.raises(CohortError, match=r"^epsilon=0\.0 must lie in \(0, 1\)$"):
        GRPOConfig(epsilon=0.0, rm_batch_size=0)
    with pytest.raises(CohortError, match=r"^rm_batch_size=0 must be at least 1$"):
        GRPOConfig(rm_batch_size=0)
    unchecked = with_value("beta", -1.0)  # validate() refuses the same, for a config changed after it was built
    with pytest.raises(CohortError, match=r"^beta=-1\.0 is negative"):
        unchecked.validate()


@pytest.mark.parametrize("options, message", [
    ({"rollout_gpus": 2, "async_rollouts": True, "fsdp": True},
     "rollout_gpus=2 with fsdp is not supported (the samplers need whole weights from one rank); train the trainer "
     "ranks with DDP (leave out fsdp=True)"),
    ({"rollout_tensor_parallel_size": 2},
     "rollout_tensor_parallel_size=2 without rollout_gpus samples on the training ranks in groups, each rank "
     "keeping its shard of the model, which needs fsdp=True (the update's weights sharded too); pass fsdp=True, "
     "or rollout_gpus=K to sample on ranks of their own"),
    ({"rollout_tensor_parallel_size": 2, "fsdp": True, "async_rollouts": True, "max_staleness": 2},
     "async_rollouts with rollout_tensor_parallel_size=2 on the training ranks samples on the shard the trainer "
     "refreshes after each update, 1 update behind; pass max_staleness=1, or rollout_gpus=K to sample further "
     "ahead on ranks of their own"),
    ({"save_total_limit": 2, "max_consecutive_nonfinite": 0}, "max_consecutive_nonfinite=0 must be at least 1"),
    ({"rm_updates_per_step": -1}, "rm_updates_per_step=-1 must be ≥ 0"),
    ({"top_k": -2}, "top_k=-2: a negative count means nothing; pass top_k=0 (off) or more than 1"),
])
def test_combinations_name_the_values_and_the_fix(options, message):
    with pytest.raises(CohortError) as caught:
        GRPOConfig(**options).validate()
    assert str(caught.value) == message


def test_one_wording_of_a_refused_value():
    assert refusal("beta", -0.5, "is negative", "the KL coefficient must be ≥ 0") == (
        "beta=-0.5 is negative; the KL coefficient must be ≥ 0")
    assert refusal("num_generations", 1, ": GRPO needs 2") == "num_generations=1: GRPO needs 2"
    with pytest.raises(CohortError) as caught:
        choose("loss_type", "ppo2")
    assert str(caught.value) == "loss_type='ppo2' is not one of its values; pass grpo, bnpo, dapo or dr_grpo (loss_type)"


def test_true_and_false_as_strings_are_booleans_for_the_options_that_also_take_auto():
    """From Python or YAML "true" means what --name true means on the command line; "auto" stays auto."""
    from cohort_grpo.config.choices import CHOICES

    three_way = [name for name, values in CHOICES.items() if set(values) >= {"auto", "true", "false"}]
    assert {"gradient_checkpointing", "torch_compile", "partial_rollouts", "offload_optimizer"} <= set(three_way)
    for name in three_way:
        for text, value in (("true", True), ("False", False), ("TRUE", True)):
            options = {name: text, **({"async_rollouts": True, "rollout_gpus": 1} if name == "partial_rollouts" else {})}
            assert getattr(GRPOConfig(**options).validate(), name) is value, (name, text)
        assert getattr(GRPOConfig(**{name: "auto"}).validate(), name) == "auto"
