"""The update's `auto` speed options: what a bare config resolves to on each device and model."""

import dataclasses

import pytest
import torch

from cohort_grpo import GRPOConfig
from cohort_grpo.config.command_line import parse_config
from cohort_grpo.errors import CohortError, command_line
from cohort_grpo.plans.training_plan import StepShape, micro_batch_tokens
from cohort_grpo.models import CausalLM, ModelConfig
from cohort_grpo.update.fast_path import MICRO_BATCH_FLOP, fast_path_line, fast_path_settings

CPU, GPU = torch.device("cpu"), torch.device("cuda")


class OurModel(torch.nn.Module):
    def __init__(self, parameters: int = 1_000_000_000):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(parameters, device="meta"))  # counted, never allocated

    def compile_for_training(self):  # what marks cohort's own implementation
        raise AssertionError("resolving options must not compile anything")


class HFModel(torch.nn.Module):
    pass


def resolve_fast_path(args, model, device, **options):
    """`args` with the fast path's settings for `model` on `device` in place of its `auto`s."""
    return dataclasses.replace(args, **fast_path_settings(args, model, device, **options))


def test_a_bare_config_is_all_auto():
    config = GRPOConfig().validate()
    assert (config.torch_compile, config.gradient_checkpointing) == ("auto", "auto")
    assert config.max_tokens_per_micro_batch == "auto"


def test_cpu_turns_everything_off():
    args = resolve_fast_path(GRPOConfig().validate(), OurModel(), CPU, compiles=True)
    assert args.torch_compile is False and args.gradient_checkpointing is False
    assert args.gradient_checkpointing_layers is None and args.max_tokens_per_micro_batch == 0


def test_gpu_with_our_model_gets_the_measured_fast_path():
    args = resolve_fast_path(GRPOConfig().validate(), OurModel(), GPU, compiles=True)
    assert args.torch_compile is True and args.gradient_checkpointing is True
    # 1.1e14 FLOPs ÷ (6 × 1e9 parameters) = 18,333 tokens, down to a multiple of 256.
    assert MICRO_BATCH_FLOP == 1.1e14
    assert args.gradient_checkpointing_layers == "auto" and args.max_tokens_per_micro_batch == 18_176
    assert fast_path_line(args) == ("update: torch_compile on, gradient checkpointing only the layers the memory "
                                    "budget needs, micro-batches of 16 completions / 18,176 tokens")
    # A model 3× larger takes a third: 6,111 tokens, 5,888 in multiples of 256; a huge one still gets 1,024.
    assert resolve_fast_path(GRPOConfig().validate(), OurModel(3_000_000_000), GPU).max_tokens_per_micro_batch == 5_888
    assert resolve_fast_path(GRPOConfig().validate(), OurModel(10**11), GPU).max_tokens_per_micro_batch == 1_024


def test_a_mixture_of_experts_is_sized_by_the_weights_a_token_passes_through():
    """A token of a 7.2B-weight model routed to 8 of 64 experts does a 1.6B model's work: its micro-batches are
    that model's, not a dense 7.2B model's five times smaller ones (whose fixed host cost the GPU cannot hide)."""
    config = ModelConfig(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                         num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                         num_experts=64, num_experts_per_tok=8, moe_intermediate_size=1024, norm_topk_prob=True)
    with torch.device("meta"):
        model = CausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    experts = 16 * 64 * 3 * 2048 * 1024  # gate, up and down of every expert of every layer
    active = total - experts + experts * 8 // 64

    def auto_tokens(model):
        return resolve_fast_path(GRPOConfig().validate(), model, GPU, compiles=True).max_tokens_per_micro_batch

    # 1.1e14 ÷ (6 × 1.598e9) = 11,472 tokens, 11,264 in multiples of 256; all 7.23e9 weights would give 2,304.
    assert auto_tokens(model) == auto_tokens(OurModel(active)) == 11_264
    assert auto_tokens(OurModel(total)) == 2_304
    # The memory plan, from the config alone, counts the micro-batch the update will make.
    step = StepShape(rows=256, group=8, prompt_len=128, completion_len=512, micro_rows=256)
    assert micro_batch_tokens(config, step) == 11_264


