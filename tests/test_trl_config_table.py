"""docs/howto/from-trl.md's table of TRL's `GRPOConfig` fields against TRL 1.16 and cohort's `GRPOConfig`.

Every field TRL 1.16's `GRPOConfig` declares (and the `TrainingArguments` defaults it overrides) has a
row; every cohort name a row gives is an option; each row's status is one of the page's words; a
"same" row's default is TRL's and a "default differs" row's is not; a TRL name the page says cohort
accepts as an alias sets cohort's field.

TRL's field list is kept here as a literal (CI has no TRL). Where TRL's source is at hand
(/tmp/trl, or the folder in $TRL_SOURCE, holding trl/trainer/grpo_config.py), the literal is checked
against it with `ast`, so a TRL upgrade that adds, drops or re-defaults a field fails here.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from pathlib import Path

import pytest

from cohort_grpo.config.grpo_config import GRPOConfig

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "howto" / "from-trl.md"
TRL_CONFIG = Path(os.environ.get("TRL_SOURCE", "/tmp/trl")) / "trl" / "trainer" / "grpo_config.py"
FIELDS = {f.name: f for f in dataclasses.fields(GRPOConfig)}
STATUSES = ("same", "default differs", "meaning differs", "different name", "not supported")

# TRL 1.16's GRPOConfig: every declared field with its default (trl/trainer/grpo_config.py).
TRL_FIELDS = {
    "learning_rate": 1e-06, "model_init_kwargs": None, "trust_remote_code": False, "router_aux_loss_coef": None,
    "disable_dropout": False, "cast_lm_head_to_fp32": False, "remove_unused_columns": False, "num_generations": 8,
    "num_generations_eval": None, "max_completion_length": 512, "ds3_gather_for_generation": True,
    "shuffle_dataset": True, "pad_to_multiple_of": "auto", "generation_batch_size": None,
    "steps_per_generation": None, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None,
    "generation_kwargs": None, "chat_template_kwargs": None, "repetition_penalty": 1.0,
    "cache_implementation": None, "use_vllm": False, "vllm_mode": "colocate", "vllm_model_impl": "vllm",
    "vllm_enable_sleep_mode": False, "vllm_structured_outputs_regex": None, "vllm_server_base_url": None,
    "vllm_server_host": "0.0.0.0", "vllm_server_port": 8000, "vllm_server_timeout": 240.0, "vllm_group_port": 51216,
    "vllm_gpu_memory_utilization": 0.3, "vllm_max_model_length": None, "vllm_tensor_parallel_size": 1, "beta": 0.0,
    "num_iterations": 1, "epsilon": 0.2, "delta": None, "epsilon_high": None, "sapo_temperature_neg": 1.05,
    "sapo_temperature_pos": 1.0, "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0, "importance_sampling_level": "token", "reward_weights": None,
    "multi_objective_aggregation": "sum_then_normalize", "scale_rewards": "group", "loss_type": "dapo",
    "mask_truncated_completions": False, "sync_ref_model": False, "ref_model_mixup_alpha": 0.6,
    "ref_model_sync_steps": 512, "top_entropy_quantile": 1.0, "entropy_coef": 0.0, "use_adaptive_entropy": False,
    "entropy_coef_min": 0.0, "entropy_coef_max": 1.0, "entropy_coef_delta": 0.005, "entropy_target": 0.2,
    "max_tool_calling_iterations": None, "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_max": 3.0,
    "vllm_importance_sampling_clip_min": None, "off_policy_mask_threshold": None, "use_bias_correction_kl": True,
    "log_completions": False, "log_multimodal": True, "num_completions_to_print": None, "log_unique_prompts": False,
    "log_completions_hub_repo": None, "use_transformers_continuous_batching": False,
    "transformers_continuous_batching_config": None, "use_transformers_paged": False,
    "vllm_importance_sampling_cap": None,
}

# TrainingArguments fields whose defaults TRL 1.16's GRPOConfig overrides (its docstring's note), besides
# learning_rate, which it declares.
TRL_OVERRIDES = {"logging_steps": 10, "gradient_checkpointing": True, "bf16": True}
# Defaults that are written differently but mean the same.
EQUIVALENT_DEFAULTS = {"min_p": (None, 0.0)}  # off
# A value other than the default for each TRL name cohort accepts as an alias, to check it takes effect.
ALIAS_VALUES = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_mask",
                "vllm_importance_sampling_clip_max": 2.5, "vllm_importance_sampling_clip_min": 0.5,
                "vllm_importance_sampling_cap": 2.5}


@dataclasses.dataclass
class Row:
    section: str
    trl: str
    cohort: list[str]
    status: str


def rows() -> list[Row]:
    text = PAGE.read_text(encoding="utf-8")
    out = []
    for heading in ("## The same names", "## Different names, or no equivalent"):
        assert heading in text, f"{PAGE.name} lost its section {heading!r}"
        section = text.split(heading, 1)[1].split("\n## ", 1)[0]
        for line in section.splitlines():
            if not line.startswith("| `"):
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            assert len(cells) == 3, f"a row of {heading!r} needs three cells (TRL, cohort, status): {line}"
            names = re.findall(r"`(\w+)`", cells[0])
            assert len(names) == 1, f"a row names one TRL field: {line}"
            out.append(Row(heading, names[0], re.findall(r"`([a-z_0-9]+)`", cells[1]), cells[2]))
    return out


def default(name: str):
    f = FIELDS[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def trl_source_fields() -> tuple[dict, dict]:
    """(declared fields → defaults, overridden TrainingArguments fields → defaults) from TRL's source."""
    tree = ast.parse(TRL_CONFIG.read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GRPOConfig"]
    declared = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            value = node.value
            if isinstance(value, ast.Call):  # field(default=..., metadata=...)
                keywords = {k.arg: k.value for k in value.keywords}
                declared[node.target.id] = ast.literal_eval(keywords["default"]) if "default" in keywords else None
            else:
                declared[node.target.id] = None if value is None else ast.literal_eval(value)
    note = ast.get_docstring(cls).split("default values different from", 1)[1]
    overrides = {}
    for name, text in re.findall(r"- `(\w+)`: Defaults to `?([^`\s]+)`?", note):
        overrides[name] = ast.literal_eval(text) if name != "bf16" else True  # bf16: "True if fp16 is not set"
    return declared, overrides


# ---- against TRL's own source, where it is at hand --------------------------------------------------

@pytest.mark.skipif(not TRL_CONFIG.is_file(),
                    reason=f"TRL's source is not at {TRL_CONFIG} (set TRL_SOURCE to a TRL checkout to check the "
                           "embedded field list against it); the embedded TRL 1.16 list is checked below")
def test_embedded_list_is_trl_source():
    declared, overrides = trl_source_fields()
    assert sorted(declared) == sorted(TRL_FIELDS), (
        f"TRL declares {sorted(set(declared) - set(TRL_FIELDS))} that the literal lacks, and the literal has "
        f"{sorted(set(TRL_FIELDS) - set(declared))} that TRL does not")
    assert declared == TRL_FIELDS
    assert {k: v for k, v in overrides.items() if k != "learning_rate"} == TRL_OVERRIDES
    assert overrides["learning_rate"] == TRL_FIELDS["learning_rate"]


# ---- the page against the list and against cohort ----------------------------------------------------

def test_every_trl_field_has_a_row():
    listed = [row.trl for row in rows()]
    duplicates = sorted({n for n in listed if listed.count(n) > 1})
    assert not duplicates, f"{PAGE.name} lists these TRL fields twice: {duplicates}"
    missing = sorted((set(TRL_FIELDS) | set(TRL_OVERRIDES)) - set(listed))
    assert not missing, f"{PAGE.name} has no row for TRL's {missing}"


def test_every_status_is_one_of_the_words():
    for row in rows():
        assert row.status.startswith(STATUSES), f"{row.trl}: status {row.status!r} starts with none of {STATUSES}"


def test_cohort_names_are_options():
    for row in rows():
        unknown = [n for n in row.cohort if n not in FIELDS]
        assert not unknown, f"{row.trl}: {unknown} are not GRPOConfig fields"
        if not row.status.startswith("not supported"):
            assert row.cohort, f"{row.trl}: a {row.status.split(':')[0]!r} row must name cohort's field"


def test_same_name_rows_name_the_same_field():
    for row in rows():
        same_name = row.status.startswith(("same", "default differs", "meaning differs"))
        assert same_name == (row.section == "## The same names"), (
            f"{row.trl}: a {row.status.split(':')[0]!r} row belongs in the other section")
        if same_name:
            assert row.cohort == [row.trl], f"{row.trl}: the same-name row names {row.cohort}"
        elif row.status.startswith("different name"):
            assert row.trl not in row.cohort


def test_defaults_are_as_the_status_says():
    trl_defaults = {**TRL_FIELDS, **TRL_OVERRIDES}
    checked = 0
    for row in rows():
        if row.trl not in trl_defaults or not row.cohort:
            continue
        theirs, ours = trl_defaults[row.trl], default(row.cohort[0])
        equal = theirs == ours or EQUIVALENT_DEFAULTS.get(row.trl) == (theirs, ours)
        if row.status.startswith("same") or "the same default" in row.status:
            assert equal, f"{row.trl}: the page says same, but TRL's default is {theirs!r} and cohort's {ours!r}"
            checked += 1
        elif "default differs" in row.status:
            assert not equal, f"{row.trl}: the page says the default differs, but both are {ours!r}"
            checked += 1
    assert checked >= 20


def test_trl_aliases_set_cohorts_field():
    aliases = [row for row in rows() if "alias" in row.status]
    assert {row.trl for row in aliases} == set(ALIAS_VALUES)
    for row in aliases:
        assert row.trl in FIELDS, f"{row.trl}: the page says cohort accepts it, but it is no GRPOConfig field"
        config = GRPOConfig(**{row.trl: ALIAS_VALUES[row.trl]}).validate()
        assert getattr(config, row.cohort[0]) == ALIAS_VALUES[row.trl], row.trl


def test_trl_booleans_for_scale_rewards():
    """The scale_rewards row promises TRL's booleans."""
    assert GRPOConfig(scale_rewards=True).validate().scale_rewards == "group"
    assert GRPOConfig(scale_rewards=False).validate().scale_rewards == "none"
