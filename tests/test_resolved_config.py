"""The run's configuration is settled once: the caller's `GRPOConfig` is never changed, the trainer's resolved
config refuses changes and every stage reads it, `--print_config` prints it with every `auto` settled (a YAML
that `--config` reads back to the same run), and the one table of option values drives validation, `--help` and
docs/reference.md."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import yaml

from cohort_grpo.trainer.grpo_trainer import GRPOTrainer
from cohort_grpo.config.choices import AUTO_OPTIONS, CHOICES
from cohort_grpo.cli import main
from cohort_grpo.config.grpo_config import GRPOConfig
from cohort_grpo.config.command_line import config_help, parse_config
from cohort_grpo.errors import CohortError
from cohort_grpo.parallel.placement import Placement
from cohort_grpo.run.resolve import resolve_run_config

ROOT = Path(__file__).resolve().parents[1]
ROWS = [{"prompt": f"{a}+{b}=?"} for a in range(4) for b in range(4)]


def length_reward(prompts, completions, **_):
    return [float(len(c)) for c in completions]


def small(tmp_path, **options) -> GRPOConfig:
    return GRPOConfig(num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                      max_completion_length=4, max_steps=1, output_dir=str(tmp_path / "run"), quiet=True,
                      device="cpu", **options)


def test_building_a_trainer_leaves_the_callers_config_as_it_was(tiny_dir, tmp_path):
    # TRL's spellings (a boolean scale_rewards, a vllm_* name) and unset values are what resolution rewrites.
    args = small(tmp_path, scale_rewards=True, vllm_importance_sampling_cap=2.0)
    asked = dataclasses.asdict(args)
    trainer = GRPOTrainer(tiny_dir, length_reward, ROWS, args=args, log=lambda *_: None)
    assert dataclasses.asdict(args) == asked and not args.frozen
    used = trainer.args
    assert (used.scale_rewards, used.importance_sampling_clip_max, used.vllm_importance_sampling_cap) == ("group", 2.0, None)
    assert used.task == "arithmetic" and used.max_staleness == 1 and used.torch_compile is False
    # the same config builds a second trainer to the same resolved values
    again = GRPOTrainer(tiny_dir, length_reward, ROWS, args=args, log=lambda *_: None)
    assert again.args == used and dataclasses.asdict(args) == asked


def test_the_resolved_config_refuses_changes_and_every_stage_reads_it(tiny_dir, tmp_path):
    trainer = GRPOTrainer(tiny_dir, length_reward, ROWS, args=small(tmp_path), log=lambda *_: None)
    with pytest.raises(CohortError, match=r"^cannot set beta: a trainer's resolved config is read-only; set it on "):
        trainer.args.beta = 0.5
    assert trainer.args.beta == 0.0
    for stage in (trainer.policy_update, trainer.memory, trainer.group_sampler):
        assert stage.args is trainer.args
    copy = dataclasses.replace(trainer.args, beta=0.5)  # a mutable copy to build another run from
    copy.max_steps = 3
    assert (copy.beta, copy.max_steps, trainer.args.max_steps) == (0.5, 3, 1)


def test_resolution_needs_the_model_and_device():
    model = torch.nn.Linear(2, 2)  # not one of cohort's models: Hugging Face generate samples it
    resolved = resolve_run_config(GRPOConfig(), model=model, device=torch.device("cpu"))
    assert resolved.frozen and resolved.model_impl == "hf" and resolved.dtype == "float32"
    assert resolved.optimizer_state_dtype == "float32" and resolved.gradient_checkpointing is False
    model.to(torch.bfloat16)
    assert resolve_run_config(GRPOConfig(), model=model, device=torch.device("cpu")).optimizer_state_dtype == "bfloat16"
    partial = GRPOConfig(partial_rollouts=True, async_rollouts=True, rollout_gpus=1)
    with pytest.raises(CohortError, match="partial_rollouts needs cohort's engine"):
        resolve_run_config(partial, model=model, device=torch.device("cpu"),
                           placement=Placement.from_config(partial.validate(), 2))


def printed_config(capsys, *argv) -> str:
    assert main(["train", *argv, "--print_config"]) == 0
    return capsys.readouterr().out


def test_print_config_settles_every_auto_and_round_trips_through_config(tiny_dir, tmp_path, capsys):
    out = printed_config(capsys, "--model", tiny_dir, "--device", "cpu", "--max_steps", "1",
                         "--output_dir", str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # printed, not trained: the folder the build made is gone
    values = yaml.safe_load(out)
    assert set(values) == {f.name for f in dataclasses.fields(GRPOConfig)}
    assert [name for name, value in values.items() if value == "auto"] == []
    assert {name for name in AUTO_OPTIONS if values[name] is None} <= {"gradient_checkpointing_layers"}
    assert (values["device"], values["dtype"], values["model_impl"]) == ("cpu", "float32", "cohort")
    assert "# default, resolved from auto" in next(line for line in out.splitlines() if line.startswith("torch_compile:"))
    saved = tmp_path / "printed.yaml"
    saved.write_text(out)
    parsed = parse_config(["--config", str(saved)])
    assert parsed.to_dict() == values
    # the printed values are a fixed point: a run of them resolves to them, and prints them again
    trainer = GRPOTrainer(tiny_dir, length_reward, ROWS, args=parsed, log=lambda *_: None)
    assert trainer.args.to_dict() == values
    assert yaml.safe_load(printed_config(capsys, "--config", str(saved))) == values


def test_print_config_keeps_stdout_yaml_alone(tiny_dir, tmp_path, capsys):
    out = printed_config(capsys, "--model", tiny_dir, "--device", "cpu", "--output_dir", str(tmp_path / "run"))
    assert all(line.startswith("#") or ":" in line for line in out.splitlines())
    assert isinstance(yaml.safe_load(out), dict)


def reference_page() -> str:
    spec = importlib.util.spec_from_file_location("generate_reference", ROOT / "docs" / "generate_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("generate_reference", module)
    spec.loader.exec_module(module)
    return module.render()


def test_one_table_drives_validation_help_and_the_reference(monkeypatch):
    monkeypatch.setitem(CHOICES, "loss_type", (*CHOICES["loss_type"], "grpo_plus"))
    assert GRPOConfig(loss_type="grpo_plus").validate().loss_type == "grpo_plus"
    with pytest.raises(CohortError, match=r"^loss_type='nope' is not one of its values; pass grpo, bnpo, dapo, "
                                          r"dr_grpo or grpo_plus \(loss_type\)$"):
        GRPOConfig(loss_type="nope").validate()
    assert "--loss_type {grpo,bnpo,dapo,dr_grpo,grpo_plus}" in config_help()
    (row,) = [line for line in reference_page().splitlines() if line.startswith("| `loss_type` |")]
    assert "`grpo`, `bnpo`, `dapo`, `dr_grpo`, `grpo_plus`" in row


def test_every_table_entry_refuses_what_it_does_not_list():
    needs = {"partial_rollouts": dict(async_rollouts=True, rollout_gpus=1),  # what `true` needs beside it
             "rollout_tensor_parallel_size": dict(fsdp=True)}  # a split without sampling ranks: the colocated one
    for name, values in CHOICES.items():
        for value in values:  # each listed spelling (a pattern by an instance of it) is accepted
            given = {"N": 3, "cuda:N": "cuda:1", "true": True, "false": False}.get(value, value)
            GRPOConfig(**{name: given}, **needs.get(name, {})).validate()
        with pytest.raises(CohortError, match=rf"^{name}='unlisted' is not one of its values; pass "):
            GRPOConfig(**{name: "unlisted"}).validate()