def test_gpu_without_triton_or_under_fsdp_does_not_compile():
    assert resolve_fast_path(GRPOConfig().validate(), OurModel(), GPU, compiles=False).torch_compile is False
    assert resolve_fast_path(GRPOConfig(fsdp=True).validate(), OurModel(), GPU, compiles=True).torch_compile is False


def test_transformers_models_recompute_every_layer_as_trl():
    args = resolve_fast_path(GRPOConfig().validate(), HFModel(), GPU, compiles=True)
    assert args.torch_compile is False and args.gradient_checkpointing is True
    assert args.gradient_checkpointing_layers is None and args.max_tokens_per_micro_batch == 0


def test_explicit_values_are_kept():
    given = GRPOConfig(torch_compile=False, gradient_checkpointing=True, gradient_checkpointing_layers=3,
                       max_tokens_per_micro_batch=0).validate()
    assert fast_path_settings(given, OurModel(), GPU, compiles=True) == {}
    # A layer count given with checkpointing left at auto asks for checkpointing, on a CPU too.
    args = resolve_fast_path(GRPOConfig(gradient_checkpointing_layers=2).validate(), OurModel(), CPU)
    assert args.gradient_checkpointing is True and args.gradient_checkpointing_layers == 2
    # The budget alone goes with auto checkpointing.
    args = resolve_fast_path(GRPOConfig(max_memory_gib=30).validate(), OurModel(), GPU, compiles=True)
    assert args.gradient_checkpointing_layers == "auto" and args.max_memory_gib == 30


def test_command_line_values():
    config = parse_config(["--torch_compile", "auto", "--gradient_checkpointing", "false"])
    assert (config.torch_compile, config.gradient_checkpointing) == ("auto", False)
    assert parse_config(["--gradient_checkpointing", "AUTO"]).gradient_checkpointing == "auto"
    with pytest.raises(CohortError, match="torch_compile='sometimes' is not one of its values; pass auto, true or false"):
        GRPOConfig(torch_compile="sometimes").validate()
    with command_line(), pytest.raises(CohortError,
                                       match="--torch_compile expects auto, true or false, got 'sometimes'"):
        parse_config(["--torch_compile", "sometimes"])
    with pytest.raises(CohortError, match="only the budget of gradient_checkpointing_layers=auto"):
        GRPOConfig(gradient_checkpointing=True, max_memory_gib=30).validate()
    assert parse_config(["--max_tokens_per_micro_batch", "8192"]).max_tokens_per_micro_batch == 8192
    assert parse_config(["--max_tokens_per_micro_batch", "Auto"]).max_tokens_per_micro_batch == "auto"
    with command_line(), pytest.raises(
            CohortError, match="--max_tokens_per_micro_batch expects a whole number or auto, got 'lots'"):
        parse_config(["--max_tokens_per_micro_batch", "lots"])
    with pytest.raises(CohortError, match="max_tokens_per_micro_batch='lots' is not one of its values; pass a whole number or auto"):
        GRPOConfig(max_tokens_per_micro_batch="lots").validate()
    with pytest.raises(CohortError, match="max_tokens_per_micro_batch=-1 is negative"):
        GRPOConfig(max_tokens_per_micro_batch=-1).validate()


def test_the_trainer_runs_with_the_resolved_options(tiny_dir, tmp_path):
    from helpers import update_trainer

    trainer = update_trainer(tiny_dir, tmp_path, device="cpu")
    assert trainer.args.torch_compile is False and trainer.args.gradient_checkpointing is False
    assert not trainer.model.gradient_checkpointing
    checkpointed = update_trainer(tiny_dir, tmp_path / "c", device="cpu", gradient_checkpointing_layers=1)
    assert checkpointed.model.gradient_checkpointing and checkpointed.model.checkpointed_layers == 1
